"""The memory simulation of a stage (``stage_dp.memory_sim``): hand-computed peaks of a tiny
synthetic graph (one device, a pipeline of two microbatches, a sharded mesh with a
redistributed input), and the simulated peak of a real captured GPT step against the live
heap the runtime's interpreter actually reaches (one device, in process, a few seconds)."""

from __future__ import annotations

import gc
import operator
from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx

from alpa_torch.capture import capture
from alpa_torch.core.spec import ShardingSpec
from stage_dp.memory_sim import GRAD_MARKER_NAME, batch_scaled_values, plan_memory, simulate_stage

aten = torch.ops.aten


def _graph(sizes: dict[str, int], ops: list[tuple[str, str, tuple[str, ...]]], inputs: dict[str, str],
           outputs: dict[str, str]):
    """An OpGraph-like object: float32 tensors of ``sizes[name]`` elements; ``ops``: (name, phase,
    inputs) in order, a name starting with 'm' is a gradient marker, with 'v' a view; ``inputs``:
    placeholder -> kind; ``outputs``: node -> kind."""
    g = fx.Graph()
    env = {}
    for name in inputs:
        env[name] = g.placeholder(name)
        env[name].meta["val"] = torch.empty(sizes[name], device="meta")
    facts = {}
    for name, phase, args in ops:
        target = "alpa.grad.default" if name.startswith("m") else "aten.view.default" if name.startswith("v") \
            else "aten.add.Tensor"
        node = g.call_function(aten.add.Tensor, tuple(env[a] for a in args))
        node.name = name
        node.meta["val"] = torch.empty(sizes[name], device="meta")
        env[name] = node
        facts[name] = SimpleNamespace(name=name, target=target, phase=phase, inputs=tuple(args),
                                      is_view=name.startswith("v"))
    g.output(tuple(env[n] for n in outputs))
    gm = fx.GraphModule({}, g)
    return SimpleNamespace(
        gm=gm, nodes=facts,
        inputs=tuple(SimpleNamespace(kind=k, name=n, node=n, shape=(sizes[n],)) for n, k in inputs.items()),
        outputs=tuple(SimpleNamespace(kind=k, name=n, node=n) for n, k in outputs.items()))


def _sharding(mesh_shape=(1, 1), value_specs=None, input_specs=None):
    parse = ShardingSpec.parse
    return SimpleNamespace(mesh_shape=mesh_shape,
                           value_specs={k: parse(v) for k, v in (value_specs or {}).items()},
                           input_specs={k: tuple(parse(s) for s in v) for k, v in (input_specs or {}).items()})


# x (batch, 400 B) and w (param, 200 B): f1 = x.w, f2 = f(f1), loss; backward b1 = f(loss, f1),
# g = f(b1, x) (w's gradient, parameter-sized), marker m; update w_new = f(w, m).
SIZES = {"x": 100, "w": 50, "f1": 100, "f2": 100, "loss": 1, "b1": 100, "g": 50, "m": 50, "w_new": 50}
OPS = [("f1", "forward", ("x", "w")), ("f2", "forward", ("f1",)), ("loss", "forward", ("f2",)),
       ("b1", "backward", ("loss", "f1")), ("g", "backward", ("b1", "x")), ("m", "backward", ("g",)),
       ("w_new", "update", ("w", "m"))]
GRAPH = _graph(SIZES, OPS, {"x": "batch", "w": "param"}, {"w_new": "param", "loss": "loss"})


def test_one_device_engine_hand_computed():
    """One program: x 400 + f1 400 + f2 400 + loss 4 live at the loss, over w's 200."""
    est = simulate_stage(GRAPH, _sharding())
    assert est.peak_bytes == 1404 and est.node == "loss" and est.phase == "forward"
    assert est.state_bytes == 200 and est.grad_bytes == 0
    assert est.phase_peaks["backward"] == 1404  # b1 made before f1 and loss are freed
    assert est.phase_peaks["update"] == 604  # w 200 + g (as m) 200 + w_new 200 + the loss 4


