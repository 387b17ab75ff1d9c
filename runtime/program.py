"""Serialized graph records compiled into steps a worker runs with little per-operator work.

Owns two things, both decided once when a worker installs its program, never per step:

- **argument resolution**: each record's ``(args, kwargs)`` become a closure that
  builds the call's arguments from the values of its inputs (a list, in the
  record's ``inputs`` order), instead of walking the argument tree with
  ``pytree.tree_map`` on every call;
- **liveness**: ``free`` of a step names the values whose last reader it is, so
  the interpreter deletes them from its environment right after the step and
  the memory of activations, gradients and temporaries is given back as soon
  as the program no longer needs it (as eager PyTorch's reference counting
  does). Values the caller still reads after the program (``keep``: a pipeline
  stage's activations its backward reads, values it sends, the step's outputs)
  are never freed here.

It does not run anything (``interpreter.py`` does) and knows nothing of
shardings. Records come from ``serialize_graph`` (below):
``(op, name, target, args, kwargs, inputs)`` with ``Ref`` marking a reference
to another record's value.
"""

from __future__ import annotations

import copyreg
import io
import operator
import pickle
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx


class Ref(str):
    """A reference to another node's value inside a serialized node's arguments."""


class Slot:
    """Stands for input ``i`` of a record while its argument layout is worked out
    (``step.layout()`` shows where each input goes)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


# Step kinds
CALL, GETITEM, MARKER, GET_ATTR, OUTPUT, PLACEHOLDER = range(6)


class Step:
    """One record, ready to run: what to call, how to build its arguments, what to free after it."""

    __slots__ = ("kind", "name", "target", "inputs", "resolve", "free", "before", "donate")

    def __init__(self, kind: int, name: str, target: Any, inputs: tuple[str, ...],
                 resolve: Callable[[list], tuple[tuple, dict]] | None):
        self.kind = kind
        self.name = name
        self.target = target
        self.inputs = inputs
        self.resolve = resolve
        """``resolve(values) -> (args, kwargs)``; ``values[i]`` is the value of ``inputs[i]``."""
        self.free: tuple[str, ...] = ()
        """Values deleted from the environment after this step (their last reader)."""
        self.before: tuple[str, ...] = ()
        """Gradients to collect from their bucket before this step (it reads them first)."""
        self.donate = None
        """``donation.Donation``: the input this step may overwrite with its result, if any."""

    def layout(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with ``Slot(i)`` where input ``i`` goes: the call's argument layout."""
        return self.resolve([Slot(i) for i in range(len(self.inputs))])

    def __repr__(self) -> str:
        return f"Step({self.name}, free={self.free}, before={self.before})"


class Program:
    """Compiled steps of an ordered list of records."""

    def __init__(self, steps: list[Step], produced: frozenset[str], reads: frozenset[str]):
        self.steps = steps
        self.produced = produced
        """Names this program computes."""
        self.reads = reads
        """Names this program reads but does not compute (its inputs from outside)."""
        self._by_name: dict[str, Step] | None = None
        self.overwrites: dict[str, tuple[int, frozenset[str]]] = {}
        """State inputs whose memory the program may overwrite, and where (``donation.state_overwrites``)."""
        self.fast: Callable[[dict, Any], list | None] | None = None
        """The program as one generated function (``codegen.generate``), made by its runner once
        every operator's way of running is settled."""

    def step(self, name: str) -> Step:
        """The step computing ``name``."""
        if self._by_name is None:
            self._by_name = {st.name: st for st in self.steps}
        return self._by_name[name]

    def first_readers(self, names: Iterable[str]) -> dict[str, Step]:
        """For each of ``names`` the program reads, the first step that reads it."""
        wanted, out = set(names), {}
        for st in self.steps:
            for a in st.inputs:
                if a in wanted and a not in out:
                    out[a] = st
        return out


def _getter(a, index: dict[str, int]) -> Callable[[list], Any]:
    """A function ``values -> a`` with every ``Ref`` inside ``a`` replaced by its value."""
    if isinstance(a, Ref):
        return operator.itemgetter(index[a])
    if isinstance(a, (list, tuple)) and _has_ref(a):
        parts = [_getter(x, index) for x in a]
        kind = type(a)
        return lambda values: kind([p(values) for p in parts])
    if isinstance(a, dict) and _has_ref(a):
        parts = {k: _getter(v, index) for k, v in a.items()}
        return lambda values: {k: p(values) for k, p in parts.items()}
    return lambda values: a


def _has_ref(a) -> bool:
    return any(isinstance(x, Ref) for x in pytree.tree_leaves(a))


