"""What one worker did during a step, and when: the measured side of a pipeline trace.

Owns ``StepRecorder``: off by default, and then each ``span`` is one attribute test and
a shared no-op context. On (``Engine.record``, ``parallelize(..., trace=True)``), it keeps
one event per span of the last step: (name, category, start ns, end ns, details), on the
wall clock (``time.time_ns``), which the processes of one host share and the hosts of a
cluster keep close (NTP), so the events of every worker line up on one time axis.

Categories: 'forward', 'backward', 'weight', 'update' (a phase program of a stage, 'weight' a
split backward's second part; a one-stage plan runs its step as one program, 'step'),
'transfer' (receiving a cross-stage value, posting its sends, waiting for sends at the end of
the step), 'collective' (waiting for the gradient buckets' reductions, ``grad_buckets.py``) and,
in a one-stage step, 'reduction': a bucket's all-reduce from its start to its end as the step
saw it (when its first reader had waited for it), on a row of its own (details ``row``), where
it overlaps the backward.
Names follow the predicted trace's (``alpa_torch.viz.trace_from_timeline``): 'F3' / 'B3' / 'W3' for microbatch 3, 'U'.
Turning events into a Chrome/Perfetto trace is ``alpa_torch.viz.trace_from_events``'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

Event = tuple[str, str, int, int, dict]
"""(name, category, start ns, end ns, details such as the microbatch)."""

_OFF = contextlib.nullcontext()


class StepRecorder:
    """The events of this worker's last step (module docstring)."""

    def __init__(self) -> None:
        self.on = False
        self.events: list[Event] = []

    def begin_step(self) -> None:
        """Forget the previous step's events."""
        self.events = []

    def span(self, name: str, category: str, **details: Any) -> contextlib.AbstractContextManager:
        """A context that records its run as one event (nothing when off)."""
        return self._span(name, category, details) if self.on else _OFF

    def add(self, name: str, category: str, start_ns: int, end_ns: int, **details: Any) -> None:
        """Record an event timed by its caller (nothing when off)."""
        if self.on:
            self.events.append((name, category, start_ns, end_ns, details))

    @contextlib.contextmanager
    def _span(self, name: str, category: str, details: dict) -> Iterator[None]:
        start = time.time_ns()
        try:
            yield
        finally:
            self.events.append((name, category, start, time.time_ns(), details))
