"""The headline benchmark: ``parallelize(train_step, cluster)`` with default options against PyTorch's own tools.

Usage (from the repository root)::

    python bench/vs_pytorch.py                                   # every workload, 3 repeats (hours on 2 cores)
    python bench/vs_pytorch.py --workloads deep_1x4,wide_1x4 --repeats 1
    python bench/vs_pytorch.py --systems alpa,ddp,fsdp2 --out docs/results/vs_pytorch.jsonl

What a user gets, end to end: alpa-torch is exactly ``parallelize(train_step,
Cluster.local(hosts, devices))`` (the README's call, default options, the default plan
cache) called as the user calls it, one step per call, timed by the driver's wall clock
(every step ships its batch from the driver and returns the loss to it). Its first call
(capture, planning or the cached plan, start of the workers, deployment, the step) is
reported apart as ``first_step_s``, with ``plan_source``.

The peers, each set up as its documentation recommends, in fresh processes (gloo, one
torch thread per process, as alpa-torch's virtual devices), on the same seeded GPT
(``alpa_torch.zoo.GPT``), global batches and AdamW (foreach off):

- ``ddp``: ``DistributedDataParallel``, the batch split over the ranks;
- ``ddp_compile``: the same DDP model wrapped in ``torch.compile`` (PyTorch's DDP notes: wrap
  with DDP first, then compile; Dynamo's DDP optimizer cuts the graph at the gradient buckets);
- ``fsdp2`` / ``fsdp2_keep``: ``fully_shard`` on every block, then on the model, with
  ``reshard_after_forward`` True / False;
- ``fsdp2_compile``: ``fsdp2`` with every block compiled before it is sharded
  (``block.compile(fullgraph=True)``), as torchtitan applies ``torch.compile`` per block;
- ``fsdp2_tp``: a 2-D ``DeviceMesh`` (dp = world / 2, tp = 2): in every block
  ``parallelize_module`` with ``ColwiseParallel`` on the fused qkv and the MLP's first
  matmul and ``RowwiseParallel`` on the attention output and the MLP's second; the fused
  qkv's rows reordered so that a column shard holds whole heads, and the attention run on
  its local heads (torchtitan's split by heads); then ``fully_shard`` over dp;
- ``pipe_1f1b@m`` / ``pipe_interleaved@m``: ``torch.distributed.pipelining``
  ``Schedule1F1B`` (one block range per rank) and ``ScheduleInterleaved1F1B`` (two
  ranges per rank, rank r holding stages r and r + world), at each microbatch count m of
  the sweep (``--microbatches``, default world and 2 x world); the best m is the peer.

Timing: a peer's step is the slowest rank's, timed from a barrier; the median over the
timed steps after the warm-up ones. Every repeat runs every system once, alpa-torch
first, then the peers (so repeats alternate them). Memory: per worker, peak RSS
(``VmHWM``) minus the RSS after start-up (torch imported, process group or Ray worker
up, no model yet); alpa-torch's start-up RSS is read on a fresh worker group of the same
cluster, its peak across the resets its runtime makes between deployments
(``runtime/device_memory.py``), and a first call that measured candidate plans also reports
the most a trial held (``trials_mem_mb``, from ``step.tuning``: the trials may have run on
workers the kept plan's replaced), which counts in ``fits``. A workload with ``memory_mb``
gives alpa-torch's cluster that memory per device (``Cluster.local(..., memory_bytes=...)``:
the plan must fit it) and counts a peer only if its measured memory fits it.

Output, JSON lines (``--out`` appends them to a file too): one per (workload, system,
repeat) with step_s, steps_s, mem_mb, losses, loss_diff against single-device eager
(max over steps); one per (workload, system) with the median and spread over repeats;
one summary line with, per workload, the best peer, compiled or eager, and
``auto_over_best_peer`` = best peer's step time / alpa-torch's (target >= 1.0), the machine's
load and the date. A workload with more devices than the machine has cores is marked
``oversubscribed``: there its processes share cores, and the timings measure the machine more
than the plans.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math
import os
import statistics
import sys
import time
import types

import torch
from _common import (
    BenchConfig,
    _data_parallel_step,
    _ddp_worker,
    _init_rank,
    _pipeline_worker,
    _report,
    _spawn,
    _timed_loop,
    block_ranges,
    build_model,
    current_rss_mb,
    eager_reference,
    error_text,
    global_batch,
    parse_measuring_args,
    select,
)
from _plans import _ship_by_value, _worker_lifetime_peak, _worker_rss, dumps, machine_info

from alpa_torch.zoo import make_optimizer

log = logging.getLogger("vs_pytorch")


@dataclasses.dataclass(frozen=True)
class VsWorkload:
    """A model, a cluster shape and (optionally) a memory limit per device."""

    model: dict
    hosts: int
    devices: int
    memory_mb: float | None = None

    @property
    def world(self) -> int:
        return self.hosts * self.devices


DEEP = dict(vocab_size=1024, block_size=64, n_layer=8, n_head=4, n_embd=128, global_batch=16)
"""Deep and narrow: 8 blocks of width 128 (1.9 M parameters)."""
WIDE = dict(vocab_size=1024, block_size=64, n_layer=4, n_head=8, n_embd=384, global_batch=16)
"""Wide and shallow: 4 blocks of width 384 (7.9 M parameters)."""
WORKLOADS = {
    "deep_2x2": VsWorkload(DEEP, 2, 2),
    "wide_2x2": VsWorkload(WIDE, 2, 2),
    "deep_1x4": VsWorkload(DEEP, 1, 4),
    "wide_1x4": VsWorkload(WIDE, 1, 4),
    "deep_1x2": VsWorkload(DEEP, 1, 2),
    # DDP holds the whole AdamW state (16 B a parameter, 126 MB for the wide GPT) and its gradient buckets
    # per rank: its measured growth over start-up is ~290 MB, above this limit; pipelines and FSDP2 + TP stay under
    "wide_1x4_256mb": VsWorkload(WIDE, 1, 4, memory_mb=256),
}
SYSTEMS = ("alpa", "ddp", "ddp_compile", "fsdp2", "fsdp2_keep", "fsdp2_compile", "fsdp2_tp", "pipe_1f1b",
           "pipe_interleaved")


# ---------------------------------------------------------------- torch workers (spawned processes)


def _fsdp2_worker(rank, world, port, cfg, queue, reshard_after_forward=True, compile_blocks=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init_rank(rank, world, port)
    base = current_rss_mb()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(cfg)
    for block in model.blocks:
        if compile_blocks:
            block.compile(fullgraph=True)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    opt = make_optimizer("adamw", model)
    times, losses = _timed_loop(cfg, _data_parallel_step(model, opt, cfg, rank, world))
    _report(rank, world, times, losses, base, queue)


def _heads_together(attn, tp: int) -> None:
    """Reorder the fused qkv's output rows so that the j-th of ``tp`` equal row blocks holds
    [q; k; v] of heads j*H/tp .. (j+1)*H/tp, and run the attention on whatever heads its input
    holds: what a column shard of ``c_attn`` then computes is its own heads' attention."""
    C = attn.c_proj.in_features
    if attn.n_head % tp:
        raise ValueError(f"{attn.n_head} heads do not split over tp={tp}")
    width = C // tp
    order = torch.cat([torch.arange(part * C + j * width, part * C + (j + 1) * width)
                       for j in range(tp) for part in range(3)])
    with torch.no_grad():
        attn.c_attn.weight.copy_(attn.c_attn.weight[order])
        if attn.c_attn.bias is not None:
            attn.c_attn.bias.copy_(attn.c_attn.bias[order])

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = torch.softmax(att.masked_fill(self.causal_mask[:T, :T], float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, -1))
    attn.forward = types.MethodType(forward, attn)


