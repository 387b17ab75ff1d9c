"""alpa-torch: Alpa-style automatic parallelization of plain PyTorch training steps.

Public API::

    from alpa_torch import Cluster, parallelize
    step = parallelize(train_step, Cluster.local(1, 4))
    loss = step(model, optimizer, batch)

The names below load lazily (PEP 562): importing ``alpa_torch.core`` (what a worker
process needs) does not import the planner or Ray. Reading order, bottom-up:
``docs/architecture.md``.

Imports: ``alpa_torch.core``, ``intra_ilp``, ``stage_dp``, ``runtime``, torch, tqdm, transformers, matplotlib.

The package is the top layer: nothing below it imports ``alpa_torch`` outside ``alpa_torch.core``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# ``capture`` is a function and a submodule: bound now, or importing the submodule (as anything
# that captures does) would leave the module where the function belongs.
from alpa_torch.capture import capture  # noqa: E402, F401

_EXPORTS = {
    "parallelize": "alpa_torch.api", "ParallelStep": "alpa_torch.api", "load_checkpoint": "alpa_torch.api",
    "load_into": "alpa_torch.api", "capture": "alpa_torch.capture",
    "empty_weights": "alpa_torch.initial_state", "init_weights": "runtime.state_sources",
    "Cluster": "alpa_torch.core.cluster", "DeviceSpec": "alpa_torch.core.cluster",
    "LinkSpec": "alpa_torch.core.cluster", "DEVICE_SPECS": "alpa_torch.core.cluster",
    "LINK_SPECS": "alpa_torch.core.cluster", "OpGraph": "alpa_torch.core.graph",
    "ParallelPlan": "alpa_torch.core.plan", "PlanOptions": "alpa_torch.core.options",
    "cluster_from_ray": "runtime.discovery", "profile_cluster": "runtime.profile",
    **{name: "alpa_torch.core.errors" for name in (
        "AlpaTorchError", "BatchSplitError", "CaptureError", "CheckpointError", "ClusterSpecError",
        "DataDependentControlFlowError", "IndexRangeError", "InfeasibleMemoryError", "LossError",
        "MissingExtraError", "PlanError", "PlannerError", "StateOnWorkersError", "StepUsageError",
        "UnsupportedOperatorError", "WorkerError")},
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'alpa_torch' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except AttributeError as exc:  # raised inside the module: `from alpa_torch import x` would hide it
        raise ImportError(f"importing {module} for alpa_torch.{name} failed: {exc}") from exc
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # for type checkers and IDEs; nothing runs
    from alpa_torch.api import ParallelStep, load_checkpoint, load_into, parallelize  # noqa: F401
    from alpa_torch.core.cluster import DEVICE_SPECS, LINK_SPECS, Cluster, DeviceSpec, LinkSpec  # noqa: F401
    from alpa_torch.core.errors import (  # noqa: F401
        AlpaTorchError,
        BatchSplitError,
        CaptureError,
        CheckpointError,
        ClusterSpecError,
        DataDependentControlFlowError,
        IndexRangeError,
        InfeasibleMemoryError,
        LossError,
        MissingExtraError,
        PlanError,
        PlannerError,
        StateOnWorkersError,
        StepUsageError,
        UnsupportedOperatorError,
        WorkerError,
    )
    from alpa_torch.core.graph import OpGraph  # noqa: F401
    from alpa_torch.core.options import PlanOptions  # noqa: F401
    from alpa_torch.core.plan import ParallelPlan  # noqa: F401
    from alpa_torch.initial_state import empty_weights  # noqa: F401
    from runtime.discovery import cluster_from_ray  # noqa: F401
    from runtime.profile import profile_cluster  # noqa: F401
    from runtime.state_sources import init_weights  # noqa: F401
