"""Inter-operator planning: operator clustering into layers and the stage DP.

- ``layering``    cluster n ops into L layers (Alpa §5.2), exact DP
- ``dp``          slice L layers into pipeline stages on submeshes (Alpa eq. 2-5)
- ``kernels``     the numba kernels of both, each runnable as plain Python
- ``brute_force`` exponential references the tests compare against

No torch, no torch.distributed, no Ray.
"""

from .brute_force import brute_force_cluster_layers, brute_force_stage_dp
from .dp import NoFeasiblePlanError, StageDPResult, solve_stage_dp
from .kernels import NO_NUMBA_ENV, numba_default
from .layering import LayerClustering, cluster_layers, cluster_layers_detailed

__all__ = [
    "LayerClustering",
    "NO_NUMBA_ENV",
    "NoFeasiblePlanError",
    "StageDPResult",
    "numba_default",
    "brute_force_cluster_layers",
    "brute_force_stage_dp",
    "cluster_layers",
    "cluster_layers_detailed",
    "solve_stage_dp",
]

# Layer assignment of a captured graph (``layer_assign``). The stage search lives in
# ``stage_dp.search`` (``plan``), not re-exported: it imports torch and intra_ilp.
from .layer_assign import LayerAssignment, assign_layers  # noqa: E402

__all__ += ["LayerAssignment", "assign_layers"]
