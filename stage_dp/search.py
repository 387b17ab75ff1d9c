"""Inter-op planning: layers -> pipeline stages on submeshes -> ``ParallelPlan`` (Alpa §5).

Owns ``plan(graph, cluster) -> ParallelPlan``: it picks the layers
(``layer_assign``), prices every candidate stage (``stage_costs``, which asks
``intra_ilp``), runs the stage DP (``dp.solve_stage_dp``) for each candidate
number of microbatches B, and places the chosen submeshes on the cluster.
Does not own any of those algorithms, nor running the plan (``runtime``).

The stage DP's inputs, every candidate stage priced for one B (its cost per microbatch and
the memory rule that decides which stages may follow it), are ``tables.py``'s.

Options: ``sharding=False`` keeps only (n, 1) logical meshes with replicated
parameters and optimizer state (data parallelism, see ``stage_costs``);
``pipeline=False`` allows one stage (the whole cluster); ``num_stages=K``
forces exactly K stages (submesh sizes s·W + 1 and D·W + K devices with
W = K + 1 make the DP's device count also count stages); ``submesh`` forces
every stage onto one submesh shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import logging
import math
import time
from collections.abc import Callable

import numpy as np

from alpa_torch.core.cluster import Cluster, GiB
from alpa_torch.core.errors import InfeasibleMemoryError, PlanError
from alpa_torch.core.graph import OpGraph
from alpa_torch.core.options import PlanOptions
from alpa_torch.core.plan import ParallelPlan, StagePlan, graph_fingerprint, tile_submeshes

from .checkpointing import Checkpointing, choose_layers, saved_and_peak
from .dp import NoFeasiblePlanError, StageDPResult
from .layer_assign import LayerAssignment, assign_layers
from .memory_sim import with_simulated_memory
from .stage_costs import StageCostModel
from .tables import StageTables, build_tables, microbatch_candidates, run_dp, step_time

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ plan()
def plan(graph: OpGraph, cluster: Cluster, options: PlanOptions | None = None, *,
         progress: Callable[[str], None] | None = None, layers: LayerAssignment | None = None,
         cost_model: StageCostModel | None = None, **option_fields) -> ParallelPlan:
    """The best plan found for ``graph`` on ``cluster`` under ``options`` (module docstring);
    ``options`` may also be given as ``PlanOptions``'s fields (``plan(g, c, num_stages=2)``).

    ``layers`` (a ``LayerAssignment``) overrides ``options.num_layers``; ``cost_model`` lets
    several calls share ILP solutions (it must be for this graph, cluster and layers).
    Raises ``InfeasibleMemoryError`` when nothing fits, ``PlanError`` for impossible
    forced options, ``BatchSplitError`` for a bad ``num_microbatches``. The step's own
    rules (one microbatch for BatchNorm, ...) are ``stage_dp.planner.make_plan``'s.
    """
    if options is not None and option_fields:
        raise PlanError(f"pass options or their fields, not both ({sorted(option_fields)})")
    options = options or PlanOptions(**option_fields)
    with _gc_frozen():
        return _plan(graph, cluster, options, progress=progress, layers=layers, cost_model=cost_model)


@contextlib.contextmanager
def _gc_frozen():
    """Hide everything allocated before planning (a captured graph: millions of objects for
    GPT-3 39B) from the cyclic garbage collector while planning, so its full passes, which
    planning's allocations trigger now and then, stop costing ~1 s each. Left alone if the
    caller froze objects itself (``gc.unfreeze`` would undo that)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _plan(graph, cluster, options: PlanOptions, *, progress, layers, cost_model) -> ParallelPlan:
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    num_stages = _check_options(cluster, options)
    submesh, pipeline, sharding, schedule = options.submesh, options.pipeline, options.sharding, options.schedule
    if cost_model is None:
        layers = layers or assign_layers(graph, options.num_layers)
        cost_model = StageCostModel(graph, cluster, layers, sharding=sharding, logical_shapes=options.logical_shapes,
                                    progress=say, submeshes=planned_submeshes(cluster, options))
    elif cost_model.graph is not graph or cost_model.cluster != cluster or cost_model.sharding != sharding:
        raise PlanError("cost_model was built for another graph, cluster or sharding option")
    model, layers = cost_model, cost_model.layers
    ckpt = Checkpointing.parse(options.checkpointing)
    budget = float(min(options.memory_budget_bytes or cluster.device.memory_bytes, ckpt.budget_bytes or math.inf))
    candidates = microbatch_candidates(graph, options.num_microbatches)
    scale = 1.0 / max(candidates)
    sub_idx = None if submesh is None else model.submeshes.index(tuple(submesh))
    say(f"{layers.num_layers} layers ({model.sigs.num_distinct} distinct), {len(model.configs)} meshes, "
        f"B in {candidates}")

    def simulated_peak(rule_budget: float) -> float:
        """The simulated peak of the plan the memory rule picks under ``rule_budget``."""
        res, tables, _ = search(rule_budget)
        record = {"microbatch_candidates": candidates, "checkpointing": ckpt.mode}
        return build_plan(graph, model, tables, res.stages, schedule, rule_budget, record).peak_memory_bytes

    search = functools.partial(_fitting_search, model, candidates, schedule, scale, num_stages, sub_idx, pipeline,
                               sharding, ckpt, say, cap_budget=budget, simulate=simulated_peak)

    def planned(rule_budget: float) -> ParallelPlan:
        """The plan the memory rule picks under ``rule_budget``, its peak simulated (raises
        ``InfeasibleMemoryError`` if the rule admits none)."""
        res, tables, lean_all = search(rule_budget)
        # the plan's record: the options asked for, and what planning found and took
        record = {**options.to_dict(), "num_stages": num_stages, "logical_shapes": model.logical_shapes,
                  "layering": layers.method, "microbatch_candidates": candidates, "lean_all": lean_all,
                  "num_ilps": model.num_ilps, "distinct_layers": model.sigs.num_distinct,
                  "ilp_s": round(model.ilp_s, 3), "dp_tmax_evaluated": res.num_tmax_evaluated,
                  "checkpointing": ckpt.mode, "plan_s": round(time.perf_counter() - t0, 3)}
        if rule_budget < budget:
            record["memory_rule_budget_bytes"] = rule_budget
        out = build_plan(graph, model, tables, res.stages, schedule, rule_budget, record)
        return dataclasses.replace(out, memory_budget_bytes=budget)

    out = _fitting(planned, budget)
    say(f"planned in {time.perf_counter() - t0:.1f} s: {out.summary()}")
    return out


