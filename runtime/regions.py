"""Compiled regions: runs of a device's program that are local kernels alone, compiled by Inductor.

Once every operator's way of running is settled (``codegen.py``), most of a device's step is
local kernels on local tensors: on one device all of it, on a sharded mesh every operator whose
inputs arrive as its rule wants them. Between them stand what only the runner can do: a
redistribution or DTensor call, a random operator (seeded per device, ``rng.py``), a gradient
handed to its bucket (its reduction starts there: a region ends before it, so the overlap stays),
a bucket's result collected. ``split`` cuts the program at those; each maximal run of local
kernels (with the ``getitem``s and graph constants between them) becomes a ``Region``.

A region is an FX graph of the kernels' operator overloads, its inputs the values it reads from
before it, its outputs the values read after it. On its first call it is compiled with
``torch._inductor.standalone_compile`` on the real inputs (Inductor: C++ on CPU, Triton on CUDA)
and runs the compiled code from then on. With a cache directory the compiled artifact is saved
there (``CompiledArtifact.save``, written to a temporary file renamed over the entry), keyed by
``artifact_key``: the graph's code (inputs named by position), every input's shape, strides,
alignment, dtype and device, torch's version, Inductor's configuration and the machine's vector
instructions or GPU generation. A later run of the same program on such a machine loads it and
compiles nothing; an entry that does not load is logged and compiled again. A region of the same
kernels on the same layouts as one whose artifact is in use in the process (the update of each
parameter of one shape) takes that artifact, neither compiling nor loading it.
Compiled code is specialized on its inputs' shapes and strides; an input laid out otherwise than
when compiled (an earlier region's compiled output) compiles the region again, once. A region
that fails to compile runs its kernels one by one as before, with one log line naming the reason
(without ``compile`` no region is made). A value a region produces and no later step reads stays
inside it: Inductor decides its memory. An input whose last reader is inside the region is handed
over with the call (``_taking_list``): the compiled code frees it after its last use, as eager
frees a saved activation during the backward.

A region holding the last reader of a state tensor the runner owns outright writes that state's
new value into its memory (``in_place``, from ``donation.state_overwrites``), as torch.optim's
compiled update does; a 0-d value its kernels read is computed once (``hoist_scalars``).

What a region never holds: a step that writes into a dead input (``donation.py``: the compiled
code decides its own buffer reuse, so a compiling runner turns that donation off), a gradient marker
whose hook does more than name the value (a bucket's, a pipeline's accumulation), a watched
value's hook (a region ends after the value, and the hook runs then: the loss answers the driver
early, which overlaps its next call with the backward and the update).
"""

from __future__ import annotations

import hashlib
import logging
import operator
import os
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._C._dynamo.guards import assert_size_stride

from .program import CALL, GET_ATTR, GETITEM, MARKER, Slot

log = logging.getLogger(__name__)

_IN_USE: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
"""The artifacts this process's regions hold, by ``artifact_key``: a region of the same kernels on
the same layouts as a live one takes its artifact, neither compiling nor loading it again."""


