"""What a solved layer ILP costs, split the way the stage DP prices it (``stage_costs``).

Owns: the chosen strategies' compute, collective and resharding seconds per phase
(forward/backward, update), and the fixed parts every microbatch pays in full (operator
overhead, collective latency). Does not own the ILP (``intra_ilp``) nor how the parts are
summed over layers and stages (``stage_costs``, ``search``).
"""

from __future__ import annotations

import math
import operator

import torch

from alpa_torch.core.grad_op import GRAD_MARKER_NAME
from intra_ilp import cost_model as cm


def node_val(node):
    """The fake tensor (or other value) tracing recorded for an fx node."""
    return node.meta.get("val")


def phase_parts(instance, choice, graph, ops: set[str]) -> dict[str, float]:
    """ILP cost of the chosen strategies split by phase and kind. Nodes count by their
    own phase, and only those in ``ops``: a source produced by an operator of another
    layer is that layer's cost (older ``build_stage_instance`` priced it in both).
    Edges count in the consumer's phase (an edge into a stored input, i.e. an updated
    state written back, is update)."""
    acc: dict[tuple[str, str], list[float]] = {(ph, kind): [] for ph in ("fb", "update")
                                                for kind in ("compute", "comm", "reshard")}

    def phase(name, placeholder):
        node = graph.nodes.get(name)
        return placeholder if node is None else "update" if node.phase == "update" else "fb"

    for i, node in enumerate(instance.nodes):
        if node.name in ops:  # a placeholder here is a batch input, loaded per microbatch
            acc[phase(node.name, "fb"), "compute"].append(float(node.compute_s[choice[i]]))
            acc[phase(node.name, "fb"), "comm"].append(float(node.comm_s[choice[i]]))
    for e in instance.edges:
        acc[phase(instance.nodes[e.dst].name, "update"), "reshard"].append(
            float(e.reshard_s[choice[e.src], choice[e.dst]]))
    return {f"{kind}_{ph}": math.fsum(v) for (ph, kind), v in acc.items()}


def fixed_fb_parts(instance, choice, graph, ops: set[str], builder, mesh: cm.MeshCost,
                    fx_nodes) -> tuple[float, float]:
    """(operator overhead, collective latency) of the layer's forward/backward under ``choice``:
    ``mesh.op_overhead_s`` per forward/backward operator of ``ops`` the runtime runs (not a
    ``getitem`` nor a gradient marker), and α of every collective on the cheapest reshard
    path (``cost_model.reshard_path``) of each forward/backward edge the choice pays for.
    Both are per microbatch whatever its size (``search.build_tables``)."""

    ran = 0
    for name in ops:
        facts, node = graph.nodes.get(name), fx_nodes.get(name)
        if facts is None or node is None or facts.phase == "update":
            continue
        if node.target is operator.getitem or str(node.target) == GRAD_MARKER_NAME:
            continue
        ran += 1
    latency = 0.0
    for e in instance.edges:
        dst_name, src_name = instance.nodes[e.dst].name, instance.nodes[e.src].name
        facts = graph.nodes.get(dst_name)
        if facts is None or facts.phase == "update" or not e.reshard_s[choice[e.src], choice[e.dst]] > 0:
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


def latency_s(mesh: cm.MeshCost, src, dst, shape, itemsize: int) -> float:
    """α of every collective on the cheapest reshard path from ``src`` to ``dst``."""
    steps = cm.reshard_path(mesh, src, dst, tuple(shape), itemsize)
    return math.fsum(mesh.axis_alpha_s(st.axis) for st in steps if st.collective not in ("slice", "zero", "relabel"))
