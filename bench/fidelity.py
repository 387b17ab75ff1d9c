"""Cost-model fidelity: the planner's predictions against measured steps on a profiled local cluster.

Usage (from the repository root; 8-15 minutes on a shared 2-core machine, depending on its load)::

    python bench/fidelity.py                    # GPT vocab 4096, T 128, 4 layers, d 256, batch 16 on local 2x2
    python bench/fidelity.py --model small      # GPT vocab 1024, T 64, 4 layers, d 128, batch 8 (quicker)
    python bench/fidelity.py --model tiny --plans mesh_4x1,pp2_b1   # ~30 k parameters: the runtime's fixed memory
    python bench/fidelity.py --plans auto,mesh_4x1,pp2_b4_1f1b --timed-steps 7
    python bench/fidelity.py --reprofile        # measure the cluster again instead of the cached JSON
    python bench/fidelity.py --cluster 1x2      # 2 devices on the 2 cores: the same test without oversubscription
    python bench/fidelity.py --fit-calibration /tmp/cal_2x2.json        # run, and fit corrections from its steps
    python bench/fidelity.py --calibration /tmp/cal_2x2.json            # then: after one measured calibration

``profile_cluster(Cluster.local(2, 2))`` is measured once (matmul FLOP/s, memory
bandwidth, per-collective alpha/beta on the intra- and inter-"host" groups) and
cached as ``/tmp/alpa_torch_bench/cluster_local_2x2.json``. Every plan below is
priced with that calibrated cluster by the planner itself
(``stage_dp.search.plan`` with forced options, or ``_plans.forced_plan``
for a given stage list, which prices it from the same stage tables), then run
on 4 fresh Ray workers (one process and one torch thread per virtual device,
gloo) through the same deployment ``parallelize`` uses (``_plans.plan_deployer``).
Layers of every plan but ``auto*`` are the transformer blocks
(``assign_layers(graph, boundaries_by_module='blocks')``): the embeddings join
block 0, the head block 3.

Plans (``--plans``, comma-separated; default all):

- ``auto``: the plan ``parallelize`` makes (default layering, no forced
  option); ``auto_mb2``: the same search without the microbatch counts that
  leave one sample per microbatch (the step's graph changes at batch 1, so
  ``parallelize`` refuses to run such a plan: a planner bug this works around);
- ``mesh_4x1``, ``mesh_2x2``: one stage on all 4 devices on that logical mesh
  ('fast' ILP, the ILP decides every operator), B = 1 (a 1x4 mesh is 4x1 with
  the axes swapped: the planner leaves it out);
- ``tp_4x1``, ``zero3_4x1``: one stage on the 4x1 mesh with forced shardings
  (``_plans.family_force``: Megatron tensor parallelism with the batch
  replicated; ZeRO-3 with parameters and optimizer state split by dim 0),
  the ILP placing the rest (``intra_ilp.stage.solve_stage(force=...)``); the
  prediction is that ILP's own (compute + collectives + resharding; memory: the
  simulated peak, ``stage_dp.memory_sim``), deployed as ``tests/test_runtime.py`` does;
- ``dp_replicated``: ``pipeline=False, sharding=False`` (data parallel, state replicated);
- ``pp2_b1``, ``pp2_b2_1f1b``, ``pp2_b4_1f1b``, ``pp2_b4_gpipe``: ``num_stages=2``
  (the planner picks the split and the meshes), B microbatches, schedule;
- ``pp2_dp_b4``: ``num_stages=2, sharding=False`` (DP2 x PP2), B = 4;
- ``pp4_b4_1f1b``, ``pp4_b4_gpipe``, ``pp4_b8_1f1b``: ``num_stages=4`` (one device per stage);
- ``submesh_1x2_b2``: ``submesh=(1, 2)`` (every stage on two devices), B = 2.

Each plan prints one JSON line: ``plan``, ``summary`` (layers@submesh/mesh),
``predicted`` (step_s = compute_s + communication_s + bubble_s as the plan
states them, peak_memory_mb, and per stage: time / compute / comm /
cross-stage seconds per microbatch, update seconds per step, memory,
persistent and activation MB, in-flight microbatches, operators), ``measured``
(step_s: median driver wall time of ``--timed-steps`` steps after
``--warmup-steps``; per worker ``model_mb`` = peak RSS minus the RSS once the
plan is deployed and before the state is loaded, ``_plans.py`` has the exact
protocol; ``breakdown``: per worker, seconds per step in DTensor
redistributions, gradient buckets, pipeline sends and receives (a receive
includes waiting for the other stage) and the rest, ``ops_s``, over
``--breakdown-steps`` extra instrumented steps, timers from
``bench/runtime_vs_torch.py``), ``rel_err_time``, ``rel_err_mem`` (predicted
peak per device against the largest worker's ``model_mb``), ``rel_err_mem_live``
(the same against the largest worker's ``live_mb``, the live heap's peak: the
runtime's values without the allocator's kept pages), ``loss_diff`` (max
over steps against single-device eager training: the plan ran correctly),
``diagnosis`` (``diagnose``: implied fixed cost per operator, measured cost per
collective), ``misses`` (``misses``: per stage and kind of cost, compute / update /
transfer, the seconds measured in one step the runtime recorded, ``--trace-steps``,
against the plan's figure, ``alpa_torch.calibration.observe``; the summary's
``misses_by_kind`` has the median ratio per kind).

Calibration (``alpa_torch.calibration``, #20 item 4): ``--fit-calibration FILE`` writes the
corrections per kind of cost and submesh that the run's recorded steps give (the medians of
the raw ratios of every plan's ``misses``); ``--calibration FILE`` plans every plan of a
later run with them (``Cluster.cost_correction``: the stage DP scales each stage's figures;
a forced sharding's step scales by the whole cluster's 'compute' factor). The later run
measures its steps anew, so its score is out of the sample the corrections came from.
A plan that fails to plan or run prints ``error`` and is left out of the statistics.

``predicted`` also carries a what-if that is NOT the planner's prediction:
``device_s`` (the devices' summed busy seconds per step, from the plan's stage
times) and ``capacity_step_s = max(step_s, device_s / cores)``: on
``Cluster.local`` the "devices" are processes sharing this machine's cores, so
a step cannot beat its total work over the cores; the summary's
``what_if_capacity`` gives its Spearman and error next to the planner's. A second
what-if, ``fill_drain_step_s`` (``fill_drain``; summary ``what_if_fill_drain``): Alpa's
eq. 2 with the pipeline's fill and drain priced at the rate of the devices running
then (a stage alone on a host gets the cores the others leave).

The LAST line: ``spearman`` (rank correlation of predicted and measured step
times), ``median_rel_err_time``, ``median_rel_err_mem`` (fractions), the
targets (>= 0.9, <= 0.20, <= 0.15) and whether each is met, the median
measured / predicted ratios (the bias), the calibration and the machine's load.

What this file does not own: the helpers (``bench/_plans.py``), the PyTorch
baselines (``bench/_common.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path

from _common import BenchConfig, eager_reference, error_text, parse_measuring_args, select
from _plans import (
    Planner,
    cluster_summary,
    dumps,
    machine_info,
    plan_deployer,
    profiled_cluster,
    rel_err,
    run_on_workers,
    sharding_deployer,
    spearman,
    stage_op_counts,
    workload,
)

from alpa_torch import calibration

log = logging.getLogger("fidelity")

TARGETS = {"spearman": 0.9, "median_rel_err_time": 0.20, "median_rel_err_mem": 0.15}
MODELS = {
    "full": dict(vocab_size=4096, block_size=128, n_layer=4, n_head=4, n_embd=256, global_batch=16),
    "small": dict(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=128, global_batch=8),
    # ~30 k parameters: the planner predicts ~1 MB, so model_mb is the runtime's own fixed memory
    "tiny": dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, global_batch=8),
}
_MiB = 2.0**20
# name -> (Planner kind, spec): 'auto' (min samples per microbatch), 'search' (planner options),
# 'forced' ((stages as (lo, hi, submesh, mesh), 'L' = the last layer), B), 'family' (family, submesh, mesh)
PLANS = {
    "auto": ("auto", 1),
    "auto_mb2": ("auto", 2),
    "mesh_4x1": ("forced", ([(0, "L", (2, 2), (4, 1))], 1)),
    "mesh_2x2": ("forced", ([(0, "L", (2, 2), (2, 2))], 1)),
    "tp_4x1": ("family", ("tp", (2, 2), (4, 1))),
    "zero3_4x1": ("family", ("zero3", (2, 2), (4, 1))),
    "dp_replicated": ("search", dict(pipeline=False, sharding=False)),
    "pp2_b1": ("search", dict(num_stages=2, num_microbatches=1)),
    "pp2_b2_1f1b": ("search", dict(num_stages=2, num_microbatches=2)),
    "pp2_b4_1f1b": ("search", dict(num_stages=2, num_microbatches=4)),
    "pp2_b4_gpipe": ("search", dict(num_stages=2, num_microbatches=4, schedule="gpipe")),
    "pp2_dp_b4": ("search", dict(num_stages=2, num_microbatches=4, sharding=False)),
    "pp4_b4_1f1b": ("search", dict(num_stages=4, num_microbatches=4)),
    "pp4_b4_gpipe": ("search", dict(num_stages=4, num_microbatches=4, schedule="gpipe")),
    "pp4_b8_1f1b": ("search", dict(num_stages=4, num_microbatches=8)),
    "submesh_1x2_b2": ("search", dict(submesh=(1, 2), num_microbatches=2)),
    # activation checkpointing (every layer recomputed): memory with and without it
    "ckpt_one_stage": ("search", dict(pipeline=False, num_microbatches=1, checkpointing="full")),
    "ckpt_pp2_b4_1f1b": ("search", dict(num_stages=2, num_microbatches=4, checkpointing="full")),
}
# --cluster 1x2: two devices on the two cores (no oversubscription), the same kinds of plan
PLANS_1X2 = {
    "auto": ("auto", 1),
    "auto_mb2": ("auto", 2),
    "mesh_2x1": ("forced", ([(0, "L", (1, 2), (2, 1))], 1)),
    "tp_2x1": ("family", ("tp", (1, 2), (2, 1))),
    "zero3_2x1": ("family", ("zero3", (1, 2), (2, 1))),
    "dp_replicated": ("search", dict(pipeline=False, sharding=False)),
    "pp2_b1": ("search", dict(num_stages=2, num_microbatches=1)),
    "pp2_b2_1f1b": ("search", dict(num_stages=2, num_microbatches=2)),
    "pp2_b4_1f1b": ("search", dict(num_stages=2, num_microbatches=4)),
    "pp2_b4_gpipe": ("search", dict(num_stages=2, num_microbatches=4, schedule="gpipe")),
    "pp2_b8_1f1b": ("search", dict(num_stages=2, num_microbatches=8)),
    "ckpt_one_stage": ("search", dict(pipeline=False, num_microbatches=1, checkpointing="full")),
    "ckpt_pp2_b4_1f1b": ("search", dict(num_stages=2, num_microbatches=4, checkpointing="full")),
}
CLUSTER_PLANS = {"2x2": PLANS, "1x2": PLANS_1X2}


def capacity(step_s: float, device_s: float) -> dict:
    """A what-if predictor, not the planner's: the devices of ``Cluster.local`` are processes
    sharing this machine's cores, so a step takes at least the devices' summed busy time
    (``device_s``: Σ over stages of devices × B × t per microbatch, all from the plan) over
    the physical cores: ``capacity_step_s = max(step_s, device_s / cores)``."""
    cores = os.cpu_count() or 1
    return {"device_s": round(device_s, 5), "capacity_step_s": round(max(step_s, device_s / cores), 5)}


def fill_drain(plan, machine_devices: int) -> float:
    """A what-if predictor, not the planner's: Alpa's eq. 2, ``T = Σ_k t_k + (B-1) max_k t_k``,
    with the fill and drain part (``Σ_k t_k``) priced at the rate of the devices that run
    then. The planner prices every device at the rate measured with all devices busy; with
    devices sharing this machine's cores (``Cluster.local`` puts every virtual host here), a
    stage running while the others wait in the fill or drain gets the freed cores: ``t_k``
    scales by ``min(1, cores / D) / min(1, cores / n_k)`` (``D`` devices on the machine,
    ``n_k`` in stage k). 1 where no cores are shared (``D <= cores``) and for a stage on
    every device."""
    cores = os.cpu_count() or 1
    busy = min(1.0, cores / machine_devices)
    saved = math.fsum((1.0 - busy / min(1.0, cores / s.num_devices)) * s.time_s for s in plan.stages)
    return plan.predicted_step_s - saved


def predicted(plan, graph, cluster) -> dict:
    if not hasattr(plan, "stages"):  # a StageSharding: one stage, B = 1, the ILP's own figures
        from stage_dp.memory_sim import simulate_stage

        s = plan
        # ``--calibration``: the 'compute' correction of the whole cluster (a one-stage step's
        # measured ratio sets compute and update alike; the ILP does not split the two)
        f = cluster.correction("compute", (cluster.num_hosts, cluster.devices_per_host))
        total, compute, comm = f * s.total_s, f * s.compute_s, f * (s.comm_s + s.reshard_s)
        mem = simulate_stage(graph, s).peak_bytes  # the planner's simulated peak, as build_plan reports it
        stage = {"layers": "all", "devices": "all", "mesh": list(s.mesh_shape), "time_s": round(total, 5),
                 "compute_s": round(compute, 5), "comm_s": round(comm, 5),
                 "memory_mb": round(mem / _MiB, 2), "persistent_mb": round(s.persistent_bytes / _MiB, 2),
                 "activation_mb": round(s.activation_bytes / _MiB, 2), "in_flight": 1,
                 "ops_per_step": len(graph.nodes)}
        devices = s.mesh_shape[0] * s.mesh_shape[1]
        return {"step_s": round(total, 5), "compute_s": round(compute, 5),
                "communication_s": round(comm, 5), "bubble_s": 0.0,
                "peak_memory_mb": round(mem / _MiB, 2), "num_microbatches": 1, "schedule": None,
                **capacity(total, devices * total), "fill_drain_step_s": round(total, 5),
                "stages": [stage]}
    ops = stage_op_counts(plan, graph)
    stages = [{"layers": [s.layer_start, s.layer_end], "devices": list(s.device_ids),
               "mesh": list(s.logical_mesh), "time_s": round(s.time_s, 5), "compute_s": round(s.compute_s, 5),
               "comm_s": round(s.comm_s, 5), "cross_stage_s": round(s.cross_stage_s, 5),
               "update_s": round(s.update_s, 5), "memory_mb": round(s.memory_bytes / _MiB, 2),
               "persistent_mb": round(s.persistent_bytes / _MiB, 2),
               "activation_mb": round(s.activation_bytes / _MiB, 2), "in_flight": s.in_flight,
               "ops_per_step": ops[k]["per_step"]} for k, s in enumerate(plan.stages)]
    busy = sum(s.num_devices * plan.num_microbatches * s.time_s for s in plan.stages)
    return {"step_s": round(plan.predicted_step_s, 5), "compute_s": round(plan.compute_s, 5),
            "communication_s": round(plan.communication_s, 5), "bubble_s": round(plan.bubble_s, 5),
            "peak_memory_mb": round(plan.peak_memory_bytes / _MiB, 2), "num_microbatches": plan.num_microbatches,
            "schedule": plan.schedule, **capacity(plan.predicted_step_s, busy),
            "fill_drain_step_s": round(fill_drain(plan, cluster.num_devices), 5), "stages": stages}


def measured(res: dict) -> dict:
    out = {"step_s": round(res["step_s"], 4), "steps_s": [round(t, 4) for t in res["steps_s"]],
           "model_mb": [round(x, 1) for x in res["model_mb"]], "peak_rss_mb": [round(x, 1) for x in res["peak_mb"]],
           "base_rss_mb": [round(x, 1) for x in res["rss_base_mb"]],
           "start_rss_mb": [round(x, 1) for x in res["rss_start_mb"]], "deploy_s": round(res["deploy_s"], 2)}
    if "breakdown" in res:
        out["breakdown"] = res["breakdown"]
    if "live_mb" in res:
        out["live_mb"] = [round(x, 1) for x in res["live_mb"]]
    return out


def diagnose(line: dict) -> dict | None:
    """Where the measured time went against the prediction (needs ``--breakdown-steps``).

    Per worker: ``ops_s`` (its step outside collectives and p2p) minus its stage's
    predicted compute per step (B x compute_s), divided by the operators it runs per
    step, is the implied fixed cost per operator (interpreter, DTensor dispatch, and
    the slow-down of 4 processes sharing 2 cores); the time in DTensor redistributions
    and gradient buckets over their count is the measured cost of one collective
    (α + β b, plus waiting for the slowest rank; a bucket's asynchronous all-reduce
    counts only where the step waits for it).
    Medians over workers.
    """
    bd = line["measured"].get("breakdown")
    if not bd:
        return None
    pred = line["predicted"]
    b = pred["num_microbatches"]
    stage_of_rank = {}
    for k, st in enumerate(pred["stages"]):
        for r in (st["devices"] if st["devices"] != "all" else range(len(bd["per_rank"]))):
            stage_of_rank[r] = k
    per_op, per_coll, ops_ratio = [], [], []
    for r, t in enumerate(bd["per_rank"]):
        st = pred["stages"][stage_of_rank[r]]
        compute = st["compute_s"] * b
        per_op.append((t["ops_s"] - compute) / st["ops_per_step"] * 1e6)
        if compute > 0:
            ops_ratio.append(t["ops_s"] / compute)
        calls = t["redistributes"] + t.get("grad_buckets", 0)
        if calls:
            per_coll.append((t["redistribute_s"] + t.get("grad_bucket_s", 0.0)) / calls * 1e3)
    med = statistics.median
    return {"implied_op_overhead_us": round(med(per_op), 1),
            "ops_over_predicted_compute": round(med(ops_ratio), 2) if ops_ratio else None,
            "collective_ms": round(med(per_coll), 2) if per_coll else None,
            "collectives_per_step": max(t["redistributes"] + t.get("grad_buckets", 0) for t in bd["per_rank"]),
            "p2p_wait_s": round(max(t["p2p_recv_s"] for t in bd["per_rank"]), 4)}


def misses(plan, pred: dict, events, cluster) -> list[dict]:
    """Where the prediction misses, per stage and kind of cost, from one step the runtime recorded
    (``events``: (stage, rank, events) per worker, ``Engine.events``): ``calibration.observe``
    for a plan; for a forced sharding (one stage, B = 1, one program) its 'step' against the
    predicted step, the cost model's own figure being the ILP's."""
    from alpa_torch import calibration

    if hasattr(plan, "stages"):
        return calibration.observe(plan, events)
    measured_s = statistics.median(sum(t1 - t0 for _, _, t0, t1, _ in evs) / 1e9 for _, _, evs in events)
    shape = (cluster.num_hosts, cluster.devices_per_host)
    return [calibration.observation(0, "step", shape, pred["step_s"], plan.total_s, measured_s)]


def run_plan(name: str, planner: Planner, wl, cluster, eager: dict, args) -> dict:
    kind, spec = CLUSTER_PLANS[args.cluster][name]
    t0 = time.perf_counter()
    try:
        plan = planner.plan(kind, spec)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports and goes on
        return {"plan": name, "error": f"planning failed: {type(exc).__name__}: {exc}"}
    is_plan = hasattr(plan, "stages")
    line = {"plan": name, "summary": plan.summary() if is_plan else f"B=1 all@{args.cluster}/{plan.mesh_shape[0]}x"
            f"{plan.mesh_shape[1]} forced {spec[0]}", "plan_s": round(time.perf_counter() - t0, 2),
            "predicted": predicted(plan, wl.graph, cluster)}
    try:
        deploy = plan_deployer(plan, wl, cluster) if is_plan else sharding_deployer(wl, plan)
        res = run_on_workers(cluster, deploy, wl, warmup=args.warmup_steps, timed=args.timed_steps,
                             breakdown_steps=args.breakdown_steps, trace_steps=args.trace_steps)
    except Exception as exc:  # noqa: BLE001
        line["error"] = f"running failed: {error_text(exc)}"
        return line
    line["measured"] = measured(res)
    line["rel_err_time"] = round(rel_err(line["predicted"]["step_s"], res["step_s"]), 4)
    line["rel_err_mem"] = round(rel_err(line["predicted"]["peak_memory_mb"], max(res["model_mb"])), 4)
    if res.get("live_mb"):
        line["rel_err_mem_live"] = round(rel_err(line["predicted"]["peak_memory_mb"], max(res["live_mb"])), 4)
    line["loss_diff"] = max(abs(a - e) for a, e in zip(res["losses"], eager["losses"]))
    diagnosis = diagnose(line)
    if diagnosis:
        line["diagnosis"] = diagnosis
    if res.get("events"):
        line["misses"] = misses(plan, line["predicted"], res["events"], cluster)
    return line


def summary(lines: list[dict], cluster, cfg: BenchConfig, t_start: float) -> dict:
    ok = [ln for ln in lines if "error" not in ln]
    out = {"summary": True, "cluster_shape": f"{cluster.num_hosts}x{cluster.devices_per_host}",
           "plans": len(lines), "measured": len(ok),
           "failed": [ln["plan"] for ln in lines if "error" in ln], "model": cfg.describe()}
    if len(ok) >= 2:
        pred = [ln["predicted"]["step_s"] for ln in ok]
        meas = [ln["measured"]["step_s"] for ln in ok]
        out["spearman"] = round(spearman(pred, meas), 4)
        out["median_rel_err_time"] = round(statistics.median(ln["rel_err_time"] for ln in ok), 4)
        out["median_rel_err_mem"] = round(statistics.median(ln["rel_err_mem"] for ln in ok), 4)
        out["median_measured_over_predicted_time"] = round(statistics.median(m / p for m, p in zip(meas, pred)), 3)
        out["median_measured_over_predicted_mem"] = round(statistics.median(
            max(ln["measured"]["model_mb"]) / ln["predicted"]["peak_memory_mb"] for ln in ok), 3)
        cap = [ln["predicted"]["capacity_step_s"] for ln in ok]
        out["what_if_capacity"] = {  # module docstring: not the planner's prediction
            "spearman": round(spearman(cap, meas), 4),
            "spearman_device_s": round(spearman([ln["predicted"]["device_s"] for ln in ok], meas), 4),
            "median_rel_err_time": round(statistics.median(rel_err(c, m) for c, m in zip(cap, meas)), 4)}
        fd = [ln["predicted"]["fill_drain_step_s"] for ln in ok]
        out["what_if_fill_drain"] = {  # ``fill_drain``: not the planner's prediction either
            "spearman": round(spearman(fd, meas), 4),
            "median_rel_err_time": round(statistics.median(rel_err(f, m) for f, m in zip(fd, meas)), 4)}
        live = [ln for ln in ok if "rel_err_mem_live" in ln]
        if live:  # against the live heap instead of RSS (module docstring)
            out["median_rel_err_mem_live"] = round(statistics.median(ln["rel_err_mem_live"] for ln in live), 4)
            out["median_live_over_predicted_mem"] = round(statistics.median(
                max(ln["measured"]["live_mb"]) / ln["predicted"]["peak_memory_mb"] for ln in live), 3)
        out["spearman_mem"] = round(spearman([ln["predicted"]["peak_memory_mb"] for ln in ok],
                                             [max(ln["measured"]["model_mb"]) for ln in ok]), 4)
        out["targets"] = TARGETS
        out["met"] = {"spearman": out["spearman"] >= TARGETS["spearman"],
                      "median_rel_err_time": out["median_rel_err_time"] <= TARGETS["median_rel_err_time"],
                      "median_rel_err_mem": out["median_rel_err_mem"] <= TARGETS["median_rel_err_mem"]}
        out["max_loss_diff"] = max(ln["loss_diff"] for ln in ok)
        ratios: dict[str, list[float]] = {}
        for ln in ok:
            for m in ln.get("misses", ()):
                if m["ratio"] is not None:
                    ratios.setdefault(m["kind"], []).append(m["ratio"])
        if ratios:  # ``misses``: measured / predicted per kind of cost, median and range over plans and stages
            out["misses_by_kind"] = {k: {"median": round(statistics.median(v), 3), "min": min(v), "max": max(v),
                                         "stages": len(v)} for k, v in sorted(ratios.items())}
        diag = [ln["diagnosis"] for ln in ok if "diagnosis" in ln]
        if diag:
            out["median_implied_op_overhead_us"] = statistics.median(d["implied_op_overhead_us"] for d in diag)
            colls = [d["collective_ms"] for d in diag if d["collective_ms"] is not None]
            out["median_collective_ms"] = statistics.median(colls) if colls else None
    out["cluster"] = cluster_summary(cluster)
    out["calibration"] = cluster.cost_correction or None  # ``--calibration``: the corrections planned with
    out["machine"] = machine_info()
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="full")
    ap.add_argument("--cluster", choices=sorted(CLUSTER_PLANS), default="2x2",
                    help="2x2: the benchmark; 1x2: two devices on two cores (no oversubscription), for comparison")
    ap.add_argument("--plans", default=None, help=f"comma-separated subset of {','.join(PLANS)} "
                    f"(--cluster 1x2: {','.join(PLANS_1X2)}); default all")
    ap.add_argument("--reprofile", action="store_true", help="profile the cluster again (ignore the cached JSON)")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--timed-steps", type=int, default=5)
    ap.add_argument("--breakdown-steps", type=int, default=2, help="extra instrumented steps (0: none)")
    ap.add_argument("--trace-steps", type=int, default=1,
                    help="extra steps the runtime records, for the misses per stage and kind (0: none)")
    ap.add_argument("--calibration", metavar="FILE.json", default=None,
                    help="measured cost corrections ({kind: {submesh: factor}}, as --fit-calibration writes them) "
                         "to plan with: the fidelity 'after one measured calibration'")
    ap.add_argument("--fit-calibration", metavar="FILE.json", default=None,
                    help="write the corrections this run's recorded steps give (alpa_torch.calibration.fit)")
    args = parse_measuring_args(ap, argv)
    table = CLUSTER_PLANS[args.cluster]
    names = select(ap, args.plans or ",".join(table), table, "plan")
    if args.timed_steps < 5:
        log.warning("--timed-steps %d < 5: the medians are noisier than the benchmark's protocol", args.timed_steps)
    t_start = time.perf_counter()
    from alpa_torch.core.cluster import Cluster
    from runtime.ray_env import ensure_ray, stop_ray

    cfg = BenchConfig(**MODELS[args.model], warmup_steps=args.warmup_steps, timed_steps=args.timed_steps)
    eager = eager_reference(cfg)
    wl = workload(cfg)
    shape = tuple(int(x) for x in args.cluster.split("x"))
    started = ensure_ray(Cluster.local(*shape))  # one Ray for the profile and every plan
    lines = []
    try:
        cluster, cached = profiled_cluster(*shape, reprofile=args.reprofile)
        log.info("cluster (%s): %s", "cached" if cached else "profiled now", cluster.describe())
        if args.calibration:
            cluster = calibration.calibrated(cluster, json.loads(Path(args.calibration).read_text()))
            log.info("planning with the measured cost corrections of %s: %s", args.calibration,
                     cluster.cost_correction)
        planner = Planner(wl.graph, cluster)
        for name in names:
            line = run_plan(name, planner, wl, cluster, eager, args)
            print(dumps(line), flush=True)
            lines.append(line)
    finally:
        if started:
            stop_ray()
    if args.fit_calibration:
        fitted = calibration.fit([m for ln in lines for m in ln.get("misses", ())])
        Path(args.fit_calibration).write_text(json.dumps(fitted, indent=1) + "\n")
        log.info("wrote the corrections of this run's recorded steps to %s: %s", args.fit_calibration, fitted)
    print(dumps(summary(lines, cluster, cfg, t_start)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
