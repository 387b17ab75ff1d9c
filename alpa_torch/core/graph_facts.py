"""Per-node facts of a captured graph: phase, FLOPs, bytes moved.

Phases come from dataflow, not from trace order, so they survive
functionalization:

- update   = every node reachable from a gradient marker or from an optimizer
             state / host scalar input (clipping, the optimizer maths), and every
             node neither forward nor backward: what only the update reads (the
             float32 copy AdamW's maths makes of a bfloat16 parameter), which a
             pipeline computes once a step in its update program (as backward it was
             computed in each microbatch's backward, and the update found no such value);
- forward  = ancestors of the loss and of the updated buffers, not update;
- backward = the other ancestors of the gradient markers.

FLOPs use PyTorch's own formulas (``torch.utils.flop_counter``, the table
behind ``FlopCounterMode``); an operator it does not know is counted as one
FLOP per output element, which is right for the elementwise majority.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from .graph import IOSpec, OpNode

log = logging.getLogger(__name__)

aten = torch.ops.aten

VIEW_OPS = frozenset(
    {
        aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
        aten.transpose.int, aten.permute.default, aten.expand.default, aten.unsqueeze.default,
        aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.slice.Tensor,
        aten.select.int, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int,
        aten.as_strided.default, aten.alias.default, aten.detach.default,
    }
)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def node_flops(node: fx.Node) -> float:
    """FLOPs of one node from PyTorch's formula table (fallback: output numel)."""
    out = node.meta.get("val")
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    fn = flop_registry.get(packet) if packet is not None else None
    if fn is not None:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        try:
            return float(fn(*args, out_val=out, **kwargs))
        except Exception as exc:  # noqa: BLE001 - a formula that cannot read these args: fall back
            log.info("the FLOP formula of %s failed on %s (%s: %s): counting one FLOP per output element",
                     target, node.name, type(exc).__name__, exc)
    if target in VIEW_OPS or target is operator.getitem:
        return 0.0
    return float(sum(t.numel() for t in _tensors(out)))


def _reach(start: set[str], nodes: list[fx.Node], forward: bool) -> set[str]:
    """Names reachable from ``start`` along users (forward) or inputs (backward)."""
    seen = set(start)
    order = nodes if forward else list(reversed(nodes))
    for n in order:
        if forward:
            if any(a.name in seen for a in n.all_input_nodes):
                seen.add(n.name)
        elif n.name in seen:
            seen.update(a.name for a in n.all_input_nodes)
    return seen


def _phases(gm: fx.GraphModule, inputs, outputs, marker) -> dict[str, str]:
    nodes = list(gm.graph.nodes)
    markers = {n.name for n in nodes if n.target is marker}
    sources = markers | {s.node for s in inputs if s.kind in ("opt_state", "host_scalar")}
    update = _reach(sources, nodes, forward=True) - markers
    roots = {s.node for s in outputs if s.kind in ("loss", "buffer", "output")}
    forward = _reach(roots, nodes, forward=False) - update
    backward = _reach(markers, nodes, forward=False) - update - forward
    return {
        n.name: "forward" if n.name in forward else "backward" if n.name in backward else "update"
        for n in nodes
        if n.op == "call_function"
    }


def build_nodes(gm, inputs: tuple[IOSpec, ...], outputs, opt_names: list[str], marker):
    """``OpNode`` per call_function node, and parameter -> gradient node name."""
    phases = _phases(gm, inputs, outputs, marker)
    nodes: dict[str, OpNode] = {}
    grad_of: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is marker:
            grad_of[opt_names[n.args[1]]] = n.name  # the last marker of a parameter wins
        out = _tensors(n.meta.get("val"))
        ins = {a.name: a for a in n.all_input_nodes}
        is_view = n.target in VIEW_OPS or n.target is operator.getitem
        read = 0 if is_view else sum(_nbytes(t) for a in ins.values() for t in _tensors(a.meta.get("val")))
        written = 0 if is_view else sum(_nbytes(t) for t in out)
        nodes[n.name] = OpNode(
            name=n.name,
            target=str(n.target),
            phase=phases[n.name],
            inputs=tuple(ins),
            shape=tuple(out[0].shape) if out else None,
            dtype=str(out[0].dtype).removeprefix("torch.") if out else None,
            flops=node_flops(n),
            bytes_read=read,
            bytes_written=written,
            is_view=is_view,
            stack=n.meta.get("stack_trace", "") or "",
        )
    return nodes, grad_of
