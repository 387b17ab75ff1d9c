"""The model object between steps: what a loop that never reads it pays, and what a read costs.

Usage (from the repository root; about three minutes)::

    python bench/model_reads.py                  # GPT (d 256, 4 layers, T 128), Cluster.local(1, 2)
    python bench/model_reads.py --rounds 3 --steps 12

``parallelize(train_step, Cluster.local(1, 2), tune=False)`` trains the GPT; after 3 untimed
steps, each round times ``--steps`` steps in three ways, in this order, on the same workers:

- ``never_reads``: the loop only calls the step (the default, the model's hooks installed:
  ``alpa_torch/live.py``);
- ``hooks_removed``: the same loop with the hooks taken off the model and the optimizer
  (a diagnostic baseline: what the step costs without the mechanism);
- ``reads_every_step``: ``model.state_dict()`` after every step (each read brings the model's
  state from the workers in one gather; the time of the read is reported apart).

One JSON line per way and round (median and 90th percentile of an iteration as the driver
sees it: the step call, and the read after it; for reads, the median read, which first waits
for the rest of the step, and the bytes it moves), then a summary line with each way's
median over the rounds and ``never_reads / hooks_removed``: the target is that a loop that
never reads keeps its step time (the ratio within the rounds' own spread).
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import BenchConfig, build_model, global_batch
from _plans import dumps, machine_info

from alpa_torch.zoo import make_optimizer

MODEL = dict(vocab_size=4096, block_size=128, n_layer=4, n_head=4, n_embd=256, global_batch=16)


def _timed(step, model, opt, cfg, start: int, steps: int, read: bool) -> tuple[list[float], list[float]]:
    """Per iteration: the wall time of the step call and the read after it (if any); and the reads'.
    A step answers once the forward has its loss (``runtime/worker.py``), so a read right after it
    first waits for the step's backward and update: only the two together compare."""
    times, reads = [], []
    for i in range(start, start + steps):
        t0 = time.perf_counter()
        float(step(model, opt, global_batch(cfg, i)))
        if read:
            t1 = time.perf_counter()
            model.state_dict()
            reads.append(time.perf_counter() - t1)
        times.append(time.perf_counter() - t0)
    return times, reads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from alpa_torch import Cluster, parallelize
    from alpa_torch.zoo import train_step

    cfg = BenchConfig(**MODEL)
    model = build_model(cfg)
    opt = make_optimizer("adamw", model)
    step = parallelize(train_step, Cluster.local(1, 2), tune=False)
    info = machine_info()
    results: dict[str, list[float]] = {}
    try:
        n = 0
        for _ in range(3):
            float(step(model, opt, global_batch(cfg, n)))
            n += 1
        state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        for r in range(args.rounds):
            for way in ("never_reads", "hooks_removed", "reads_every_step"):
                live = step._live
                if way == "hooks_removed":
                    live.detach()
                times, reads = _timed(step, model, opt, cfg, n, args.steps, way == "reads_every_step")
                n += args.steps
                if way == "hooks_removed":  # put the hooks back for the next way
                    for obj in [*model.modules(), opt]:
                        obj.__class__ = live._watched(type(obj))
                med = statistics.median(times)
                results.setdefault(way, []).append(med)
                line = {"bench": "model_reads", "way": way, "round": r, "steps": args.steps, "model": cfg.describe(),
                        "cluster": "1x2", "iteration_median_ms": round(1e3 * med, 2),
                        "iteration_p90_ms": round(1e3 * sorted(times)[int(0.9 * (len(times) - 1))], 2), **info}
                if reads:
                    line.update(read_median_ms=round(1e3 * statistics.median(reads), 2), read_bytes=state_bytes)
                print(dumps(line), flush=True)
    finally:
        step.shutdown()
    medians = {way: statistics.median(v) for way, v in results.items()}
    spread = {way: round(max(v) / min(v), 3) for way, v in results.items()}
    print(dumps({"bench": "model_reads", "summary": True, "rounds": args.rounds,
                 **{f"{way}_ms": round(1e3 * m, 2) for way, m in medians.items()},
                 "never_reads_over_hooks_removed": round(medians["never_reads"] / medians["hooks_removed"], 3),
                 "round_spread": spread, **info}), flush=True)


if __name__ == "__main__":
    main()