def test_batch_scaling_spares_parameter_gradients():
    assert batch_scaled_values(GRAPH) == {"x", "f1", "f2", "loss", "b1"}


def test_pipeline_two_microbatches_hand_computed():
    """GPipe F0 F1 B0 B1 on one stage, B = 2: batch-derived values halve (x, f1, f2, b1: 200 B;
    the loss 2 B). F1 runs with microbatch 0's kept x, f1 and loss (402 B) parked: w 200 +
    402 + x 200 + f1 200 + f2 200 + loss 2 = 1204 at its loss; B0 peaks at b1 with
    microbatch 1 parked (1204 too); the gradient accumulator holds m (200) from B0 on; the
    update holds w, m and m's division copy, then makes w_new (600)."""
    est = simulate_stage(GRAPH, _sharding(), num_microbatches=2, engine=False,
                         order=[("F", 0), ("F", 1), ("B", 0), ("B", 1)])
    assert est.peak_bytes == 1204 and est.phase == "forward" and est.microbatch == 1 and est.node == "loss"
    assert est.parked_bytes == 402 and est.grad_bytes == 200
    assert est.phase_peaks == {"forward": 1204, "backward": 1204, "update": 600}
    one_f_one_b = simulate_stage(GRAPH, _sharding(), num_microbatches=2, engine=False,
                                 order=[("F", 0), ("B", 0), ("F", 1), ("B", 1)])
    assert one_f_one_b.peak_bytes == 1002  # F1 after B0: nothing parked, m (200) accumulated


def test_sharded_values_and_a_redistributed_input():
    """On 2 devices x and f1 are split (S(0)): 200 B each; f2 wants f1 replicated, so a full
    copy of f1 (400 B) exists while f2 runs."""
    specs = {"x": "S(0)R", "f1": "S(0)R", "f2": "RR", "b1": "S(0)R"}
    plain = simulate_stage(GRAPH, _sharding((2, 1), specs, {"f2": ["S(0)R"]}))
    moved = simulate_stage(GRAPH, _sharding((2, 1), specs, {"f2": ["RR"]}))
    # plain: w 200 + x 200 + f1 200 + f2 400 (+ loss 4 at the loss)
    assert plain.peak_bytes == 1004 and plain.node == "loss"
    assert moved.peak_bytes == 1400 and moved.node == "f2"  # + the 400 B copy of f1 during f2


def test_views_share_their_input_storage():
    sizes = dict(SIZES, v1=100)
    ops = [("f1", "forward", ("x", "w")), ("v1", "forward", ("f1",)), ("f2", "forward", ("v1",)),
           ("loss", "forward", ("f2",)), ("b1", "backward", ("loss", "v1")), ("g", "backward", ("b1", "x")),
           ("m", "backward", ("g",)), ("w_new", "update", ("w", "m"))]
    g = _graph(sizes, ops, {"x": "batch", "w": "param"}, {"w_new": "param", "loss": "loss"})
    assert simulate_stage(g, _sharding()).peak_bytes == 1404  # v1 costs nothing: it is f1


# ------------------------------------------------------------------ against the runtime
def _mallinfo():
    from runtime.device_memory import heap_in_use_bytes

    if heap_in_use_bytes() is None:
        pytest.skip("needs glibc's mallinfo2")
    return heap_in_use_bytes


