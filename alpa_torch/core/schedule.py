"""Pipeline schedules, one object each: instruction order, memory, step time; and a simulator.

A schedule is a ``PipelineSchedule`` subclass with a ``name``, registered by being defined
(``schedule_named``). Its one method to write is ``order``: a stage's forwards and
backwards in the order it runs them. Everything else the planner, the memory simulation,
``explain``, ``viz``, the CLI and the runtime need is derived from that order or given by
the class:

- ``programs(S, B)``: one ordered program of ``Instruction``s per stage, the order with
  its communication. Workers execute their program in order; this module only says *what*
  runs *when*, it never moves a tensor (``runtime`` executors do). ``RECV_ACT`` comes right
  before the forward that consumes it, ``SEND_ACT`` right after the forward that produces
  it; ``RECV_GRAD`` right before the backward, ``SEND_GRAD`` right after.
- ``in_flight(stages_after, B)``: the microbatches whose activations a stage holds at once
  (the stage DP's memory rule), counted from the first stage's order in a pipeline of
  ``stages_after + 1`` stages.
- ``sum_weight(B)``, ``max_weight(B)``: the step time is ``T = sum_weight(B) * sum_k t_k +
  max_weight(B) * max_k t_k`` over the stages' per-microbatch times ``t_k`` (``step_time``); the
  stage DP minimises that form.
- ``costs(stage_times)``: how a stage's per-microbatch time splits into its instructions'
  (``simulate``'s ``fwd_s``, ``bwd_s``, ``weight_s``): the forward a third, the backward the rest
  (split in two halves, except on the first stage, which sends nothing back).

A schedule may split a stage's backward into two instructions (zero-bubble schedules):
``BACKWARD`` then computes only what the stage sends to the stage before it (the gradients
of its inputs, and everything they need), and ``WEIGHT`` the rest (the weight gradients),
later. ``alpa_torch.core.partition.split_backward`` cuts the stage's backward program so.
A microbatch's forward values stay until the last of the two parts that reads them has run.

The schedules:

- ``GPipe`` (``"gpipe"``): every forward in microbatch order, then every backward in
  microbatch order, then the update. Same order as
  ``torch.distributed.pipelining.ScheduleGPipe``. All B microbatches in flight.
- ``OneFOneB`` (``"1f1b"``): PipeDream-flush 1F1B. Stage ``k`` runs ``min(S - k - 1, B)``
  warm-up forwards, then alternates one forward and one backward, then drains the
  remaining backwards. The compute order equals
  ``torch.distributed.pipelining.Schedule1F1B`` (which counts its warm-up as ``min(S - k,
  B)`` forwards followed by "1B1F": the same sequence). Stage k holds at most ``min(S - k,
  B)`` microbatches.

Both take Alpa's eq. 2, ``max_weight = B - 1``: with equal stage times ``t`` a step is
``(B + S - 1) t``, a bubble fraction of ``(S - 1) / (B + S - 1)`` (GPipe paper, §2.2).

- ``ZeroBubbleH1`` (``"zb-h1"``): ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR
  2024): 1F1B's microbatches in flight per stage, its backward split (``BACKWARD``, ``WEIGHT``),
  every ``WEIGHT`` run where a stage would otherwise wait (``_greedy_zero_bubble``). The gradients
  cross a stage in a third of a microbatch's time instead of two thirds, and the ``WEIGHT``s fill
  the drain, so with equal stage times ``t`` and ``B >= S`` a step is ``B t + (S - 1) t / 3``:
  ``sum_weight = 1/3``, ``max_weight = B - 1/3``. Every stage holds up to ``min(S, B)``
  microbatches until their ``WEIGHT``, but only 1F1B's count until their ``BACKWARD``: the stage
  DP's rule counts those (``in_flight``); the rest hold only what the ``WEIGHT`` reads, which the
  memory simulation counts.

``simulate`` runs programs as a discrete-event simulation with buffered (non-blocking)
sends and blocking receives: it proves a schedule is deadlock-free and gives each
instruction's start and end time.
"""

