"""Pictures of a plan: the cluster coloured by stage and the predicted pipeline timeline.

Owns three things, all drawn with matplotlib's object API on the Agg canvas (no
pyplot, no global figure state, no display needed):

- ``predicted_timeline(plan)``: the cost model's step as a ``alpa_torch.core.schedule``
  simulation. Each stage's per-microbatch time ``t_k`` (``StagePlan.time_s``) is
  split into its parts: the optimizer update (``update_s`` per step, drawn once at
  the end), the cross-stage transfer ``x_k`` (``cross_stage_s``: activations in and
  gradients out, so one direction is ``x_k / 2``) and forward + backward
  ``fb_k = t_k - x_k - update_s / B``, split by the schedule (``PipelineSchedule.costs``:
  1/3 forward and 2/3 backward, as a backward computes two matmuls per forward matmul, dX
  and dW; a split backward's two parts 1/3 each). ``simulate`` takes
  one transfer time for every boundary, so the mean of ``x_k / 2`` over the
  stages that receive is used. The simulated makespan is not Alpa eq. 2's T: eq. 2
  charges each transfer inside its stage's time, the simulation on the critical
  path; both are shown.
- ``plan_figure(plan, path)``: the hosts × devices grid coloured by stage (with
  each device's logical-mesh coordinate) above that timeline, one row per device
  (per stage when there are more than 16 devices), idle time hatched as bubbles.
- Chrome / Perfetto traces: ``trace_from_timeline`` writes the predicted timeline
  as ``traceEvents`` (ph 'X', microseconds; pid = stage, tid = device);
  ``timeline_from_trace`` draws any such trace (rows = (pid, tid), named by the 'M'
  metadata events when present); ``compare_traces`` draws a predicted and a
  measured trace one above the other on one time axis; ``trace_from_events`` makes the
  measured one from what the workers recorded (``runtime/timeline.py``,
  ``parallelize(..., trace=True)`` and ``step.measured_trace()``).

What it does not own: the plan, the schedule or the simulation (``alpa_torch.core.schedule``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from alpa_torch.core.errors import require_extra
from alpa_torch.core.plan import ParallelPlan, _ranges

MAX_DEVICE_ROWS = 16
ROW_TID = 100_000
"""A measured event with a ``row`` (a bucket's all-reduce: ``runtime/timeline.py``) goes to a row of
its own under its device: tid = (the row's index + 1) x ROW_TID + rank."""
_CMAP = "tab10"


# ------------------------------------------------------------------ the predicted timeline
def stage_times(plan: ParallelPlan) -> dict[str, list[float] | float]:
    """Per-stage simulate() inputs from the plan (module docstring): fwd_s, bwd_s, weight_s, update_s,
    comm_s."""
    from alpa_torch.core.schedule import schedule_named

    b = plan.num_microbatches
    fb = [max(s.time_s - s.cross_stage_s - s.update_s / b, 0.0) for s in plan.stages]
    receiving = [s.cross_stage_s / 2 for s in plan.stages[1:]]
    return {**schedule_named(plan.schedule).costs(fb, len(plan.stages), b),
            "update_s": [s.update_s for s in plan.stages],
            "comm_s": sum(receiving) / len(receiving) if receiving else 0.0}


def predicted_timeline(plan: ParallelPlan):
    """``alpa_torch.core.schedule.simulate`` of the plan's schedule with the cost model's times."""
    from alpa_torch.core.schedule import schedule_named, simulate

    programs = schedule_named(plan.schedule).programs(len(plan.stages), plan.num_microbatches)
    return simulate(programs, **stage_times(plan))


# ------------------------------------------------------------------ traces
def trace_from_timeline(timeline, plan: ParallelPlan | None = None, per_device: bool = True) -> dict:
    """A Chrome/Perfetto trace (dict) of a simulated ``Timeline``: compute events only
    (F, B, W, U); one row (tid) per device of each stage (pid), or one per stage with
    ``per_device=False`` or without a plan."""
    from alpa_torch.core.schedule import BACKWARD, FORWARD, UPDATE, WEIGHT

    cats = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight", UPDATE: "update"}
    events: list[dict] = []
    for k, stage_events in enumerate(timeline.events):
        devices = plan.stages[k].device_ids if plan is not None else (k,)
        where = f"devices {_ranges(devices)}" if plan is not None else f"stage {k}"
        events.append(_name_event("process", k, _stage_name(k, devices) if plan else f"stage {k}"))
        rows = {d: f"device {d}" for d in devices} if per_device and plan is not None else {devices[0]: where}
        for d, row in rows.items():
            events.append(_name_event("thread", k, row, tid=d))
            for e in stage_events:
                kind = e.instruction.kind
                if kind not in cats:
                    continue
                mb = e.instruction.microbatch
                events.append({"ph": "X", "name": kind.value + ("" if mb is None else str(mb)), "cat": cats[kind],
                               "pid": k, "tid": d, "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6,
                               "args": {"stage": k, "microbatch": mb}})
    return _trace(events, "alpa-torch cost model (predicted)", timeline.makespan_s)


def predicted_trace(plan: ParallelPlan) -> dict:
    """The cost model's step of ``plan`` as a trace: ``trace_from_timeline(predicted_timeline(plan), plan)``."""
    return trace_from_timeline(predicted_timeline(plan), plan)


def trace_from_events(per_rank, plan: ParallelPlan | None = None) -> dict:
    """A Chrome/Perfetto trace of what the workers recorded in a step (``runtime/timeline.py``;
    ``ParallelStep.measured_trace``): ``per_rank`` is (stage, rank, events) per worker, as
    ``Engine.events`` gives it. One row (tid) per device (rank) of each stage (pid), as in
    ``trace_from_timeline``, and below it one per ``row`` its events name (``ROW_TID``); times
    from the first event of any worker."""
    start = min((e[2] for _, _, events in per_rank for e in events), default=0)
    end = max((e[3] for _, _, events in per_rank for e in events), default=start)
    out: list[dict] = []
    for k in sorted({stage for stage, _, _ in per_rank}):
        ranks = [rank for stage, rank, _ in per_rank if stage == k]
        devices = plan.stages[k].device_ids if plan is not None and k < len(plan.stages) else ranks
        out.append(_name_event("process", k, _stage_name(k, devices)))
    for k, rank, events in per_rank:
        out.append(_name_event("thread", k, f"device {rank}", tid=rank))
        rows = sorted({d["row"] for *_, d in events if "row" in d})
        tids = {row: (i + 1) * ROW_TID + rank for i, row in enumerate(rows)}
        out += [_name_event("thread", k, f"device {rank} {row}", tid=tids[row]) for row in rows]
        for name, cat, t0, t1, details in events:
            out.append({"ph": "X", "name": name, "cat": cat, "pid": k, "tid": tids.get(details.get("row"), rank),
                        "ts": (t0 - start) / 1e3, "dur": (t1 - t0) / 1e3, "args": {"stage": k, **details}})
    return _trace(out, "alpa-torch runtime (measured)", (end - start) / 1e9)


def _stage_name(k: int, devices) -> str:
    return f"stage {k} (devices {_ranges(devices)})"


def _name_event(kind: str, pid, name: str, tid=None) -> dict:
    """A metadata event naming a process (``kind`` 'process': a stage) or a thread ('thread': a row)."""
    out = {"ph": "M", "name": f"{kind}_name", "pid": pid}
    if tid is not None:
        out["tid"] = tid
    return {**out, "args": {"name": name}}


def _trace(events: list[dict], source: str, makespan_s: float) -> dict:
    """A Chrome/Perfetto trace dict of ``events``, times in microseconds, shown in ms."""
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"source": source, "makespan_s": makespan_s}}


