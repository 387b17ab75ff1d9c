"""Train the zoo GPT with ``parallelize`` on a Ray cluster of (virtual) devices.

    python examples/train_gpt.py                     # local: 1 host x 2 virtual CPU devices
    python examples/train_gpt.py --hosts 2 --devices 2 --steps 5
    RAY_ADDRESS=127.0.0.1:6379 python examples/train_gpt.py   # a running Ray cluster
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python examples/train_gpt.py

It captures the step, plans its sharding on the cluster, trains, prints the
loss of every step as ``step N loss X`` and, with ``--check``, replays the same
steps eagerly on one device and reports the largest difference.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time

import torch

from alpa_torch import Cluster, cluster_from_ray, parallelize
from alpa_torch.zoo import GPT, GPTConfig, make_batch, make_optimizer, train_step

log = logging.getLogger("train_gpt")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=1, help="hosts of the local virtual cluster")
    p.add_argument("--devices", type=int, default=2, help="virtual devices per host")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--check", action="store_true", help="compare with eager single-device training (exit 1 beyond "
                   "--tolerance)")
    p.add_argument("--tolerance", type=float, default=1e-4, help="--check: largest loss difference")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("ray", "intra_ilp.ilp", "intra_ilp.reduce"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    import ray

    connected = bool(os.environ.get("RAY_ADDRESS")) or ray.is_initialized()
    cluster = cluster_from_ray() if connected else Cluster.local(args.hosts, args.devices)
    log.info("cluster: %s", cluster.describe())

    torch.manual_seed(0)
    model = GPT(GPTConfig.small())  # 4 layers, width 64, vocab 128
    reference = copy.deepcopy(model) if args.check else None
    optimizer = make_optimizer("adamw", model)
    step = parallelize(train_step, cluster)
    try:
        t0 = time.perf_counter()
        losses = []
        for i in range(args.steps):
            loss = float(step(model, optimizer, make_batch("gpt", args.batch, seed=i)))
            losses.append(loss)
            print(f"step {i} loss {loss:.6f}", flush=True)
        log.info("%d steps in %.1f s (first step includes capture, planning and start-up)",
                 args.steps, time.perf_counter() - t0)
        print(f"plan ({step.plan_source}{', compiled' if step.compiled else ''}):\n{step.plan.table()}", flush=True)
        if reference is not None:
            ref_opt = make_optimizer("adamw", reference)
            worst = max(abs(float(train_step(reference, ref_opt, make_batch("gpt", args.batch, seed=i)).detach()) - l)
                        for i, l in enumerate(losses))
            ok = worst <= args.tolerance
            print(f"max |loss - eager loss| = {worst:.3g} ({'ok' if ok else 'FAILED'}, tolerance {args.tolerance:g})",
                  flush=True)
            return 0 if ok else 1
    finally:
        step.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
