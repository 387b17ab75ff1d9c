"""Layer assignment and the inter-op search: invariants of emitted plans.

One small zoo GPT (4 blocks, no biases, plain SGD: the fewest operators per
block) is captured once; each cluster's ``StageCostModel`` shares one ILP
solution cache, so the local 1x4 and 2x2 clusters (same links) solve each
layer once. Plans are checked against the rules every plan must follow
(contiguous stages covering all layers once, submeshes tiling the cluster,
memory within the budget, Alpa eq. 2), not against hand-picked answers.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from alpa_torch.capture import capture
from alpa_torch.core.cluster import Cluster
from alpa_torch.core.errors import BatchSplitError, InfeasibleMemoryError, PlanError
from alpa_torch.core.options import PlanOptions
from alpa_torch.core.plan import ParallelPlan, tile_submeshes
from alpa_torch.core.schedule import schedule_named
from alpa_torch.zoo import GPT, GPTConfig, _lm_batch, train_step
from stage_dp import assign_layers, search
from stage_dp.checkpointing import Checkpointing
from stage_dp.search import plan, planned_submeshes
from stage_dp.stage_costs import StageCostModel
from stage_dp.tables import step_time, tied_spans

CLUSTERS = {
    "local1x4": lambda: Cluster.local(1, 4),
    "local2x2": lambda: Cluster.local(2, 2),
    "v100_2x8": lambda: Cluster.simulated(2, 8, device="v100-16gb", intra="nvlink2", inter="eth-25g"),
}


def _capture(cfg: GPTConfig, step=train_step):
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return capture(step, model, opt, _lm_batch(cfg.vocab_size, 8, torch.Generator().manual_seed(0)))


@pytest.fixture(scope="module")
def graph():
    return _capture(GPTConfig.small(bias=False))


@pytest.fixture(scope="module")
def layers(graph):
    return assign_layers(graph, 4)


@pytest.fixture(scope="module")
def models(graph, layers):
    cache: dict = {}
    return {name: StageCostModel(graph, make(), layers, solution_cache=cache) for name, make in CLUSTERS.items()}


# ------------------------------------------------------------------ layering
def test_every_node_gets_a_layer_forward_contiguous_backward_monotone(graph, layers):
    names = [n.name for n in graph.gm.graph.nodes if n.op in ("placeholder", "call_function")]
    assert set(layers.layer_of) == set(names)
    fwd = [layers.layer_of[n] for n, v in graph.nodes.items() if v.phase == "forward"]
    assert fwd == sorted(fwd) and set(fwd) == set(range(4))
    for name, node in graph.nodes.items():
        if node.phase == "backward":
            for u in node.inputs:
                if u in graph.nodes and graph.nodes[u].phase == "backward":
                    assert layers.layer_of[u] >= layers.layer_of[name], (u, name)
    assert not layers.update_crosses_layers
    assert layers.boundary_bytes[0] == 0 and min(layers.boundary_bytes[1:]) > 0


def test_gpt_blocks_land_one_per_layer(graph, layers):
    for s in graph.inputs:
        if s.kind == "param" and s.name.startswith("blocks."):
            assert layers.layer_of[s.node] == int(s.name.split(".")[1]), s.name
    by_module = assign_layers(graph, boundaries_by_module="blocks")
    assert by_module.num_layers == 4 and by_module.method == "modules"
    assert assign_layers(graph).num_layers == 4  # default: one layer per 6 matmuls


def test_default_layers_are_balanced():
    """No layer of FLOP-free operators (the loss's scalar tail crosses fewer bytes than a block
    boundary, so clustering by bytes alone made two such layers of the deep GPT's 8 and left the
    others up to 1.5x the mean: a pipeline could not be balanced on them)."""
    g = _capture(GPTConfig.deep(bias=False, vocab_size=256))
    a = assign_layers(g)
    assert a.num_layers == 8
    mean = sum(a.forward_flops) / a.num_layers
    assert 0.5 * mean <= min(a.forward_flops) and max(a.forward_flops) <= 1.5 * mean, a.forward_flops


def test_layers_cut_between_repeated_blocks():
    """A stack of blocks (``blocks.<i>``) is cut between whole blocks, evenly: the middle
    layers repeat, so the stage costs solve one ILP for all of them (LLaMA-3-8B's 16
    layers cut by operator had 7 distinct signatures, half the cuts inside a block)."""
    from stage_dp.layer_assign import LayerSignatures

    g = _capture(GPTConfig.deep(bias=False, vocab_size=256))
    a = assign_layers(g, 4)
    assert a.method == "blocks"
    forward = [n for n, v in g.nodes.items() if v.phase == "forward"]
    firsts = [next(n for n in forward if a.layer_of[n] == l) for l in range(4)]
    blocks = {s.node: s.name.split(".")[1] for s in g.inputs if s.kind == "param" and s.name.startswith("blocks.")}
    for l, first in enumerate(firsts[1:], 1):  # each later layer opens with a block: 2 blocks per layer
        read = {blocks[u] for u in g.nodes[first].inputs if u in blocks}
        assert read == {str(2 * l)}, (l, first, read)
    assert LayerSignatures(g, a).num_distinct == 3  # first (embeddings), the two middle ones, last (head)


@pytest.mark.parametrize("seed", range(20))
def test_even_cuts_match_brute_force(seed):
    import itertools

    import numpy as np

    from stage_dp.layer_assign import _least_squares_cuts

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    k = int(rng.integers(1, n + 1))
    flops = rng.integers(1, 5, n).astype(float)
    mean = flops.sum() / k

    def cost(cuts):
        edges = list(cuts) + [n]
        return sum((flops[a:b].sum() - mean) ** 2 for a, b in zip(edges, edges[1:]))

    best = min(cost((0, *c)) for c in itertools.combinations(range(1, n), k - 1))
    got = _least_squares_cuts(flops, k)
    assert got[0] == 0 and len(got) == k and all(np.diff(got) > 0) and got[-1] < n
    assert math.isclose(cost(got), best, rel_tol=1e-9, abs_tol=1e-9)


def test_even_cuts_prefer_a_regular_cut():
    """Where the evenest cut puts its odd layer inside the stack, an as-even cut with the same
    count in every middle layer is taken (one distinct middle layer, so fewer ILPs); where the
    regular cut is much less even, the evenest one stays."""
    import numpy as np

    from stage_dp.layer_assign import REGULAR_SLACK, _even_cuts, _least_squares_cuts, _sse

    # LLaMA-like: 20 equal blocks, the first with (nearly free) embeddings, the last with a head of ~1 block
    flops = np.array([1.001] + [1.0] * 18 + [2.1])
    least, got = _least_squares_cuts(flops, 5), _even_cuts(flops, 5)
    assert len(set(np.diff(least)[1:])) > 1, least  # the evenest cut alone has two kinds of middle layer
    inner = np.diff(got)[1:]  # blocks per layer, the second to the fourth
    assert (inner == inner[0]).all(), got
    assert _sse(flops, got) <= _sse(flops, least) * (1 + REGULAR_SLACK)
    # in 6 layers the best regular cut is more than twice as uneven: the evenest stays
    assert list(_even_cuts(flops, 6)) == list(_least_squares_cuts(flops, 6))


def test_global_norm_clip_crosses_layers():
    def clipped_step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = model.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    g = _capture(GPTConfig.tiny(bias=False), clipped_step)
    a = assign_layers(g, 2)
    assert a.update_crosses_layers
    assert all(a.layer_of[s.node] in (0, 1) for s in g.outputs if s.kind == "param")


# ------------------------------------------------------------------ plans
def _check_invariants(p: ParallelPlan, graph, cluster):
    p.validate(graph, cluster)
    assert [s.layer_start for s in p.stages] == [0] + [s.layer_end + 1 for s in p.stages[:-1]]
    assert p.stages[-1].layer_end == p.num_layers - 1
    ids = sorted(d for s in p.stages for d in s.device_ids)
    assert ids == list(range(cluster.num_devices))
    assert p.peak_memory_bytes <= p.memory_budget_bytes
    assert all(s.memory_bytes <= p.memory_budget_bytes for s in p.stages)
    times = [s.time_s for s in p.stages]
    assert p.predicted_step_s == pytest.approx(schedule_named(p.schedule).step_time(times, p.num_microbatches))
    if p.schedule in ("gpipe", "1f1b"):  # Alpa eq. 2
        assert p.predicted_step_s == pytest.approx(sum(times) + (p.num_microbatches - 1) * max(times))
    assert p.predicted_step_s == pytest.approx(p.compute_s + p.communication_s + p.bubble_s)
    assert set(p.stage_nodes(0)) | set().union(*(p.stage_nodes(k) for k in range(len(p.stages)))) \
        == set(p.layer_of)


@pytest.mark.parametrize("name", list(CLUSTERS))
def test_plan_invariants(graph, models, name):
    model = models[name]
    p = plan(graph, model.cluster, cost_model=model)
    _check_invariants(p, graph, model.cluster)
    assert p.options["distinct_layers"] == 3  # first block+embeddings, middle blocks, last block+head
    text = p.table()
    assert "stage" in text and f"{p.stages[0].layer_start}-{p.stages[0].layer_end}" in text


def test_forced_options(graph, models):
    model = models["local1x4"]
    cl = model.cluster
    two = plan(graph, cl, cost_model=model, num_stages=2)
    assert len(two.stages) == 2
    one = plan(graph, cl, cost_model=model, pipeline=False)
    assert len(one.stages) == 1 and one.stages[0].submesh == (1, 4)
    four = plan(graph, cl, cost_model=model, num_microbatches=4)
    assert four.num_microbatches == 4
    halves = plan(graph, cl, cost_model=model, submesh=(1, 2))
    assert [s.submesh for s in halves.stages] == [(1, 2), (1, 2)]
    gpipe = plan(graph, cl, cost_model=model, schedule="gpipe", num_microbatches=8)
    assert all(s.in_flight == 8 for s in gpipe.stages)
    one_f_one_b = plan(graph, cl, cost_model=model, num_microbatches=8, num_stages=2)
    zero_bubble = plan(graph, cl, cost_model=model, schedule="zb-h1", num_microbatches=8, num_stages=2)
    assert zero_bubble.predicted_step_s < one_f_one_b.predicted_step_s  # a third of the bubble
    for p in (two, one, four, halves, gpipe, zero_bubble):
        _check_invariants(p, graph, cl)
    with pytest.raises(BatchSplitError, match="does not divide"):
        plan(graph, cl, cost_model=model, num_microbatches=3)
    with pytest.raises(PlanError, match="one stage"):
        plan(graph, cl, cost_model=model, pipeline=False, num_stages=2)


def test_one_stage_search_prices_only_the_whole_cluster(graph, layers, models):
    """pipeline=False builds its cost model over the whole cluster's submesh alone, and plans
    what the search over every submesh plans with pipelining off."""
    cl = models["v100_2x8"].cluster
    lone = plan(graph, cl, layers=layers, pipeline=False)
    assert lone.options["num_ilps"] <= 3 * len(cl.logical_mesh_shapes((2, 8)))  # 3 distinct layers
    everywhere = plan(graph, cl, cost_model=models["v100_2x8"], pipeline=False)
    assert lone.summary() == everywhere.summary()
    assert lone.predicted_step_s == pytest.approx(everywhere.predicted_step_s, rel=1e-12)
    forced = StageCostModel(graph, cl, layers, submeshes=planned_submeshes(cl, PlanOptions(submesh=(1, 4))))
    assert {c.submesh for c in forced.configs} == {(1, 4)}
    with pytest.raises(ValueError, match="not all among"):
        StageCostModel(graph, cl, layers, submeshes=[(3, 8)])


def test_tightening_the_memory_rule_reuses_every_ilp(graph, layers):
    """The refits of ``_fitting`` only tighten the DP's rule: the lean layer caps stay those of
    the device's budget, so no ILP is solved again (a tighter rule may make the search solve
    lean ILPs it had not needed; planning under the same rules again solves nothing)."""
    cl = Cluster.simulated(2, 8, device="v100-16gb", intra="nvlink2", inter="eth-25g")
    model = StageCostModel(graph, cl, layers)
    budget = 2e6  # bytes: tight enough that some layers get lean columns
    args = (model, [1, 2, 4, 8], "1f1b", 1 / 8, None, None, True, True, Checkpointing.parse("auto"), lambda m: None)
    assert any(cfg.variant == "lean" for cols in search.candidate_columns(model, model.configs, budget, 1 / 8,
                                                                          lean_all=False) for cfg in cols)
    for rule in (budget, 0.97 * budget, 0.9 * budget):
        search._fitting_search(*args, rule, cap_budget=budget)
    solved = model.num_ilps
    for rule in (budget, 0.97 * budget, 0.9 * budget):
        search._fitting_search(*args, rule, cap_budget=budget)
    assert model.num_ilps == solved


@pytest.mark.sweep  # 40-90 s each on 2 cores
@pytest.mark.parametrize("budget", [5e5, 8e5])
def test_lean_ilps_are_solved_only_where_the_best_plan_needs_them(graph, layers, budget):
    """The search prices unsolved lean columns by lower bounds and solves the lean ILPs of the
    stages the best plan puts on them, until its stages are all priced exactly: the same plan
    as with every lean ILP solved first, from no more ILPs (fewer where some lean column is
    never taken). Budgets where the plan has lean stages."""
    cl = Cluster.simulated(2, 8, device="v100-16gb", intra="nvlink2", inter="eth-25g")
    ckpt, candidates = Checkpointing.parse("auto"), [1, 2, 4, 8]
    lazy, eager = StageCostModel(graph, cl, layers), StageCostModel(graph, cl, layers)
    res, tables, _ = search._fitting_search(lazy, candidates, "1f1b", 1 / 8, None, None, True, True, ckpt,
                                            lambda m: None, budget, cap_budget=budget)
    columns = search.with_recompute(search.candidate_columns(eager, eager.configs, budget, 1 / 8, lean_all=False),
                                    ckpt)
    res_all, tables_all = search._search(eager, columns, candidates, budget, "1f1b", 1 / 8, None, None, True)

    def shape(r, t):
        return [(i, j, t.columns[s][c].submesh, t.columns[s][c].logical_shape, t.columns[s][c].variant)
                for i, j, s, c in r.stages]

    assert shape(res, tables) == shape(res_all, tables_all)
    assert any(variant == "lean" for *_, variant in shape(res, tables))
    assert step_time(tables, res.stages) == pytest.approx(step_time(tables_all, res_all.stages),
                                                                 rel=1e-12)
    assert not any(tables.columns[s][c].bound and not lazy.solved(l, tables.columns[s][c], 1 / 8)
                   for i, j, s, c in res.stages for l in range(i, j + 1))
    assert lazy.num_ilps <= eager.num_ilps
    if budget == 1e6:
        assert lazy.num_ilps < eager.num_ilps


def test_a_plan_above_its_simulated_budget_is_not_planned_again(graph, models):
    """``_fitting``'s first cut goes below what the rule counted for the plan that simulated
    too high, so the DP cannot admit it again: one re-plan where the rule's figure for
    the plan sits below the rule's budget (cutting the budget alone admitted it again)."""
    p = plan(graph, models["local1x4"].cluster, cost_model=models["local1x4"])
    counted = search._rule_bytes(p)
    budget, calls = 2.0 * counted, []

    def planned(rule):  # the DP's choice: the plan while the rule admits it, then a fitting one
        calls.append(rule)
        fits = rule < counted
        return dataclasses.replace(p, peak_memory_bytes=(0.5 if fits else 1.1) * budget)

    assert search._fitting(planned, budget).peak_memory_bytes <= budget
    assert len(calls) == 2 and calls[1] < counted


