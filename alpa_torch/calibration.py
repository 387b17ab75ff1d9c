"""Calibrating the cost model by measured steps: a correction per kind of cost and submesh.

The cost model prices a stage from FLOPs, bytes and the profiled rates of one device and
link. What it leaves out shows up as a steady ratio per kind of cost and stage shape: on the
shared cores of a local cluster a stage whose partners wait in a pipeline runs its forward
and backward at about 0.74x the prediction while a one-stage step on the whole cluster runs
at 1.15x (``bench/fidelity.py``, docs/benchmarks.md §1); on GPUs the same ratios hold the
achieved fraction of peak FLOP/s and link bandwidth at each stage size.

- ``observe(plan, events)``: from one step the runtime recorded (``Engine.events``), per
  stage and kind of cost (``Cluster.COST_KINDS``: 'compute' = the forward and backward
  programs of the B microbatches, 'update' = the update program and the wait for the
  gradient buckets, 'transfer' = cross-stage receives, which include waiting for the other
  stage, sends and their final wait; a one-stage step without microbatches runs as one
  program, 'step'), the median over the stage's devices of the seconds measured against
  the plan's figure for them: ``ratio`` = measured / the plan's figure, ``raw_ratio`` =
  measured / the figure of the cost model alone (the plan's figure with the corrections
  it was priced with divided out).
- ``fit(observations)``: per kind and submesh the median ``raw_ratio``; a 'step' counts
  for both 'compute' and 'update' of its submesh. 'transfer' is observed but not fitted: a
  blocking receive also waits for the other stage to produce the value, which eq. 2
  already prices as the pipeline's bubble (its measured ratio ran 3.9-4.4x on local
  clusters), so a correction from it would count the wait twice. A 'transfer' factor
  given by hand (``Cluster.cost_correction``) is applied.
- ``calibrated(cluster, corrections)``: the cluster with them (``Cluster.cost_correction``;
  ones measured anew replace the old ones of the same kind and submesh), which the stage
  DP then applies (``stage_dp.search``: the intra-op choices stay the cost model's).
- ``load`` / ``store``: the corrections of a step on a cluster in the plan cache, keyed by
  the step's graph (``graph_fingerprint``), the cluster without its corrections and the
  cost model's version. ``parallelize`` (with ``tune``) plans with the stored ones and
  stores what its measured plan selection recorded (``alpa_torch.tune``), so the next
  planning of that step on that cluster (other options, such as a schedule or a number of
  microbatches, or a cache that lost the plan) ranks its candidates at the measured rates.
  They are not carried to other steps: a ratio holds what the cost model leaves out of that
  step, and how much that is depends on the step. A small step is mostly each operator's
  fixed cost, which FLOPs and bytes do not price: a GPT at T = 64 on one CPU device measured
  57x its compute figure, and that correction, applied to a deep GPT planned next on the
  same cluster, priced its step at 9.4 s instead of 0.17 s and set 1x1 and 1x2 submeshes
  57x apart.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Any

from alpa_torch.core.cluster import COST_KINDS, Cluster, submesh_key
from alpa_torch.core.graph import OpGraph
from alpa_torch.core.plan import ParallelPlan, graph_fingerprint

from .plan_cache import PlanCache

log = logging.getLogger(__name__)

VERSION = 2
"""Part of the cache key of stored corrections: a change of what they mean misses (2: kept per
step, no longer per cluster)."""
EVENT_KINDS = {"forward": "compute", "backward": "compute", "weight": "compute", "update": "update",
               "collective": "update", "transfer": "transfer", "step": "step", "reduction": None}
"""Category of a recorded event (``runtime/timeline.py``) -> the kind of cost it is measured against
(None: inside another event's time, a bucket's all-reduce in a one-stage step's)."""
FITTED = ("compute", "update", "step")
"""The kinds ``fit`` learns from."""


def stage_figures(plan: ParallelPlan) -> list[dict[str, float]]:
    """Per stage, the seconds per step the plan gives each kind of cost: compute = B x (t - x - u / B),
    the stage's time per microbatch without its transfer and its share of the update; update = u;
    transfer = B x x."""
    b = plan.num_microbatches
    return [{"compute": b * (st.time_s - st.cross_stage_s) - st.update_s, "update": st.update_s,
             "transfer": b * st.cross_stage_s} for st in plan.stages]


def observe(plan: ParallelPlan, events: list[tuple[int, int, list]]) -> list[dict[str, Any]]:
    """Measured against predicted seconds per stage and kind of cost (module docstring), from
    ``events``: (stage, rank, that worker's events) per worker."""
    cluster = Cluster.from_dict(plan.cluster)
    spent: dict[int, list[dict[str, float]]] = {}
    for stage, _, evs in events:
        per_kind: dict[str, float] = {}
        for _, category, t0, t1, _ in evs:
            kind = EVENT_KINDS[category]
            if kind is not None:
                per_kind[kind] = per_kind.get(kind, 0.0) + (t1 - t0) / 1e9
        spent.setdefault(stage, []).append(per_kind)
    figures = stage_figures(plan)
    out = []
    for k, devices in sorted(spent.items()):
        submesh = plan.stages[k].submesh
        fig = figures[k]
        raw = {kind: fig[kind] / cluster.correction(kind, submesh) for kind in COST_KINDS}
        if any("step" in d for d in devices):
            fig, raw = {"step": plan.predicted_step_s}, {"step": raw["compute"] + raw["update"]}
        for kind, predicted in fig.items():
            measured = statistics.median(d.get(kind, 0.0) for d in devices)
            out.append(observation(k, kind, submesh, predicted, raw[kind], measured))
    return out


def observation(stage: int, kind: str, submesh: tuple[int, int], predicted_s: float, raw_s: float,
                measured_s: float) -> dict[str, Any]:
    """One record of ``observe``: ``predicted_s`` is the plan's figure, ``raw_s`` the cost model's alone."""
    return {"stage": stage, "kind": kind, "submesh": submesh_key(submesh),
            "predicted_s": round(predicted_s, 6), "measured_s": round(measured_s, 6),
            "ratio": round(measured_s / predicted_s, 4) if predicted_s > 0 else None,
            "raw_ratio": round(measured_s / raw_s, 4) if raw_s > 0 and measured_s > 0 else None}


def fit(observations: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The corrections ``observations`` give: per kind and submesh the median raw ratio ('transfer'
    left out: module docstring)."""
    ratios: dict[str, dict[str, list[float]]] = {}
    for ob in observations:
        if ob["raw_ratio"] is None or ob["kind"] not in FITTED:
            continue
        for kind in (("compute", "update") if ob["kind"] == "step" else (ob["kind"],)):
            ratios.setdefault(kind, {}).setdefault(ob["submesh"], []).append(ob["raw_ratio"])
    return {kind: {key: round(statistics.median(v), 4) for key, v in sorted(table.items())}
            for kind, table in sorted(ratios.items())}


def calibrated(cluster: Cluster, corrections: dict[str, dict[str, float]]) -> Cluster:
    """``cluster`` with ``corrections`` added to its own (the new ones win)."""
    merged = {kind: dict(table) for kind, table in cluster.cost_correction.items()}
    for kind, table in corrections.items():
        merged.setdefault(kind, {}).update(table)
    return dataclasses.replace(cluster, cost_correction=merged)


def cache_fields(cluster: Cluster, graph: OpGraph) -> dict[str, Any]:
    """The plan cache key of the corrections stored for ``graph`` on ``cluster``."""
    from intra_ilp import cost_model  # read at call time, as plan_cache.key_fields does

    return {"calibration": VERSION, "graph_fingerprint": graph_fingerprint(graph),
            "cluster": dataclasses.replace(cluster, cost_correction={}).to_dict(),
            "cost_model_version": cost_model.COST_MODEL_VERSION}


def load(cache: PlanCache | None, cluster: Cluster, graph: OpGraph) -> Cluster:
    """``cluster`` with the corrections stored for ``graph`` on it, if any; a cluster that has its
    own corrections (the user gave them) is returned as is."""
    if cache is None or cluster.cost_correction:
        return cluster
    stored = cache.get_data(cache_fields(cluster, graph))
    if not stored:
        return cluster
    try:
        out = calibrated(cluster, stored)
    except Exception as exc:  # noqa: BLE001 - a damaged entry means: plan with the cost model alone
        log.warning("ignoring the stored calibration of this step and cluster (%s)", exc)
        return cluster
    log.info("planning with the measured cost corrections stored for this step and cluster: %s", stored)
    return out


def store(cache: PlanCache | None, cluster: Cluster, graph: OpGraph, corrections: dict[str, dict[str, float]]) -> None:
    """Add ``corrections`` to those stored for ``graph`` on ``cluster`` (``load``)."""
    if cache is None or not corrections:
        return
    fields = cache_fields(cluster, graph)
    try:
        old = dataclasses.replace(cluster, cost_correction=cache.get_data(fields) or {})
    except Exception as exc:  # noqa: BLE001 - a damaged entry is replaced
        log.warning("replacing the stored calibration of this step and cluster (%s)", exc)
        old = dataclasses.replace(cluster, cost_correction={})
    cache.put_data(fields, calibrated(old, corrections).cost_correction)


__all__ = ["EVENT_KINDS", "FITTED", "VERSION", "cache_fields", "calibrated", "fit", "load", "observation", "observe",
           "stage_figures", "store"]
