"""Shared pieces of ``bench/runtime_vs_torch.py``: the model, the batches, the
measurements, and the PyTorch baselines it is compared against.

What it owns:

- ``BenchConfig``: the GPT shape, global batch, steps and microbatches of a run;
- ``global_batch(cfg, step)``: the deterministic batch of step ``step`` (the
  same tokens for every runner: eager, alpa-torch and PyTorch);
- ``max_rss_mb`` / ``current_rss_mb`` / ``median``: the measurements;
- ``select`` / ``emit``: the benchmarks' command lines (a checked comma list of cases; one JSON
  line per result, printed and appended to ``--out``);
- the PyTorch baselines, each run in fresh processes started by
  ``torch.multiprocessing.spawn`` over gloo with one torch thread per rank:
  ``run_torch_ddp`` (``DistributedDataParallel``) and ``run_torch_pipeline``
  (``torch.distributed.pipelining`` ``Schedule1F1B`` over a GPT split by hand
  at transformer-block boundaries, one ``PipelineStage`` per rank).

What it does not own: alpa-torch (capture, planning, the Ray runtime): that is
``runtime_vs_torch.py``. Nothing here imports Ray.

Timing protocol (both sides): every step starts after a barrier (the
alpa-torch driver's call is one too); a rank times its own step; a step's time
is the slowest rank's; the reported number is the median over the timed
steps after the warm-up ones.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import resource
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from alpa_torch.zoo import GPT, GPTConfig, lm_loss, make_optimizer, train_step


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """One benchmark run: model shape, data and step counts (same for every runner)."""

    vocab_size: int
    block_size: int
    """Sequence length T of every sample (the model's block size)."""
    n_layer: int
    n_head: int
    n_embd: int
    global_batch: int
    """Sequences per optimizer step, split over data-parallel ranks or microbatches."""
    warmup_steps: int = 2
    timed_steps: int = 5
    microbatches: int = 4
    """Microbatches per step of the pipelined cases."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.timed_steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"need timed_steps >= 1 and warmup_steps >= 0, got {self.timed_steps}, "
                             f"{self.warmup_steps}")

    @property
    def steps(self) -> int:
        return self.warmup_steps + self.timed_steps

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd)

    def describe(self) -> str:
        return (f"GPT(vocab {self.vocab_size}, T {self.block_size}, {self.n_layer} layers, {self.n_head} heads, "
                f"d {self.n_embd}), batch {self.global_batch}, AdamW")

    def to_dict(self) -> dict:
        return asdict(self)


def build_model(cfg: BenchConfig) -> GPT:
    """The seeded GPT every runner starts from (identical weights everywhere)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return GPT(cfg.gpt_config()).train()


def global_batch(cfg: BenchConfig, step: int, batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets), each [B, T] int64: the tokens of step ``step`` (0-based)."""
    gen = torch.Generator().manual_seed(1000 + step)
    b = cfg.global_batch if batch_size is None else batch_size
    seq = torch.randint(0, cfg.vocab_size, (b, cfg.block_size + 1), generator=gen)  # [B, T+1]
    return seq[:, :-1].clone(), seq[:, 1:].clone()


# ---------------------------------------------------------------- measurements


def max_rss_mb() -> float:
    """Peak resident set of this process image, MB.

    ``VmHWM`` of ``/proc/self/status`` where it exists, else ``ru_maxrss``.
    Linux carries ``ru_maxrss`` across ``execve`` (``signal->maxrss`` keeps the
    high-water mark of the pre-exec image), so a process spawned by a 400 MB
    driver reports >= 400 MB even if it never held that much; ``VmHWM`` belongs
    to the current address space and starts afresh at ``exec``.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def current_rss_mb() -> float:
    """Resident set of this process now, MB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2.0**20


def error_text(exc: BaseException) -> str:
    """A failure for a JSON line: its type, its first line and, for a worker group's error, the
    first worker's own exception (the line naming what a device raised), each cut at 300 characters."""
    lines = str(exc).splitlines() or [""]
    raised = next((ln for ln in lines[1:] if " raised " in ln), None)
    return f"{type(exc).__name__}: {lines[0][:300]}" + (f" | {raised.strip()[:300]}" if raised else "")


def median(xs) -> float:
    return float(statistics.median(xs))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def eager_reference(cfg: BenchConfig) -> dict:
    """Single-process eager training with one thread: step-1 loss and median step time."""
    torch.set_num_threads(1)
    model = build_model(cfg)
    opt = make_optimizer("adamw", model)
    times, losses = [], []
    for step in range(cfg.steps):
        batch = global_batch(cfg, step)
        t0 = time.perf_counter()
        losses.append(float(train_step(model, opt, batch).detach()))
        times.append(time.perf_counter() - t0)
    return {"first_loss": losses[0], "losses": losses, "step_s": median(times[cfg.warmup_steps:])}


# ---------------------------------------------------------------- torch workers


def _init_rank(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)  # one thread per virtual device (docs/design.md)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world, timeout=datetime.timedelta(seconds=300))


def _report(rank: int, world: int, times: list[float], losses: list[float | None], base: float, queue) -> None:
    """Rank 0 puts one dict: per-step slowest time, per-rank memory, the losses (mean over the ranks
    that have one: every rank's shard mean under data parallelism, the last stage's under pipelining)."""
    dist = torch.distributed
    mine = {"times": times, "losses": losses, "peak": max_rss_mb(), "base": base}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        steps = len(times)
        per_step = [max(r["times"][i] for r in everyone) for i in range(steps)]
        loss = []
        for i in range(steps):
            have = [r["losses"][i] for r in everyone if r["losses"][i] is not None]
            loss.append(sum(have) / len(have) if have else None)
        queue.put({"per_step_s": per_step, "losses": loss, "peak_rss_mb": [r["peak"] for r in everyone],
                   "base_rss_mb": [r["base"] for r in everyone]})
    dist.barrier()
    dist.destroy_process_group()


def _timed_loop(cfg: BenchConfig, step_fn) -> tuple[list[float], list[float | None]]:
    """(seconds, loss or None) of ``step_fn(idx, tgt)`` for every step: the batch is made before
    the barrier, the timer runs from the barrier to the step's end."""
    times, losses = [], []
    for step in range(cfg.steps):
        idx, tgt = global_batch(cfg, step)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        loss = step_fn(idx, tgt)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    return times, losses


def _data_parallel_step(model, opt, cfg: BenchConfig, rank: int, world: int):
    """One step on this rank's equal share of the global batch; its loss (the shard's mean)."""
    per = cfg.global_batch // world

    def step(idx, tgt):
        opt.zero_grad()
        # DDP hooks into forward; the module's own loss() would bypass it
        loss = lm_loss(model(idx[rank * per:(rank + 1) * per]), tgt[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        return float(loss.detach())  # equal shards: the mean of the ranks' losses is the global loss
    return step


def _ddp_worker(rank: int, world: int, port: int, cfg: BenchConfig, queue, compile_model: bool = False) -> None:
    """DDP on this rank; ``compile_model``: the DDP model wrapped in ``torch.compile`` (DDP first)."""
    from torch.nn.parallel import DistributedDataParallel

    _init_rank(rank, world, port)
    base = current_rss_mb()
    model = DistributedDataParallel(build_model(cfg))
    if compile_model:
        model = torch.compile(model)
    opt = make_optimizer("adamw", model)
    times, losses = _timed_loop(cfg, _data_parallel_step(model, opt, cfg, rank, world))
    _report(rank, world, times, losses, base, queue)


class _StageModule(nn.Module):
    """Blocks [lo, hi) of a GPT; the first stage adds the embeddings, the last the head."""

    def __init__(self, gpt: GPT, lo: int, hi: int):
        super().__init__()
        self.first, self.last = lo == 0, hi == len(gpt.blocks)
        if self.first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        if self.last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # x: idx [b, T] -> [b, T, C]
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x  # [b, T, V] or [b, T, C]


def block_ranges(n_layer: int, num_stages: int) -> list[tuple[int, int]]:
    """Even split of ``n_layer`` blocks into ``num_stages`` ranges [lo, hi)."""
    if n_layer % num_stages:
        raise ValueError(f"{n_layer} blocks do not split evenly into {num_stages} stages")
    k = n_layer // num_stages
    return [(s * k, (s + 1) * k) for s in range(num_stages)]


def pipeline_rank(cfg: BenchConfig, rank: int, world: int, schedule: str = "1f1b"):
    """(schedule, optimizer) of this rank's ``torch.distributed.pipelining`` stages, ``cfg.microbatches``
    microbatches: for 'gpipe' and '1f1b' one stage, blocks ``block_ranges(cfg.n_layer, world)[rank]``;
    for 'interleaved' (``ScheduleInterleaved1F1B``) two of ``2 * world`` stages, ``rank`` and
    ``rank + world`` (its loop order); 'zb-h1' is ``ScheduleInterleavedZeroBubble`` (the paper's
    ZB1P, ZB-H1 with virtual stages) with one stage a rank, that is ZB-H1."""
    from torch.distributed import pipelining as pp

    loops = 2 if schedule == "interleaved" else 1
    ranges = block_ranges(cfg.n_layer, world * loops)
    gpt = build_model(cfg)
    modules = [_StageModule(gpt, *ranges[rank + k * world]) for k in range(loops)]
    opt = make_optimizer("adamw", nn.ModuleList(modules))
    stages = [pp.PipelineStage(m, rank + k * world, world * loops, torch.device("cpu"))
              for k, m in enumerate(modules)]
    # scale_grads=True (default): gradients are divided by the microbatch count,
    # so with a mean loss per microbatch they equal the full-batch gradient.
    if schedule == "interleaved":
        return pp.ScheduleInterleaved1F1B(stages, cfg.microbatches, loss_fn=lm_loss), opt
    if schedule == "zb-h1":
        return pp.ScheduleInterleavedZeroBubble(stages, cfg.microbatches, loss_fn=lm_loss), opt
    kind = {"1f1b": pp.Schedule1F1B, "gpipe": pp.ScheduleGPipe}[schedule]
    return kind(stages[0], cfg.microbatches, loss_fn=lm_loss), opt


def pipeline_step(schedule, opt, rank: int, world: int, idx: torch.Tensor, tgt: torch.Tensor) -> float | None:
    """One training step of a pipeline rank; the mean microbatch loss on the last rank, else None."""
    losses: list[torch.Tensor] = []
    opt.zero_grad()
    if rank == 0:
        schedule.step(idx)
    elif rank == world - 1:
        schedule.step(target=tgt, losses=losses)
    else:
        schedule.step()
    opt.step()
    return float(torch.stack(losses).detach().mean()) if losses else None


def _pipeline_worker(rank: int, world: int, port: int, cfg: BenchConfig, queue, schedule: str = "1f1b") -> None:
    _init_rank(rank, world, port)
    base = current_rss_mb()
    sched, opt = pipeline_rank(cfg, rank, world, schedule)
    times, losses = _timed_loop(cfg, lambda idx, tgt: pipeline_step(sched, opt, rank, world, idx, tgt))
    _report(rank, world, times, losses, base, queue)


def _spawn(worker, world: int, cfg: BenchConfig) -> dict:
    """Run ``worker`` on ``world`` fresh gloo ranks; rank 0's summary dict."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # size the pools before torch loads in the children
    try:
        mp.spawn(worker, args=(world, free_port(), cfg, queue), nprocs=world, join=True)
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    out = queue.get()
    out["step_s"] = median(out["per_step_s"][cfg.warmup_steps:])
    return out


def parse_measuring_args(ap, argv: list[str] | None):
    """``ap``'s arguments, with what every measuring script runs under: INFO logging with
    times on stderr (stdout is the JSON lines) and one torch thread in this process."""
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    return args


def emit(row: dict, out_path: str | None) -> None:
    """Print ``row`` as one JSON line, and append it to ``out_path`` where one is given (``--out``)."""
    line = json.dumps(row)
    print(line, flush=True)
    if out_path:
        with open(out_path, "a") as f:
            f.write(line + "\n")


def select(ap, text: str, allowed, what: str) -> list[str]:
    """The comma-separated names in ``text``, each one of ``allowed``; else ``ap.error``
    naming the unknown ones (``what``: 'case', 'plan', ...)."""
    names = [n for n in text.split(",") if n]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        ap.error(f"unknown {what}(s) {unknown}; choose from {list(allowed)}")
    return names


def run_torch_ddp(cfg: BenchConfig, world: int) -> dict:
    """DistributedDataParallel over ``world`` gloo ranks, batch split evenly."""
    if cfg.global_batch % world:
        raise ValueError(f"global batch {cfg.global_batch} does not split over {world} ranks")
    return _spawn(_ddp_worker, world, cfg)


def run_torch_pipeline(cfg: BenchConfig, num_stages: int) -> dict:
    """Schedule1F1B over ``num_stages`` ranks, one block range per rank."""
    block_ranges(cfg.n_layer, num_stages)  # validates the split
    if cfg.global_batch % cfg.microbatches:
        raise ValueError(f"global batch {cfg.global_batch} does not split into {cfg.microbatches} microbatches")
    return _spawn(_pipeline_worker, num_stages, cfg)
