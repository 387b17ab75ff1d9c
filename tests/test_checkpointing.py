"""Activation checkpointing: the graph rewrite, the layer choice, the plan and the runtime.

- ``alpa_torch.core.remat.rematerialize`` gives the same step bit for bit on one
  device (the copies run the same kernels on the same inputs);
- ``stage_dp.checkpointing.choose_layers`` equals brute force over every subset;
- the planner makes a model fit with checkpointing where it does not fit without;
- ``parallelize`` runs such plans (one stage, and a 2-stage pipeline) and equals
  single-device eager training (fp32, atol 1e-5, as the runtime's golden tests).
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

from alpa_torch import parallelize
from alpa_torch.capture import capture
from alpa_torch.core.cluster import Cluster
from alpa_torch.core.errors import InfeasibleMemoryError, PlanError
from alpa_torch.core.remat import is_random, recompute_nodes, rematerialize
from alpa_torch.optim import OptimizerSet
from alpa_torch.zoo import ZOO, build, make_batch, make_optimizer, train_step
from stage_dp.checkpointing import Checkpointing, choose_layers, stage_memory
from stage_dp.layer_assign import assign_layers
from stage_dp.search import plan

ATOL = 1e-5


def _graph_inputs(model, opt, batch):
    functional = OptimizerSet((opt,), {id(p): n for n, p in model.named_parameters()})
    values = {n: p.detach() for n, p in model.named_parameters()}
    values.update(dict(model.named_buffers()))
    params = dict(model.named_parameters())
    for n in functional.names:
        for k, v in functional.initial_state(n, params[n]).items():
            values[f"{n}.{k}"] = v
    for k, v in functional.host_scalars().items():
        values[k] = torch.tensor(v, dtype=torch.float64)
    for i, leaf in enumerate(pytree.tree_leaves(batch)):
        values[f"batch.{i}"] = leaf
    return values


# ------------------------------------------------------------------ the rewrite
@pytest.mark.parametrize("name", ["gpt", "mlp", "hf_gpt2"])
def test_rematerialized_graph_is_bitwise_the_same_step(name):
    model, batch = ZOO[name]()
    opt = make_optimizer("adamw", model)
    graph = capture(train_step, model, opt, batch)
    layers = assign_layers(graph, num_layers=3)
    new, origin = rematerialize(graph, layers.layer_of, range(layers.num_layers))
    # the originals: forward operators, and elements of their tuple results the backward reads
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    assert origin and all(graph.nodes[o].phase == "forward" or nodes[o].args[0].name in origin.values()
                          for o in origin.values())
    assert all(new.nodes[c].phase == "backward" for c in origin)
    # no backward operator reads a recomputed forward value of its own layer: it reads the copy
    copied = set(origin.values())
    for node in new.nodes.values():
        if node.phase == "forward":
            continue
        mine = layers.layer_of[origin.get(node.name, node.name)]
        assert all(layers.layer_of[r] != mine for r in copied & set(node.inputs)), node.name
    values = _graph_inputs(model, opt, batch)
    a, b = graph.run(values), new.run(values)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_recompute_nothing_returns_the_graph_itself():
    model, batch = ZOO["mlp"]()
    graph = capture(train_step, model, make_optimizer("sgd", model), batch)
    layers = assign_layers(graph, num_layers=2)
    assert rematerialize(graph, layers.layer_of, ()) == (graph, {})


def test_random_operators_are_kept_not_recomputed():
    assert is_random("aten.native_dropout.default") and is_random("aten.rand_like.default")
    assert not is_random("aten.mm.default") and not is_random("aten.addmm.default")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    batch = (torch.randn(4, 8), torch.randn(4, 1))

    def step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        return loss

    graph = capture(step, model, torch.optim.SGD(model.parameters(), lr=0.1), batch)
    layer_of = {n.name: 0 for n in graph.gm.graph.nodes}
    copied = {n for names in recompute_nodes(graph, layer_of, [0]).values() for n in names}
    assert copied and not any(is_random(graph.nodes[n].target) for n in copied)


# ------------------------------------------------------------------ the choice
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(1.0, 100.0), st.floats(0.0, 1.0)), min_size=1, max_size=6),
       st.floats(0.0, 200.0), st.integers(1, 4), st.floats(0.3, 1.2))
def test_choose_layers_equals_brute_force(layers, persistent, in_flight, squeeze):
    f = np.array([t for t, _, _ in layers])
    act = np.array([a for _, a, _ in layers])
    kept = act * np.array([k for _, _, k in layers]) * 0.5
    full = stage_memory(persistent, in_flight, act, kept, ())
    budget = persistent + squeeze * (full - persistent)
    fits = budget * (1 + 1e-9)  # choose_layers's tolerance
    best = min((float(f[list(r)].sum()), r) for n in range(len(layers) + 1)
               for r in itertools.combinations(range(len(layers)), n)
               if stage_memory(persistent, in_flight, act, kept, r) <= fits)[0] \
        if stage_memory(persistent, in_flight, act, kept, range(len(layers))) <= fits else None
    if best is None:
        with pytest.raises(PlanError, match="even recomputing every layer"):
            choose_layers(f, act, kept, persistent, in_flight, budget)
        return
    chosen = choose_layers(f, act, kept, persistent, in_flight, budget)
    assert stage_memory(persistent, in_flight, act, kept, chosen) <= budget * (1 + 1e-9)
    assert float(f[list(chosen)].sum()) == pytest.approx(best, abs=1e-6)


@pytest.mark.parametrize("bad", ["some", -1, 0, float("inf"), True])
def test_bad_checkpointing_option(bad):
    with pytest.raises(PlanError, match="checkpointing="):
        Checkpointing.parse(bad)


# ------------------------------------------------------------------ the plan
@pytest.fixture(scope="module")
def wide_batch_gpt():
    """The zoo GPT at batch 32 on one microbatch: activations dominate its memory.
    SGD: Adam's m / sqrt(v) turns a last-bit difference of a near-zero gradient (the
    sharded plan sums in another order) into a 1e-5 parameter difference; the
    runtime's golden tests cover Adam on their plans."""
    model, batch = build("gpt", batch_size=32)
    return model, batch, capture(train_step, model, make_optimizer("sgd", model), batch)