def write_trace(trace: dict, path: str | os.PathLike[str]) -> None:
    Path(path).write_text(json.dumps(trace) + "\n")


def load_trace(trace: Any) -> dict:
    """A trace dict from a dict, a JSON string or a path; a bare event list is wrapped."""
    if isinstance(trace, (str, os.PathLike)) and not str(trace).lstrip().startswith(("{", "[")):
        trace = Path(trace).read_text()
    if isinstance(trace, str):
        trace = json.loads(trace)
    if isinstance(trace, list):
        trace = {"traceEvents": trace}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("not a Chrome trace: expected a JSON object with a 'traceEvents' list "
                         "(or a list of events)")
    return trace


def _rows(trace: dict) -> tuple[list[tuple], dict[tuple, str], list[dict]]:
    """Sorted (pid, tid) rows, their labels and the 'X' events of ``trace``."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    proc = {e.get("pid"): e["args"]["name"] for e in trace["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "process_name" and "args" in e}
    thread = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in trace["traceEvents"]
              if e.get("ph") == "M" and e.get("name") == "thread_name" and "args" in e}
    rows = sorted({(e.get("pid", 0), e.get("tid", 0)) for e in events}, key=lambda r: (str(r[0]), str(r[1])))
    rows = sorted(rows, key=lambda r: (_num(r[0]), _num(r[1])))
    labels = {r: f"{proc.get(r[0], f'pid {r[0]}').split(' (')[0]} / {thread.get(r, f'tid {r[1]}')}" for r in rows}
    return rows, labels, events


def _num(x) -> tuple:
    return (0, x) if isinstance(x, (int, float)) else (1, str(x))


# ------------------------------------------------------------------ drawing
def _colour(cmap, index: int, kind: str):
    """Stage colour; forward lighter, backward full, anything else grey."""
    from matplotlib.colors import to_rgb

    if kind in ("update", "U"):
        return (0.55, 0.55, 0.55)
    r, g, b = to_rgb(cmap(index % cmap.N))
    if kind in ("forward", "F"):
        return (r + (1 - r) * 0.45, g + (1 - g) * 0.45, b + (1 - b) * 0.45)
    return (r, g, b)


def draw_trace(ax, trace: dict, title: str | None = None, x_max_ms: float | None = None) -> float:
    """Draw ``trace`` on ``ax`` (rows top to bottom, ms from its first event); returns its span in ms."""
    from matplotlib import colormaps

    cmap = colormaps[_CMAP]
    rows, labels, events = _rows(trace)
    t0 = min((float(e.get("ts", 0)) for e in events), default=0.0)
    span = max((float(e.get("ts", 0)) + float(e.get("dur", 0)) - t0 for e in events), default=0.0) / 1e3
    index = {r: n for n, r in enumerate(rows)}
    width = x_max_ms or span or 1.0
    for _r, y in index.items():  # idle time shows through as hatched bubble
        ax.barh(y, width, left=0, height=0.8, color="white", edgecolor="0.85", hatch="////", linewidth=0)
    for e in events:
        y = index[(e.get("pid", 0), e.get("tid", 0))]
        start, dur = (float(e.get("ts", 0)) - t0) / 1e3, float(e.get("dur", 0)) / 1e3
        name = str(e.get("name", ""))
        kind = e.get("cat") or name[:1]
        stage = e.get("args", {}).get("stage", e.get("pid", 0))
        colour = _colour(cmap, stage if isinstance(stage, int) else hash(stage) % 10, kind)
        ax.barh(y, dur, left=start, height=0.8, color=colour, edgecolor="black", linewidth=0.4)
        if dur > 0.03 * width:
            ax.text(start + dur / 2, y, name, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [labels[r] for r in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, width)
    ax.set_xlabel("time (ms)")
    if title:
        ax.set_title(title, fontsize=9)
    return span


def draw_grid(ax, plan: ParallelPlan) -> None:
    """The hosts × devices grid: each device coloured by its stage, with its logical-mesh coordinate."""
    from matplotlib import colormaps
    from matplotlib.patches import Patch

    cmap = colormaps[_CMAP]
    hosts, per_host = plan.cluster["num_hosts"], plan.cluster["devices_per_host"]
    for s in plan.stages:
        _, cols = s.logical_mesh
        for pos, d in enumerate(s.device_ids):
            h, i = divmod(d, per_host)
            ax.add_patch(_rect(i, h, cmap(s.index % cmap.N)))
            if per_host <= 16:
                ax.text(i + 0.5, h + 0.5, f"S{s.index}\nd{d} ({pos // cols},{pos % cols})", ha="center",
                        va="center", fontsize=7)
    ax.set_xlim(0, per_host)
    ax.set_ylim(hosts, 0)
    ax.set_xticks([i + 0.5 for i in range(per_host)], [str(i) for i in range(per_host)], fontsize=7)
    ax.set_yticks([h + 0.5 for h in range(hosts)], [f"host {h}" for h in range(hosts)], fontsize=7)
    ax.set_xlabel("device of host")
    ax.set_aspect("auto")
    handles = [Patch(color=cmap(s.index % cmap.N), label=f"stage {s.index}: layers {s.layer_start}-{s.layer_end}, "
                     f"mesh {s.logical_mesh[0]}x{s.logical_mesh[1]}") for s in plan.stages]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    ax.set_title(f"{plan.cluster_description.split(';')[0]}: stage of each device (logical-mesh coordinate)",
                 fontsize=9)


def _rect(x, y, colour):
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.04, y + 0.06), 0.92, 0.88, facecolor=colour, edgecolor="black", linewidth=0.6)


def _predicted_trace_rows(plan: ParallelPlan, timeline) -> dict:
    """The predicted trace with one row per device, or per stage above MAX_DEVICE_ROWS devices."""
    return trace_from_timeline(timeline, plan, per_device=sum(s.num_devices for s in plan.stages) <= MAX_DEVICE_ROWS)


def plan_figure(plan: ParallelPlan, path: str | os.PathLike[str] | None = None):
    """Grid above predicted timeline; saved as PNG to ``path`` if given. Returns the Figure."""
    require_extra("matplotlib", "plot", "drawing a plan (--png, viz.plan_figure)")
    from matplotlib.figure import Figure

    timeline = predicted_timeline(plan)
    trace = _predicted_trace_rows(plan, timeline)
    n_rows = len(_rows(trace)[0])
    grid_h = 0.45 * plan.cluster["num_hosts"] + 1.0
    fig = Figure(figsize=(11, grid_h + 0.3 * n_rows + 2.0), layout="constrained")
    top, bottom = fig.subplots(2, 1, height_ratios=[grid_h, 0.3 * n_rows + 1.2])
    draw_grid(top, plan)
    b = plan.num_microbatches
    draw_trace(bottom, trace, title=(
        f"predicted {plan.schedule} timeline, {b} microbatch(es): simulated {timeline.makespan_s * 1e3:.3f} ms "
        f"(Alpa eq. 2: {plan.predicted_step_s * 1e3:.3f} ms), idle {timeline.idle_fraction:.0%}\n"
        "F = forward (1/3 of a stage's time), B = backward (2/3), U = update; hatched = bubble"))
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def timeline_from_trace(trace: Any, path: str | os.PathLike[str] | None = None, title: str | None = None):
    """Draw a Chrome/Perfetto trace (dict, JSON text or file; 'X' events) as a timeline PNG."""
    require_extra("matplotlib", "plot", "drawing a trace (viz.timeline_from_trace)")
    from matplotlib.figure import Figure

    trace = load_trace(trace)
    n_rows = max(len(_rows(trace)[0]), 1)
    fig = Figure(figsize=(11, 0.3 * n_rows + 1.6), layout="constrained")
    draw_trace(fig.subplots(), trace, title=title or trace.get("otherData", {}).get("source"))
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def compare_traces(predicted: Any, measured: Any, path: str | os.PathLike[str] | None = None):
    """Predicted above measured, on one time axis (ms from each trace's first event)."""
    require_extra("matplotlib", "plot", "drawing a trace (viz.compare_traces)")
    from matplotlib.figure import Figure

    traces = [load_trace(predicted), load_trace(measured)]
    spans = [max((float(e.get("ts", 0)) + float(e.get("dur", 0)) for e in t["traceEvents"] if e.get("ph") == "X"),
                 default=0.0) - min((float(e.get("ts", 0)) for e in t["traceEvents"] if e.get("ph") == "X"),
                                    default=0.0) for t in traces]
    heights = [0.3 * max(len(_rows(t)[0]), 1) + 1.0 for t in traces]
    fig = Figure(figsize=(11, sum(heights) + 0.6), layout="constrained")
    axes = fig.subplots(2, 1, height_ratios=heights, sharex=True)
    for ax, t, what, span in zip(axes, traces, ("predicted", "measured"), spans):
        draw_trace(ax, t, title=f"{what}: {span / 1e3:.3f} ms", x_max_ms=max(spans) / 1e3 or None)
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
