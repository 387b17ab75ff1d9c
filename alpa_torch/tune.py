"""Measured plan selection: where the cost model cannot tell plans apart, run them and keep the fastest.

The cost model's step times miss by up to about 2x on shared CPU cores (``bench/fidelity.py``,
docs/benchmarks.md), enough to rank a pipeline above plain data parallelism that measures
faster. So ``parallelize`` (``tune=True``, the default) treats its prediction as a short list:

- the candidates (``candidates``) are the plan of the search (the stage DP over pipelines
  and submeshes, the ILP on each stage), the searched pipeline at fewer microbatches
  (``fewer_microbatches``), where the search chose one stage the pipeline of one stage per
  device (``deepest_pipeline``) and it at fewer microbatches, the best one-stage plan (``pipeline=False``: the
  ILP's sharding over the whole cluster) and the data-parallel one-stage plan
  (``pipeline=False, sharding=False``: the batch split, state and update replicated, what
  DDP runs), each planned on the same captured graph within the user's options (one the
  options rule out is not a candidate), and each cached under its own options; equal plans
  count once;
- a candidate predicted within ``MARGIN`` times the fastest prediction is measured
  (``select``, called by ``ParallelStep._tune``): deployed on the step's workers, loaded with the initial state,
  run on the first batch with the results thrown away: ``SKIP`` steps untimed (on a stage of
  several devices the first step runs through DTensor, the second records the replay, the
  third generates the replay's code: 0.6 s for the 2,372 operators of
  ``bench/vs_pytorch.py``'s deep GPT, more than its step), then timed steps until they took
  ``TIMED_S`` (within ``TIMED_STEPS``), the median of them;
  one more step is recorded, per stage and kind of cost (``alpa_torch.calibration``),
  and the corrections those records give are stored for the cluster, so later plannings on it
  price stages at the measured rates; planned with such corrections, the candidates are
  measured within ``CALIBRATED_MARGIN`` only;
- each measured candidate's memory is measured too (the most any of its devices held,
  ``runtime/device_memory.py``, and of it what the earlier trials had left on the
  workers); one whose own part is over the memory the plan may use per device
  (``ParallelPlan.memory_budget_bytes``) is not kept, whatever its speed: the
  simulation that let it in counts the plan's tensors, not the runtime's own memory nor
  what the allocator keeps (on the 256 MiB workload of ``bench/vs_pytorch.py`` one-stage
  plans simulated at 74 and 186 MiB measured 337 and 591 MiB); where the first candidate
  measured over the device, one on the same meshes simulated to need more is not measured
  (``_cannot_fit``);
- with ``compile`` left to it (``parallelize(compile=None)``, the default), the plan kept so
  far, and the next fastest replayed within ``COMPILE_MARGIN`` of it (``to_compile``), are
  measured once more with their workers' programs compiled (``runtime/regions.py``; the
  compiling happens in the untimed steps), as candidates of their own, even where the kept one
  was the only plan measured: compiled kernels run faster or slower than replayed ones by model,
  sequence length and device (docs/benchmarks.md §4: 0.84-1.01x on this machine's CPUs), and
  the compiled program writes only the new state into the old one's memory (Inductor decides the
  rest), so it may need more memory;
- the fastest measured that may fit is kept, the initial state loaded into it, and training
  starts; on new workers if it held more than the plan may use in its trial (with what the
  earlier trials left); where none may fit, the one that needed the least, on new workers,
  with a warning.
  The choice and its measurements are stored in the plan cache beside the searched plan
  (``tuned_fields``), so the next run of this step on this cluster takes it at once.

Whatever plan is kept, the step trains as eagerly: every candidate is a plan of the same
step, and the trial steps leave no trace (the state is loaded again; random operators are
seeded by step number, ``runtime/rng.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import time
from collections.abc import Callable

from alpa_torch.core.cluster import Cluster
from alpa_torch.core.errors import PlanError
from alpa_torch.core.graph import OpGraph
from alpa_torch.core.options import PlanOptions
from alpa_torch.core.plan import ParallelPlan, text_table

from .plan_cache import PlanCache, cached_plan, key_fields, plan_decisions

log = logging.getLogger(__name__)

_MiB = 2**20

MARGIN = 2.0
"""A candidate predicted slower than ``MARGIN`` x the fastest prediction is not measured."""
CALIBRATED_MARGIN = 1.25
"""``MARGIN`` for candidates planned with measured cost corrections (``Cluster.cost_correction``)."""
SKIP = 3
"""Trial steps not timed (DTensor's first run, the replay's recording, its code generation)."""
TIMED_STEPS = (3, 20)
"""The fewest and the most timed trial steps per measured candidate."""
TIMED_S = 1.0
"""Timed trial steps go on, up to ``TIMED_STEPS``' most, until they took this long: a 1.5 s step
is timed 3 times, a 30 ms step 20 (three steps of 30 ms on shared cores could not tell a 5 %
difference between the replayed and the compiled program apart)."""
COMPILE_MARGIN = 1.25
"""With ``compile`` left to measurement, a replayed candidate measured within this factor of the
fastest replayed one is measured compiled too (``to_compile``): compiling shrinks the kernels and
leaves the communication, so the replayed ranking need not hold. On ``bench/vs_pytorch.py``'s deep
GPT on ``Cluster.local(1, 2)`` the searched plan measured 129.7 ms replayed and 124.2 compiled, the
data-parallel plan 143.8 replayed (1.11x) and 112.0 compiled in the next run
(docs/results/vs_pytorch_2026-11-29_1x2_r7_tuning.log, _r8)."""
COMPILED_TRIALS = 2
"""The most candidates measured compiled: each costs one compile of its programs on the first call."""
TUNE_VERSION = 9
"""Part of the cache key of a measured choice: a change of the rules above misses."""
ENV_VAR = "ALPA_TORCH_TUNE"
"""``ALPA_TORCH_TUNE=0``: the default of ``tune`` is False (the test suite runs so; see tests/conftest.py)."""


def enabled(option: bool | None) -> bool:
    """``tune`` as given, or (None) True unless ``$ALPA_TORCH_TUNE`` is 0."""
    if option is None:
        return os.environ.get(ENV_VAR, "1") != "0"
    if not isinstance(option, bool):
        raise PlanError(f"tune={option!r} must be True, False or None (the default: ${ENV_VAR}, else True)")
    return option


@dataclasses.dataclass
class Candidate:
    """One plan ``parallelize`` may keep."""

    label: str
    """'search', 'N stages, N microbatches', 'N stages', 'one stage' or 'data parallel'; ', compiled'
    after it for a compiled one."""
    plan: ParallelPlan
    compiled: bool = False
    """Its workers' programs compiled (``parallelize(compile=True)``)."""
    measured_s: float | None = None
    """Median step time of the timed trial steps; None: not measured."""
    measured_bytes: float | None = None
    """The most memory one of its devices held in its trial (deployment, state, steps); None: not measured."""
    own_bytes: float | None = None
    """The most one of its devices held above what the earlier trials had left on it: what it
    would hold on new workers, less what they had already paid for it (modules imported, the
    state received); None: not measured."""
    note: str = ""
    """Why it was not measured, or why it was kept."""
    observations: list[dict] = dataclasses.field(default_factory=list)
    """Its recorded trial step against its prediction (``calibration.observe``); empty: not measured."""

    def to_dict(self, kept: bool) -> dict:
        return {"label": self.label, "plan": self.plan.summary(), "predicted_s": self.plan.predicted_step_s,
                "measured_s": self.measured_s, "predicted_bytes": self.plan.peak_memory_bytes,
                "measured_bytes": self.measured_bytes, "own_bytes": self.own_bytes,
                "budget_bytes": self.plan.memory_budget_bytes, "note": self.note, "kept": kept,
                "compiled": self.compiled}

    def fits(self) -> bool:
        """Measured within the memory its plan may use per device (True where not measured)."""
        return self.measured_bytes is None or self.measured_bytes <= self.plan.memory_budget_bytes

    def may_fit(self) -> bool:
        """Its own part (``own_bytes``) within the memory its plan may use: it may fit on new workers."""
        held = self.measured_bytes if self.own_bytes is None else self.own_bytes
        return held is None or held <= self.plan.memory_budget_bytes