from __future__ import annotations

import abc
import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from .errors import PlanError


class Kind(str, enum.Enum):
    """What one instruction does; the value is its short name in reprs."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    SEND_ACT = "sendA"
    RECV_ACT = "recvA"
    SEND_GRAD = "sendG"
    RECV_GRAD = "recvG"
    UPDATE = "U"


FORWARD, BACKWARD, WEIGHT, UPDATE = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT, Kind.UPDATE
_COMPUTE = (FORWARD, BACKWARD, WEIGHT)
FORWARD_SHARE = 1.0 / 3.0
"""Share of a stage's per-microbatch time taken by its forward (``PipelineSchedule.costs``); a split
backward's two parts take the same share each."""
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD
_SENDS = (SEND_ACT, SEND_GRAD)
_RECVS = (RECV_ACT, RECV_GRAD)
# Where each communication kind's peer sits relative to its own stage.
_PEER_OFFSET = {SEND_ACT: +1, RECV_ACT: -1, SEND_GRAD: -1, RECV_GRAD: +1}


@dataclass(frozen=True, slots=True)
class Instruction:
    """One step of a stage's program.

    ``microbatch`` is None only for ``UPDATE``; ``peer_stage`` is set only for
    sends (the receiver) and receives (the sender).
    """

    kind: Kind
    stage: int
    microbatch: int | None = None
    peer_stage: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))
        if (self.kind == UPDATE) != (self.microbatch is None):
            need = "takes no" if self.kind == UPDATE else "needs a"
            raise ValueError(f"{self.kind.name} {need} microbatch, got {self.microbatch!r}")
        offset = _PEER_OFFSET.get(self.kind)
        if offset is None and self.peer_stage is not None:
            raise ValueError(f"{self.kind.name} has no peer stage, got {self.peer_stage}")
        if offset is not None and self.peer_stage != self.stage + offset:
            raise ValueError(f"{self.kind.name} on stage {self.stage} must have peer_stage "
                             f"{self.stage + offset}, got {self.peer_stage}")

    def __repr__(self) -> str:
        if self.kind == UPDATE:
            return "U"
        if self.peer_stage is None:
            return f"{self.kind.value}{self.microbatch}"
        src, dst = (self.stage, self.peer_stage) if self.kind in _SENDS else (self.peer_stage, self.stage)
        return f"{self.kind.value}{self.microbatch}:{src}->{dst}"

    __str__ = __repr__

    @property
    def is_compute(self) -> bool:
        return self.kind in _COMPUTE

    def message(self) -> tuple[str, int, int, int]:
        """Key of the message a send posts or a receive waits for: (what, src, dst, mb)."""
        what = "act" if self.kind in (SEND_ACT, RECV_ACT) else "grad"
        src, dst = (self.stage, self.peer_stage) if self.kind in _SENDS else (self.peer_stage, self.stage)
        return what, src, dst, self.microbatch


Programs = list[list[Instruction]]
"""One ordered program of instructions per stage."""


def _expand(stage: int, num_stages: int, order: Sequence[tuple[Kind, int]]) -> list[Instruction]:
    """Turn a stage's compute order [(F|B|W, mb)] into a program with its communication."""
    first, last = stage == 0, stage == num_stages - 1
    program: list[Instruction] = []
    for kind, mb in order:
        if kind == FORWARD:
            if not first:
                program.append(Instruction(RECV_ACT, stage, mb, stage - 1))
            program.append(Instruction(FORWARD, stage, mb))
            if not last:
                program.append(Instruction(SEND_ACT, stage, mb, stage + 1))
        elif kind == WEIGHT:
            program.append(Instruction(WEIGHT, stage, mb))
        else:
            if not last:
                program.append(Instruction(RECV_GRAD, stage, mb, stage + 1))
            program.append(Instruction(BACKWARD, stage, mb))
            if not first:
                program.append(Instruction(SEND_GRAD, stage, mb, stage - 1))
    program.append(Instruction(UPDATE, stage))
    return program


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need num_stages >= 1 and num_microbatches >= 1, got {num_stages} and {num_microbatches}")


