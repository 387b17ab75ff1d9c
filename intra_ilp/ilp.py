"""The intra-op sharding ILP: Pyomo model (``build_model``) and HiGHS solve (``solve_instance``).

Input: an ``ILPInstance``, reduced by ``reduce.py`` to a ``ReducedProblem`` with
variables ``i`` (one per group of original nodes, ``k_i`` strategies), node
costs ``c_i``, edges ``(i, j)`` with matrices ``R_ij``, memory rows and, in the
unreduced model only, follower links. Output: an ``ILPSolution`` with one
strategy per *original* node. Building never solves; solving never builds
(``solve_instance`` calls both, in that order).

Formulation (Alpa §4, with AutoParallel's tight edge linearisation)::

    min   offset + sum_i sum_s c_i[s] x[i,s] + sum_(i,j) sum_(a,b) R_ij[a,b] e[(i,j),a,b]

    x[i,s] in {0,1},  e[(i,j),a,b] in [0,1]

    one_hot[i]:         sum_s x[i,s] = 1
    edge_src[(i,j),a]:  sum_b e[(i,j),a,b] = x[i,a]
    edge_dst[(i,j),b]:  sum_a e[(i,j),a,b] = x[j,b]
    memory[t]:          C_t + sum_i sum_s m_ti[s] x[i,s] <= budget
    follow[l,a]:        x[leader,a] <= x[follower, map[a]]   (x[leader,a] <= 0 if map[a] = -1)

``e`` is the joint distribution of the two endpoint choices: its marginals are
``x``. With ``x`` integral the marginals force ``e`` to the one product entry
``e[a*,b*] = 1``, so ``e`` needs no integrality: only ``x`` is binary. The
marginal form is tighter than Alpa's ``e <= x_i, e <= x_j, sum e = 1`` (its LP
relaxation is exact on trees) and has ``k_i + k_j`` rows per edge instead of
``2 k_i k_j + 1``; the LP relaxation is often already integral.

Strategies of ``i`` whose rows of ``R_ij`` are equal (the same output placement reached
from different inputs) share one row of ``e``: ``e`` is indexed by classes of equal rows
and of equal columns, with the marginals summed over each class (``_edge_classes``).
Any ``e`` over classes splits back into one over strategies, in proportion to ``x``
within each class, with the same cost and marginals, so the LP relaxation is the same
(GPT-3 39B's layer ILPs: 46-71k edge columns -> 39-50k; planning 8x8 V100 75 -> 70 s).

Min-peak-memory ILP (for the infeasible-memory message): same variables,
``memory[t]: C_t + sum m_ti[s] x[i,s] <= peak``, objective ``min peak``.

Solve (``lp_first``): relax ``x`` to [0, 1] and solve the LP with HiGHS; if
every ``x`` is within 1e-6 of 0 or 1 the LP optimum is an ILP optimum (it is
feasible and no ILP point can beat the relaxation); otherwise restore
``x`` binary and solve the MIP with the time left.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import pyomo.environ as pe
from pyomo.core.expr.numeric_expr import LinearExpression, MonomialTermExpression

from alpa_torch.core.errors import InfeasibleMemoryError
from intra_ilp import rounding
from intra_ilp.highs_direct import INFEASIBLE, OPTIMAL, STATUS, HighsDirect
from intra_ilp.instance import ILPInstance
from intra_ilp.reduce import ReducedProblem, reduce_instance

log = logging.getLogger(__name__)
INTEGRALITY_TOL = 1e-6


class ILPSolveError(RuntimeError):
    """HiGHS stopped without any feasible plan (time limit too short, numerical failure)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ILPSolution:
    """The chosen strategies and what they cost."""

    strategy_index: tuple[int, ...]
    """per original node, the index into its ``strategy_names``."""
    compute_s: float
    comm_s: float
    reshard_s: float
    objective_s: float
    """compute_s + comm_s + reshard_s, evaluated on the original instance."""
    peak_memory_bytes: float
    """max over liveness points of the per-device memory (constant included)."""
    status: str
    """'optimal' (within ``mip_gap``), 'time_limit', 'iteration_limit' or 'feasible'."""
    gap: float
    """relative MIP gap |objective - bound| / |objective| (0 when proven optimal by the LP)."""
    build_s: float
    """time to reduce the instance and build the Pyomo model."""
    solve_s: float
    """time in HiGHS, including loading the model into it."""
    num_vars: int
    num_constraints: int
    used_lp: bool
    """True when the LP relaxation was integral and no MIP was solved."""
    reduce_s: float = 0.0
    """the part of ``build_s`` spent in ``reduce.py``."""
    extra: dict = field(default_factory=dict)
    """sizes of the reduced problem etc., for logs and benchmarks."""

    def strategy_names(self, instance: ILPInstance) -> dict[str, str]:
        """{node name: chosen strategy name}."""
        return {v.name: v.strategy_names[s] for v, s in zip(instance.nodes, self.strategy_index)}