def variants(options: PlanOptions) -> list[tuple[str, PlanOptions]]:
    """The options of the other candidates (module docstring), within what ``options`` allow."""
    if options.submesh is not None or options.num_stages not in (None, 1):
        return []  # the user fixed the stages' shape or count
    out = []
    if options.pipeline and options.num_stages is None:
        out.append(("one stage", options.replace(pipeline=False)))
    if options.sharding:
        out.append(("data parallel", options.replace(pipeline=False, sharding=False, num_stages=None)))
    return out


def fewer_microbatches(searched: ParallelPlan, options: PlanOptions) -> list[tuple[str, PlanOptions]]:
    """The searched pipeline's stage count at as many microbatches as stages (the fewest that keep
    every stage busy in 1F1B's steady state), where the search chose more and the user fixed none.

    The cost model's weakest figure is the price of a microbatch: its fixed costs per operator
    and per transfer, which grow with the count, against the bubble, which shrinks. On the
    shared cores of a local cluster it ranked 8 microbatches of the deep GPT of
    ``bench/vs_pytorch.py`` first (predicted 126 ms) where 4 measured 171-207 ms and 8
    measured 202-290 (docs/results/vs_pytorch_2026-11-26_r*_tuning.log)."""
    n = len(searched.stages)
    if n == 1 or options.num_microbatches is not None or searched.num_microbatches <= n:
        return []
    return [(f"{n} stages, {n} microbatches", options.replace(num_stages=n, num_microbatches=n))]