def max_in_flight(order: Sequence[Instruction | tuple[Kind, int]]) -> int:
    """Peak number of microbatches whose forward ran and whose backward has not (its ``WEIGHT``,
    where the backward is split), in a program or a compute order."""
    steps = [(i.kind, i.microbatch) if isinstance(i, Instruction) else (Kind(i[0]), i[1]) for i in order]
    split = {mb for kind, mb in steps if kind == WEIGHT}
    live = peak = 0
    for kind, mb in steps:
        if kind == FORWARD:
            live += 1
            peak = max(peak, live)
        elif kind == (WEIGHT if mb in split else BACKWARD):
            live -= 1
    return peak


_REGISTRY: dict[str, PipelineSchedule] = {}


class PipelineSchedule(abc.ABC):
    """One pipeline schedule (module docstring). A subclass sets ``name`` and writes ``order``;
    defining it registers it for ``schedule_named``."""

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            _REGISTRY[cls.name] = cls()

    def __repr__(self) -> str:
        return f"<schedule {self.name}>"

    @abc.abstractmethod
    def order(self, stage: int, num_stages: int, num_microbatches: int) -> list[tuple[Kind, int]]:
        """Stage ``stage``'s forwards and backwards, ``[(FORWARD | BACKWARD | WEIGHT, microbatch)]``, in
        the order it runs them (``WEIGHT`` only where the schedule splits the backward)."""

    def programs(self, num_stages: int, num_microbatches: int) -> Programs:
        """Every stage's program: its order with the communication, ending with ``UPDATE``."""
        _check_sizes(num_stages, num_microbatches)
        return [_expand(k, num_stages, self.order(k, num_stages, num_microbatches)) for k in range(num_stages)]

    def compute_order(self, num_stages: int, num_microbatches: int) -> list[list[tuple[str, int]]]:
        """Per stage, ``[('F' | 'B' | 'W', microbatch), ...]``: what a pipeline stage executes, and what
        the memory simulation replays."""
        _check_sizes(num_stages, num_microbatches)
        return [[(kind.value, mb) for kind, mb in self.order(k, num_stages, num_microbatches)]
                for k in range(num_stages)]

    @functools.cache  # noqa: B019 - schedules are registered singletons
    def in_flight(self, stages_after: int, num_microbatches: int) -> int:
        """Microbatches a stage followed by ``stages_after`` stages holds at once (module docstring)."""
        return max_in_flight(self.order(0, stages_after + 1, num_microbatches))

    def sum_weight(self, num_microbatches: int) -> float:
        """The weight of the stages' summed times in the step time (module docstring): 1."""
        return 1.0

    def max_weight(self, num_microbatches: int) -> float:
        """The weight of the slowest stage in the step time (module docstring): Alpa's eq. 2, B - 1."""
        return float(num_microbatches - 1)

    def step_time(self, stage_times: Sequence[float], num_microbatches: int) -> float:
        """The step of stages taking ``stage_times`` per microbatch: ``sum_weight(B) * sum +
        max_weight(B) * max``."""
        b = num_microbatches
        return self.sum_weight(b) * math.fsum(stage_times) + self.max_weight(b) * max(stage_times)

    def splits_backward(self, num_stages: int, num_microbatches: int) -> bool:
        """Whether the orders hold ``WEIGHT`` instructions (module docstring)."""
        return any(kind == WEIGHT for k in range(num_stages) for kind, _ in self.order(k, num_stages, num_microbatches))

    def costs(self, stage_times: Sequence[float], num_stages: int, num_microbatches: int) -> dict[str, list[float]]:
        """``simulate``'s ``fwd_s``, ``bwd_s`` and ``weight_s`` for stages taking ``stage_times`` per
        microbatch (forward and backward): ``FORWARD_SHARE`` of it is the forward's, the rest the
        backward's, in two equal parts where the schedule splits it, except on the first stage: it
        sends nothing back, so its ``BACKWARD`` is empty and its ``WEIGHT`` is all of it."""
        fwd = [FORWARD_SHARE * t for t in stage_times]
        rest = [t - f for t, f in zip(stage_times, fwd)]
        if not self.splits_backward(num_stages, num_microbatches):
            return {"fwd_s": fwd, "bwd_s": rest, "weight_s": [0.0] * len(rest)}
        first = [0.0 if k == 0 else r / 2 for k, r in enumerate(rest)]
        return {"fwd_s": fwd, "bwd_s": first, "weight_s": [r - b for r, b in zip(rest, first)]}

    def bubble_fraction(self, num_stages: int, num_microbatches: int) -> float:
        """Idle share of a step with equal stage times: ``1 - B t / step_time``."""
        _check_sizes(num_stages, num_microbatches)
        return 1.0 - num_microbatches / self.step_time([1.0] * num_stages, num_microbatches)