def _fitting(planned: Callable[[float], ParallelPlan], budget: float) -> ParallelPlan:
    """The first plan whose simulated peak fits ``budget``, from ``planned(rule_budget)``.

    The stage DP decides feasibility by its fast memory rule; a plan it admits can simulate
    above the budget (``memory_sim``). Then plan again with the rule's budget cut to what
    the rule counted for that plan (``_rule_bytes``, at most the rule's budget) times the
    overshoot, so the next plan is not the same one (cutting the rule's budget alone left
    GPT-3 39B's plan admitted twice), and where a cut leaves the rule nothing, bisect
    between that cut and the last budget that gave a plan. ``InfeasibleMemoryError`` (with
    the least simulated peak seen) if nothing fits after ``FIT_ATTEMPTS`` cuts and
    ``FIT_BISECTIONS`` bisections."""
    rule, refused = budget, None  # refused: the last rule budget that admitted nothing
    best = planned(rule)  # the rule admits nothing even at the budget: its own error
    peaks = [best.peak_memory_bytes]
    for _ in range(FIT_ATTEMPTS + FIT_BISECTIONS):
        if best.peak_memory_bytes <= budget:
            return best
        logger.info("the stage DP's memory rule admitted a plan (rule budget %.4g) whose simulation peaks at "
                    "%.4g of %.4g bytes: planning again with a tighter rule", rule, best.peak_memory_bytes, budget)
        admitted = rule
        rule = ((admitted + refused) / 2 if refused is not None
                else min(rule, _rule_bytes(best)) * budget / best.peak_memory_bytes * (1 - FIT_MARGIN))
        try:
            best = planned(rule)
            peaks.append(best.peak_memory_bytes)
        except InfeasibleMemoryError:
            refused, rule = rule, admitted  # keep the last plan; bisect next
    need = min(peaks)
    raise InfeasibleMemoryError(
        f"No plan fits in {budget / GiB:.3f} GiB per device: every plan the stage DP's memory rule admitted, "
        f"down to a rule budget of {rule / GiB:.3f} GiB, simulates above it (the least: {need / GiB:.3f} GiB "
        "per device, stage_dp/memory_sim.py). Remedies: more devices or devices with more memory, more "
        "microbatches, checkpointing='full', or a smaller model or batch", required_bytes=need)


