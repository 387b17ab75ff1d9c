"""The stage DP's inputs for one microbatch count B: every candidate stage priced (Alpa §5.1).

Owns ``build_tables`` (``StageTables``: per stage of layers i..j on submesh s with config c,
its time per microbatch, its parts and its memory, and the most stages that may follow it),
``run_dp`` (the stage DP on them under forced options), ``step_time`` (a slicing's step) and
the rules these follow. ``search.plan`` builds them for each B it tries; ``explain`` re-runs
the DP on them for its runner-ups.

Stage cost of layers i..j on submesh s with config c, per microbatch (the
DP's t in the schedule's step time, ``T = v Σ_k t_k + w max_k t_k``, ``v, w =
PipelineSchedule.sum_weight(B), max_weight(B)``: 1 and B - 1 for GPipe and 1F1B, Alpa eq. 2)::

    t = (fb_ij - f_ij + upd_ij) / B + f_ij + a_ij (B-1) / B + x_i
    fb_ij   forward + backward time of the ILP solution (compute, collectives,
            resharding) for the whole captured batch; its size-dependent part
            scales with the microbatch, 1/B of it (the graph is captured at the
            full batch and FLOPs and bytes scale linearly)
    f_ij    the part of fb_ij every microbatch pays in full, whatever its size:
            the fixed cost per operator execution (``cost_model.operator_s``)
            and the latency α of each forward/backward collective
            (``stage_costs.LayerCost.overhead_fb_s``, ``latency_fb_s``); the
            bandwidth part of weight all-gathers is still divided by B
    a_ij    adding one microbatch's gradients into the step's sums, paid by
            every microbatch after the first (``layer_parts.accumulate_s``)
    upd_ij  optimizer time (incl. the gradient all-reduce before it), paid once
            per step; spreading it as upd/B over the microbatches keeps eq. 2
    x_i     cross-stage transfer for a stage starting at layer i > 0: the
            forward activations in and their gradients out, 2 (α + β b_i / (B n_s)),
            b_i = ``LayerAssignment.boundary_bytes[i]``, n_s devices of the
            submesh (each receives its share; Alpa's cross-mesh resharding), on
            the inter-host link when the cluster has several hosts (placement
            is unknown inside the DP), else the intra-host link

A cluster calibrated by measured steps (``Cluster.cost_correction``) scales, per
submesh, fb_ij, f_ij and a_ij by its 'compute' factor, upd_ij by its 'update' factor and
x_i by its 'transfer' factor (``Cluster.correction``): the intra-op ILP's choices
are unchanged, the stage DP compares the stages at their measured rates.

Memory per device (the DP's feasibility rule): persistent + k · activation / B with k microbatches in
flight, k = ``PipelineSchedule.in_flight(n_succ, B)`` for a stage followed by n_succ stages,
so ``max_n_succ_stages`` is the largest n_succ whose k fits (-1 when none does; every one
when the schedule never holds more than fit). M is the
device memory or ``memory_budget_bytes``. The plan reports, per stage, the peak the
runtime's allocations reach (``memory_sim``: liveness of the stage's programs in
the schedule's order, the optimizer's old and new state at once, transient
copies), which may exceed this rule's figure.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from alpa_torch.core.cluster import COST_KINDS
from alpa_torch.core.errors import BatchSplitError
from alpa_torch.core.schedule import PipelineSchedule, schedule_named

from .dp import StageDPResult, solve_stage_dp
from .stage_costs import MeshConfig, StageCostModel, batch_size


@dataclass(frozen=True, kw_only=True, slots=True)
class StageTables:
    """The stage DP's inputs for one B, with the parts of each cost (all [L, L, S, C])."""

    num_microbatches: int
    schedule: PipelineSchedule
    """Its in-flight rule decided ``max_n_succ``; its step time prices a slicing (``step_time``)."""
    columns: tuple[tuple[MeshConfig, ...], ...]
    """columns[s][c]: the config of column c of submesh s."""
    sizes: np.ndarray
    cost_s: np.ndarray
    """t per microbatch (module docstring); inf = no such candidate."""
    compute_s: np.ndarray
    cross_s: np.ndarray
    update_s: np.ndarray
    """Per step."""
    persistent_bytes: np.ndarray
    activation_bytes: np.ndarray
    """Per microbatch."""
    max_n_succ: np.ndarray


