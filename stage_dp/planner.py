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
from alpa_torch.core.errors import PlanError
from alpa_torch.core.graph import OpGraph
from alpa_torch.core.options import PlanOptions
from alpa_torch.core.plan import ParallelPlan

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