def _rule_bytes(p: ParallelPlan) -> float:
    """The most the stage DP's memory rule counts for a stage of ``p`` (persistent + in flight
    x activation bytes; ``StagePlan.memory_bytes`` is the simulation's figure)."""
    return max(s.persistent_bytes + s.in_flight * s.activation_bytes for s in p.stages)


FIT_ATTEMPTS = 5
"""Plannings with the rule's budget cut by the overshoot (``_fitting``)."""
FIT_BISECTIONS = 8
"""Plannings bisecting between a rule budget that admits nothing and one whose plan is too big."""
FIT_MARGIN = 0.005
"""Each cut takes this fraction more than the overshoot."""


def _fitting_search(model, candidates, schedule, scale, num_stages, sub_idx, pipeline, sharding, ckpt, say,
                    budget: float, *, cap_budget: float, simulate=None):
    """``(dp result, tables, lean_all)`` of the best plan whose memory rule fits ``budget``; raises
    ``InfeasibleMemoryError`` if none does, even with least-memory ILP variants on every mesh
    (``simulate(rule_budget)``: the simulated peak of the plan under a rule budget, for the error).
    The 'lean' layer caps come from ``cap_budget``, the device's budget, not from the rule's
    ``budget``: the plannings of ``_fitting``, which only tighten the rule, reuse every ILP
    solution (a cap per rule budget re-solved every lean ILP: GPT-3 39B on 8x8 V100, three
    refits, 70 s each)."""
    columns = with_recompute(candidate_columns(model, model.configs, cap_budget, scale, lean_all=False, lazy=True),
                             ckpt)
    best = _search_solving_picked(model, columns, candidates, budget, schedule, scale, num_stages, sub_idx,
                                  pipeline, say)
    lean_all = False
    if best is None and sharding:
        lean_all = True
        say("no plan fits; adding least-memory ILP variants for every mesh")
        columns = with_recompute(candidate_columns(model, model.configs, cap_budget, scale, lean_all=True), ckpt)
        best = _search(model, columns, candidates, budget, schedule, scale, num_stages, sub_idx, pipeline)
    if best is None:
        _raise_infeasible(model, columns, candidates, budget, schedule, scale, num_stages, sub_idx, pipeline,
                          ckpt, simulate)
    return (*best, lean_all)


def _search_solving_picked(model, columns, candidates, budget, schedule, scale, num_stages, sub_idx, pipeline,
                           say):
    """``_search`` over ``columns``, some of them ``bound`` (priced by lower bounds,
    ``stage_costs``): while the best plan has a stage on a bound column, solve that column's
    ILPs of that stage's layers and search again. The plan returned is priced exactly (its
    stages' layers all solved) and is the best over every column, bounds and all, since no
    bound is above what its ILPs give: the lean ILPs the plan cannot use are never solved
    (LLaMA-3-70B on 16x8 H100: 53 solved up front, 4.2 s each, none used). None if no plan
    fits even at the bounds."""
    while True:
        best = _search(model, columns, candidates, budget, schedule, scale, num_stages, sub_idx, pipeline)
        if best is None:
            return None
        todo = bound_layers(model, best[1], best[0].stages, scale)
        if not todo:
            return best
        say(f"{len(todo)} layer(s) of the best plan so far are priced by bounds: solving their lean ILPs")
        model.solve_many([(l, cfg, scale) for l, cfg in todo])


