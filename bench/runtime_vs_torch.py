"""Diagnostic, forced plans: alpa-torch's runtime against hand-written PyTorch on the same model, batch and devices.

Every case here runs a plan forced into its baseline's shape (the planner does not choose
it): this measures the runtime, not the planner. What a user gets from ``parallelize`` with
default options against PyTorch's tools is ``bench/vs_pytorch.py``.

Usage (from the repository root; about 5 minutes on a 2-core machine)::

    python bench/runtime_vs_torch.py            # GPT vocab 4096, T 128, 4 layers, 4 heads, d 256, batch 16
    python bench/runtime_vs_torch.py --small    # GPT vocab 1024, T 64, 4 layers, 4 heads, d 128, batch 8
    python bench/runtime_vs_torch.py --cases dp4_1x4,pp2_1f1b --timed-steps 7 --breakdown

Prints one JSON line per case, then one summary line. Every case trains the
same seeded GPT (``alpa_torch.zoo.GPT``, AdamW via ``alpa_torch.zoo.make_optimizer``) on
the same global batches, on local CPU "devices": one process and one torch
thread each, gloo.

- ``dp4_1x4``: alpa-torch's pure data-parallel plan on ``Cluster.local(1, 4)``,
  logical mesh (1, 4): every batch leaf forced to ``RS(0)``, every parameter,
  buffer and optimizer state and every operator of the update to ``RR``
  (``solve_stage(..., force=...)``, ``--dp-plan ddp``, the default): the plan
  DDP executes, every device updating the whole model from all-reduced
  gradients; the ILP places the rest (where and how gradients are reduced).
  ``--dp-plan forced`` leaves the update operators to the ILP, which on the
  default CPU figures computes most of the update on slices and all-gathers
  the results (a ZeRO-like hybrid, not pure data parallelism: measured 5-15 %
  slower here than the replicated update, as the gather of 3 x 21 MB costs
  more than the sliced update saves); ``--dp-plan ilp`` forces nothing.
  Baseline: ``DistributedDataParallel`` over 4 gloo processes.
- ``dp4_2x2``: the same on ``Cluster.local(2, 2)`` with the 2D logical mesh
  (2, 2) and the batch ``S(0)S(0)`` (split over both axes). Same baseline.
- ``pp2_1f1b`` / ``pp4_1f1b``: alpa-torch's 2- / 4-stage 1F1B pipeline
  (``Engine``): stages are even ranges of transformer blocks
  (``assign_layers(..., boundaries_by_module='blocks')``; the embeddings join
  the first stage, the head the last), one device per stage,
  ``--microbatches`` microbatches (default 4). Baseline:
  ``torch.distributed.pipelining`` ``Schedule1F1B`` over ``PipelineStage``s
  cut by hand at the same block boundaries, 2 / 4 gloo processes.

Protocol: single-device eager first (the loss reference), then per case the
PyTorch baseline and right after it alpa-torch (the machine's load drifts, so
each pair is measured back to back); one Ray for all alpa-torch cases, stopped
at the end. Step time = median over ``--timed-steps`` steps after
``--warmup-steps``. An alpa-torch step is the driver's ``engine.step`` wall
time (Ray call, batch transfer and the workers' step); a PyTorch step is the
slowest rank's time after a barrier. Peak memory = the largest peak RSS
(``VmHWM``) of any worker process, MB; ``*_base_rss_mb`` is the largest RSS
right after start-up (Ray actor, or spawned process with torch imported),
before the model exists. Both sides run at the same CPU priority: Ray starts
its workers at niceness 15 (``RAY_worker_niceness``), the PyTorch ranks run at
the driver's (0), so on a machine shared with other work the alpa-torch
workers got a fraction of the CPU the baseline got (alpa-torch's 2x2 step
swung from 0.6 to 1.1 s within one run while DDP's stayed at 0.39 s); the
Ray this script starts gets ``RAY_worker_niceness=0`` unless the environment
sets it (``RAY_worker_niceness=15`` measures as before; a Ray joined through
``RAY_ADDRESS`` keeps its own).

Keys of a case line: case, model, cluster, steps (timed), alpa_step_s,
torch_step_s, ratio (alpa / torch), alpa_peak_rss_mb, torch_peak_rss_mb,
alpa_base_rss_mb, torch_base_rss_mb, loss_diff (|alpa-torch step-1 loss -
single-device eager|), loss_diff_all_steps (max over every step), warning
(only when either exceeds ``LOSS_TOL``), torch_loss_diff (step 1),
eager_1dev_step_s, alpa_setup_s (capture, plan, workers, deploy),
alpa_steps_s / torch_steps_s (every step, warm-up included), plan; with
``--breakdown``, alpa_breakdown: per rank, mean seconds per step in the
worker's step, in DTensor redistributions (collectives), in the gradient
buckets (``grad_bucket_s``: flattening, issuing and waiting for the bucketed
all-reduces; ``grad_buckets``: buckets issued per step), in the
interpreter's one-collective paths (``flat_collective_s`` /
``flat_collectives``: scalars and gathers over a whole 2-D mesh, the sharded
update's results all-gathered flat), in pipeline send/recv (a recv includes
waiting for the other stage) and the rest (``ops_s``: operators and
interpreter), plus the driver's overhead (Ray).
The summary line gives the target (alpa-torch <= 1.10 x PyTorch per case) and
whether each case meets it.

What this file does not own: the PyTorch baselines and the measurement
helpers (``bench/_common.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections import Counter

import torch
from _common import (
    BenchConfig,
    block_ranges,
    build_model,
    eager_reference,
    global_batch,
    median,
    parse_measuring_args,
    run_torch_ddp,
    run_torch_pipeline,
    select,
)

from alpa_torch.zoo import make_optimizer, train_step

log = logging.getLogger("runtime_vs_torch")

TARGET_RATIO = 1.10
LOSS_TOL = 1e-5
CASES = ("dp4_1x4", "dp4_2x2", "pp2_1f1b", "pp4_1f1b")
FULL = dict(vocab_size=4096, block_size=128, n_layer=4, n_head=4, n_embd=256, global_batch=16)
SMALL = dict(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=128, global_batch=8)


# ---------------------------------------------------------------- worker-side probes (run in Ray actors)


def _worker_rss_now(state: dict) -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2.0**20


def _worker_rss_peak(state: dict) -> float:
    """Peak RSS of this worker, MB: ``VmHWM`` (see ``_common.max_rss_mb`` on why not ``ru_maxrss``)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024.0 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _worker_install_timers(state: dict) -> bool:
    """``--breakdown``: time this worker's step, its DTensor redistributions, gradient buckets and p2p.

    Wraps, in this worker process only, the runner's ``step``, DTensor's
    ``redistribute_local_tensor`` (every collective a plan or DTensor's own
    rules insert; synchronous on gloo), ``runtime.grad_buckets.GradBuckets``'
    issue and completion (the bucketed gradient all-reduces: asynchronous, so
    this is the time they cost the step, not their duration) and
    ``runtime.comm.send`` / ``recv`` (a ``recv`` includes waiting for the other
    stage: transfer plus bubble), and the interpreter's one-collective paths
    (``replicate_over_world``: a value partial / sharded over both axes of a 2-D
    mesh made replicated; ``gather_replicated``: state updated on shards
    all-gathered flat; ``flat_collective_s``, ``flat_collectives``, counted per
    call: one ``gather_replicated`` call per step issues one all-gather per placements).
    """
    import time

    from torch.distributed.tensor import _api, _dispatch, _redistribute

    timers = state["bench_timers"] = {"step_s": 0.0, "steps": 0, "redistribute_s": 0.0, "redistributes": 0,
                                      "recv_s": 0.0, "send_s": 0.0, "bucket_s": 0.0, "buckets": 0,
                                      "flat_s": 0.0, "flats": 0}

    def timed(fn, key, count=None):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[key] += time.perf_counter() - t0
                if count:
                    timers[count] += 1
        return wrapper

    owner = state["pipe"] if "pipe" in state else state["runner"]
    owner.step = timed(owner.step, "step_s", "steps")
    redistribute = timed(_redistribute.redistribute_local_tensor, "redistribute_s", "redistributes")
    for module in (_redistribute, _api, _dispatch):
        module.redistribute_local_tensor = redistribute
    try:
        from runtime.grad_buckets import GradBuckets
    except ImportError:  # an older runtime without buckets
        GradBuckets = None
    if GradBuckets is not None:
        GradBuckets._issue = timed(GradBuckets._issue, "bucket_s", "buckets")
        GradBuckets._complete = timed(GradBuckets._complete, "bucket_s")
    from runtime import interpreter

    for fn in ("replicate_over_world", "gather_replicated"):  # one collective for many (interpreter.py)
        if hasattr(interpreter, fn):
            setattr(interpreter, fn, timed(getattr(interpreter, fn), "flat_s", "flats"))
    if "pipe" in state:
        from runtime import comm

        comm.send, comm.recv = timed(comm.send, "send_s"), timed(comm.recv, "recv_s")
    return True


