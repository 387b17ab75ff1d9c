"""A Pyomo model in HiGHS as one sparse matrix: ``HighsDirect``.

Owns: moving a Pyomo model built by ``ilp.build_model`` into ``highspy`` and
running it as an LP relaxation, as a MIP, or as an LP with some variables'
strategies fixed (``rounding.dive``). Does not own the model (``ilp.py``) nor
what the answers mean.

Pyomo stays the modelling layer: the model is compiled by Pyomo's own
``LinearStandardFormCompiler`` (``A``, ``c``, ``rhs`` as scipy/numpy arrays),
the pattern of ``pyomo.contrib.solver``'s ``GurobiDirect``, and handed to HiGHS
with one ``passModel``. Pyomo's persistent HiGHS interface adds variables and
rows one Python object at a time (measured here: ~0.5 s to load a 20k-column
model, longer than HiGHS takes to solve it); compiling plus ``passModel``
takes a fifth of that. The compiler merges repeated terms of a row, so HiGHS
never sees a row naming one column twice (docs/design.md). The model stays loaded
between the LP, the dive and the MIP, so each re-solve starts from the last
basis.
"""

from __future__ import annotations

import highspy
import numpy as np
import pyomo.environ as pe
from pyomo.common.dependencies import scipy_available
from pyomo.repn.plugins.standard_form import LinearStandardFormCompiler

_INF = highspy.kHighsInf
OPTIMAL = highspy.HighsModelStatus.kOptimal
INFEASIBLE = (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible)
STATUS = {OPTIMAL: "optimal", highspy.HighsModelStatus.kTimeLimit: "time_limit",
          highspy.HighsModelStatus.kIterationLimit: "iteration_limit"}

_SEARCH_OPTIONS = ("mip_allow_restart", "mip_heuristic_run_rins", "mip_heuristic_run_rens",
                   "mip_heuristic_run_root_reduced_cost", "mip_heuristic_run_feasibility_jump")
"""HiGHS MIP options (all on by default) for finding a first solution, off when the MIP has a start."""


def quiet_highs():
    """A HiGHS instance that prints nothing: ``output_flag`` off before any method that logs.

    highspy's Python ``Highs.__init__`` (1.12 and later) enables its callbacks right after
    constructing the solver, and that call writes HiGHS's banner to standard output
    before any option can be set (HiGHS issues #1702, #2749). Constructing the compiled
    base class, switching output off and only then using it keeps the banner out of the
    user's standard output; older highspy without that base only logs once a method runs.
    """
    core = getattr(getattr(highspy, "_core", None), "_Highs", None)
    h = core() if core is not None and issubclass(highspy.Highs, core) else highspy.Highs()
    h.setOptionValue("output_flag", False)
    return h


def load_compiler() -> None:
    """Import now what Pyomo's standard-form compiler imports on its first use (scipy,
    0.5-1 s), e.g. before forking processes that each would import it again."""
    bool(scipy_available)


def _bounds(v) -> tuple[float, float]:
    """(lower, upper) of a Pyomo variable, nan where it has none."""
    return tuple(np.nan if b is None else float(b) for b in v.bounds)


