"""Checkpoints and recovery of a ``ParallelStep``: save, load, and restarting after a failure.

``ResilientStep`` is the part of ``alpa_torch.api.ParallelStep`` that deals with checkpoints
(``runtime/checkpoint.py`` owns the format). With ``max_restarts=N, checkpoint_dir=d,
checkpoint_every=k`` a step writes a checkpoint to ``d`` at start and after every k-th
step; when a worker dies (``WorkerError``) it starts new workers, reloads the last
checkpoint and retries the step that failed, at most N times in the step's life. The
batches of steps run after that checkpoint are gone, so their updates are lost: the
contract is "training continues from the checkpoint's state, and the failed step is
retried on it". With k = 1 the losses are those of an uninterrupted run.

Losing a host: on a cluster of real hosts (``cluster_from_ray``), a restart first waits up
to ``host_timeout_s`` for Ray to report every host alive again. If a host stays gone (or
its workers cannot be placed within that time), the step plans again for the hosts that
are left and loads the checkpoint onto the new plan (a checkpoint loads onto any plan and
cluster size), then retries the failed step there.
"""

from __future__ import annotations

import logging
import time

from alpa_torch.core.errors import CheckpointError, ClusterSpecError, WorkerError

from .initial_state import checkpoint_source
from .optim import LossScaler

log = logging.getLogger(__name__)

MIN_RESERVE_S = 5.0
"""A restart on the same cluster waits at least this long for its workers' resources (Ray
takes a moment to place them even when every host is there)."""


def check_reliability_options(max_restarts, checkpoint_dir, checkpoint_every, host_timeout_s) -> None:
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise CheckpointError(f"max_restarts={max_restarts!r} must be an int >= 0")
    if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
        raise CheckpointError(f"checkpoint_every={checkpoint_every!r} must be an int >= 1 (steps between checkpoints)")
    if max_restarts and checkpoint_dir is None:
        raise CheckpointError(f"max_restarts={max_restarts} needs checkpoint_dir=...: a restart reloads the last "
                              "checkpoint written there. Fix: pass checkpoint_dir (shared storage on real hosts).")
    if not isinstance(host_timeout_s, (int, float)) or host_timeout_s < 0:
        raise CheckpointError(f"host_timeout_s={host_timeout_s!r} must be a number of seconds >= 0 (how long a "
                              "restart waits for a lost host to come back before planning for the hosts left)")


