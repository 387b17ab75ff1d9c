"""Independent jobs on forked worker processes: ``fork_map``.

Owns: running ``fn(item)`` for a list of items on up to ``workers`` processes
forked from this one, results in item order. Does not own what the jobs are
(``stage_costs.StageCostModel.solve_many`` sends it per-layer ILPs).

Why fork. A job needs the captured graph and the cost model's caches, which do
not pickle cheaply (fx nodes, fake tensors); forked children share them
copy-on-write, and only items' indices go out and picklable results come back.
Jobs are pulled from a queue (the slow ILPs do not wait behind each other);
results are pure functions of the items, so which child ran which job does
not change them.

When not to fork (then the jobs run here, in order): one worker or job; no
``fork`` on the platform; other Python threads alive (a lock one holds at the
fork would stay held in the child); Ray initialised in this process (its
gRPC threads are not fork-safe). A child resets HiGHS's thread pool first
(its threads do not survive the fork).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait

from alpa_torch.core.errors import AlpaTorchError, PlannerError

logger = logging.getLogger(__name__)

POLL_S = 0.5


def default_workers() -> int:
    """min(2, CPUs this process may use): ILP solves are CPU-bound and single-threaded."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(2, cpus))


def can_fork() -> bool:
    """Module docstring, "When not to fork"."""
    if "fork" not in multiprocessing.get_all_start_methods() or threading.active_count() > 1:
        return False
    ray = sys.modules.get("ray")
    return not (ray is not None and getattr(ray, "is_initialized", lambda: False)())


def _child(fn, items, tasks, conn) -> None:
    try:
        import highspy

        highspy.Highs.resetGlobalScheduler(False)
    except Exception:  # noqa: BLE001 - no HiGHS, or an older one: nothing to reset
        pass
    while (i := tasks.get()) is not None:
        try:
            conn.send((i, True, fn(items[i])))
        except BaseException as exc:  # noqa: BLE001 - sent to the parent, re-raised there
            trace = "".join(traceback.format_exception(exc))
            try:
                conn.send((i, False, (exc, trace)))
            except Exception:  # noqa: BLE001 - an exception that does not pickle
                conn.send((i, False, (RuntimeError(f"{type(exc).__name__}: {exc}"), trace)))
    conn.close()


def _raise(exc: BaseException, trace: str, what: str):
    """Re-raise a job's exception in the parent. An alpa-torch error keeps its type (callers act on
    it) with the worker's traceback as a note; anything else becomes a ``PlannerError`` naming the
    job, with the worker's traceback in its message (a bare re-raise would show only this frame)."""
    if isinstance(exc, AlpaTorchError):
        exc.add_note(f"in a planner worker process, {what}:\n{trace}")
        raise exc
    raise PlannerError(f"the planner failed {what}: {type(exc).__name__}: {exc}\nplanner worker traceback:\n"
                       f"{trace}", traceback_text=trace) from exc


def _here(fn: Callable, item, describe: Callable[[object], str]):
    """``fn(item)`` in this process; a failure is named as a worker's would be."""
    try:
        return fn(item)
    except Exception as exc:  # noqa: BLE001 - re-raised with the job named
        _raise(exc, "".join(traceback.format_exception(exc)), describe(item))


def fork_map(fn: Callable, items: Sequence, workers: int, describe: Callable[[object], str] = repr) -> list:
    """``[fn(x) for x in items]``, on up to ``workers`` forked processes when that is safe.

    Children take item indices from one queue and send (index, ok, result or
    (exception, traceback text)) back on their own pipe; a child's pipe closing tells
    that it exited. A job's failure names it with ``describe(item)`` (``_raise``).
    """
    workers = min(workers, len(items))
    if workers <= 1 or not can_fork():
        return [_here(fn, x, describe) for x in items]
    ctx = multiprocessing.get_context("fork")
    tasks = ctx.SimpleQueue()
    readers = {}
    for _ in range(workers):
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(fn, items, tasks, w), daemon=True)
        p.start()
        w.close()
        readers[r] = p
    procs = list(readers.values())
    for i in list(range(len(items))) + [None] * workers:
        tasks.put(i)
    out: dict[int, object] = {}
    try:
        while len(out) < len(items):
            if not readers:
                raise RuntimeError("planner worker processes exited before finishing their jobs")
            for conn in wait(list(readers), timeout=POLL_S):
                try:
                    i, ok, value = conn.recv()
                except EOFError:  # the child exited
                    p = readers.pop(conn)
                    p.join()
                    if p.exitcode:
                        raise RuntimeError(f"a planner worker process died (exit code {p.exitcode})") from None
                    continue
                if not ok:
                    _raise(*value, describe(items[i]))
                out[i] = value
    finally:
        for p in procs:
            if p.is_alive() and len(out) < len(items):
                p.kill()
            p.join()
        for conn in readers:
            conn.close()
        tasks.close()
    return [out[i] for i in range(len(items))]