def deepest_pipeline(searched: ParallelPlan, cluster: Cluster, options: PlanOptions) -> list[tuple[str, PlanOptions]]:
    """Where the search chose one stage: the pipeline of one stage per device (as many as there
    are layers at most), the shape ``torch.distributed.pipelining`` runs, so that a pipeline is
    always among the candidates. None where the user fixed the stages or ruled pipelines out.

    The search's one-stage choice is the cost model's least reliable: on the shared cores of
    a local cluster it ranked the GPT's sharded one-stage plan first (132 ms predicted, 470-553
    measured) where the 4-stage pipeline had measured 155 ms on the same cluster
    (docs/results/vs_pytorch_2026-11-27_r5_tuning.log, _r6)."""
    if len(searched.stages) > 1 or not options.pipeline or options.num_stages is not None \
            or options.submesh is not None:
        return []
    k = min(cluster.num_devices, searched.stages[-1].layer_end + 1)
    return [(f"{k} stages", options.replace(num_stages=k))] if k > 1 else []


def candidates(searched: ParallelPlan, graph: OpGraph, cluster: Cluster, options: PlanOptions,
               cache: PlanCache | None, progress: Callable[[str], None] | None = None) -> list[Candidate]:
    """The searched plan, then the variants' plans that differ from every earlier one (a pipeline
    candidate's own ``fewer_microbatches`` right after it)."""
    out = [Candidate("search", searched)]
    seen = [_decisions(searched)]
    todo = fewer_microbatches(searched, options) + deepest_pipeline(searched, cluster, options) + variants(options)
    while todo:
        label, opts = todo.pop(0)
        try:
            plan, _ = cached_plan(cache, graph, cluster, opts, progress)
        except PlanError as exc:  # e.g. no one-stage plan fits the memory
            log.info("no %s candidate: %s", label, str(exc).splitlines()[0])
            continue
        decisions = _decisions(plan)
        if decisions not in seen:
            out.append(Candidate(label, plan))
            seen.append(decisions)
            if opts.num_stages not in (None, 1) and opts.num_microbatches is None:
                todo[:0] = fewer_microbatches(plan, options)
    return out


