"""Driver memory as models grow: the driver holds no full tensor of a model built on the meta device.

Usage (from the repository root; about 6 minutes on 2 cores)::

    python bench/driver_memory.py                  # every size, eager check on the small ones
    python bench/driver_memory.py --sizes s,m --out /tmp/dm.jsonl

Each size is a GPT (``alpa_torch.zoo.GPT``, vocabulary 512, 64 tokens, batch 4; ``SIZES``)
built under ``alpa_torch.empty_weights()`` and trained ``--steps`` AdamW steps on
``Cluster.local(1, 4)`` with ``parallelize(..., pipeline=False, memory_budget_bytes=B)``: one
stage on the four devices whose budget ``B`` (40 % of the replicated footprint) makes the
planner shard the weights and optimizer state (a ZeRO-like plan), initialised on the workers
(``init_fn=GPT._init_weights``), planned afresh (no plan cache: a cached plan skips the search
and its memory, so the driver's peak would depend on earlier runs). Each size runs in its own
process; one JSON line each: parameters, full AdamW state bytes (weights + two moments, fp32),
the driver's peak RSS and its RSS before the first call, each worker's peak RSS and the state
bytes it holds, seconds to the first step, losses; ``--eager`` sizes also run eagerly in
another process from ``alpa_torch.init_weights`` (the same initialisation on one device) and
report the largest loss difference. A summary line gives the driver's peak growth from the
smallest to the largest size (target <= 10 %) and each worker's share of the state (target
about 1/4).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

SIZES = {  # name: (n_embd, n_layer); n_head = n_embd // 64. The default series grows the width at a
    # fixed depth (14.6M to 247.5M parameters, 17x): the same graph, so the driver's share that
    # grows with the number of operators (capture, planning) stays out of the comparison.
    "s": (384, 8), "m": (768, 8), "l": (1152, 8), "xl": (1600, 8),
    "deep-s": (256, 4), "deep-xl": (1024, 24),  # depth: 1,236 -> 6,916 operators (diagnostic)
}
DEFAULT = ("s", "m", "l", "xl")
EAGER = ("s", "m", "l")
VOCAB, TOKENS, BATCH, SEED = 512, 64, 4, 0


def _config(size: str):
    from alpa_torch.zoo import GPTConfig

    n_embd, n_layer = SIZES[size]
    return GPTConfig(vocab_size=VOCAB, block_size=TOKENS, n_layer=n_layer, n_head=n_embd // 64, n_embd=n_embd)


def _batches(steps: int):
    import torch

    gen = torch.Generator().manual_seed(SEED)
    return [(torch.randint(0, VOCAB, (BATCH, TOKENS), generator=gen), torch.randint(0, VOCAB, (BATCH, TOKENS),
                                                                                    generator=gen))
            for _ in range(steps)]


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _worker_memory(state: dict) -> dict:
    """Inside a worker: its peak RSS and the bytes of the state shards it holds."""
    import resource as res

    from torch.distributed.tensor import DTensor

    held = 0
    for value in state["runner"].state.values():
        local = value.to_local() if isinstance(value, DTensor) else value
        held += local.numel() * local.element_size()
    return {"peak_rss_bytes": res.getrusage(res.RUSAGE_SELF).ru_maxrss * 1024, "state_bytes": held}


def child(size: str, steps: int) -> dict:
    """One size, parallel, in this process."""
    import torch

    import alpa_torch
    from alpa_torch import Cluster, parallelize
    from alpa_torch.zoo import GPT, train_step

    torch.manual_seed(SEED)
    cfg = _config(size)
    with alpa_torch.empty_weights():
        model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    state_bytes = 3 * 4 * params  # fp32 weights + AdamW's exp_avg and exp_avg_sq
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = _batches(steps)
    rss_before = _rss_bytes()
    step = parallelize(train_step, Cluster.local(1, 4), pipeline=False, init_fn=GPT._init_weights, tune=False,
                       memory_budget_bytes=0.4 * 4 * state_bytes, plan_cache=False)  # planned here, every run
    try:
        t0 = time.perf_counter()
        losses = [float(step(model, optimizer, batches[0]))]
        first_s = time.perf_counter() - t0
        losses += [float(step(model, optimizer, b)) for b in batches[1:]]
        workers = step.group.call_all(_worker_memory)
    finally:
        step.shutdown()
    return {"size": size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "params": params,
            "adamw_state_bytes": state_bytes, "driver_rss_before_bytes": rss_before,
            "driver_peak_rss_bytes": _peak_rss_bytes(), "worker_peak_rss_bytes": [w["peak_rss_bytes"] for w in workers],
            "worker_state_bytes": [w["state_bytes"] for w in workers],
            "worker_state_share": [round(w["state_bytes"] / state_bytes, 4) for w in workers],
            "seconds_to_first_step": round(first_s, 2), "losses": losses}


def eager(size: str, steps: int) -> dict:
    """One size on one device, from the same initialisation (``alpa_torch.init_weights``)."""
    import torch

    import alpa_torch
    from alpa_torch.zoo import GPT, train_step

    with alpa_torch.empty_weights():
        model = GPT(_config(size))
    alpa_torch.init_weights(model, GPT._init_weights, seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"losses": [float(train_step(model, optimizer, b).detach()) for b in _batches(steps)]}


def _run(mode: str, size: str, steps: int) -> dict:
    out = subprocess.run([sys.executable, __file__, f"--{mode}", size, "--steps", str(steps)], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} {size} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=",".join(DEFAULT), help=f"comma-separated, of {list(SIZES)}")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--eager", default=",".join(EAGER), help="sizes also run eagerly (empty: none)")
    p.add_argument("--out", help="append the JSON lines to this file too")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--eager-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child or args.eager_child:
        print(json.dumps(child(args.child, args.steps) if args.child else eager(args.eager_child, args.steps)))
        return 0
    from _plans import machine_info  # bench/ is on the path of a script run from it

    sizes = args.sizes.split(",")
    lines = []
    for size in sizes:
        line = {"bench": "driver_memory", **machine_info(), **_run("child", size, args.steps)}
        if size in args.eager.split(","):
            ref = _run("eager-child", size, args.steps)["losses"]
            line["eager_losses"] = ref
            line["max_loss_diff"] = max(abs(a - b) for a, b in zip(line["losses"], ref))
        lines.append(line)
        print(json.dumps(line), flush=True)
    first, last = lines[0], lines[-1]
    shares = [s for line in lines for s in line["worker_state_share"]]
    summary = {"bench": "driver_memory", "summary": True, **machine_info(),
               "params_range": [first["params"], last["params"]],
               "params_ratio": round(last["params"] / first["params"], 1),
               "driver_peak_growth": round(last["driver_peak_rss_bytes"] / first["driver_peak_rss_bytes"] - 1, 4),
               "target_driver_peak_growth": 0.10, "worker_state_share_range": [min(shares), max(shares)],
               "max_loss_diff": max((line.get("max_loss_diff", 0.0) for line in lines), default=0.0)}
    lines.append(summary)
    print(json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