def bound_layers(model, tables: StageTables, stages, scale: float) -> set:
    """(layer, config) of each layer of ``stages`` (start, end, s, c) that ``tables`` prices by a
    lower bound (a ``bound`` column whose ILP is unsolved, ``stage_costs``); empty when the
    stages are priced exactly."""
    return {(l, dataclasses.replace(cfg, recompute=False)) for i, j, s, c in stages
            if (cfg := tables.columns[s][c]).bound for l in range(i, j + 1) if not model.solved(l, cfg, scale)}


def planned_submeshes(cluster, options: PlanOptions) -> list[tuple[int, int]] | None:
    """The submesh shapes a search under ``options`` can place stages on: the forced
    ``submesh``; the whole cluster for one stage (``pipeline=False``; stages tile the
    cluster); else None (every one of ``Cluster.submesh_shapes``)."""
    if options.submesh is not None:
        return [tuple(options.submesh)]
    if not options.pipeline:
        return [(cluster.num_hosts, cluster.devices_per_host)]
    return None


def _check_options(cluster, options: PlanOptions) -> int | None:
    """The forced stage count (1 without pipelining), after the checks only the cluster allows."""
    submesh, num_stages = options.submesh, options.num_stages
    if submesh is not None and tuple(submesh) not in cluster.submesh_shapes():
        raise PlanError(f"submesh {submesh!r} is not one of this cluster's {list(cluster.submesh_shapes())}")
    if not options.pipeline:
        return 1
    if num_stages is not None and not 1 <= num_stages <= cluster.num_devices:
        raise PlanError(f"num_stages={num_stages} must be in [1, {cluster.num_devices}] "
                        "(one device per stage at least)")
    return num_stages


def with_recompute(columns, ckpt: Checkpointing):
    """``columns`` with the recompute-every-layer twin of each (``checkpointing.py``):
    both for 'auto', only the twins for 'full', none for 'none'."""
    if not ckpt.twins:
        return columns
    twins = [[dataclasses.replace(cfg, recompute=True) for cfg in cols] for cols in columns]
    return [cols + tw if ckpt.plain else tw for cols, tw in zip(columns, twins)]


def candidate_columns(model, configs, budget, scale, *, lean_all, lazy=False):
    """Configs per submesh (``stage_costs`` variants): every fast one; a 'lean' twin
    capped at budget / ceil(L n / D) bytes per layer (a proportional share of the
    layers for n of the D devices) where some layer's fast solution exceeds that cap;
    with ``lean_all`` also a 'min' twin of every multi-device mesh. ``lazy``: the lean
    ILPs are left unsolved, their columns ``bound`` (``_search_solving_picked``)."""
    columns = [[] for _ in model.submeshes]
    num_layers = model.layers.num_layers
    lean = {cfg: _capped(model, cfg, budget, "lean") for cfg in configs}
    # One batch: fast ILPs, and 'lean' ones for the layers whose fast solution exceeds the cap
    # (solve_many skips the others), i.e. exactly the lean ILPs the columns below need.
    model.solve_many([(l, cfg, 1.0) for cfg in configs for l in range(num_layers)]
                     + [(l, c, scale) for c in lean.values() if c is not None and not lazy for l in range(num_layers)]
                     + [(l, c, scale) for cfg in configs if lean_all and (c := _capped(model, cfg, budget, "min"))
                        for l in range(num_layers)])
    for cfg in configs:
        columns[cfg.submesh_index].append(cfg)
        size = cfg.logical_shape[0] * cfg.logical_shape[1]
        if not model.sharding or size == 1:
            continue
        cap = lean[cfg].layer_budget_bytes
        fast = [model.layer_cost(l, cfg) for l in range(num_layers)]
        if any(c.persistent_bytes + scale * c.activation_bytes > cap for c in fast):
            columns[cfg.submesh_index].append(dataclasses.replace(lean[cfg], bound=lazy))
        if lean_all:
            columns[cfg.submesh_index].append(dataclasses.replace(cfg, variant="min"))
    return columns


