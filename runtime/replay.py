"""Learn each operator's sharded execution once with DTensor, then replay it on local tensors.

DTensor decides, for every call, how an operator runs on shards: it
propagates placements, redistributes inputs where its rule asks, rewrites
size arguments to local sizes, runs the local kernel and wraps the result.
For a fixed plan and fixed shapes those decisions are the same every step, yet
they cost ~80 us of Python per operator here (``Cluster.profile``'s
``sharded_op_overhead_s`` before replay: 91 us against 11 us for a plain call),
as much as the kernel itself for a data-parallel shard on a CPU core (about
1,100 operators per step of the benchmark GPT).

So the first step runs every operator through DTensor (``learn``), and records
per operator:

- for each tensor input, its placements and global shape/stride as read, and
  the ones the plan redistributes it to (``InputMeta``): replayed as exactly
  that redistribution, nothing else;
- the kernel DTensor runs on this device's shards, when its call is nothing
  but that kernel (``local_call``): decided from the input placements by
  DTensor's own sharding propagation, so it holds for every step with these
  placements and shapes, whatever the values; an argument rewrite (a ``view``'s
  global size to the local one) is part of it. Operators whose rule
  redistributes inside the call, random operators, mutating ones and those
  with a custom handler keep running through DTensor. On the learning step the
  local kernel is also run and compared with DTensor's result, bit for bit, as
  a tripwire (a disagreement keeps the operator on DTensor and is logged);
- the placements and global shape/stride of what it produced (``ValueMeta``),
  to wrap a local value back into a DTensor where one is needed (state,
  stage crossings, DTensor-only operators, the gradient buckets).

Every device of the mesh must make the same choices (a collective skipped on
one device would hang the others): ``agree`` takes the AND of the "local" flags over
the mesh (a device-dependent rewrite, e.g. of an uneven shard's size, is
local on each device alike). Later steps (``replay``) keep only local tensors in
the environment.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .devices import mesh_device
from .program import Slot

log = logging.getLogger(__name__)


class ValueMeta(NamedTuple):
    """What turns a local tensor back into its DTensor."""

    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]


class InputMeta(NamedTuple):
    have: ValueMeta | None
    """As read (None: a plain tensor, i.e. replicated)."""
    placed: ValueMeta | None
    """After the plan's redistribution (None: read as is)."""


class StepReplay:
    """What ``learn`` found out about one operator."""

    __slots__ = ("inputs", "call", "redistribute")

    def __init__(self, inputs: tuple, call: LocalCall | None):
        self.inputs = inputs
        """Per input: an ``InputMeta``, or None for a non-tensor."""
        self.call = call
        """How it runs on local tensors (``local_call``); None: through DTensor."""
        self.redistribute = tuple((i, m.have, m.placed.placements) for i, m in enumerate(inputs)
                                  if m is not None and m.placed is not None)
        """``(input index, meta as read, placements wanted)`` of the plan's redistributions
        (meta None: a plain tensor, replicated, e.g. a factory operator's result)."""

    def merge(self, other: StepReplay) -> None:
        """Another execution of the same operator (a pipeline's next microbatch): local only if
        both ran the same way."""
        if self.call != other.call or self.inputs != other.inputs:
            self.call = None


def meta_of(value) -> Any:
    """``ValueMeta`` of a DTensor, a tuple/list of them for a multi-output operator, else None."""
    if isinstance(value, DTensor):
        return ValueMeta(tuple(value.placements), value.shape, tuple(value.stride()))
    if isinstance(value, (tuple, list)):
        return type(value)(meta_of(v) for v in value)
    return None


def wrap(local: torch.Tensor, meta: ValueMeta, mesh) -> DTensor:
    return DTensor.from_local(local, mesh, meta.placements, run_check=False, shape=meta.shape, stride=meta.stride)


