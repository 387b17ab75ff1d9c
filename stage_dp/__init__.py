"""Inter-operator planning: operators into layers, layers into pipeline stages on submeshes, the plan.

Modules, bottom-up (``docs/architecture.md`` §3 says more of each):

- ``kernels``        the numba kernels of the layering and the stage DP, each runnable as plain Python
- ``layering``       cluster n operators into L layers (Alpa §5.2), exact DP
- ``dp``             slice L layers into pipeline stages on submeshes (Alpa eq. 2-5), exact, pruned
- ``brute_force``    exponential references the tests compare against
- ``layer_assign``   every node of a captured graph to a layer; repeated layers found
- ``fork_pool``      the ILPs of different meshes on forked processes
- ``layer_parts``    a solved layer ILP's seconds by phase, its gradient reductions priced as buckets
- ``stitching``      the resharding between the layers of a stage under their solutions
- ``checkpointing``  which layers of a stage recompute their forward (a small ILP per stage)
- ``stage_costs``    ``StageCostModel``: one ILP per distinct layer and mesh, stitched into stage costs
- ``memory_sim``     the peak memory of a planned stage, simulated as the runtime allocates
- ``coupling``       whether microbatches would change the step; how microbatch losses add up
- ``tables``         every candidate stage priced for one microbatch count: the stage DP's inputs
- ``search``         ``plan()``: the DP over microbatch counts, refitted until the simulated peak fits
- ``planner``        ``make_plan()`` and ``plan_forward()``: the step's rules applied, then the search

This file re-exports ``kernels``, ``layering``, ``dp``, ``brute_force`` and ``layer_assign``,
which need numpy and numba only: importing ``stage_dp`` loads neither torch nor the ILP.

Imports: ``alpa_torch.core``, ``intra_ilp``, torch, numpy, numba, pyomo, highspy. Never
``runtime`` or the public face (``tests/test_layers.py``): a plan is made without Ray.
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
