"""Measured plan selection on the running workers: the part of ``alpa_torch.api.ParallelStep``
that runs ``alpa_torch.tune``'s trials.

``_tune`` runs after the first deployment when ``tune`` is on: it asks ``tune.candidates`` for
the plans the cost model cannot tell apart, has ``tune.select`` deploy and time each on the
workers (``_use``: on the running workers, on new ones where a candidate could not fit beside
what earlier trials left, compiled or not), keeps the fastest, stores the choice and the
measured cost corrections (``calibration``) in the plan cache, and leaves the kept plan
deployed with the initial state.
"""

from __future__ import annotations

import logging
import time

from alpa_torch.core.cluster import Cluster
from alpa_torch.core.plan import ParallelPlan

from . import calibration
from . import tune as tuner

log = logging.getLogger(__name__)


class MeasuredSelection:
    """Measured plan selection; mixed into ``ParallelStep`` (whose fields it uses)."""

    def _tune(self, model, optimizer, batch, sources: list) -> None:
        """Measured plan selection (``alpa_torch.tune``): run the candidates the cost model cannot
        tell apart on the workers, keep the fastest, load the initial state (``sources``) into it."""
        t0 = time.perf_counter()
        cands = tuner.candidates(self.plan, self.graph, Cluster.from_dict(self.plan.cluster), self.options,
                                 self.plan_cache, self.progress)  # the cluster the plan was priced on
        if len(cands) == 1 and self.compile is not None:
            return
        scalars = self._functional.host_scalars()
        leaves = self._batch_leaves(batch)

        def observe(plan: ParallelPlan) -> list[dict]:  # one more step, recorded
            self.engine.record(True)
            self.engine.step(leaves, scalars)
            observations = calibration.observe(plan, self.engine.events())
            self.engine.record(self.trace)
            return observations

        kept = tuner.select(cands, lambda plan, fresh, compiled, again: self._use(plan, model, optimizer, batch,
                                                                                   sources, fresh, compiled, again),
                            lambda: self.engine.step(leaves, scalars), observe,
                            lambda: self.engine.memory(), try_compiled=self.compile is None)
        tuner.store_choice(self.plan_cache, self.graph, self.cluster, self.options, cands, kept)
        corrections = calibration.fit([ob for c in cands for ob in c.observations])
        calibration.store(self.plan_cache, self.cluster, self.graph, corrections)
        self.tuning = kept.plan.options["tuning"]
        self.plan_source = f"measured ({self.plan_source})"
        text = tuner.report(self.tuning) + (f"\n  measured cost corrections (measured / predicted), stored for "
                                            f"this step and cluster: {corrections}" if corrections else "")
        log.info("%s\n(%.1f s)", text, time.perf_counter() - t0)
        if self.progress is not None:
            self.progress(text)

    def _use(self, plan: ParallelPlan, model, optimizer, batch, sources: list, fresh: bool = False,
             compiled: bool = False, again: bool = False) -> None:
        """Deploy ``plan`` on the running workers (on new ones if ``fresh``: none of the memory the
        earlier plans left; their programs compiled if ``compiled``) and load the state ``sources``
        give into it; ``again``: ``plan`` is deployed already, so only the state is loaded again and
        the step count restarted (``Engine.restart``)."""
        if again:
            self.engine.restart(sources)
            return
        self.plan, self.compiled = plan, compiled
        self.run_graph = self._runtime_graph(model, optimizer, batch)
        if fresh:
            self._stop_workers()
            self._launch(sources)
            return
        self.engine = self._deploy()
        self.engine.load(sources)
