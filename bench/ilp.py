"""Benchmark the intra-op sharding ILP on whole GPT-3-shaped models as one stage.

Each model (GPT-3 paper shapes via ``alpa_torch.zoo.gpt_config``: 1.3B = 24 layers
x 2048, 6.7B = 32 x 4096, 39B = 48 x 8192; vocab 51200, fp32, AdamW) is built
on the ``meta`` device and its whole training step captured once with a small
batch (default 8 sequences x 1024 tokens: the ILP's size does not depend on the
batch, only its costs do). Then ``intra_ilp.stage.solve_stage`` plans it as a
single stage on each logical mesh of one simulated host of 8 A100-80GB
(``Cluster.simulated(1, 8, device='a100-80gb')``, NVLink on both axes): 1x8,
2x4, 8x1. No memory budget (a 39B model does not fit one host; this measures
the planner, not a plan).

One JSON line per (model, mesh): model, mesh, layers, hidden, batch, seq,
num_nodes (ILP nodes before reduction), num_tie_groups, num_vars and
num_constraints (of the Pyomo model HiGHS solves, after reductions),
build_s (strategies, costs, reshard matrices, tie detection, reductions and the
Pyomo model), solve_s (HiGHS, loading included), gap (relative MIP gap; 0 when
the LP relaxation was integral), objective_s (predicted step time of the plan:
compute + resharding), status, exploit_repetition; the first line of a model
also has capture_s.

Usage: python bench/ilp.py [--quick] [--models 1.3b,6.7b,39b] [--meshes 1x8,2x4,8x1]
                           [--batch 8] [--seq 1024] [--gap 0.01] [--no-repetition]
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from alpa_torch.capture import capture
from alpa_torch.core.cluster import Cluster
from alpa_torch.zoo import GPT, gpt_config, make_optimizer, train_step
from intra_ilp.cost_model import MeshCost
from intra_ilp.stage import build_stage_instance, solve_stage

MODELS = ("1.3b", "6.7b", "39b")
MESHES = ((1, 8), (2, 4), (8, 1))


def capture_gpt(name: str, batch: int, seq: int):
    """(OpGraph, config, seconds) of a GPT-3-shaped fp32 model's AdamW step, on meta."""
    cfg = gpt_config(name, block_size=seq)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(batch, seq, dtype=torch.long)  # [B, T] token ids (targets alike)
    graph = capture(train_step, model, make_optimizer("adamw", model), (idx, idx.clone()))
    return graph, cfg, time.perf_counter() - t0


def bench_case(graph, cfg, name: str, mesh_shape, args) -> dict:
    cluster = Cluster.simulated(1, 8, device="a100-80gb")
    mesh = MeshCost.from_cluster(cluster, (1, 8), mesh_shape)
    plan = solve_stage(graph, mesh, mip_gap=args.gap, time_limit_s=args.time_limit,
                       exploit_repetition=not args.no_repetition)
    instance, _ = build_stage_instance(graph, mesh, exploit_repetition=not args.no_repetition)
    return {
        "model": name, "mesh": f"{mesh_shape[0]}x{mesh_shape[1]}", "layers": cfg.n_layer,
        "hidden": cfg.n_embd, "batch": args.batch, "seq": args.seq, "num_nodes": len(instance.nodes),
        "num_tie_groups": len(instance.tie_groups), "num_vars": plan.num_vars,
        "num_constraints": plan.num_constraints, "build_s": round(plan.build_s, 3),
        "solve_s": round(plan.solve_s, 3), "gap": plan.gap, "objective_s": plan.total_s,
        "status": plan.solver_status, "exploit_repetition": not args.no_repetition,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only GPT 1.3B")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--meshes", default=",".join(f"{a}x{b}" for a, b in MESHES))
    ap.add_argument("--batch", type=int, default=8, help="sequences in the captured batch")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--gap", type=float, default=0.01, help="relative MIP gap")
    ap.add_argument("--time-limit", type=float, default=600.0, help="HiGHS time limit per case, s")
    ap.add_argument("--no-repetition", action="store_true", help="do not tie repeated layers")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    models = ["1.3b"] if args.quick else args.models.split(",")
    meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]
    for name in models:
        graph, cfg, capture_s = capture_gpt(name, args.batch, args.seq)
        for i, mesh_shape in enumerate(meshes):
            row = bench_case(graph, cfg, name, mesh_shape, args)
            if i == 0:
                row["capture_s"] = round(capture_s, 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
