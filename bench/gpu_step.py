"""Diagnostic: ``parallelize`` on one CUDA device against the same eager step on that device.

Usage (on a machine with a GPU, from the repository root; about a minute)::

    python bench/gpu_step.py                       # GPT 8 layers, width 1024, T 512, batch 8 (118 M params)
    python bench/gpu_step.py --layers 2 --width 256 --block 128

A seeded zoo GPT and a deep copy of it train with AdamW in fp32 on ``cuda:0``: the copy
through ``parallelize(train_step, cluster)`` (one Ray worker holding the GPU, NCCL backend,
the plan found by itself), the original eagerly in this process. The first ``--check`` steps
alternate and compare losses; then ``--steps`` steps of each are timed (``cuda.synchronize``
around each). One JSON line: the loss differences, planning plus the first steps, and the median
step of each. What is left between the two is the runtime's own cost around the kernels on a GPU
(the driver's call into Ray, the worker's program of DTensor operations). Without CUDA it exits 2.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from _plans import dumps, machine_info


def main(argv: list[str] | None = None) -> int:
    import ray

    from alpa_torch import parallelize
    from alpa_torch.core.cluster import Cluster
    from alpa_torch.zoo import GPT, GPTConfig, make_optimizer, train_step
    from runtime.discovery import builtin_device_for_cuda

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--block", type=int, default=512, help="sequence length")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--check", type=int, default=3, help="steps compared against eager first")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_step.py needs a CUDA device; none is visible here.")
        return 2
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.width)
    cluster = Cluster.simulated(1, 1, builtin_device_for_cuda(torch.cuda.get_device_name(0)) or "a100-80gb")
    ray.init(address="local", num_gpus=1, include_dashboard=False)
    torch.manual_seed(0)
    eager = GPT(cfg).cuda()
    model = copy.deepcopy(eager)
    eager_opt, opt = make_optimizer("adamw", eager), make_optimizer("adamw", model)
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(cfg.vocab_size, (args.batch, args.block), generator=gen).cuda() for _ in "xy")
               for _ in range(4)]

    def eager_step(i: int) -> float:
        return float(train_step(eager, eager_opt, batches[i % 4]).detach())

    def timed(fn) -> list[float]:
        times = []
        for i in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(i)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times

    t0 = time.perf_counter()
    step = parallelize(train_step, cluster)
    try:
        diffs = [abs(float(step(model, opt, batches[i % 4])) - eager_step(i)) for i in range(args.check)]
        first_s = time.perf_counter() - t0
        eager_times = timed(eager_step)
        auto_times = timed(lambda i: float(step(model, opt, batches[i % 4])))
    finally:
        step.shutdown()
        ray.shutdown()
    eager_ms, auto_ms = (1e3 * statistics.median(t) for t in (eager_times, auto_times))
    print(dumps({"config": vars(args), "device": torch.cuda.get_device_name(0),
                 "params_M": round(sum(p.numel() for p in eager.parameters()) / 1e6, 1),
                 "loss_abs_diff": diffs, "plan_and_check_steps_s": round(first_s, 2),
                 "eager_step_ms": round(eager_ms, 2), "parallelize_step_ms": round(auto_ms, 2),
                 "parallelize_over_eager": round(auto_ms / eager_ms, 3),
                 "eager_ms": [round(1e3 * t, 2) for t in eager_times],
                 "parallelize_ms": [round(1e3 * t, 2) for t in auto_times], "machine": machine_info()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
