"""Capture a plain training step as one functional aten graph (``OpGraph``).

The user writes ``train_step(model, optimizer, batch)``: zero_grad, forward,
loss, ``loss.backward()``, ``optimizer.step()``, return loss. We trace it in
one or two passes, on fake tensors (no memory for weights, so a GPT-39B can be
captured on a laptop; a model built on the ``meta`` device works too):

1. ``make_fx`` runs the user's function with the module's parameters swapped
   for traced leaves (``_reparametrize_module``). Real autograd runs, so the
   backward operators are recorded. The optimizer the step receives is a
   stand-in whose ``step()`` runs the user's optimizer's own ``step()``,
   functionalized (``alpa_torch.optim.OptimizerSet.update``), on the traced
   leaves, and each gradient is
   passed through the identity marker ``alpa.grad`` when ``.backward()``
   returns, so the gradient boundary stays visible in the graph.
2. where that graph writes into a tensor, ``functionalize`` re-traces it:
   in-place ops (BatchNorm's running statistics, ``clip_grad_norm_``'s
   scaling, ``x += y``) become pure ops whose results are graph outputs. A
   graph without one is already functional (the functionalized update, autograd's
   gradients as values; most Hugging Face models) and is not traced again: the
   second pass was 40 % of capturing LLaMA-3-8B.

Mixed precision (``precision='bf16'`` or ``'fp16'``): the user's step runs
under ``torch.autocast`` while it is traced, so the graph holds autocast's own
casts (weights cast to bf16/fp16 before each matmul, the loss in fp32) as plain
``_to_copy`` operators. ``loss.backward()`` and ``optimizer.step()`` run with
autocast off, as in eager code that autocasts only the forward: gradients of
the fp32 parameters are fp32, and parameters and optimizer state stay fp32
(master weights). With fp16 the loss is scaled before backward and each
gradient unscaled right after it (so a clip between backward and step sees
true gradients), and the update is skipped in the graph when a gradient is not
finite (``optim.LossScaler``: its state is optimizer state named ``amp.*``).

What this module does not do: decide shardings or stages (``intra_ilp``,
``stage_dp``), or run anything distributed (``runtime``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.nn.utils.stateless import _reparametrize_module

from alpa_torch.core.errors import CaptureError, LossError, PlanError
from alpa_torch.core.grad_op import GRAD_MARKER, grad_marker
from alpa_torch.core.graph import IOSpec, OpGraph, optimizers_of
from alpa_torch.core.graph_facts import build_nodes
from alpa_torch.core.host_program import HostProgram, hoist

from . import masked_mean
from . import optim as fopt
from .tracing import Inputs, traced

log = logging.getLogger(__name__)



PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``precision`` values: the autocast compute dtype (None: no autocast)."""


def check_precision(precision: Any) -> str:
    """``precision`` if it is one of ``PRECISIONS``, else a ``PlanError`` naming them."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise PlanError(
            f"precision={precision!r} is not supported; use one of 'fp32' (the default), 'bf16' (bfloat16 "
            "compute, fp32 master weights) or 'fp16' (float16 compute with dynamic loss scaling, fp32 master "
            "weights)"
        )
    return precision


class _Amp:
    """Mixed precision while tracing (module docstring): the autocast context of the
    user's step, autocast off for backward and the optimizer, and with fp16 the loss
    scaler: ``state`` (traced ``LossScaler.STATE`` tensors), ``found_inf`` after backward
    and ``new_state`` after ``optimizer.step()``."""

    def __init__(self, precision: str, device_type: str, state: dict[str, torch.Tensor] | None):
        self.dtype = PRECISIONS[precision]
        self.device_type = device_type
        self.state = state
        self.found_inf: torch.Tensor | None = None
        self.new_state: dict[str, torch.Tensor] | None = None

    @property
    def scaling(self) -> bool:
        return self.state is not None

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype)

    def off(self):
        return torch.autocast(self.device_type, enabled=False)

    def scale_loss(self, loss: torch.Tensor, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
        """``loss * scale``; gradients already accumulated (an earlier backward) are scaled
        back up too, so they add up scaled, as with ``GradScaler`` (exact: a power of 2)."""
        scale = self.state["amp.loss_scale"]
        for leaf in leaves.values():
            if leaf.grad is not None:
                leaf.grad = leaf.grad * scale
        return loss * scale

    def unscale(self, leaves: dict[str, torch.Tensor]) -> None:
        """Divide every gradient by the scale (``GradScaler.unscale_``) and note whether one is not finite."""
        scale = self.state["amp.loss_scale"]
        grads = []
        for leaf in leaves.values():
            if leaf.grad is not None:
                leaf.grad = leaf.grad / scale
                grads.append(leaf.grad)
        self.found_inf = fopt.LossScaler.found_inf(grads)


class _Results:
    """What the optimizers' steps computed while tracing: new parameters and state, by name."""

    def __init__(self):
        self.params: dict[str, torch.Tensor] = {}
        self.states: dict[str, dict[str, torch.Tensor]] = {}
        self.stepped = False


