"""Buffer donation: an elementwise operator writes its result into the memory of its
first input when nothing reads that memory afterwards.

The captured step is functional: the optimizer update makes a new tensor for
every operator (``exp_avg.lerp(grad, w)``, ``param * decay``, ...), where eager
PyTorch's optimizer updates in place. Out of place, each operator writes to
memory nobody has touched this step (cold caches, and a working set of the old
and the new optimizer state together). On the benchmark GPT (AdamW, batch 4 per
device, one CPU thread) the replayed step took 3-4 % longer than with the update
in place; donation takes that back, and the memory the old values held.

``find_donations`` decides, once per compiled program, which operator may run
in place on which input: the operator is one of ``INPLACE`` (elementwise, with
an in-place twin of the same arguments), the input is its first argument, no
other argument of the call shares its memory, and every value sharing that
memory (views of it, the value it views, getitems: an alias analysis from the
operators' schemas) is read for the last time by this operator. Memory that
outlives the program is never donated: the program's outputs and kept values,
gradient markers (buckets and pipeline accumulators hold them), graph
constants and everything the caller put in the environment (the batch, host
scalars, gradients and activations from other programs) except the runner's
state, which only the program that reads it last in a step may donate
(``state_nodes``: a pipeline stage's forward programs read the parameters again
for the next microbatch). State memory is donated only while the runner owns
it outright (``StageRunner`` checks that before each call: not a view, not
memory it was loaded from, not shared by two state entries).

The in-place twin runs the same kernel on the same values (a ``TensorIterator``
whose output is its first input) and gives the same bits; ``tests`` check that
for every operator here. At run time the donated tensor must also be contiguous
(an in-place write into overlapping or strided memory would not be the
functional result laid out the same way); otherwise the functional operator
runs. ``ALPA_TORCH_DONATE=0`` turns donation off (a debugging switch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from .program import CALL, GET_ATTR, GETITEM, MARKER, OUTPUT, Program, Slot
from .replay import bitwise_equal

_ELEMENTWISE = ("add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "mul.Tensor", "mul.Scalar",
                "div.Tensor", "div.Scalar", "lerp.Scalar", "lerp.Tensor", "addcmul.default",
                "addcdiv.default", "sqrt.default", "rsqrt.default", "neg.default", "reciprocal.default",
                "exp.default")


def _inplace_table() -> dict:
    aten, out = torch.ops.aten, {}
    for qualified in _ELEMENTWISE:
        name, overload = qualified.split(".")
        out[getattr(getattr(aten, name), overload)] = getattr(getattr(aten, name + "_"), overload)
    return out


INPLACE = _inplace_table()
"""Functional elementwise ``OpOverload`` -> its in-place twin (same arguments, writes the first)."""


@dataclass(frozen=True, slots=True)
class Donation:
    """The input of one step that may be overwritten by the step's result."""

    slot: int
    """Index of the donated value in the step's ``inputs`` (its first argument)."""
    state: str | None
    """The state input (graph placeholder) whose memory this is, if any: donated only while
    the runner owns that tensor outright."""


class _Aliases:
    """Union-find over value names: a group is one piece of memory and its views."""

    def __init__(self):
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        root = self.parent.setdefault(x, x)
        while root != self.parent[root]:
            root = self.parent[root]
        while x != root:  # path compression
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb


