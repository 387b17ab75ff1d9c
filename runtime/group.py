"""A group of device workers: start them on Ray, call into them, notice when one dies, stop them.

Owns ``WorkerGroup``: one ``DeviceWorker`` actor per device of a ``Cluster``,
placed by a placement group (every device of a host on one node), joined into
one torch.distributed group, and called with ``call_all`` / ``call``. Every
wait has a timeout; a dead or failed worker raises ``WorkerError`` naming its
rank and host, and the group shuts itself down (a surviving rank may be stuck
in a collective with the dead one, and nothing can interrupt it but a kill).
It does not know what the workers compute: the executor sends callables.

Ranks are host-major like ``Cluster``: rank ``h * devices_per_host + i`` is
local device ``i`` of host ``h``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray import cloudpickle
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from alpa_torch.core.cluster import Cluster
from alpa_torch.core.errors import WorkerError, WorkerFailure
from runtime.ray_env import ResourcePlan, alive_nodes, ensure_ray, plan_resources, stop_ray
from runtime.worker import RemoteDeviceWorker, SharedCall, actor_env

logger = logging.getLogger(__name__)

# Shared arguments at least this large go through the object store once, not once per rank.
_PUT_ONCE_BYTES = 100 * 1024
# Graceful leave of the process group at shutdown; then actors are killed regardless.
_GRACEFUL_S = 5.0
# After a first failure, how long to collect other ranks' failures (to name the dead rank).
_FAILURE_GRACE_S = 2.0
# How long shutdown waits for worker processes on this machine to exit.
_EXIT_WAIT_S = 10.0
# How long clearing a kept group's workers (DeviceWorker.clear) or asking a kept group's workers
# whether they are alive may take before the group is shut down instead.
_KEEP_CHECK_S = 30.0
# A worker holding more process groups than this is not kept: each deployment's meshes add groups
# that stay (DeviceWorker.clear), each with its sockets and threads.
_KEEP_MAX_GROUPS = 128


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerInfo:
    """Where one device's worker runs."""

    rank: int
    host_index: int
    pid: int
    hostname: str
    node_ip: str


KEEP_WORKERS_ENV = "ALPA_TORCH_KEEP_WORKERS"
"""``ALPA_TORCH_KEEP_WORKERS=1`` in the driver's environment: a group shut down cleanly on a Ray it
did not start keeps its workers, cleared of every deployment (``DeviceWorker.clear``), with their
process group and their Ray reservation, and the next ``WorkerGroup.start`` in this process for the
same cluster, Ray and worker environment takes them instead of starting new ones (starting and
joining a 1x2 group's workers takes 4-7 s on 2 cores). One group is kept at most: a start for
another cluster shuts it down first, so it never holds resources a new group waits for; Ray ends
it with this process's job. For many short runs on one cluster (the tests set it); off by default,
since kept workers hold their devices after ``shutdown()``."""


@dataclass(frozen=True, slots=True)
class _Kept:
    """A group's workers kept for the next start with the same ``key`` (``KEEP_WORKERS_ENV``)."""

    key: tuple
    actors: list[Any]
    pg: PlacementGroup
    infos: list[WorkerInfo]


_kept: _Kept | None = None