class _StepOptimizer:
    """What ``train_step`` receives as its optimizer (one per optimizer) during capture: ``step()``
    traces the user's optimizer ``k`` itself (``optim.OptimizerSet.update``) on the graph's inputs."""

    def __init__(self, functional: fopt.OptimizerSet, k: int, leaves, inputs, states, scalars, results: _Results,
                 amp: _Amp | None = None, carried: _CarriedGrads | None = None):
        self._functional, self._k = functional, k
        self._amp = amp
        self._carried = carried
        self._leaves = leaves
        """Name -> traced leaf (its ``.grad`` set by backward) of every parameter this optimizer updates."""
        self._inputs = inputs
        """Name -> the graph input of each of those parameters (the optimizer updates these)."""
        self._states = states
        self._scalars = scalars
        self._results = results

    def zero_grad(self, set_to_none: bool = True) -> None:
        for leaf in self._leaves.values():
            leaf.grad = None

    def step(self, closure=None):
        if closure is not None:
            raise CaptureError("optimizer.step(closure) is not supported; call loss.backward() then optimizer.step()")
        if self._carried is not None:
            self._carried.drop(self._leaves)
        amp = self._amp
        with amp.off() if amp is not None else contextlib.nullcontext():  # fp32 master weights
            self._step(amp if amp is not None and amp.scaling else None)

    def _step(self, amp: _Amp | None) -> None:
        grads = {n: leaf.grad for n, leaf in self._leaves.items()}
        # fp16: the values before the update, copied: the traced update writes its results back into
        # its inputs, and where the step writes anything else (clip_grad_norm_, BatchNorm) the whole
        # graph is functionalized again, which makes a later read of an input see the written value
        olds, old_params = {}, {}
        if amp is not None:
            olds = {n: {k: v.detach().clone() for k, v in self._states[n].items()} for n in grads}
            old_params = {n: self._leaves[n].detach().clone() for n in grads}
        params, states = self._functional.update(self._k, self._inputs, grads, self._states, self._scalars)
        if amp is not None:  # fp16: skip the update in the graph when a gradient overflowed
            found_inf = amp.found_inf if amp.found_inf is not None else torch.tensor(False)
            params = {n: torch.where(found_inf, old_params[n], p) for n, p in params.items()}
            states = {n: {k: torch.where(found_inf, olds[n][k], v) for k, v in s.items()} for n, s in states.items()}
            amp.new_state = fopt.LossScaler.update(amp.state, found_inf)
        self._results.params.update(params)
        self._results.states.update(states)
        self._results.stepped = True

    def __getattr__(self, item):  # param_groups, state, defaults...: the user's optimizer
        return getattr(self._functional.optimizers[self._k], item)


