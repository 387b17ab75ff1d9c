"""Split a captured step into per-stage programs and the values that cross stages.

Pure bookkeeping, no communication: given the stage of every graph node, each
stage gets three ordered lists of operators, run as

- ``forward``  once per microbatch,
- ``backward`` once per microbatch (gradients are accumulated over them),
- ``update``   once per step, on the accumulated gradients;

and a ``Crossing`` for every value produced on one stage and read on another,
with the phase that produces it and the first phase that reads it. The
pipeline schedule needs forward values to flow to later stages and backward
values to earlier ones; anything else (a weight tied across stages, a global
gradient-norm clip spanning stages) is refused with a ``PlanError`` naming the
value, because the runtime cannot yet execute it. Graph constants (``get_attr``
nodes) belong to no stage and never cross: each stage reading one makes its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from alpa_torch.core.errors import PlanError

from .grad_reductions import LAYOUT_OPS
from .graph import OpGraph

PHASE_ORDER = {"forward": 0, "backward": 1, "update": 2}


@dataclass(frozen=True, slots=True)
class Crossing:
    """A value computed on stage ``src`` and read on stage ``dst``."""

    value: str
    src: int
    dst: int
    produced: str
    """'forward' or 'backward' (sent after that phase of each microbatch)."""
    consumed: str
    """'forward' or 'backward' (received before that phase)."""


@dataclass(frozen=True, slots=True)
class StageProgram:
    stage: int
    forward: tuple[str, ...]
    backward: tuple[str, ...]
    update: tuple[str, ...]
    sources: tuple[str, ...]
    """Graph inputs this stage reads (placeholder names)."""


def _phase(graph, name: str) -> str:
    node = graph.nodes.get(name)
    return node.phase if node is not None else "input"


def _check_crossing(graph, value: str, s: int, t: int, produced: str, consumed: str) -> None:
    ok = (produced == "forward" and consumed == "forward" and t > s) or (
        produced == "forward" and consumed == "backward") or (
        produced == "backward" and consumed == "backward" and t < s)
    if not ok:
        raise PlanError(
            f"value {value!r} ({produced}, stage {s}) is read by the {consumed} of stage {t}: the pipeline "
            "runtime cannot move it (a weight tied across stages, or a global gradient-norm clip across "
            "stages). Use pipeline=False, or keep the tied parts in one stage."
        )


def partition(graph: OpGraph, stage_of: dict[str, int], num_stages: int) -> tuple[list[StageProgram], list[Crossing]]:
    """Per-stage programs and the crossings, from each node's stage."""
    order = [n.name for n in graph.gm.graph.nodes if n.op == "call_function"]
    inputs_of = {s.node for s in graph.inputs}
    constants = {n.name for n in graph.gm.graph.nodes if n.op == "get_attr"}
    crossings: dict[tuple[str, int], Crossing] = {}
    sources: list[set[str]] = [set() for _ in range(num_stages)]
    lists = [{"forward": [], "backward": [], "update": []} for _ in range(num_stages)]
    for name in order:
        t, consumed = stage_of[name], graph.nodes[name].phase
        lists[t][consumed].append(name)
        for u in graph.nodes[name].inputs:
            if u in constants:  # a get_attr constant: every stage makes its own (pipeline.PipelineRunner)
                continue
            if u in inputs_of:
                sources[t].add(u)
                continue
            s, produced = stage_of[u], _phase(graph, u)
            if s == t:
                continue
            _check_crossing(graph, u, s, t, produced, consumed)
            key = (u, t)
            if key not in crossings or PHASE_ORDER[consumed] < PHASE_ORDER[crossings[key].consumed]:
                crossings[key] = Crossing(u, s, t, produced, consumed)
    _check_params_local(graph, stage_of, sources)
    programs = [
        StageProgram(k, tuple(lists[k]["forward"]), tuple(lists[k]["backward"]), tuple(lists[k]["update"]),
                     tuple(sorted(sources[k])))
        for k in range(num_stages)
    ]
    return programs, sorted(crossings.values(), key=lambda c: (order.index(c.value), c.dst))


