"""Pipeline schedules measured: predicted bubble against measured, and against PyTorch's schedule.

Usage (from the repository root; about 6 minutes)::

    python bench/schedules.py                                   # gpipe, 1f1b, zb-h1 at 2, 4 and 8 microbatches
    python bench/schedules.py --schedules 1f1b --microbatches 4 --out docs/results/schedules_DATE.jsonl

The deep GPT of ``bench/vs_pytorch.py`` (8 blocks of width 128, T 64, batch 16, AdamW) on
``Cluster.local(1, 2)``, one core a device, as two pipeline stages of one device each, for
every schedule and microbatch count B:

- **alpa-torch**: ``parallelize(train_step, cluster, schedule=S, num_stages=2,
  num_microbatches=B, trace=True)``; the planner picks the cut and each stage's program.
  ``predicted_bubble``: the idle share of the plan's simulated step
  (``viz.predicted_timeline``: the schedule's programs at the cost model's stage times);
  ``measured_bubble``: the idle share of a measured step: per worker, the time outside its
  forwards, backwards and update in the last step's trace (``step.measured_trace``), over the
  median step ``step_ms``, the period at which steps follow each other. ``measured_bubble_span``
  takes the span of that step's events instead: it counts as idle the time a worker still
  spent on the step before (the runtime answers a step once the loss is known, so the next
  one starts while the first stage drains), which makes it the larger.
- **PyTorch**: ``torch.distributed.pipelining``'s schedule of the same name
  (``ScheduleGPipe``, ``Schedule1F1B``; for ZB-H1 ``ScheduleInterleavedZeroBubble``, the paper's
  ZB1P, with one stage a rank) over the same blocks split evenly
  (``_common.pipeline_rank``), gloo, one thread a rank; ``torch_step_ms``: its median step.

One JSON line per (schedule, B), then a summary line: the largest relative gap between
predicted and measured bubble, and ``alpa_over_torch`` per case (PyTorch's step over
alpa-torch's: above 1 is faster than PyTorch). Targets (issue: pipeline schedules as
objects): the predicted bubble within 15 % (relative) of the measured one; each schedule at
least as fast as PyTorch's of the same name.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

from _common import (
    BenchConfig,
    _pipeline_worker,
    _spawn,
    build_model,
    emit,
    global_batch,
    parse_measuring_args,
    select,
)
from _plans import machine_info
from vs_pytorch import DEEP

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
COMPUTE = ("forward", "backward", "weight", "update")


def measured_bubble(trace: dict, step_s: float | None = None) -> float:
    """Idle share of a measured step: 1 - (compute time of every worker) / (workers x the step's
    period): ``step_s`` (the median step the caller timed), else the span of the trace's events."""
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    start = min(e["ts"] for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans)
    rows = {(e["pid"], e["tid"]) for e in spans}
    busy = sum(e["dur"] for e in spans if e["cat"] in COMPUTE)
    period_us = end - start if step_s is None else 1e6 * step_s
    return 1.0 - busy / (len(rows) * period_us)


def run_alpa(schedule: str, cfg: BenchConfig) -> dict:
    from alpa_torch import Cluster, parallelize, viz
    from alpa_torch.zoo import make_optimizer, train_step

    model = build_model(cfg)
    opt = make_optimizer("adamw", model)
    step = parallelize(train_step, Cluster.local(1, 2), schedule=schedule, num_stages=2,
                       num_microbatches=cfg.microbatches, trace=True)
    times = []
    try:
        for i in range(cfg.steps):
            batch = global_batch(cfg, i)
            t0 = time.perf_counter()
            float(step(model, opt, batch))
            times.append(time.perf_counter() - t0)
        step.sync(model, opt)  # the last step's backward and update are done, so its trace is whole
        median_s = statistics.median(times[cfg.warmup_steps:])
        trace = step.measured_trace()
        plan = step.plan
        predicted = viz.predicted_timeline(plan).idle_fraction
    finally:
        step.shutdown()
    return {"step_ms": round(1e3 * median_s, 2), "predicted_bubble": round(predicted, 4),
            "measured_bubble": round(measured_bubble(trace, median_s), 4),
            "measured_bubble_span": round(measured_bubble(trace), 4),
            "predicted_step_ms": round(1e3 * plan.predicted_step_s, 2), "plan": plan.summary(),
            "layers_per_stage": [s.layer_end - s.layer_start + 1 for s in plan.stages]}


def run_torch(schedule: str, cfg: BenchConfig) -> dict:
    out = _spawn(functools.partial(_pipeline_worker, schedule=schedule), 2, cfg)
    return {"torch_step_ms": round(1e3 * out["step_s"], 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma list of {SCHEDULES}")
    ap.add_argument("--microbatches", default="2,4,8", help="comma list of microbatch counts")
    ap.add_argument("--steps", type=int, default=6, help="timed steps (after 2 untimed)")
    ap.add_argument("--out", metavar="FILE", help="also append the JSON lines to FILE")
    args = parse_measuring_args(ap, argv)
    machine = machine_info()
    rows = []
    for schedule in select(ap, args.schedules, SCHEDULES, "schedule"):
        for b in (int(x) for x in args.microbatches.split(",")):
            cfg = BenchConfig(**DEEP, microbatches=b, timed_steps=args.steps)
            row = {"bench": "schedules", "schedule": schedule, "microbatches": b, "model": cfg.describe(),
                   "cluster": "1x2", **run_alpa(schedule, cfg), **run_torch(schedule, cfg)}
            row["bubble_gap"] = round(abs(row["predicted_bubble"] - row["measured_bubble"])
                                      / max(row["measured_bubble"], 1e-9), 4)
            row["alpa_over_torch"] = round(row["torch_step_ms"] / row["step_ms"], 3)
            rows.append(row)
            emit(row, args.out)
    emit({"bench": "schedules", "summary": True, **machine, "argv": sys.argv[1:] if argv is None else argv,
          "max_bubble_gap": max(r["bubble_gap"] for r in rows),
          "alpa_over_torch": {f"{r['schedule']}@{r['microbatches']}": r["alpa_over_torch"] for r in rows},
          "target": "bubble gap <= 0.15, alpa_over_torch >= 1.0",
          "met": all(r["bubble_gap"] <= 0.15 and r["alpa_over_torch"] >= 1.0 for r in rows)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
