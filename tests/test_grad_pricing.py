"""The cost model prices gradient reductions as the runtime runs them (``runtime/grad_buckets.py``):
once a step, in flat buckets, wherever the ILP's solution placed the reduction
(``stage_dp.layer_parts.bucketed_edges``; the rule itself is ``alpa_torch.core.grad_reductions``)."""

from __future__ import annotations

import pytest
import torch

from alpa_torch.capture import capture
from alpa_torch.core.cluster import Cluster
from alpa_torch.core.grad_op import GRAD_MARKER_NAME
from alpa_torch.core.grad_reductions import BUCKET_CAP_BYTES, find_reductions
from alpa_torch.core.spec import to_dtensor_placements
from alpa_torch.zoo import GPT, GPTConfig, _lm_batch, train_step
from intra_ilp import cost_model as cm
from stage_dp import assign_layers
from stage_dp.layer_parts import latency_s
from stage_dp.stage_costs import StageCostModel


@pytest.fixture(scope="module")
def graph():
    """Large enough per device (batch 32 of 64 tokens) that the ILP shards the batch."""
    cfg = GPTConfig(vocab_size=1024, block_size=64, n_layer=2, n_head=4, n_embd=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return capture(train_step, model, opt, _lm_batch(cfg.vocab_size, 32, torch.Generator().manual_seed(0)))


def _stage(graph, shape):
    layers = assign_layers(graph, 2)
    model = StageCostModel(graph, Cluster.local(*shape), layers, sharding=False)
    cfg = next(c for c in model.configs if c.variant == "fast" and tuple(c.submesh) == shape)
    last = layers.num_layers - 1
    return model, cfg, model.mesh_cost(cfg), model.range_costs(cfg), model.stage_sharding(0, last, cfg), last


def _runtime_reductions(graph, sharding):
    """What the runtime's ``StageRunner`` finds in this stage plan (its own call, its own records)."""
    fx = {n.name: n for n in graph.gm.graph.nodes}
    records = [(n.op, n.name, str(n.target), None, None, tuple(a.name for a in n.all_input_nodes))
               for n in fx.values() if n.name in graph.nodes]
    value_specs = {k: to_dtensor_placements(v) for k, v in sharding.value_specs.items()}
    input_specs = {k: [to_dtensor_placements(s) for s in v] for k, v in sharding.input_specs.items()}
    return fx, find_reductions(records, value_specs, input_specs, GRAD_MARKER_NAME)


@pytest.mark.parametrize("shape", [(1, 2), (2, 2)])
def test_a_data_parallel_stage_pays_each_bucketed_gradient_once_a_step(graph, shape):
    """The update's collectives are exactly the all-reduces of the gradients the runtime buckets:
    per gradient its bandwidth and its share of one α per ``BUCKET_CAP_BYTES``."""
    model, cfg, mesh, rc, sharding, last = _stage(graph, shape)
    fx, reductions = _runtime_reductions(graph, sharding)
    assert len(reductions) >= 10
    (axis,) = [a for a, n in enumerate(mesh.mesh_shape) if n > 1]
    alpha = mesh.axis_alpha_s(axis)
    expected = 0.0
    for red in reductions.values():
        assert red.axes == (axis,)
        val = fx[red.marker].meta["val"]
        nbytes = val.numel() * val.element_size()  # data parallel: every gradient whole on every device
        expected += cm.allreduce_s(mesh, axis, nbytes) - alpha + alpha * nbytes / BUCKET_CAP_BYTES
    assert rc.comm_update_s[0, last] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("shape", [(1, 2), (2, 2)])
def test_no_alpha_of_a_bucketed_gradient_is_left_in_forward_backward(graph, shape):
    """Forward/backward keeps the α of every collective the stage plan runs per microbatch, and
    none of the reductions the runtime moves into buckets (the marker's input and the deferred
    layout records' inputs)."""
    model, cfg, mesh, rc, sharding, last = _stage(graph, shape)
    fx, reductions = _runtime_reductions(graph, sharding)
    bucketed = {(fx[name].all_input_nodes[0].name, name) for red in reductions.values()
                for name in (red.marker, *red.deferred)}
    batch = {s.node for s in graph.inputs if s.kind == "batch"}
    kept, moved = [], []
    for name, facts in graph.nodes.items():
        node = fx[name]
        if facts.phase == "update" or name not in sharding.input_specs:
            continue
        tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        for a, want in zip(tensors, sharding.input_specs[name]):
            have = sharding.value_specs.get(a.name)
            if have is None or have == want or (a.name in batch and want.is_replicated):
                continue
            val = a.meta["val"]
            alpha = latency_s(mesh, have, want, tuple(val.shape), val.element_size())
            (moved if (a.name, name) in bucketed else kept).append(alpha)
    assert moved and sum(kept) < sum(moved)
    assert rc.latency_fb_s[0, last] == pytest.approx(sum(kept), rel=1e-9)


def test_a_stage_pays_the_gradient_accumulation_of_every_microbatch_after_the_first(graph):
    """A pipeline adds each later microbatch's local gradient summands into the step's sums
    (``runtime.pipeline.PipelineRunner._grad``): per gradient marker one add reading two
    summands and writing one, at the marker's planned spec; B - 1 of them a step."""
    from stage_dp.tables import build_tables

    model, cfg, mesh, rc, sharding, last = _stage(graph, (1, 2))
    fx = {n.name: n for n in graph.gm.graph.nodes}
    markers = [n for n in graph.nodes if str(fx[n].target) == GRAD_MARKER_NAME]
    assert len(markers) >= 10
    expected = 0.0
    for name in markers:
        val = fx[name].meta["val"]
        nbytes = cm.bytes_per_device(sharding.value_specs[name], tuple(val.shape), val.element_size(),
                                     mesh.mesh_shape)
        expected += cm.operator_s(mesh, 0.0, 3.0 * nbytes)
    assert rc.accumulate_s[0, last] == pytest.approx(expected, rel=1e-9)
    s = model.submeshes.index(tuple(cfg.submesh))
    cols = [[cfg] if i == s else [] for i in range(len(model.submeshes))]
    one, four = (build_tables(model, cols, b, float("inf"), "1f1b", 1.0).cost_s[0, last, s, 0] for b in (1, 4))
    fixed = rc.overhead_fb_s[0, last] + rc.latency_fb_s[0, last]
    variable = one - fixed
    assert four - (variable / 4 + fixed) == pytest.approx(expected * 3 / 4, rel=1e-6)


@pytest.mark.parametrize("shape", [(1, 2), (2, 2)])
def test_the_ilp_chooses_by_the_bucketed_prices(graph, shape):
    """The layer ILPs weigh a gradient reduction at what the runtime pays for it in a bucket, not
    at a collective with its own α: data parallel then splits the batch from the embedding on,
    where the ILP used to run the embedding and the first LayerNorm on the whole batch (keeping
    their small gradients replicated, to dodge their α) and all-gather the blocks' activation
    gradients of the whole batch for it, every microbatch."""
    model, cfg, mesh, rc, sharding, last = _stage(graph, shape)
    fx = {n.name: n for n in graph.gm.graph.nodes}
    batch = next(s for s in graph.inputs if s.kind == "batch").shape[0]
    whole = [name for name, facts in graph.nodes.items() if facts.phase != "update"
             and isinstance(val := fx[name].meta.get("val"), torch.Tensor) and val.dim() == 3
             and val.shape[0] == batch and sharding.value_specs[name].is_replicated]
    assert not whole, whole