def _capped(model, cfg, budget, variant):
    """The 'lean' (cap: budget / ceil(L n / D)) or 'min' twin of a multi-device ``cfg``
    (``candidate_columns``), or None."""
    size = cfg.logical_shape[0] * cfg.logical_shape[1]
    if not model.sharding or size == 1:
        return None
    if variant == "min":
        return dataclasses.replace(cfg, variant="min")
    cap = budget / math.ceil(model.layers.num_layers * size / model.cluster.num_devices)
    return dataclasses.replace(cfg, variant="lean", layer_budget_bytes=cap)


def _search(model, columns, candidates, budget, schedule, scale, num_stages, sub_idx, pipeline):
    """Best (StageDPResult, StageTables) over the B candidates, or None if none fits."""
    best = None
    for b in candidates:
        tables = build_tables(model, columns, b, budget, schedule, scale)
        try:
            res = _run(model, tables, num_stages, sub_idx, pipeline)
        except NoFeasiblePlanError as exc:
            logger.debug("B=%d: %s", b, exc)
            continue
        total = step_time(tables, res.stages)
        if best is None or total < best[0]:
            best = (total, res, tables)
    return None if best is None else best[1:]


def _run(model, tables: StageTables, num_stages, sub_idx, pipeline) -> StageDPResult:
    """The stage DP on ``tables`` over the whole cluster, with the forced options."""
    return run_dp(tables, model.cluster.num_devices, num_stages=num_stages, max_stages=None if pipeline else 1,
                  submesh_index=sub_idx)


def _raise_infeasible(model, columns, candidates, budget, schedule, scale, num_stages, sub_idx, pipeline,
                      ckpt: Checkpointing, simulate=None):
    """InfeasibleMemoryError with the least per-device memory any candidate plan needs
    (bisection on the stage DP's memory rule, at the largest B: the smallest activations;
    then, with ``simulate``, the simulated peak of the plan the rule picks there, where that is
    more: a budget of that much gets a plan), or PlanError if no plan exists even with
    unlimited memory."""
    b = max(candidates)

    def feasible(m):
        try:
            _run(model, build_tables(model, columns, b, m, schedule, scale), num_stages, sub_idx, pipeline)
            return True
        except NoFeasiblePlanError:
            return False

    hi = budget * 2
    while not feasible(hi):
        if hi > 1e18:
            try:
                _run(model, build_tables(model, columns, b, math.inf, schedule, scale), num_stages, sub_idx,
                     pipeline)
            except NoFeasiblePlanError as exc:
                raise PlanError(f"no plan satisfies the forced options: {exc}") from exc
            break
        hi *= 4
    lo = budget
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    if simulate is not None:
        hi = max(hi, simulate(hi))
    cl = model.cluster
    recompute = "" if ckpt.twins else "activation checkpointing (checkpointing='auto'), "
    raise InfeasibleMemoryError(
        f"No plan fits in {budget / GiB:.3f} GiB per device on the {cl.num_hosts}x{cl.devices_per_host} "
        f"cluster: the best candidate plan needs {hi / GiB:.3f} GiB per device ({hi:.4g} bytes; "
        f"{b} microbatches, {schedule}{', with activation checkpointing' if ckpt.twins else ''}). Remedies: "
        f"more devices or devices with more memory, more microbatches (a larger batch), {recompute}a smaller "
        f"model or batch, or memory_budget_bytes if the budget was set too low.", required_bytes=hi)