def compile_resolver(args: tuple, kwargs: dict, inputs: tuple[str, ...]) -> Callable[[list], tuple[tuple, dict]]:
    """``values -> (args, kwargs)`` for one record.

    The common case, references and constants at the top level only, fills a
    template list by position; nested containers (``cat``'s tensor list, a
    ``view``'s size list holding a symbolic size) get per-element getters."""
    index = {a: i for i, a in enumerate(inputs)}
    if not _has_ref(kwargs) and not any(isinstance(a, (list, tuple, dict)) and _has_ref(a) for a in args):
        template = list(args)
        slots = [(pos, index[a]) for pos, a in enumerate(args) if isinstance(a, Ref)]
        kw = dict(kwargs)

        def flat(values: list) -> tuple[tuple, dict]:
            out = template.copy()
            for pos, i in slots:
                out[pos] = values[i]
            return tuple(out), kw

        return flat
    arg_getters = [_getter(a, index) for a in args]
    kw_getters = {k: _getter(v, index) for k, v in kwargs.items()}
    return lambda values: (tuple(g(values) for g in arg_getters), {k: g(values) for k, g in kw_getters.items()})


def compile_program(records: list[tuple], marker_name: str, keep: Iterable[str] = ()) -> Program:
    """Steps of ``records`` (targets already resolved) with liveness against ``keep``.

    A value, computed here or put in the environment by the caller (graph inputs,
    a pipeline stage's forward activations its backward reads, received
    crossings), is freed after the last step of this program that reads it, or
    right after the step computing it when nothing here reads it, unless it is
    in ``keep`` (read after the program). Freeing a graph input only drops the
    environment's reference: the runner's state still holds parameters."""
    steps: list[Step] = []
    produced: set[str] = set()
    reads: set[str] = set()
    for op, name, target, args, kwargs, inputs in records:
        inputs = tuple(inputs)
        if op == "placeholder":
            steps.append(Step(PLACEHOLDER, name, None, (), None))
            continue
        if op == "output":
            leaves = pytree.tree_leaves(args[0])
            steps.append(Step(OUTPUT, name, leaves, inputs, None))
        elif op == "get_attr":
            steps.append(Step(GET_ATTR, name, args[0], (), None))
        elif target is operator.getitem:
            steps.append(Step(GETITEM, name, args[1], inputs[:1], None))
        elif str(target) == marker_name:
            steps.append(Step(MARKER, name, target, inputs[:1], None))
        else:
            steps.append(Step(CALL, name, target, inputs, compile_resolver(args, kwargs, inputs)))
        reads.update(a for a in inputs if a not in produced)
        produced.add(name)
    _assign_frees(steps, set(keep))
    return Program(steps, frozenset(produced), frozenset(reads))


def _assign_frees(steps: list[Step], keep: set[str]) -> None:
    last: dict[str, int] = {}
    for i, st in enumerate(steps):
        if st.kind == PLACEHOLDER:
            continue
        if st.kind != OUTPUT:
            last.setdefault(st.name, i)  # never read: free right after it is made
        for a in st.inputs:
            last[a] = i
    free: dict[int, list[str]] = {}
    for name, i in last.items():
        if name not in keep and steps[i].kind != OUTPUT:
            free.setdefault(i, []).append(name)
    for i, names in free.items():
        steps[i].free = tuple(names)


def serialize_graph(gm: fx.GraphModule) -> list[tuple]:
    """The graph as picklable records ``(op, name, target, args, kwargs, inputs)``.

    Workers execute records directly: no re-tracing, no code generation."""
    records = []
    for n in gm.graph.nodes:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: Ref(a.name))
        target = n.target
        if isinstance(target, torch._ops.OpOverload):
            target = f"op:{target}"  # e.g. 'op:aten.mm.default'; OpOverloads do not pickle
        elif target is operator.getitem:
            target = "getitem"
        if n.op == "get_attr":
            target, args = n.target, (getattr(gm, n.target).detach().clone(),)
        records.append((n.op, n.name, target, args, kwargs, tuple(a.name for a in n.all_input_nodes)))
    return records


def graph_bytes(gm: fx.GraphModule) -> bytes:
    """``serialize_graph(gm)`` pickled for a worker, each memory format (``torch.preserve_format``) by its
    name in ``torch``. Pickle looks a memory format up by its dotted name ``torch.preserve_format`` in
    every loaded module, and a script that imports ray before torch has ``__mp_main__``, that is itself,
    first among them: the bytes then named the driver's script, and the worker failed to load them
    ("Can't get attribute 'torch.preserve_format' on <module '__main__'>")."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf)
    pickler.dispatch_table = copyreg.dispatch_table | {torch.memory_format: _reduce_memory_format}
    pickler.dump(serialize_graph(gm))
    return buf.getvalue()


def _reduce_memory_format(value: torch.memory_format) -> tuple:
    return _torch_attribute, (str(value).removeprefix("torch."),)


def _torch_attribute(name: str) -> Any:
    """``torch.<name>``: how a worker loads a memory format ``graph_bytes`` pickled."""
    return getattr(torch, name)


def record_target(t):
    """The callable a record's target names (``serialize_graph``'s spelling undone)."""
    if t == "getitem":
        return operator.getitem
    if isinstance(t, str) and t.startswith("op:"):
        ns, name, overload = t[3:].split(".")
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    return t