class WorkerGroup:
    """One Ray actor per device of ``cluster``, in one torch.distributed group. Use ``WorkerGroup.start``."""

    def __init__(self, cluster: Cluster, *, started_ray: bool, call_timeout_s: float) -> None:
        self.cluster = cluster
        self.call_timeout_s = call_timeout_s
        """Default limit of ``call_all`` / ``call``, seconds."""
        self.startup_s: dict[str, float] = {}
        """Seconds per start-up phase: ray, placement, actors, process_group; or ray, kept (``KEEP_WORKERS_ENV``)."""
        self.infos: list[WorkerInfo] = []
        self._started_ray = started_ray
        self._actors: list[Any] = []
        self._pg: PlacementGroup | None = None
        self._closed_reason: str | None = None
        self._key: tuple | None = None
        """What a kept group must match to be taken (``KEEP_WORKERS_ENV``): cluster, Ray job, worker
        environment, collective timeout."""

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, cluster: Cluster, *, address: str | None = None, timeout_s: float = 120.0,
              call_timeout_s: float = 600.0, collective_timeout_s: float = 300.0,
              log_to_driver: bool = False, reserve_timeout_s: float | None = None) -> WorkerGroup:
        """Start a worker per device of ``cluster`` and join them into one process group.

        ``timeout_s`` bounds each start-up phase (resources, actors, process group;
        ``reserve_timeout_s``, if given, the first);
        ``collective_timeout_s`` is torch.distributed's own timeout inside the workers.
        Raises ``ClusterSpecError`` if Ray is too small, ``WorkerError`` if a phase fails.
        """
        t0 = time.perf_counter()
        started = ensure_ray(cluster, address=address, log_to_driver=log_to_driver)
        group = cls(cluster, started_ray=started, call_timeout_s=call_timeout_s)
        group.startup_s["ray"] = time.perf_counter() - t0
        try:
            plan = plan_resources(cluster, alive_nodes())
            threads = cluster.threads_per_device
            env = actor_env(threads, oversubscribed=plan.cpus_per_device < threads)
            group._key = (cluster, ray.get_runtime_context().get_job_id(), tuple(sorted(env.items())),
                          collective_timeout_s)
            if not group._take_kept():
                group._reserve(plan, timeout_s if reserve_timeout_s is None else reserve_timeout_s)
                group._start_actors(plan, env, timeout_s)
                group._init_process_group(timeout_s, collective_timeout_s)
        except BaseException:
            group.shutdown(graceful=False)
            raise
        logger.info("worker group of %d devices up: %s", cluster.num_devices,
                    ", ".join(f"{k} {v:.2f} s" for k, v in group.startup_s.items()))
        return group

    def _reserve(self, plan: ResourcePlan, timeout_s: float) -> None:
        t0 = time.perf_counter()
        self._pg = placement_group(list(plan.bundles), strategy=plan.strategy)
        if not self._pg.wait(timeout_seconds=timeout_s):
            raise WorkerError(
                f"Ray could not reserve {len(plan.bundles)} bundle(s) {plan.bundles[0]} ({plan.strategy}) for "
                f"{self._shape()} within {timeout_s:g} s: available {_rounded(ray.available_resources())} of "
                f"{_rounded(ray.cluster_resources())}. Fix: shut down other WorkerGroups or work on this Ray "
                "cluster, or give Ray more CPUs/GPUs.")
        self.startup_s["placement"] = time.perf_counter() - t0

    def _take_kept(self) -> bool:
        """Take the kept group's workers if they were kept for this group's key, keeping is on and they
        all answer (``KEEP_WORKERS_ENV``); shut a kept group on this Ray down otherwise. Whether they
        were taken."""
        global _kept
        kept, _kept = _kept, None
        if kept is None:
            return False
        t0 = time.perf_counter()
        if kept.key == self._key and _keeping():
            try:
                self._gather([a.ping.remote() for a in kept.actors], range(len(kept.actors)), _KEEP_CHECK_S,
                             "a kept worker's ping")
            except WorkerError as exc:
                logger.info("kept workers not taken: %s", _first_lines(exc))
            else:
                self._actors, self._pg, self.infos = kept.actors, kept.pg, kept.infos
                self.startup_s["kept"] = time.perf_counter() - t0
                return True
        if kept.key[1] == self._key[1]:  # on the same Ray: its resources are freed for this group
            _stop(kept.actors, kept.pg, kept.infos)
        return False

    def _start_actors(self, plan: ResourcePlan, env: dict[str, str], timeout_s: float) -> None:
        t0 = time.perf_counter()
        c = self.cluster
        for rank in range(c.num_devices):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=plan.bundle_index(rank, c.devices_per_host))
            actor = RemoteDeviceWorker.options(
                num_cpus=plan.cpus_per_device, num_gpus=plan.gpus_per_device, max_restarts=0,
                runtime_env={"env_vars": env}, scheduling_strategy=strategy,
            ).remote(rank, self.host_of(rank), c.threads_per_device, use_gpu=plan.gpus_per_device > 0)
            self._actors.append(actor)
        infos = self._gather([a.info.remote() for a in self._actors], range(c.num_devices), timeout_s,
                             "start-up (actor ready)")
        node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in alive_nodes()}
        self.infos = [WorkerInfo(rank=i["rank"], host_index=self.host_of(i["rank"]), pid=i["pid"],
                                 hostname=i["hostname"], node_ip=node_ips.get(i["node_id"], "?")) for i in infos]
        self.startup_s["actors"] = time.perf_counter() - t0

    def _init_process_group(self, timeout_s: float, collective_timeout_s: float) -> None:
        t0 = time.perf_counter()
        # Rank 0 hosts the TCP store: loopback for local devices, else rank 0's node as Ray knows it
        # (Ray 2.60 turns _node_ip_address='127.0.0.1' into the routable IP, so ask for loopback here).
        addr = "127.0.0.1" if self.cluster.is_local else self.infos[0].node_ip
        n = self.cluster.num_devices
        port = self._gather([self._actors[0].host_store.remote(addr, n, collective_timeout_s)], [0], timeout_s,
                            "rendezvous store")[0]
        refs = [a.init_process_group.remote(r, n, addr, port, self.cluster.backend, collective_timeout_s)
                for r, a in enumerate(self._actors)]
        self._gather(refs, range(n), timeout_s, f"init_process_group({self.cluster.backend} at {addr}:{port})")
        self.startup_s["process_group"] = time.perf_counter() - t0

    # ------------------------------------------------------------------ calls
    @property
    def world_size(self) -> int:
        return self.cluster.num_devices

    def host_of(self, rank: int) -> int:
        """Host index of device ``rank`` (host-major numbering)."""
        return rank // self.cluster.devices_per_host

    def pids(self) -> list[int]:
        """Worker process ids in rank order."""
        return [info.pid for info in self.infos]

    def call_all(self, fn: Callable[..., Any], *args: Any, per_rank_args: Sequence[Sequence[Any]] | None = None,
                 timeout_s: float | None = None, answer_early: bool = False, **kwargs: Any) -> list[Any]:
        """``fn(state, *args, *per_rank_args[rank], **kwargs)`` on every rank; results in rank order.

        ``fn`` runs inside the worker with its persistent ``state`` dict; tensors in
        results come back as numpy. Any failure, death or timeout raises ``WorkerError``
        and shuts the group down. With ``answer_early``, ``fn(state, ..., answer=answer)`` may hand
        back its result before it ends (``DeviceWorker.run_early``): an error after that is
        raised by the rank's next call.
        """
        self._check_open()
        n = self.world_size
        if per_rank_args is not None and len(per_rank_args) != n:
            raise ValueError(f"per_rank_args has {len(per_rank_args)} entries for {n} ranks. "
                             "Fix: give one tuple of arguments per rank.")
        if n > 1 and not any(map(_put_once, (*args, *kwargs.values()))):
            # small shared arguments (a step's microbatches) go with fn, pickled once for all ranks:
            # Ray would serialize them again for every rank's call
            fn_bytes, shared, shared_kw = cloudpickle.dumps(SharedCall(fn, args, kwargs)), [], {}
            if len(fn_bytes) >= _PUT_ONCE_BYTES:  # nested arrays: in the object store once for all ranks
                fn_bytes = ray.put(fn_bytes)
        else:
            fn_bytes = cloudpickle.dumps(fn)  # pickled once, the same bytes to every rank
            shared = [_put_if_large(a) for a in args] if n > 1 else list(args)
            shared_kw = {k: _put_if_large(v) for k, v in kwargs.items()} if n > 1 else kwargs
        refs = [(actor.run_early if answer_early else actor.run).remote(
                    fn_bytes, *shared, *(per_rank_args[r] if per_rank_args else ()), **shared_kw)
                for r, actor in enumerate(self._actors)]
        return self._gather_or_close(refs, range(n), timeout_s, _name(fn))

    def call(self, rank: int, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
             **kwargs: Any) -> Any:
        """``fn(state, *args, **kwargs)`` on device ``rank`` only (no collectives with the others!)."""
        self._check_open()
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1}")
        ref = self._actors[rank].run.remote(cloudpickle.dumps(fn), *args, **kwargs)
        return self._gather_or_close([ref], [rank], timeout_s, _name(fn))[0]

    def _gather_or_close(self, refs: list[Any], ranks: Sequence[int], timeout_s: float | None, what: str) -> list:
        try:
            return self._gather(refs, ranks, self.call_timeout_s if timeout_s is None else timeout_s, what)
        except WorkerError as exc:
            self.shutdown(graceful=False, reason=str(exc))
            raise

    def _gather(self, refs: list[Any], ranks: Sequence[int], timeout_s: float, what: str) -> list[Any]:
        """Results of ``refs`` (one per rank in ``ranks``); ``WorkerError`` soon after the first failure."""
        pending = dict(zip(refs, ranks, strict=True))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                late = sorted(pending.values())
                raise WorkerError(
                    f"{what}: device rank(s) {late} (host(s) {sorted({self.host_of(r) for r in late})}) did not "
                    f"answer within {timeout_s:g} s; done: {sorted(results)}. The group is shut down, since a "
                    "rank stuck in a collective cannot be interrupted. Fix: raise timeout_s, or look for a "
                    "rank that deadlocked (mismatched collectives) or is far slower.",
                    failures=tuple(self._worker_failure(r, False, f"no answer within {timeout_s:g} s")
                                   for r in late))
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0], timeout=0)
            except ray.exceptions.RayError as exc:
                raise self._failure(what, {rank: exc} | self._more_failures(pending)) from exc
        return [results[r] for r in ranks]

    @staticmethod
    def _more_failures(pending: dict[Any, int]) -> dict[int, BaseException]:
        """Errors other ranks report within a short grace: a peer of a dead rank often fails first
        (gloo: connection closed), and the message should name the rank that died."""
        failures: dict[int, BaseException] = {}
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_FAILURE_GRACE_S) if pending else ([], [])
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayError as exc:
                failures[pending[ref]] = exc
        return failures

    def _failure(self, what: str, failures: dict[int, BaseException]) -> WorkerError:
        """One ``WorkerError`` for all failed ranks, dead ranks first (they are the cause)."""
        gone = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)  # killed, by Ray's memory monitor too
        died = sorted(r for r, e in failures.items() if isinstance(e, gone))
        raised = sorted(r for r in failures if r not in died)
        lines, records = [], []
        for rank in died + raised:
            exc, where = failures[rank], f"device rank {rank} (host {self.host_of(rank)}{self._pid_text(rank)})"
            if rank in died:
                text = _first_lines(exc, 20)  # a failed __init__ puts its traceback here
                lines.append(f"{where} died: {text}")
            elif isinstance(exc, ray.exceptions.RayTaskError):
                text = f"{type(exc.cause).__name__}: {exc.cause}\nWorker traceback:\n{exc}"
                lines.append(f"{where} raised {text}")
            else:
                text = _first_lines(exc)
                lines.append(f"{where} failed: {text}")
            records.append(self._worker_failure(rank, rank in died, text))
        if any(isinstance(e, ray.exceptions.OutOfMemoryError) for e in failures.values()):
            fix = ("Fix: the node ran out of memory and Ray killed the worker: a plan needing less memory per device "
                   "(parallelize(..., memory_budget_bytes=...)), a smaller batch or model, or more devices; start a "
                   "new group.")
        elif died:
            fix = "Fix: check the dead worker's log (out of memory? killed?) and start a new group."
        else:
            fix = "Fix: correct the error in the callable; start a new group."
        head = f"{what} failed on device rank(s) {died + raised} (died: {died}, raised: {raised}); group shut down."
        return WorkerError("\n".join([head, *lines, fix]), failures=tuple(records))

    def _worker_failure(self, rank: int, died: bool, error: str) -> WorkerFailure:
        info = self.infos[rank] if rank < len(self.infos) else None
        return WorkerFailure(rank=rank, host=self.host_of(rank), pid=info.pid if info else None,
                             hostname=info.hostname if info else None, died=died, error=error)

    def _pid_text(self, rank: int) -> str:
        return f", pid {self.infos[rank].pid} on {self.infos[rank].hostname}" if rank < len(self.infos) else ""

    def _shape(self) -> str:
        return f"a {self.cluster.num_hosts}x{self.cluster.devices_per_host} cluster"

    def _check_open(self) -> None:
        if self._closed_reason is not None:
            raise WorkerError(f"this worker group is shut down ({self._closed_reason}). "
                              "Fix: start a new one with WorkerGroup.start(cluster).")

    # --------------------------------------------------------------- shutdown
    def shutdown(self, *, graceful: bool = True, reason: str = "shutdown() was called") -> None:
        """Leave the process group (if ``graceful``), kill the actors, free the reservation, wait for
        this machine's worker processes to exit, and stop Ray if ``start`` started it. Idempotent."""
        if self._closed_reason is not None:
            return
        self._closed_reason = reason.splitlines()[0]
        if graceful and self._keep():
            return
        if ray.is_initialized():
            if graceful and self._actors:
                ray.wait([a.shutdown.remote() for a in self._actors], num_returns=len(self._actors),
                         timeout=_GRACEFUL_S)
            _stop(self._actors, self._pg, self.infos)
            if self._started_ray:
                stop_ray()
        self._actors, self._pg = [], None

    def _keep(self) -> bool:
        """Keep this group's workers for the next start (``KEEP_WORKERS_ENV``) if it is on, this group
        did not start Ray, and every worker clears its state; whether they were kept."""
        global _kept
        if not _keeping() or self._started_ray or not self._actors or self._key is None or not ray.is_initialized():
            return False
        try:
            groups = self._gather([a.clear.remote() for a in self._actors], range(len(self._actors)),
                                  _KEEP_CHECK_S, "clearing the workers to keep them")
        except WorkerError as exc:
            logger.warning("workers not kept: %s", _first_lines(exc))
            return False
        if max(groups) > _KEEP_MAX_GROUPS:
            logger.info("workers not kept: they hold %d process groups (at most %d)", max(groups), _KEEP_MAX_GROUPS)
            return False
        if _kept is not None:
            _stop(_kept.actors, _kept.pg, _kept.infos)
        _kept = _Kept(self._key, self._actors, self._pg, self.infos)
        self._actors, self._pg = [], None
        return True

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown(graceful=exc_info[0] is None)

    def __repr__(self) -> str:
        state = "open" if self._closed_reason is None else "shut down"
        return f"WorkerGroup({self._shape()}, {self.cluster.backend}, {state}, pids={self.pids()})"


