"""Why this plan: time and memory per stage, the binding constraint, the runner-ups.

Owns the explanation of a ``ParallelPlan`` (``explain(plan) -> str``), the
runner-up plans (``alternatives``) and the planning entry the CLI uses
(``stage_dp.planner.make_plan_with_model``: planning with its ``StageCostModel`` kept, so
the runner-ups reuse every ILP solution). It does not search anything new: the
runner-ups are the same stage DP (``stage_dp.tables.run_dp``) on the same priced
stage tables (``build_tables``), re-run with forced options.

Per stage k of a plan with B microbatches and step time T (the schedule's
``PipelineSchedule.step_time``: Alpa eq. 2 for GPipe and 1F1B), per step:

    compute_k = B · compute_s      comm_k = B · comm_s   (of which B · cross_stage_s
    bubble_k  = T - B · t_k                              crosses to other stages)

so compute_k + comm_k + bubble_k = T on every stage: the bubble is the time stage
k waits for the others (fill and drain of the pipeline, and waiting on slower
stages). Memory per device: persistent + in_flight × activation (``StagePlan``).

Runner-ups (``alternatives``), what the DP compared or could have been forced to:

1. the best plan at each microbatch count B the search tried (it keeps the best B);
2. the best plan with the stage count forced to K, for K in 1, 2, 4, ... (and the
   chosen K ± 1), at every B: K = 1 is ``pipeline=False``;

(1 and 2 also when the plan's own B or K were forced: every B dividing the batch,
unless BatchNorm pins B = 1; nothing but K = 1 when the plan has ``pipeline=False``);
3. the best plan with no memory limit (budget = inf, plain 'fast' ILPs): if it is
   faster than the chosen plan, memory is the binding constraint, else time is.

A runner-up with a stage on a memory-lean column whose ILPs the search never needed
is priced as the search priced it, by lower bounds (``stage_dp.stage_costs``), and
says so (``lower_bound``; '>=' in the table): solving those ILPs for runner-ups
alone doubled LLaMA-3-70B's planning.

Plans recorded by the CLI carry these in ``plan.options['alternatives']``; for a
plan without them, ``explain`` falls back to a heuristic for the binding
constraint (memory if a stage needed a memory-lean ILP variant or the peak is
within 5 % of the budget) and says so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re

from alpa_torch.core.cluster import GiB
from alpa_torch.core.plan import ParallelPlan, _ranges, text_table

from .tune import report

log = logging.getLogger(__name__)
_MS = 1e3
MEMORY_TIGHT = 0.95
"""Peak / budget above which the heuristic calls memory binding."""


# ------------------------------------------------------------------ runner-ups
def alternatives(model, plan: ParallelPlan) -> list[dict]:
    """Runner-up plans (module docstring, 1-3), each a JSON-ready dict, fastest first."""
    from stage_dp.search import candidate_columns
    from stage_dp.tables import build_tables

    opts = plan.options
    budget, schedule = plan.memory_budget_bytes, plan.schedule
    scale = 1.0 / max(opts.get("microbatch_candidates") or [plan.num_microbatches])
    candidates = _microbatch_counts(model.graph, plan)
    devices = model.cluster.num_devices
    pipeline = opts.get("pipeline", True)
    forced = opts.get("num_stages")
    sub_idx = model.submeshes.index(tuple(opts["submesh"])) if opts.get("submesh") else None
    counts = [None] if not pipeline else [None] + _stage_counts(len(plan.stages), model, devices)
    # lean ILPs the search left unsolved stay so: a runner-up on them is a lower bound
    columns = candidate_columns(model, model.configs, budget, scale, lean_all=bool(opts.get("lean_all")), lazy=True)
    free_columns = candidate_columns(model, model.configs, math.inf, scale, lean_all=False)
    seen, out = set(), []
    for b in candidates:
        tables = build_tables(model, columns, b, budget, schedule, scale)
        for k in counts:
            label = (f"{k} stage(s) forced, B={b}" if k else f"{forced} stage(s) as planned, B={b}" if forced
                     else f"best at B={b}")
            _add(out, seen, tables, devices, k or forced, pipeline, sub_idx, label=label, budget=budget,
                 bounds=(model, scale))
        free = build_tables(model, free_columns, b, math.inf, schedule, scale)
        _add(out, seen, free, devices, forced, pipeline, sub_idx, label=f"no memory limit, B={b}",
             budget=budget, unlimited=True)
    out.sort(key=lambda a: (a["predicted_step_s"], a["num_stages"], a["label"]))
    return out


def _microbatch_counts(graph, plan: ParallelPlan) -> list[int]:
    """Every B the search could try (also when the plan's B was forced); 1 only when the step couples
    its batch (BatchNorm, a pooled statistic used nonlinearly: ``coupling``)."""
    from stage_dp.coupling import batch_coupling
    from stage_dp.tables import microbatch_candidates

    return [1] if batch_coupling(graph) is not None else microbatch_candidates(graph, None)


def _stage_counts(chosen: int, model, devices: int) -> list[int]:
    top = min(devices, model.layers.num_layers)
    ks = {1, chosen - 1, chosen + 1} | {2**i for i in range(1, top.bit_length())}
    return sorted(k for k in ks if 1 <= k <= top)


def _add(out, seen, tables, devices, num_stages, pipeline, sub_idx, *, label, budget, unlimited=False,
         bounds=None):
    """The DP's best plan on ``tables`` under the forced options, described, into ``out`` unless
    seen; ``bounds`` = (cost model, activation scale) where ``tables`` has bound columns."""
    from stage_dp.dp import NoFeasiblePlanError
    from stage_dp.search import bound_layers
    from stage_dp.tables import run_dp, step_time

    try:
        res = run_dp(tables, devices, num_stages=num_stages, max_stages=None if pipeline else 1,
                     submesh_index=sub_idx)
    except NoFeasiblePlanError as exc:
        log.debug("%s: no plan (%s)", label, exc)
        return
    key = (tables.num_microbatches, res.stages, unlimited)
    if key in seen:
        return
    seen.add(key)
    lower = bounds is not None and bool(bound_layers(bounds[0], tables, res.stages, bounds[1]))
    out.append(describe_stages(tables, res.stages, step_time(tables, res.stages), label=label, budget=budget,
                               unlimited=unlimited, lower_bound=lower))


def describe_stages(tables, stages, total_s: float, *, label: str, budget: float, unlimited: bool,
                    lower_bound: bool = False) -> dict:
    """A runner-up as data: summary, time parts (the schedule's step time) and peak memory per device;
    ``lower_bound``: a stage is priced by bounds (a lean column whose ILPs the search did not
    solve, ``stage_dp.search.bound_layers``), its time and memory are then at least these."""
    b, k_total = tables.num_microbatches, len(stages)
    parts, peak, slow = [], 0.0, (-1.0, 0.0, 0.0)
    for k, (i, j, s, c) in enumerate(stages):
        cfg = tables.columns[s][c]
        in_flight = tables.schedule.in_flight(k_total - 1 - k, b)
        peak = max(peak, float(tables.persistent_bytes[i, j, s, c] + in_flight * tables.activation_bytes[i, j, s, c]))
        t, comp = float(tables.cost_s[i, j, s, c]), float(tables.compute_s[i, j, s, c])
        slow = max(slow, (t, comp, t - comp))
        variant = "" if cfg.variant == "fast" else f"[{cfg.variant}]"
        parts.append(f"L{i}-{j}@{cfg.submesh[0]}x{cfg.submesh[1]}/{cfg.logical_shape[0]}x{cfg.logical_shape[1]}"
                     f"{variant}")
    t_max, comp, comm = slow
    return {"label": label, "summary": f"B={b} " + " | ".join(parts), "num_microbatches": b,
            "num_stages": k_total, "predicted_step_s": float(total_s), "compute_s": b * comp,
            "communication_s": b * comm, "bubble_s": float(total_s) - b * t_max, "peak_memory_bytes": peak,
            "fits": bool(peak <= budget), "memory_unlimited": unlimited, "lower_bound": lower_bound}


def with_alternatives(plan: ParallelPlan, alts: list[dict], **extra) -> ParallelPlan:
    """A copy of ``plan`` whose ``options`` also hold the runner-ups (and ``extra`` facts)."""
    return dataclasses.replace(plan, options={**plan.options, "alternatives": alts, **extra})


# ------------------------------------------------------------------ the explanation
def stage_breakdown(plan: ParallelPlan) -> list[dict]:
    """Per stage, per step: compute, communication, cross-stage, bubble (module docstring)."""
    b, total = plan.num_microbatches, plan.predicted_step_s
    return [{"stage": s.index, "compute_s": b * s.compute_s, "comm_s": b * s.comm_s,
             "cross_stage_s": b * s.cross_stage_s, "bubble_s": total - b * s.time_s,
             "headroom_bytes": plan.memory_budget_bytes - s.memory_bytes} for s in plan.stages]


def binding_constraint(plan: ParallelPlan) -> tuple[str, str]:
    """('memory' | 'time', why) from the recorded no-memory-limit runner-up, else the heuristic."""
    alts = plan.options.get("alternatives")
    free = [a for a in alts or () if a.get("memory_unlimited")]
    if free:
        best = min(free, key=lambda a: a["predicted_step_s"])
        if best["predicted_step_s"] < plan.predicted_step_s * (1 - 1e-6) and not best["fits"]:
            gain = 1 - best["predicted_step_s"] / plan.predicted_step_s
            return "memory", (f"without a memory limit the plan {best['summary']} would take "
                              f"{best['predicted_step_s'] * _MS:.3f} ms ({gain:.1%} faster) but needs "
                              f"{best['peak_memory_bytes'] / GiB:.2f} GiB per device, over the "
                              f"{plan.memory_budget_bytes / GiB:.2f} GiB budget")
        pace = ("the slowest stage sets the pace (B x t_max) and the pipeline fill/drain adds the bubble"
                if len(plan.stages) > 1 else "the stage's compute and communication are the step")
        return "time", f"no faster plan exists even with unlimited memory: {pace}"
    lean = [s.index for s in plan.stages if s.variant != "fast"]
    ratio = plan.peak_memory_bytes / plan.memory_budget_bytes
    if lean or ratio > MEMORY_TIGHT or plan.options.get("lean_all"):
        why = f"stages {lean} use memory-lean ILP variants" if lean else f"the peak is {ratio:.0%} of the budget"
        return "memory", why + " (heuristic: this plan records no runner-ups; re-plan with the CLI to check)"
    return "time", (f"every stage uses its fastest sharding and the peak is {ratio:.0%} of the budget "
                    "(heuristic: this plan records no runner-ups)")


def explain(plan: ParallelPlan, top: int = 8) -> str:
    """The text report of ``alpa-torch explain``."""
    b, total = plan.num_microbatches, plan.predicted_step_s
    lines = [f"Plan: {plan.summary()}  ({len(plan.stages)} stage(s), {b} microbatch(es), {plan.schedule})",
             f"Cluster: {plan.cluster_description}",
             f"Predicted step: {total * _MS:.3f} ms = compute {plan.compute_s * _MS:.3f} + comm "
             f"{plan.communication_s * _MS:.3f} + bubble {plan.bubble_s * _MS:.3f} (slowest stage, {plan.schedule}'s "
             "step time)",
             "", "Time per stage and step (compute + comm + bubble = step time on every stage):"]
    head = ("stage", "devices", "mesh", "compute ms", "comm ms", "(cross-stage)", "bubble ms", "busy")
    rows = [head]
    for s, part in zip(plan.stages, stage_breakdown(plan)):
        busy = 1 - part["bubble_s"] / total if total > 0 else 1.0
        rows.append((str(s.index), _ranges(s.device_ids), f"{s.logical_mesh[0]}x{s.logical_mesh[1]}",
                     f"{part['compute_s'] * _MS:.3f}", f"{part['comm_s'] * _MS:.3f}",
                     f"({part['cross_stage_s'] * _MS:.3f})", f"{part['bubble_s'] * _MS:.3f}", f"{busy:.0%}"))
    lines += _table(rows)
    lines += ["", f"Memory per device (budget {plan.memory_budget_bytes / GiB:.3f} GiB):"]
    rows = [("stage", "devices", "persistent GiB", "activations GiB", "in flight", "peak GiB", "headroom GiB")]
    for s in plan.stages:
        head_b = plan.memory_budget_bytes - s.memory_bytes
        rows.append((str(s.index), _ranges(s.device_ids), f"{s.persistent_bytes / GiB:.3f}",
                     f"{s.activation_bytes / GiB:.3f}", str(s.in_flight), f"{s.memory_bytes / GiB:.3f}",
                     f"{head_b / GiB:.3f} ({head_b / plan.memory_budget_bytes:.0%})"))
    lines += _table(rows)
    kind, why = binding_constraint(plan)
    slow = max(plan.stages, key=lambda s: (s.time_s, -s.index))
    lines += ["", f"Binding constraint: {kind.upper()}: {why}.",
              f"Slowest stage: {slow.index} (t = {slow.time_s * _MS:.3f} ms per microbatch: compute "
              f"{slow.compute_s * _MS:.3f}, comm {slow.comm_s * _MS:.3f}); "
              f"it is {'communication' if slow.comm_s > slow.compute_s else 'compute'}-bound."]
    lines += ["", *_runner_ups(plan, top)]
    if plan.options.get("tuning"):  # measured plan selection kept this plan
        lines += ["", report(plan.options["tuning"])]
    if plan.cluster.get("cost_correction"):
        lines += ["", "Priced with measured cost corrections (measured / predicted, per kind of cost and submesh; "
                  f"alpa_torch.calibration): {plan.cluster['cost_correction']}"]
    stats = {k: plan.options[k] for k in ("plan_s", "num_ilps", "ilp_s", "dp_tmax_evaluated", "layering")
             if k in plan.options}
    if stats:
        lines += ["", "Planner: " + ", ".join(f"{k} {v}" for k, v in stats.items())]
    return "\n".join(lines)


def distinct_runner_ups(plan: ParallelPlan) -> list[dict]:
    """The recorded runner-ups, one per stage layout (the layout at its best B; one that fits the
    budget before one that does not), the chosen layout left out, fastest first."""
    chosen = _layout(plan.summary())
    best: dict[str, dict] = {}
    for a in plan.options.get("alternatives") or ():
        layout = _layout(a["summary"])
        rank = (not a["fits"], a["predicted_step_s"], a["peak_memory_bytes"])
        if layout != chosen and (layout not in best or rank < _rank(best[layout])):
            best[layout] = a
    return sorted(best.values(), key=lambda a: (a["predicted_step_s"], not a["fits"], a["num_stages"]))


def _layout(summary: str) -> str:
    """'B=4 L0-3@1x2/2x1[lean] | ...' -> 'L0-3@1x2/2x1 | ...' (the stages, not B or the ILP variant)."""
    return re.sub(r"\[\w+\]", "", summary.split(" ", 1)[1] if " " in summary else summary)


def _rank(a: dict) -> tuple:
    return (not a["fits"], a["predicted_step_s"], a["peak_memory_bytes"])


def _runner_ups(plan: ParallelPlan, top: int) -> list[str]:
    if plan.options.get("alternatives") is None:
        return ["Runner-ups: none recorded in this plan. `alpa-torch explain PLAN --model MODEL` (or "
                "`alpa-torch plan`) re-plans the model and adds them."]
    others = distinct_runner_ups(plan)
    if not others:
        return ["Runner-ups: none: every other option the DP was given led to this same stage layout."]
    lines = [f"Runner-ups (other stage layouts the stage DP found: best per microbatch count B, per forced "
             f"stage count, and without a memory limit; {len(others)} distinct, {min(top, len(others))} shown):"]
    rows = [("#", "step ms", "vs chosen", "peak GiB", "fits", "found as", "plan")]
    for n, a in enumerate(others[:top], 1):
        at_least = ">=" if a.get("lower_bound") else ""
        rows.append((str(n), f"{at_least}{a['predicted_step_s'] * _MS:.3f}",
                     f"{at_least}{a['predicted_step_s'] / plan.predicted_step_s - 1:+.1%}"
                     if plan.predicted_step_s else "-",
                     f"{at_least}{a['peak_memory_bytes'] / GiB:.3f}",
                     ("yes" if a["fits"] else "NO") if not at_least else "yes?" if a["fits"] else "NO", a["label"],
                     a["summary"]))
    note = ["  >=: a lower bound (a stage on a memory-lean ILP variant the search did not need to solve: "
            "its time and memory are at least these, and it may not fit)"]
    return lines + _table(rows) + (note if any(a.get("lower_bound") for a in others[:top]) else [])


def _table(rows) -> list[str]:
    return text_table(rows, indent="  ")
