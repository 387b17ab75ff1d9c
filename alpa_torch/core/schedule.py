"""Pipeline schedules as data: per-stage instruction lists and a simulator.

A schedule is ``list[list[Instruction]]``: one ordered program per pipeline
stage. Workers execute their program in order; this module only says *what*
runs *when*, it never moves a tensor (``runtime`` executors do).

- ``gpipe(S, B)``: every forward in microbatch order, then every backward in
  microbatch order, then the update. Same order as
  ``torch.distributed.pipelining.ScheduleGPipe``.
- ``one_f_one_b(S, B)``: PipeDream-flush 1F1B. Stage ``k`` runs
  ``min(S - k - 1, B)`` warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards. The compute order equals
  ``torch.distributed.pipelining.Schedule1F1B`` (which counts its warm-up as
  ``min(S - k, B)`` forwards followed by "1B1F": the same sequence). Stage k
  keeps at most ``min(S - k, B)`` microbatches' activations alive (the memory
  rule the stage DP uses).

Communication sits where a real executor needs it: ``RECV_ACT`` right before
the forward that consumes it, ``SEND_ACT`` right after the forward that
produces it; ``RECV_GRAD`` right before the backward, ``SEND_GRAD`` right after.

``simulate`` runs the programs as a discrete-event simulation with buffered
(non-blocking) sends and blocking receives: it proves a schedule is
deadlock-free and gives each instruction's start and end time. With unit
costs and free communication GPipe takes ``(B + S - 1)(f + b)``, i.e. a bubble
fraction of ``(S - 1) / (B + S - 1)`` (GPipe paper, §2.2).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Kind(str, enum.Enum):
    """What one instruction does; the value is its short name in reprs."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "sendA"
    RECV_ACT = "recvA"
    SEND_GRAD = "sendG"
    RECV_GRAD = "recvG"
    UPDATE = "U"


FORWARD, BACKWARD, UPDATE = Kind.FORWARD, Kind.BACKWARD, Kind.UPDATE
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
        return self.kind in (FORWARD, BACKWARD)

    def message(self) -> tuple[str, int, int, int]:
        """Key of the message a send posts or a receive waits for: (what, src, dst, mb)."""
        what = "act" if self.kind in (SEND_ACT, RECV_ACT) else "grad"
        src, dst = (self.stage, self.peer_stage) if self.kind in _SENDS else (self.peer_stage, self.stage)
        return what, src, dst, self.microbatch


Schedule = list[list[Instruction]]


def _expand(stage: int, num_stages: int, order: Sequence[tuple[Kind, int]]) -> list[Instruction]:
    """Turn a stage's compute order [(F|B, mb)] into a program with its communication."""
    first, last = stage == 0, stage == num_stages - 1
    program: list[Instruction] = []
    for kind, mb in order:
        if kind == FORWARD:
            if not first:
                program.append(Instruction(RECV_ACT, stage, mb, stage - 1))
            program.append(Instruction(FORWARD, stage, mb))
            if not last:
                program.append(Instruction(SEND_ACT, stage, mb, stage + 1))
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


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: all forwards (mb 0..B-1), then all backwards (mb 0..B-1), then UPDATE."""
    _check_sizes(num_stages, num_microbatches)
    mbs = range(num_microbatches)
    order = [(FORWARD, mb) for mb in mbs] + [(BACKWARD, mb) for mb in mbs]
    return [_expand(k, num_stages, order) for k in range(num_stages)]


def one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[Kind, int]]:
    """Compute order of 1F1B on one stage: warm-up F, steady (F, B) pairs, cool-down B."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    steady = num_microbatches - warmup
    order = [(FORWARD, mb) for mb in range(warmup)]
    for i in range(steady):
        order += [(FORWARD, warmup + i), (BACKWARD, i)]
    order += [(BACKWARD, mb) for mb in range(steady, num_microbatches)]
    return order


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream-flush 1F1B (Narayanan et al. 2021), ending with UPDATE on every stage."""
    _check_sizes(num_stages, num_microbatches)
    return [_expand(k, num_stages, one_f_one_b_order(k, num_stages, num_microbatches)) for k in range(num_stages)]


def max_in_flight(program: Sequence[Instruction]) -> int:
    """Peak number of microbatches whose forward ran and whose backward has not."""
    live = peak = 0
    for ins in program:
        if ins.kind == FORWARD:
            live += 1
            peak = max(peak, live)
        elif ins.kind == BACKWARD:
            live -= 1
    return peak


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle share of a GPipe / 1F1B step with equal stage costs: (S - 1) / (B + S - 1)."""
    _check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def check_schedule(schedules: Schedule) -> None:
    """Raise ValueError unless every stage's program has the data dependencies an executor needs.

    Per stage and microbatch: one forward and one backward, forward first;
    the activation received before the forward, sent after it; the gradient
    received before the backward, sent after it; one UPDATE, last.
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
        """Time stage ``stage`` spent computing (forward, backward, update)."""
        compute = (FORWARD, BACKWARD, UPDATE)
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
    schedules: Schedule,
    fwd_s: float | Sequence[float] = 1.0,
    bwd_s: float | Sequence[float] = 1.0,
    comm_s: float = 0.0,
    update_s: float = 0.0,
) -> Timeline:
    """Discrete-event run of ``schedules``: sends are buffered, receives block.

    A send posts its message at its start time; it arrives ``comm_s`` later.
    A receive starts when its stage reaches it and ends when the message has
    arrived. Costs may be one number or one per stage. Raises
    ``DeadlockError`` if no stage can move, ValueError if a send is never received.
    """
    num_stages = len(schedules)
    cost = {FORWARD: _per_stage(fwd_s, num_stages, "fwd_s"), BACKWARD: _per_stage(bwd_s, num_stages, "bwd_s"),
            UPDATE: _per_stage(update_s, num_stages, "update_s")}
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


def format_schedule(schedules: Schedule) -> str:
    """One line per stage, e.g. ``stage 0: F0 sendA0:0->1 F1 ...``."""
    return "\n".join(f"stage {k}: " + " ".join(map(repr, program)) for k, program in enumerate(schedules))


def compute_order(schedule: str, num_stages: int, num_microbatches: int) -> list[list[tuple[str, int]]]:
    """Per stage, its forwards and backwards in the order the schedule runs them: ``[('F' | 'B',
    microbatch), ...]`` (what a pipeline stage executes, and what the memory simulation replays)."""
    make = {"gpipe": gpipe, "1f1b": one_f_one_b}[schedule]
    return [[("F" if i.kind == FORWARD else "B", i.microbatch) for i in program if i.kind in (FORWARD, BACKWARD)]
            for program in make(num_stages, num_microbatches)]
