"""Activation checkpointing in the plan: which layers of a stage recompute their forward.

The graph rewrite is ``alpa_torch.core.remat`` (a recomputed layer keeps only what its
forward reads from outside it: the previous layer's output; its backward runs a
copy of its forward first). This module prices that and chooses it.

Per layer l on a logical mesh (``stage_costs.LayerCost``, at the captured batch,
per device): ``activation_bytes`` a_l (forward values its backward reads),
``kept_bytes`` k_l (what stays when it is recomputed) and ``recompute_s`` f_l
(the time of the copied forward operators under the layer's sharding, its
collectives included). For a stage holding ``in_flight`` microbatches with
persistent bytes P, recomputing the layers R costs

    time    t + sum_{l in R} f_l / B                (per microbatch)
    memory  P + in_flight * (sum_{l not in R} a_l + sum_{l in R} k_l) / B
              + max_{l in R} (a_l - k_l) / B        (one layer rematerialized at a time)

Two steps, as Colossal-Auto orders them (after the sharding is fixed):

1. the stage DP gets, next to every mesh column, a "recompute every layer"
   twin (``tables.build_tables``): a stage that fits only with checkpointing
   becomes a candidate with its true time and memory;
2. for each stage of the chosen plan that uses such a twin, ``choose_layers``
   solves the 0/1 choice exactly (a Rotor-style chain: an integer program in
   Pyomo, solved by HiGHS): least added time such that the stage fits its
   budget with its real in-flight count, which the DP column over-approximated.

Modes (``parallelize(checkpointing=...)``): ``'auto'`` (the above), ``'none'``
(never recompute), ``'full'`` (every stage recomputes every layer), or a number
of bytes: plan as ``'auto'`` with that per-device budget for the stages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyomo.environ as pe
from pyomo.contrib.solver.common.results import TerminationCondition
from pyomo.contrib.solver.solvers.highs import Highs

from alpa_torch.core.errors import PlanError
from alpa_torch.core.options import checkpointing_budget


@dataclass(frozen=True, slots=True)
class Checkpointing:
    """The parsed ``checkpointing`` option."""

    mode: str
    """'auto', 'none' or 'full'."""
    budget_bytes: float | None = None
    """The per-device budget the stages must meet (a number given as the option)."""

    @staticmethod
    def parse(option) -> Checkpointing:
        if isinstance(option, Checkpointing):
            return option
        return Checkpointing(*checkpointing_budget(option))

    @property
    def twins(self) -> bool:
        """Whether the DP gets recompute twins of the mesh columns."""
        return self.mode != "none"

    @property
    def plain(self) -> bool:
        """Whether the DP keeps the columns without recomputation."""
        return self.mode != "full"


def range_max(values: np.ndarray) -> np.ndarray:
    """[L, L]: entry [i, j] = max(values[i..j]) for i <= j, -inf below the diagonal."""
    n = len(values)
    out = np.full((n, n), -np.inf)
    for i in range(n):
        out[i, i:] = np.maximum.accumulate(values[i:])
    return out


def saved_and_peak(act: np.ndarray, kept: np.ndarray, chosen) -> tuple[float, float]:
    """(bytes kept per microbatch in flight, bytes of the one layer rematerialized at a
    time) of a stage recomputing the layers ``chosen`` (indices into the per-microbatch
    arrays ``act`` / ``kept``; module docstring)."""
    r = np.zeros(len(act), dtype=bool)
    r[list(chosen)] = True
    return float(np.where(r, kept, act).sum()), float(np.max(np.where(r, act - kept, 0.0), initial=0.0))


def stage_memory(persistent: float, in_flight: int, act: np.ndarray, kept: np.ndarray, chosen) -> float:
    """Peak bytes per device of a stage recomputing the layers ``chosen`` (module docstring)."""
    saved, peak = saved_and_peak(act, kept, chosen)
    return persistent + in_flight * saved + peak


def choose_layers(recompute_s: np.ndarray, act: np.ndarray, kept: np.ndarray, persistent: float,
                  in_flight: int, budget: float, *, time_limit_s: float = 10.0) -> tuple[int, ...]:
    """The layers (indices into the arrays) to recompute for least added time with the stage
    within ``budget`` bytes; arrays per microbatch. Recomputing nothing when that fits.
    Raises ``PlanError`` if even recomputing every layer does not fit."""
    n = len(act)
    if stage_memory(persistent, in_flight, act, kept, ()) <= budget:
        return ()
    every = tuple(range(n))
    if stage_memory(persistent, in_flight, act, kept, every) > budget * (1 + 1e-9):
        raise PlanError(f"the stage needs {stage_memory(persistent, in_flight, act, kept, every):.4g} bytes per "
                        f"device even recomputing every layer; the budget is {budget:.4g}")
    saving = np.maximum(act - kept, 0.0)
    # Costs below HiGHS's resolution (1e-9 of the largest) are zeros to it, not tiny numbers: a
    # 1e-45 cost made it return a set costing 1 where one costing ~0 fit (hypothesis found it).
    recompute_s = np.where(np.abs(recompute_s) < 1e-9 * float(np.abs(recompute_s).max(initial=0.0)), 0.0,
                           recompute_s)
    m = pe.ConcreteModel(name="activation_checkpointing")
    m.r = pe.Var(range(n), domain=pe.Binary)
    m.z = pe.Var(bounds=(0.0, float(saving.max(initial=0.0))))
    m.fit = pe.Constraint(expr=persistent + in_flight * float(act.sum())
                          - in_flight * sum(float(saving[l]) * m.r[l] for l in range(n)) + m.z <= budget)
    m.peak = pe.Constraint(range(n), rule=lambda m, l: m.z >= float(saving[l]) * m.r[l])
    m.time = pe.Objective(expr=sum(float(recompute_s[l]) * m.r[l] for l in range(n)), sense=pe.minimize)
    res = Highs().solve(m, time_limit=time_limit_s, load_solutions=False, raise_exception_on_nonoptimal_result=False,
                        solver_options={"output_flag": False, "mip_rel_gap": 0.0})
    if res.termination_condition != TerminationCondition.convergenceCriteriaSatisfied:
        return every  # fits, by the check above
    values = res.solution_loader.get_vars(list(m.r.values()))
    chosen = tuple(l for l in range(n) if values[m.r[l]] > 0.5)
    if stage_memory(persistent, in_flight, act, kept, chosen) > budget * (1 + 1e-9):
        return every
    return chosen