def _keeping() -> bool:
    """Whether ``KEEP_WORKERS_ENV`` is on in this process's environment."""
    return os.environ.get(KEEP_WORKERS_ENV, "0") not in ("", "0")


def _stop(actors: list[Any], pg: PlacementGroup | None, infos: list[WorkerInfo]) -> None:
    """Kill the workers ``actors``, free their reservation ``pg`` and wait for their processes on this
    machine to exit."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 (already dead is fine)
            logger.debug("ray.kill: %s", exc)
    if pg is not None:
        remove_placement_group(pg)
    _wait_exit([i.pid for i in infos if i.hostname == socket.gethostname()], _EXIT_WAIT_S)


def _put_once(value: Any) -> bool:
    """A numpy array large enough to matter: it goes to the object store once, ranks read it zero-copy."""
    return isinstance(value, np.ndarray) and value.nbytes >= _PUT_ONCE_BYTES


def _put_if_large(value: Any) -> Any:
    return ray.put(value) if _put_once(value) else value


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _first_lines(exc: BaseException, n: int = 3) -> str:
    return " ".join(str(exc).strip().splitlines()[:n])


def _rounded(resources: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in sorted(resources.items()) if k in ("CPU", "GPU")}


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _wait_exit(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        logger.warning("worker process(es) %s still running %g s after shutdown", left, timeout_s)
