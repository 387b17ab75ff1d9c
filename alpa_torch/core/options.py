"""``PlanOptions``: every option of the planner, spelled once.

``parallelize(train_step, cluster, **options)``, ``stage_dp.search.plan(graph, cluster,
**options)``, the CLI's planner flags and ``explain`` all build one of these; the plan
cache keys on ``to_dict()``; ``stage_dp.planner.make_plan`` applies the rules that
depend on the step (one microbatch for batch-coupled steps and fp16). What the cluster
is, how the step is captured (``precision``) and how it runs (restarts, checkpoints) are
not plan options.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .errors import PlanError
from .schedule import DEFAULT_SCHEDULE, schedule_named

CHECKPOINTING_MODES = ("auto", "none", "full")
"""``checkpointing`` as a word (a positive number is a per-device byte budget)."""
LOGICAL_SHAPES = ("alpa", "all")
"""Which logical meshes of a submesh the planner tries: Alpa's (n x m, and the 1-D views), or every factorisation."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """What the planner may choose and what it must respect. Defaults: everything free."""

    num_microbatches: int | None = None
    """Force this many microbatches (a divisor of the batch size); None: the planner picks."""
    num_stages: int | None = None
    """Force this many pipeline stages; None: the planner picks."""
    num_layers: int | None = None
    """Cluster the operators into this many layers for the stage search; None: a default by graph size."""
    pipeline: bool = True
    """False: one stage on the whole cluster (intra-op sharding only)."""
    sharding: bool = True
    """False: no intra-op sharding beyond data parallelism (pipeline and data parallel only)."""
    memory_budget_bytes: float | None = None
    """Memory per device a plan must fit in; None: the device's memory."""
    schedule: str = DEFAULT_SCHEDULE
    """Pipeline schedule, a name of ``alpa_torch.core.schedule``'s (``schedule_names()``)."""
    checkpointing: str | float = "auto"
    """Activation checkpointing: 'auto' (recompute layers where a stage would not fit otherwise or
    where that is faster), 'none', 'full' (every layer), or bytes per device the stages must fit in."""
    submesh: tuple[int, int] | None = None
    """Force every stage onto submeshes of this shape (``(hosts, devices)``); None: the planner picks."""
    logical_shapes: str = "alpa"
    """Logical meshes tried per submesh, one of ``LOGICAL_SHAPES``."""

    def __post_init__(self) -> None:
        for name in ("num_microbatches", "num_stages", "num_layers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise PlanError(f"{name}={value!r} must be a positive int or None")
        for name in ("pipeline", "sharding"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"{name}={getattr(self, name)!r} must be True or False")
        budget = self.memory_budget_bytes
        if budget is not None and not (isinstance(budget, (int, float)) and not isinstance(budget, bool)
                                       and 0 < budget < math.inf):
            raise PlanError(f"memory_budget_bytes={budget!r} must be a positive number of bytes per device or None")
        schedule_named(self.schedule)  # raises on an unknown name
        if self.logical_shapes not in LOGICAL_SHAPES:
            raise PlanError(f"logical_shapes={self.logical_shapes!r}: use one of {LOGICAL_SHAPES}")
        checkpointing_budget(self.checkpointing)  # raises on a bad value
        if self.submesh is not None:
            if len(tuple(self.submesh)) != 2 or not all(isinstance(x, int) and x >= 1 for x in self.submesh):
                raise PlanError(f"submesh={self.submesh!r} must be (hosts, devices), two positive ints")
            object.__setattr__(self, "submesh", tuple(self.submesh))
        if not self.pipeline and self.num_stages not in (None, 1):
            raise PlanError(f"pipeline=False means one stage, but num_stages={self.num_stages}")

    def to_dict(self) -> dict[str, Any]:
        """JSON data: the plan cache's key and ``ParallelPlan.options``."""
        d = dataclasses.asdict(self)
        d["submesh"] = list(self.submesh) if self.submesh else None
        return d

    def replace(self, **changes: Any) -> PlanOptions:
        return dataclasses.replace(self, **changes)


def checkpointing_budget(option: Any) -> tuple[str, float | None]:
    """``(mode, budget_bytes)`` of a ``checkpointing`` option: a mode of ``CHECKPOINTING_MODES``, or
    'auto' with a positive finite budget given as a number; ``PlanError`` for anything else."""
    if isinstance(option, str) and option in CHECKPOINTING_MODES:
        return option, None
    if isinstance(option, (int, float)) and not isinstance(option, bool) and option > 0 and math.isfinite(option):
        return "auto", float(option)
    raise PlanError(f"checkpointing={option!r} is not understood: use 'auto', 'none', 'full' or a positive "
                    "number of bytes per device (the memory the stages must fit in)")
