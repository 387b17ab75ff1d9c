"""Inter-op planning: layers -> pipeline stages on submeshes -> ``ParallelPlan`` (Alpa §5).

Owns ``plan(graph, cluster) -> ParallelPlan``: it picks the layers
(``layer_assign``), prices every candidate stage (``stage_costs``, which asks
``intra_ilp``), runs the stage DP (``dp.solve_stage_dp``) for each candidate
number of microbatches B, and places the chosen submeshes on the cluster.
Does not own any of those algorithms, nor running the plan (``runtime``).

Stage cost of layers i..j on submesh s with config c, per microbatch (the
DP's t in Alpa eq. 2, ``T = Σ_k t_k + (B-1) max_k t_k``)::

    t = (fb_ij + upd_ij) / B + x_i
    fb_ij   forward + backward time of the ILP solution (compute, collectives,
            resharding) for the whole captured batch; one microbatch is 1/B of
            it (approximation: the graph is captured at the full batch and
            costs are scaled linearly, so per-microbatch fixed costs such as
            collective latency or weight all-gathers are undercounted by B×)
    upd_ij  optimizer time (incl. the gradient all-reduce before it), paid once
            per step; spreading it as upd/B over the microbatches keeps eq. 2
    x_i     cross-stage transfer for a stage starting at layer i > 0: the
            forward activations in and their gradients out, 2 (α + β b_i / (B n_s)),
            b_i = ``LayerAssignment.boundary_bytes[i]``, n_s devices of the
            submesh (each receives its share; Alpa's cross-mesh resharding), on
            the inter-host link when the cluster has several hosts (placement
            is unknown inside the DP), else the intra-host link

Memory per device: persistent + k · activation / B with k microbatches in
flight; 1F1B: k = n_succ + 1, so ``max_n_succ_stages`` = floor((M - p) / a) - 1
(-1 when even k = 1 does not fit; unlimited when k >= B fit, since at most
B microbatches exist); GPipe: all B in flight. M is the device
memory or ``memory_budget_bytes``.

Options: ``sharding=False`` keeps only (n, 1) logical meshes with replicated
parameters and optimizer state (data parallelism, see ``stage_costs``);
``pipeline=False`` allows one stage (the whole cluster); ``num_stages=K``
forces exactly K stages (submesh sizes s·W + 1 and D·W + K devices with
W = K + 1 make the DP's device count also count stages); ``submesh`` forces
every stage onto one submesh shape.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from alpa_torch.errors import BatchSplitError, InfeasibleMemoryError, PlanError
from alpa_torch.plan import SCHEDULES, ParallelPlan, StagePlan, graph_fingerprint, tile_submeshes

from .dp import NoFeasiblePlanError, StageDPResult, solve_stage_dp
from .layer_assign import LayerAssignment, assign_layers
from .stage_costs import MeshConfig, StageCostModel, batch_size

logger = logging.getLogger(__name__)
_GiB = 2.0**30


@dataclass(frozen=True, kw_only=True, slots=True)
class StageTables:
    """The stage DP's inputs for one B, with the parts of each cost (all [L, L, S, C])."""

    num_microbatches: int
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
    """``[num_microbatches]`` if given, else the powers of two dividing the batch size."""
    size = batch_size(graph)
    if num_microbatches is not None:
        if num_microbatches < 1 or size % num_microbatches:
            raise BatchSplitError(f"num_microbatches={num_microbatches} does not divide the batch size "
                                  f"{size}; use a divisor of it")
        return [int(num_microbatches)]
    return [b for b in (2**k for k in range(size.bit_length())) if size % b == 0]


def max_n_succ(persistent, activation, budget, num_layers, num_microbatches, schedule) -> np.ndarray:
    """Module docstring, memory rule; int64, capped at num_layers."""
    if schedule == "gpipe":
        fits = persistent + activation * num_microbatches <= budget
        return np.where(fits, num_layers, -1).astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.floor((budget - persistent) / activation)
    k = np.where(activation > 0, k, np.where(persistent <= budget, num_layers + 1, 0))
    k = np.where(k >= num_microbatches, num_layers + 1, k)  # at most B are ever in flight
    return np.clip(np.nan_to_num(k, nan=0.0) - 1, -1, num_layers).astype(np.int64)


