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

Min-peak-memory ILP (for the infeasible-memory message): same variables,
``memory[t]: C_t + sum m_ti[s] x[i,s] <= peak``, objective ``min peak``.

Solve (``lp_first``): relax ``x`` to [0, 1] and solve the LP with HiGHS; if
every ``x`` is within 1e-6 of 0 or 1 the LP optimum is an ILP optimum (it is
feasible and no ILP point can beat the relaxation); otherwise restore
``x`` binary and solve the MIP with the time left.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import pyomo.environ as pe
from pyomo.contrib.solver.common.results import TerminationCondition
from pyomo.contrib.solver.solvers.highs import Highs

from alpa_torch.errors import InfeasibleMemoryError
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


def _add_one_hot(m: pe.ConcreteModel, prob: ReducedProblem) -> None:
    """one_hot[i]: sum_s x[i,s] = 1."""
    m.one_hot = pe.Constraint(range(len(prob.num_strategies)),
                              rule=lambda m, i: sum(m.x[i, s] for s in range(prob.num_strategies[i])) == 1)


def _add_edges(m: pe.ConcreteModel, prob: ReducedProblem) -> None:
    """edge_src[j,a]: sum_b e[j,a,b] = x[i,a];  edge_dst[j,b]: sum_a e[j,a,b] = x[i',b]."""
    m.E = pe.Set(dimen=3, initialize=[(j, a, b) for j, (_, _, r) in enumerate(prob.edges)
                                      for a in range(r.shape[0]) for b in range(r.shape[1])], ordered=True)
    m.e = pe.Var(m.E, bounds=(0.0, 1.0))
    src = [(j, a) for j, (_, _, r) in enumerate(prob.edges) for a in range(r.shape[0])]
    dst = [(j, b) for j, (_, _, r) in enumerate(prob.edges) for b in range(r.shape[1])]

    def src_rule(m, j, a):
        i, _, r = prob.edges[j]
        return sum(m.e[j, a, b] for b in range(r.shape[1])) == m.x[i, a]

    def dst_rule(m, j, b):
        _, i, r = prob.edges[j]
        return sum(m.e[j, a, b] for a in range(r.shape[0])) == m.x[i, b]

    m.edge_src = pe.Constraint(src, rule=src_rule)
    m.edge_dst = pe.Constraint(dst, rule=dst_rule)


def _add_memory(m: pe.ConcreteModel, prob: ReducedProblem, bound) -> None:
    """memory[t]: C_t + sum_i sum_s m_ti[s] x[i,s] <= bound (the budget, or the peak variable)."""
    rows = {row.point: row for row in prob.memory_rows}

    def rule(m, t):
        row = rows[t]
        lhs = row.constant_bytes + sum(float(c[s]) * m.x[i, s] for i, c in row.terms for s in range(len(c)) if c[s])
        return lhs <= bound

    m.memory = pe.Constraint(sorted(rows), rule=rule)


def _add_follow(m: pe.ConcreteModel, prob: ReducedProblem) -> None:
    """follow[l,a]: x[leader,a] <= x[follower,map[a]], or x[leader,a] <= 0 when map[a] = -1."""
    idx = [(n, a) for n, (_, _, mp) in enumerate(prob.links) for a in range(len(mp))]

    def rule(m, n, a):
        f, l, mp = prob.links[n]
        return m.x[l, a] <= (m.x[f, int(mp[a])] if mp[a] >= 0 else 0)

    m.follow = pe.Constraint(idx, rule=rule)


def build_model(prob: ReducedProblem, *, min_peak: bool = False) -> pe.ConcreteModel:
    """The Pyomo model of ``prob`` (see the module docstring). Does not solve."""
    assert min_peak or all(row.terms for row in prob.memory_rows), "constant-only memory row in cost model"
    m = pe.ConcreteModel(name="intra_op_min_peak" if min_peak else "intra_op_sharding")
    m.X = pe.Set(dimen=2, initialize=[(i, s) for i, k in enumerate(prob.num_strategies) for s in range(k)],
                 ordered=True)
    m.x = pe.Var(m.X, domain=pe.Binary)
    _add_one_hot(m, prob)
    _add_edges(m, prob)
    _add_follow(m, prob)
    if min_peak:
        m.peak = pe.Var(bounds=(0.0, None))
        _add_memory(m, prob, m.peak)
        m.objective = pe.Objective(expr=m.peak, sense=pe.minimize)
    else:
        _add_memory(m, prob, prob.memory_budget_bytes)
        node = [float(c[s]) * m.x[i, s] for i, c in enumerate(prob.cost_s) for s in range(len(c)) if c[s]]
        edge = [float(r[a, b]) * m.e[j, a, b] for j, (_, _, r) in enumerate(prob.edges)
                for a, b in zip(*np.nonzero(r))]
        m.objective = pe.Objective(expr=prob.offset_s + sum(node) + sum(edge), sense=pe.minimize)
    return m


@dataclass(frozen=True, slots=True)
class _Outcome:
    choice: tuple[int, ...] | None
    status: str
    gap: float
    used_lp: bool
    infeasible: bool


_STATUS = {TerminationCondition.convergenceCriteriaSatisfied: "optimal",
           TerminationCondition.maxTimeLimit: "time_limit", TerminationCondition.iterationLimit: "iteration_limit"}