def _without_timings(p: ParallelPlan) -> dict:
    d = p.to_dict()
    for key in ("plan_s", "ilp_s"):
        d["options"].pop(key)
    for s in d["stages"]:
        s["sharding"].pop("build_s"), s["sharding"].pop("solve_s")
    return d


def test_same_inputs_same_plan_and_data_parallel_only(graph, layers):
    cl = Cluster.local(1, 2)
    first = plan(graph, cl, layers=layers)
    again = plan(graph, cl, layers=layers)
    assert _without_timings(first) == _without_timings(again)
    dp_only = plan(graph, cl, layers=layers, sharding=False)
    _check_invariants(dp_only, graph, cl)
    assert all(s.logical_mesh[1] == 1 for s in dp_only.stages)


def test_json_round_trip_is_exact(graph, models, tmp_path):
    model = models["v100_2x8"]
    p = plan(graph, model.cluster, cost_model=model)
    p.to_json(tmp_path / "plan.json")
    back = ParallelPlan.from_json(tmp_path / "plan.json")
    assert back == p
    back.validate(graph, model.cluster)


def test_validate_rejects_broken_plans(graph, models):
    model = models["local1x4"]
    p = plan(graph, model.cluster, cost_model=model, num_stages=2)
    a, b = p.stages
    with pytest.raises(PlanError, match="contiguously"):
        dataclasses.replace(p, stages=(a, dataclasses.replace(b, layer_start=b.layer_start + 1))) \
            .validate(graph, model.cluster)
    with pytest.raises(PlanError, match="tile|reuses|not the|submesh"):
        dataclasses.replace(p, stages=(a, dataclasses.replace(b, device_ids=a.device_ids))) \
            .validate(graph, model.cluster)
    with pytest.raises(PlanError, match="another graph"):
        dataclasses.replace(p, graph_fingerprint="0" * 16).validate(graph, model.cluster)
    with pytest.raises(PlanError, match="cluster"):
        p.validate(graph, Cluster.local(1, 2))


