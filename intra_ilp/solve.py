"""Command line: solve a saved intra-op ILP instance and print the plan as one JSON object.

    python -m intra_ilp.solve INSTANCE.json|INSTANCE.npz [--time-limit S] [--gap G]
                              [--no-lp-first] [--no-reduce] [--threads N] [--verbose]

The instance file alone is enough (format: ``intra_ilp/instance.py``). Output
keys: objective_s, compute_s, comm_s, reshard_s, peak_memory_bytes,
memory_budget_bytes, status, gap, build_s, reduce_s, solve_s, num_vars,
num_constraints, used_lp, strategies ({node name: strategy name}).
If no plan fits in memory it prints ``{"status": "infeasible_memory",
"required_bytes": ..., "message": ...}`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

from alpa_torch.core.errors import InfeasibleMemoryError
from intra_ilp.ilp import solve_instance
from intra_ilp.instance import ILPInstance


def _finite_or_none(x: float) -> float | None:
    return None if math.isinf(x) else x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m intra_ilp.solve", description=__doc__.splitlines()[0])
    ap.add_argument("instance", help="instance file (.json or .npz)")
    ap.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="HiGHS time limit, seconds")
    ap.add_argument("--gap", type=float, default=0.01, metavar="G", help="relative MIP gap")
    ap.add_argument("--no-lp-first", action="store_true", help="skip the LP relaxation, solve the MIP directly")
    ap.add_argument("--no-reduce", action="store_true", help="solve the direct model without reductions")
    ap.add_argument("--threads", type=int, default=None, help="HiGHS threads")
    ap.add_argument("--verbose", "-v", action="store_true", help="log progress to stderr")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)

    inst = ILPInstance.load(args.instance)
    try:
        sol = solve_instance(inst, time_limit_s=args.time_limit, mip_gap=args.gap, lp_first=not args.no_lp_first,
                             threads=args.threads, reduce=not args.no_reduce)
    except InfeasibleMemoryError as err:
        print(json.dumps({"status": "infeasible_memory", "required_bytes": err.required_bytes,
                          "memory_budget_bytes": _finite_or_none(inst.memory_budget_bytes), "message": str(err)}))
        print(err, file=sys.stderr)
        return 2
    out = {
        "objective_s": sol.objective_s, "compute_s": sol.compute_s, "comm_s": sol.comm_s,
        "reshard_s": sol.reshard_s, "peak_memory_bytes": sol.peak_memory_bytes,
        "memory_budget_bytes": _finite_or_none(inst.memory_budget_bytes), "status": sol.status, "gap": sol.gap,
        "build_s": sol.build_s, "reduce_s": sol.reduce_s, "solve_s": sol.solve_s, "num_vars": sol.num_vars,
        "num_constraints": sol.num_constraints, "used_lp": sol.used_lp, "metadata": inst.metadata,
        "strategies": sol.strategy_names(inst),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
