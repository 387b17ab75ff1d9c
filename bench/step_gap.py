"""Diagnostic: the driver's round trip between two steps, with the workers' early answers on and off.

Usage (from the repository root; about two minutes)::

    python bench/step_gap.py                       # the deep GPT of vs_pytorch.py on Cluster.local(1, 1)
    python bench/step_gap.py --workload deep_1x2 --rounds 3

``parallelize(train_step, cluster, tune=False)`` (the planner's own plan, no measured selection,
so both modes run the same plan) on a ``vs_pytorch.py`` workload's GPT, ``--steps`` timed steps
after 3 untimed ones, once with ``ALPA_TORCH_EARLY_ANSWER=1`` (the default: a step returns its
loss when the forward has it, ``runtime/worker.py``) and once with ``=0`` (it returns when every
worker has finished its update), alternating for ``--rounds`` rounds, a new worker group each.
The workers' step program is wrapped with a wall-clock timer for the timed steps. One JSON line
per run: the median step as the driver sees it, and per worker the median time busy in the step
and idle between the end of one step and the start of the next (the round trip the early answer
hides), and the worker process's CPU time per step. A summary line gives each mode's median.

Where each worker has a core to itself and to spare (a GPU host's CPU, ``Cluster.local(1, 1)``
on 2 cores) the idle time is what a step loses; where the workers already fill every core
(``deep_1x2`` on 2 cores), the round trip's work competes with the step for CPU either way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _common import BenchConfig, build_model, global_batch
from _plans import dumps, machine_info
from vs_pytorch import WORKLOADS

from alpa_torch.zoo import make_optimizer


def _time_steps(state: dict) -> bool:
    """Worker: wrap this rank's step program with a wall-clock timer (idempotent)."""
    program = state["program"]
    if "step_times" not in state:
        inner, times = program.step, []

        def timed(*args):
            start = time.time()
            try:
                return inner(*args)
            finally:
                times.append((start, time.time()))

        program.step, state["step_times"] = timed, times
    state["step_times"].clear()
    return True


def _usage(state: dict) -> tuple[list, float]:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return state.get("step_times", []), r.ru_utime + r.ru_stime


def run(workload: str, cluster_text: str | None, steps: int, early: bool) -> dict:
    from alpa_torch import Cluster, parallelize
    from alpa_torch.zoo import train_step

    wl = WORKLOADS[workload]
    hosts, devices = map(int, cluster_text.split("x")) if cluster_text else (wl.hosts, wl.devices)
    os.environ["ALPA_TORCH_EARLY_ANSWER"] = "1" if early else "0"
    cfg = BenchConfig(**wl.model, warmup_steps=3, timed_steps=steps)
    model = build_model(cfg)
    opt = make_optimizer("adamw", model)
    step = parallelize(train_step, Cluster.local(hosts, devices), tune=False)
    try:
        for i in range(cfg.warmup_steps):
            float(step(model, opt, global_batch(cfg, i)))
        step.group.call_all(_time_steps)
        cpu0 = [c for _, c in step.group.call_all(_usage)]
        driver = []
        for i in range(cfg.warmup_steps, cfg.steps):
            batch = global_batch(cfg, i)
            t0 = time.perf_counter()
            float(step(model, opt, batch))
            driver.append(time.perf_counter() - t0)
        usage = step.group.call_all(_usage)  # waits for the last step's rest
        plan = step.plan.summary()
    finally:
        step.shutdown()
    ms = lambda xs: round(statistics.median(xs) * 1e3, 2)  # noqa: E731
    workers = [{"busy_ms": ms([e - s for s, e in times]),
                "idle_between_steps_ms": ms([b[0] - a[1] for a, b in zip(times, times[1:])]),
                "cpu_ms_per_step": round((cpu - c0) / steps * 1e3, 1)}
               for (times, cpu), c0 in zip(usage, cpu0)]
    return {"workload": workload, "cluster": f"{hosts}x{devices}", "early_answer": early, "plan": plan,
            "step_ms": ms(driver), "workers": workers}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="deep_1x2", choices=[w for w, v in WORKLOADS.items() if v.memory_mb is None])
    ap.add_argument("--cluster", default="1x1", help="HOSTSxDEVICES (default 1x1; '' for the workload's own)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    print(dumps({"start": True, "argv": sys.argv[1:], **machine_info()}), flush=True)
    lines = []
    for r in range(args.rounds):
        for early in (True, False):
            line = {"round": r, **run(args.workload, args.cluster or None, args.steps, early)}
            lines.append(line)
            print(dumps(line), flush=True)
    summary = {}
    for mode, on in (("early_answer", True), ("answer_at_end", False)):
        runs = [ln for ln in lines if ln["early_answer"] == on]
        summary[mode] = {"step_ms": statistics.median(ln["step_ms"] for ln in runs),
                         "idle_between_steps_ms": statistics.median(
                             w["idle_between_steps_ms"] for ln in runs for w in ln["workers"])}
    print(dumps({"summary": summary, **machine_info()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