class GPipe(PipelineSchedule):
    """All forwards (microbatch 0..B-1), then all backwards (0..B-1)."""

    name = "gpipe"

    def order(self, stage: int, num_stages: int, num_microbatches: int) -> list[tuple[Kind, int]]:
        mbs = range(num_microbatches)
        return [(FORWARD, mb) for mb in mbs] + [(BACKWARD, mb) for mb in mbs]


class OneFOneB(PipelineSchedule):
    """PipeDream-flush 1F1B (Narayanan et al. 2021): warm-up forwards, steady (F, B) pairs, cool-down backwards."""

    name = "1f1b"

    def order(self, stage: int, num_stages: int, num_microbatches: int) -> list[tuple[Kind, int]]:
        warmup = min(num_stages - stage - 1, num_microbatches)
        steady = num_microbatches - warmup
        order = [(FORWARD, mb) for mb in range(warmup)]
        for i in range(steady):
            order += [(FORWARD, warmup + i), (BACKWARD, i)]
        return order + [(BACKWARD, mb) for mb in range(steady, num_microbatches)]


class ZeroBubbleH1(PipelineSchedule):
    """ZB-H1 (Qi et al. 2024): 1F1B's memory, the backward split, weight gradients where stages would
    wait (module docstring)."""

    name = "zb-h1"

    def order(self, stage: int, num_stages: int, num_microbatches: int) -> list[tuple[Kind, int]]:
        return list(_greedy_zero_bubble(num_stages, num_microbatches)[stage])

    def in_flight(self, stages_after: int, num_microbatches: int) -> int:
        """1F1B's: the microbatches waiting for their ``BACKWARD`` (module docstring)."""
        return _REGISTRY[OneFOneB.name].in_flight(stages_after, num_microbatches)

    def sum_weight(self, num_microbatches: int) -> float:
        return 1.0 / 3.0

    def max_weight(self, num_microbatches: int) -> float:
        return num_microbatches - 1.0 / 3.0


@functools.cache
def _greedy_zero_bubble(num_stages: int, num_microbatches: int) -> tuple[tuple[tuple[Kind, int], ...], ...]:
    """Every stage's ZB-H1 order (``ZeroBubbleH1``): the stages run on unit forward, backward and weight
    times, stage k taking at every tick the first of: a forward whose activation has arrived, while
    fewer than ``min(S - k, B)`` microbatches wait for their backward (1F1B's) and fewer than
    ``min(S, B)`` for their weight; a backward whose gradient has arrived; its oldest pending weight.
    With ``B >= S`` the step is ``3B + S - 1`` ticks, ZB-H1's (1F1B's: ``3B + 3(S - 1)``)."""
    _check_sizes(num_stages, num_microbatches)
    s, b = num_stages, num_microbatches
    done = {kind: [0] * s for kind in _COMPUTE}  # per stage: microbatches done of each kind, in order
    ready: dict[tuple[Kind, int, int], int] = {(FORWARD, 0, mb): 0 for mb in range(b)}  # tick an input arrives
    orders: list[list[tuple[Kind, int]]] = [[] for _ in range(s)]
    tick = 0
    while any(done[WEIGHT][k] < b for k in range(s)):
        finished = []
        for k in range(s):
            f, bw, w = done[FORWARD][k], done[BACKWARD][k], done[WEIGHT][k]
            if f < b and f - bw < min(s - k, b) and f - w < min(s, b) and ready.get((FORWARD, k, f), tick + 1) <= tick:
                kind, mb = FORWARD, f
            elif bw < f and ready.get((BACKWARD, k, bw), tick + 1) <= tick:
                kind, mb = BACKWARD, bw
            elif w < bw:
                kind, mb = WEIGHT, w
            else:
                continue
            done[kind][k] += 1
            orders[k].append((kind, mb))
            finished.append((kind, k, mb))
        tick += 1
        for kind, k, mb in finished:  # what a tick computed arrives at the next
            if kind == FORWARD:
                ready[(FORWARD, k + 1, mb) if k + 1 < s else (BACKWARD, k, mb)] = tick
            elif kind == BACKWARD and k > 0:
                ready[(BACKWARD, k - 1, mb)] = tick
    return tuple(tuple(o) for o in orders)


