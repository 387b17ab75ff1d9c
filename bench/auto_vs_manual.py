"""The automatic plan against every manual plan family, measured on local CPU workers.

Usage (from the repository root; about 10 minutes on a 2-core machine)::

    python bench/auto_vs_manual.py                      # 4 cases: {2x2, 1x4} x {deep, wide}
    python bench/auto_vs_manual.py --cases 2x2_deep --pairs 2 --timed-steps 7

Cases: ``Cluster.local(2, 2)`` and ``Cluster.local(1, 4)`` (4 virtual CPU
devices, one process and one torch thread each, gloo), each profiled once
(``profile_cluster``, cached under ``/tmp/alpa_torch_bench``; ``--reprofile``),
times two GPT shapes (``alpa_torch.zoo.GPT``, AdamW, vocab 1024, T 64, batch 16):

- ``deep``: 8 layers, 4 heads, d 128 (narrow: many small operators);
- ``wide``: 2 layers, 8 heads, d 512 (few large matmuls, 8x the parameters per layer).

Plans, all run by the same runtime on the same workers:

- ``auto``: what ``parallelize(train_step, cluster=<profiled>)`` plans
  (``ParallelStep.make_plan``, plan cache off): the search, no option forced;
  ``auto_mb2``: the same search without the microbatch counts that leave one
  sample per microbatch (the captured step changes at batch 1 and
  ``parallelize`` refuses such a plan when it deploys it: a planner gap this
  variant works around; reported separately, never as ``auto``);
- single-stage manual families on all 4 devices (``_plans.family_force`` +
  ``intra_ilp.stage.solve_stage(force=...)`` + ``runtime.engine.Engine``, as
  ``tests/test_runtime.py``), on the 1D mesh of the cluster ((4, 1) on 2x2,
  (1, 4) on 1x4): ``dp`` (batch split, state replicated), ``zero1`` (optimizer
  state split), ``zero3`` (parameters and optimizer state split), ``tp``
  (Megatron: batch replicated, qkv / fc1 / lm_head by output, proj / fc2 by
  input), and ``dp_tp`` on the (2, 2) mesh (batch on axis 0, Megatron on axis 1);
  the ILP places every value not forced;
- pipelines through planner options (layers = transformer blocks, the planner
  picks the split and each stage's mesh): ``pp2`` (``num_stages=2``, B = 4,
  1F1B), ``pp2_dp`` (``num_stages=2, sharding=False``: DP2 x PP2), ``pp4``
  (``num_stages=4``, B = 4; needs >= 4 blocks).

Protocol: per cluster one set of 4 workers for all its cases (a plan is
deployed, measured, replaced). Screening: every plan once (``--screen-warmup``
then ``--screen-steps`` steps, median driver wall time per step), to pick the
best manual plan. Then the final pairs: that plan and ``auto`` measured back to
back ``--pairs`` times (order alternating; ``--warmup-steps`` then
``--timed-steps`` each), the median per plan; throughput = global batch / step
time (samples/s). ``loss_diff``: max |loss - eager single-device loss| over the
screened steps (every plan must train the same). ``same_plan``: the auto plan
is the best manual one (their ratio then only shows the measurement noise).

One JSON line per case: case, cluster, model, auto_plan, auto_predicted_step_s,
auto_throughput (null when the auto plan cannot run: ``auto_error``),
best_manual, best_manual_throughput, ratio (auto / best manual; 0 when auto
failed), met (ratio >= 0.95), auto_mb2_plan / auto_mb2_throughput / ratio_mb2,
final_runs, predicted_best_manual (the manual plan the cost model ranks first),
screened (per plan: samples_s, step_s, predicted_step_s, plan, loss_diff or
error). Last line: the summary.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

from _common import BenchConfig, eager_reference, global_batch, parse_measuring_args, select
from _plans import (
    Planner,
    cluster_summary,
    dumps,
    machine_info,
    plan_deployer,
    profiled_cluster,
    run_on_workers,
    sharding_deployer,
    workload,
)

log = logging.getLogger("auto_vs_manual")

TARGET = 0.95
CLUSTERS = {"2x2": (2, 2), "1x4": (1, 4)}
MODELS = {
    "deep": dict(vocab_size=1024, block_size=64, n_layer=8, n_head=4, n_embd=128, global_batch=16),
    "wide": dict(vocab_size=1024, block_size=64, n_layer=2, n_head=8, n_embd=512, global_batch=16),
}
CASES = tuple(f"{c}_{m}" for c in CLUSTERS for m in MODELS)


def manual_plans(shape: tuple[int, int]) -> dict[str, tuple]:
    """name -> (Planner kind, spec) of every manual plan on a ``shape`` cluster."""
    sub = shape
    line = (4, 1) if shape[0] > 1 else (1, 4)
    plans = {fam: ("family", (fam, sub, line)) for fam in ("dp", "zero1", "zero3", "tp")}
    plans["dp_tp"] = ("family", ("dp_tp", sub, (2, 2)))
    plans["pp2"] = ("search", dict(num_stages=2, num_microbatches=4))
    plans["pp2_dp"] = ("search", dict(num_stages=2, num_microbatches=4, sharding=False))
    plans["pp4"] = ("search", dict(num_stages=4, num_microbatches=4))
    return plans


def auto_plan(wl, cluster):
    """The plan ``parallelize(train_step, cluster=cluster)`` would run (no cache, no forced option)."""
    from alpa_torch.api import ParallelStep
    from alpa_torch.core.plan import graph_fingerprint
    from alpa_torch.zoo import train_step

    step = ParallelStep(train_step, cluster, plan_cache=False)
    plan = step.make_plan(wl.model, wl.optimizer, global_batch(wl.cfg, 0))
    assert plan.graph_fingerprint == graph_fingerprint(wl.graph), "auto plan made for another graph"
    return plan


def _describe(plan) -> tuple[str, float]:
    if hasattr(plan, "stages"):
        return plan.summary(), plan.predicted_step_s
    specs = {str(v) for v in plan.value_specs.values()}
    return f"B=1 one stage on {plan.mesh_shape}, specs {sorted(specs)[:6]}", plan.total_s


def measure(plan, wl, cluster, group, eager, warmup: int, timed: int) -> dict:
    deploy = plan_deployer(plan, wl, cluster) if hasattr(plan, "stages") else sharding_deployer(wl, plan)
    res = run_on_workers(cluster, deploy, wl, warmup=warmup, timed=timed, group=group)
    return {"step_s": res["step_s"], "samples_s": wl.cfg.global_batch / res["step_s"],
            "loss_diff": max(abs(a - e) for a, e in zip(res["losses"], eager["losses"]))}


def make_plans(wl, cluster, shape_name: str) -> tuple[dict, dict]:
    """(plans by name, screened entries of the plans that failed to plan)."""
    planner = Planner(wl.graph, cluster)
    plans, failed = {"auto": auto_plan(wl, cluster), "auto_mb2": planner.auto(min_microbatch=2)}, {}
    for name, (kind, spec) in manual_plans(CLUSTERS[shape_name]).items():
        try:
            plans[name] = planner.plan(kind, spec)
        except Exception as exc:  # noqa: BLE001 - e.g. pp4 on a 2-block model
            failed[name] = {"error": f"planning: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return plans, failed


def screen(case: str, plans: dict, screened: dict, run) -> None:
    """Measure every plan once (``run(plan, screening=True)``) into ``screened``."""
    for name, plan in plans.items():
        summary, pred = _describe(plan)
        if name == "auto_mb2" and screened.get("auto", {}).get("plan") == summary:
            screened[name] = dict(screened["auto"], same_as="auto")  # the same plan: not measured twice
            continue
        try:
            m = run(plan, screening=True)
        except Exception as exc:  # noqa: BLE001
            screened[name] = {"plan": summary, "error": f"running: {type(exc).__name__}: {str(exc)[:200]}"}
            continue
        screened[name] = {"samples_s": round(m["samples_s"], 2), "step_s": round(m["step_s"], 4),
                          "predicted_step_s": round(pred, 5), "plan": summary, "loss_diff": m["loss_diff"]}
        log.info("%s %s: %.2f samples/s (predicted step %.4f s)", case, name, m["samples_s"], pred)


def final_pairs(best: str, screened: dict, plans: dict, pairs: int, run) -> dict[str, list[float]]:
    """samples/s of the best manual plan and the auto plan(s), back to back, order alternating."""
    autos = [n for n in ("auto", "auto_mb2") if "samples_s" in screened.get(n, {})]
    if len(autos) == 2 and screened["auto_mb2"].get("same_as") == "auto":
        autos = ["auto"]  # the same plan: measure it once
    final = {name: [] for name in [best] + autos}
    for k in range(pairs):
        for name in ([best] + autos if k % 2 == 0 else autos + [best]):
            final[name].append(run(plans[name], screening=False)["samples_s"])
    return final


def run_case(case: str, cluster, group, args) -> dict:
    shape_name, model_name = case.split("_")
    steps = max(args.warmup_steps + args.timed_steps, args.screen_warmup + args.screen_steps)
    cfg = BenchConfig(**MODELS[model_name], warmup_steps=0, timed_steps=steps)  # eager: every step's loss
    t0 = time.perf_counter()
    eager = eager_reference(cfg)
    wl = workload(cfg)

    def run(plan, screening: bool) -> dict:
        warmup, timed = (args.screen_warmup, args.screen_steps) if screening else (args.warmup_steps,
                                                                                   args.timed_steps)
        return measure(plan, wl, cluster, group, eager, warmup, timed)

    plans, screened = make_plans(wl, cluster, shape_name)
    screen(case, plans, screened, run)
    ok = {n: s for n, s in screened.items() if "samples_s" in s and not n.startswith("auto")}
    best = max(ok, key=lambda n: ok[n]["samples_s"])
    final = final_pairs(best, screened, plans, args.pairs, run)
    best_tp = statistics.median(final[best])
    auto_tp = statistics.median(final["auto"]) if "auto" in final else None
    mb2_tp = statistics.median(final["auto_mb2"]) if "auto_mb2" in final else auto_tp
    out = {"case": case, "cluster": f"local {shape_name}", "model": cfg.describe(),
           "auto_plan": screened["auto"].get("plan"), "auto_predicted_step_s": screened["auto"].get("predicted_step_s"),
           "auto_throughput": None if auto_tp is None else round(auto_tp, 2),
           "best_manual": best, "best_manual_plan": ok[best]["plan"], "best_manual_throughput": round(best_tp, 2),
           "ratio": round((auto_tp or 0.0) / best_tp, 3), "met": (auto_tp or 0.0) >= TARGET * best_tp,
           "auto_mb2_plan": screened.get("auto_mb2", {}).get("plan"),
           "auto_mb2_throughput": None if mb2_tp is None else round(mb2_tp, 2),
           "ratio_mb2": round((mb2_tp or 0.0) / best_tp, 3),
           "same_plan": screened["auto"].get("plan") == ok[best]["plan"],
           "final_runs": {k: [round(x, 2) for x in v] for k, v in final.items()},
           "predicted_best_manual": min((s["predicted_step_s"], n) for n, s in ok.items())[1],
           "screened": screened, "case_s": round(time.perf_counter() - t0, 1)}
    if "error" in screened["auto"]:
        out["auto_error"] = screened["auto"]["error"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--screen-warmup", type=int, default=1, help="warm-up steps of a screening run")
    ap.add_argument("--screen-steps", type=int, default=3, help="timed steps of a screening run")
    ap.add_argument("--warmup-steps", type=int, default=2, help="warm-up steps of a final run")
    ap.add_argument("--timed-steps", type=int, default=5, help="timed steps of a final run")
    ap.add_argument("--pairs", type=int, default=2, help="back-to-back (best manual, auto) final measurements")
    ap.add_argument("--reprofile", action="store_true")
    args = parse_measuring_args(ap, argv)
    cases = select(ap, args.cases, CASES, "case")
    from alpa_torch.core.cluster import Cluster
    from runtime.group import WorkerGroup
    from runtime.ray_env import ensure_ray, stop_ray

    t0 = time.perf_counter()
    lines, calib = [], {}
    started = ensure_ray(Cluster.local(1, 4))
    try:
        for shape_name, shape in CLUSTERS.items():
            mine = [c for c in cases if c.startswith(shape_name + "_")]
            if not mine:
                continue
            cluster, _ = profiled_cluster(*shape, reprofile=args.reprofile)
            calib[shape_name] = cluster_summary(cluster)
            with WorkerGroup.start(cluster) as group:
                for case in mine:
                    line = run_case(case, cluster, group, args)
                    print(dumps(line), flush=True)
                    lines.append(line)
    finally:
        if started:
            stop_ray()
    print(dumps({"summary": True, "target": f"auto_throughput >= {TARGET} x best_manual_throughput in every case",
                 "ratios": {ln["case"]: ln["ratio"] for ln in lines}, "met": {ln["case"]: ln["met"] for ln in lines},
                 "ratios_mb2": {ln["case"]: ln["ratio_mb2"] for ln in lines},
                 "all_met": all(ln["met"] for ln in lines), "clusters": calib, "machine": machine_info(),
                 "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