def test_too_big_for_the_cluster_says_how_much_memory(graph, layers):
    budget = 200_000.0  # bytes per device; the model needs ~1-2 MB
    cl = Cluster.local(1, 2, memory_bytes=budget)
    with pytest.raises(InfeasibleMemoryError) as info:
        plan(graph, cl, layers=layers)
    need = info.value.required_bytes
    assert need > budget and math.isfinite(need)
    assert f"{need / 2**30:.3f} GiB" in str(info.value) and "Remedies" in str(info.value)
    fits = plan(graph, cl, layers=layers, memory_budget_bytes=need * 1.01)
    # feasibility is the DP's rule; the reported peak (memory_sim) may exceed it
    assert max(s.persistent_bytes + s.in_flight * s.activation_bytes for s in fits.stages) <= need * 1.01


def _mlp_step(model, optimizer, batch):
    x, y = batch
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def test_no_stage_starts_inside_a_tied_weight_span(graph, layers):
    """A weight read by layers 1 and 2 (tied) keeps them in one stage: the pipeline runtime
    refuses a parameter used by several stages, so the stage DP never cuts at layer 2."""
    from alpa_torch.core.partition import partition, stage_of_nodes

    assert tied_spans(graph, layers.layer_of) == []  # untied GPT
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(16, 16), torch.nn.ReLU())])
    net[2].weight = net[4].weight  # the 2nd and 3rd Linear share their weight
    g = capture(_mlp_step, net, torch.optim.SGD(net.parameters(), lr=0.1),
                (torch.randn(8, 16), torch.randn(8, 16)))
    tied = assign_layers(g, 4)
    assert tied_spans(g, tied.layer_of) == [(1, 2)]
    with pytest.raises(PlanError, match="several stages"):  # the cut the DP must avoid
        partition(g, stage_of_nodes(g, tied.layer_of, [(0, 1), (2, 3)]), 2)
    cl = Cluster.local(1, 4)
    three = plan(g, cl, layers=tied, num_stages=3)
    ranges = [(s.layer_start, s.layer_end) for s in three.stages]
    assert ranges == [(0, 0), (1, 2), (3, 3)]
    _check_invariants(three, g, cl)
    partition(g, stage_of_nodes(g, three.layer_of, ranges), 3)
    for p in (plan(g, cl, layers=tied), plan(g, Cluster.local(1, 2), layers=tied, num_stages=2)):
        assert all(not 1 < s.layer_start <= 2 for s in p.stages)
    with pytest.raises(PlanError, match="no plan"):  # 4 stages would split the tied pair
        plan(g, cl, layers=tied, num_stages=4)