def _offsets(sizes) -> list[int]:
    """[0, s0, s0 + s1, ...]: where each block of a flat index range starts."""
    return [0] + np.cumsum(np.asarray(sizes, dtype=np.int64)).tolist()


def _rows(m: pe.ConcreteModel, name: str, rows: list) -> None:
    """Add the prebuilt relational expressions ``rows`` as the indexed constraint ``name``."""
    m.add_component(name, pe.Constraint(range(len(rows)), rule=lambda _, r: rows[r]))


def _add_one_hot(m: pe.ConcreteModel, prob: ReducedProblem, x: list, xo: list[int]) -> None:
    """one_hot[i]: sum_s x[i,s] = 1."""
    _rows(m, "one_hot", [LinearExpression(x[xo[i]:xo[i + 1]]) == 1 for i in range(len(prob.num_strategies))])


def _edge_classes(r: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(class of each row of ``r``, class of each column, the matrix of the classes): rows
    (columns) with the same costs in every column (row) are one class."""
    _, row_of = np.unique(r, axis=0, return_inverse=True)
    rows = r[np.unique(row_of, return_index=True)[1]]
    _, col_of = np.unique(rows, axis=1, return_inverse=True)
    return row_of.ravel(), col_of.ravel(), rows[:, np.unique(col_of, return_index=True)[1]]


def _add_edges(m: pe.ConcreteModel, prob: ReducedProblem, x: list, e: list, xo: list[int],
               eo: list[int], classes: list) -> None:
    """edge_src[j,g]: sum_h e[j,g,h] = sum_(a in g) x[i,a];  edge_dst[j,h]: sum_g e[j,g,h] =
    sum_(b in h) x[i',b], over the row classes g and column classes h of R_ij
    (``_edge_classes``; e[j] is row-major G x H)."""
    src, dst = [], []
    for j, ((i, i2, _), (row_of, col_of, rc)) in enumerate(zip(prob.edges, classes)):
        ka, kb = rc.shape
        ej = e[eo[j]:eo[j + 1]]
        src += [LinearExpression(ej[g * kb:(g + 1) * kb] + [MonomialTermExpression((-1, x[xo[i] + a]))
                                                           for a in np.flatnonzero(row_of == g).tolist()]) == 0
                for g in range(ka)]
        dst += [LinearExpression(ej[h::kb] + [MonomialTermExpression((-1, x[xo[i2] + b]))
                                             for b in np.flatnonzero(col_of == h).tolist()]) == 0
                for h in range(kb)]
    _rows(m, "edge_src", src)
    _rows(m, "edge_dst", dst)


def _add_memory(m: pe.ConcreteModel, prob: ReducedProblem, x: list, xo: list[int], peak=None) -> None:
    """memory[t]: C_t + sum_i sum_s m_ti[s] x[i,s] <= budget (or <= peak, the min-peak variable)."""
    rows = []
    for row in sorted(prob.memory_rows, key=lambda r: r.point):
        terms = [float(row.constant_bytes)]
        for i, c in row.terms:
            terms += [MonomialTermExpression((float(c[s]), x[xo[i] + s])) for s in np.flatnonzero(c).tolist()]
        if peak is None:
            rows.append(LinearExpression(terms) <= prob.memory_budget_bytes)
        else:
            rows.append(LinearExpression(terms + [MonomialTermExpression((-1, peak))]) <= 0)
    _rows(m, "memory", rows)


def _add_follow(m: pe.ConcreteModel, prob: ReducedProblem, x: list, xo: list[int]) -> None:
    """follow[l,a]: x[leader,a] <= x[follower,map[a]], or x[leader,a] <= 0 when map[a] = -1."""
    rows = []
    for f, l, mp in prob.links:
        rows += [LinearExpression([x[xo[l] + a]]
                                  + ([MonomialTermExpression((-1, x[xo[f] + int(t)]))] if t >= 0 else [])) <= 0
                 for a, t in enumerate(mp.tolist())]
    _rows(m, "follow", rows)


def build_model(prob: ReducedProblem, *, min_peak: bool = False) -> pe.ConcreteModel:
    """The Pyomo model of ``prob`` (see the module docstring). Does not solve.

    Variables are flat: ``x[xo[i] + s]`` is x[i,s] and ``e[eo[j] + g H + h]`` is
    e[j,g,h] over edge j's G x H classes (``m.x_offsets`` = xo, ``m.e_offsets`` = eo). Every row is a prebuilt
    ``LinearExpression``, about 4x faster to build than summing Pyomo terms.
    """
    assert min_peak or all(row.terms for row in prob.memory_rows), "constant-only memory row in cost model"
    m = pe.ConcreteModel(name="intra_op_min_peak" if min_peak else "intra_op_sharding")
    classes = [_edge_classes(r) for _, _, r in prob.edges]
    xo, eo = _offsets(prob.num_strategies), _offsets([rc.size for _, _, rc in classes])
    m.x = pe.Var(range(xo[-1]), domain=pe.Binary)
    m.e = pe.Var(range(eo[-1]), bounds=(0.0, 1.0))
    m.x_offsets, m.e_offsets = xo, eo
    x, e = list(m.x.values()), list(m.e.values())
    _add_one_hot(m, prob, x, xo)
    _add_edges(m, prob, x, e, xo, eo, classes)
    _add_follow(m, prob, x, xo)
    if min_peak:
        m.peak = pe.Var(bounds=(0.0, None))
        _add_memory(m, prob, x, xo, m.peak)
        m.objective = pe.Objective(expr=m.peak, sense=pe.minimize)
    else:
        _add_memory(m, prob, x, xo)
        coef = np.concatenate([np.asarray(c, dtype=float) for c in prob.cost_s]
                              + [rc.ravel() for _, _, rc in classes] + [np.zeros(0)])
        nz, xe = np.flatnonzero(coef), x + e
        terms = [float(prob.offset_s)] + [MonomialTermExpression((c, xe[k]))
                                          for c, k in zip(coef[nz].tolist(), nz.tolist())]
        m.objective = pe.Objective(expr=LinearExpression(terms), sense=pe.minimize)
    return m


@dataclass(frozen=True, slots=True)
class _Outcome:
    choice: tuple[int, ...] | None
    status: str
    gap: float
    used_lp: bool
    infeasible: bool
    bound: float = -math.inf
    """a lower bound of the optimum (LP relaxation or MIP dual bound)."""


def _choice(xs: list[np.ndarray]) -> tuple[int, ...]:
    """The strategy with the largest x value of each variable (the 1 of an integral solution)."""
    return tuple(int(np.argmax(xv)) for xv in xs)


def _within(value: float, bound: float, mip_gap: float) -> tuple[bool, float]:
    """(value is within the relative ``mip_gap`` of the lower ``bound``, that gap)."""
    gap = max(value - bound, 0.0) / max(abs(value), 1e-300)
    return value - bound <= mip_gap * abs(value) + 1e-12 * max(1.0, abs(value)), gap


def _round(hd: HighsDirect, prob: ReducedProblem, xs: list[np.ndarray], bound: float, *, min_peak: bool,
           mip_gap: float, time_limit_s: float) -> tuple[tuple[int, ...], float] | None:
    """(integral choice, its objective) near a fractional LP point of objective ``bound``
    (``rounding.py``), or None: least-memory rounding and local search first, the dives
    (LP re-solves) only if that point is not within ``mip_gap``. On GPT-3 39B's 8x8 V100
    plan 52 of 72 fractional layer LPs rounded to within 1 % at once (0.2 s in all), where
    their dives took 17.9 s and ended no better in all but 5 (by at most 0.25 %; 6 long
    dives ended up to 0.5 % worse)."""
    if prob.links:  # the direct model: followers are rows the rounding does not know
        return None
    if min_peak:  # one row: least-memory rounding is <= the LP peak, i.e. optimal
        rows = rounding.evaluate(prob, choice := rounding.round_lp(prob, xs))[1]
        return choice, max(float(rows.max(initial=0.0)), 0.0)
    best = None
    for toward in ("lp", "nearest", "memory"):  # each only if the points so far end far from the bound
        if best is not None and _within(best[1], bound, mip_gap if toward == "nearest" else mip_gap / 10)[0]:
            break
        choice = None
        if toward != "lp":
            choice = rounding.dive(prob, xs, lambda var, s: hd.fix(var, s, time_limit_s), toward)
            hd.unfix_all()
        choice = choice or rounding.round_lp(prob, xs)
        if np.any(rounding.evaluate(prob, choice)[1] > prob.memory_budget_bytes):
            continue
        choice = rounding.improve(prob, choice)
        value = rounding.evaluate(prob, choice)[0]
        if best is None or value < best[1]:
            best = (choice, value)
    return best


def _solve_model(m: pe.ConcreteModel, prob: ReducedProblem, *, time_limit_s: float, mip_gap: float,
                 lp_first: bool, threads: int | None, min_peak: bool = False) -> _Outcome:
    """LP relaxation first (if asked): an integral LP optimum is the answer; a fractional
    one is rounded (``rounding.py``) and the point is the answer if within ``mip_gap``
    of the LP bound, else the MIP's start. Reads x back as one index per variable."""
    t0, hd = time.perf_counter(), HighsDirect(m, threads)
    start = None
    if lp_first:
        status, values, objective, bound = hd.run(integral=False, time_limit_s=time_limit_s)
        if status in INFEASIBLE:
            return _Outcome(None, "infeasible", math.inf, True, True)
        if status == OPTIMAL and values is not None:
            xs = hd.x_values(values)
            if all(np.all(np.minimum(xv, 1.0 - xv) <= INTEGRALITY_TOL) for xv in xs):
                return _Outcome(_choice(xs), "optimal", 0.0, True, False, bound)
            point = _round(hd, prob, xs, bound, min_peak=min_peak, mip_gap=mip_gap, time_limit_s=time_limit_s)
            if point is not None:
                ok, gap = _within(point[1], bound, mip_gap)
                if ok:
                    return _Outcome(point[0], "optimal", gap, True, False, bound)
                start = point[0]
            log.info("LP relaxation fractional (objective %.6g); solving the MIP", objective)
    left = max(1.0, time_limit_s - (time.perf_counter() - t0))
    status, values, objective, bound = hd.run(integral=True, time_limit_s=left, mip_gap=mip_gap, start=start)
    if status in INFEASIBLE:
        return _Outcome(None, "infeasible", math.inf, False, True)
    if values is None:
        raise ILPSolveError(f"HiGHS stopped ({status.name}) without a feasible plan after "
                            f"{time.perf_counter() - t0:.1f} s; raise time_limit_s (was {time_limit_s})")
    gap = 0.0 if objective == bound else abs(objective - bound) / max(abs(objective), 1e-300)
    return _Outcome(_choice(hd.x_values(values)), STATUS.get(status, "feasible"), gap, False, False, bound)


def _count(m: pe.ConcreteModel) -> tuple[int, int]:
    nv = sum(len(v) for v in m.component_objects(pe.Var, active=True))
    nc = sum(len(c) for c in m.component_objects(pe.Constraint, active=True))
    return nv, nc


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector while a model is built and solved, then collect once.

    A Pyomo model is ~100k small container objects, many in reference cycles: with the
    collector on, its generation-0/1 passes (and generation-2 passes over whatever large
    heap the caller holds, such as a captured graph) cost several times the build itself.
    Callers return before the context closes, so the model is garbage by then.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            gc.collect(0)


def _build_and_solve(prob: ReducedProblem, *, min_peak: bool = False, **solve) -> tuple[_Outcome, int, int, float]:
    """(outcome, Pyomo variables, Pyomo rows, seconds to build) for a non-empty ``prob``."""
    t0 = time.perf_counter()
    m = build_model(prob, min_peak=min_peak)
    build_s = time.perf_counter() - t0
    nv, nc = _count(m)
    return _solve_model(m, prob, min_peak=min_peak, **solve), nv, nc, build_s


def min_peak_memory(instance: ILPInstance, *, time_limit_s: float = 60.0,
                    threads: int | None = None) -> tuple[float, tuple[int, ...], str]:
    """Smallest achievable peak memory (bytes), an assignment reaching it, and the solve status."""
    prob = reduce_instance(instance, min_peak=True)
    if not prob.memory_rows:
        choice = prob.expand([0] * len(prob.num_strategies))
        return instance.peak_memory_bytes(choice), choice, "optimal"
    with _gc_paused():
        out = _build_and_solve(prob, min_peak=True, time_limit_s=time_limit_s, mip_gap=0.0, lp_first=True,
                               threads=threads)[0]
    assert out.choice is not None, "the min-peak ILP is always feasible"
    choice = prob.expand(out.choice)
    return instance.peak_memory_bytes(choice), choice, out.status


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2.0 ** 30), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10)):
        if abs(n) >= size:
            return f"{n:.6g} bytes ({n / size:.2f} {unit})"
    return f"{n:.6g} bytes"


