"""Peak memory per device of a planned stage, simulated the way the runtime allocates it.

The stage DP's memory rule (``tables.max_n_succ``) is fast and coarse: parameters,
optimizer state and gradients plus the forward values the backward reads, times the
microbatches in flight. The runtime holds more at its peak (the optimizer update of a
functional optimizer makes the new state while the old one is still held; the loss and
its gradient at full vocabulary width are transient; redistributed inputs are copies), and
less elsewhere. This module replays what the runtime does, value by value, on sizes alone:

- **programs** (``runtime/program.py``): each phase runs its operators in graph order and
  frees every value after its last reader, unless it must outlive the program (``keep``:
  forward values the backward reads, values sent to other stages, the step's outputs); a
  value the program never reads stays as long as its environment. A view (``is_view``) and
  a gradient marker share their input's storage; a ``getitem`` is an element of its
  producer's output, made when the producer runs. An input the plan wants in another spec
  (``StageSharding.input_specs``) is redistributed into a copy that lives during the
  operator (the operator's output, for a view of it);
- **sizes**: each value's local shard under the stage's ``value_specs`` on its mesh
  (``cost_model.bytes_per_device``: a partial sum is full size); values computed from the
  batch are scaled to one microbatch (1/B), except backward values shaped like a
  parameter (a weight gradient is parameter-sized whatever the batch);
- **one stage, one microbatch** (``runtime/engine.py``): the whole step is one program;
  gradients are freed after their last reader in the update;
- **a pipeline stage** (``runtime/pipeline.py``): forward and backward programs per
  microbatch in the schedule's order (``alpa_torch/core/schedule.py``), each
  forward's kept values parked until its backward (a split backward's first part parks what
  its second part reads until that runs), values received from other stages
  made at the start of the phase reading them; gradients are summed over microbatches
  into an accumulator (summing allocates the new sum while the old one exists) that
  lives until the end of the step, and divided by B before the update (a copy, except
  for partial gradients reduced in place in buckets);
- **state**: parameters, optimizer state and buffers of the stage are held all step; the
  update's outputs (the new state) live until the step ends, so the old and the new
  state coexist at the end of the update.

Not modelled: the runtime's fixed memory (interpreter, DTensor and process-group
caches, code loaded by the first step), operator workspaces, allocator slack (freed
heap pages kept by glibc), gradient-bucket concatenation copies, and activation
checkpointing (``build_plan`` keeps the rule-based figure for recomputing stages).

``simulate_stage`` does one stage; ``plan_memory`` every stage of a planned pipeline.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch

from alpa_torch.core.grad_op import GRAD_MARKER_NAME
from alpa_torch.core.partition import partition, phase_lists, stage_of_nodes
from alpa_torch.core.schedule import DEFAULT_SCHEDULE, schedule_named
from alpa_torch.core.spec import ShardingSpec
from intra_ilp import cost_model as cm

_INF = math.inf


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """The simulated peak of one device of a stage (bytes)."""

    peak_bytes: float
    """Most bytes live at once on one device of the stage."""
    phase: str
    """'forward', 'backward' or 'update': where the peak is."""
    node: str
    """The operator running at the peak."""
    microbatch: int | None
    """The microbatch at the peak (None in the update)."""
    state_bytes: float
    """Parameters, optimizer state and buffers, held all step."""
    parked_bytes: float
    """Forward values one microbatch keeps for its backward (the largest)."""
    grad_bytes: float
    """Gradients once accumulated over the microbatches."""
    phase_peaks: dict = field(default_factory=dict)
    """Peak bytes per phase."""


class _Sizes:
    """Per-device bytes of the values of one stage, at the microbatch size."""

    def __init__(self, graph, sharding, num_microbatches: int):
        self.graph = graph
        self.mesh_shape = tuple(sharding.mesh_shape)
        self.value_specs = sharding.value_specs
        self.input_specs = sharding.input_specs
        self.fx = {n.name: n for n in graph.gm.graph.nodes}
        self.scaled = batch_scaled_values(graph) if num_microbatches > 1 else set()
        self.inv_b = 1.0 / num_microbatches
        self._cache: dict[tuple, float] = {}

    def spec(self, name: str) -> ShardingSpec:
        spec = self.value_specs.get(name)
        if isinstance(spec, str):
            spec = ShardingSpec.parse(spec)
        return spec or ShardingSpec.replicated(len(self.mesh_shape))

    def bytes(self, name: str, spec: ShardingSpec | None = None) -> float:
        """Bytes of ``name`` (its tensor, or 0) on one device in ``spec`` (default: its value spec)."""
        node = self.fx.get(name)
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor):
            return 0.0
        spec = spec or self.spec(name)
        key = (spec, tuple(val.shape), val.element_size())
        nbytes = self._cache.get(key)
        if nbytes is None:
            try:
                nbytes = float(cm.bytes_per_device(spec, key[1], key[2], self.mesh_shape))
            except (ValueError, AssertionError):  # a spec that does not fit: count the whole tensor
                nbytes = float(math.prod(key[1]) * key[2])
            self._cache[key] = nbytes
        return nbytes * self.inv_b if name in self.scaled else nbytes

    def tensor_inputs(self, name: str) -> list[str]:
        node = self.fx[name]
        return [a.name for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]

    def placed(self, name: str) -> list[tuple[str, ShardingSpec]]:
        """(input, spec) of each input the operator ``name`` redistributes before it runs."""
        wants = self.input_specs.get(name)
        if not wants:
            return []
        out = []
        for a, want in zip(self.tensor_inputs(name), wants):
            if isinstance(want, str):
                want = ShardingSpec.parse(want)
            have = self.spec(a)
            if want == have:
                continue
            if any(w.is_partial and not h.is_partial for w, h in zip(want.placements, have.placements)):
                continue  # making a partial sum is DTensor-internal: the runtime passes the value as is
            out.append((a, want))
        return out


def batch_scaled_values(graph) -> set[str]:
    """Values whose size shrinks with the microbatch: the batch inputs and the forward and
    backward values computed from them, except backward values shaped like a parameter (or
    its transpose): a weight gradient (``mm(grad_out.T, x)``, a bias gradient's sum) is
    parameter-sized whatever the batch. Gradient markers and the update are parameter-sized."""
    batch = {s.node for s in graph.inputs if s.kind == "batch"}
    param_shapes = set()
    for s in graph.inputs:
        if s.kind == "param":
            param_shapes |= {tuple(s.shape), tuple(reversed(s.shape))}
    fx_nodes = {n.name: n for n in graph.gm.graph.nodes}
    dep = set(batch)
    for name, facts in graph.nodes.items():  # topological order
        if facts.phase == "update" or facts.target == GRAD_MARKER_NAME:
            continue
        if not any(a in dep for a in facts.inputs):
            continue
        val = fx_nodes[name].meta.get("val") if name in fx_nodes else None
        if facts.phase == "backward" and isinstance(val, torch.Tensor) and tuple(val.shape) in param_shapes:
            continue  # a parameter's gradient (or a step towards it)
        dep.add(name)
    return dep


class _Stage:
    """The storage model of one stage: which value owns which storage, and when it is made."""

    def __init__(self, graph, sharding, num_microbatches: int):
        self.graph = graph
        self.sizes = _Sizes(graph, sharding, num_microbatches)
        self.root: dict[str, str] = {}
        """value -> the value owning its storage (itself, or what a view / marker aliases)."""
        self.element_of: dict[str, str] = {}
        """getitem -> its producer (the element is made when the producer runs)."""
        for name, facts in graph.nodes.items():
            node = self.sizes.fx[name]
            if node.target is operator.getitem:
                self.element_of[name] = node.args[0].name
                self.root[name] = name
            elif facts.target == GRAD_MARKER_NAME or (facts.is_view and node.all_input_nodes):
                src = node.all_input_nodes[0].name
                placed = facts.target != GRAD_MARKER_NAME and any(a == src for a, _ in self.sizes.placed(name))
                self.root[name] = name if placed else self.root.get(src, src)
            else:
                self.root[name] = name

    def root_of(self, name: str) -> str:
        return self.root.get(name, name)

    def program(self, steps: list[str], keep: set[str], present: dict[str, float], base: float, *,
                accumulate: dict[str, float] | None = None, external: frozenset = frozenset(),
                by_phase: dict[str, float] | None = None):
        """Simulate one program (``runtime/program.py`` liveness) and return
        ``(peak, node at the peak, live roots at the end {root: bytes})``.

        ``present``: values in the environment at the start, with their bytes (roots);
        ``external``: values held elsewhere all step (state), never counted here; ``base``:
        bytes held outside this program (state, parked microbatches); ``by_phase``: filled
        with the peak of the steps of each phase;
        ``accumulate``: the gradient accumulator {marker: bytes} of a pipeline, updated in
        place (markers hand their value over; later microbatches add into it)."""
        sizes = self.sizes
        index = {name: i for i, name in enumerate(steps)}
        last: dict[str, float] = {}
        for i, name in enumerate(steps):
            last.setdefault(name, i)
            for a in self.graph.nodes[name].inputs:
                last[a] = i
        for name in keep:
            if name in last or name in present:
                last[name] = _INF
        for name in present:
            last.setdefault(name, _INF)  # never read here: stays in the environment
        root_end: dict[str, float] = {}
        for name, end in last.items():
            if name in external:
                continue
            r = self.root_of(name)
            if r in external:
                continue
            root_end[r] = max(root_end.get(r, -1), end)
        made: dict[int, list[tuple[str, float]]] = {}
        for i, name in enumerate(steps):
            if self.root_of(name) != name or name in external:
                continue
            at = index.get(self.element_of.get(name), i)
            made.setdefault(at, []).append((name, sizes.bytes(name)))
        live = {r: b for r, b in present.items() if r not in external}
        total = math.fsum(live.values())
        acc = accumulate if accumulate is not None else {}
        acc_total = math.fsum(acc.values())
        peak, at_peak = base + total + acc_total, steps[0] if steps else ""
        frees: dict[float, list[str]] = {}
        for r, end in root_end.items():
            frees.setdefault(end, []).append(r)
        for i, name in enumerate(steps):
            for r, b in made.get(i, ()):
                if r not in live:
                    live[r] = b
                    total += b
            facts = self.graph.nodes[name]
            transient = 0.0
            if not facts.is_view and facts.target != GRAD_MARKER_NAME:  # a view owns its placed input
                transient = math.fsum(sizes.bytes(a, spec) for a, spec in sizes.placed(name))
            if accumulate is not None and facts.target == GRAD_MARKER_NAME:
                g = sizes.bytes(name)
                if name in acc:
                    transient += g  # the new sum exists while the old one does
                else:
                    acc[name] = g
                    acc_total += g
                    r = self.root_of(name)
                    if r in live and root_end.get(r, -1) <= i:
                        total -= live.pop(r)  # handed to the accumulator (counted there)
            now = base + total + acc_total + transient
            if by_phase is not None and now > by_phase.get(facts.phase, -1.0):
                by_phase[facts.phase] = now
            if now > peak:
                peak, at_peak = now, name
            for r in frees.get(i, ()):
                if r in live:
                    total -= live.pop(r)
        return peak, at_peak, live


def simulate_stage(graph, sharding, *, forward=None, backward=None, update=None, weight=None,
                   num_microbatches: int = 1, order=None, received: dict | None = None, sent: dict | None = None,
                   engine: bool | None = None) -> MemoryEstimate:
    """The simulated peak per device of one stage (module docstring).

    ``forward`` / ``backward`` / ``update``: the stage's operators per phase in graph order
    (``alpa_torch.core.partition``; default: every node of ``graph`` by its phase); ``weight``: a
    split backward's second part (``partition.phase_lists``), run by the order's 'W's. ``order``:
    the stage's compute order [('F' | 'B' | 'W', microbatch)] (default: one forward, one backward).
    ``received`` / ``sent``: {'forward' | 'backward': values received before / sent after
    that phase}. ``engine``: run as one program (``runtime/engine.py``; default when there
    is one microbatch and nothing crosses stages)."""
    phases = {"forward": forward, "backward": backward, "update": update}
    if any(v is None for v in phases.values()):
        for ph in phases:
            if phases[ph] is None:
                phases[ph] = [n for n, f in graph.nodes.items() if f.phase == ph]
    received, sent = received or {}, sent or {}
    st = _Stage(graph, sharding, num_microbatches)
    sizes = st.sizes
    reads = set()
    for ph in phases.values():
        for n in ph:
            reads.update(graph.nodes[n].inputs)
    state_kinds = ("param", "opt_state", "buffer")
    state = frozenset(s.node for s in graph.inputs if s.kind in state_kinds and s.node in reads)
    constants = frozenset(n.name for n in graph.gm.graph.nodes if n.op == "get_attr")
    external = state | constants
    state_bytes = math.fsum(sizes.bytes(n) for n in state)
    batch = [s.node for s in graph.inputs if s.kind in ("batch", "host_scalar") and s.node in reads]
    outputs = {s.node for s in graph.outputs}
    if engine is None:
        engine = num_microbatches == 1 and not any(received.values()) and not any(sent.values())
    if engine:
        steps = [n for ph in ("forward", "backward", "update") for n in phases[ph]]
        present = {n: sizes.bytes(n) for n in batch}
        by_phase: dict[str, float] = {}
        peak, node, _ = st.program(steps, outputs, present, state_bytes, external=external, by_phase=by_phase)
        return MemoryEstimate(peak_bytes=peak, phase=graph.nodes[node].phase if node in graph.nodes else "forward",
                              node=node, microbatch=0, state_bytes=state_bytes, parked_bytes=0.0, grad_bytes=0.0,
                              phase_peaks=by_phase)
    fwd, bwd, upd, wgt = phases["forward"], phases["backward"], phases["update"], list(weight or ())
    wgt_reads = {a for n in wgt for a in graph.nodes[n].inputs} - set(wgt)
    bwd_reads = ({a for n in bwd for a in graph.nodes[n].inputs} | wgt_reads) - set(bwd) - set(wgt)
    loss = {s.node for s in graph.outputs if s.kind == "loss"}
    keep_f = (bwd_reads | set(sent.get("forward", ())) | loss | outputs)
    keep_b = set(sent.get("backward", ())) | outputs | wgt_reads
    order = [(getattr(kind, "value", kind), mb) for kind, mb in order or [("F", 0), ("B", 0)]]
    split = any(kind == "W" for kind, _ in order)
    parked: dict[int, tuple[tuple, dict[str, float], float]] = {}  # mb -> (its forward's key, roots, bytes)
    acc: dict[str, float] = {}
    best = (-1.0, "", None, "forward")
    phase_peaks = {"forward": 0.0, "backward": 0.0, "update": 0.0}
    biggest_park = 0.0
    # Every microbatch's forward (backward) program is the same; what differs is the bytes held
    # outside it (a constant added to every point) and which gradients the accumulator holds
    # already. So each program is simulated once per accumulator content (and, for a backward,
    # per forward that parked its values) with nothing held outside, and replayed: a few of GPT-3
    # 39B's 1024 programs at 256 microbatches on two stages (the plan's simulation 12-15 s -> 0.4-0.8 s).
    memo: dict[tuple, tuple[float, str, dict[str, float], dict[str, float]]] = {}
    parked_roots = {st.root_of(v) for v in bwd_reads}
    wgt_roots = {st.root_of(v) for v in wgt_reads}
    for kind, mb in order:
        others = math.fsum(p[2] for k, p in parked.items() if k != mb)
        forward = kind == "F"
        key = ("F" if forward else (kind, parked[mb][0] if mb in parked else None), frozenset(acc))
        if key not in memo:
            had = set(acc)
            if forward:
                present = {n: sizes.bytes(n) for n in batch}
                present.update({v: sizes.bytes(v) for v in received.get("forward", ())})
                peak, node, live = st.program(fwd, keep_f, present, 0.0, accumulate=acc, external=external)
            else:
                present = dict(parked[mb][1]) if mb in parked else {}
                if kind == "B":
                    present.update({v: sizes.bytes(v) for v in received.get("backward", ())})
                    peak, node, live = st.program(bwd, keep_b, present, 0.0, accumulate=acc, external=external)
                else:
                    peak, node, live = st.program(wgt, outputs, present, 0.0, accumulate=acc, external=external)
            memo[key] = (peak, node, live, {m: g for m, g in acc.items() if m not in had})
        else:
            acc.update(memo[key][3])
        peak, node, live, _ = memo[key]
        peak += state_bytes + others
        # parked until the backward reads them, or a split backward's weight part
        parks = parked_roots if forward else wgt_roots if split and kind == "B" else None
        if parks is not None:
            kept = {r: b for r, b in live.items() if r in parks}
            parked[mb] = (key, kept, math.fsum(kept.values()))
            biggest_park = max(biggest_park, parked[mb][2])
        else:
            parked.pop(mb, None)
        phase = "forward" if forward else "backward"
        phase_peaks[phase] = max(phase_peaks[phase], peak)
        if peak > best[0]:
            best = (peak, node, mb, phase)
    grad_bytes = math.fsum(acc.values())
    # Update: the accumulated gradients (divided by B into copies unless reduced in place) are held
    # until the step ends; the new state (outputs) too.
    copies = 0.0
    if num_microbatches > 1:
        copies = math.fsum(b for m, b in acc.items() if not sizes.spec(m).has_partial)
    held = state_bytes + grad_bytes
    peak_u, node_u, _ = st.program(upd, outputs, {}, held, external=external | frozenset(acc))
    peak_u = max(peak_u, held + copies)
    phase_peaks["update"] = peak_u
    if peak_u > best[0]:
        best = (peak_u, node_u, None, "update")
    return MemoryEstimate(peak_bytes=best[0], phase=best[3], node=best[1], microbatch=best[2],
                          state_bytes=state_bytes, parked_bytes=biggest_park, grad_bytes=grad_bytes,
                          phase_peaks=phase_peaks)


def plan_memory(graph, layer_of: dict[str, int], stage_ranges, shardings, *, num_microbatches: int,
                schedule: str = DEFAULT_SCHEDULE) -> list[MemoryEstimate]:
    """``simulate_stage`` for every stage of a plan: layers ``stage_ranges[k]`` (inclusive) on
    ``shardings[k]``, partitioned as the runtime does (``alpa_torch.core.partition``), each stage in
    its schedule's compute order."""
    ranges = [tuple(r) for r in stage_ranges]
    k_total, b = len(ranges), num_microbatches
    stage_of = stage_of_nodes(graph, layer_of, ranges)
    programs, crossings = partition(graph, stage_of, k_total)
    engine = k_total == 1 and b == 1
    pipeline_schedule = schedule_named(schedule)
    orders = pipeline_schedule.compute_order(k_total, b)
    split = pipeline_schedule.splits_backward(k_total, b)
    out = []
    for k, prog in enumerate(programs):
        order, lists = orders[k], phase_lists(graph, prog, crossings, split)
        received = {ph: [c.value for c in crossings if c.dst == k and c.consumed == ph]
                    for ph in ("forward", "backward")}
        sent = {ph: [c.value for c in crossings if c.src == k and c.produced == ph] for ph in ("forward", "backward")}
        out.append(simulate_stage(graph, shardings[k], forward=list(lists["forward"]),
                                  backward=list(lists["backward"]), update=list(lists["update"]),
                                  weight=list(lists.get("weight", ())), num_microbatches=b, order=order,
                                  received=received, sent=sent, engine=engine))
    return out


def with_simulated_memory(graph, layer_of: dict[str, int], stages, *, num_microbatches: int,
                          schedule: str = DEFAULT_SCHEDULE) -> tuple:
    """``StagePlan``s with ``memory_bytes`` = the simulated peak (``plan_memory``) of the
    programs the runtime runs: with activation checkpointing, those of the rewritten graph
    (``alpa_torch.core.remat``: copies sharded as their originals). Every stage keeps the stage
    DP's figure if the simulation cannot partition the plan (then a warning says why)."""
    import dataclasses
    import logging

    from alpa_torch.core.remat import extend_layer_of, extend_sharding, rematerialize

    try:
        ranges = [(s.layer_start, s.layer_end) for s in stages]
        graph, copies = rematerialize(graph, layer_of, [l for s in stages for l in s.recompute_layers], ranges)
        est = plan_memory(graph, extend_layer_of(layer_of, copies), ranges,
                          [extend_sharding(s.sharding, copies) for s in stages], num_microbatches=num_microbatches,
                          schedule=schedule)
    except Exception as exc:  # noqa: BLE001 - a figure to report, never a reason to fail planning
        logging.getLogger(__name__).warning("memory simulation failed (%s: %s): reporting the stage DP's "
                                            "memory rule instead", type(exc).__name__, exc)
        return tuple(stages)
    return tuple(dataclasses.replace(s, memory_bytes=e.peak_bytes) for s, e in zip(stages, est))