def phase_lists(graph: OpGraph, program: StageProgram, crossings: Sequence[Crossing], split: bool
                ) -> dict[str, tuple[str, ...]]:
    """The operators of each phase the runtime runs on stage ``program.stage``: 'forward', 'backward'
    and 'update'; where the schedule splits the backward (``split``), 'backward' is its first part
    and 'weight' its second (``split_backward``)."""
    out = {"forward": program.forward, "backward": program.backward, "update": program.update}
    if split:
        sent = [c.value for c in crossings if c.src == program.stage and c.produced == "backward"]
        out["backward"], out["weight"] = split_backward(graph, program.backward, sent)
    return out


def split_backward(graph: OpGraph, backward: Sequence[str], sent: Iterable[str]) -> tuple[tuple[str, ...],
                                                                                      tuple[str, ...]]:
    """A stage's backward as the two parts a zero-bubble schedule runs apart (``core/schedule.py``,
    ``BACKWARD`` then ``WEIGHT``): the operators ``sent`` (the values the backward sends to earlier
    stages: its inputs' gradients) need, then every other one (the weight gradients), each in
    ``backward``'s order. The second part reads what it needs of the first's values."""
    inside, need, first = set(backward), set(sent), set()
    for name in reversed(backward):
        if name in need:
            first.add(name)
            need.update(u for u in graph.nodes[name].inputs if u in inside)
    return tuple(n for n in backward if n in first), tuple(n for n in backward if n not in first)


def _check_params_local(graph, stage_of: dict[str, int], sources: list[set[str]]) -> None:
    """Parameters, optimizer state and updated buffers live on exactly one stage.

    A buffer the step never changes (a causal mask) may be read by several: each keeps a copy."""
    changed = {(o.kind, o.name) for o in graph.outputs if o.node != _input_node(graph, o.kind, o.name)}
    for spec in graph.inputs:
        if spec.kind not in ("param", "buffer", "opt_state"):
            continue
        if spec.kind == "buffer" and (spec.kind, spec.name) not in changed:
            continue
        users = [k for k, src in enumerate(sources) if spec.node in src]
        if len(users) > 1:
            raise PlanError(
                f"{spec.kind} {spec.name!r} is used by stages {users}; a weight shared by several stages "
                "(tied embeddings) is not supported by the pipeline runtime yet. Untie it, keep its users "
                "in one stage, or use pipeline=False."
            )


def _input_node(graph, kind: str, name: str) -> str | None:
    return next((s.node for s in graph.inputs if s.kind == kind and s.name == name), None)


def stage_of_nodes(graph: OpGraph, layer_of: dict[str, int], layer_ranges: list[tuple[int, int]]) -> dict[str, int]:
    """Stage of every node from its layer and the stages' inclusive layer ranges."""
    stage_of_layer = {}
    for k, (lo, hi) in enumerate(layer_ranges):
        for layer in range(lo, hi + 1):
            stage_of_layer[layer] = k
    stage_of = {name: stage_of_layer[layer] for name, layer in layer_of.items()}
    users = _users(graph)
    _pull_gradients_to_params(graph, stage_of, users)
    _updates_on_param_stage(graph, stage_of)
    _layouts_with_readers(graph, stage_of, users)
    return stage_of


def _users(graph) -> dict[str, list[str]]:
    """Node -> the nodes reading it (once per input slot)."""
    users: dict[str, list[str]] = {}
    for name, node in graph.nodes.items():
        for u in node.inputs:
            users.setdefault(u, []).append(name)
    return users