DEFAULT_SCHEDULE = OneFOneB.name


def schedule_names() -> tuple[str, ...]:
    """The registered schedules' names."""
    return tuple(_REGISTRY)


def schedule_named(name: str) -> PipelineSchedule:
    """The registered schedule ``name``; a ``PlanError`` naming the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise PlanError(f"schedule {name!r} is unknown; use one of {schedule_names()}") from None


def check_schedule(schedules: Programs) -> None:
    """Raise ValueError unless every stage's program has the data dependencies an executor needs.

    Per stage and microbatch: one forward and one backward, forward first;
    the activation received before the forward, sent after it; the gradient
    received before the backward, sent after it; where a stage splits its backward,
    every microbatch's WEIGHT after its backward; one UPDATE, last.
    """
    num_stages = len(schedules)
    for k, program in enumerate(schedules):
        if not program or program[-1].kind != UPDATE or sum(i.kind == UPDATE for i in program) != 1:
            raise ValueError(f"stage {k}: program must end with exactly one UPDATE: {program}")
        pos = {(i.kind, i.microbatch): n for n, i in enumerate(program)}
        if len(pos) != len(program) or any(i.stage != k for i in program):
            raise ValueError(f"stage {k}: repeated instruction or instruction of another stage: {program}")
        mbs = {i.microbatch for i in program if i.kind == FORWARD}
        if mbs != {i.microbatch for i in program if i.kind == BACKWARD}:
            raise ValueError(f"stage {k}: forwards and backwards cover different microbatches")
        for mb in mbs:
            chain = ([(RECV_ACT, mb)] if k > 0 else []) + [(FORWARD, mb)]
            if k < num_stages - 1:
                chain += [(SEND_ACT, mb), (RECV_GRAD, mb)]
            chain += [(BACKWARD, mb)] + ([(SEND_GRAD, mb)] if k > 0 else [])
            where = [pos.get(step, -1) for step in chain]
            if min(where) < 0 or where != sorted(where):
                raise ValueError(f"stage {k}, microbatch {mb}: need order {chain}, got positions {where}")
        weights = {i.microbatch for i in program if i.kind == WEIGHT}
        if weights and (weights != mbs or any(pos[(WEIGHT, mb)] < pos[(BACKWARD, mb)] for mb in mbs)):
            raise ValueError(f"stage {k}: a split backward needs every microbatch's WEIGHT after its BACKWARD")


class DeadlockError(RuntimeError):
    """Every unfinished stage waits on a receive whose send never comes."""


@dataclass(frozen=True, slots=True)
class Event:
    """One instruction as it ran in a simulation: start and end in seconds."""

    instruction: Instruction
    start_s: float
    end_s: float

    def __repr__(self) -> str:
        return f"{self.instruction}[{self.start_s:g},{self.end_s:g}]"


@dataclass(frozen=True, slots=True)
class Timeline:
    """Result of ``simulate``: per-stage events in program order and the makespan."""

    events: tuple[tuple[Event, ...], ...]
    makespan_s: float

    def __repr__(self) -> str:
        return f"Timeline(stages={len(self.events)}, makespan_s={self.makespan_s:g})"

    def busy_s(self, stage: int) -> float:
        """Time stage ``stage`` spent computing (forward, backward, weight, update)."""
        compute = (*_COMPUTE, UPDATE)
        return sum(e.end_s - e.start_s for e in self.events[stage] if e.instruction.kind in compute)

    @property
    def idle_fraction(self) -> float:
        """Share of stage-time not spent computing: the simulated bubble."""
        total = len(self.events) * self.makespan_s
        return 0.0 if total == 0 else 1.0 - sum(self.busy_s(k) for k in range(len(self.events))) / total

    def event(self, kind: Kind, stage: int, microbatch: int | None = None) -> Event:
        """The event of instruction ``kind`` for ``microbatch`` on ``stage``."""
        return next(e for e in self.events[stage]
                    if e.instruction.kind == kind and e.instruction.microbatch == microbatch)


def _per_stage(value: float | Sequence[float], num_stages: int, name: str) -> list[float]:
    values = [float(value)] * num_stages if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != num_stages or any(v < 0 for v in values):
        raise ValueError(f"{name} must be a non-negative number or one per stage ({num_stages}), got {value!r}")
    return values


def simulate(
    schedules: Programs,
    fwd_s: float | Sequence[float] = 1.0,
    bwd_s: float | Sequence[float] = 1.0,
    comm_s: float = 0.0,
    update_s: float | Sequence[float] = 0.0,
    weight_s: float | Sequence[float] = 0.0,
) -> Timeline:
    """Discrete-event run of ``schedules``: sends are buffered, receives block.

    A send posts its message at its start time; it arrives ``comm_s`` later.
    A receive starts when its stage reaches it and ends when the message has
    arrived. Costs may be one number or one per stage. Raises
    ``DeadlockError`` if no stage can move, ValueError if a send is never received.
    """
    num_stages = len(schedules)
    cost = {FORWARD: _per_stage(fwd_s, num_stages, "fwd_s"), BACKWARD: _per_stage(bwd_s, num_stages, "bwd_s"),
            WEIGHT: _per_stage(weight_s, num_stages, "weight_s"), UPDATE: _per_stage(update_s, num_stages, "update_s")}
    pc, clock = [0] * num_stages, [0.0] * num_stages
    events: list[list[Event]] = [[] for _ in range(num_stages)]
    arrivals: dict[tuple[str, int, int, int], float] = {}
    progress = True
    while progress:
        progress = False
        for k, program in enumerate(schedules):
            while pc[k] < len(program):
                ins, start = program[pc[k]], clock[k]
                if ins.kind in _RECVS:
                    if ins.message() not in arrivals:
                        break  # blocked: come back after other stages moved
                    end = max(start, arrivals.pop(ins.message()))
                elif ins.kind in _SENDS:
                    if ins.message() in arrivals:
                        raise ValueError(f"stage {k}: {ins} sent twice before being received")
                    arrivals[ins.message()] = start + comm_s
                    end = start
                else:
                    end = start + cost[ins.kind][k]
                events[k].append(Event(ins, start, end))
                clock[k], pc[k], progress = end, pc[k] + 1, True
    blocked = {k: schedules[k][pc[k]] for k in range(num_stages) if pc[k] < len(schedules[k])}
    if blocked:
        raise DeadlockError(f"schedule deadlocks: stages wait on {blocked}; in flight: {sorted(arrivals)}")
    if arrivals:
        raise ValueError(f"messages sent but never received: {sorted(arrivals)}")
    return Timeline(tuple(tuple(e) for e in events), max(clock, default=0.0))


def format_schedule(schedules: Programs) -> str:
    """One line per stage, e.g. ``stage 0: F0 sendA0:0->1 F1 ...``."""
    return "\n".join(f"stage {k}: " + " ".join(map(repr, program)) for k, program in enumerate(schedules))