def to_local(value):
    """Local tensors of a DTensor, or of the DTensors inside a tuple/list result."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, (tuple, list)):
        return type(value)(to_local(v) for v in value)
    return value


class LocalCall(NamedTuple):
    """How DTensor runs one operator on this device's shards, with no collective: the kernel
    (``op``, DTensor may rewrite it, e.g. ``squeeze.default`` -> ``squeeze.dims``) and its
    flat positional arguments with the tensors left out (``template``, None at ``tensors``),
    rebuilt with ``tree`` where the arguments nest (``cat``'s list)."""

    op: Any
    template: tuple
    tensors: tuple[int, ...]
    tree: Any


def local_call(target, args: tuple, kwargs: dict) -> LocalCall | None:
    """What DTensor's dispatcher would run locally for ``target(*args, **kwargs)``, or None
    when that is not just one kernel on the local shards.

    Decided from placements, never from values: DTensor's own sharding propagation for
    these input specs (cached by DTensor itself) gives the output spec and any
    redistribution or argument rewrite. The call is local when the rule redistributes
    nothing (an argument rewrite, e.g. a ``view``'s global size to the local one, is
    kept) and DTensor's dispatcher does nothing else around the kernel: not a random
    operator (DTensor offsets the generator per shard), not one with a custom handler
    (convolution, argmax, ...), not mutating, and with a tensor result (a scalar result
    such as ``equal``'s is reduced over the mesh)."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return None
    dispatcher = DTensor._op_dispatcher
    if target in dispatcher._random_ops or target in dispatcher._custom_op_handlers:
        return None
    if not any(isinstance(v, DTensor) for v in pytree.tree_leaves((args, kwargs))):
        return None
    try:
        info = dispatcher.unwrap_to_op_info(target, args, kwargs)
        dispatcher.sharding_propagator.propagate(info)
    except Exception:  # noqa: BLE001 - no rule (DTensor decomposes or refuses): keep DTensor
        return None
    sharding = info.output_sharding
    if sharding is None or sharding.output_spec is None:
        return None
    if any(isinstance(v, torch.Tensor) for v in info.local_kwargs.values()) and sharding.needs_redistribute:
        return None
    flat, op = list(info.local_args), target
    if sharding.needs_redistribute:
        schema = sharding.redistribute_schema
        if schema is None:
            return None
        wanted = (tuple(pytree.tree_leaves(schema.args_schema)) if info.args_tree_spec is not None
                  else schema.args_schema)
        rewritten = []
        for i, spec in enumerate(info.flat_args_schema):
            if isinstance(spec, DTensorSpec):
                if spec != wanted[i]:
                    return None  # DTensor redistributes inside the call
                rewritten.append(flat[i])
            else:
                rewritten.append(wanted[i] if sharding.use_val_from_redistribute_schema else spec)
        if sharding.use_val_from_redistribute_schema:
            rewritten.extend(wanted[len(info.flat_args_schema):])
        flat = rewritten
        op = schema.op
    tensors = tuple(i for i, v in enumerate(flat) if isinstance(v, torch.Tensor))
    template = tuple(None if isinstance(v, torch.Tensor) else v for v in flat)
    return LocalCall(op, template, tensors, info.args_tree_spec)


def run_local(call: LocalCall, args: tuple, kwargs: dict):
    """``call`` on local tensors: ``args``/``kwargs`` as the record resolves them."""
    flat = pytree.tree_leaves(args) if call.tree is not None else args
    out = list(call.template)
    for i in call.tensors:
        out[i] = flat[i]
    return call.op(*(pytree.tree_unflatten(out, call.tree) if call.tree is not None else out), **kwargs)


def local_layout(call: LocalCall, st) -> tuple[Any, tuple, dict] | None:
    """``(kernel, args, kwargs)`` of ``call`` for the compiled record ``st``, with ``Slot(i)`` where
    this step's input ``i`` goes (``codegen.Layout``): the kernel itself on the template, this
    step's local tensors put in. None when a tensor is passed by keyword or sits where no input
    reference is (``run_local`` then does the general thing)."""
    args, kwargs = st.layout()
    if any(isinstance(v, Slot) for v in pytree.tree_leaves(kwargs)):
        return None
    flat = pytree.tree_leaves(args) if call.tree is not None else args
    if not all(i < len(flat) and isinstance(flat[i], Slot) for i in call.tensors):
        return None
    out = list(call.template)
    for i in call.tensors:
        out[i] = flat[i]
    return call.op, tuple(out if call.tree is None else pytree.tree_unflatten(out, call.tree)), dict(kwargs)


def check_local(st, placed: list, result) -> LocalCall | None:
    """The ``LocalCall`` of one operator run through DTensor on ``placed`` inputs, if it
    reproduces DTensor's local result (``result``) bit for bit on this step: the
    placement-based decision (``local_call``) is the rule, the value check only a
    tripwire that keeps DTensor wherever the two ever disagree."""
    args, kwargs = st.resolve(placed)
    call = local_call(st.target, args, kwargs)
    if call is None:
        return None
    local_args, local_kwargs = st.resolve([v.to_local() if isinstance(v, DTensor) else v for v in placed])
    try:
        got = pytree.tree_leaves(run_local(call, local_args, local_kwargs))
    except Exception:  # noqa: BLE001 - see the log line below
        got = None
    want = pytree.tree_leaves(to_local(result))
    if got is None or len(got) != len(want) or not all(bitwise_equal(a, b) for a, b in zip(got, want)):
        log.warning("operator %s (%s): the local kernel DTensor's rule implies differs from DTensor's "
                    "result; it keeps running through DTensor", st.name, st.target)
        return None
    return call


def bitwise_equal(a, b) -> bool:
    """``a`` and ``b`` are the same local tensor (shape, dtype, strides, bits; NaN where the
    other has NaN), or equal non-tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and not isinstance(a, DTensor)
                and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
                and (torch.equal(a, b) or (a.is_floating_point()  # NaN where DTensor has NaN too
                                           and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))))
    return a == b


def agree(flags: dict[str, bool], mesh) -> dict[str, bool]:
    """AND of every device's ``flags`` over the mesh (same keys everywhere)."""
    names = sorted(flags)
    t = torch.tensor([1 if flags[n] else 0 for n in names], dtype=torch.int32, device=mesh_device(mesh))
    for axis in range(mesh.ndim):
        if mesh.size(axis) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=mesh.get_group(axis))
    return {n: bool(v) for n, v in zip(names, t.tolist())}