def _raise_infeasible(instance: ILPInstance, time_limit_s: float, threads: int | None) -> None:
    peak, choice, status = min_peak_memory(instance, time_limit_s=time_limit_s, threads=threads)
    mem = instance.memory_at(choice)
    t = int(np.argmax(mem)) if mem else -1
    qual = "" if status == "optimal" else f" (at most; the min-peak ILP stopped: {status})"
    raise InfeasibleMemoryError(
        f"No sharding plan fits in device memory: the smallest peak any strategy choice achieves is "
        f"{_fmt_bytes(peak)}{qual}, reached at liveness point {t}, but the budget is "
        f"{_fmt_bytes(instance.memory_budget_bytes)}. "
        "Remedies: use more devices (a larger mesh for this stage), split the model into more pipeline "
        "stages, enable activation checkpointing, or raise the memory budget.", required_bytes=peak)


def solve_instance(instance: ILPInstance, *, time_limit_s: float = 60.0, mip_gap: float = 0.01,
                   lp_first: bool = True, threads: int | None = None, reduce: bool = True) -> ILPSolution:
    """Reduce, build and solve ``instance`` with HiGHS; raise ``InfeasibleMemoryError`` if nothing fits.

    ``reduce=False`` solves the direct model (one variable per node, followers
    and ties as ``follow`` constraints), for comparison and testing.
    """
    t0 = time.perf_counter()
    prob = reduce_instance(instance, reductions=reduce)
    t1 = time.perf_counter()
    if any(not row.terms for row in prob.memory_rows):  # a point over budget whatever the choice
        _raise_infeasible(instance, time_limit_s, threads)
    nv = nc = 0
    if prob.num_strategies:
        with _gc_paused():
            out, nv, nc, build_s = _build_and_solve(prob, time_limit_s=time_limit_s, mip_gap=mip_gap,
                                                    lp_first=lp_first, threads=threads)
        t2 = t1 + build_s
        if out.infeasible:
            _raise_infeasible(instance, time_limit_s, threads)
    else:  # the reductions solved everything
        t2, out = t1, _Outcome((), "optimal", 0.0, False, False, prob.offset_s)
    t3 = time.perf_counter()
    choice = prob.expand(out.choice)
    assert not instance.violations(choice), instance.violations(choice)
    parts = instance.cost_parts(choice)
    sol = ILPSolution(strategy_index=choice, **parts, objective_s=math.fsum(parts.values()),
                      peak_memory_bytes=instance.peak_memory_bytes(choice), status=out.status, gap=out.gap,
                      build_s=t2 - t0, solve_s=t3 - t2, num_vars=nv, num_constraints=nc, used_lp=out.used_lp,
                      reduce_s=t1 - t0, extra={"reduced_vars": len(prob.num_strategies),
                                               "reduced_edges": len(prob.edges),
                                               "memory_rows": len(prob.memory_rows),
                                               "lower_bound_s": min(out.bound, math.fsum(parts.values()))})
    log.info("intra-op ILP: %s objective %.6g s (%d vars, %d rows) reduce %.2f s build %.2f s solve %.2f s lp=%s",
             sol.status, sol.objective_s, nv, nc, sol.reduce_s, sol.build_s, sol.solve_s, sol.used_lp)
    return sol
