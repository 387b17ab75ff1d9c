"""What a solved layer ILP costs, split the way the stage DP prices it (``stage_costs``).

Owns: the chosen strategies' compute, collective and resharding seconds per phase
(forward/backward, update), the fixed parts every microbatch pays in full (operator
overhead, collective latency), the gradient reductions re-priced as the runtime runs
them (once a step, in buckets: ``bucketed_edges``) and the gradient accumulation each
microbatch after the first pays (``accumulate_s``). Does not own the ILP (``intra_ilp``) nor how the parts are
summed over layers and stages (``stage_costs``, ``search``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import numpy as np
import torch

from alpa_torch.core.grad_op import GRAD_MARKER_NAME
from alpa_torch.core.grad_reductions import BUCKET_CAP_BYTES, find_reductions
from alpa_torch.core.spec import P, R, ShardingSpec, to_dtensor_placements
from intra_ilp import cost_model as cm
from intra_ilp.reshard_paths import reshard_path, reshard_s


def node_val(node):
    """The fake tensor (or other value) tracing recorded for an fx node."""
    return node.meta.get("val")


def phase_parts(instance, choice, graph, ops: set[str], skip: frozenset[int] = frozenset()) -> dict[str, float]:
    """ILP cost of the chosen strategies split by phase and kind. Nodes count by their
    own phase, and only those in ``ops``: a source produced by an operator of another
    layer is that layer's cost (older ``build_stage_instance`` priced it in both).
    Edges count in the consumer's phase (an edge into a stored input, i.e. an updated
    state written back, is update), except the edges at ``skip`` (indices into
    ``instance.edges``: the gradient reductions ``bucketed_edges`` prices instead)."""
    acc: dict[tuple[str, str], list[float]] = {(ph, kind): [] for ph in ("fb", "update")
                                                for kind in ("compute", "comm", "reshard")}

    def phase(name, placeholder):
        node = graph.nodes.get(name)
        return placeholder if node is None else "update" if node.phase == "update" else "fb"

    for i, node in enumerate(instance.nodes):
        if node.name in ops:  # a placeholder here is a batch input, loaded per microbatch
            acc[phase(node.name, "fb"), "compute"].append(float(node.compute_s[choice[i]]))
            acc[phase(node.name, "fb"), "comm"].append(float(node.comm_s[choice[i]]))
    for k, e in enumerate(instance.edges):
        if k not in skip:
            acc[phase(instance.nodes[e.dst].name, "update"), "reshard"].append(
                float(e.reshard_s[choice[e.src], choice[e.dst]]))
    return {f"{kind}_{ph}": math.fsum(v) for (ph, kind), v in acc.items()}


def fixed_fb_parts(instance, choice, graph, ops: set[str], builder, mesh: cm.MeshCost,
                   fx_nodes, skip: frozenset[int] = frozenset()) -> tuple[float, float]:
    """(operator overhead, collective latency) of the layer's forward/backward under ``choice``:
    ``mesh.op_overhead_s`` per forward/backward operator of ``ops`` the runtime runs (not a
    ``getitem`` nor a gradient marker), and α of every collective on the cheapest reshard
    path (``cost_model.reshard_path``) of each forward/backward edge the choice pays for,
    but those at ``skip`` (as ``phase_parts``). Both are per microbatch whatever its size
    (``tables.build_tables``)."""

    ran = 0
    for name in ops:
        facts, node = graph.nodes.get(name), fx_nodes.get(name)
        if facts is None or node is None or facts.phase == "update":
            continue
        if node.target is operator.getitem or str(node.target) == GRAD_MARKER_NAME:
            continue
        ran += 1
    latency = 0.0
    for k, e in enumerate(instance.edges):
        dst_name, src_name = instance.nodes[e.dst].name, instance.nodes[e.src].name
        facts = graph.nodes.get(dst_name)
        if k in skip or facts is None or facts.phase == "update" or not e.reshard_s[choice[e.src], choice[e.dst]] > 0:
            continue
        dst_node = fx_nodes[dst_name]
        tensor_inputs = [a.name for a in dst_node.all_input_nodes if isinstance(node_val(a), torch.Tensor)]
        if src_name not in tensor_inputs:
            continue
        j = tensor_inputs.index(src_name)
        src_st, dst_st = builder.options[src_name][choice[e.src]], builder.options[dst_name][choice[e.dst]]
        src_spec = src_st.outputs[0] if src_st.outputs and src_st.outputs[0] else None
        if src_spec is None or j >= len(dst_st.inputs):
            continue
        val = node_val(fx_nodes[src_name])
        latency += latency_s(mesh, src_spec, dst_st.inputs[j], tuple(val.shape), val.element_size())
    return ran * mesh.op_overhead_s, latency


def accumulate_s(instance, choice, ops: set[str], builder, mesh: cm.MeshCost, fx_nodes) -> float:
    """Seconds to add one microbatch's gradients of the layer into the step's sums under
    ``choice``: the pipeline runtime keeps one sum per gradient marker and adds each later
    microbatch's local summand to it (``runtime.pipeline.PipelineRunner._grad``), an
    elementwise add that reads two summands and writes one (``cost_model.operator_s``).
    Paid B - 1 times a step (``tables.build_tables``). The local summand is the marker's
    chosen spec on this device (a partial gradient is full-sized)."""
    out = []
    for i, node in enumerate(instance.nodes):
        fx_node = fx_nodes.get(node.name)
        if node.name not in ops or fx_node is None or str(fx_node.target) != GRAD_MARKER_NAME:
            continue
        st, val = builder.options[node.name][choice[i]], node_val(fx_node)
        if not st.outputs or st.outputs[0] is None or not isinstance(val, torch.Tensor):
            continue
        nbytes = cm.bytes_per_device(st.outputs[0], tuple(val.shape), val.element_size(), mesh.mesh_shape)
        out.append(cm.operator_s(mesh, 0.0, 3.0 * nbytes))
    return math.fsum(out)


def latency_s(mesh: cm.MeshCost, src, dst, shape, itemsize: int) -> float:
    """α of every collective on the cheapest reshard path from ``src`` to ``dst``."""
    steps = reshard_path(mesh, src, dst, tuple(shape), itemsize)
    return math.fsum(mesh.axis_alpha_s(st.axis) for st in steps if st.collective not in ("slice", "zero", "relabel"))


def bucketed_edges(instance, choice, ops: set[str], builder, mesh: cm.MeshCost,
                   fx_nodes) -> tuple[frozenset[int], float]:
    """The layer's gradient reductions priced as the runtime runs them, not as the ILP did:
    ``(edges, update_s)``.

    The ILP prices a partial gradient's reduction at the edge where its choice reduces it,
    in backward, with the α of each collective, per microbatch. The runtime finds those
    reductions with ``alpa_torch.core.grad_reductions.find_reductions`` (the same rule,
    run here on the chosen specs) and runs each once a step, after the last microbatch,
    in flat buckets of ``BUCKET_CAP_BYTES``. ``edges``: indices into ``instance.edges`` of
    the chains' edges (the marker's input and those of the layout records the runtime
    defers, or the marker's readers when the gradient stays partial through it), which
    ``phase_parts`` and ``fixed_fb_parts`` leave out; ``update_s``: one all-reduce of each
    gradient's local summand instead (``bucket_s``). A chain that leaves the layer is
    ``stitching.Stitching``'s. The ILP chose by the same prices (``with_bucketed_gradients``)."""
    index = {node.name: i for i, node in enumerate(instance.nodes)}
    chosen = {name: builder.options[name][choice[i]] for name, i in index.items()}
    value_specs = {n: to_dtensor_placements(st.outputs[0]) for n, st in chosen.items()
                   if st.outputs and st.outputs[0] is not None}
    input_specs = {n: [to_dtensor_placements(s) for s in st.inputs] for n, st in chosen.items()
                   if n in ops and st.inputs and all(s is not None for s in st.inputs)}
    records = [(fx_nodes[n].op, n, str(fx_nodes[n].target), None, None,
                tuple(a.name for a in fx_nodes[n].all_input_nodes)) for n in ops if n in index]
    edges: set[int] = set()
    update_s: list[float] = []
    for red in find_reductions(records, value_specs, input_specs, GRAD_MARKER_NAME).values():
        marker = chosen[red.marker].outputs[0]
        if any(marker.placements[a].is_partial for a in red.axes):  # reduced at its readers
            ends = {(red.marker, u.name) for u in fx_nodes[red.marker].users}
        else:  # reduced on the way to it
            ends = {(fx_nodes[n].all_input_nodes[0].name, n) for n in (red.marker, *red.deferred)}
        if not ops.issuperset(name for end in ends for name in end):
            continue
        edges |= {k for k, e in enumerate(instance.edges)
                  if (instance.nodes[e.src].name, instance.nodes[e.dst].name) in ends}
        val = node_val(fx_nodes[red.marker])
        update_s.append(bucket_s(mesh, marker, red.axes, tuple(val.shape), val.element_size()))
    return frozenset(edges), math.fsum(update_s)


