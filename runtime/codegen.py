"""A compiled program as one generated Python function: the steady-state step without an interpreter loop.

Once a runner knows how every operator of a program runs (from the first step on one
device; after the learning step when replaying, ``replay.py``), those decisions do not
change. The interpreter loop still paid for them on every operator of every step: the
step's kind tests, the argument closure (``program.compile_resolver``), a template copy,
the ``OpOverload`` wrapper and the liveness loop: 2.25 us per operator above eager PyTorch
on a core of the development machine, 0.50 us generated (``bench/runner_overhead.py``: a
2,659-step GPT step on one device at a tiny size, 14.1 -> 9.1 ms against eager's 8.1 / 7.8,
docs/results/runner_overhead_2026-11-26.jsonl), which is what matters where kernels are
short (small shards, GPUs).

``generate`` writes the program out as straight-line Python, one statement per step,
compiled once with ``compile``:

- an operator that runs as one local kernel: ``env['mm_3'] = C[7](env['t_1'], env['x'])``,
  the kernel's C++ callable itself with its constant arguments as ``C`` entries (the
  argument layout comes from ``Layout``, decided by the runner);
- one that runs in place on a dead input (``donation.py``): the same, through its donor;
- anything else (DTensor, a redistribution first, a random operator): the runner's own
  per-operator function, ``env['x'] = C[9](env)``;
- markers, bucket collections and graph constants call the runner's hooks, and every
  value is popped from the environment right after its last reader, as the loop did;
- a value the runner watches (the loss: ``StageRunner.step`` answers with it early) is
  handed to its hook as soon as it is computed.

The generated function is ``fn(env, on_grad) -> outputs or None`` with the loop's contract
(``StageRunner.run``). It holds no tensor: values live in ``env`` only.
"""

from __future__ import annotations

import keyword
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .program import CALL, GET_ATTR, GETITEM, MARKER, OUTPUT, Program, Ref, Slot
from .regions import Region, region_io, split


class Layout(NamedTuple):
    """How one operator runs as a direct call: ``fn(*args, **kwargs)``, with ``Slot(i)`` inside
    ``args``/``kwargs`` where the step's ``inputs[i]`` goes; ``donor``: ``fn`` takes
    ``(args, kwargs)`` (a donating call, ``donation.donating``)."""

    fn: Callable
    args: tuple
    kwargs: dict
    donor: bool = False
    op: Any = None
    """The operator overload ``fn`` is the kernel of (what a compiled region calls), if known."""


def _has_slot(value) -> bool:
    return isinstance(value, Slot) or (isinstance(value, (list, tuple)) and any(_has_slot(v) for v in value))


class _Writer:
    def __init__(self):
        self.consts: list[Any] = []
        self.lines: list[str] = []

    def const(self, value) -> str:
        self.consts.append(value)
        return f"C[{len(self.consts) - 1}]"

    def expr(self, value, inputs: tuple[str, ...]) -> str:
        """Python source of ``value`` with each ``Slot`` read from the environment."""
        if isinstance(value, Slot):
            return f"env[{inputs[value.i]!r}]"
        if isinstance(value, (list, tuple)) and _has_slot(value):  # e.g. ``cat``'s list of tensors
            parts = [self.expr(v, inputs) for v in value]
            return f"[{', '.join(parts)}]" if isinstance(value, list) else f"({''.join(p + ', ' for p in parts)})"
        if value is None or type(value) in (bool, int):
            return repr(value)
        return self.const(value)

    def call(self, layout: Layout, inputs: tuple[str, ...]) -> str:
        fn = self.const(layout.fn)
        args = [self.expr(a, inputs) for a in layout.args]
        if layout.donor:
            kwargs = "{" + ", ".join(f"{k!r}: {self.expr(v, inputs)}" for k, v in layout.kwargs.items()) + "}"
            return f"{fn}(({''.join(a + ', ' for a in args)}), {kwargs})"
        for k, v in layout.kwargs.items():
            plain = k.isidentifier() and not keyword.iskeyword(k)
            args.append(f"{k}={self.expr(v, inputs)}" if plain else f"**{{{k!r}: {self.expr(v, inputs)}}}")
        return f"{fn}({', '.join(args)})"

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)


