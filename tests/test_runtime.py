"""Golden tests of the runtime: planned steps on Ray workers equal single-device eager.

Each case captures a zoo model's step, plans its sharding on a logical mesh,
runs 3 steps on ``Cluster.local`` workers (gloo) and compares the loss of every
step and every parameter afterwards with eager training (fp32, atol 1e-5).

Meshes: ``realistic`` prices collectives as gloo does here, which makes tiny
models stay replicated; ``cheap_comm`` makes communication almost free so the
ILP shards aggressively (tensor parallel, 2D mixes, sharded optimizer state):
the plans that exercise the collectives.
"""

from __future__ import annotations

import copy

import pytest
import torch

from alpa_torch.capture import capture
from alpa_torch.cluster import Cluster
from alpa_torch.optim import FunctionalOptimizer
from intra_ilp.cost_model import MeshCost
from intra_ilp.stage import solve_stage
from tests.zoo import ZOO, make_batch, make_optimizer, train_step

pytestmark = pytest.mark.usefixtures("ray_session")
ATOL = 1e-5


def cheap_comm(shape):
    return MeshCost(mesh_shape=shape, alpha_s=(1e-9, 1e-9), beta_s_per_byte=(1e-15, 1e-15),
                    peak_flops_per_s=1e6, memory_bandwidth_bytes_per_s=1e12)


def realistic(cluster, shape):
    return MeshCost.from_cluster(cluster, (cluster.num_hosts, cluster.devices_per_host), shape)


def _state(model, functional):
    values = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name in functional.names:
        for key, v in functional.initial_state(name, values[name]).items():
            values[f"{name}.{key}"] = v
    return {k: v.detach().numpy() for k, v in values.items()}


def run_case(name, cluster, mesh, opt="adamw", steps=3, force=None):
    from runtime.engine import Engine
    from runtime.group import WorkerGroup

    eager, _ = ZOO[name]()
    model = copy.deepcopy(eager)
    eager_opt, opt2 = make_optimizer(opt, eager), make_optimizer(opt, model)
    graph = capture(train_step, model, opt2, make_batch(name, 8, seed=0))
    sharding = solve_stage(graph, mesh, force=force)
    functional = FunctionalOptimizer(opt2, {id(p): n for n, p in model.named_parameters()})
    with WorkerGroup.start(cluster) as group:
        engine = Engine(group, graph, sharding)
        engine.load_state(_state(model, functional))
        for i in range(steps):
            batch = make_batch(name, 8, seed=i)
            expected = float(train_step(eager, eager_opt, batch).detach())
            got = engine.step({f"batch.{j}": t.numpy() for j, t in enumerate(batch)}, functional.host_scalars(i + 1))
            assert got == pytest.approx(expected, abs=ATOL), f"step {i}: loss {got} != eager {expected}"
        final = engine.gather_state()
    for pname, p in eager.named_parameters():
        torch.testing.assert_close(torch.from_numpy(final[pname]), p.detach(), atol=ATOL, rtol=0)
    for bname, b in eager.named_buffers():
        torch.testing.assert_close(torch.from_numpy(final[bname]), b, atol=ATOL, rtol=0)
    return sharding


def _sharded_params(graph_sharding) -> int:
    return sum(1 for s in graph_sharding.value_specs.values() if not s.is_replicated)


def test_mlp_replicated_plan_matches_eager():
    cluster = Cluster.local(1, 2)
    sharding = run_case("mlp", cluster, realistic(cluster, (1, 2)))
    assert sharding.total_s > 0


def test_mlp_tensor_parallel_matches_eager():
    sharding = run_case("mlp", Cluster.local(1, 2), cheap_comm((1, 2)))
    assert _sharded_params(sharding) > 0, "the cheap-communication mesh should shard something"


def test_gpt_2d_mesh_matches_eager():
    sharding = run_case("gpt", Cluster.local(2, 2), cheap_comm((2, 2)))
    assert _sharded_params(sharding) > 0


def test_cnn_batchnorm_sgd_matches_eager():
    run_case("cnn", Cluster.local(1, 2), cheap_comm((1, 2)), opt="sgd")