def _needs(graph, cluster, **options):
    try:
        plan(graph, cluster, memory_budget_bytes=1.0, **options)
    except InfeasibleMemoryError as exc:
        return exc.required_bytes
    raise AssertionError("1 byte per device fitted")


def test_checkpointing_makes_a_model_fit(wide_batch_gpt):
    _, _, graph = wide_batch_gpt
    cluster, one = Cluster.local(1, 2), dict(num_microbatches=1, pipeline=False)
    without = _needs(graph, cluster, checkpointing="none", **one)
    with_full = _needs(graph, cluster, checkpointing="full", **one)
    assert with_full < 0.8 * without
    budget = (without + with_full) / 2
    with pytest.raises(InfeasibleMemoryError):
        plan(graph, cluster, memory_budget_bytes=budget, checkpointing="none", **one)
    p = plan(graph, cluster, memory_budget_bytes=budget, **one)
    st0 = p.stages[0]  # the stage DP's memory rule fits the budget (memory_bytes is the simulated peak)
    assert p.recompute_layers and st0.persistent_bytes + st0.in_flight * st0.activation_bytes <= budget
    plain = plan(graph, cluster, checkpointing="none", **one)
    assert p.predicted_step_s > plain.predicted_step_s  # recomputation is not free
    assert not plain.recompute_layers and "recompute" in p.table()
    # the same budget as a number: the option form of a memory budget
    assert plan(graph, cluster, checkpointing=budget, **one).recompute_layers == p.recompute_layers


def test_full_checkpointing_recomputes_every_layer_and_lowers_the_simulated_peak(wide_batch_gpt):
    _, _, graph = wide_batch_gpt
    options = dict(num_stages=2, num_microbatches=4)
    p = plan(graph, Cluster.local(1, 2), checkpointing="full", **options)
    assert sorted(p.recompute_layers) == list(range(p.num_layers))
    assert all(s.recompute_layers == tuple(range(s.layer_start, s.layer_end + 1)) for s in p.stages)
    # memory_bytes: the liveness simulation of the rewritten programs (stage_dp.memory_sim)
    plain = plan(graph, Cluster.local(1, 2), checkpointing="none", **options)
    assert [s.layer_start for s in plain.stages] == [s.layer_start for s in p.stages]
    assert all(c.memory_bytes < n.memory_bytes for c, n in zip(p.stages, plain.stages))


# ------------------------------------------------------------------ the runtime
def _train_and_compare(step, name_or_model, batches, opt="adamw"):
    eager, _ = name_or_model
    model = copy.deepcopy(eager)
    eager_opt, opt2 = make_optimizer(opt, eager), make_optimizer(opt, model)
    for i, batch in enumerate(batches):
        expected = float(train_step(eager, eager_opt, batch).detach())
        got = float(step(model, opt2, batch))
        assert got == pytest.approx(expected, abs=ATOL), f"step {i}: loss {got} != eager {expected}"
    step.sync(model, opt2)
    for pname, p in eager.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[pname].detach(), p.detach(), atol=ATOL, rtol=0)