class Region:
    """Steps ``steps`` of a program as one compiled function (module docstring).

    ``inputs``: names read from the environment; ``outputs``: names written to it; ``freed``:
    inputs whose last reader is inside (dropped from the environment after the call);
    ``eager(env)``: the steps run one by one (the fallback); ``cache``: the directory of compiled
    artifacts, or None. A value that is a tuple or list of tensors (a multi-output operator's)
    crosses the compiled function's border as its elements."""

    def __init__(self, index: int, steps: list, layouts: dict[str, Any], constants: dict[str, Callable],
                 inputs: tuple[str, ...], outputs: tuple[str, ...], freed: tuple[str, ...],
                 eager: Callable[[dict], None], cache: str | None = None,
                 in_place: dict[str, str] | None = None, owned: set[str] | frozenset[str] = frozenset()):
        self.index, self.steps, self.layouts, self.constants = index, steps, layouts, constants
        self.inputs, self.outputs, self.freed, self.eager, self.cache = inputs, outputs, freed, eager, cache
        self.in_place = dict(in_place or {})
        """Output -> the state input whose memory it is written into (of one shape and dtype; settled
        when compiled). That input is this device's state tensor, read last here; the caller's
        ``owned`` holds it while the runner owns the tensor outright, else the region writes into a
        copy of it (the state then becomes that copy)."""
        self.owned = owned
        self._writes: list[tuple[str, int, str]] = []
        """(output, flat index of its state input, state input) of each write in place, once compiled."""
        self.loaded = False
        """Whether the compiled code came from the cache (nothing compiled)."""
        self.compiled: Callable | None = None
        self._artifact: Callable | None = None
        """The compiled artifact; while a region holds it, ``_IN_USE`` hands it to regions of its key."""
        self.failed: str | None = None
        """Why compiling failed (the region then runs eagerly), or None."""
        self.compile_s = 0.0
        self._in_kinds: list[int | None] = []
        self._in_layouts: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        """Each flat input's shape and strides when compiled."""
        self._out_kinds: list[tuple[type, int] | None] = []
        self._relaid = False
        """Whether it was compiled again for inputs laid out otherwise (once; a second time it fails)."""

    def __call__(self, env: dict) -> None:
        if self.compiled is None and self.failed is None:
            self._compile(env)
        args = None if self.compiled is None else self._flatten([env[a] for a in self.inputs])
        if args is not None and not self._laid_out_as_compiled(args):
            args = None  # no reference to the inputs kept while the region is compiled again or runs as written
            self._compile_again(env)
            if self.compiled is not None:
                args = self._flatten([env[a] for a in self.inputs])
        if args is None:
            self.eager(env)
            return
        written = {}
        for name, at, state in self._writes:  # the new state goes into the old one's memory
            if state not in self.owned:
                args[at] = args[at].clone()  # memory the runner does not own outright: a copy of its own
            written[name] = args[at]
        for name in self.freed:  # the compiled code holds the last reference and frees it after its last use
            env.pop(name, None)
        values = iter(self.compiled(args))
        for name, kind in zip(self.outputs, self._out_kinds):
            if name in written:
                env[name] = written[name]
            else:
                env[name] = next(values) if kind is None else kind[0](next(values) for _ in range(kind[1]))

    def _laid_out_as_compiled(self, flat: list) -> bool:
        """Whether every flat input has the shape and strides the compiled code was specialized on,
        by the check that code makes itself (``assert_size_stride``: a size-1 dimension's stride is
        free), but before it takes the inputs, while the region can still run another way."""
        try:
            for t, (shape, stride) in zip(flat, self._in_layouts):
                assert_size_stride(t, shape, stride)
        except AssertionError:
            return False
        return True

    def _compile_again(self, env: dict) -> None:
        """An input laid out otherwise than when compiled: compile on these inputs, once; layouts
        that change again leave the kernels running as written from then on."""
        if self._relaid:
            self._fail("inputs laid out differently again")
            return
        self._relaid = True
        log.info("region at step %d: an input is laid out otherwise than when compiled; compiling again", self.index)
        self._compile(env)

    def _flatten(self, values: list) -> list:
        """``values`` of ``inputs`` as the compiled function takes them: a tuple's elements each."""
        flat = []
        for value, kind in zip(values, self._in_kinds):
            flat.extend(value) if kind is not None else flat.append(value)
        return flat

    def graph(self) -> fx.GraphModule:
        """The region as an FX graph of operator overloads: placeholders for the inputs (a tuple's
        elements each), then the graph constants; outputs likewise flattened. Placeholders are
        named by position, not by the values they hold, so regions of the same kernels on the same
        layouts (the update of each same-shaped parameter) have the same code and artifact key:
        the first compiles, the others take its artifact (``compiled_artifact``)."""
        g = fx.Graph()
        nodes: dict[str, Any] = {}
        for i, (a, kind) in enumerate(zip(self.inputs, self._in_kinds)):
            if kind is None:
                nodes[a] = g.placeholder(f"in{i}")
            else:
                nodes[a] = tuple(g.placeholder(f"in{i}_{j}") for j in range(kind))
        consts = {name: g.placeholder(f"const{k}") for k, name in enumerate(self.constants)}
        for st in self.steps:
            if st.kind == GET_ATTR:
                nodes[st.name] = consts[st.name]
            elif st.kind == MARKER:  # it only names its value here
                nodes[st.name] = nodes[st.inputs[0]]
            elif st.kind == GETITEM:
                src = nodes[st.inputs[0]]
                nodes[st.name] = src[st.target] if isinstance(src, tuple) else g.call_function(
                    operator.getitem, (src, st.target))
            else:
                lay = self.layouts[st.name]
                def put(v, inputs=st.inputs):
                    return nodes[inputs[v.i]] if isinstance(v, Slot) else v
                nodes[st.name] = g.call_function(lay.op, fx.node.map_aggregate(lay.args, put),
                                                 fx.node.map_aggregate(lay.kwargs, put))
        for name, _, state in self._writes:
            g.call_function(torch.ops.aten.copy_.default, (nodes[state], nodes[name]))
        written = {name for name, _, _ in self._writes}
        out = []
        for name, kind in zip(self.outputs, self._out_kinds):
            node = nodes[name]
            if name in written:
                continue
            if kind is None:
                out.append(node)
            else:
                out.extend(node[j] if isinstance(node, tuple) else g.call_function(operator.getitem, (node, j))
                           for j in range(kind[1]))
        g.output(tuple(out))
        return fx.GraphModule(torch.nn.Module(), g)

    def _compile(self, env: dict) -> None:
        """Compile on this call's inputs; the outputs' kinds come from running the steps on fake
        tensors. The compiled code runs from this call on, so every later region is compiled on the
        layouts compiled code gives it (Inductor specializes on them)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        t0 = time.perf_counter()
        try:
            args = [env[a] for a in self.inputs]
            self._in_kinds = [_arity(a) for a in args]
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with mode:
                fake = {a: mode.from_tensor(v) if kind is None else type(v)(mode.from_tensor(x) for x in v)
                        for a, v, kind in zip(self.inputs, args, self._in_kinds)}
                self.eager(fake)
            results = [fake[name] for name in self.outputs]
            self._out_kinds = [None if (n := _arity(r)) is None else (type(r), n) for r in results]
            consts = [get() for get in self.constants.values()]
            flat = self._flatten(args)
            self._writes = self._writes_in_place(fake, flat)
            gm = self.graph()
            hoist_scalars(gm, flat + consts)
            self._artifact, self.loaded = compiled_artifact(gm, flat + consts, self.cache)
            self._in_layouts = [(tuple(t.shape), t.stride()) for t in flat]
            self.compiled = _taking_list(self._artifact, consts)
        except Exception as exc:  # noqa: BLE001 - any failure falls back to the kernels as they are
            self._fail(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        self.compile_s += time.perf_counter() - t0

    def _writes_in_place(self, fake: dict, flat: list) -> list[tuple[str, int, str]]:
        """``_writes``: each ``in_place`` output whose state input is one plain tensor of the same shape,
        strides and dtype, and which no other output writes."""
        at, i = {}, 0
        for name, kind in zip(self.inputs, self._in_kinds):
            if kind is None:
                at[name] = i
            i += 1 if kind is None else kind
        writes, taken = [], set()
        for name in self.outputs:
            state = self.in_place.get(name)
            if state is None or state not in at or state in taken:
                continue
            new, old = fake[name], flat[at[state]]
            if isinstance(new, torch.Tensor) and (new.shape, new.stride(), new.dtype) == (
                    old.shape, old.stride(), old.dtype):
                writes.append((name, at[state], state))
                taken.add(state)
        return writes

    def _fail(self, why: str) -> None:
        self.compiled, self.failed = None, why
        log.warning("region at step %d (%d steps) runs uncompiled: %s", self.index, len(self.steps), why)


def hoist_scalars(gm: fx.GraphModule, example: list[torch.Tensor]) -> int:
    """Make each 0-d value that ``gm`` computes from 0-d values alone and that a larger kernel reads
    (an optimizer's bias corrections from its step count, a learning rate's arithmetic) one more
    output of ``gm``; returns how many were added (the caller ignores them).

    Inductor's C++ code inlines such a value into each kernel that reads it, inside the loop, and
    computes it again for every vector of elements: AdamW's ``1 - beta ** step``, in double
    precision, once per 16 elements of every parameter. An output is computed once, before the
    loops. The deep GPT's update (101 parameters, 1.86 M elements, one thread): 13.0 ms as written,
    9.9 ms with its 302 such values computed once (``docs/results/update_region_2026-11-29.log``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    nodes = list(gm.graph.nodes)
    try:
        FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*example)
    except Exception as exc:  # noqa: BLE001 - an operator fake tensors cannot run: the graph compiles as it is
        log.debug("no 0-d values hoisted: %s: %s", type(exc).__name__, exc)
        for n in nodes:
            n.meta.pop("val", None)
        return 0

    def zero_dim(n) -> bool:
        v = n.meta.get("val")
        return isinstance(v, torch.Tensor) and v.dim() == 0

    scalar = {n for n in nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
              and not n.target.is_view and zero_dim(n) and all(zero_dim(a) for a in n.all_input_nodes)}
    for n in nodes:
        n.meta.pop("val", None)  # Inductor makes its own, in its own fake mode
    out = nodes[-1]
    outputs = set(out.args[0])
    hoisted = [n for n in nodes if n in scalar and n not in outputs
               and any(u not in scalar and u.op != "output" for u in n.users)]
    if hoisted:
        out.args = (tuple(out.args[0]) + tuple(hoisted),)
        gm.recompile()
    return len(hoisted)


