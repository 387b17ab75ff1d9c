"""Plan GPT-3 1.3B ... 39B on simulated GPU clusters; one JSON line per (model, cluster).

Setup (Alpa OSDI'22 §8.1 GPT benchmark): sequence 1024, vocab 51200, global
batch 1024 sequences, AdamW. Each model is built on the ``meta`` device and
captured at the global batch (fake tensors: no memory); microbatch counts B
(powers of two dividing 1024) are priced by scaling the captured costs
(``stage_dp.search`` docstring). Layers = transformer blocks
(``boundaries_by_module='blocks'``; the embeddings join the first block, the
head the last). ``--dtype float16`` (default): the whole graph, optimizer
state included, is fp16 (no fp32 master weights, so memory is lower than
Alpa's mixed precision); ``--dtype float32 --precision fp16`` is Alpa's mixed
precision (fp32 master weights and AdamW state, fp16 compute under autocast,
loss scaling): 16 bytes of state per parameter, where activation checkpointing
becomes necessary (``recomputed_layers``).

Clusters: H hosts x 8 V100-16GB, NVLink2 inside a host, 25 Gbit/s Ethernet
between hosts (Alpa's testbed), or H x 8 A100-80GB over 200 Gbit/s InfiniBand.

Keys: model, hosts, devices_per_host, device, capture_s, plan_s (planning wall
time after capture: layers, ILPs, DP, plan assembly), plan_cpu_s (CPU time of
the same, planner worker processes included: on a shared machine wall time also
counts other people's work),
num_ilps, ilp_s,
predicted_step_s, peak_memory_gib, plan (summary; "ckpt a-b": layers a..b
recompute their forward in the backward), recomputed_layers (activation
checkpointing, ``stage_dp.checkpointing``: how many layers the plan recomputes;
0 when every stage fits without), recompute_by_stage, best_manual_step_s,
best_manual, manual_s; or error (+ required_gib) when nothing fits.

best_manual: a Megatron-style grid over pipeline degree pp (power of two,
<= layers, dividing the devices), the logical meshes (dp, tp) the search may
use on the (D/pp)-device submesh (fast and memory-lean ILP variants) and the
microbatch counts; layers split evenly (stage k = layers round(kL/pp) ..
round((k+1)L/pp) - 1). Each stage is priced from the same stage tables as
the search (per-layer ILPs: a manual plan fixes the degrees, the ILP still
picks each operator's sharding) with the same memory check. Every manual plan
lies in the search space, so auto <= manual as long as the DP is exact.

Usage: python bench/plan_gpt.py [--models 1.3b,2.6b] [--hosts 1,2,4,8]
                                [--devices v100,a100] [--dtype float16] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import resource
import sys
import time

import torch

from alpa_torch.capture import capture
from alpa_torch.core.cluster import Cluster, GiB
from alpa_torch.core.errors import InfeasibleMemoryError
from alpa_torch.zoo import GPT, gpt_config, make_optimizer, train_step
from stage_dp import assign_layers
from stage_dp.search import candidate_columns, plan
from stage_dp.stage_costs import StageCostModel
from stage_dp.tables import build_tables, microbatch_candidates, step_time

MODELS = ("1.3b", "2.6b", "6.7b", "15b", "39b")
DEVICES = {"v100": dict(device="v100-16gb", intra="nvlink2", inter="eth-25g"),
           "a100": dict(device="a100-80gb", intra="nvlink3", inter="ib-200g")}
GLOBAL_BATCH, SEQ = 1024, 1024


def capture_gpt(name: str, dtype: str, precision: str = "fp32"):
    with torch.device("meta"):
        model = GPT(gpt_config(name)).to(getattr(torch, dtype))
    opt = make_optimizer("adamw", model)
    tokens = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long, device="meta")
    return capture(train_step, model, opt, (tokens, tokens), precision=precision)


def best_manual(model: StageCostModel, candidates, budget, lean_all):
    """(step_s, description) of the best evenly split Megatron-style plan (docstring)."""
    num_layers, devices = model.layers.num_layers, model.cluster.num_devices
    scale = 1.0 / max(candidates)
    columns = candidate_columns(model, model.configs, budget, scale, lean_all=lean_all)
    sizes = [n * m for n, m in model.submeshes]
    best = (math.inf, None)
    for b in candidates:
        tables = build_tables(model, columns, b, budget, "1f1b", scale)
        pp = 1
        while pp <= min(num_layers, devices):
            if devices % pp == 0 and devices // pp in sizes:
                s = sizes.index(devices // pp)
                bounds = [round(k * num_layers / pp) for k in range(pp + 1)]
                for c, cfg in enumerate(columns[s]):
                    stages = [(bounds[k], bounds[k + 1] - 1, s, c) for k in range(pp)]
                    t = step_time(tables, stages)
                    if t < best[0]:
                        best = (t, {"pp": pp, "dp": cfg.logical_shape[0], "tp": cfg.logical_shape[1],
                                    "B": b, "submesh": list(model.submeshes[s]), "ilp": cfg.variant})
            pp *= 2
    return best


def _cpu_s() -> float:
    """CPU seconds of this process and of its finished children (the planner's workers)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def run_case(graph, name, hosts, device, capture_s, progress):
    cluster = Cluster.simulated(hosts, 8, **DEVICES[device])
    out = {"model": name, "hosts": hosts, "devices_per_host": 8, "device": cluster.device.name,
           "capture_s": round(capture_s, 2)}
    t0, c0 = time.perf_counter(), _cpu_s()
    layers = assign_layers(graph, boundaries_by_module="blocks")
    model = StageCostModel(graph, cluster, layers, progress=progress)
    try:
        p = plan(graph, cluster, cost_model=model, progress=progress)
    except InfeasibleMemoryError as exc:
        out.update(plan_s=round(time.perf_counter() - t0, 2), plan_cpu_s=round(_cpu_s() - c0, 2),
                   num_ilps=model.num_ilps, error=str(exc),
                   required_gib=round(exc.required_bytes / GiB, 3))
        return out
    out.update(plan_s=round(time.perf_counter() - t0, 2), plan_cpu_s=round(_cpu_s() - c0, 2),
               num_ilps=model.num_ilps, ilp_s=round(model.ilp_s, 2),
               num_layers=layers.num_layers, predicted_step_s=round(p.predicted_step_s, 4),
               peak_memory_gib=round(p.peak_memory_bytes / GiB, 3), plan=p.summary(),
               recomputed_layers=len(p.recompute_layers),
               recompute_by_stage=[len(st.recompute_layers) for st in p.stages])
    t1 = time.perf_counter()
    candidates = microbatch_candidates(graph, None)
    step, desc = best_manual(model, candidates, p.memory_budget_bytes, p.options["lean_all"])
    out.update(best_manual_step_s=round(step, 4) if math.isfinite(step) else None, best_manual=desc,
               manual_s=round(time.perf_counter() - t1, 2),
               auto_over_manual=round(p.predicted_step_s / step, 4) if math.isfinite(step) else None)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
    ap.add_argument("--hosts", default="1,2,4,8", help="comma list of host counts (8 devices each)")
    ap.add_argument("--devices", default="v100,a100", help="comma list of v100, a100")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                    help="mixed precision of the captured step (use with --dtype float32: fp32 master weights "
                         "and optimizer state, fp16/bf16 compute, as Alpa trains GPT)")
    ap.add_argument("--quick", action="store_true", help="1.3b on 1 and 2 V100 hosts only")
    ap.add_argument("--verbose", "-v", action="store_true", help="planner progress on stderr")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    models, hosts, devices = args.models.split(","), [int(h) for h in args.hosts.split(",")], args.devices.split(",")
    if args.quick:
        models, hosts, devices = ["1.3b"], [1, 2], ["v100"]
    t_start = time.perf_counter()

    def progress(msg):
        if args.verbose:
            print(f"[{time.perf_counter() - t_start:8.1f} s] {msg}", file=sys.stderr, flush=True)

    for name in models:
        t0 = time.perf_counter()
        graph = capture_gpt(name, args.dtype, args.precision)
        capture_s = time.perf_counter() - t0
        for device in devices:
            for h in hosts:
                print(json.dumps(run_case(graph, name, h, device, capture_s, progress)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