@pytest.mark.usefixtures("ray_session")
@pytest.mark.sweep
def test_checkpointed_plan_runs_and_equals_eager(wide_batch_gpt):
    model, _, graph = wide_batch_gpt
    cluster, one = Cluster.local(1, 2), dict(num_microbatches=1, pipeline=False)
    without = _needs(graph, cluster, checkpointing="none", **one)
    with_full = _needs(graph, cluster, checkpointing="full", **one)
    step = parallelize(train_step, cluster=cluster, memory_budget_bytes=(without + with_full) / 2, **one)
    try:
        batches = [make_batch("gpt", 32, seed=s) for s in range(3)]
        _train_and_compare(step, (model, None), batches, opt="sgd")
        assert step.plan.recompute_layers and step._recomputed
    finally:
        step.shutdown()


@pytest.mark.usefixtures("ray_session")
def test_checkpointed_pipeline_equals_eager():
    model, batch = build("gpt", batch_size=8)
    step = parallelize(train_step, cluster=Cluster.local(1, 2), checkpointing="full", num_stages=2,
                       num_microbatches=2, schedule="1f1b")
    try:
        _train_and_compare(step, (model, None), [make_batch("gpt", 8, seed=s) for s in range(3)])
        assert len(step.plan.stages) == 2 and step.plan.recompute_layers
    finally:
        step.shutdown()


def _pre_norm_twin():
    """LLaMA-3-8B's transformers class at 2 layers (its RMSNorm is decomposed: the block's first
    operator reading a block weight is the norm's scale, after the normalization), with HF's step."""
    pytest.importorskip("transformers")
    from alpa_torch.zoo_hf import TWIN_BATCH, TWIN_SEQ, hf_batch, hf_train_step, hf_twin

    model = hf_twin("llama3-8b")
    return model, hf_train_step, [hf_batch("llama3-8b", model.config, TWIN_BATCH, TWIN_SEQ, seed=s) for s in range(3)]


def test_recomputed_layer_stays_on_its_stage_in_a_pre_norm_model(caplog):
    """A norm weight's gradient reads the normalized input, computed by the layer before; the
    partition moves it to its weight's stage. Reading that layer's recomputed copies, it pulled
    the whole recomputed forward of the first layer (the embedding and its weight) onto the
    second stage, and the memory simulation of every such plan failed ('param
    model.embed_tokens.weight is used by stages [0, 1]'), as the runtime would have."""
    from alpa_torch.core.partition import partition, stage_of_nodes
    from alpa_torch.core.remat import extend_layer_of

    model, step, batches = _pre_norm_twin()
    graph = capture(step, model, torch.optim.AdamW(model.parameters()), batches[0])
    layers = assign_layers(graph, 2)
    remat, copies = rematerialize(graph, layers.layer_of, [0, 1], [(0, 0), (1, 1)])
    layer_of = extend_layer_of(layers.layer_of, copies)
    stage_of = stage_of_nodes(remat, layer_of, [(0, 0), (1, 1)])
    partition(remat, stage_of, 2)  # raised PlanError
    assert all(stage_of[c] == layer_of[c] for c in copies)  # every copy on its original's stage
    # in one stage the gradient stays, and reads the copy: the normalized input is recomputed, not kept
    one, _ = rematerialize(graph, layers.layer_of, [0, 1], [(0, 1)])
    assert len(one.nodes) == len(remat.nodes) + 1
    with caplog.at_level("WARNING"):
        p = plan(graph, Cluster.local(1, 2), num_stages=2, num_layers=2, checkpointing="full")
    assert p.recompute_layers and "memory simulation failed" not in caplog.text


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_checkpointed_pipeline_of_a_pre_norm_model_equals_eager():
    model, step_fn, batches = _pre_norm_twin()
    eager = copy.deepcopy(model)
    step = parallelize(step_fn, cluster=Cluster.local(1, 2), checkpointing="full", num_stages=2, num_layers=2,
                       num_microbatches=2)
    try:
        eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for i, batch in enumerate(batches):
            expected = float(step_fn(eager, eager_opt, batch).detach())
            got = float(step(model, opt, batch))
            assert got == pytest.approx(expected, abs=ATOL), f"step {i}: loss {got} != eager {expected}"
        step.sync(model, opt)
        assert len(step.plan.stages) == 2 and step.plan.recompute_layers
        for name, p in eager.named_parameters():
            torch.testing.assert_close(dict(model.named_parameters())[name].detach(), p.detach(), atol=ATOL, rtol=0)
    finally:
        step.shutdown()