def microbatch_candidates(graph, num_microbatches: int | None) -> list[int]:
    """``[num_microbatches]`` if given, else the powers of two dividing the batch size
    that leave at least 2 samples per microbatch: a microbatch of one sample is
    usually another graph (tracing specialises dims of size 1), which the runtime
    refuses (``ParallelStep._runtime_graph``); a forced count is taken as given."""
    size = batch_size(graph)
    if num_microbatches is not None:
        if num_microbatches < 1 or size % num_microbatches:
            raise BatchSplitError(f"num_microbatches={num_microbatches} does not divide the batch size "
                                  f"{size}; use a divisor of it")
        return [int(num_microbatches)]
    return [b for b in (2**k for k in range(size.bit_length())) if size % b == 0 and (size // b > 1 or b == 1)]


def max_n_succ(persistent, activation, budget, num_layers, num_microbatches, schedule: PipelineSchedule
               ) -> np.ndarray:
    """Module docstring, memory rule: the most stages that may follow each candidate, from the
    microbatches that fit beside its persistent bytes and the schedule's ``in_flight``; int64, -1
    = never, capped at num_layers."""
    # "n stages may follow" means any fewer may too: the most held by n or fewer, non-decreasing in n
    in_flight = np.maximum.accumulate([schedule.in_flight(n, num_microbatches) for n in range(num_layers + 1)])
    with np.errstate(divide="ignore", invalid="ignore"):
        fit = np.floor((budget - persistent) / activation)
    fit = np.where(activation > 0, fit, np.where(persistent <= budget, np.inf, -1.0))
    fit = np.nan_to_num(fit, nan=-1.0, posinf=np.inf)
    return (np.searchsorted(in_flight, fit, side="right") - 1).astype(np.int64)


def build_tables(model: StageCostModel, columns, num_microbatches: int, budget_bytes: float,
                 schedule: str, activation_scale: float) -> StageTables:
    """Price every (i, j, s, c) for B = num_microbatches under ``schedule`` (a name; module docstring)."""
    num_layers, b, pipeline_schedule = model.layers.num_layers, num_microbatches, schedule_named(schedule)
    model.solve_many((l, cfg, activation_scale) for cols in columns for cfg in cols if not cfg.bound
                     for l in range(num_layers))
    shape = (num_layers, num_layers, len(columns), max(len(c) for c in columns))
    arr = {k: np.full(shape, np.inf) for k in ("cost", "compute", "cross", "update", "pers", "act")}
    cl = model.cluster
    link = cl.inter_host_link if cl.num_hosts > 1 else cl.intra_host_link
    boundary = np.asarray(model.layers.boundary_bytes, dtype=np.float64)
    upper = np.triu(np.ones((num_layers, num_layers), dtype=bool))
    sizes = np.array([n * m for n, m in model.submeshes], dtype=np.int64)
    for s, cols in enumerate(columns):
        f_fb, f_up, f_x = (cl.correction(kind, model.submeshes[s]) for kind in COST_KINDS)
        cross = f_x * np.where(np.arange(num_layers) > 0,
                               2 * (link.alpha_s + link.beta_s_per_byte * boundary / (b * sizes[s])), 0.0)
        for c, cfg in enumerate(cols):
            rc = model.range_costs(dataclasses.replace(cfg, recompute=False), activation_scale)
            upd = f_up * (rc.compute_update_s + rc.comm_update_s)
            fixed = rc.overhead_fb_s + rc.latency_fb_s  # paid in full by every microbatch
            acc = f_fb * rc.accumulate_s * (b - 1) / b
            t = (f_fb * (rc.compute_fb_s + rc.comm_fb_s - fixed) + upd) / b + f_fb * fixed + acc + cross[:, None]
            compute = (f_fb * (rc.compute_fb_s - rc.overhead_fb_s) + f_up * rc.compute_update_s) / b \
                + f_fb * rc.overhead_fb_s + acc
            pers, act = rc.persistent_bytes, rc.activation_bytes / b
            if cfg.recompute:  # every layer recomputed (``checkpointing.py``)
                t, compute = t + f_fb * rc.recompute_s / b, compute + f_fb * rc.recompute_s / b
                pers, act = pers + np.maximum(rc.remat_peak_bytes, 0.0) / b, rc.kept_bytes / b
            for key, val in (("cost", t), ("compute", compute),
                             ("cross", np.broadcast_to(cross[:, None], t.shape)), ("update", upd),
                             ("pers", pers), ("act", act)):
                arr[key][:, :, s, c] = np.where(upper, val, np.inf)
    for lo, hi in tied_spans(model.graph, model.layers.layer_of):  # no stage starts inside a tied span
        arr["cost"][lo + 1:hi + 1] = np.inf
    mns = max_n_succ(arr["pers"], arr["act"], budget_bytes, num_layers, b, pipeline_schedule)
    mns = np.where(np.isfinite(arr["cost"]), mns, -1)
    return StageTables(num_microbatches=b, schedule=pipeline_schedule, columns=tuple(tuple(c) for c in columns),
                       sizes=sizes,
                       cost_s=arr["cost"], compute_s=arr["compute"], cross_s=arr["cross"],
                       update_s=arr["update"], persistent_bytes=arr["pers"], activation_bytes=arr["act"],
                       max_n_succ=mns)


def tied_spans(graph, layer_of) -> list[tuple[int, int]]:
    """(first, last) layer of the operators reading each parameter that several layers read.

    A tied weight (BERT-MLM's decoder = word embeddings, T5's shared embedding) must stay on
    one stage: the split into stage programs (``alpa_torch/core/partition.py``) refuses a parameter
    read by several stages, so ``build_tables`` prices every stage starting in (first, last] as inf."""
    params = {s.node for s in graph.inputs if s.kind == "param"}
    span: dict[str, tuple[int, int]] = {}
    for name, node in graph.nodes.items():
        l = layer_of[name]
        for u in node.inputs:
            if u in params:
                lo, hi = span.get(u, (l, l))
                span[u] = (min(lo, l), max(hi, l))
    return sorted({(lo, hi) for lo, hi in span.values() if hi > lo})


def run_dp(tables: StageTables, num_devices: int, *, num_stages=None, max_stages=None,
           submesh_index=None) -> StageDPResult:
    """``solve_stage_dp`` on ``tables`` with the forced options (module docstring)."""
    cost, sizes, devices = tables.cost_s, tables.sizes, num_devices
    if submesh_index is not None:
        cost = cost.copy()
        keep = np.zeros(cost.shape[2], dtype=bool)
        keep[submesh_index] = True
        cost[:, :, ~keep, :] = np.inf
    if num_stages is not None:
        width = num_stages + 1
        sizes, devices = sizes * width + 1, num_devices * width + num_stages
        max_stages = num_stages
    res = solve_stage_dp(cost, tables.max_n_succ, sizes, devices, tables.num_microbatches,
                         max_stages=max_stages, schedule=tables.schedule)
    if num_stages is not None:
        assert len(res.stages) == num_stages, "the device-count encoding forces the stage count"
    return res


def step_time(tables: StageTables, stages) -> float:
    """The schedule's step time of given stages (start, end, s, c); inf if a stage does not fit."""
    ts = [tables.cost_s[i, j, s, c] for i, j, s, c in stages]
    k = len(stages)
    if any(tables.max_n_succ[i, j, s, c] < k - 1 - q for q, (i, j, s, c) in enumerate(stages)):
        return math.inf
    return tables.schedule.step_time([float(t) for t in ts], tables.num_microbatches)