def build_tables(model: StageCostModel, columns, num_microbatches: int, budget_bytes: float,
                 schedule: str, activation_scale: float) -> StageTables:
    """Price every (i, j, s, c) for B = num_microbatches (module docstring)."""
    num_layers, b = model.layers.num_layers, num_microbatches
    shape = (num_layers, num_layers, len(columns), max(len(c) for c in columns))
    arr = {k: np.full(shape, np.inf) for k in ("cost", "compute", "cross", "update", "pers", "act")}
    cl = model.cluster
    link = cl.inter_host_link if cl.num_hosts > 1 else cl.intra_host_link
    boundary = np.asarray(model.layers.boundary_bytes, dtype=np.float64)
    upper = np.triu(np.ones((num_layers, num_layers), dtype=bool))
    sizes = np.array([n * m for n, m in model.submeshes], dtype=np.int64)
    for s, cols in enumerate(columns):
        cross = np.where(np.arange(num_layers) > 0,
                         2 * (link.alpha_s + link.beta_s_per_byte * boundary / (b * sizes[s])), 0.0)
        for c, cfg in enumerate(cols):
            rc = model.range_costs(cfg, activation_scale)
            upd = rc.compute_update_s + rc.comm_update_s
            t = (rc.compute_fb_s + rc.comm_fb_s + upd) / b + cross[:, None]
            for key, val in (("cost", t), ("compute", (rc.compute_fb_s + rc.compute_update_s) / b),
                             ("cross", np.broadcast_to(cross[:, None], t.shape)), ("update", upd),
                             ("pers", rc.persistent_bytes), ("act", rc.activation_bytes / b)):
                arr[key][:, :, s, c] = np.where(upper, val, np.inf)
    mns = max_n_succ(arr["pers"], arr["act"], budget_bytes, num_layers, b, schedule)
    mns = np.where(np.isfinite(arr["cost"]), mns, -1)
    return StageTables(num_microbatches=b, columns=tuple(tuple(c) for c in columns), sizes=sizes,
                       cost_s=arr["cost"], compute_s=arr["compute"], cross_s=arr["cross"],
                       update_s=arr["update"], persistent_bytes=arr["pers"], activation_bytes=arr["act"],
                       max_n_succ=mns)


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
                         max_stages=max_stages)
    if num_stages is not None:
        assert len(res.stages) == num_stages, "the device-count encoding forces the stage count"
    return res


def step_time(tables: StageTables, stages) -> float:
    """Alpa eq. 2 for given stages (start, end, s, c); inf if a stage does not fit."""
    ts = [tables.cost_s[i, j, s, c] for i, j, s, c in stages]
    k = len(stages)
    if any(tables.max_n_succ[i, j, s, c] < k - 1 - q for q, (i, j, s, c) in enumerate(stages)):
        return math.inf
    return float(sum(ts) + (tables.num_microbatches - 1) * max(ts))