class _CarriedGrads:
    """Gradients an eager call would carry in from the last call, and whether the step adds to them.

    In eager PyTorch ``.grad`` outlives a call: a step that runs ``loss.backward()`` before any
    ``zero_grad`` adds its gradients to what the previous call left there. The parallel step
    starts every call from no gradients, so that step cannot be reproduced. While tracing, each
    parameter starts with a stand-in gradient; the first ``backward`` notes which stand-ins are
    still there untouched (no ``zero_grad`` of either kind ran: set to None, or zeroed in
    place) and drops them. If the step also ends with gradients left in ``.grad``, the next
    eager call would add to them: ``check`` refuses that step by name."""

    def __init__(self, leaves: dict[str, torch.Tensor]):
        self.stand_ins = {}
        for name, leaf in leaves.items():
            leaf.grad = torch.zeros_like(leaf)
            self.stand_ins[name] = (leaf.grad, leaf.grad._version)
        self.added_to: list[str] | None = None

    def drop(self, leaves: dict[str, torch.Tensor]) -> None:
        """At the first backward (or ``optimizer.step()``): note and drop the untouched stand-ins."""
        if self.added_to is not None:
            return
        self.added_to = []
        for name, leaf in leaves.items():
            stand_in, version = self.stand_ins[name]
            if leaf.grad is stand_in:
                if stand_in._version == version:
                    self.added_to.append(name)
                leaf.grad = None if stand_in._version == version else leaf.grad

    def check(self, leaves: dict[str, torch.Tensor]) -> None:
        carried = [n for n in self.added_to or () if leaves[n].grad is not None]
        if carried:
            raise CaptureError(
                f"train_step runs loss.backward() before any optimizer.zero_grad() and leaves gradients in .grad "
                f"(e.g. {carried[0]}): eager PyTorch would add each call's gradients to the last call's "
                "(gradient accumulation across calls), which the parallel step does not carry from one call to "
                "the next. Fix: call optimizer.zero_grad() at the start of the step (or after optimizer.step()); to "
                "accumulate over several batches, pass them in one batch and call backward on each inside the step")


@contextlib.contextmanager
def _marking_backward(leaves: dict[str, torch.Tensor], order: list[str], amp: _Amp | None = None,
                      carried: _CarriedGrads | None = None):
    """Patch Tensor.backward so each gradient passes through ``alpa.grad`` afterwards
    (with ``amp``: backward without autocast, and fp16 loss scaling around it)."""
    original = torch.Tensor.backward
    index = {n: i for i, n in enumerate(order)}
    depth = 0

    def backward(self, *args, **kwargs):
        # make_fx's torch-function mode sends Tensor.backward back through
        # handle_torch_function, which calls this patched method again: mark
        # only when the outermost call returns, or every gradient gets two markers.
        nonlocal depth
        if depth == 0 and carried is not None:
            carried.drop(leaves)
        context = contextlib.nullcontext()
        if depth == 0 and amp is not None:
            context = amp.off()
            if amp.scaling:
                with context:
                    self = amp.scale_loss(self, leaves)
        depth += 1
        try:
            with context:
                original(self, *args, **kwargs)
        finally:
            depth -= 1
        if depth:
            return
        for name, leaf in leaves.items():
            if leaf.grad is not None:
                leaf.grad = grad_marker(leaf.grad, index[name])
        if amp is not None and amp.scaling:
            with amp.off():
                amp.unscale(leaves)

    torch.Tensor.backward = backward
    try:
        yield
    finally:
        torch.Tensor.backward = original


def _collect_inputs(model, functional, batch_leaves) -> Inputs:
    ins = Inputs()
    for name, p in model.named_parameters():
        ins.add("param", name, p.detach())
    for name, b in model.named_buffers():
        ins.add("buffer", name, b.detach())
    params = dict(model.named_parameters())
    for name in functional.names:
        for key, value in functional.initial_state(name, params[name]).items():
            ins.add("opt_state", f"{name}.{key}", value)
    if functional.device_step:  # fp16 loss scaling: the LossScaler's state, after the optimizer's
        for key, value in fopt.LossScaler.initial_state().items():
            ins.add("opt_state", key, value)
    for key, value in functional.host_scalars().items():
        ins.add("host_scalar", key, torch.tensor(value, dtype=torch.float64))
    for i, leaf in enumerate(batch_leaves):
        if isinstance(leaf, torch.Tensor):
            ins.add("batch", f"batch.{i}", leaf)
    return ins


