"""Give every node of a captured training step a layer (Alpa OSDI'22 §5.2).

Owns: ``assign_layers(graph) -> LayerAssignment``, the map from each node of an
``OpGraph`` (``alpa_torch.core.graph``) to one of L layers, and the facts about the
layers the stage search reads (FLOPs, bytes crossing each cut). Does not own
the clustering DP itself (``layering.cluster_layers``, exact, numba) nor what
layers become (``search.py`` slices them into pipeline stages).

Rules, in the order they are applied:

1. forward operators, in topological order, are cut into L contiguous layers
   by ``cluster_layers`` (FLOPs from ``OpNode.flops``; edges from operator
   inputs weighted by the bytes of the producer's output, chained over the
   consumers of a value so a value entering a layer counts once: see
   ``_forward_edges``), or at module boundaries (``boundaries_by_module``).
   A model with a stack of at least L repeated blocks (``_block_starts``:
   decoder layers) is cut between whole blocks only: evenly by FLOPs, the
   same count of blocks in every middle layer where that is as even
   (``_even_cuts``), where every cut between blocks sends the same bytes (a
   transformer's residual stream), else by ``cluster_layers`` over the blocks;
2. placeholders (parameters, buffers, batch leaves) take the layer of their
   first forward consumer; optimizer state the layer of its parameter; other
   inputs (host scalars) the smallest layer of any consumer;
3. backward operators: guess(v) = max layer of the forward values and
   placeholders v reads (saved activations, parameters), else the max layer
   of its backward inputs, else L-1; then, in topological order,
   layer(v) = min(guess(v), min over backward producers u of layer(u)), so
   backward data only flows from higher to lower layers;
4. update operators take the layer of the parameter / optimizer state / buffer
   they produce (through any chain of update consumers); an operator feeding
   several (a global-norm clip) takes the smallest such layer, and if it
   depends on a gradient, ``update_crosses_layers`` is set;
5. a ``getitem`` takes the layer of the multi-output operator it reads, so a
   tuple never crosses a stage boundary (the runtime moves tensors only).

Default L (``default_num_layers``): one layer per 6 matmul-class forward
operators, rounded (a transformer block has 6: qkv, scores, context,
out-projection, fc1, fc2; the LM head adds 1), at least min(2, #matmuls), at most 16 and at most the number of
forward operators.

No torch import: only the ``OpGraph`` records are read.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .layering import cluster_layers

logger = logging.getLogger(__name__)

MAX_DEFAULT_LAYERS = 16
MATMULS_PER_LAYER = 6
_MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "conv2d",
               "conv1d", "_scaled_dot_product")
_GETITEM = "<built-in function getitem>"
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerAssignment:
    """Which layer every node of an ``OpGraph`` belongs to."""

    num_layers: int
    """L."""
    layer_of: Mapping[str, int]
    """node name -> layer, for every placeholder and ``call_function`` node, in graph order."""
    forward_flops: tuple[float, ...]
    """FLOPs of the forward operators of each layer."""
    boundary_bytes: tuple[int, ...]
    """[l]: bytes of forward values made in layers < l and read in layers >= l (0 for l = 0):
    what a pipeline cut before layer l sends forward (and its gradient back)."""
    update_crosses_layers: bool
    """True if a gradient-dependent update operator feeds parameters of several layers."""
    method: str = "cluster"
    """'cluster' (``cluster_layers`` over operators), 'blocks' (``cluster_layers`` over whole
    repeated blocks, ``_block_starts``) or 'modules' (``boundaries_by_module``)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        bad = {k: v for k, v in self.layer_of.items() if not 0 <= v < self.num_layers}
        if bad:
            raise ValueError(f"layers out of [0, {self.num_layers}): {dict(list(bad.items())[:5])}")

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "layer_of": dict(self.layer_of),
                "forward_flops": list(self.forward_flops), "boundary_bytes": list(self.boundary_bytes),
                "update_crosses_layers": self.update_crosses_layers, "method": self.method}

    @staticmethod
    def from_dict(d: Mapping) -> LayerAssignment:
        return LayerAssignment(num_layers=int(d["num_layers"]), layer_of=dict(d["layer_of"]),
                               forward_flops=tuple(float(x) for x in d["forward_flops"]),
                               boundary_bytes=tuple(int(x) for x in d["boundary_bytes"]),
                               update_crosses_layers=bool(d["update_crosses_layers"]),
                               method=str(d.get("method", "cluster")))