def _worker_read_timers(state: dict) -> dict:
    return dict(state["bench_timers"])


# ---------------------------------------------------------------- alpa-torch side


def _initial_state(model, functional) -> dict:
    """Parameters, buffers and optimizer state as numpy, keyed by graph input name."""
    values = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name in functional.names:
        for key, v in functional.initial_state(name, values[name]).items():
            values[f"{name}.{key}"] = v
    return {k: v.detach().numpy() for k, v in values.items()}


def pure_dp_force(graph, batch_spec: str, *, replicated_update: bool = False) -> dict[str, str]:
    """The ``force=`` of a pure data-parallel plan.

    Batch leaves get ``batch_spec``; parameters, buffers and optimizer state ``RR``.
    With ``replicated_update`` every update-phase operator is pinned to ``RR``
    as well: every device runs the whole optimizer step on all-reduced
    gradients, exactly what DDP does (otherwise the ILP may compute some updates
    on slices and all-gather the results before storing them replicated).
    """
    force = {}
    for s in graph.inputs:
        if s.kind == "batch" and s.shape:
            force[s.name] = batch_spec
        elif s.kind in ("param", "buffer", "opt_state"):
            force[s.name] = "RR"
    if replicated_update:
        fx_nodes = {n.name: n for n in graph.gm.graph.nodes}
        for name, node in graph.nodes.items():
            if node.phase == "update" and isinstance(fx_nodes[name].meta.get("val"), torch.Tensor):
                force[name] = "RR"
    return force