def margin(cands: list[Candidate]) -> float:
    """``CALIBRATED_MARGIN`` if the candidates were planned with measured cost corrections, else ``MARGIN``."""
    return CALIBRATED_MARGIN if cands[0].plan.cluster.get("cost_correction") else MARGIN


def to_measure(cands: list[Candidate]) -> list[Candidate]:
    """The candidates predicted within ``margin`` of the fastest prediction; the others get a note."""
    fastest, limit = min(c.plan.predicted_step_s for c in cands), margin(cands)
    chosen = []
    for c in cands:
        if c.plan.predicted_step_s <= limit * fastest:
            chosen.append(c)
        else:
            c.note = f"predicted {c.plan.predicted_step_s / fastest:.1f}x the fastest prediction: not measured"
    return chosen


def _cannot_fit(c: Candidate, first: Candidate) -> bool:
    """``c`` runs on the same devices and meshes as ``first``, simulates to at least its memory,
    and ``first``, measured on workers no trial had used, measured over the device: then ``c``
    does not fit either and is not measured (a note says so; on a GPU its trial could run out
    of memory). On the 256 MiB workload the data-parallel plan (186 MiB simulated) was measured
    at 591 MiB after the sharded one-stage plan (74 MiB) had measured 337."""
    if first.measured_bytes is None or first.may_fit() or _meshes(c.plan) != _meshes(first.plan) \
            or c.plan.peak_memory_bytes < first.plan.peak_memory_bytes:
        return False
    c.note = (f"simulated to need no less than the {first.label} plan on the same meshes, which measured "
              f"{first.measured_bytes / _MiB:.0f} MiB on a device: cannot fit, not measured")
    return True


def _meshes(plan: ParallelPlan) -> list[tuple]:
    return [(s.device_ids, s.logical_mesh) for s in plan.stages]


def keep(cands: list[Candidate]) -> Candidate:
    """The fastest measured candidate that may fit its device's memory, with a note saying why it
    was kept; one that cannot gets a note saying so. Where none may fit, the one with the least
    memory of its own, with a warning (the memory promise is broken). The kept one runs on new
    workers unless it fitted in its trial's (``select``)."""
    measured = sorted((c for c in cands if c.measured_s is not None), key=lambda c: c.measured_s)
    for c in measured:
        if not c.may_fit():
            c.note = (f"measured {c.measured_bytes / _MiB:.0f} MiB on a device, over the "
                      f"{c.plan.memory_budget_bytes / _MiB:.0f} MiB the plan may use: not kept")
    plausible = [c for c in measured if c.may_fit()]
    if not plausible:
        best = min(measured, key=lambda c: c.own_bytes if c.own_bytes is not None else c.measured_bytes)
        best.note = f"none fits: the least memory measured ({best.measured_bytes / _MiB:.0f} MiB), run on new workers"
        log.warning("no measured plan fits the device memory (%.0f MiB): keeping the %s plan, which needed the "
                    "least (%.0f MiB), on new workers. Fix: activation checkpointing (checkpointing='full'), a "
                    "smaller memory_budget_bytes to plan within, or more devices",
                    best.plan.memory_budget_bytes / _MiB, best.label, best.measured_bytes / _MiB)
        return best
    best = plausible[0]
    if best is not measured[0]:  # a faster one cannot fit
        best.note = (f"fastest measured that fits: {best.measured_s * 1e3:.1f} ms (the {measured[0].label} plan "
                     f"measured {measured[0].measured_s * 1e3:.1f} ms but does not fit)")
    elif len(measured) == 1:
        best.note = f"the only candidate measured: {best.measured_s * 1e3:.1f} ms"
    else:
        runner = measured[1]
        best.note = (f"fastest measured: {best.measured_s * 1e3:.1f} ms against {runner.measured_s * 1e3:.1f} ms "
                     f"of the {runner.label} plan")
    if not best.fits():
        best.note += (f"; on new workers: its trial held {best.measured_bytes / _MiB:.0f} MiB, "
                      f"{(best.measured_bytes - best.own_bytes) / _MiB:.0f} of them left by earlier trials")
    return best


