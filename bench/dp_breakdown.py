"""Diagnostic: where the planner's data-parallel step of a ``vs_pytorch.py`` workload spends its time.

Usage (from the repository root; about a minute)::

    python bench/dp_breakdown.py deep_1x2

Plans the workload's GPT with ``pipeline=False, sharding=False`` (the data-parallel candidate of
``alpa_torch/tune.py``), runs it on the runtime's workers (``_plans.run_on_workers``: 2 warm-up
steps, 5 timed, then 3 with the per-worker timers of ``runtime_vs_torch.py --breakdown``) and
prints one JSON line: the plan, its predicted and measured step, the per-rank breakdown
(operators, DTensor redistributions and their count, gradient buckets, flat collectives) and
every place the plan reshards a value (operator, phase, input, from -> to).
"""

from __future__ import annotations

import sys

from _common import BenchConfig, global_batch, parse_measuring_args
from _plans import dumps, machine_info, plan_deployer, run_on_workers, workload
from vs_pytorch import WORKLOADS


def reshards(graph, sharding) -> list[str]:
    """'phase op node <- input: from -> to' for every operator input the plan reshards."""
    out = []
    for name, specs in sharding.input_specs.items():
        node = graph.nodes.get(name)
        for a, spec in zip(node.inputs if node else (), specs):
            src = sharding.value_specs.get(a)
            if src is not None and str(src) != str(spec):
                out.append(f"{node.phase} {node.target} {name} <- {a}: {src} -> {spec}")
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    from alpa_torch.api import ParallelStep
    from alpa_torch.core.cluster import Cluster
    from alpa_torch.zoo import train_step
    from runtime.ray_env import ensure_ray, stop_ray

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    args = parse_measuring_args(ap, argv)
    w = WORKLOADS[args.workload]
    cfg = BenchConfig(**w.model)
    wl = workload(cfg)
    cluster = Cluster.local(w.hosts, w.devices)
    started = ensure_ray(cluster)
    try:
        step = ParallelStep(train_step, cluster, plan_cache=False, tune=False, pipeline=False, sharding=False)
        plan = step.make_plan(wl.model, wl.optimizer, global_batch(cfg, 0))
        res = run_on_workers(cluster, plan_deployer(plan, wl, cluster), wl, warmup=2, timed=5, breakdown_steps=3,
                             live_steps=0)
    finally:
        if started:
            stop_ray()
    print(dumps({"workload": args.workload, "plan": plan.summary(), "predicted_step_s": plan.predicted_step_s,
                 "step_s": res["step_s"], "breakdown": res["breakdown"],
                 "reshards": reshards(step.graph, plan.stages[0].sharding), "machine": machine_info()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