def with_bucketed_gradients(instance, builder, mesh: cm.MeshCost, fx_nodes):
    """A copy of ``instance`` whose edges into gradient markers cost what the runtime pays for
    them: where it reduces the gradient in a bucket (``bucketed_edge``), one gradient's share
    of the bucket (``bucket_s``) instead of a collective of its own with its own α.

    ``bucketed_edges`` prices the solved layer that way; the ILP must choose by the same
    prices, or it avoids small partial gradients whose reductions cost it an α each and the
    runtime almost nothing: a GPT's embedding layer on a (2, 1) mesh then ran its embedding
    and first LayerNorm on the whole batch to keep their gradients replicated, and
    all-gathered three activation gradients of the whole batch every microbatch for it
    (the data-parallel step of ``bench/vs_pytorch.py``'s deep GPT on 1x2: about 5 % slower)."""
    flat = [axis for axis, n in enumerate(mesh.mesh_shape) if n == 1]

    def plain(spec) -> bool:
        # no placement on an axis of one device: discounted too, a (2, 1) plan kept its gradients
        # PP / S(0)S(0), which DTensor runs its own slow way (280-291 ms a step against 100)
        return spec is not None and all(spec.placements[axis] == R for axis in flat)

    memo: dict[tuple, np.ndarray] = {}
    edges = []
    for edge in instance.edges:
        dst = instance.nodes[edge.dst].name
        if str(fx_nodes[dst].target) != GRAD_MARKER_NAME:
            edges.append(edge)
            continue
        src_opts, marker_opts = builder.options[instance.nodes[edge.src].name], builder.options[dst]
        val = node_val(fx_nodes[dst])
        key = (id(src_opts), id(marker_opts), tuple(val.shape), val.element_size())
        if key not in memo:
            matrix = np.array(edge.reshard_s, dtype=np.float64)
            for a, st in enumerate(src_opts):
                have = st.outputs[0] if st.outputs else None
                for b, marker in enumerate(mk.outputs[0] for mk in marker_opts):
                    axes = _bucketed_axes(have, marker) if plain(have) and plain(marker) else None
                    if axes is not None:
                        matrix[a, b] = bucket_s(mesh, marker, axes, key[2], key[3])
            memo[key] = matrix
        edges.append(dataclasses.replace(edge, reshard_s=memo[key]))
    return dataclasses.replace(instance, edges=tuple(edges))