def compiled_artifact(gm: fx.GraphModule, example: list[torch.Tensor],
                      cache: str | None) -> tuple[Callable, bool]:
    """``(fn, loaded)``: ``gm`` compiled by Inductor for inputs like ``example``: the artifact a live
    region of this process holds for them (``_IN_USE``), else the one the directory ``cache``
    holds (both ``loaded``: nothing compiled), else compiled and saved there (module docstring);
    a cache that cannot be read or written is logged and bypassed."""
    from torch._inductor import CompiledArtifact, standalone_compile

    key = artifact_key(gm, example)
    if (artifact := _IN_USE.get(key)) is not None:
        return artifact, True
    path = None if cache is None else Path(cache) / f"{key}.bin"
    if path is not None and path.is_file():
        try:
            artifact = _IN_USE[key] = CompiledArtifact.load(path=str(path), format="binary")
            return artifact, True
        except Exception as exc:  # noqa: BLE001 - a damaged or foreign entry: compile it again
            log.warning("ignoring compiled region %s (%s: %s); compiling it again", path, type(exc).__name__, exc)
    artifact = _IN_USE[key] = standalone_compile(gm, example, dynamic_shapes="from_example_inputs")
    if path is not None:
        tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            artifact.save(path=str(tmp), format="binary")
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not save the compiled region %s (%s); continuing without", path, exc)
            tmp.unlink(missing_ok=True)
    return artifact, False


