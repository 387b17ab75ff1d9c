"""Deploying a plan on running workers: the step's graph rewritten for the layers the plan
recomputes, each operator given its stage, and the runtime's ``Engine`` built over them.

Owns ``deploy_plan`` (``ParallelStep`` calls it for the plan it keeps and for each candidate
measured plan selection tries). Does not own planning, the workers (``runtime.group``) nor
running a step (``runtime.engine``).
"""

from __future__ import annotations

from typing import Any

from alpa_torch.core.cluster import Cluster
from alpa_torch.core.graph import OpGraph
from alpa_torch.core.plan import ParallelPlan


def deploy_plan(group, plan: ParallelPlan, graph: OpGraph, cluster: Cluster, seed: int = 0,
                combine: str = "mean", compile: bool = False,
                compile_cache: str | None = None) -> tuple[Any, dict[str, str]]:
    """Deploy ``plan`` on the workers of ``group``: ``(engine, copies)``; with ``compile``, the workers
    compile their programs' runs of local kernels (``runtime/regions.py``), saving and loading the
    compiled artifacts in the directory ``compile_cache`` if given.

    ``graph`` is the step on one microbatch (``ParallelStep._runtime_graph``). The
    layers the plan recomputes are rewritten first (``remat.rematerialize``); the
    copies take their original's sharding, layer and stage. ``copies``: copy node ->
    original node (empty without activation checkpointing)."""
    from alpa_torch.core.partition import stage_of_nodes
    from alpa_torch.core.remat import extend_layer_of, extend_sharding, rematerialize
    from runtime.engine import Engine, StageDeployment

    ranges = [(s.layer_start, s.layer_end) for s in plan.stages]
    graph, copies = rematerialize(graph, plan.layer_of, plan.recompute_layers, ranges)
    stage_of = stage_of_nodes(graph, extend_layer_of(plan.layer_of, copies), ranges)
    stages = [StageDeployment(s.device_ids, s.logical_mesh, extend_sharding(s.sharding, copies))
              for s in plan.stages]
    engine = Engine(group, graph, stages, stage_of, plan.num_microbatches, plan.schedule, cluster=cluster,
                    seed=seed, combine=combine, compile=compile, compile_cache=compile_cache)
    return engine, copies


__all__ = ["deploy_plan"]
