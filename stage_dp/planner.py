"""The planning entry: ``make_plan(graph, cluster, options)``.

``stage_dp.search.plan`` finds the best plan for given options. Some options are not the
user's to take for a given step; this module applies those rules, once, for every caller
(``parallelize``, the CLI, ``explain``):

- a step that couples the samples of its batch (BatchNorm in training, a statistic pooled
  over the batch: ``coupling.batch_coupling``) runs one microbatch;
- fp16 mixed precision runs one stage without microbatches (the loss scale and the overflow
  check span the whole step).

A user who forces what a rule forbids gets a ``PlanError`` naming the rule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from alpa_torch.core.cluster import Cluster
from alpa_torch.core.errors import InfeasibleMemoryError, PlanError
from alpa_torch.core.graph import OpGraph
from alpa_torch.core.options import PlanOptions
from alpa_torch.core.plan import ParallelPlan
from alpa_torch.core.sharding import StageSharding

from .coupling import batch_coupling
from .layer_assign import assign_layers
from .search import plan, planned_submeshes
from .stage_costs import StageCostModel

log = logging.getLogger(__name__)

FP16_RULE = ("precision='fp16' runs on one stage without microbatches (the loss scale and the overflow check are "
             "shared by every parameter, which the pipeline runtime cannot split yet); use num_microbatches=1 and "
             "one stage, or precision='bf16'")


def effective_options(graph: OpGraph, options: PlanOptions) -> PlanOptions:
    """``options`` after the step's own rules (module docstring)."""
    reason = batch_coupling(graph)
    if reason is not None:
        if options.num_microbatches not in (None, 1):
            raise PlanError(f"num_microbatches={options.num_microbatches} would change this step's numbers: "
                            f"{reason}; use num_microbatches=1 (with BatchNorm, or GroupNorm/LayerNorm)")
        log.info("one microbatch: %s", reason)
        options = options.replace(num_microbatches=1)
    if graph.meta.get("precision") == "fp16":
        if options.num_microbatches not in (None, 1) or options.num_stages not in (None, 1):
            raise PlanError(FP16_RULE)
        options = options.replace(pipeline=False, num_stages=None, num_microbatches=1)
    return options


def check_plan(graph: OpGraph, plan: ParallelPlan) -> None:
    """A plan (forced or loaded) the step's rules allow."""
    if graph.meta.get("precision") == "fp16" and (len(plan.stages) > 1 or plan.num_microbatches > 1):
        raise PlanError(FP16_RULE)


def make_plan(graph: OpGraph, cluster: Cluster, options: PlanOptions | None = None, *,
              progress: Callable[[str], None] | None = None) -> ParallelPlan:
    """The best plan for ``graph`` on ``cluster`` under ``options`` and the step's rules."""
    return plan(graph, cluster, effective_options(graph, options or PlanOptions()), progress=progress)


def make_plan_with_model(graph: OpGraph, cluster: Cluster, options: PlanOptions | None = None, *,
                         progress: Callable[[str], None] | None = None) -> tuple[ParallelPlan, StageCostModel]:
    """``make_plan``, and the ``StageCostModel`` it priced stages with (``explain``'s runner-ups
    re-run the stage DP on it without solving ILPs again)."""
    options = effective_options(graph, options or PlanOptions())
    try:
        layers = assign_layers(graph, options.num_layers)
    except ValueError as exc:
        raise PlanError(str(exc)) from exc
    model = StageCostModel(graph, cluster, layers, sharding=options.sharding, logical_shapes=options.logical_shapes,
                           progress=progress, submeshes=planned_submeshes(cluster, options))
    return plan(graph, cluster, options, progress=progress, cost_model=model), model


def plan_forward(graph: OpGraph, cluster: Cluster, *, memory_budget_bytes: float,
                 mesh_shape: tuple[int, int] | None = None, force: dict[str, str] | None = None) -> StageSharding:
    """The sharding of a forward-only graph (``alpa_torch.capture_forward``: an evaluation) as one
    stage on every device of ``cluster``: the fastest of the whole cluster's logical meshes (one ILP
    each), or of ``mesh_shape`` alone; ``force``: value -> spec the plan keeps (the parameters where
    a training plan stores them, so the evaluation reads them in place). Activations of a forward
    without backward live one operator at a time: the memory row is the state the graph reads
    (``memory_budget_bytes``: what the device has left for it)."""
    from intra_ilp import cost_model as cm
    from intra_ilp.stage import solve_stage

    submesh = (cluster.num_hosts, cluster.devices_per_host)
    shapes = [mesh_shape] if mesh_shape is not None else list(cluster.logical_mesh_shapes(submesh))
    best, errors = None, []
    for shape in shapes:
        mesh = cm.MeshCost.from_cluster(cluster, submesh, shape, graph.meta.get("dtype", "float32"))
        try:
            sharding = solve_stage(graph, mesh, memory_budget_bytes=memory_budget_bytes, force=force)
        except InfeasibleMemoryError as exc:
            errors.append(exc)
            continue
        if best is None or sharding.total_s < best.total_s:
            best = sharding
    if best is None:
        raise InfeasibleMemoryError(
            f"the forward function does not fit on {cluster.num_devices} devices next to the training state "
            f"({memory_budget_bytes / 2**30:.2f} GiB left per device): {errors[0]}",
            min(e.required_bytes for e in errors if e.required_bytes is not None) if errors else None)
    return best
