"""Learn each operator's sharded execution once with DTensor, then replay it on local tensors.

DTensor decides, for every call, how an operator runs on shards: it
propagates placements, redistributes inputs where its rule asks, rewrites
size arguments to local sizes, runs the local kernel and wraps the result.
For a fixed plan and fixed shapes those decisions are the same every step, yet
they cost ~40 us of Python per operator, as much as the kernel itself for a
data-parallel shard on a CPU core (1,181 operators per GPT step).

So the first step runs every operator through DTensor (``learn``), and records
per operator:

- for each tensor input, its placements and global shape/stride as read, and
  the ones the plan redistributes it to (``InputMeta``): replayed as exactly
  that redistribution, nothing else;
- whether the plain kernel on the local shards computes DTensor's local result
  bit for bit (``local_safe``): no collective inside the call
  (``CommDebugMode``), not a random or in-place operator, same shape, dtype and
  values; a size argument (``view``, ``expand``...) may be replaced by the
  local size DTensor used. Otherwise the operator keeps running through DTensor;
- the placements and global shape/stride of what it produced (``ValueMeta``),
  to wrap a local value back into a DTensor where one is needed (state,
  stage crossings, DTensor-only operators, the gradient buckets).

Every device of the mesh must make the same choices (a collective skipped on
one device would hang the others): ``agree`` takes the AND of the flags over
the mesh. Later steps (``replay``) keep only local tensors in the environment.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

SIZE_ARG_OPS = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
                          "aten.expand.default"})
"""Operators whose second argument is a size DTensor rewrites to the local size."""


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

    __slots__ = ("inputs", "local_safe", "size_arg", "redistribute")

    def __init__(self, inputs: tuple, local_safe: bool, size_arg: tuple | None):
        self.inputs = inputs
        """Per input: an ``InputMeta``, or None for a non-tensor."""
        self.local_safe = local_safe
        self.size_arg = size_arg
        """The local size that replaces argument 1 (``SIZE_ARG_OPS``), or None."""
        self.redistribute = tuple((i, m.have, m.placed.placements) for i, m in enumerate(inputs)
                                  if m is not None and m.have is not None and m.placed is not None)
        """``(input index, meta as read, placements wanted)`` of the plan's redistributions."""

    def merge(self, other: "StepReplay") -> None:
        """Another execution of the same operator (a pipeline's next microbatch): safe only if both were."""
        self.local_safe = (self.local_safe and other.local_safe and self.size_arg == other.size_arg
                           and self.inputs == other.inputs)


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


def _plain_candidates(st, local_values: list, result) -> list[tuple[tuple, dict, tuple | None]]:
    args, kwargs = st.resolve(local_values)
    out = [(args, kwargs, None)]
    if str(st.target) in SIZE_ARG_OPS and isinstance(result, DTensor):
        size = tuple(result.to_local().shape)
        out.append(((args[0], list(size), *args[2:]), kwargs, size))
    return out


def check_local(st, placed: list, result, collectives: int) -> tuple[bool, tuple | None]:
    """(local_safe, size_arg) of one operator, from one DTensor execution (see the module docstring)."""
    target = st.target
    if collectives or not isinstance(target, torch._ops.OpOverload):
        return False, None
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False, None
    local_values = [v.to_local() if isinstance(v, DTensor) else v for v in placed]
    want = pytree.tree_leaves(to_local(result))
    for args, kwargs, size in _plain_candidates(st, local_values, result):
        try:
            got = pytree.tree_leaves(target(*args, **kwargs))
        except Exception:  # noqa: BLE001 - the plain kernel refused the global arguments
            continue
        if len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want)):
            return True, size
    return False, None


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and not isinstance(a, DTensor)
                and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
    return a == b


def agree(flags: dict[str, bool], mesh) -> dict[str, bool]:
    """AND of every device's ``flags`` over the mesh (same keys everywhere)."""
    names = sorted(flags)
    t = torch.tensor([1 if flags[n] else 0 for n in names], dtype=torch.int32)
    for axis in range(mesh.ndim):
        if mesh.size(axis) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=mesh.get_group(axis))
    return {n: bool(v) for n, v in zip(names, t.tolist())}


def replay_args(st, rp: StepReplay, values: list) -> tuple[tuple, dict]:
    args, kwargs = st.resolve(values)
    if rp.size_arg is not None:
        args = (args[0], list(rp.size_arg), *args[2:])
    return args, kwargs