def test_simulated_peak_matches_the_runtimes_live_heap():
    """The zoo GPT step run by the runtime's interpreter on one device (plain tensors): the live
    heap (glibc's in-use bytes, sampled after every operator) peaks within 5 % of the simulation."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from alpa_torch.core.cluster import Cluster
    from alpa_torch.optim import OptimizerSet
    from alpa_torch.zoo import GPT, GPTConfig, _lm_batch, make_optimizer, train_step
    from intra_ilp.cost_model import MeshCost
    from intra_ilp.stage import solve_stage
    from runtime.interpreter import StageRunner, serialize_graph
    from runtime.profile import _OneDevice

    in_use = _mallinfo()
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    opt = make_optimizer("adamw", model)
    batch = _lm_batch(GPTConfig.small().vocab_size, 16, torch.Generator().manual_seed(0))
    graph = capture(train_step, model, opt, batch)
    sharding = solve_stage(graph, MeshCost.from_cluster(Cluster.local(1, 1), (1, 1), (1, 1)))
    est = simulate_stage(graph, sharding)

    functional = OptimizerSet((opt,), {id(p): n for n, p in model.named_parameters()})
    values = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name in functional.names:
        values.update({f"{name}.{k}": v for k, v in functional.initial_state(name, values[name]).items()})
    io = {"inputs": [(s.kind, s.name, s.node) for s in graph.inputs],
          "outputs": [(s.kind, s.name, s.node) for s in graph.outputs]}
    runner = StageRunner(serialize_graph(graph.gm), {k: str(v) for k, v in sharding.value_specs.items()},
                         {k: [str(s) for s in v] for k, v in sharding.input_specs.items()}, io, _OneDevice("cpu"))
    runner.load_state({k: v.detach().clone().numpy() for k, v in values.items()})
    feed = {"batch.0": batch[0].numpy(), "batch.1": batch[1].numpy()}
    feed.update({k: v.numpy() for k, v in graph.loss_norms(feed).items()})  # the mean loss's count
    scalars = graph.host_inputs(functional.host_scalars())  # as Engine.step does
    runner.step(feed, scalars)  # the state now lives in the runtime's own tensors
    peak = [0]

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            peak[0] = max(peak[0], in_use())
            return out

    gc.collect()
    base = in_use()
    state = sum(v.numel() * v.element_size() for v in runner.state.values())
    with Probe():
        runner.step(feed, scalars)
    live = peak[0] - base + state
    assert live == pytest.approx(est.peak_bytes, rel=0.05), (live, est)


def test_plan_memory_matches_build_plan():
    """``build_plan`` reports the simulated peak of every stage (``plan_memory``)."""
    from alpa_torch.core.cluster import Cluster
    from alpa_torch.zoo import GPT, GPTConfig, _lm_batch, train_step
    from stage_dp.search import plan

    torch.manual_seed(0)
    model = GPT(GPTConfig.small(bias=False))
    graph = capture(train_step, model, torch.optim.SGD(model.parameters(), lr=0.1),
                    _lm_batch(GPTConfig.small().vocab_size, 8, torch.Generator().manual_seed(0)))
    p = plan(graph, Cluster.local(1, 2), num_stages=2, num_microbatches=2)
    est = plan_memory(graph, p.layer_of, [(s.layer_start, s.layer_end) for s in p.stages],
                      [s.sharding for s in p.stages], num_microbatches=2, schedule=p.schedule)
    assert [s.memory_bytes for s in p.stages] == [e.peak_bytes for e in est]
    assert p.peak_memory_bytes == max(e.peak_bytes for e in est)
    for _s, e in zip(p.stages, est):  # the optimizer's old and new state, gradients: above the DP's rule
        assert e.peak_bytes >= e.state_bytes + e.grad_bytes
        assert e.phase in ("forward", "backward", "update")


def test_a_split_backward_parks_what_its_weight_part_reads():
    """ZB-H1 (``core/schedule.py``) holds a microbatch until its weight part: with 4 microbatches the
    last of two stages holds up to two (1F1B: one), so its simulated peak is above 1F1B's and below
    GPipe's (all four held until their whole backward)."""
    from alpa_torch.core.cluster import Cluster
    from alpa_torch.zoo import GPT, GPTConfig, _lm_batch, train_step
    from stage_dp.search import plan

    torch.manual_seed(0)
    model = GPT(GPTConfig.small(bias=False))
    graph = capture(train_step, model, torch.optim.SGD(model.parameters(), lr=0.1),
                    _lm_batch(GPTConfig.small().vocab_size, 8, torch.Generator().manual_seed(0)))
    p = plan(graph, Cluster.local(1, 2), num_stages=2, num_microbatches=4, schedule="zb-h1")
    assert p.schedule == "zb-h1" and len(p.stages) == 2
    peaks = {name: plan_memory(graph, p.layer_of, [(s.layer_start, s.layer_end) for s in p.stages],
                               [s.sharding for s in p.stages], num_microbatches=4, schedule=name)
             for name in ("1f1b", "zb-h1", "gpipe")}
    assert [s.memory_bytes for s in p.stages] == [e.peak_bytes for e in peaks["zb-h1"]]
    last = {name: est[1] for name, est in peaks.items()}
    assert last["1f1b"].peak_bytes < last["zb-h1"].peak_bytes <= last["gpipe"].peak_bytes
    assert last["zb-h1"].parked_bytes <= last["1f1b"].parked_bytes  # one microbatch's forward values at most