def _make_step_fn(train_step, model, functional, ins: Inputs, batch_leaves, batch_spec, optimizer_arg,
                  precision="fp32", device_type="cpu"):
    """The pure function of flat inputs that pass 1 traces. ``optimizer_arg``: what the user passes
    as the optimizer (one, or a tuple or list of them), so the step receives the same shape."""
    names = [n for k, n in ins.specs]
    param_names = [n for k, n in ins.specs if k == "param"]
    buffer_names = [n for k, n in ins.specs if k == "buffer"]
    requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}

    def step_fn(*flat):
        by_name = dict(zip(names, flat))
        leaves = {n: by_name[n].detach().requires_grad_(requires_grad[n]) for n in param_names}
        buffers = {n: by_name[n] for n in buffer_names}
        states = {p: {k: by_name[f"{p}.{k}"] for k in functional.state_names(p)} for p in functional.names}
        scalars = {n: by_name[n] for k, n in ins.specs if k == "host_scalar"}
        batch_iter = iter(by_name[f"batch.{i}"] if isinstance(v, torch.Tensor) else v
                          for i, v in enumerate(batch_leaves))
        batch = pytree.tree_unflatten(list(batch_iter), batch_spec)
        amp = None
        if PRECISIONS[precision] is not None:
            scaler = {n: by_name[n] for n in fopt.LossScaler.STATE} if functional.device_step else None
            amp = _Amp(precision, device_type, scaler)
        optimized = {n: leaves[n] for n in functional.names}
        carried = _CarriedGrads(optimized)
        results = _Results()
        shims = []
        for k in range(len(functional.optimizers)):
            mine = [n for n in functional.names if functional.owner[n][0] == k]
            shims.append(_StepOptimizer(functional, k, {n: optimized[n] for n in mine}, {n: by_name[n] for n in mine},
                                        states, scalars, results, amp, carried))
        shim = type(optimizer_arg)(shims) if isinstance(optimizer_arg, (tuple, list)) else shims[0]
        with _reparametrize_module(model, {**leaves, **buffers}, tie_weights=True):
            with _marking_backward(optimized, functional.names, amp, carried):
                with amp.autocast() if amp is not None else contextlib.nullcontext():
                    loss = train_step(model, shim, batch)
            new_buffers = [b for _, b in model.named_buffers()]
        _check_loss(loss)
        if not results.stepped:
            raise CaptureError(
                "train_step never called optimizer.step() on the optimizer it was given; "
                "call optimizer.step() after loss.backward() (use the `optimizer` argument, not a global)"
            )
        if not results.params and functional.names:
            raise CaptureError("no parameter received a gradient: call loss.backward() before optimizer.step()")
        carried.check(optimized)
        new_params = [results.params.get(n, leaves[n].detach()) for n in param_names]
        new_states = [results.states[p][k] if p in results.states else states[p][k]
                      for p in functional.names for k in functional.state_names(p)]
        if functional.device_step:
            new_states += [amp.new_state[n] for n in fopt.LossScaler.STATE]
        return [loss.detach()] + new_params + new_buffers + new_states

    return step_fn


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor):
        raise LossError(
            f"train_step returned {type(loss).__name__}, not the loss tensor; end the step with `return loss`"
        )
    if loss.numel() != 1 or not loss.dtype.is_floating_point:
        raise LossError(
            f"train_step returned a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}; "
            "it must return one floating-point scalar loss (reduce it, e.g. loss.mean())"
        )


def capture(
    train_step: Callable, model: torch.nn.Module, optimizer, batch: Any, precision: str = "fp32",
    optimizers: fopt.OptimizerSet | None = None, device_type: str | None = None,
) -> OpGraph:
    """Trace ``train_step(model, optimizer, batch)`` into an ``OpGraph``.

    Nothing is executed for real: the model, optimizer(s) and batch are only read.
    ``precision``: 'fp32', 'bf16' or 'fp16' (module docstring), kept in ``graph.meta``.
    ``optimizers``: the ``OptimizerSet`` of ``optimizer`` to trace with (it keeps the guards the
    trace takes; default: a new one). ``device_type``: what the graph will run on ('cpu', 'cuda';
    ``Cluster.device_type``), which decides where attention stays fused (``tracing.FusedAttention``);
    default: the device of the model's tensors.
    """
    t0 = time.perf_counter()
    check_precision(precision)
    param_ids = {id(p): n for n, p in model.named_parameters()}
    functional = optimizers or fopt.OptimizerSet(optimizers_of(optimizer), param_ids, device_step=precision == "fp16")
    functional.guards = []
    batch_leaves, batch_spec = pytree.tree_flatten(batch)
    ins = _collect_inputs(model, functional, batch_leaves)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    device_type_of = next((v.device.type for v in ins.values if v.device.type != "meta"), "cpu")
    step_fn = _make_step_fn(train_step, model, functional, ins, batch_leaves, batch_spec, optimizer, precision,
                            device_type_of)
    gm = traced(step_fn, ins.values, mode, "train_step", device_type or device_type_of)
    with _use_lazy_graph_module(True):
        norms = _exact_masked_means(gm, ins, mode)
    program = _hoist_host_scalars(gm, ins, functional)
    graph = _assemble(gm, ins, functional, model)
    graph.meta["loss_norms"] = norms
    if program is not None:
        graph.meta["host_program"] = program
    graph.meta.update(
        capture_s=time.perf_counter() - t0, model=type(model).__name__,
        optimizer="+".join(type(o).__name__ for o in functional.optimizers), precision=precision,
        batch_shapes=[tuple(v.shape) for (k, name), v in zip(ins.specs, ins.values)
                      if k == "batch" and not name.startswith(masked_mean.NORM_PREFIX)],
    )
    log.info("captured %s in %.2f s", graph.summary(), graph.meta["capture_s"])
    return graph


