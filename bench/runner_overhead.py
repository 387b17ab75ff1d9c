"""Diagnostic: the runtime's own cost per operator, one device, against eager PyTorch on the same step.

Usage (from the repository root; about a minute)::

    python bench/runner_overhead.py                      # GPT 8 layers, width 32, T 16, batch 1
    python bench/runner_overhead.py --width 128 --block 64 --batch 4

The seeded GPT of the benchmarks (``_plans.workload``) is captured with its AdamW step and
run by a ``StageRunner`` on a one-device mesh in this process (no Ray, no collectives: what
is left is the runtime's per-operator work around the kernels), and by eager PyTorch
(forward, backward, ``AdamW.step``) on the same model, one torch thread each, alternating,
``--steps`` steps per round after 3 untimed ones, ``--rounds`` rounds. One JSON line: the
median step of each, the number of program steps the runner executes, and
``overhead_us_per_op`` = (runner - eager) / steps.
At a tiny size the kernels are short and the difference is the runtime's own Python.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import BenchConfig, build_model, global_batch
from _plans import dumps, machine_info, workload


def main(argv: list[str] | None = None) -> int:
    from alpa_torch.core.cluster import Cluster
    from alpa_torch.zoo import lm_loss, make_optimizer
    from intra_ilp.cost_model import MeshCost
    from intra_ilp.stage import solve_stage
    from runtime.interpreter import StageRunner, serialize_graph
    from runtime.profile import _OneDevice

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--block", type=int, default=16, help="sequence length")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = BenchConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                      n_embd=args.width, global_batch=args.batch)
    wl = workload(cfg)
    graph, functional = wl.graph, wl.functional
    sharding = solve_stage(graph, MeshCost.from_cluster(Cluster.local(1, 1), (1, 1), (1, 1)))
    io = {"inputs": [(s.kind, s.name, s.node) for s in graph.inputs],
          "outputs": [(s.kind, s.name, s.node) for s in graph.outputs]}
    runner = StageRunner(serialize_graph(graph.gm), {k: str(v) for k, v in sharding.value_specs.items()},
                         {k: [str(s) for s in v] for k, v in sharding.input_specs.items()}, io, _OneDevice("cpu"))
    runner.load_state(wl.state)
    batch = global_batch(cfg, 0)
    feed = {"batch.0": batch[0].numpy(), "batch.1": batch[1].numpy()}
    feed.update({k: v.numpy() for k, v in graph.loss_norms(feed).items()})
    scalars = graph.host_inputs(functional.host_scalars())  # as Engine.step does
    eager_model = build_model(cfg)
    eager_opt = make_optimizer("adamw", eager_model)
    count = [0]

    def runner_step():
        count[0] += 1
        runner.step(feed, scalars)

    def eager_step():
        eager_opt.zero_grad()
        lm_loss(eager_model(batch[0]), batch[1]).backward()
        eager_opt.step()

    def timed(fn) -> float:
        times = []
        for _ in range(3 + args.steps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[3:])

    rounds = [(timed(runner_step), timed(eager_step)) for _ in range(args.rounds)]
    run_s = statistics.median(r for r, _ in rounds)
    eager_s = statistics.median(e for _, e in rounds)
    steps = len(runner.program.steps)
    print(dumps({"config": vars(args), "torch_threads": torch.get_num_threads(), "program_steps": steps,
                 "runner_step_ms": round(run_s * 1e3, 2), "eager_step_ms": round(eager_s * 1e3, 2),
                 "overhead_us_per_op": round((run_s - eager_s) / steps * 1e6, 2),
                 "rounds_ms": [[round(r * 1e3, 2), round(e * 1e3, 2)] for r, e in rounds],
                 "machine": machine_info()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