def solve_dp_plan(graph, mesh, batch_spec: str, plan: str):
    """``plan``: 'forced' (pure DP inputs), 'ddp' (also a replicated update) or 'ilp' (unconstrained)."""
    import inspect

    from intra_ilp.stage import solve_stage

    if plan == "ilp":
        return solve_stage(graph, mesh)
    if "force" not in inspect.signature(solve_stage).parameters:
        raise SystemExit("intra_ilp.stage.solve_stage has no `force=` argument: cannot pin a pure "
                         "data-parallel plan. Update the checkout, or run with --dp-plan ilp.")
    return solve_stage(graph, mesh, force=pure_dp_force(graph, batch_spec, replicated_update=plan == "ddp"))


def plan_summary(sharding) -> str:
    """The most common value specs and the ILP's predicted step time."""
    specs = Counter(str(s) for s in sharding.value_specs.values())
    return f"values {dict(specs.most_common(4))}; predicted {sharding.total_s * 1e3:.1f} ms"


def _timed_steps(cfg: BenchConfig, step_fn, functional, on_warm=None) -> tuple[list[float], list[float]]:
    """(seconds, loss) of every step; ``on_warm()`` is called once the warm-up steps are done."""
    times, losses = [], []
    for step in range(cfg.steps):
        if step == cfg.warmup_steps and on_warm is not None:
            on_warm()
        idx, tgt = global_batch(cfg, step)
        batch = {"batch.0": idx.numpy(), "batch.1": tgt.numpy()}
        t0 = time.perf_counter()
        loss = step_fn(batch, functional.host_scalars())
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return times, losses


