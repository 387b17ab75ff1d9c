"""Golden tests of pipelined plans on Ray workers: equal to single-device eager.

Each case slices a zoo model's captured step into stages by layer ranges,
shards every stage on its submesh with the ILP, runs 3 steps with GPipe or
1F1B over microbatches, and compares losses and all parameters with eager
training of the full batch (fp32, atol 1e-5).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from alpa_torch.capture import capture
from alpa_torch.core.cluster import Cluster
from alpa_torch.core.errors import BatchSplitError, PlanError
from alpa_torch.core.partition import partition, stage_of_nodes
from alpa_torch.optim import OptimizerSet
from alpa_torch.zoo import ZOO, make_batch, make_optimizer, train_step
from intra_ilp.cost_model import MeshCost
from intra_ilp.stage import solve_stage
from stage_dp.layer_assign import assign_layers

ATOL = 1e-5
BATCH = 8


def cheap_comm(shape):
    return MeshCost(mesh_shape=tuple(shape), alpha_s=(1e-9, 1e-9), beta_s_per_byte=(1e-15, 1e-15),
                    peak_flops_per_s=1e6, memory_bandwidth_bytes_per_s=1e12)


def _plan(name, stages, microbatches, cheap, opt="adamw", force_dp=False):
    model, _ = ZOO[name]()
    optimizer = make_optimizer(opt, model)
    microbatch = make_batch(name, BATCH // microbatches, seed=0)
    graph = capture(train_step, model, optimizer, microbatch)
    layers = assign_layers(graph, max(hi for _, hi, _, _ in stages) + 1)
    stage_of = stage_of_nodes(graph, layers.layer_of, [(lo, hi) for lo, hi, _, _ in stages])
    cluster = Cluster.local(2, 2)
    deployments = []
    from runtime.engine import StageDeployment

    for k, (_, _, ranks, shape) in enumerate(stages):
        names = {n for n, s in stage_of.items() if s == k and n in graph.nodes}
        submesh = (1, len(ranks)) if len(ranks) <= 2 else (2, 2)
        mesh = cheap_comm(shape) if cheap else MeshCost.from_cluster(cluster, submesh, tuple(shape))
        force = None
        if force_dp:  # the batch split along the stage's devices, state replicated
            force = {s.name: ("RS(0)" if s.kind == "batch" and s.shape else "RR")
                     for s in graph.inputs if s.kind in ("batch", "param", "opt_state")}
        deployments.append(StageDeployment(tuple(ranks), tuple(shape), solve_stage(graph, mesh, names=names,
                                                                                    force=force)))
    return model, optimizer, graph, stage_of, deployments


def run_pipeline(name, hosts, devices, stages, microbatches, schedule, cheap=False, opt="adamw", dst_gather=None,
                 force_dp=False):
    from runtime.engine import Engine
    from runtime.group import WorkerGroup
    from runtime.wire import to_wire_dict

    eager, _ = ZOO[name]()
    eager_opt = make_optimizer(opt, eager)
    model, optimizer, graph, stage_of, deployments = _plan(name, stages, microbatches, cheap, opt, force_dp)
    functional = OptimizerSet((optimizer,), {id(p): n for n, p in model.named_parameters()})
    values = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for n in functional.names:
        for key, v in functional.initial_state(n, values[n]).items():
            values[f"{n}.{key}"] = v
    with WorkerGroup.start(Cluster.local(hosts, devices)) as group:
        engine = Engine(group, graph, deployments, stage_of, microbatches, schedule, dst_gather=dst_gather)
        engine.load_state(to_wire_dict(values))
        for i in range(3):
            batch = make_batch(name, BATCH, seed=i)
            expected = float(train_step(eager, eager_opt, batch).detach())
            got = engine.step({f"batch.{j}": t.numpy() for j, t in enumerate(batch)}, functional.host_scalars())
            assert got == pytest.approx(expected, abs=ATOL), f"step {i}"
        final = engine.gather_state()
    for pname, p in eager.named_parameters():
        np.testing.assert_allclose(final[pname], p.detach().numpy(), atol=ATOL, rtol=0, err_msg=pname)


TWO = [[0, 0, [0], [1, 1]], [1, 1, [1], [1, 1]]]
FOUR = [[k, k, [k], [1, 1]] for k in range(4)]
TWO_BY_DP2 = [[0, 0, [0, 1], [1, 2]], [1, 1, [2, 3], [1, 2]]]
UNEVEN = [[0, 0, [0], [1, 1]], [1, 1, [1], [1, 1]], [2, 2, [2, 3], [1, 2]]]


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize(
    "name,hosts,devices,stages,microbatches,schedule,cheap",
    [
        ("gpt", 1, 2, TWO, 2, "1f1b", False),
        pytest.param("gpt", 2, 2, TWO_BY_DP2, 2, "gpipe", True, marks=pytest.mark.slow),  # 12-18 s each
        pytest.param("gpt", 2, 2, FOUR, 4, "1f1b", False, marks=pytest.mark.slow),
        pytest.param("gpt", 2, 2, UNEVEN, 2, "1f1b", True, marks=pytest.mark.sweep),
        ("mlp", 1, 2, TWO, 1, "gpipe", False),
        ("mlp", 2, 2, TWO_BY_DP2, 4, "1f1b", True),
        ("gpt", 1, 2, TWO, 4, "zb-h1", False),
        pytest.param("gpt", 1, 2, TWO, 2, "zb-h1", False, marks=pytest.mark.sweep),
        pytest.param("gpt", 1, 2, TWO, 8, "zb-h1", False, marks=pytest.mark.sweep),
        pytest.param("gpt", 2, 2, TWO_BY_DP2, 4, "zb-h1", False, marks=pytest.mark.slow),
        pytest.param("gpt", 2, 2, FOUR, 4, "zb-h1", False, marks=pytest.mark.sweep),
    ],
    ids=["gpt-2stage-1f1b", "gpt-2stage-x-2dev-gpipe", "gpt-4stage-4mb", "gpt-uneven-submeshes",
         "mlp-2stage-1mb", "mlp-2stage-x-2dev-4mb", "gpt-2stage-zb-4mb", "gpt-2stage-zb-2mb", "gpt-2stage-zb-8mb",
         "gpt-2stage-x-2dev-zb-4mb", "gpt-4stage-zb-4mb"],
)
def test_pipeline_matches_eager(name, hosts, devices, stages, microbatches, schedule, cheap):
    run_pipeline(name, hosts, devices, stages, microbatches, schedule, cheap)


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("name,hosts,stages,schedule,dst_gather", [
    ("gpt", 1, TWO, "1f1b", None), pytest.param("gpt", 1, TWO, "gpipe", None, marks=pytest.mark.sweep),
    pytest.param("mlp", 2, UNEVEN, "1f1b", True, marks=pytest.mark.slow)],
    ids=["gpt-2stage-1f1b", "gpt-2stage-gpipe", "mlp-uneven-gather"])
def test_pipelines_equal_eager_with_every_message_tagged_alike(monkeypatch, name, hosts, stages, schedule,
                                                                dst_gather):
    """NCCL ignores tags: the messages between two ranks match by the order both sides post them.
    With ``ALPA_TORCH_P2P_TAGS=0`` (set in the driver's environment; the workers get it) every
    message carries tag 0, and pipelines of 4 microbatches (several messages each way between one
    pair of ranks a step, and a destination mesh's gather) still equal eager."""
    from runtime.switches import P2P_TAGS_ENV
    from runtime.worker import actor_env

    monkeypatch.setenv(P2P_TAGS_ENV, "0")
    assert actor_env(1, False)[P2P_TAGS_ENV] == "0"
    run_pipeline(name, hosts, 2, stages, 4, schedule, cheap=True, dst_gather=dst_gather)


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("name", [pytest.param("gpt", marks=pytest.mark.sweep), "mlp"])
def test_two_stages_of_pure_data_parallel(name):
    """2 stages x data parallel 2: each stage splits its microbatch over its 2 devices."""
    run_pipeline(name, 2, 2, TWO_BY_DP2, 2, "1f1b", force_dp=True)


@pytest.mark.usefixtures("ray_session")
def test_cross_mesh_local_all_gather_matches_eager():
    """Alpa's local all-gather: boxes cross once, the replicated destination gathers."""
    run_pipeline("gpt", 2, 2, UNEVEN, 2, "1f1b", cheap=False, dst_gather=True)


def test_local_all_gather_halves_cross_bytes_into_a_replicated_submesh():
    from runtime.comm import _plan, mesh_placement, prefer_dst_gather

    src, dst = mesh_placement([0], (1, 1)), mesh_placement([2, 3], (1, 2))
    direct, gathered = _plan((8, 16), "RR", src, "RR", dst, False), _plan((8, 16), "RR", src, "RR", dst, True)
    assert gathered.cross_bytes * 2 == direct.cross_bytes
    assert prefer_dst_gather((8, 16), "RR", src, "RR", dst, 4, cross_beta_s=1.0, local_beta_s=0.1)
    assert not prefer_dst_gather((8, 16), "RR", src, "RR", dst, 4, cross_beta_s=0.1, local_beta_s=1.0)


def test_partition_crossings_flow_forward_then_backward():
    _, _, graph, stage_of, _ = _plan("gpt", FOUR, 2, cheap=False)
    programs, crossings = partition(graph, stage_of, 4)
    assert all(p.forward and p.backward and p.update for p in programs)
    for c in crossings:
        if c.produced == c.consumed == "forward":
            assert c.dst > c.src
        if c.produced == c.consumed == "backward":
            assert c.dst < c.src
    # each gradient is computed on its parameter's stage, so updates stay local
    placeholder = {s.name: s.node for s in graph.inputs if s.kind == "param"}
    for param, marker in graph.grad_of.items():
        assert stage_of[marker] == stage_of[placeholder[param]]


def test_a_split_backward_sends_from_its_first_part_and_computes_the_weight_gradients_in_its_second():
    """Zero-bubble schedules run a stage's backward in two parts (``partition.phase_lists``): the
    first computes exactly what is sent to the stage before, the second every weight gradient."""
    from alpa_torch.core.partition import phase_lists

    _, _, graph, stage_of, _ = _plan("gpt", FOUR, 2, cheap=False)
    programs, crossings = partition(graph, stage_of, 4)
    for prog in programs:
        lists = phase_lists(graph, prog, crossings, split=True)
        first, second = lists["backward"], lists["weight"]
        assert sorted(first + second) == sorted(prog.backward)
        sent = {c.value for c in crossings if c.src == prog.stage and c.produced == "backward"}
        assert sent <= set(first)
        assert bool(first) == (prog.stage > 0)  # the first stage sends nothing back
        markers = {m for m in graph.grad_of.values() if stage_of[m] == prog.stage}
        assert markers and markers <= set(second)
        ancestors, todo = set(), list(sent)
        while todo:  # nothing in the first part is there for the weight gradients alone
            name = todo.pop()
            if name in ancestors or name not in first:
                continue
            ancestors.add(name)
            todo += graph.nodes[name].inputs
        assert ancestors == set(first)
    assert phase_lists(graph, programs[1], crossings, split=False)["backward"] == programs[1].backward


def test_a_gpt_stage_boundary_moves_one_value_each_way():
    """The backward sends only the activation gradient, as the forward the activation: the view and
    transpose that a linear layer's weight gradient makes of it run on the stage reading them (they
    crossed too: three transfers of the same bytes per boundary and microbatch)."""
    _, _, graph, stage_of, _ = _plan("gpt", FOUR, 2, cheap=False)
    _, crossings = partition(graph, stage_of, 4)
    for boundary in range(3):
        forward = [c for c in crossings if (c.src, c.dst) == (boundary, boundary + 1)]
        backward = [c for c in crossings if (c.src, c.dst) == (boundary + 1, boundary)]
        assert [c.produced for c in forward] == ["forward"], forward
        assert [c.produced for c in backward] == ["backward"], backward
        shape = graph.nodes[forward[0].value].shape
        assert graph.nodes[backward[0].value].shape == shape
        assert graph.nodes[backward[0].value].target not in ("aten.view.default", "aten.t.default")


def test_tied_weights_across_stages_are_refused():
    from alpa_torch.zoo import GPT, GPTConfig

    model = GPT(GPTConfig.tiny(tie_weights=True))
    graph = capture(train_step, model, make_optimizer("adam", model), make_batch("gpt", 4, seed=0))
    layers = assign_layers(graph, 2)
    stage_of = stage_of_nodes(graph, layers.layer_of, [(0, 0), (1, 1)])
    with pytest.raises(PlanError, match="tied|shared|several"):
        partition(graph, stage_of, 2)


def test_batch_that_does_not_split_is_refused():
    from runtime.engine import Engine

    engine = Engine.__new__(Engine)
    engine.num_microbatches = 3
    with pytest.raises(BatchSplitError, match="divisible by 3"):
        engine.split({"batch.0": np.zeros((8, 4))})


class _WhereMLP(torch.nn.Module):
    """Linear -> where(h > 0, h, 0.0) -> Linear -> ReLU -> Linear: ``where``'s backward makes its zero with
    ``scalar_tensor(0)``, a factory operator that reads nothing, so the layer rules put it in
    the last layer while its reader is in the first (the T5 twin's position-bias mask)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)  # [B, 16]
        return self.c(torch.relu(self.b(torch.where(h > 0, h, 0.0))))


def _ce_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.usefixtures("ray_session")
def test_plain_tensor_sent_between_stages_after_the_first_step():
    """Regression: a value that is a plain tensor on its stage (a factory operator's result, no
    DTensor metadata) sent to another stage crashed every step after the first (replay wrapped
    it with metadata it never had: AttributeError 'NoneType' object has no attribute
    'placements'). Found by the T5 twin (tests/test_hf_twins.py)."""
    import copy

    from alpa_torch import parallelize

    torch.manual_seed(0)
    model = _WhereMLP()
    eager = copy.deepcopy(model)
    eager_opt, optimizer = make_optimizer("adamw", eager), make_optimizer("adamw", model)
    step = parallelize(_ce_step, Cluster.local(2, 2), num_stages=2, num_layers=2, plan_cache=False)
    try:
        for i in range(3):
            gen = torch.Generator().manual_seed(i)
            batch = (torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen))
            expected = float(_ce_step(eager, eager_opt, batch).detach())
            assert float(step(model, optimizer, batch)) == pytest.approx(expected, abs=ATOL), f"step {i}"
        state, plan = step.state_dict(), step.plan
    finally:
        step.shutdown()
    assert [s.num_devices for s in plan.stages] == [2, 2], plan.summary()  # the bug needed DTensor stages
    for pname, p in eager.named_parameters():
        torch.testing.assert_close(state["model"][pname], p.detach(), atol=ATOL, rtol=0)


@pytest.mark.usefixtures("ray_session")
def test_a_schedule_defined_outside_the_library_is_planned_explained_and_run():
    """``tests.test_schedule.Reversed`` is one class the library never names: ``parallelize`` plans
    two stages with it (the stage DP reads its memory and step time), ``explain`` and the runner-ups
    read it, and the runtime runs its order equal to eager."""
    import copy

    from alpa_torch import parallelize
    from alpa_torch.core.options import PlanOptions
    from alpa_torch.explain import alternatives, explain, with_alternatives
    from stage_dp.planner import make_plan_with_model
    from tests.test_schedule import Reversed
    from tests.test_semantics import CLUSTER, _mlp, _xy, plain

    eager = _mlp()
    model = copy.deepcopy(eager)
    eager_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model))
    step = parallelize(plain, CLUSTER, schedule=Reversed.name, num_stages=2, num_microbatches=2, plan_cache=False)
    try:
        for i in range(3):
            want = float(plain(eager, eager_opt, _xy(i)).detach())
            assert float(step(model, opt, _xy(i))) == pytest.approx(want, abs=ATOL), f"step {i}"
        state = step.state_dict()["model"]
        plan = step.plan
    finally:
        step.shutdown()
    for pname, p in eager.named_parameters():
        torch.testing.assert_close(state[pname], p.detach(), atol=ATOL, rtol=0, msg=pname)
    assert plan.schedule == Reversed.name and len(plan.stages) == 2
    assert [s.in_flight for s in plan.stages] == [2, 2]  # the toy holds every microbatch, as GPipe
    from alpa_torch.viz import predicted_timeline

    order = [e.instruction for e in predicted_timeline(plan).events[1] if e.instruction.is_compute]
    assert [repr(i) for i in order] == ["F0", "F1", "B1", "B0"]

    fresh = _mlp()
    graph = capture(plain, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2), _xy(0))
    planned, cost_model = make_plan_with_model(graph, CLUSTER, PlanOptions(schedule=Reversed.name, num_stages=2))
    text = explain(with_alternatives(planned, alternatives(cost_model, planned)))
    assert Reversed.name in text