def _choice(m: pe.ConcreteModel, values, num_vars: int) -> tuple[int, ...]:
    """The strategy with the largest x value of each variable (the 1 of an integral solution)."""
    best: dict[int, tuple[float, int]] = {}
    for (i, s), v in m.x.items():
        if values[v] > best.get(i, (-1.0, 0))[0]:
            best[i] = (values[v], s)
    return tuple(best[i][1] for i in range(num_vars))


def _solve_model(m: pe.ConcreteModel, prob: ReducedProblem, *, time_limit_s: float, mip_gap: float,
                 lp_first: bool, threads: int | None) -> _Outcome:
    """LP relaxation first (if asked), MIP if the LP is fractional. Reads x back as one index per var."""
    opt, start = Highs(), time.perf_counter()
    kw = dict(load_solutions=False, raise_exception_on_nonoptimal_result=False, threads=threads,
              solver_options={"output_flag": False})
    xs = list(m.x.values())
    choice_of = lambda values: _choice(m, values, len(prob.num_strategies))  # noqa: E731

    if lp_first:
        for v in xs:
            v.domain = pe.UnitInterval
        res = opt.solve(m, time_limit=time_limit_s, **kw)
        for v in xs:
            v.domain = pe.Binary
        tc = res.termination_condition
        if tc in (TerminationCondition.provenInfeasible, TerminationCondition.infeasibleOrUnbounded):
            return _Outcome(None, "infeasible", math.inf, True, True)
        if tc == TerminationCondition.convergenceCriteriaSatisfied:
            values = res.solution_loader.get_vars(xs)
            if all(min(val, 1.0 - val) <= INTEGRALITY_TOL for val in values.values()):
                return _Outcome(choice_of(values), "optimal", 0.0, True, False)
            log.info("LP relaxation fractional (objective %.6g); solving the MIP", res.incumbent_objective)
        opt.update_variables(xs)
    left = max(1.0, time_limit_s - (time.perf_counter() - start))
    res = opt.solve(m, time_limit=left, rel_gap=mip_gap, **kw)
    tc = res.termination_condition
    if tc in (TerminationCondition.provenInfeasible, TerminationCondition.infeasibleOrUnbounded):
        return _Outcome(None, "infeasible", math.inf, False, True)
    if res.incumbent_objective is None:
        raise ILPSolveError(f"HiGHS stopped ({tc.name}) without a feasible plan after "
                            f"{time.perf_counter() - start:.1f} s; raise time_limit_s (was {time_limit_s})")
    inc, bound = res.incumbent_objective, res.objective_bound
    gap = 0.0 if bound is None or inc == bound else abs(inc - bound) / max(abs(inc), 1e-300)
    return _Outcome(choice_of(res.solution_loader.get_vars(xs)), _STATUS.get(tc, "feasible"), gap, False, False)


def _count(m: pe.ConcreteModel) -> tuple[int, int]:
    nv = sum(len(v) for v in m.component_objects(pe.Var, active=True))
    nc = sum(len(c) for c in m.component_objects(pe.Constraint, active=True))
    return nv, nc


def min_peak_memory(instance: ILPInstance, *, time_limit_s: float = 60.0,
                    threads: int | None = None) -> tuple[float, tuple[int, ...], str]:
    """Smallest achievable peak memory (bytes), an assignment reaching it, and the solve status."""
    prob = reduce_instance(instance, min_peak=True)
    if not prob.memory_rows:
        choice = prob.expand([0] * len(prob.num_strategies))
        return instance.peak_memory_bytes(choice), choice, "optimal"
    m = build_model(prob, min_peak=True)
    out = _solve_model(m, prob, time_limit_s=time_limit_s, mip_gap=0.0, lp_first=True, threads=threads)
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
        m = build_model(prob)
        t2 = time.perf_counter()
        nv, nc = _count(m)
        out = _solve_model(m, prob, time_limit_s=time_limit_s, mip_gap=mip_gap, lp_first=lp_first, threads=threads)
        if out.infeasible:
            _raise_infeasible(instance, time_limit_s, threads)
    else:  # the reductions solved everything
        t2, out = t1, _Outcome((), "optimal", 0.0, False, False)
    t3 = time.perf_counter()
    choice = prob.expand(out.choice)
    assert not instance.violations(choice), instance.violations(choice)
    parts = instance.cost_parts(choice)
    sol = ILPSolution(strategy_index=choice, **parts, objective_s=math.fsum(parts.values()),
                      peak_memory_bytes=instance.peak_memory_bytes(choice), status=out.status, gap=out.gap,
                      build_s=t2 - t0, solve_s=t3 - t2, num_vars=nv, num_constraints=nc, used_lp=out.used_lp,
                      reduce_s=t1 - t0, extra={"reduced_vars": len(prob.num_strategies),
                                               "reduced_edges": len(prob.edges),
                                               "memory_rows": len(prob.memory_rows)})
    log.info("intra-op ILP: %s objective %.6g s (%d vars, %d rows) reduce %.2f s build %.2f s solve %.2f s lp=%s",
             sol.status, sol.objective_s, nv, nc, sol.reduce_s, sol.build_s, sol.solve_s, sol.used_lp)
    return sol