def _installer(group, breakdown: bool):
    return (lambda: group.call_all(_worker_install_timers)) if breakdown else None


def _breakdown(driver_times: list[float], timers: list[dict] | None) -> dict | None:
    """Mean seconds per timed step: the driver's wall time and, per rank, where the worker spent it."""
    if timers is None:
        return None
    n = max(timers[0]["steps"], 1)
    per_rank = [{"step_s": t["step_s"] / n, "redistribute_s": t["redistribute_s"] / n,
                 "redistributes": t["redistributes"] / n, "p2p_recv_s": t["recv_s"] / n,
                 "p2p_send_s": t["send_s"] / n, "grad_bucket_s": t.get("bucket_s", 0.0) / n,
                 "grad_buckets": t.get("buckets", 0) / n, "flat_collective_s": t.get("flat_s", 0.0) / n,
                 "flat_collectives": t.get("flats", 0) / n,
                 "ops_s": (t["step_s"] - t["redistribute_s"] - t["recv_s"] - t["send_s"] - t.get("bucket_s", 0.0)
                           - t.get("flat_s", 0.0)) / n}
                for t in timers]
    driver_s = sum(driver_times) / len(driver_times)
    worker_s = max(r["step_s"] for r in per_rank)
    return {"driver_step_s": round(driver_s, 4), "max_worker_step_s": round(worker_s, 4),
            "driver_overhead_s": round(driver_s - worker_s, 4),
            "per_rank": [{k: round(v, 4) for k, v in r.items()} for r in per_rank]}


def run_alpa_dp(cfg: BenchConfig, hosts: int, devices: int, plan: str, breakdown: bool = False) -> dict:
    """Pure data parallelism over a ``hosts x devices`` local cluster."""
    from alpa_torch.capture import capture
    from alpa_torch.core.cluster import Cluster
    from alpa_torch.optim import OptimizerSet
    from intra_ilp.cost_model import MeshCost
    from runtime.engine import Engine
    from runtime.group import WorkerGroup

    t0 = time.perf_counter()
    model = build_model(cfg)
    opt = make_optimizer("adamw", model)
    graph = capture(train_step, model, opt, global_batch(cfg, 0))
    cluster = Cluster.local(hosts, devices)
    mesh_shape, batch_spec = ((1, devices), "RS(0)") if hosts == 1 else ((hosts, devices), "S(0)S(0)")
    mesh = MeshCost.from_cluster(cluster, (hosts, devices), mesh_shape)
    sharding = solve_dp_plan(graph, mesh, batch_spec, plan)
    functional = OptimizerSet((opt,), {id(p): n for n, p in model.named_parameters()})
    state = _initial_state(model, functional)
    with WorkerGroup.start(cluster) as group:
        base = max(group.call_all(_worker_rss_now))
        engine = Engine(group, graph, sharding)
        engine.load_state(state)
        setup_s = time.perf_counter() - t0
        times, losses = _timed_steps(cfg, engine.step, functional, _installer(group, breakdown))
        peak = max(group.call_all(_worker_rss_peak))
        timers = group.call_all(_worker_read_timers) if breakdown else None
    return {"times": times, "losses": losses, "peak_rss_mb": peak, "base_rss_mb": base,
            "setup_s": setup_s, "plan": f"mesh {mesh_shape}, {plan}: {plan_summary(sharding)}",
            "breakdown": _breakdown(times[cfg.warmup_steps:], timers)}