def _taking_list(artifact: Callable, consts: list) -> Callable[[list], Any]:
    """A function of the region's flat inputs as one list, which it empties: the compiled code
    (AOTAutograd's boxed calling convention, as ``torch.compile`` calls it) then holds the only
    reference to an input the caller let go of, and frees it after its last use, as eager does,
    instead of when the region ends. A ``CompiledArtifact`` is called with its inputs as
    arguments, which keeps them all until it returns; its list-taking function is the closure
    variable ``compiled_fn`` of the callable or of one it wraps (``__wrapped__``; PyTorch 2.13's
    fresh and loaded artifacts). Where none is found the artifact is called as documented."""
    fn = getattr(artifact, "_compiled_fn", artifact)
    while fn is not None:
        cells = dict(zip(getattr(fn, "__code__", None) and fn.__code__.co_freevars or (),
                         (c.cell_contents for c in getattr(fn, "__closure__", None) or ())))
        if callable(boxed := cells.get("compiled_fn")) and not cells.get("params_buffers_flat"):
            def call(args: list, boxed=boxed) -> Any:
                args.extend(consts)
                return boxed(args)
            return call
        fn = getattr(fn, "__wrapped__", None)
    return lambda args: artifact(*args, *consts)


def artifact_key(gm: fx.GraphModule, example: list[torch.Tensor]) -> str:
    """32 hex digits of SHA-256 over what a compiled region depends on (module docstring)."""
    from torch._inductor import config

    devices = sorted({t.device for t in example}, key=str)
    if any(d.type == "cuda" for d in devices):
        machine = repr([torch.cuda.get_device_capability(d) for d in devices if d.type == "cuda"])
    else:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        machine = str(pick_vec_isa())
    from torch._inductor.utils import tensor_is_aligned

    # Where an input starts within its storage matters to the compiled code only as Inductor's
    # alignment class (it copies an input misaligned at run time itself): the gradients of a bucket
    # (views at offsets of one buffer) then share their update's artifact.
    inputs = [(tuple(t.shape), t.stride(), tensor_is_aligned(t), str(t.dtype), str(t.device), t.requires_grad)
              for t in example]
    digest = hashlib.sha256()
    for part in (torch.__version__, machine, gm.code, repr(inputs)):
        digest.update(part.encode())
    digest.update(config.get_hash())
    return digest.hexdigest()[:32]


