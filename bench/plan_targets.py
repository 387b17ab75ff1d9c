"""Planning time at real scale, measured as a user runs it: ``alpa-torch plan`` in a new process.

The three cases of issue #16's planning-time targets, each one ``alpa-torch plan`` command
(capture included: the interpreter's start, imports, building the model on the meta
device, capture, planning, printing), wall clock and CPU (the command and its planner
worker processes), on this machine as it is:

- ``llama3-8b-one-stage``: LLaMA-3-8B (``alpa_torch.zoo_hf``, the published config, bf16
  mixed precision, AdamW, HF's step with labels) at sequence 8192 x batch 16 on 8x8
  H100-80GB as one stage (``--no-pipeline``). Target 20 s.
- ``gpt-39b``: Alpa's GPT-3 39B (seq 1024, batch 1024) on 8x8 V100-16GB, NVLink2 inside a
  host, 25 Gbit/s Ethernet between hosts, full search, ``--no-alternatives``. Target 60 s.
- ``llama3-70b``: LLaMA-3-70B at its published setting (``PublishedModel``) on 16x8
  H100-80GB, full search with pipelining. Target 120 s.

``--attention math`` is a diagnostic for before/after comparisons in one hour: the same
commands with ``scaled_dot_product_attention`` captured as eager's math path (matmul,
softmax, matmul: the capture before attention stayed fused), by replacing
``alpa_torch.tracing.math_reason`` in the planning process; the line says ``"attention":
"math"``.

One JSON line per case: case, command, wall_s, cpu_s, capture_s (the CLI's own log line),
target_s, met, the plan's summary line, exit code, and ``_plans.machine_info()`` taken
before the run (date, cores, load averages, torch, the code's commit). Run it on a quiet
machine: the planner uses two processes.

Usage: python bench/plan_targets.py [--cases llama3-8b-one-stage,gpt-39b,llama3-70b] [--attention math]
[--out FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time

from _common import emit, select
from _plans import machine_info

HF = ["alpa_torch.zoo_hf:hf_published", "--precision", "bf16"]
CASES = {
    "llama3-8b-one-stage": (20.0, [*HF, "--model-arg", "name=llama3-8b", "--model-arg", "seq_len=8192",
                                   "--model-arg", "batch_size=16", "--cluster", "8x8", "--device", "h100-80gb",
                                   "--no-pipeline"]),
    "gpt-39b": (60.0, ["gpt-39b", "--cluster", "8x8", "--device", "v100-16gb", "--intra", "nvlink2", "--inter",
                       "eth-25g", "--no-alternatives"]),
    "llama3-70b": (120.0, [*HF, "--model-arg", "name=llama3-70b", "--cluster", "16x8", "--device", "h100-80gb"]),
}
"""case -> (target seconds, ``alpa-torch plan`` arguments)."""
_CAPTURED = re.compile(r"captured OpGraph\(.*\) in ([0-9.]+) s")


_MATH_ATTENTION = ("import sys, alpa_torch.tracing as t; t.math_reason = lambda *a, **k: 'bench/plan_targets.py "
                   "--attention math (a diagnostic)'; from alpa_torch.cli import main; sys.exit(main(sys.argv[1:]))")


def run_case(name: str, attention: str = "fused") -> dict:
    target, args = CASES[name]
    entry = ["-c", _MATH_ATTENTION] if attention == "math" else ["-m", "alpa_torch.cli"]
    command = [sys.executable, *entry, "plan", *args, "--verbose"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    machine = machine_info()
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    captured = _CAPTURED.search(done.stderr)
    summary = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    row = {"case": name, "command": "alpa-torch plan " + " ".join(args), "wall_s": round(wall, 1),
           "cpu_s": round(cpu, 1), "capture_s": float(captured[1]) if captured else None, "target_s": target,
           "met": done.returncode == 0 and wall <= target, "plan": summary[0] if summary else None,
           "returncode": done.returncode, **({"attention": "math"} if attention == "math" else {}), **machine}
    if done.returncode:
        row["stderr_tail"] = done.stderr[-2000:]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {list(CASES)}")
    ap.add_argument("--attention", choices=("fused", "math"), default="fused",
                    help="math: a diagnostic, attention captured as matmul and softmax (module docstring)")
    ap.add_argument("--out", metavar="FILE", help="also append the JSON lines to FILE")
    args = ap.parse_args(argv)
    for name in select(ap, args.cases, CASES, "case"):
        emit(run_case(name, args.attention), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