def test_getitem_elements_are_made_with_their_producer():
    """A two-output operator's elements exist from the moment it runs (``getitem`` only names them)."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(100, device="meta")
    pair = g.call_function(aten.var_mean.correction, (x,))
    pair.meta["val"] = (torch.empty(100, device="meta"), torch.empty(100, device="meta"))
    a = g.call_function(operator.getitem, (pair, 0))
    a.meta["val"] = torch.empty(100, device="meta")
    b = g.call_function(operator.getitem, (pair, 1))
    b.meta["val"] = torch.empty(100, device="meta")
    s = g.call_function(aten.add.Tensor, (a, b))
    s.meta["val"] = torch.empty(1, device="meta")
    g.output((s,))
    gm = fx.GraphModule({}, g)
    facts = {n.name: SimpleNamespace(name=n.name, target="aten.x", phase="forward",
                                     inputs=tuple(i.name for i in n.all_input_nodes),
                                     is_view=n.target is operator.getitem)
             for n in gm.graph.nodes if n.op == "call_function"}
    graph = SimpleNamespace(gm=gm, nodes=facts, inputs=(SimpleNamespace(kind="batch", name="x", node="x",
                                                                        shape=(100,)),),
                            outputs=(SimpleNamespace(kind="loss", name="loss", node=s.name),))
    est = simulate_stage(graph, _sharding())
    assert est.peak_bytes == 1200 and est.node == pair.name  # x + both elements, before x is freed
    assert GRAD_MARKER_NAME == "alpa.grad.default"


def test_views_of_cast_weights_alias_so_the_rule_counts_what_the_backward_keeps():
    """Under autocast the forward multiplies ``t(_to_copy(weight))``, a view of the weight's bf16
    copy, and the backward keeps it. Were the view allowed to gather the sharded copy into its
    input, the gathered weight would be kept to the backward while the ILP's memory row counted
    the copy at its sharded size (LLaMA-3-8B, one stage on 8x8 V100: 14 GiB per device that the
    stage DP's rule did not see). The view keeps its source's layout, and the bytes the ILP counts
    for activations are what the simulation parks between forward and backward."""
    from alpa_torch.core.cluster import Cluster
    from alpa_torch.zoo import GPT, GPTConfig, make_optimizer, train_step
    from intra_ilp.cost_model import MeshCost
    from intra_ilp.stage import solve_stage

    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=1024)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(2, 64, dtype=torch.long)
    graph = capture(train_step, model, make_optimizer("adamw", model), (idx, idx.clone()), precision="bf16")
    sharding = solve_stage(graph, MeshCost.from_cluster(Cluster.simulated(1, 4, "a100-80gb"), (1, 4), (1, 4)),
                           mip_gap=1e-4)
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    stored = {s.node for s in graph.inputs if s.kind == "param"}
    casts = {n for n in graph.nodes
             if nodes[n].target is aten._to_copy.default and nodes[n].all_input_nodes[0].name in stored}
    views = [n for n, f in graph.nodes.items() if f.is_view and nodes[n].all_input_nodes[0].name in casts]
    assert casts and views
    for name in views:
        src = nodes[name].all_input_nodes[0].name
        assert sharding.input_specs[name][0] == sharding.value_specs[src], name
    parked = simulate_stage(graph, sharding, engine=False).parked_bytes
    assert parked == pytest.approx(sharding.activation_bytes, rel=1e-3)
