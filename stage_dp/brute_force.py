"""Brute-force references for the stage DP and the layer clustering (tests only).

Owns nothing the planner runs: these enumerate every plan, so they are
exponential and meant for L <= 5 layers, D <= 4 devices, n <= 10 ops. They
share only input validation with the fast code and define the tie-breaking the
fast code must reproduce:

- stage DP: least (T, max t_k, sum t_k, number of stages, stages tuple), with
  sum = t_0 + (t_1 + (... + t_{K-1})) and T = sum + w * max (w: ``dp.slowest_weight``);
- clustering: least (max C, sum C, max layer FLOPs, boundaries), with layer
  FLOPs = prefix[b] - prefix[a] over ``np.cumsum`` prefixes, at the first
  imbalance of the relaxation sequence that admits a plan.
"""

from __future__ import annotations

import itertools

import numpy as np

from .dp import NoFeasiblePlanError, StageDPResult, slowest_weight, validate_inputs
from .layering import LayerClustering, imbalance_schedule, layer_bounds, validate_graph


def _stage_choices(cost, mns, sizes, num_devices, l, i):
    """Usable (s, c, cost, mns) for stage l..i."""
    return [(s, c, float(cost[l, i, s, c]), int(mns[l, i, s, c]))
            for s in range(cost.shape[2]) for c in range(cost.shape[3])
            if np.isfinite(cost[l, i, s, c]) and mns[l, i, s, c] >= 0
            and sizes[s] <= num_devices]


def _plans(cost, mns, sizes, num_devices, max_stages):
    """Every feasible plan as a tuple of (l, i, s, c, cost)."""
    num_layers = cost.shape[0]
    for cuts in itertools.product((False, True), repeat=num_layers - 1):
        starts = [0] + [j + 1 for j, cut in enumerate(cuts) if cut]
        bounds = list(zip(starts, [s - 1 for s in starts[1:]] + [num_layers - 1]))
        if max_stages is not None and len(bounds) > max_stages:
            continue
        options = [_stage_choices(cost, mns, sizes, num_devices, l, i) for l, i in bounds]
        for pick in itertools.product(*options):
            n_stages = len(pick)
            if sum(int(sizes[s]) for s, _, _, _ in pick) != num_devices:
                continue
            if any(m < n_stages - 1 - k for k, (_, _, _, m) in enumerate(pick)):
                continue
            yield tuple((l, i, s, c, t) for (l, i), (s, c, t, _) in zip(bounds, pick))


def brute_force_stage_dp(stage_cost_s, max_n_succ_stages, submesh_sizes, num_devices,
                         num_microbatches, *, schedule=None, max_stages=None, use_numba=None) -> StageDPResult:
    """Same contract as ``solve_stage_dp``, by enumeration (``use_numba`` ignored)."""
    cost, mns, sizes = validate_inputs(stage_cost_s, max_n_succ_stages, submesh_sizes,
                                       num_devices, num_microbatches, max_stages)
    w, best_key = slowest_weight(schedule, num_microbatches), None
    for plan in _plans(cost, mns, sizes, int(num_devices), max_stages):
        sum_s = 0.0
        for stage in reversed(plan):
            sum_s = stage[4] + sum_s
        t_max_s = max(stage[4] for stage in plan)
        total_s = sum_s + w * t_max_s
        key = (total_s, t_max_s, sum_s, len(plan), tuple(st[:4] for st in plan))
        if best_key is None or key < best_key:
            best_key = key
    if best_key is None:
        raise NoFeasiblePlanError("brute force: no feasible plan")
    total_s, t_max_s, sum_s, _, stages = best_key
    return StageDPResult(total_s=total_s, t_max_s=t_max_s, sum_s=sum_s,
                         stages=tuple(tuple(int(x) for x in st) for st in stages),
                         num_tmax_evaluated=0)


def brute_force_cluster_layers(flops, edge_src, edge_dst, edge_bytes, num_layers, *,
                               imbalance=0.5, use_numba=None) -> LayerClustering:
    """Same contract as ``cluster_layers_detailed``, by enumeration of all boundaries."""
    flops, edge_src, edge_dst, edge_bytes = validate_graph(
        flops, edge_src, edge_dst, edge_bytes, num_layers)
    n = flops.size
    prefix = np.concatenate(([0.0], np.cumsum(flops)))
    for imb in imbalance_schedule(imbalance, num_layers):
        cap, floor = layer_bounds(prefix[n], num_layers, imb)
        best = None
        for inner in itertools.combinations(range(1, n), num_layers - 1):
            bounds = (0,) + inner + (n,)
            fl = [prefix[b] - prefix[a] for a, b in zip(bounds[:-1], bounds[1:])]
            if max(fl) > cap or min(fl) < floor:
                continue
            c = [int(edge_bytes[(edge_src < a) & (edge_dst >= a) & (edge_dst < b)].sum())
                 for a, b in zip(bounds[:-1], bounds[1:])]
            key = (max(c), sum(c), max(fl), bounds[:-1], c, fl)
            if best is None or key < best:
                best = key
        if best is not None:
            return LayerClustering(
                boundaries=np.asarray(best[3], np.int64),
                layer_flops=np.asarray(best[5], np.float64),
                layer_in_bytes=np.asarray(best[4], np.int64), imbalance=imb)
    raise AssertionError("the relaxation always ends feasible")