def select(cands: list[Candidate], use: Callable[[ParallelPlan, bool, bool], None], step: Callable[[], object],
           observe: Callable[[ParallelPlan], list[dict]],
           memory: Callable[[], list[tuple[float, float]]], try_compiled: bool = False) -> Candidate:
    """The candidate to keep, measured where the predictions are close (module docstring).

    ``cands[0]`` is deployed with the initial state, uncompiled; ``use(plan, fresh, compiled,
    again)`` deploys a plan on the workers (on new ones if ``fresh``; their programs compiled if
    ``compiled``) and loads the initial state into it; ``again``: it is the plan deployed now, so
    only its state is loaded again and its step count restarted; ``step()`` runs one trial step;
    ``observe(plan)`` runs one more, recorded, and returns ``calibration.observe``'s records of
    it; ``memory()`` gives, per device of the deployed plan, the most memory it held since the
    plan was deployed and how much of it earlier trials had left, in bytes (``Engine.memory``).
    ``try_compiled``: the kept plan, and the next fastest within ``COMPILE_MARGIN`` (``to_compile``),
    are measured compiled too, appended to ``cands``. On
    return the kept plan is deployed with the initial state."""
    trials = to_measure(cands)
    if len(trials) == 1 and not try_compiled:  # the cost model tells them apart: nothing to measure
        kept = trials[0]
        kept.note = f"the only candidate predicted within {margin(cands):g}x of the fastest"
        if kept is not cands[0]:
            use(kept.plan, False, False, False)
        return kept
    deployed = cands[0]
    for c in trials:
        if c is deployed or not _cannot_fit(c, cands[0]):
            deployed = _trial(c, deployed, use, step, observe, memory)
    kept = keep(cands)
    if try_compiled:
        kept.note = ""  # the fastest replayed; the compiled trials may change which is kept
        for c in to_compile(cands, kept):
            cands.append(Candidate(f"{c.label}, compiled", c.plan, compiled=True))
            deployed = _trial(cands[-1], deployed, use, step, observe, memory)
        kept = keep(cands)
    # The trial steps changed the state: load it again; in fresh workers where the kept plan's
    # devices held more than it may use (what the earlier trials left counted in its measurement).
    fresh = not kept.fits()
    use(kept.plan, fresh, kept.compiled, kept is deployed and not fresh)
    return kept


def to_compile(cands: list[Candidate], kept: Candidate) -> list[Candidate]:
    """The replayed candidates to measure compiled too: ``kept``, then the next fastest measured
    that may fit, within ``COMPILE_MARGIN`` of ``kept``'s time, ``COMPILED_TRIALS`` in all. Those
    left out get a note."""
    out = [kept]
    for c in sorted((c for c in cands if c.measured_s is not None and c is not kept and c.may_fit()),
                    key=lambda c: c.measured_s):
        within = c.measured_s <= COMPILE_MARGIN * kept.measured_s
        if within and len(out) < COMPILED_TRIALS:
            out.append(c)
        elif not c.note:
            why = f"{COMPILED_TRIALS} compiled trials already" if within else f"over {COMPILE_MARGIN:g}x"
            c.note = (f"measured {c.measured_s / kept.measured_s:.2f}x the {kept.label} plan replayed ({why}): "
                      "not measured compiled")
    return out