def test_tile_submeshes_packs_largest_first():
    cl = Cluster.simulated(4, 8)
    shapes = [(1, 2), (2, 8), (1, 4), (1, 2), (1, 8)]
    ids = tile_submeshes(cl, shapes)
    assert sorted(d for t in ids for d in t) == list(range(32))
    assert ids[1] == tuple(range(16)) and ids[4] == tuple(range(16, 24))
    with pytest.raises(PlanError, match="do not tile"):
        tile_submeshes(cl, [(2, 8), (2, 8), (1, 2)])


def test_fixed_costs_are_paid_by_every_microbatch(graph, models):
    """The operator overhead and the collective latency of forward/backward do not shrink with
    the microbatch: t = (fb - fixed + upd) / B + fixed + cross (``search`` docstring)."""
    import operator

    from intra_ilp.stage import GRAD_MARKER_NAME
    from stage_dp.search import candidate_columns
    from stage_dp.tables import build_tables

    model = models["local2x2"]
    cols = candidate_columns(model, model.configs, math.inf, 0.5, lean_all=False)
    tables = {b: build_tables(model, cols, b, math.inf, "1f1b", 0.5) for b in (1, 2)}
    last = model.layers.num_layers - 1
    for s, col in enumerate(cols):
        for c, cfg in enumerate(col):
            rc = model.range_costs(cfg)
            mesh = model.mesh_cost(cfg)
            fx_nodes = {n.name: n for n in graph.gm.graph.nodes}
            ran = sum(1 for n, f in graph.nodes.items() if f.phase != "update"
                      and fx_nodes[n].target is not operator.getitem and str(fx_nodes[n].target) != GRAD_MARKER_NAME)
            assert rc.overhead_fb_s[0, last] == pytest.approx(ran * mesh.op_overhead_s)
            fixed = rc.overhead_fb_s[0, last] + rc.latency_fb_s[0, last]
            upd = rc.compute_update_s[0, last] + rc.comm_update_s[0, last]
            fb = rc.compute_fb_s[0, last] + rc.comm_fb_s[0, last]
            acc = rc.accumulate_s[0, last]
            for b, t in tables.items():
                assert t.cost_s[0, last, s, c] == pytest.approx((fb - fixed + upd) / b + fixed + acc * (b - 1) / b)
            if cfg.logical_shape != (1, 1):
                assert rc.latency_fb_s[0, last] > 0 or rc.comm_fb_s[0, last] == 0
