"""Activation checkpointing as a graph rewrite: recompute a layer's forward in its backward.

The plan names the layers to recompute (``StagePlan.recompute``). For each such
layer, every forward value its backward (or another layer's backward) reads is
produced a second time by a copy of its forward operators, placed just before
the first backward operator that needs it; the backward reads the copies, so
the originals are read only by the forward and die there (the runtime frees a
value after its last reader). What a recomputed layer keeps per microbatch are
the values its copies read from outside the layer (the previous layer's output:
the checkpoint; and the weights) and the values other layers' backward reads.

Copies are exact: the same operators on the same inputs (a random operator is
never copied: its output is kept), with the original's sharding
(``extend_sharding``), layer and stage. The copies are backward operators by
dataflow (they lead to gradients, not to the loss), so ``partition`` puts them in
the stage's backward program with no other change.

``recompute_nodes`` is also what the planner prices (``stage_dp.checkpointing``):
the copied operators' forward time is the added time, and the saved values of a
recomputed layer drop to the ones read from outside it.
"""

from __future__ import annotations

import dataclasses
import operator

import torch.fx as fx

from .grad_op import GRAD_MARKER
from .graph import OpGraph
from .graph_facts import build_nodes
from .partition import stage_of_nodes

COPY_SUFFIX = "_recompute"
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "randperm", "exponential",
           "geometric", "cauchy", "log_normal", "poisson")


def is_random(target: str) -> bool:
    """Whether an aten target draws random numbers (recomputing it would not reproduce it)."""
    op = target.split(".")[1] if target.startswith("aten.") else target
    return any(word in op for word in _RANDOM)


def recompute_nodes(graph: OpGraph, layer_of: dict[str, int], layers,
                    reader: dict[str, int] | None = None) -> dict[int, list[str]]:
    """Per recomputed layer, its forward operators to copy, in graph order.

    Those are the layer's forward values read by a non-forward operator of the same
    layer, and the forward operators of the same layer they are computed from (a
    value from another layer, a graph input or a random operator's output is read
    as kept; so is a value another layer's backward reads: that reader keeps the
    original, which is what a stage boundary needs). ``reader``: the layer whose copies each
    operator reads (``reader_layers``; default ``layer_of``)."""
    layers = set(layers)
    nodes = graph.nodes
    reader = layer_of if reader is None else reader
    own = {n: layer_of[n] for n, f in nodes.items()
           if f.phase == "forward" and layer_of.get(n) in layers and not is_random(f.target)}
    # An element of a recomputed operator's tuple result (a layer norm's saved mean and rstd) that
    # only the backward reads is recomputed with it: a value of the forward, whatever its phase.
    for node in graph.gm.graph.nodes:
        if node.target is operator.getitem and node.args[0].name in own and node.name in nodes:
            own[node.name] = own[node.args[0].name]
    need: set[str] = set()
    for f in nodes.values():
        if f.phase != "forward":
            need.update(a for a in f.inputs if a in own and own[a] == reader.get(f.name))
    stack = list(need)
    while stack:
        n = stack.pop()
        for a in nodes[n].inputs:
            if a in own and own[a] == own[n] and a not in need:
                need.add(a)
                stack.append(a)
    out: dict[int, list[str]] = {}
    for n in nodes:  # graph order
        if n in need:
            out.setdefault(own[n], []).append(n)
    return out


def reader_layers(graph: OpGraph, layer_of: dict[str, int], stage_ranges=None) -> dict[str, int]:
    """The layer whose recomputed copies each operator reads: its own (``layer_of``), or none
    where ``partition`` runs it on another stage than its layer's (``stage_ranges``: the
    stages' inclusive layer ranges; None prices layers alone, as if each were a stage).

    A pre-norm block's RMSNorm weight gradient reads the normalized input, which the block
    before computes (the block starts at the weight's first reader), so its layer is the one
    before; where a stage starts at that block, the partition moves the gradient to its weight's
    stage, where the copies of the layer before (on the stage before, recomputed after this
    stage's backward) cannot reach: it reads the original, kept. Reading the copies, it pulled
    the whole recomputed forward of the layer before (the embedding and its weight) onto the
    later stage, and the plan could not be partitioned."""
    if stage_ranges is None:
        return layer_of
    stage_of = stage_of_nodes(graph, layer_of, [tuple(r) for r in stage_ranges])
    home = {layer: k for k, (lo, hi) in enumerate(stage_ranges) for layer in range(lo, hi + 1)}
    return {n: layer for n, layer in layer_of.items() if stage_of[n] == home[layer]}