def build_plan(graph, model: StageCostModel, tables: StageTables, stages, schedule: str,
               budget: float, options: dict) -> ParallelPlan:
    """A ``ParallelPlan`` from DP stages (start, end, submesh, column) priced by ``tables``."""
    b, k_total = tables.num_microbatches, len(stages)
    devices = tile_submeshes(model.cluster, [model.submeshes[s] for _, _, s, _ in stages])
    out = []
    scale = 1.0 / max(options["microbatch_candidates"])
    for k, (i, j, s, c) in enumerate(stages):
        cfg = tables.columns[s][c]
        base = dataclasses.replace(cfg, recompute=False)
        in_flight = tables.schedule.in_flight(k_total - 1 - k, b)
        t, comp = float(tables.cost_s[i, j, s, c]), float(tables.compute_s[i, j, s, c])
        pers, act = float(tables.persistent_bytes[i, j, s, c]), float(tables.activation_bytes[i, j, s, c])
        memory, recompute = pers + in_flight * act, ()
        if cfg.recompute:
            recompute, extra_s, pers, act, memory = _choose_recompute(
                model, base, i, j, b, in_flight, budget, scale, full=options.get("checkpointing") == "full")
            extra_s *= model.cluster.correction("compute", model.submeshes[s])
            t, comp = t + extra_s, comp + extra_s
        out.append(StagePlan(
            index=k, layer_start=i, layer_end=j, submesh=tuple(model.submeshes[s]), device_ids=devices[k],
            logical_mesh=tuple(cfg.logical_shape), variant=cfg.variant,
            sharding=model.stage_sharding(i, j, base, scale),
            time_s=t, compute_s=comp, comm_s=t - comp, cross_stage_s=float(tables.cross_s[i, j, s, c]),
            update_s=float(tables.update_s[i, j, s, c]), persistent_bytes=pers, activation_bytes=act,
            in_flight=in_flight, memory_bytes=memory, recompute_layers=recompute))
    # the reported peak per device: the runtime's allocations simulated (the DP's rule decided feasibility)
    out = list(with_simulated_memory(graph, model.layers.layer_of, out, num_microbatches=b, schedule=schedule))
    slow = max(out, key=lambda st: (st.time_s, -st.index))
    total = tables.schedule.step_time([st.time_s for st in out], b)
    return ParallelPlan(
        stages=tuple(out), schedule=schedule, num_microbatches=b, num_layers=model.layers.num_layers,
        layer_of=dict(model.layers.layer_of), predicted_step_s=total, compute_s=b * slow.compute_s,
        communication_s=b * slow.comm_s, bubble_s=total - b * slow.time_s,
        peak_memory_bytes=max(st.memory_bytes for st in out), memory_budget_bytes=budget,
        cluster=model.cluster.to_dict(), cluster_description=model.cluster.describe(),
        graph_fingerprint=graph_fingerprint(graph), options=json.loads(json.dumps(options)))


def _choose_recompute(model, base, i, j, b, in_flight, budget, scale, *, full: bool):
    """For a stage on a recompute column: (layers to recompute, the time that saves
    against recomputing all (<= 0), persistent bytes, activation bytes per
    microbatch, peak bytes), ``checkpointing.choose_layers`` with the stage's real
    in-flight count (every layer when ``full``)."""
    lcs = [model.layer_cost(l, base, scale) for l in range(i, j + 1)]
    f = np.array([c.recompute_s for c in lcs]) / b
    a = np.array([c.activation_bytes for c in lcs]) / b
    kept = np.array([c.kept_bytes for c in lcs]) / b
    pers = float(model.range_costs(base, scale).persistent_bytes[i, j])
    chosen = tuple(range(len(lcs))) if full else choose_layers(f, a, kept, pers, in_flight, budget)
    saved, peak = saved_and_peak(a, kept, chosen)
    return (tuple(i + l for l in chosen), float(f[list(chosen)].sum() - f.sum()), pers + peak, saved,
            pers + in_flight * saved + peak)