def _exact_masked_means(gm: fx.GraphModule, ins: Inputs, mode: FakeTensorMode) -> dict:
    """``masked_mean.rewrite`` on the traced graph: each count it divides by becomes a batch input
    (appended after the batch's own leaves, as ``_assemble`` expects)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    batch_nodes = {name: ph.name for (kind, name), ph in zip(ins.specs, placeholders) if kind == "batch"}

    def add_input(name: str, example: torch.Tensor) -> fx.Node:
        last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        with gm.graph.inserting_after(last):
            ph = gm.graph.placeholder(name.replace(".", "_"))
        with mode:
            ph.meta["val"] = torch.empty((), dtype=example.dtype)
        ins.add("batch", name, example)
        return ph

    return masked_mean.rewrite(gm, batch_nodes, add_input)


def _hoist_host_scalars(gm: fx.GraphModule, ins: Inputs, functional) -> HostProgram | None:
    """``host_program.hoist`` on the traced graph: each value of hyper-parameters alone becomes a
    host-scalar input (appended last), computed by the returned program on every call."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    program = hoist(gm, {ph.name: name for (kind, name), ph in zip(ins.specs, placeholders) if kind == "host_scalar"})
    if program is None:
        return None
    for key, value in program.values(functional.host_scalars()).items():
        ins.add("host_scalar", key, value)
    return program


def _assemble(gm: fx.GraphModule, ins: Inputs, functional, model) -> OpGraph:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(ins.specs), "placeholder count differs from inputs"
    inputs = tuple(
        IOSpec(kind, name, tuple(v.shape), str(v.dtype).removeprefix("torch."), ph.name)
        for (kind, name), v, ph in zip(ins.specs, ins.values, placeholders)
    )
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    returned = pytree.tree_leaves(out_node.args[0])
    kinds = (
        [("loss", "loss")]
        + [("param", n) for k, n in ins.specs if k == "param"]
        + [("buffer", n) for k, n in ins.specs if k == "buffer"]
        + [("opt_state", f"{p}.{s}") for p in functional.names for s in functional.state_names(p)]
        + [("opt_state", n) for n in (fopt.LossScaler.STATE if functional.device_step else ())]
    )
    assert len(returned) == len(kinds), "output count differs from expectation"
    outputs = tuple(
        IOSpec(kind, name, tuple(r.meta["val"].shape), str(r.meta["val"].dtype).removeprefix("torch."), r.name)
        for (kind, name), r in zip(kinds, returned)
    )
    # The loss scale feeds the backward (loss * scale): as an optimizer-state source of the
    # update phase it would make the whole backward "update" (graph_facts._phases).
    phase_inputs = tuple(dataclasses.replace(s, kind="buffer") if (s.kind, s.name) == ("opt_state", "amp.loss_scale")
                         else s for s in inputs)
    nodes, grad_of = build_nodes(gm, phase_inputs, outputs, functional.names, GRAD_MARKER)
    return OpGraph(
        gm=gm, inputs=inputs, outputs=outputs, nodes=nodes, grad_of=grad_of,
        param_groups={n: gi for n, (_, gi) in functional.owner.items()},
    )