def generate(program: Program, layout: Callable[[Any], Layout | None], general: Callable[[Any], Callable[[dict], Any]],
             marker: Callable, collect: Callable, constant: Callable,
             watch: dict[str, Callable[[Any], None]] | None = None,
             regions: Callable[[Any], bool] | None = None,
             region_cache: str | None = None,
             writes: dict[str, tuple[str, int, frozenset[str]]] | None = None,
             owned: set[str] | None = None) -> Callable[[dict, Any], list | None]:
    """``fn(env, on_grad)`` running ``program`` (module docstring).

    ``layout(step)``: the step's direct call, or None; ``general(step)``: ``env -> value`` for the
    others; ``marker(name, src, env, on_grad)``, ``collect(names, env)`` and ``constant(step)``: the
    runner's handling of gradient markers, bucket collections and graph constants;
    ``watch[name](value)``: called with value ``name`` right after the step computing it.
    ``regions``: compile runs of local kernels (``regions.py``); ``regions(marker)`` says whether a
    gradient marker only names its value (``env[name] = value``: it may sit inside a run), else it
    ends the run. A run ends after a watched value, whose hook runs then. ``region_cache``: the
    directory of the regions' compiled artifacts, or None. ``writes``: new state value -> ``(state
    input, i, shared)`` (``interpreter.StageRunner._state_writes``): a region holding step ``i``, reading
    the state input and none of the other values in ``shared``, writes the new value into the state's
    memory while ``owned`` (the runner's set, kept up to date) holds the state input."""
    watch = watch or {}
    w = _Writer()
    layouts = {st.name: layout(st) for st in program.steps if st.kind == CALL}
    spans = {}
    if regions is not None:
        def fusable(st) -> bool:
            lay = layouts.get(st.name)
            return st.kind in (GETITEM, GET_ATTR) or (
                lay is not None and not lay.donor and isinstance(lay.op, torch._ops.OpOverload))
        spans = dict(split(program.steps, fusable, regions, frozenset(watch)))
    steps, i, made = program.steps, 0, []
    while i < len(steps):
        st = steps[i]
        if st.before:
            w.emit(f"collect({st.before!r}, env)")
        if i in spans:
            end = spans[i]
            made.append(_region(w, steps, i, end, layouts, general, constant, region_cache, writes or {},
                                owned if owned is not None else set()))
            w.emit(f"R[{len(made) - 1}](env)")
            for later in steps[i:end]:  # hooks of the region's values, in order
                if later.name in watch and later.kind in (CALL, GETITEM):
                    w.emit(f"{w.const(watch[later.name])}(env[{later.name!r}])")
            i = end
            continue
        if st.kind == OUTPUT:
            items = [f"env[{a!r}]" if isinstance(a, Ref) else w.const(a) for a in st.target]
            w.emit(f"return [{', '.join(items)}]")
            break
        _emit_step(w, st, layouts, general, constant)
        if st.kind == MARKER:
            w.emit(f"marker({st.name!r}, {st.inputs[0]!r}, env, on_grad)")
        if st.name in watch and st.kind in (CALL, GETITEM):
            w.emit(f"{w.const(watch[st.name])}(env[{st.name!r}])")
        for name in st.free:
            w.emit(f"pop({name!r}, None)")
        i += 1
    source = "def run(env, on_grad):\n    pop = env.pop\n" + "\n".join(w.lines) + "\n    return None\n"
    scope = {"C": w.consts, "R": made, "marker": marker, "collect": collect, "constant": constant}
    exec(compile(source, "<alpa_torch program>", "exec"), scope)  # our own generated source
    run = scope["run"]
    run.regions = made
    return run


def _emit_step(w: _Writer, st, layouts: dict, general: Callable, constant: Callable, inside: bool = False) -> None:
    """The line computing a kernel's, ``getitem``'s or constant's value into ``env`` (``inside`` a region,
    a marker's too)."""
    if st.kind == CALL:
        lay = layouts[st.name]
        value = w.call(lay, st.inputs) if lay is not None else f"{w.const(general(st))}(env)"
        w.emit(f"env[{st.name!r}] = {value}")
    elif st.kind == GETITEM:
        w.emit(f"env[{st.name!r}] = env[{st.inputs[0]!r}][{w.expr(st.target, ())}]")
    elif st.kind == GET_ATTR:
        w.emit(f"env[{st.name!r}] = constant({w.const(st)})")
    elif st.kind == MARKER and inside:  # a marker that only names its value
        w.emit(f"env[{st.name!r}] = env[{st.inputs[0]!r}]")


def _region(w: _Writer, steps: list, start: int, end: int, layouts: dict, general: Callable,
            constant: Callable, cache: str | None, writes: dict, owned: set[str]) -> Region:
    """``steps[start:end]`` as a ``Region``; its uncompiled form is generated like the program; the
    new state it may write in place (``generate``'s ``writes``)."""
    inner = _Writer()
    inner.consts = w.consts
    for st in steps[start:end]:
        _emit_step(inner, st, layouts, general, constant, inside=True)
        for name in st.free:
            inner.emit(f"pop({name!r}, None)")
    source = "def eager(env):\n    pop = env.pop\n" + "\n".join(inner.lines) + "\n"
    scope = {"C": w.consts, "constant": constant}
    exec(compile(source, f"<alpa_torch region at step {start}>", "exec"), scope)  # our own generated source
    inputs, outputs, freed = region_io(steps, start, end)
    members = steps[start:end]
    consts = {st.name: (lambda st=st: constant(st)) for st in members if st.kind == GET_ATTR}
    read = set(inputs)
    in_place = {new: state for new, (state, at, shared) in writes.items()
                if start <= at < end and new in outputs and state in read and not (shared - {state}) & read}
    return Region(start, members, layouts, consts, inputs, outputs, freed, scope["eager"], cache, in_place, owned)


__all__ = ["Layout", "generate"]
