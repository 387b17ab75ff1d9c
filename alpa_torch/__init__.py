"""alpa-torch: Alpa-style automatic parallelization of plain PyTorch training steps.

Public API::

    from alpa_torch import Cluster, parallelize
    step = parallelize(train_step, cluster=Cluster.local(1, 4))
    loss = step(model, optimizer, batch)

Reading order: ``cluster`` (devices and links), ``capture`` (the step as one
graph), ``intra_ilp`` (sharding per operator), ``stage_dp`` (pipeline
stages), ``runtime`` (Ray workers), ``api`` (``parallelize``).
"""

from .api import ParallelStep, load_checkpoint, load_into, parallelize
from .capture import capture
from .cluster import DEVICE_SPECS, LINK_SPECS, Cluster, DeviceSpec, LinkSpec
from .errors import (
    AlpaTorchError,
    BatchSplitError,
    CaptureError,
    CheckpointError,
    ClusterSpecError,
    DataDependentControlFlowError,
    InfeasibleMemoryError,
    LossError,
    PlanError,
    UnsupportedOperatorError,
    WorkerError,
)
from .graph import OpGraph

__all__ = [
    "AlpaTorchError", "BatchSplitError", "CaptureError", "CheckpointError", "Cluster", "ClusterSpecError",
    "DEVICE_SPECS", "DataDependentControlFlowError", "DeviceSpec", "InfeasibleMemoryError",
    "LINK_SPECS", "LinkSpec", "LossError", "OpGraph", "ParallelStep", "PlanError",
    "UnsupportedOperatorError", "WorkerError", "capture", "load_checkpoint", "load_into", "parallelize",
]
__version__ = "0.1.0"