def _trial(c: Candidate, deployed: Candidate, use: Callable, step: Callable, observe: Callable,
           memory: Callable) -> Candidate:
    """Measure ``c`` (``select``), deploying it unless it is ``deployed``; the candidate deployed after."""
    if c is not deployed:
        use(c.plan, False, c.compiled, False)
    for _ in range(SKIP):
        step()
    timed: list[float] = []
    while len(timed) < TIMED_STEPS[1] and (len(timed) < TIMED_STEPS[0] or sum(timed) < TIMED_S):
        t = time.perf_counter()
        step()
        timed.append(time.perf_counter() - t)
    c.measured_s = statistics.median(timed)
    c.observations = [] if c.compiled else observe(c.plan)  # the cost model prices kernels replayed
    held = memory()  # per device: (peak, of it left by earlier trials)
    c.measured_bytes = max(peak for peak, _ in held)
    c.own_bytes = max(peak - left for peak, left in held)
    return c


def report(tuning: list[dict]) -> str:
    """A text table of the candidates (``Candidate.to_dict``): predicted and measured step time,
    which was kept and why."""
    rows = [("candidate", "plan", "predicted ms", "measured ms", "simulated MiB", "measured MiB", "")]
    for t in tuning:
        measured_mib = t.get("measured_bytes")  # plans cached before memory was measured have none
        rows.append((t["label"] + (" (kept)" if t["kept"] else ""), t["plan"], f"{t['predicted_s'] * 1e3:.1f}",
                     "-" if t["measured_s"] is None else f"{t['measured_s'] * 1e3:.1f}",
                     "-" if t.get("predicted_bytes") is None else f"{t['predicted_bytes'] / _MiB:.0f}",
                     _mib_text(measured_mib, t.get("own_bytes")), t["note"]))
    return "measured plan selection (tune=True):\n" + "\n".join(text_table(rows, indent="  "))


def _mib_text(measured_bytes: float | None, own_bytes: float | None) -> str:
    """'-', '312', or '312 (own 150)' where earlier trials had left memory on the workers."""
    if measured_bytes is None:
        return "-"
    text = f"{measured_bytes / _MiB:.0f}"
    if own_bytes is not None and round(own_bytes / _MiB) != round(measured_bytes / _MiB):
        text += f" (own {own_bytes / _MiB:.0f})"
    return text


def tuned_fields(graph: OpGraph, cluster: Cluster, options: PlanOptions) -> dict:
    """The plan cache key of the measured choice for ``options``."""
    return {**key_fields(graph, cluster, options), "tuned": TUNE_VERSION}


def cached_choice(cache: PlanCache | None, graph: OpGraph, cluster: Cluster,
                  options: PlanOptions) -> ParallelPlan | None:
    """The measured choice of an earlier run, or None."""
    if cache is None:
        return None
    hit = cache.get(tuned_fields(graph, cluster, options), graph, cluster)
    return None if hit is None else hit[0]


def store_choice(cache: PlanCache | None, graph: OpGraph, cluster: Cluster, options: PlanOptions,
                 cands: list[Candidate], kept: Candidate) -> None:
    """Store the kept plan, with every candidate's measurements in its ``options['tuning']``."""
    kept.plan.options["tuning"] = [c.to_dict(c is kept) for c in cands]
    if cache is not None:
        cache.put(tuned_fields(graph, cluster, options), kept.plan)


def kept_compiled(tuning: list[dict]) -> bool:
    """Whether the kept candidate of a measured choice (``Candidate.to_dict``s) was the compiled one."""
    return any(t["kept"] and t.get("compiled", False) for t in tuning)


def _decisions(plan: ParallelPlan) -> str:
    d = plan_decisions(plan)
    d.pop("options", None)
    return json.dumps(d, sort_keys=True)


__all__ = ["CALIBRATED_MARGIN", "COMPILED_TRIALS", "COMPILE_MARGIN", "ENV_VAR", "MARGIN", "SKIP", "TIMED_S",
           "TIMED_STEPS", "Candidate", "cached_choice", "candidates", "enabled", "fewer_microbatches", "keep",
           "kept_compiled", "margin", "report", "select", "store_choice", "to_compile", "to_measure", "tuned_fields",
           "variants"]