class LayerSignatures:
    """Per layer: its operators (graph order), and the name map to the first layer with
    the same signature (its representative): same operator targets, shapes, dtypes,
    phases, output roles and wiring, sources described by shape and kind. Layers with
    one signature build identical intra-op ILPs, so ``stage_costs`` solves one."""

    def __init__(self, graph, layers: LayerAssignment):
        self.ops: list[list[str]] = [[] for _ in range(layers.num_layers)]
        for name in graph.nodes:
            self.ops[layers.layer_of[name]].append(name)
        inputs = {s.node: s for s in graph.inputs}
        out_kinds = {s.node: s.kind for s in graph.outputs}
        self.rep_of: list[int] = []
        self.to_rep: list[dict[str, str]] = []
        first: dict[tuple, int] = {}
        names_of: list[list[str]] = []
        for l, ops in enumerate(self.ops):
            names, sig = _signature(graph, ops, inputs, out_kinds)
            names_of.append(names)
            rep = first.setdefault(sig, l)
            self.rep_of.append(rep)
            self.to_rep.append(dict(zip(names, names_of[rep])))

    @property
    def num_distinct(self) -> int:
        return len(set(self.rep_of))


def _signature(graph, ops: list[str], inputs: dict, out_kinds: dict):
    """(ops + sources in first-use order, position-independent signature)."""
    pos = {n: i for i, n in enumerate(ops)}
    sources: dict[str, int] = {}
    entries = []
    for n in ops:
        node = graph.nodes[n]
        refs = tuple(("o", pos[u]) if u in pos else ("s", sources.setdefault(u, len(sources)))
                     for u in node.inputs)
        entries.append((node.target, node.shape, node.dtype, node.phase, refs, out_kinds.get(n)))
    src_desc = []
    for u in sources:
        if u in graph.nodes:
            v = graph.nodes[u]
            src_desc.append((v.target, v.shape, v.dtype, v.phase))
        else:
            spec = inputs.get(u)
            src_desc.append((spec.kind, tuple(spec.shape), spec.dtype) if spec else ("?",))
    return ops + list(sources), (tuple(entries), tuple(src_desc))


def value_bytes(node) -> int:
    """Bytes of an ``OpNode``'s (first) output, from its shape and dtype."""
    if node.shape is None:
        return 0
    return math.prod(int(d) for d in node.shape) * _ITEMSIZE.get(str(node.dtype), 4)


def is_matmul(node) -> bool:
    op = str(node.target).removeprefix("aten.").split(".")[0]
    return op.startswith(_MATMUL_OPS)


def default_num_layers(graph) -> int:
    """The default L (module docstring)."""
    forward = [n for n in graph.nodes.values() if n.phase == "forward"]
    matmuls = sum(is_matmul(n) for n in forward)
    layers = max(round(matmuls / MATMULS_PER_LAYER), min(2, matmuls), 1)
    return max(1, min(layers, MAX_DEFAULT_LAYERS, len(forward)))


def _module_boundaries(graph, forward: list[str], spec) -> np.ndarray:
    """Index (in ``forward``) of the first forward op reading each module's parameters."""
    params = [s for s in graph.inputs if s.kind == "param"]
    if isinstance(spec, str):
        pat = re.compile(rf"^{re.escape(spec)}\.(\d+)\.")
        idx = sorted({int(m.group(1)) for s in params if (m := pat.match(s.name))})
        prefixes = [f"{spec}.{i}" for i in idx]
    else:
        prefixes = list(spec)
    if not prefixes:
        raise ValueError(f"boundaries_by_module={spec!r} matches no parameter; parameter names look "
                         f"like {[s.name for s in params[:3]]}")
    pos = {name: i for i, name in enumerate(forward)}
    starts = []
    for prefix in prefixes:
        holders = {s.node for s in params if s.name.startswith(prefix + ".")}
        first = min((pos[n] for n in forward if holders & set(graph.nodes[n].inputs)), default=None)
        if first is None:
            raise ValueError(f"no forward operator reads a parameter of module {prefix!r}")
        starts.append(first)
    starts = np.unique(starts).astype(np.int64)
    starts[0] = 0  # what precedes the first module (embeddings) joins its layer
    return starts