class ResilientStep:
    """Checkpoints and restarts; mixed into ``ParallelStep`` (whose fields it uses)."""

    def _run_step(self, leaves: dict, model, optimizer, batch) -> float:
        """One step on the workers; on a ``WorkerError`` restart from the last checkpoint and retry it."""
        while True:
            number = self._step + 1
            try:
                loss = self.engine.step(leaves, self._functional.host_scalars())
                self._step = number
                if self.checkpoint_dir is not None and number % self.checkpoint_every == 0:
                    self.save(self.checkpoint_dir)
                return loss
            except WorkerError as exc:
                if self.restarts >= self.max_restarts:
                    fix = (f"gave up after {self.restarts} restart(s) (max_restarts={self.max_restarts})"
                           if self.max_restarts else "to restart automatically from the last checkpoint, pass "
                           "max_restarts=N and checkpoint_dir=... to parallelize")
                    raise WorkerError(f"step {number}: {exc}\n{fix}.") from exc
                self._restart(exc, number, model, optimizer, batch)

    def _restart(self, exc: WorkerError, number: int, model, optimizer, batch) -> None:
        """New workers from the last checkpoint: on the same cluster, or planned again for the hosts left."""
        from runtime import checkpoint

        self.restarts += 1
        log.warning("step %d: %s; restart %d of %d from the checkpoint in %s", number,
                    str(exc).splitlines()[0], self.restarts, self.max_restarts, self.checkpoint_dir)
        self._stop_workers()  # the group already shut itself down; this drops the references
        path, manifest = checkpoint.read_manifest(self.checkpoint_dir)
        smaller = self._wait_for_hosts()
        if smaller is None:
            try:
                self._launch([checkpoint_source(self.graph, path, manifest)],
                             reserve_timeout_s=max(self.host_timeout_s, MIN_RESERVE_S))
                self._step = manifest["step"]
                return
            except (WorkerError, ClusterSpecError):
                smaller = self._hosts_left()
                if smaller is None:
                    raise
        log.warning("%d of %d host(s) left after waiting %g s for the lost one(s): planning again for %s",
                    smaller.num_hosts, self.cluster.num_hosts, self.host_timeout_s, smaller.describe())
        self.cluster = smaller
        self.make_plan(model, optimizer, batch)
        self.run_graph = self._runtime_graph(model, optimizer, batch)
        self._launch([checkpoint_source(self.graph, path, manifest)])
        self._step = manifest["step"]

    def _hosts_left(self):
        """The cluster cut to the hosts Ray has alive, when fewer than the step's (None: all there, or
        a local cluster, whose hosts are virtual)."""
        if self.cluster.is_local:
            return None
        from runtime.discovery import hosts_left

        return hosts_left(self.cluster)

    def _wait_for_hosts(self):
        """``_hosts_left`` once every host is back or ``host_timeout_s`` has passed."""
        deadline = time.monotonic() + self.host_timeout_s
        smaller = self._hosts_left()
        while smaller is not None and time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            smaller = self._hosts_left()
        return smaller

    def save(self, directory: str) -> str:
        """Write a checkpoint of the live state to ``directory`` (``runtime/checkpoint.py``):
        each worker writes its own shards, the driver the manifest; the previous checkpoint
        there is replaced atomically. Returns the directory's absolute path."""
        from runtime import checkpoint

        if self.engine is None:
            raise CheckpointError("nothing to save: the step has not run yet (or was shut down); call it once "
                                  "before save()")
        meta = {"step": self._step, "graph_fingerprint": self.plan.graph_fingerprint, "plan": self.plan.to_dict(),
                "tensors": self._tensor_table(),
                "optimizer": self._describe_optimizers(checkpoint.describe_optimizer)}
        return str(checkpoint.save_checkpoint(directory, self.engine.save_shards, meta))

    def load(self, directory: str) -> int:
        """Restore a checkpoint written by ``save`` (by any plan or cluster size); returns its step.

        Before the first call it is applied when the step starts (the model's and optimizer's
        own values are then ignored); afterwards the running workers are reloaded. The
        optimizer's step count comes from the checkpoint; ``lr`` still from the optimizer."""
        from runtime import checkpoint

        path, manifest = checkpoint.read_manifest(directory)
        if self.engine is None:
            self._pending = (path, manifest)
        else:
            self.engine.load([checkpoint_source(self.graph, path, manifest)])
            self._step = manifest["step"]
        return manifest["step"]

    def _describe_optimizers(self, describe):
        """The manifest's ``optimizer``: one description, or a list for a step of several optimizers."""
        f = self._functional
        out = [describe(opt, [n for n in f.names if f.owner[n][0] == k]) for k, opt in enumerate(f.optimizers)]
        return out if len(out) > 1 else out[0]

    def _tensor_table(self) -> dict[str, dict]:
        """Manifest ``tensors``: kind, shape, dtype (and param, key of optimizer state)."""
        owner = {f"{n}.{k}": (n, k) for n in self._functional.names for k in self._functional.state_names(n)}
        owner.update({n: ("<amp>", n) for n in LossScaler.STATE})  # fp16 loss scaling: no parameter's state
        table = {}
        for s in self.graph.inputs:
            if s.kind in ("param", "buffer", "opt_state"):
                table[s.name] = {"kind": s.kind, "shape": list(s.shape), "dtype": s.dtype}
                if s.kind == "opt_state":
                    table[s.name]["param"], table[s.name]["key"] = owner[s.name]
        return table

    def _warn_overwrite(self) -> None:
        from runtime import checkpoint

        try:
            _, old = checkpoint.read_manifest(self.checkpoint_dir)
        except CheckpointError:
            return
        if old["step"] != self._step:
            log.warning("overwriting the checkpoint of step %d in %s with step %d; to resume from it, call "
                        "step.load(%r) before the first step", old["step"], self.checkpoint_dir, self._step,
                        self.checkpoint_dir)