def _fsdp2_tp_worker(rank, world, port, cfg, queue):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _init_rank(rank, world, port)
    base = current_rss_mb()
    tp = 2
    dp = world // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = build_model(cfg)
    for block in model.blocks:
        _heads_together(block.attn, tp)
        parallelize_module(block, mesh["tp"], {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                               "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = make_optimizer("adamw", model)
    # the ranks of one tp group read the same share of the batch
    times, losses = _timed_loop(cfg, _data_parallel_step(model, opt, cfg, rank // tp, dp))
    _report(rank, world, times, losses, base, queue)


TORCH_WORKERS = {
    "ddp": _ddp_worker,
    "ddp_compile": functools.partial(_ddp_worker, compile_model=True),
    "fsdp2": _fsdp2_worker,
    "fsdp2_keep": functools.partial(_fsdp2_worker, reshard_after_forward=False),
    "fsdp2_compile": functools.partial(_fsdp2_worker, compile_blocks=True),
    "fsdp2_tp": _fsdp2_tp_worker,
    "pipe_1f1b": functools.partial(_pipeline_worker, schedule="1f1b"),
    "pipe_interleaved": functools.partial(_pipeline_worker, schedule="interleaved"),
}


def runs_of(system: str, wl: VsWorkload, cfg: BenchConfig, sweep: list[int]) -> list[tuple[str, BenchConfig]]:
    """(name, config) of each run of ``system`` on ``wl``: one, or one per microbatch count of the
    sweep for a pipeline (a count that does not divide the batch is left out); [] where it does not
    apply (the reason is logged)."""
    if system == "fsdp2_tp" and wl.world % 2:
        return []
    if system.startswith("pipe_"):
        stages = wl.world * (2 if system == "pipe_interleaved" else 1)
        try:
            block_ranges(cfg.n_layer, stages)
        except ValueError:
            return []
        return [(f"{system}@{m}", dataclasses.replace(cfg, microbatches=m)) for m in sweep
                if cfg.global_batch % m == 0]
    return [(system, cfg)]


def run_torch(system: str, cfg: BenchConfig, world: int) -> dict:
    out = _spawn(TORCH_WORKERS[system.split("@")[0]], world, cfg)
    return {"step_s": out["step_s"], "steps_s": out["per_step_s"], "losses": out["losses"],
            "mem_mb": [p - b for p, b in zip(out["peak_rss_mb"], out["base_rss_mb"])]}


# ---------------------------------------------------------------- alpa-torch


def run_alpa(wl: VsWorkload, cfg: BenchConfig) -> dict:
    """``parallelize(train_step, Cluster.local(...))`` called as a user calls it."""
    from alpa_torch import Cluster, parallelize
    from alpa_torch.zoo import train_step
    from runtime.group import WorkerGroup

    memory = None if wl.memory_mb is None else wl.memory_mb * 2**20
    cluster = Cluster.local(wl.hosts, wl.devices, memory_bytes=memory)
    _ship_by_value()
    fresh = WorkerGroup.start(cluster)  # the start-up RSS of a worker, before any model
    try:
        base = fresh.call_all(_worker_rss)
    finally:
        fresh.shutdown()
    model = build_model(cfg)
    opt = make_optimizer("adamw", model)
    step = parallelize(train_step, cluster)
    times, losses = [], []
    try:
        for i in range(cfg.steps):
            batch = global_batch(cfg, i)
            t0 = time.perf_counter()
            losses.append(float(step(model, opt, batch)))
            times.append(time.perf_counter() - t0)
        peak = step.group.call_all(_worker_lifetime_peak)  # across the runtime's resets between deployments
        plan = step.plan
        out = {"step_s": statistics.median(times[cfg.warmup_steps:]), "steps_s": times, "losses": losses,
               "mem_mb": [p - b for p, b in zip(peak, base)], "first_step_s": round(times[0], 2),
               "plan_source": step.plan_source, "plan": plan.summary(), "compiled": step.compiled,
               "predicted_step_s": round(plan.predicted_step_s, 4)}
        if step.plan_source == "measured (search)":  # this call ran the trials, maybe on workers since replaced
            out["trials_mem_mb"] = max(t["measured_bytes"] or 0.0 for t in step.tuning) / 2**20
    finally:
        step.shutdown()
    return out


# ---------------------------------------------------------------- main


def spread(xs: list[float]) -> float:
    """(max - min) / median."""
    return (max(xs) - min(xs)) / statistics.median(xs)


def measure(name: str, wl_name: str, wl: VsWorkload, cfg: BenchConfig, eager: dict, repeat: int,
            retries: int) -> dict:
    """One run of system ``name``; a run that fails (a peer's process can abort in gloo's teardown) is
    tried again up to ``retries`` times, its failures kept in ``failed_attempts``."""
    line = {"workload": wl_name, "system": name, "repeat": repeat}
    for attempt in range(1 + retries):
        try:
            res = run_alpa(wl, cfg) if name == "alpa" else run_torch(name, cfg, wl.world)
            break
        except Exception as exc:  # noqa: BLE001 - report, retry, go on
            error = error_text(exc)
            line.setdefault("failed_attempts", []).append(error)
            log.warning("%s on %s, attempt %d: %s", name, wl_name, attempt + 1, error)
    else:
        return {**line, "error": error}
    line.update(step_s=round(res["step_s"], 4), steps_s=[round(t, 4) for t in res["steps_s"]],
                mem_mb=[round(m, 1) for m in res["mem_mb"]], losses=res["losses"],
                loss_diff=max(abs(a - e) for a, e in zip(res["losses"], eager["losses"])))
    line.update({k: v for k, v in res.items() if k in ("first_step_s", "plan_source", "plan", "predicted_step_s")})
    if "trials_mem_mb" in res:
        line["trials_mem_mb"] = round(res["trials_mem_mb"], 1)
    if wl.memory_mb is not None:
        line["fits"] = held_mb(line) <= wl.memory_mb
    return line


def held_mb(line: dict) -> float:
    """The most memory a device of the run held: its processes' peaks, and alpa-torch's plan
    selection trials (measured on workers a kept plan may have replaced)."""
    return max(line["mem_mb"] + [line.get("trials_mem_mb", 0.0)])


def summarize(lines: list[dict], wl_name: str, wl: VsWorkload) -> tuple[list[dict], dict]:
    """Per system of ``wl_name``: median and spread of step time over repeats; the workload's verdict."""
    per: dict[str, list[dict]] = {}
    for ln in lines:
        if ln["workload"] == wl_name:
            per.setdefault(ln["system"], []).append(ln)
    systems = []
    for name, runs in per.items():
        ok = [r for r in runs if "error" not in r]
        entry = {"workload": wl_name, "system": name, "runs": len(runs), "failed": len(runs) - len(ok)}
        if ok:
            steps = [r["step_s"] for r in ok]
            entry.update(step_s=round(statistics.median(steps), 4), spread=round(spread(steps), 3),
                         max_mem_mb=max(held_mb(r) for r in ok),
                         max_loss_diff=max(r["loss_diff"] for r in ok))
            if wl.memory_mb is not None:
                entry["fits"] = all(r["fits"] for r in ok)
        systems.append(entry)
    usable = {e["system"]: e for e in systems if "step_s" in e and e.get("fits", True) and not e["failed"]}
    peers = {k: e for k, e in usable.items() if k != "alpa"}
    verdict = {"workload": wl_name, "cluster": f"{wl.hosts}x{wl.devices}", "memory_mb": wl.memory_mb,
               "oversubscribed": wl.world > (os.cpu_count() or 1)}
    if peers:
        best = min(peers, key=lambda k: peers[k]["step_s"])
        verdict.update(best_peer=best, best_peer_step_s=peers[best]["step_s"])
    if "alpa" in usable:
        verdict["alpa_step_s"] = usable["alpa"]["step_s"]
    if peers and "alpa" in usable:
        verdict["auto_over_best_peer"] = round(peers[best]["step_s"] / usable["alpa"]["step_s"], 3)
    return systems, verdict


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--timed-steps", type=int, default=5)
    ap.add_argument("--microbatches", default="", help="microbatch counts of the pipelines' sweep "
                    "(comma-separated; default: world and 2 x world)")
    ap.add_argument("--retries", type=int, default=1, help="tries again of a run that fails")
    ap.add_argument("--out", help="also append the JSON lines to this file")
    args = parse_measuring_args(ap, argv)
    chosen = select(ap, args.workloads, WORKLOADS, "workload")
    systems = select(ap, args.systems, SYSTEMS, "system")
    out = open(args.out, "a") if args.out else None  # closed below

    def emit(line: dict) -> None:
        text = dumps(line)
        print(text, flush=True)
        if out:
            out.write(text + "\n")
            out.flush()

    t0 = time.perf_counter()
    emit({"start": True, "argv": sys.argv[1:], "machine": machine_info()})
    lines, verdicts = [], []
    for wl_name in chosen:
        wl = WORKLOADS[wl_name]
        cfg = BenchConfig(**wl.model, warmup_steps=args.warmup_steps, timed_steps=args.timed_steps)
        sweep = [int(m) for m in args.microbatches.split(",") if m] or [wl.world, 2 * wl.world]
        eager = eager_reference(cfg)
        runs = [run for s in systems for run in (runs_of(s, wl, cfg, sweep) if s != "alpa" else [("alpa", cfg)])]
        for repeat in range(args.repeats):
            for name, run_cfg in runs:
                line = measure(name, wl_name, wl, run_cfg, eager, repeat, args.retries)
                line.update(model=cfg.describe(), eager_step_s=round(eager["step_s"], 4))
                emit(line)
                lines.append(line)
        systems_out, verdict = summarize(lines, wl_name, wl)
        for entry in systems_out:
            emit(entry)
        emit(verdict)
        verdicts.append(verdict)
    ratios = {v["workload"]: v.get("auto_over_best_peer") for v in verdicts}
    emit({"summary": True, "auto_over_best_peer": ratios,
          "target_met": all(r is not None and r >= 1.0 for r in ratios.values()),
          "repeats": args.repeats, "machine": machine_info(), "wall_s": round(time.perf_counter() - t0, 1)})
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