# ------------------------------------------------------------------ plan()
def plan(graph, cluster, *, num_microbatches: int | None = None, num_layers: int | None = None,
         num_stages: int | None = None, submesh: tuple[int, int] | None = None, pipeline: bool = True,
         sharding: bool = True, memory_budget_bytes: float | None = None, schedule: str = "1f1b",
         progress: Callable[[str], None] | None = None, layers: LayerAssignment | None = None,
         logical_shapes: str = "alpa", cost_model: StageCostModel | None = None) -> ParallelPlan:
    """The best plan found for ``graph`` on ``cluster`` (module docstring).

    ``layers`` (a ``LayerAssignment``) overrides ``num_layers``; ``cost_model`` lets
    several calls share ILP solutions (it must be for this graph, cluster and layers).
    Raises ``InfeasibleMemoryError`` when nothing fits, ``PlanError`` for impossible
    forced options, ``BatchSplitError`` for a bad ``num_microbatches``.
    """
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    num_stages = _check_options(cluster, schedule, pipeline, num_stages, submesh)
    if cost_model is None:
        layers = layers or assign_layers(graph, num_layers)
        cost_model = StageCostModel(graph, cluster, layers, sharding=sharding,
                                    logical_shapes=logical_shapes, progress=say)
    elif cost_model.graph is not graph or cost_model.cluster != cluster or cost_model.sharding != sharding:
        raise PlanError("cost_model was built for another graph, cluster or sharding option")
    model, layers = cost_model, cost_model.layers
    budget = float(memory_budget_bytes or cluster.device.memory_bytes)
    candidates = microbatch_candidates(graph, num_microbatches)
    scale = 1.0 / max(candidates)
    sub_idx = None if submesh is None else model.submeshes.index(tuple(submesh))
    say(f"{layers.num_layers} layers ({model.sigs.num_distinct} distinct), {len(model.configs)} meshes, "
        f"B in {candidates}")
    lean_all = False
    columns = candidate_columns(model, model.configs, budget, scale, lean_all=False)
    best = _search(model, columns, candidates, budget, schedule, scale, num_stages, sub_idx, pipeline)
    if best is None and sharding:
        lean_all = True
        say("no plan fits; adding least-memory ILP variants for every mesh")
        columns = candidate_columns(model, model.configs, budget, scale, lean_all=True)
        best = _search(model, columns, candidates, budget, schedule, scale, num_stages, sub_idx, pipeline)
    if best is None:
        _raise_infeasible(model, columns, candidates, budget, schedule, scale, num_stages, sub_idx, pipeline)
    res, tables = best
    options = {"num_stages": num_stages, "submesh": list(submesh) if submesh else None, "pipeline": pipeline,
               "sharding": sharding, "logical_shapes": model.logical_shapes, "layering": layers.method,
               "microbatch_candidates": candidates, "lean_all": lean_all, "num_ilps": model.num_ilps,
               "distinct_layers": model.sigs.num_distinct, "ilp_s": round(model.ilp_s, 3),
               "dp_tmax_evaluated": res.num_tmax_evaluated, "plan_s": round(time.perf_counter() - t0, 3)}
    out = build_plan(graph, model, tables, res.stages, schedule, budget, options)
    say(f"planned in {time.perf_counter() - t0:.1f} s: {out.summary()}")
    return out


def _check_options(cluster, schedule, pipeline, num_stages, submesh) -> int | None:
    if schedule not in SCHEDULES:
        raise PlanError(f"schedule {schedule!r} is unknown; use one of {SCHEDULES}")
    if submesh is not None and tuple(submesh) not in cluster.submesh_shapes():
        raise PlanError(f"submesh {submesh!r} is not one of this cluster's {list(cluster.submesh_shapes())}")
    if not pipeline:
        if num_stages not in (None, 1):
            raise PlanError(f"pipeline=False means one stage, but num_stages={num_stages}")
        return 1
    if num_stages is not None and not 1 <= num_stages <= cluster.num_devices:
        raise PlanError(f"num_stages={num_stages} must be in [1, {cluster.num_devices}] (one device per stage at least)")
    return num_stages


def candidate_columns(model, configs, budget, scale, *, lean_all):
    """Configs per submesh (``stage_costs`` variants): every fast one; a 'lean' twin
    capped at budget / ceil(L n / D) bytes per layer (a proportional share of the
    layers for n of the D devices) where some layer's fast solution exceeds that cap;
    with ``lean_all`` also a 'min' twin of every multi-device mesh."""
    columns = [[] for _ in model.submeshes]
    num_layers, devices = model.layers.num_layers, model.cluster.num_devices
    for cfg in configs:
        columns[cfg.submesh_index].append(cfg)
        size = cfg.logical_shape[0] * cfg.logical_shape[1]
        if not model.sharding or size == 1:
            continue
        cap = budget / math.ceil(num_layers * size / devices)
        fast = [model.layer_cost(l, cfg) for l in range(num_layers)]
        if any(c.persistent_bytes + scale * c.activation_bytes > cap for c in fast):
            columns[cfg.submesh_index].append(dataclasses.replace(cfg, variant="lean", layer_budget_bytes=cap))
        if lean_all:
            columns[cfg.submesh_index].append(dataclasses.replace(cfg, variant="min"))
    return columns


def _search(model, columns, candidates, budget, schedule, scale, num_stages, sub_idx, pipeline):
    """Best (StageDPResult, StageTables) over the B candidates, or None if none fits."""
    best = None
    for b in candidates:
        tables = build_tables(model, columns, b, budget, schedule, scale)
        try:
            res = run_dp(tables, model.cluster.num_devices, num_stages=num_stages,
                         max_stages=None if pipeline else 1, submesh_index=sub_idx)
        except NoFeasiblePlanError as exc:
            logger.debug("B=%d: %s", b, exc)
            continue
        total = step_time(tables, res.stages)
        if best is None or total < best[0]:
            best = (total, res, tables)
    return None if best is None else best[1:]