def _forward_edges(graph, forward: list[str]):
    """Edges for ``cluster_layers``, as a chain per value: u -> v1 -> v2 -> ... over its
    consumers v1 < v2 < ..., each weighted by the bytes of u. A layer (a contiguous
    range) holding consumers v_i..v_j then has exactly one entering edge for u, so
    C(a, b) counts each value once, not once per consumer."""
    pos = {name: i for i, name in enumerate(forward)}
    consumers: dict[int, list[int]] = {}
    for j, name in enumerate(forward):
        for u in dict.fromkeys(graph.nodes[name].inputs):
            if u in pos and pos[u] < j:
                consumers.setdefault(pos[u], []).append(j)
    src, dst, nbytes = [], [], []
    for u, vs in consumers.items():
        size = value_bytes(graph.nodes[forward[u]])
        chain = [u] + vs
        src += chain[:-1]
        dst += chain[1:]
        nbytes += [size] * len(vs)
    return np.array(src, np.int64), np.array(dst, np.int64), np.array(nbytes, np.int64)


def _forward_boundaries(graph, forward, num_layers, boundaries_by_module):
    """(first forward op index of each layer, method)."""
    if boundaries_by_module is not None:
        starts = _module_boundaries(graph, forward, boundaries_by_module)
        if num_layers is not None:
            if num_layers > starts.size:
                raise ValueError(f"num_layers={num_layers} exceeds the {starts.size} module boundaries")
            starts = starts[np.round(np.arange(num_layers) * starts.size / num_layers).astype(np.int64)]
        return starts, "modules"
    flops = np.array([graph.nodes[n].flops for n in forward], dtype=np.float64)
    src, dst, nbytes = _forward_edges(graph, forward)
    blocks = _block_starts(graph, forward)
    if blocks is not None and blocks.size >= num_layers:  # cut between whole blocks only
        seg = np.searchsorted(blocks, np.arange(len(forward)), side="right") - 1
        keep = seg[src] != seg[dst]
        seg_src, seg_dst, seg_bytes = seg[src][keep], seg[dst][keep], nbytes[keep]
        seg_flops = np.add.reduceat(flops, blocks)
        crossing = np.zeros(blocks.size + 1, dtype=np.int64)  # bytes crossing the cut before each block
        np.add.at(crossing, seg_src + 1, seg_bytes)
        np.add.at(crossing, seg_dst + 1, -seg_bytes)
        if np.unique(np.cumsum(crossing)[1:blocks.size]).size == 1:  # every cut costs the same bytes
            return blocks[_even_cuts(seg_flops, num_layers)], "blocks"
        return blocks[cluster_layers(seg_flops, seg_src, seg_dst, seg_bytes, num_layers)], "blocks"
    return cluster_layers(flops, src, dst, nbytes, num_layers), "cluster"


REGULAR_SLACK = 0.01
"""``_even_cuts`` takes the best regular cut if its sum of squares is within this fraction of the least."""


def _even_cuts(flops: np.ndarray, num_layers: int) -> np.ndarray:
    """First item of each of ``num_layers`` contiguous layers of ``flops`` (at least one item
    each), as even as the layers' FLOPs allow, preferring a regular cut.

    The evenest cut (``_least_squares_cuts``) may put its one odd layer anywhere: LLaMA-3-70B's
    80 decoder layers in 16 were 5 each but 6 in layer 13 and 4 in the last (which holds the
    head), 4 distinct layers. A regular cut, the same count of blocks in every layer but the
    first and the last, has 3 (the ends hold the embeddings and the head anyway), so a quarter
    fewer ILPs per mesh; it is taken when it is as even within ``REGULAR_SLACK`` (on LLaMA-3-8B
    and -70B it is within 0.01 %: the extra block goes to the first layer, whose embedding is
    nearly free, instead of a middle one)."""
    least = _least_squares_cuts(flops, num_layers)
    regular = _regular_cuts(flops, num_layers)
    if regular is not None and _sse(flops, regular) <= _sse(flops, least) * (1 + REGULAR_SLACK):
        return regular
    return least


def _sse(flops: np.ndarray, starts: np.ndarray) -> float:
    """Sum of squared differences of the layers' FLOPs (layers starting at ``starts``) from their mean."""
    per_layer = np.add.reduceat(flops, starts)
    return float(((per_layer - per_layer.mean()) ** 2).sum())


