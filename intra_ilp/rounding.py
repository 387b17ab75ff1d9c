"""An integral point from a fractional LP relaxation of the reduced sharding ILP.

Owns: ``dive`` and ``round_lp`` (a feasible strategy choice, one index per reduced
variable of a ``reduce.ReducedProblem``, near the LP optimum), ``improve`` (local
search) and ``evaluate`` (objective and memory rows of a choice). Pure numpy; the
LP re-solves of the dive come through a callback (``highs_direct.HighsDirect.fix``).
``ilp.py`` uses them after a fractional LP (rounding and local search first, the
dives only if that point is not close enough): a point within ``mip_gap`` of the LP
bound is an answer as good as the MIP's tolerance allows (the bound is a lower
bound of the ILP optimum); otherwise it is the MIP's start.

Least-memory rounding (``round_lp``). A variable takes, of the strategies in its
LP support (x > 1e-6), the one with the least memory coefficient (summed over
its rows). With one memory row (a stage has one liveness point) the rounded
memory is <= the LP's <= the budget, so the point is feasible. Edges need
nothing: any integral x has one ``e``, the product of its marginals.

Diving (``dive``, a standard MIP primal heuristic). The LP optimum of a
knapsack-coupled problem mixes an under-budget and an over-budget integral
solution on a few variables. Repeatedly: take the fractional variable nearest
to integral, fix it to its largest-x strategy and re-solve the LP (a warm
start: a few dual simplex pivots); if that LP is infeasible, fix it to its
least-memory strategy instead, which is always feasible (the least-memory
rounding of the current point satisfies every fixing). It ends when the LP
point is integral. A second dive fixes each variable to its least-memory
strategy straight away; ``ilp.py`` keeps the better end point. Measured on GPT-3 39B layer ILPs with a binding memory
cap: least-memory rounding alone lands 1.4-2.7 % above the LP bound, the
dive 0.01-0.8 % (HiGHS's MIP, 1-4 s: 0.01-0.8 %).

Improvement (``improve``). Greedy coordinate descent: each variable in turn
moves to the strategy that lowers the objective most (node cost plus its
edges at the neighbours' strategies) with every memory row within budget;
passes repeat until none improves (at most ``MAX_PASSES``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from intra_ilp.reduce import ReducedProblem

SUPPORT_TOL = 1e-6
MAX_PASSES = 8
MAX_DIVE_STEPS = 40


def _var_rows(prob: ReducedProblem) -> list[list[tuple[int, np.ndarray]]]:
    """Per variable: (row index, coefficient per strategy) of the memory rows it is in."""
    out: list[list[tuple[int, np.ndarray]]] = [[] for _ in prob.num_strategies]
    for r, row in enumerate(prob.memory_rows):
        for i, c in row.terms:
            out[i].append((r, np.asarray(c, dtype=float)))
    return out


def evaluate(prob: ReducedProblem, choice) -> tuple[float, np.ndarray]:
    """(objective, value of each memory row) of an integral ``choice``."""
    obj = prob.offset_s + sum(float(c[s]) for c, s in zip(prob.cost_s, choice))
    obj += sum(float(r[choice[a], choice[b]]) for a, b, r in prob.edges)
    rows = np.array([row.constant_bytes + sum(float(c[choice[i]]) for i, c in row.terms)
                     for row in prob.memory_rows], dtype=float)
    return obj, rows


def _least_memory(xv: np.ndarray, rows: list[tuple[int, np.ndarray]]) -> int:
    """The least-memory strategy in the support of ``xv`` (ties: the larger x)."""
    support = np.flatnonzero(xv > SUPPORT_TOL)
    if len(support) <= 1 or not rows:
        return int(np.argmax(xv))
    weight = sum(c for _, c in rows)[support]
    best = support[weight == weight.min()]
    return int(best[np.argmax(xv[best])])


def round_lp(prob: ReducedProblem, x_values: list[np.ndarray]) -> tuple[int, ...]:
    """Least-memory rounding of the LP point (module docstring)."""
    var_rows = _var_rows(prob)
    return tuple(_least_memory(xv, var_rows[i]) for i, xv in enumerate(x_values))


def _fractional(xv: np.ndarray) -> bool:
    return bool(np.max(np.minimum(xv, 1.0 - xv)) > SUPPORT_TOL)


def dive(prob: ReducedProblem, x_values: list[np.ndarray], fix: Callable[[int, int], list[np.ndarray] | None],
         toward: str = "nearest") -> tuple[int, ...] | None:
    """Fix fractional variables one by one, re-solving the LP each time (module docstring).

    ``fix(var, strategy)`` allows only ``strategy`` of ``var`` (replacing an earlier fix of
    it), re-solves and returns the new x values, or None if that LP is infeasible.
    ``toward='memory'`` fixes each variable to its least-memory strategy at once (never
    infeasible; better where the nearest choice leads the LP astray). Returns the integral
    choice the dive ends at, or None (no end within ``MAX_DIVE_STEPS``).
    """
    var_rows, xs = _var_rows(prob), x_values
    for _ in range(MAX_DIVE_STEPS):
        frac = [i for i, xv in enumerate(xs) if _fractional(xv)]
        if not frac:
            return tuple(int(np.argmax(xv)) for xv in xs)
        i = max(frac, key=lambda v: (float(xs[v].max()), -v))
        low = _least_memory(xs[i], var_rows[i])
        near = low if toward == "memory" else int(np.argmax(xs[i]))
        new = fix(i, near)
        if new is None and low != near:
            new = fix(i, low)
        if new is None:
            return None
        xs = new
    return None


def improve(prob: ReducedProblem, choice) -> tuple[int, ...]:
    """Greedy single-variable moves that lower the objective within the budget (docstring)."""
    choice = list(choice)
    incident: list[list[tuple[np.ndarray, int, bool]]] = [[] for _ in prob.num_strategies]
    for a, b, r in prob.edges:
        incident[a].append((r, b, True))
        incident[b].append((r, a, False))
    var_rows = _var_rows(prob)
    _, rows = evaluate(prob, choice)
    budget = prob.memory_budget_bytes
    for _ in range(MAX_PASSES):
        moved = False
        for i, cost in enumerate(prob.cost_s):
            if len(cost) == 1:
                continue
            delta = np.asarray(cost, dtype=float).copy()
            for r, j, src in incident[i]:
                delta += r[:, choice[j]] if src else r[choice[j], :]
            ok = np.ones(len(delta), dtype=bool)
            for t, c in var_rows[i]:
                ok &= rows[t] - c[choice[i]] + c <= budget
            delta = np.where(ok, delta - delta[choice[i]], np.inf)
            s = int(np.argmin(delta))
            if delta[s] < -1e-12 * max(1.0, abs(float(cost[choice[i]]))):
                for t, c in var_rows[i]:
                    rows[t] += c[s] - c[choice[i]]
                choice[i], moved = s, True
        if not moved:
            break
    return tuple(choice)