def _layouts_with_readers(graph, stage_of: dict[str, int], users: dict[str, list[str]]) -> None:
    """Run each layout operator (``LAYOUT_OPS``: a view, reshape or transpose) on its readers' stage.

    Layering puts a layout operator with the value it re-indexes, but its readers may all sit
    on the next stage: a linear layer's output gradient, made ``[B*T, C]`` and transposed for
    its weight gradient on the stage before, crossed three times (the gradient, its view and
    the view's transpose: three transfers of the same bytes per microbatch on every GPT stage
    boundary). Run with its readers, only the value it re-indexes crosses, once, as the stage
    DP prices a cut (``LayerAssignment.boundary_bytes``, the same bytes both ways). A move
    keeps the crossing's direction (forward to later stages, backward to earlier ones);
    reverse graph order moves a chain of them (``view`` then ``t``) whole."""
    outputs = {o.node for o in graph.outputs}
    for name in reversed(list(graph.nodes)):
        node = graph.nodes[name]
        if (node.target not in LAYOUT_OPS or node.phase not in ("forward", "backward") or len(node.inputs) != 1
                or name in outputs):
            continue
        src = graph.nodes.get(node.inputs[0])
        stages = {stage_of[r] for r in users.get(name, ())}
        if src is None or src.phase != node.phase or len(stages) != 1:
            continue
        s, t = stage_of[name], next(iter(stages))
        if stage_of[src.name] == s and (t > s if node.phase == "forward" else t < s):
            stage_of[name] = t


def _lift(graph, stage_of: dict[str, int], name: str, target: int) -> None:
    """Move backward node ``name`` and its earlier-stage backward inputs to stage ``target``.

    Valid because a lifted node's consumers are on stages <= target, so the data
    it sends still flows from later to earlier stages."""
    stack = [name]
    while stack:
        n = stack.pop()
        node = graph.nodes.get(n)
        if node is None or node.phase != "backward" or stage_of[n] >= target:
            continue
        stage_of[n] = target
        stack.extend(node.inputs)


def _updates_on_param_stage(graph, stage_of: dict[str, int]) -> None:
    """Every update operator runs on the stage of the state it produces.

    Walks back from each new parameter / optimizer state / buffer output through
    update operators; an operator feeding state of several stages (a global
    clip) takes the smallest, and ``partition`` then reports the crossing."""
    stored = {(s.kind, s.name): s.node for s in graph.inputs}
    wanted: dict[str, int] = {}
    for out in graph.outputs:
        home = stored.get((out.kind, out.name))
        if out.kind == "loss" or home is None:
            continue
        if out.kind == "opt_state":  # a parameter's state lives with it; the loss scaler's is its own
            home = stored.get(("param", out.name.rsplit(".", 1)[0]), home)
        stack = [out.node]
        while stack:
            name = stack.pop()
            node = graph.nodes.get(name)
            if node is None or node.phase != "update":
                continue
            if wanted.get(name, 1 << 30) > stage_of[home]:
                wanted[name] = stage_of[home]
                stack.extend(node.inputs)
    stage_of.update(wanted)


def _pull_gradients_to_params(graph, stage_of: dict[str, int], users: dict[str, list[str]]) -> None:
    """Compute each gradient on its parameter's stage.

    A bias gradient reads only the incoming gradient, so layering may put it on
    the later stage; the update, on the parameter's stage, would then read it
    across stages. Moving the gradient marker, and the backward chain that
    feeds only it, down to the parameter's stage keeps backward data flowing
    from later to earlier stages and leaves the update local."""
    placeholder = {s.name: s.node for s in graph.inputs if s.kind == "param"}
    for param, marker in graph.grad_of.items():
        target = stage_of[placeholder[param]]
        if stage_of[marker] < target:
            _lift(graph, stage_of, marker, target)
            continue
        node = marker
        while node in graph.nodes and graph.nodes[node].phase == "backward" and stage_of[node] > target:
            stage_of[node] = target
            inputs = [u for u in graph.nodes[node].inputs if u in graph.nodes]
            if len(inputs) != 1 or len(users.get(inputs[0], [])) != 1:
                break
            node = inputs[0]
