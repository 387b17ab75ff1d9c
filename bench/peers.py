"""alpa-torch's automatic plan against PyTorch's own parallelisms, same model, batch and 4 CPU workers.

Usage (from the repository root; about 5 minutes on a 2-core machine)::

    python bench/peers.py                 # GPT vocab 4096, T 128, 4 layers, 4 heads, d 256, batch 16
    python bench/peers.py --small         # GPT vocab 1024, T 64, 4 layers, 4 heads, d 128, batch 8
    python bench/peers.py --peers ddp,fsdp2,alpa_auto --timed-steps 7

Every peer trains the same seeded GPT (``alpa_torch.zoo.GPT``, AdamW, foreach off)
on the same global batches (``_common.global_batch``) for
``--warmup-steps`` + ``--timed-steps`` steps; each worker is one process with
one torch thread (gloo), started fresh for its peer.

- ``single``: one process, the whole batch (``world = 1``);
- ``ddp``: ``DistributedDataParallel``, batch split over 4 ranks;
- ``pipe_gpipe`` / ``pipe_1f1b``: ``torch.distributed.pipelining``
  ``ScheduleGPipe`` / ``Schedule1F1B``, one block range per rank (4 stages,
  embeddings in the first, head in the last), ``--microbatches`` microbatches;
- ``tp``: DTensor tensor parallel over 4 ranks (``parallelize_module``): in
  every block ``attn.c_attn`` and ``mlp.0`` ``ColwiseParallel``, ``attn.c_proj``
  and ``mlp.2`` ``RowwiseParallel``. The zoo GPT's fused qkv is split into q, k, v
  by features, not by heads, so ``c_attn``'s output is all-gathered
  (``output_layouts=Replicate()``) and the attention core runs replicated, with
  ``c_proj`` slicing its replicated input (``input_layouts=Replicate()``): the
  MLP is Megatron-parallel, attention only in its two matmuls. Embeddings, norms
  and the LM head stay replicated; every rank sees the whole batch;
- ``fsdp2``: ``fully_shard`` on every block and on the model (FSDP2), batch split over 4 ranks;
- ``alpa_auto``: alpa-torch's automatic plan for ``Cluster.local(1, 4)``
  profiled (``profile_cluster``, cached; what ``parallelize`` plans with that
  cluster, ``ParallelStep.make_plan``), run by its runtime on 4 Ray workers
  (``_plans.run_on_workers``).

One JSON line per peer: peer, step_s (median over the timed steps of the
slowest rank's step after a barrier; alpa-torch: the driver's wall time per
call), samples_s (global batch / step_s), peak_rss_mb (per worker, ``VmHWM``),
base_rss_mb (per worker after start-up: torch imported, process group up,
before the model exists), mem_mb (per worker, peak - base), first_loss,
final_loss, loss_diff (max |loss - single-device eager| over all steps),
plan (alpa-torch). A peer that fails prints ``error``. The last line sums up.

What this file does not own: the DDP / 1F1B helpers and the measurements
(``bench/_common.py``), the alpa-torch measuring (``bench/_plans.py``).
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time

from _common import (
    BenchConfig,
    _data_parallel_step,
    _ddp_worker,
    _init_rank,
    _pipeline_worker,
    _report,
    _spawn,
    _timed_loop,
    build_model,
    current_rss_mb,
    eager_reference,
    error_text,
    global_batch,
    parse_measuring_args,
    select,
)
from _plans import dumps, machine_info, plan_deployer, profiled_cluster, run_on_workers, workload
from vs_pytorch import _fsdp2_worker

from alpa_torch.zoo import lm_loss, make_optimizer

log = logging.getLogger("peers")

WORLD = 4
PEERS = ("single", "ddp", "pipe_gpipe", "pipe_1f1b", "tp", "fsdp2", "alpa_auto")
FULL = dict(vocab_size=4096, block_size=128, n_layer=4, n_head=4, n_embd=256, global_batch=16)
SMALL = dict(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=128, global_batch=8)


# ---------------------------------------------------------------- torch workers (spawned processes)


def _single_worker(rank, world, port, cfg, queue):
    _init_rank(rank, world, port)
    base = current_rss_mb()
    model = build_model(cfg)
    opt = make_optimizer("adamw", model)
    times, losses = _timed_loop(cfg, _data_parallel_step(model, opt, cfg, 0, 1))
    _report(rank, world, times, losses, base, queue)


def _tp_worker(rank, world, port, cfg, queue):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _init_rank(rank, world, port)
    base = current_rss_mb()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(cfg)
    for block in model.blocks:
        parallelize_module(block, mesh, {
            # the fused qkv is split by features (q | k | v), not by heads: gather its output
            "attn.c_attn": ColwiseParallel(output_layouts=Replicate()),
            "attn.c_proj": RowwiseParallel(input_layouts=Replicate()),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
    opt = make_optimizer("adamw", model)

    def step(idx, tgt):  # every rank: the whole batch
        opt.zero_grad()
        loss = lm_loss(model(idx), tgt)
        loss.backward()
        opt.step()
        return float(loss.detach()) if rank == 0 else None
    times, losses = _timed_loop(cfg, step)
    _report(rank, world, times, losses, base, queue)


TORCH_WORKERS = {"single": (_single_worker, 1), "ddp": (_ddp_worker, WORLD), "fsdp2": (_fsdp2_worker, WORLD),
                 "tp": (_tp_worker, WORLD),
                 "pipe_gpipe": (functools.partial(_pipeline_worker, schedule="gpipe"), WORLD),
                 "pipe_1f1b": (functools.partial(_pipeline_worker, schedule="1f1b"), WORLD)}


def run_torch(peer: str, cfg: BenchConfig) -> dict:
    worker, world = TORCH_WORKERS[peer]
    out = _spawn(worker, world, cfg)
    return {"step_s": out["step_s"], "steps_s": out["per_step_s"], "losses": out["losses"],
            "peak_rss_mb": out["peak_rss_mb"], "base_rss_mb": out["base_rss_mb"]}


# ---------------------------------------------------------------- alpa-torch


def run_alpa(cfg: BenchConfig, reprofile: bool) -> dict:
    from alpa_torch.api import ParallelStep
    from alpa_torch.core.cluster import Cluster
    from alpa_torch.zoo import train_step
    from runtime.ray_env import ensure_ray, stop_ray

    wl = workload(cfg)
    started = ensure_ray(Cluster.local(1, WORLD))
    try:
        cluster, _ = profiled_cluster(1, WORLD, reprofile=reprofile)
        t0 = time.perf_counter()
        plan = ParallelStep(train_step, cluster, plan_cache=False).make_plan(wl.model, wl.optimizer,
                                                                               global_batch(cfg, 0))
        plan_s = time.perf_counter() - t0
        res = run_on_workers(cluster, plan_deployer(plan, wl, cluster), wl, warmup=cfg.warmup_steps,
                             timed=cfg.timed_steps)
    finally:
        if started:
            stop_ray()
    return {"step_s": res["step_s"], "steps_s": res["steps_s"], "losses": res["losses"],
            "peak_rss_mb": res["peak_mb"], "base_rss_mb": res["rss_start_mb"], "plan": plan.summary(),
            "predicted_step_s": round(plan.predicted_step_s, 4), "plan_s": round(plan_s, 1)}


# ---------------------------------------------------------------- main


def line_of(peer: str, res: dict, cfg: BenchConfig, eager: dict) -> dict:
    losses = res["losses"]
    line = {"peer": peer, "workers": 1 if peer == "single" else WORLD, "step_s": round(res["step_s"], 4),
            "samples_s": round(cfg.global_batch / res["step_s"], 2),
            "peak_rss_mb": [round(x, 1) for x in res["peak_rss_mb"]],
            "base_rss_mb": [round(x, 1) for x in res["base_rss_mb"]],
            "mem_mb": [round(p - b, 1) for p, b in zip(res["peak_rss_mb"], res["base_rss_mb"])],
            "first_loss": losses[0], "final_loss": losses[-1],
            "loss_diff": max(abs(a - e) for a, e in zip(losses, eager["losses"])),
            "steps_s": [round(t, 4) for t in res["steps_s"]]}
    for key in ("plan", "predicted_step_s", "plan_s"):
        if key in res:
            line[key] = res[key]
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="smaller GPT and batch 8")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--timed-steps", type=int, default=5)
    ap.add_argument("--microbatches", type=int, default=4, help="microbatches of the torch pipelines")
    ap.add_argument("--reprofile", action="store_true")
    args = parse_measuring_args(ap, argv)
    peers = select(ap, args.peers, PEERS, "peer")
    cfg = BenchConfig(**(SMALL if args.small else FULL), warmup_steps=args.warmup_steps,
                      timed_steps=args.timed_steps, microbatches=args.microbatches)
    t0 = time.perf_counter()
    eager = eager_reference(cfg)
    lines = []
    for peer in peers:
        try:
            res = run_alpa(cfg, args.reprofile) if peer == "alpa_auto" else run_torch(peer, cfg)
            line = line_of(peer, res, cfg, eager)
        except Exception as exc:  # noqa: BLE001 - report and go on
            line = {"peer": peer, "error": error_text(exc)}
        print(dumps(line), flush=True)
        lines.append(line)
    ok = [ln for ln in lines if "error" not in ln]
    best = max(ok, key=lambda ln: ln["samples_s"])["peer"] if ok else None
    print(dumps({"summary": True, "model": cfg.describe(), "steps": cfg.timed_steps,
                 "samples_s": {ln["peer"]: ln["samples_s"] for ln in ok},
                 "max_mem_mb": {ln["peer"]: max(ln["mem_mb"]) for ln in ok}, "fastest": best,
                 "failed": [ln["peer"] for ln in lines if "error" in ln],
                 "eager_1dev_step_s": round(eager["step_s"], 4), "machine": machine_info(),
                 "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