class HighsDirect:
    """``m`` (with flat binary ``m.x`` and ``m.x_offsets``; every element of ``m.x``, and of
    ``m.e`` if there, declared with one domain) loaded into a ``highspy.Highs``."""

    def __init__(self, m: pe.ConcreteModel, threads: int | None = None):
        repn = LinearStandardFormCompiler().write(m, mixed_form=True, set_sense=None)
        assert len(repn.objectives) == 1 and repn.objectives[0].sense == pe.minimize
        cols = {id(v): j for j, v in enumerate(repn.columns)}
        self.x_cols = np.array([cols[id(v)] for v in m.x.values()], dtype=np.int32)
        """HiGHS column of each flat x variable."""
        self.x_offsets = list(m.x_offsets)
        n = len(repn.columns)
        # The flat x and e, declared with one domain each, are all but a few columns: their
        # bounds and integrality are read from one element each (one by one, 70k columns
        # cost 0.09 s of a 0.4 s layer ILP), every other column's one by one.
        bounds, binary, seen = np.full((n, 2), np.nan), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        for comp in (m.x, getattr(m, "e", None)):
            if comp is not None and len(comp):
                where, first = [cols[id(v)] for v in comp.values()], next(iter(comp.values()))
                bounds[where], binary[where], seen[where] = _bounds(first), first.is_binary(), True
        for j in np.flatnonzero(~seen).tolist():
            bounds[j], binary[j] = _bounds(repn.columns[j]), repn.columns[j].is_binary()
        self.binary = np.flatnonzero(binary).astype(np.int32)
        kind = np.array([r.bound_type for r in repn.rows], dtype=np.int64)  # 0: ==, 1: <=, -1: >=
        rhs = np.asarray(repn.rhs, dtype=float)
        a = repn.A.tocsc()
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = n, len(rhs)
        lp.col_cost_ = repn.c.toarray()[0] if repn.c.shape[0] else np.zeros(n)
        lp.offset_ = float(repn.c_offset[0]) if len(repn.c_offset) else 0.0
        lp.col_lower_ = np.nan_to_num(bounds[:, 0], nan=-_INF)
        lp.col_upper_ = np.nan_to_num(bounds[:, 1], nan=_INF)
        lp.row_lower_ = np.where(kind == 1, -_INF, rhs)
        lp.row_upper_ = np.where(kind == -1, _INF, rhs)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = a.indptr, a.indices, a.data
        self.h = quiet_highs()
        if threads is not None:
            self.h.setOptionValue("threads", int(threads))
        self.h.passModel(lp)

    def x_values(self, values: np.ndarray) -> list[np.ndarray]:
        """Column values -> x values of each reduced variable."""
        xv, xo = values[self.x_cols], self.x_offsets
        return [xv[xo[i]:xo[i + 1]] for i in range(len(xo) - 1)]

    def run(self, *, integral: bool, time_limit_s: float, mip_gap: float = 0.0, start=None):
        """(status, column values or None, objective, lower bound) of the LP relaxation or the
        MIP; ``start``: a strategy per variable, a partial MIP start (HiGHS fills in e)."""
        h, n = self.h, len(self.binary)
        if integral:
            # HiGHS 1.16 after an LP solve on the same instance: its MIP reported the optimum's
            # objective with the column values of another point (a 7-node ILP of
            # tests/test_ilp_core.py: objective 10.6255, values worth 10.7658). The MIP
            # starts from a cleared solver (the model and options stay).
            h.clearSolver()
        kind = highspy.HighsVarType.kInteger if integral else highspy.HighsVarType.kContinuous
        h.changeColsIntegrality(n, self.binary, np.full(n, kind))
        h.setOptionValue("time_limit", float(time_limit_s))
        h.setOptionValue("mip_rel_gap", float(mip_gap))
        # LP: presolve costs more than it saves on these (measured 3-4x slower with it)
        h.setOptionValue("presolve", "choose" if integral else "off")
        # With a start (``ilp._round``'s point: optimal or within ~0.1 % of it on GPT-3 39B's
        # capped layer ILPs) HiGHS's primal heuristics find nothing better and its
        # restarts re-presolve a ~70k-column model: without both its MIP closed those gaps in
        # 3.6-3.9 s instead of 9.5-15 s, with the same or better answers (docs/design.md).
        for option in _SEARCH_OPTIONS:
            h.setOptionValue(option, not (integral and start is not None))
        if start is not None:
            values = np.zeros(len(self.x_cols))
            values[[self.x_offsets[i] + s for i, s in enumerate(start)]] = 1.0
            h.setSolution(len(values), self.x_cols, values)
        h.run()
        status, info = h.getModelStatus(), h.getInfo()
        values = None
        if info.primal_solution_status == 2:  # kSolutionStatusFeasible
            values = np.asarray(h.getSolution().col_value, dtype=float)
        bound = info.mip_dual_bound if integral else info.objective_function_value
        return status, values, info.objective_function_value, bound

    def fix(self, var: int, strategy: int | None, time_limit_s: float) -> list[np.ndarray] | None:
        """Allow only ``strategy`` of ``var`` (None: all again) and re-solve the LP from the
        last basis; the new x values, or None if that LP is infeasible or stopped."""
        lo, hi = self.x_offsets[var], self.x_offsets[var + 1]
        upper = np.ones(hi - lo)
        if strategy is not None:
            upper[:] = 0.0
            upper[strategy] = 1.0
        self.h.changeColsBounds(hi - lo, self.x_cols[lo:hi], np.zeros(hi - lo), upper)
        if strategy is None:
            return None
        status, values, _, _ = self.run(integral=False, time_limit_s=time_limit_s)
        return self.x_values(values) if status == OPTIMAL and values is not None else None

    def unfix_all(self) -> None:
        """Every x back to [0, 1]."""
        n = len(self.x_cols)
        self.h.changeColsBounds(n, self.x_cols, np.zeros(n), np.ones(n))