def _aliasing(target) -> bool:
    """Whether the result of ``target`` may share memory with an input (views, in-place, unknown)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return True
    return any(r.alias_info is not None for r in schema.returns) or any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _first_arg_slot(st) -> int | None:
    """Index in ``st.inputs`` of the step's first positional argument, if it is an input
    that appears nowhere else in the call."""
    args, kwargs = st.layout()
    if not args or not isinstance(args[0], Slot):
        return None
    first = args[0].i
    leaves = pytree.tree_leaves((args[1:], kwargs))
    if any(isinstance(v, Slot) and v.i == first for v in leaves):
        return None
    return first


@dataclass(slots=True)
class _Groups:
    """Values grouped by the memory they share (``_alias_groups``)."""

    aliases: _Aliases
    last: dict[str, int]
    """Per group root: the index of the step reading it last (len(steps): kept past the program)."""
    pinned: set[str]
    """Roots of groups whose memory must outlive the program or belongs to the caller."""
    state: dict[str, set[str]]
    """Per group root: the state inputs in it."""


def _alias_groups(program: Program, state_nodes: frozenset[str] | set[str]) -> tuple[_Groups, set[str]]:
    """The program's values grouped by memory (an alias analysis from the operators' schemas), each
    group's last reader and whether its memory outlives the program or is the caller's (module
    docstring); and every value name seen."""
    steps = program.steps
    aliases, pinned = _Aliases(), set()
    last: dict[str, int] = {}
    for i, st in enumerate(steps):
        for name in st.free:
            last[name] = i
        if st.kind == CALL and _aliasing(st.target):
            for a in st.inputs:
                aliases.union(st.name, a)
        elif st.kind == GETITEM:
            aliases.union(st.name, st.inputs[0])
        elif st.kind == MARKER:
            aliases.union(st.name, st.inputs[0])
            pinned.add(st.name)
        elif st.kind == GET_ATTR:
            pinned.add(st.name)
        elif st.kind == OUTPUT:
            pinned.update(st.inputs)
    pinned.update(a for a in program.reads if a not in state_nodes)
    names = set(aliases.parent) | set(last) | set(program.reads) | {st.name for st in steps}
    pinned.update(n for n in names if n not in last)  # kept past the program
    groups = _Groups(aliases, {}, set(), {})
    for n in names:
        root = aliases.find(n)
        groups.last[root] = max(groups.last.get(root, -1), last.get(n, len(steps)))
        if n in pinned:
            groups.pinned.add(root)
        if n in program.reads and n in state_nodes:
            groups.state.setdefault(root, set()).add(n)
    return groups, names


def find_donations(program: Program, state_nodes: frozenset[str] | set[str] = frozenset()) -> dict[str, Donation]:
    """Step name -> what it may overwrite (module docstring). ``state_nodes``: the runner's
    state inputs this program may donate (it is their last reader in the step)."""
    groups, _ = _alias_groups(program, state_nodes)
    aliases = groups.aliases
    out = {}
    for i, st in enumerate(program.steps):
        if st.kind != CALL or st.target not in INPLACE or not st.inputs:
            continue
        slot = _first_arg_slot(st)
        if slot is None:
            continue
        a = st.inputs[slot]
        root = aliases.find(a)
        if a not in st.free or root in groups.pinned or groups.last[root] != i:
            continue
        if any(aliases.find(b) == root for j, b in enumerate(st.inputs) if j != slot):
            continue
        states = groups.state.get(root, set())
        if len(states) > 1:
            continue
        out[st.name] = Donation(slot, next(iter(states)) if states else None)
    return out


def state_overwrites(program: Program, state_nodes: frozenset[str] | set[str]) -> dict[str, tuple[int, frozenset[str]]]:
    """State input -> ``(i, shared)`` for each of ``state_nodes`` whose memory the program may overwrite
    once step ``i`` has read it: no value sharing that memory (``shared``, the state input among them)
    is read after step ``i``, none outlives the program, and no other state shares it. A compiled
    region holding step ``i`` writes the state's new value there (``regions.Region``), as
    torch.optim's compiled update does, when the runner owns the tensor outright."""
    groups, names = _alias_groups(program, state_nodes)
    members: dict[str, set[str]] = {}
    for n in names:
        members.setdefault(groups.aliases.find(n), set()).add(n)
    out = {}
    for root, states in groups.state.items():
        if len(states) == 1 and root not in groups.pinned:
            out[next(iter(states))] = (groups.last[root], frozenset(members[root]))
    return out


def donating(op, inplace, state: str | None, owned: set[str]):
    """``(args, kwargs) -> op(*args, **kwargs)`` for a step with a ``Donation``: in place on
    ``args[0]`` (``inplace``: the twin of ``op``) once the first call has shown the in-place
    result to be the functional one (shape, dtype, strides and bits; else never), and then
    whenever the tensor is contiguous and, for state memory, ``state`` is in ``owned``."""
    verdict = None

    def call(args, kwargs):
        nonlocal verdict
        x = args[0]
        if verdict and x.is_contiguous() and (state is None or state in owned):
            return inplace(*args, **kwargs)
        out = op(*args, **kwargs)
        if verdict is None and isinstance(x, torch.Tensor) and x.is_contiguous():
            verdict = _same_in_place(inplace, x, args, kwargs, out)
        return out
    return call


def _same_in_place(inplace, x: torch.Tensor, args, kwargs, out) -> bool:
    try:
        got = inplace(x.clone(), *args[1:], **kwargs)
    except RuntimeError:  # e.g. the result broadcasts to a larger shape than the input's
        return False
    return isinstance(out, torch.Tensor) and bitwise_equal(got, out)