def rematerialize(graph: OpGraph, layer_of: dict[str, int], layers,
                  stage_ranges=None) -> tuple[OpGraph, dict[str, str]]:
    """``graph`` with the forward of ``layers`` recomputed before its backward readers.

    Returns the new graph (a copy; ``graph`` is unchanged) and copy name -> original
    name. With no layer to recompute, returns ``graph`` itself and {}. A plan's graph needs
    its ``stage_ranges`` (``reader_layers``)."""
    reader = reader_layers(graph, layer_of, stage_ranges)
    groups = recompute_nodes(graph, layer_of, layers, reader)
    if not groups:
        return graph, {}
    gm = fx.GraphModule(graph.gm, copy_graph(graph.gm.graph))
    g = gm.graph
    by_name = {n.name: n for n in g.nodes}
    group_of = {n: l for l, names in groups.items() for n in names}
    copies: dict[str, fx.Node] = {}
    origin: dict[str, str] = {}
    for node in list(g.nodes):
        # A tuple element (``getitem``) is recomputed with its operator (``recompute_nodes``), never
        # where copies start: a layer norm's saved mean and rstd sit right after it, inside the
        # forward, and copies made there would save nothing.
        if (node.op != "call_function" or graph.nodes[node.name].phase == "forward"
                or node.target is operator.getitem):
            continue
        layer = reader.get(node.name)  # its own layer's values only: others' readers keep the originals
        wanted = [a for a in node.all_input_nodes if a.name in group_of and group_of[a.name] == layer]
        if wanted and groups[layer][0] not in copies:  # the first reader: copy the layer's forward here
            with g.inserting_before(node):
                for name in groups[layer]:
                    src = by_name[name]
                    new = g.node_copy(src, lambda a, layer=layer: copies.get(a.name, a)
                                      if group_of.get(a.name) == layer else a)
                    new.name = g._graph_namespace.create_name(name + COPY_SUFFIX, None)
                    new.meta = dict(src.meta)
                    copies[name] = new
                    origin[new.name] = name
        for a in wanted:
            node.replace_input_with(a, copies[a.name])
    for name in origin.values():  # an original tuple element whose readers all read its copy
        if by_name[name].target is operator.getitem and not by_name[name].users:
            g.erase_node(by_name[name])
    g.lint()
    gm.recompile()
    nodes, grad_of = build_nodes(gm, graph.inputs, graph.outputs, list(_opt_names(graph)), GRAD_MARKER)
    new = dataclasses.replace(graph, gm=gm, nodes=nodes, grad_of=grad_of, meta=dict(graph.meta))
    new.meta["recomputed_layers"] = sorted(groups)
    return new, origin


def copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def _opt_names(graph: OpGraph):
    """The optimizer's parameter names in the order the gradient markers index them."""
    return graph.param_groups.keys()


def extend_layer_of(layer_of: dict[str, int], origin: dict[str, str]) -> dict[str, int]:
    """``layer_of`` with every copy in its original's layer."""
    return {**layer_of, **{c: layer_of[o] for c, o in origin.items()}}


def extend_sharding(sharding, origin: dict[str, str]):
    """A ``StageSharding`` with every copy sharded as its original."""
    if not origin:
        return sharding
    values = dict(sharding.value_specs)
    inputs = dict(sharding.input_specs)
    for c, o in origin.items():
        if o in sharding.value_specs:
            values[c] = sharding.value_specs[o]
        if o in sharding.input_specs:
            inputs[c] = sharding.input_specs[o]
    return dataclasses.replace(sharding, value_specs=values, input_specs=inputs)


__all__ = ["COPY_SUFFIX", "extend_layer_of", "extend_sharding", "is_random", "reader_layers", "recompute_nodes",
           "rematerialize"]