@pytest.mark.parametrize("name,opt", [("gpt", "adamw"), ("cnn", "sgd"), ("hf_gpt2", "adam")])
def test_automatic_plan_matches_eager(name, opt):
    """Whatever plan the planner picks on 2x2 devices trains exactly like eager."""
    from alpa_torch.api import parallelize

    eager, _ = ZOO[name]()
    model = copy.deepcopy(eager)
    eager_opt, optimizer = make_optimizer(opt, eager), make_optimizer(opt, model)
    step = parallelize(train_step, cluster=Cluster.local(2, 2))
    try:
        for i in range(3):
            batch = make_batch(name, 8, seed=i)
            expected = float(train_step(eager, eager_opt, batch).detach())
            assert float(step(model, optimizer, batch)) == pytest.approx(expected, abs=ATOL), f"step {i}"
        state = step.state_dict()
        plan = step.plan
    finally:
        step.shutdown()
    assert plan.stages and sum(s.num_devices for s in plan.stages) == 4
    for pname, p in eager.named_parameters():
        torch.testing.assert_close(state["model"][pname], p.detach(), atol=ATOL, rtol=0, msg=pname)


def test_parallelize_end_to_end_and_sync():
    from alpa_torch.api import parallelize

    eager, _ = ZOO["gpt"]()
    model = copy.deepcopy(eager)
    eager_opt, opt = make_optimizer("adam", eager), make_optimizer("adam", model)

    @parallelize(cluster=Cluster.local(1, 2))
    def step(model, optimizer, batch):
        return train_step(model, optimizer, batch)

    try:
        for i in range(3):
            batch = make_batch("gpt", 8, seed=i)
            expected = float(train_step(eager, eager_opt, batch).detach())
            assert float(step(model, opt, batch)) == pytest.approx(expected, abs=ATOL)
        step.sync(model, opt)
    finally:
        step.shutdown()
    for (n, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), atol=ATOL, rtol=0, msg=n)
    # The optimizer now holds the trained state, as eager training leaves it.
    first = next(iter(model.parameters()))
    assert int(opt.state[first]["step"]) == 3


def test_forced_pure_data_parallel_matches_eager():
    """force= pins the batch to S(0) and weights / optimizer state to R: DDP's plan."""
    cluster = Cluster.local(1, 2)
    model, _ = ZOO["gpt"]()
    graph = capture(train_step, model, make_optimizer("adamw", model), make_batch("gpt", 8, seed=0))
    force = {s.name: ("RS(0)" if s.kind == "batch" else "RR")
             for s in graph.inputs if s.kind in ("batch", "param", "opt_state")}
    sharding = solve_stage(graph, realistic(cluster, (1, 2)), force=force)
    specs = {s.name: str(sharding.value_specs[s.node]) for s in graph.inputs if s.node in sharding.value_specs}
    assert specs["batch.0"] == "RS(0)" and specs["wte.weight"] == "RR"
    grads = [str(sharding.value_specs[m]) for m in graph.grad_of.values()]
    assert all(g in ("RP", "RR") for g in grads), grads
    run_case("gpt", cluster, realistic(cluster, (1, 2)), force=force)


def _force(graph, batch_spec, state_spec="RR"):
    return {s.name: (batch_spec if s.kind == "batch" else state_spec)
            for s in graph.inputs if s.kind in ("batch", "param", "opt_state")}


def _graph(name, opt="adamw"):
    model, _ = ZOO[name]()
    return capture(train_step, model, make_optimizer(opt, model), make_batch(name, 8, seed=0))


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_pure_data_parallel_on_2x2(name):
    """Batch split 4 ways, weights and optimizer state replicated: gradients all-reduced."""
    cluster = Cluster.local(2, 2)
    mesh = MeshCost.from_cluster(cluster, (2, 2), (1, 4))
    force = _force(_graph(name), "RS(0)")
    sharding = run_case(name, cluster, mesh, force=force)
    assert all(not str(v).count("S") for k, v in sharding.value_specs.items() if k.startswith("grad"))


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_pure_tensor_parallel_on_2x2(name):
    """Batch replicated; with cheap collectives the ILP shards the weights 4 ways."""
    graph = _graph(name)
    force = {s.name: "RR" for s in graph.inputs if s.kind == "batch"}
    sharding = run_case(name, Cluster.local(2, 2), cheap_comm((1, 4)), force=force)
    weights = [s.node for s in graph.inputs if s.kind == "param" and len(s.shape) == 2]
    assert any("S" in str(sharding.value_specs[w]) for w in weights), "no weight was sharded"


def test_2d_data_by_tensor_on_2x2():
    """Data parallel on mesh axis 0 (batch S(0) there), tensor parallel on axis 1."""
    graph = _graph("gpt")
    force = {s.name: "S(0)R" for s in graph.inputs if s.kind == "batch"}
    sharding = run_case("gpt", Cluster.local(2, 2), cheap_comm((2, 2)), force=force)
    weights = [s.node for s in graph.inputs if s.kind == "param" and len(s.shape) == 2]
    assert any(str(sharding.value_specs[w]).endswith(("S(0)", "S(1)")) for w in weights)