def _raise_infeasible(model, columns, candidates, budget, schedule, scale, num_stages, sub_idx, pipeline):
    """InfeasibleMemoryError with the least per-device memory any candidate plan needs
    (bisection on the budget, at the largest B: the smallest activations), or
    PlanError if no plan exists even with unlimited memory."""
    b = max(candidates)

    def feasible(m):
        tables = build_tables(model, columns, b, m, schedule, scale)
        try:
            run_dp(tables, model.cluster.num_devices, num_stages=num_stages,
                   max_stages=None if pipeline else 1, submesh_index=sub_idx)
            return True
        except NoFeasiblePlanError:
            return False

    hi = budget * 2
    while not feasible(hi):
        if hi > 1e18:
            tables = build_tables(model, columns, b, math.inf, schedule, scale)
            try:
                run_dp(tables, model.cluster.num_devices, num_stages=num_stages,
                       max_stages=None if pipeline else 1, submesh_index=sub_idx)
            except NoFeasiblePlanError as exc:
                raise PlanError(f"no plan satisfies the forced options: {exc}") from exc
            break
        hi *= 4
    lo = budget
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    cl = model.cluster
    raise InfeasibleMemoryError(
        f"No plan fits in {budget / _GiB:.3f} GiB per device on the {cl.num_hosts}x{cl.devices_per_host} "
        f"cluster: the best candidate plan needs {hi / _GiB:.3f} GiB per device ({hi:.4g} bytes; "
        f"{b} microbatches, {schedule}). Remedies: more devices or devices with more memory, more "
        f"microbatches (a larger batch), activation checkpointing, a smaller model or batch, or "
        f"memory_budget_bytes if the budget was set too low.", required_bytes=hi)


def build_plan(graph, model: StageCostModel, tables: StageTables, stages, schedule: str,
               budget: float, options: dict) -> ParallelPlan:
    """A ``ParallelPlan`` from DP stages (start, end, submesh, column) priced by ``tables``."""
    b, k_total = tables.num_microbatches, len(stages)
    devices = tile_submeshes(model.cluster, [model.submeshes[s] for _, _, s, _ in stages])
    out = []
    for k, (i, j, s, c) in enumerate(stages):
        cfg = tables.columns[s][c]
        in_flight = b if schedule == "gpipe" else min(k_total - k, b)
        t, comp = float(tables.cost_s[i, j, s, c]), float(tables.compute_s[i, j, s, c])
        pers, act = float(tables.persistent_bytes[i, j, s, c]), float(tables.activation_bytes[i, j, s, c])
        out.append(StagePlan(
            index=k, layer_start=i, layer_end=j, submesh=tuple(model.submeshes[s]), device_ids=devices[k],
            logical_mesh=tuple(cfg.logical_shape), variant=cfg.variant,
            sharding=model.stage_sharding(i, j, cfg, 1.0 / max(options["microbatch_candidates"])),
            time_s=t, compute_s=comp, comm_s=t - comp, cross_stage_s=float(tables.cross_s[i, j, s, c]),
            update_s=float(tables.update_s[i, j, s, c]), persistent_bytes=pers, activation_bytes=act,
            in_flight=in_flight, memory_bytes=pers + in_flight * act))
    slow = max(out, key=lambda st: (st.time_s, -st.index))
    total = step_time(tables, stages)
    return ParallelPlan(
        stages=tuple(out), schedule=schedule, num_microbatches=b, num_layers=model.layers.num_layers,
        layer_of=dict(model.layers.layer_of), predicted_step_s=total, compute_s=b * slow.compute_s,
        communication_s=b * slow.comm_s, bubble_s=total - b * slow.time_s,
        peak_memory_bytes=max(st.memory_bytes for st in out), memory_budget_bytes=budget,
        cluster=model.cluster.to_dict(), cluster_description=model.cluster.describe(),
        graph_fingerprint=graph_fingerprint(graph), options=json.loads(json.dumps(options)))
