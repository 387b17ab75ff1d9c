"""Capture a forward-only function of a model (an evaluation, inference) as one ``OpGraph``.

``fn(model, batch)`` computes something from the model without training it: a validation
loss, metrics, logits, or a greedy generation loop that calls the model several times.
It is traced like a training step (``tracing.py``: fake tensors, functional aten), under
``torch.no_grad()``: no backward, no optimizer. The graph's inputs are the model's
parameters and buffers and the batch's tensor leaves; its outputs (kind ``output``) are
the tensor leaves of what ``fn`` returns, in order. ``graph.meta['result']`` keeps how to
rebuild the return value (its pytree and its non-tensor leaves, which are constants of
the capture).

A function that writes a buffer (BatchNorm in train mode updates its running
statistics) is refused by name: evaluation leaves the model as it is, so call
``model.eval()`` first.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from alpa_torch.core.errors import CaptureError
from alpa_torch.core.grad_op import GRAD_MARKER
from alpa_torch.core.graph import IOSpec, OpGraph
from alpa_torch.core.graph_facts import build_nodes

from .capture import PRECISIONS, check_precision
from .tracing import Inputs, traced


def capture_forward(fn: Callable, model: torch.nn.Module, batch: Any, precision: str = "fp32",
                    device_type: str | None = None) -> OpGraph:
    """Trace ``fn(model, batch)`` (forward only, module docstring) into an ``OpGraph`` (``device_type``:
    as ``capture``'s)."""
    t0 = time.perf_counter()
    check_precision(precision)
    ins = Inputs()
    for name, p in model.named_parameters():
        ins.add("param", name, p.detach())
    for name, b in model.named_buffers():
        ins.add("buffer", name, b.detach())
    leaves, spec = pytree.tree_flatten(batch)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            ins.add("batch", f"batch.{i}", leaf)
    names = [n for _, n in ins.specs]
    buffer_names = [n for k, n in ins.specs if k == "buffer"]
    result: dict[str, Any] = {}
    device = next((v.device.type for v in ins.values if v.device.type != "meta"), "cpu")
    dtype = PRECISIONS[precision]

    def forward(*flat):
        by_name = dict(zip(names, flat))
        state = {n: by_name[n] for k, n in ins.specs if k in ("param", "buffer")}
        args = pytree.tree_unflatten([by_name[f"batch.{i}"] if isinstance(v, torch.Tensor) else v
                                      for i, v in enumerate(leaves)], spec)
        autocast = torch.autocast(device, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with torch.no_grad(), _reparametrize_module(model, state, tie_weights=True), autocast:
            out = fn(model, args)
            new_buffers = [b for _, b in model.named_buffers()]
        out_leaves, out_spec = pytree.tree_flatten(out)
        result["spec"] = out_spec
        result["constants"] = [None if isinstance(v, torch.Tensor) else v for v in out_leaves]
        return [v for v in out_leaves if isinstance(v, torch.Tensor)] + new_buffers

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    gm = traced(forward, ins.values, mode, "the forward function", device_type or device)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = list(output.args[0])
    tensors = returned[:len(returned) - len(buffer_names)]
    buffer_node = {n: ph for (k, n), ph in zip(ins.specs, placeholders) if k == "buffer"}
    written = [n for n, r in zip(buffer_names, returned[len(tensors):]) if r is not buffer_node[n]]
    if written:
        raise CaptureError(
            f"the forward function writes the model's buffer {written[0]} (BatchNorm in train mode updates its "
            "running statistics), so it is not an evaluation. Fix: call model.eval() before evaluating")
    output.args = (tensors,)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    inputs = tuple(IOSpec(kind, name, tuple(v.shape), str(v.dtype).removeprefix("torch."), ph.name)
                   for (kind, name), v, ph in zip(ins.specs, ins.values, placeholders))
    outputs = tuple(IOSpec("output", f"out.{i}", tuple(r.meta["val"].shape),
                           str(r.meta["val"].dtype).removeprefix("torch."), r.name) for i, r in enumerate(tensors))
    nodes, _ = build_nodes(gm, inputs, outputs, [], GRAD_MARKER)
    graph = OpGraph(gm=gm, inputs=inputs, outputs=outputs, nodes=nodes, grad_of={}, param_groups={})
    graph.meta.update(result=result, capture_s=time.perf_counter() - t0, model=type(model).__name__,
                      precision=precision, forward_only=True)
    return graph


def rebuild(graph: OpGraph, tensors: list[torch.Tensor]) -> Any:
    """``fn``'s return value from the graph's output tensors (``graph.meta['result']``)."""
    it = iter(tensors)
    leaves = [next(it) if c is None else c for c in graph.meta["result"]["constants"]]
    return pytree.tree_unflatten(leaves, graph.meta["result"]["spec"])