def _regular_cuts(flops: np.ndarray, num_layers: int) -> np.ndarray | None:
    """The evenest cut with k items in each layer but the first and the last (which take the
    rest, at least one each), or None where there is none (fewer than three layers)."""
    n, inner = flops.size, num_layers - 2
    best, best_sse = None, np.inf
    for k in range(1, (n - 2) // inner + 1) if inner > 0 else ():
        for first in range(1, n - inner * k):
            starts = np.concatenate(([0], first + k * np.arange(inner + 1))).astype(np.int64)
            if (sse := _sse(flops, starts)) < best_sse:
                best, best_sse = starts, sse
    return best


def _least_squares_cuts(flops: np.ndarray, num_layers: int) -> np.ndarray:
    """The cut of ``_even_cuts`` with the least sum of squared differences of the layers' FLOPs
    from their mean: an exact DP over the cut positions, O(num_layers x n^2) for n blocks
    (n <= a few hundred)."""
    prefix = np.concatenate(([0.0], np.cumsum(flops)))
    n, mean = flops.size, prefix[-1] / num_layers
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    back = np.zeros((num_layers + 1, n + 1), dtype=np.int64)
    for k in range(1, num_layers + 1):
        nxt = np.full(n + 1, np.inf)
        for j in range(k, n - (num_layers - k) + 1):
            cand = best[k - 1:j] + (prefix[j] - prefix[k - 1:j] - mean) ** 2
            i = int(np.argmin(cand))
            nxt[j], back[k, j] = cand[i], k - 1 + i
        best = nxt
    cuts, j = [], n
    for k in range(num_layers, 0, -1):
        j = int(back[k, j])
        cuts.append(j)
    return np.asarray(cuts[::-1], dtype=np.int64)


_BLOCK = re.compile(r"^(.+?)\.(\d+)\.")


def _block_starts(graph, forward: list[str]) -> np.ndarray | None:
    """Index (in ``forward``) of the first op of each repeated block (a decoder layer), or
    None: the blocks are the entries of the outermost lists of modules whose parameters
    are named ``<list>.<i>.`` (``model.layers.3.``, ``transformer.h.3.``, T5's
    ``encoder.block.3.`` and ``decoder.block.3.``; an expert list inside a block is not
    one), at least two entries each; a block starts at the first forward operator reading
    one of its parameters, and whatever precedes the first block joins it.

    Layers cut only between blocks repeat: LLaMA-3-8B's 16 layers cut by operator had 7
    distinct signatures (cuts at RMSNorms, half of them inside a decoder layer: layers of
    1.5 and 2.5 blocks), each one ILP per mesh; cut between blocks, 3 (``_even_cuts``,
    docs/benchmarks.md)."""
    block_of: dict[str, tuple[str, int]] = {}  # parameter node -> (list, index)
    for s in graph.inputs:
        if s.kind == "param" and (m := _BLOCK.match(s.name)):
            block_of[s.node] = (m.group(1), int(m.group(2)))
    sizes: dict[str, set[int]] = {}
    for lst, i in block_of.values():
        sizes.setdefault(lst, set()).add(i)
    first: dict[tuple[str, int], int] = {}
    for j, name in enumerate(forward):
        for u in graph.nodes[name].inputs:
            if (b := block_of.get(u)) is not None and len(sizes[b[0]]) >= 2:
                first.setdefault(b, j)
    if not first:
        return None
    starts = np.unique(np.fromiter(first.values(), dtype=np.int64))
    starts[0] = 0  # what precedes the first block (embeddings) joins it
    return starts


def _backward_layers(graph, layer_of: dict, num_layers: int) -> None:
    for name, node in graph.nodes.items():
        if node.phase != "backward":
            continue
        fwd = [layer_of[u] for u in node.inputs if u in layer_of and
               (u not in graph.nodes or graph.nodes[u].phase == "forward")]
        bwd = [layer_of[u] for u in node.inputs if u in graph.nodes and graph.nodes[u].phase == "backward"]
        guess = max(fwd) if fwd else max(bwd) if bwd else num_layers - 1
        layer_of[name] = min([guess] + bwd)


def _update_layers(graph, layer_of: dict, param_layer: dict) -> bool:
    """Rule 4; returns update_crosses_layers."""
    state_layer = {}
    for s in graph.outputs:
        if s.kind == "param":
            state_layer[s.node] = param_layer.get(s.name)
        elif s.kind == "opt_state":
            owner = next((p for p in param_layer if s.name.startswith(p + ".")), None)
            state_layer[s.node] = param_layer.get(owner)
        elif s.kind == "buffer":
            holder = next((i.node for i in graph.inputs if i.kind == "buffer" and i.name == s.name), None)
            state_layer[s.node] = layer_of.get(holder)
    grads = set(graph.grad_of.values())
    grad_dep = {}
    for name, node in graph.nodes.items():
        if node.phase == "update":
            grad_dep[name] = any(u in grads or grad_dep.get(u, False) for u in node.inputs)
    lo: dict[str, int] = {}
    hi: dict[str, int] = {}
    consumers: dict[str, list[str]] = {}
    for name, node in graph.nodes.items():
        if node.phase == "update":
            for u in node.inputs:
                consumers.setdefault(u, []).append(name)
    crosses = False
    for name in reversed([n for n, v in graph.nodes.items() if v.phase == "update"]):
        users = consumers.get(name, ())
        reach = [lo[c] for c in users if c in lo] + [hi[c] for c in users if c in hi]
        if state_layer.get(name) is not None:
            reach.append(state_layer[name])
        if not reach:  # feeds nothing we track: follow its inputs
            reach = [layer_of[u] for u in graph.nodes[name].inputs if u in layer_of] or [0]
        lo[name], hi[name] = min(reach), max(reach)
        layer_of[name] = lo[name]
        crosses |= lo[name] != hi[name] and grad_dep[name]
    return crosses


def _boundary_bytes(graph, layer_of: dict, num_layers: int) -> tuple[int, ...]:
    """Bytes of forward values crossing each cut (each value counted once per cut)."""
    diff = np.zeros(num_layers + 1, dtype=np.int64)
    last_use: dict[str, int] = {}
    for name, node in graph.nodes.items():
        if node.phase == "forward":
            for u in node.inputs:
                if u in graph.nodes and graph.nodes[u].phase == "forward":
                    last_use[u] = max(last_use.get(u, -1), layer_of[name])
    for u, last in last_use.items():
        if last > layer_of[u]:
            diff[layer_of[u] + 1] += value_bytes(graph.nodes[u])
            diff[last + 1] -= value_bytes(graph.nodes[u])
    return tuple(int(x) for x in np.cumsum(diff)[:num_layers])


def assign_layers(graph, num_layers: int | None = None,
                  boundaries_by_module: str | Sequence[str] | None = None) -> LayerAssignment:
    """Assign every node of ``graph`` a layer (module docstring).

    ``boundaries_by_module``: a ModuleList name (``'blocks'``: each ``blocks.<i>``
    starts a layer) or a list of module-name prefixes; the first forward operator
    reading a parameter of each module starts a layer. With ``num_layers`` too, that
    many of those boundaries are kept, evenly spaced.
    """
    forward = [n for n, v in graph.nodes.items() if v.phase == "forward"]
    if not forward:
        raise ValueError("the graph has no forward operators to cut into layers")
    if num_layers is None and boundaries_by_module is None:
        num_layers = default_num_layers(graph)
    if num_layers is not None and not 1 <= int(num_layers) <= len(forward):
        raise ValueError(f"num_layers must be in [1, {len(forward)}] (forward operators), got {num_layers}")
    starts, method = _forward_boundaries(graph, forward, num_layers, boundaries_by_module)
    num_layers = int(starts.size)
    layer_of: dict[str, int] = {}
    fwd_layer = np.searchsorted(starts, np.arange(len(forward)), side="right") - 1
    flops = np.zeros(num_layers)
    for name, l in zip(forward, fwd_layer.tolist()):
        layer_of[name] = l
        flops[l] += graph.nodes[name].flops
    placeholders = [n.name for n in graph.gm.graph.nodes if n.op == "placeholder"]
    for name, node in graph.nodes.items():  # rule 2: first forward consumer
        if node.phase == "forward":
            for u in node.inputs:
                if u not in graph.nodes:
                    layer_of.setdefault(u, layer_of[name])
    param_layer = {s.name: layer_of.get(s.node, 0) for s in graph.inputs if s.kind == "param"}
    for s in graph.inputs:
        if s.kind == "opt_state" and s.node not in layer_of:
            owner = next((p for p in param_layer if s.name.startswith(p + ".")), None)
            if owner is not None:
                layer_of[s.node] = param_layer[owner]
    _backward_layers(graph, layer_of, num_layers)
    crosses = _update_layers(graph, layer_of, param_layer)
    for name in placeholders:  # host scalars, unused inputs: smallest consuming layer
        if name not in layer_of:
            users = [layer_of[c] for c, v in graph.nodes.items() if name in v.inputs and c in layer_of]
            layer_of[name] = min(users, default=0)
    for name, node in graph.nodes.items():  # rule 5: a getitem stays with its multi-output operator
        if node.target == _GETITEM and node.inputs and node.inputs[0] in graph.nodes:
            layer_of[name] = layer_of[node.inputs[0]]
    order = placeholders + list(graph.nodes)
    ordered = {n: layer_of[n] for n in order}
    if crosses:
        logger.info("update operators (e.g. a global-norm clip) feed parameters of several layers")
    return LayerAssignment(num_layers=num_layers, layer_of=ordered, forward_flops=tuple(flops.tolist()),
                           boundary_bytes=_boundary_bytes(graph, ordered, num_layers),
                           update_crosses_layers=crosses, method=method)