def _arity(value) -> int | None:
    """None for a tensor; the length of a tuple or list of tensors; else ``TypeError``."""
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return len(value)
    raise TypeError(f"a value crossing the region's border is a {type(value).__name__}, not tensors")


def split(steps: list, fusable: Callable[[Any], bool], alias: Callable[[Any], bool],
          last: frozenset[str] = frozenset()) -> list[tuple[int, int]]:
    """``(start, end)`` of each maximal run of ``steps`` a region may hold: ``fusable`` steps (local
    kernels, ``getitem``s, constants) and the markers between them that only name their value
    (``alias``); a step collecting a bucket first starts a new run, and a run ends after a step
    named in ``last`` (a watched value: the loss answers the driver as soon as it is computed).
    Each run starts with a fusable step and holds at least one kernel."""
    spans, start = [], None
    for i, st in enumerate(steps):
        if start is not None and (st.before or not (fusable(st) or (st.kind == MARKER and alias(st)))):
            spans.append((start, i))
            start = None
        if start is None and fusable(st):
            start = i
        if start is not None and st.name in last:
            spans.append((start, i + 1))
            start = None
    if start is not None:
        spans.append((start, len(steps)))
    return [(a, b) for a, b in spans if any(steps[j].kind == CALL for j in range(a, b))]


def region_io(steps: list, start: int, end: int) -> tuple[tuple, tuple, tuple]:
    """``(inputs, outputs, freed)`` of the region ``steps[start:end]``."""
    inside = steps[start:end]
    made = {st.name for st in inside}
    freed_inside = {name for st in inside for name in st.free}
    inputs: list[str] = []
    for st in inside:
        for a in st.inputs:
            if a not in made and a not in inputs:
                inputs.append(a)
    outputs = tuple(st.name for st in inside if st.name not in freed_inside)
    return tuple(inputs), outputs, tuple(a for a in inputs if a in freed_inside)


__all__ = ["Region", "artifact_key", "compiled_artifact", "hoist_scalars", "region_io", "split"]
