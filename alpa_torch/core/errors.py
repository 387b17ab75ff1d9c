"""Exceptions raised to users of alpa-torch.

Every error says what was wrong (with the offending value) and what to do.
Internal invariants use ``assert``; anything a user can cause raises one of these.
"""

from __future__ import annotations

from dataclasses import dataclass


class AlpaTorchError(Exception):
    """Base class of every error alpa-torch raises on purpose."""


class ClusterSpecError(AlpaTorchError, ValueError):
    """A cluster or device description is invalid (zero devices, bad bandwidth, ...)."""


class CaptureError(AlpaTorchError):
    """The training step could not be captured as one static graph."""


class DataDependentControlFlowError(CaptureError):
    """The step branches on tensor values, so no single static graph describes it."""


class LossError(CaptureError):
    """The step does not return one scalar loss tensor."""


class UnsupportedOperatorError(CaptureError):
    """An operator cannot be traced or executed."""


class InfeasibleMemoryError(AlpaTorchError):
    """No plan fits in device memory; ``required_bytes`` is the smallest need found."""

    def __init__(self, message: str, required_bytes: float | None = None):
        super().__init__(message)
        self.required_bytes = required_bytes


class PlanError(AlpaTorchError, ValueError):
    """A plan (forced, loaded or found) is invalid for this model or cluster."""


class BatchSplitError(AlpaTorchError, ValueError):
    """The batch does not split into the requested microbatches or shards."""


class IndexRangeError(AlpaTorchError, IndexError):
    """A batch tensor holds an index (token id, class label) outside what the operator reading it accepts."""

    def __init__(self, message: str, *, name: str, value: int, position: tuple[int, ...], valid: tuple[int, int]):
        super().__init__(message)
        self.name, self.value, self.position, self.valid = name, value, position, valid


class StepUsageError(AlpaTorchError, RuntimeError):
    """The parallel step was called in a way its live state cannot follow (another model or
    optimizer object than the one it trains, a call after ``shutdown()``)."""


class PlannerError(AlpaTorchError, RuntimeError):
    """The planner itself failed (a bug, not the user's input): the message names what it was
    planning, ``traceback_text`` holds the traceback of the process it failed in."""

    def __init__(self, message: str, traceback_text: str = ""):
        super().__init__(message)
        self.traceback_text = traceback_text


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """What happened to one device's worker."""

    rank: int
    host: int
    """Host index (host-major numbering: ``rank // devices_per_host``)."""
    pid: int | None
    hostname: str | None
    died: bool
    """The process died (killed, out of memory), as opposed to raising or not answering."""
    error: str
    """The worker's exception (with its traceback) or what the group saw."""


class WorkerError(AlpaTorchError, RuntimeError):
    """A worker failed or died while running a step; ``failures`` say which and how, ``stages``
    the pipeline stages they belong to (when the engine knows them)."""

    def __init__(self, message: str, *, failures: tuple[WorkerFailure, ...] = (), stages: tuple[int, ...] = ()):
        super().__init__(message)
        self.failures = tuple(failures)
        self.stages = tuple(stages)

    @property
    def failed_ranks(self) -> list[int]:
        """The ranks that died, if any did (they are the cause), else every rank that failed."""
        died = [f.rank for f in self.failures if f.died]
        return sorted(died or {f.rank for f in self.failures})


class CheckpointError(AlpaTorchError, ValueError):
    """A checkpoint cannot be written or read (missing, damaged, not this format, not this model)."""


class MissingExtraError(AlpaTorchError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def require_extra(module: str, extra: str, purpose: str) -> None:
    """Raise ``MissingExtraError`` unless ``module`` can be imported: ``purpose`` needs it, and
    ``pip install "alpa-torch[extra]"`` installs it."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"{purpose} needs the {module} package, which is not installed. "
                                f'Fix: pip install "alpa-torch[{extra}]" (or pip install {module})')


class StateOnWorkersError(AlpaTorchError, RuntimeError):
    """A read of the model or optimizer after a parallel step would need state that cannot or should
    not come to this process (``alpa_torch.live``): the message says what to use instead."""