def run_alpa_pipeline(cfg: BenchConfig, num_stages: int, breakdown: bool = False) -> dict:
    """1F1B over ``num_stages`` single-device stages cut at transformer-block boundaries."""
    from alpa_torch.capture import capture
    from alpa_torch.core.cluster import Cluster
    from alpa_torch.core.partition import stage_of_nodes
    from alpa_torch.optim import OptimizerSet
    from intra_ilp.cost_model import MeshCost
    from intra_ilp.stage import solve_stage
    from runtime.engine import Engine, StageDeployment
    from runtime.group import WorkerGroup
    from stage_dp.layer_assign import assign_layers

    t0 = time.perf_counter()
    model = build_model(cfg)
    opt = make_optimizer("adamw", model)
    microbatch = global_batch(cfg, 0, batch_size=cfg.global_batch // cfg.microbatches)
    graph = capture(train_step, model, opt, microbatch)  # one microbatch's step: what each F/B runs
    layers = assign_layers(graph, num_stages, boundaries_by_module="blocks")
    stage_of = stage_of_nodes(graph, layers.layer_of, [(k, k) for k in range(num_stages)])
    cluster = Cluster.local(1, num_stages)
    mesh = MeshCost.from_cluster(cluster, (1, 1), (1, 1))
    deployments = []
    for k in range(num_stages):
        names = {n for n, s in stage_of.items() if s == k and n in graph.nodes}
        deployments.append(StageDeployment((k,), (1, 1), solve_stage(graph, mesh, names=names)))
    functional = OptimizerSet((opt,), {id(p): n for n, p in model.named_parameters()})
    state = _initial_state(model, functional)
    with WorkerGroup.start(cluster) as group:
        base = max(group.call_all(_worker_rss_now))
        engine = Engine(group, graph, deployments, stage_of, cfg.microbatches, "1f1b", cluster=cluster)
        engine.load_state(state)
        setup_s = time.perf_counter() - t0
        times, losses = _timed_steps(cfg, engine.step, functional, _installer(group, breakdown))
        peak = max(group.call_all(_worker_rss_peak))
        timers = group.call_all(_worker_read_timers) if breakdown else None
    ranges = block_ranges(cfg.n_layer, num_stages)
    return {"times": times, "losses": losses, "peak_rss_mb": peak, "base_rss_mb": base,
            "setup_s": setup_s, "plan": f"{num_stages} stages, blocks {ranges}, {cfg.microbatches} microbatches",
            "breakdown": _breakdown(times[cfg.warmup_steps:], timers)}


# ---------------------------------------------------------------- cases


def _case_line(case: str, cluster: str, cfg: BenchConfig, alpa: dict, torch_res: dict, eager: dict) -> dict:
    alpa_s = median(alpa["times"][cfg.warmup_steps:])
    line = {
        "case": case, "forced_plan": True, "model": cfg.describe(), "cluster": cluster, "steps": cfg.timed_steps,
        "alpa_step_s": round(alpa_s, 4), "torch_step_s": round(torch_res["step_s"], 4),
        "ratio": round(alpa_s / torch_res["step_s"], 3),
        "alpa_peak_rss_mb": round(alpa["peak_rss_mb"], 1), "torch_peak_rss_mb": round(max(torch_res["peak_rss_mb"]), 1),
        "alpa_base_rss_mb": round(alpa["base_rss_mb"], 1), "torch_base_rss_mb": round(max(torch_res["base_rss_mb"]), 1),
        "loss_diff": abs(alpa["losses"][0] - eager["first_loss"]),
        "loss_diff_all_steps": max(abs(a - e) for a, e in zip(alpa["losses"], eager["losses"])),
        "torch_loss_diff": abs(torch_res["losses"][0] - eager["first_loss"]),
        "eager_1dev_step_s": round(eager["step_s"], 4),
        "alpa_setup_s": round(alpa["setup_s"], 2),
        "alpa_steps_s": [round(t, 4) for t in alpa["times"]],
        "torch_steps_s": [round(t, 4) for t in torch_res["per_step_s"]],
        "plan": alpa["plan"],
    }
    if alpa.get("breakdown"):
        line["alpa_breakdown"] = alpa["breakdown"]
    if not line["loss_diff"] <= LOSS_TOL:  # also catches NaN
        line["warning"] = f"alpa-torch step-1 loss differs from single-device eager by {line['loss_diff']:.3g}"
    elif not line["loss_diff_all_steps"] <= LOSS_TOL:
        line["warning"] = (f"alpa-torch losses drift from single-device eager by up to "
                           f"{line['loss_diff_all_steps']:.3g} over {cfg.steps} steps")
    return line


def _run_case(cfg: BenchConfig, case: str, dp_plan: str, breakdown: bool) -> tuple[dict, dict, str]:
    """(alpa-torch result, PyTorch result, cluster) of one case, the baseline measured just before."""
    if case.startswith("dp4"):
        hosts, devices = (1, 4) if case == "dp4_1x4" else (2, 2)
        torch_res = run_torch_ddp(cfg, hosts * devices)
        return run_alpa_dp(cfg, hosts, devices, dp_plan, breakdown), torch_res, f"local {hosts}x{devices}"
    stages = int(case[2])
    torch_res = run_torch_pipeline(cfg, stages)
    return run_alpa_pipeline(cfg, stages, breakdown), torch_res, f"local 1x{stages}"


def run(cfg: BenchConfig, cases: list[str], dp_plan: str, breakdown: bool = False) -> list[dict]:
    """Every case, PyTorch then alpa-torch back to back (the machine's load drifts), on one Ray."""
    from alpa_torch.core.cluster import Cluster
    from runtime.ray_env import ensure_ray, stop_ray

    if __name__ != "__main__":  # imported: ship the worker probes by value (Ray workers cannot import bench/)
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    eager = eager_reference(cfg)
    log.info("eager single device: %.3f s/step", eager["step_s"])
    lines = []
    # the baseline's priority for the workers of a Ray started here (see the module docstring)
    os.environ.setdefault("RAY_worker_niceness", "0")
    started = ensure_ray(Cluster.local(1, 4))  # started once: ray.init costs 6-8 s
    try:
        for case in cases:
            alpa, torch_res, cluster = _run_case(cfg, case, dp_plan, breakdown)
            line = _case_line(case, cluster, cfg, alpa, torch_res, eager)
            print(json.dumps(line), flush=True)
            lines.append(line)
    finally:
        if started:
            stop_ray()
    return lines


def summary(lines: list[dict]) -> dict:
    met = {ln["case"]: ln["ratio"] <= TARGET_RATIO for ln in lines}
    return {"summary": True, "target": f"alpa_step_s <= {TARGET_RATIO:.2f} x torch_step_s for every case",
            "ratios": {ln["case"]: ln["ratio"] for ln in lines}, "met": met, "all_met": all(met.values()),
            "loss_ok": all("warning" not in ln for ln in lines)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="smaller GPT and batch 8 (a quick run)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--timed-steps", type=int, default=10)
    ap.add_argument("--microbatches", type=int, default=4, help="microbatches of the pipelined cases")
    ap.add_argument("--dp-plan", choices=("forced", "ddp", "ilp"), default="ddp",
                    help="ddp: batch sharded, state and optimizer update replicated (DDP's plan); "
                         "forced: batch sharded, state replicated, the update as the ILP picks; "
                         "ilp: whatever the ILP picks")
    ap.add_argument("--breakdown", action="store_true",
                    help="time each alpa-torch worker's step, redistributions and p2p (adds alpa_breakdown)")
    args = parse_measuring_args(ap, argv)
    cases = select(ap, args.cases, CASES, "case")
    cfg = BenchConfig(**(SMALL if args.small else FULL), warmup_steps=args.warmup_steps,
                      timed_steps=args.timed_steps, microbatches=args.microbatches)
    lines = run(cfg, cases, args.dp_plan, args.breakdown)
    print(json.dumps(summary(lines)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
