"""Diagnostic: the kernels of ``parallelize``'s compiled program against ``torch.compile``'s, one device.

Usage (from the repository root; about 4 minutes)::

    python bench/kernel_profile.py                        # the GPT of one_device.py at T = 1024
    python bench/kernel_profile.py --workload llama --length 256 --out /tmp/kernels.jsonl

The step of ``bench/one_device.py`` (``--workload``, ``--length``; batch 2, AdamW, float32,
the torch threads one device of ``Cluster.local(1, 1)`` gets) runs in two fresh processes:
``parallelize(train_step, Cluster.local(1, 1), compile=True)`` (compiling forced: a
diagnostic, not the default) and ``torch.compile(train_step)``. Each runs ``--warmup`` untimed
steps, ``--steps`` timed ones, then ``--profiled`` more under ``torch.profiler``; for
``parallelize`` the profiler is entered in the worker's thread that runs the step program,
and the worker's idle time between steps is measured too (``bench/step_gap.py``'s timer).

One JSON line per system: the median step, and per operator the self CPU milliseconds and the
calls a step (the ``--top`` most costly). A summary line gives ``parallelize / compile`` per
operator both ran. Operators both call (flash attention, ``mm``, ``addmm``) tell whether the
same kernels run slower in one; the rest (Inductor's ``Call CompiledFxGraph`` kernels, copies)
where the two programs differ.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _common import emit
from _plans import machine_info


def _profile_table(prof, steps: int, top: int) -> dict:
    """Per operator: self CPU ms and calls a step, the ``top`` most costly."""
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return {e.key: {"self_ms": round(e.self_cpu_time_total / 1e3 / steps, 3), "calls": round(e.count / steps, 2)}
            for e in rows}


def _profile_steps(state: dict, steps: int, top: int) -> bool:
    """Worker: profile the next ``steps`` calls of this rank's step program, in the thread that
    runs them, and time the idle gaps between them; the result lands in ``state``."""
    from torch.profiler import ProfilerActivity, profile

    program = state["program"]
    inner, box = program.step, {"calls": [], "prof": None}

    def profiled(*args):
        if not box["calls"]:
            box["prof"] = profile(activities=[ProfilerActivity.CPU])
            box["prof"].__enter__()
        start = time.time()
        try:
            return inner(*args)
        finally:
            box["calls"].append((start, time.time()))
            if len(box["calls"]) == steps:
                box["prof"].__exit__(None, None, None)
                box["table"] = _profile_table(box["prof"], steps, top)
                program.step = inner

    program.step, state["kernel_profile"] = profiled, box
    return True


def _profiled(state: dict) -> dict:
    box = state["kernel_profile"]
    gaps = [b[0] - a[1] for a, b in zip(box["calls"], box["calls"][1:])]
    return {"operators": box["table"], "worker_idle_ms": round(1e3 * statistics.median(gaps), 2)}


def worker(system: str, args) -> dict:
    """One system in this process (``--worker``): its JSON line."""
    import torch
    from one_device import _build, _threads
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(_threads())
    workload, length = args.workload, args.length
    model, batch, step_fn = _build(workload, length, "cpu", torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if system == "compile":
        step = torch.compile(step_fn)
    else:
        from alpa_torch import Cluster, parallelize

        step = parallelize(step_fn, Cluster.local(1, 1), compile=True)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        float(step(model, optimizer, batch))
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    row = {"bench": "kernel_profile", "system": system, "workload": workload, "seq_len": length,
           "step_median_ms": round(1e3 * statistics.median(times), 2), "profiled_steps": args.profiled}
    if system == "compile":
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profiled):
                float(step(model, optimizer, batch))
        row["operators"] = _profile_table(prof, args.profiled, args.top)
    else:
        step.group.call_all(_profile_steps, args.profiled, args.top)
        for _ in range(args.profiled + 1):  # the last call waits for the profiled ones
            float(step(model, optimizer, batch))
        row.update(step.group.call_all(_profiled)[0])
        step.shutdown()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="gpt", choices=("gpt", "llama"))
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--profiled", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", metavar="FILE", help="also append the JSON lines to FILE")
    ap.add_argument("--worker", metavar="SYSTEM", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args)), flush=True)
        return 0
    info = {**machine_info(), "argv": list(sys.argv[1:] if argv is None else argv)}
    rows = {}
    for system in ("parallelize_compiled", "compile"):
        cmd = [sys.executable, __file__, "--worker", system, "--workload", args.workload, "--length",
               str(args.length), "--warmup", str(args.warmup), "--steps", str(args.steps), "--profiled",
               str(args.profiled), "--top", str(args.top)]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"bench": "kernel_profile", "system": system,
                                                     "error": done.stderr[-1500:]}
        rows[system] = row = {**row, **info}
        emit(row, args.out)
    par, comp = (rows[s].get("operators", {}) for s in ("parallelize_compiled", "compile"))
    emit({"bench": "kernel_profile", "summary": True, "workload": args.workload, "seq_len": args.length,
          "step_parallelize_over_compile": _ratio(rows["parallelize_compiled"], rows["compile"], "step_median_ms"),
          "self_ms_parallelize_over_compile": {k: round(par[k]["self_ms"] / comp[k]["self_ms"], 3)
                                               for k in par if k in comp and comp[k]["self_ms"] > 0},
          **info}, args.out)
    return 0


def _ratio(a: dict, b: dict, key: str) -> float | None:
    return round(a[key] / b[key], 3) if key in a and key in b else None


if __name__ == "__main__":
    sys.exit(main())