@functools.lru_cache(maxsize=4096)
def _bucketed_axes(have: ShardingSpec, marker: ShardingSpec) -> tuple[int, ...] | None:
    return bucketed_edge(have, marker, marker)


def bucket_s(mesh: cm.MeshCost, spec: ShardingSpec, axes, shape, itemsize: int) -> float:
    """One gradient's share of a bucket's all-reduce over ``axes`` (the runtime all-reduces a
    gradient it keeps sharded, then takes its chunk): the bandwidth of its local summand,
    and the α of one collective times its share of ``BUCKET_CAP_BYTES``."""
    partial, whole = list(spec.placements), list(spec.placements)
    for a in axes:
        partial[a], whole[a] = P, R
    src, dst = ShardingSpec(tuple(partial)), ShardingSpec(tuple(whole))
    alpha = latency_s(mesh, src, dst, shape, itemsize)
    nbytes = src.local_numel(shape, mesh.mesh_shape) * itemsize
    return reshard_s(mesh, src, dst, shape, itemsize) - alpha + alpha * nbytes / BUCKET_CAP_BYTES


def bucketed_edge(src_spec: ShardingSpec, want: ShardingSpec, marker_spec: ShardingSpec) -> tuple[int, ...] | None:
    """The mesh axes the runtime reduces in a bucket where a gradient marker's input arrives
    from another layer as ``src_spec`` and the plan wants ``want`` (``find_reductions`` on
    the two records); None where it runs the edge as the plan says."""
    records = [("call_function", "src", "producer", None, None, ()),
               ("call_function", "marker", GRAD_MARKER_NAME, None, None, ("src",))]
    return _marker_axes(records, {"src": src_spec, "marker": marker_spec}, {"marker": [want]})


def bucketed_at_readers(marker_spec: ShardingSpec, wants: list[ShardingSpec]) -> tuple[int, ...] | None:
    """The mesh axes the runtime reduces in a bucket where the plan keeps a gradient partial
    through its marker and its readers (in other layers too) want ``wants``; None where
    each reader reduces it as the plan says."""
    readers = [f"reader{k}" for k in range(len(wants))]
    records = [("call_function", "marker", GRAD_MARKER_NAME, None, None, ())]
    records += [("call_function", r, "reader", None, None, ("marker",)) for r in readers]
    return _marker_axes(records, {"marker": marker_spec}, {r: [w] for r, w in zip(readers, wants)})


def _marker_axes(records, value_specs, input_specs) -> tuple[int, ...] | None:
    found = find_reductions(records, {k: to_dtensor_placements(v) for k, v in value_specs.items()},
                            {k: [to_dtensor_placements(s) for s in v] for k, v in input_specs.items()},
                            GRAD_MARKER_NAME)
    return found["marker"].axes if "marker" in found else None
