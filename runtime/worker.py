"""One device's worker: the Ray actor that owns a device, its process group and its state.

Owns ``DeviceWorker`` (a plain class, so it can be tested in-process) and
``RemoteDeviceWorker`` (the same class as a Ray actor). A worker joins the
torch.distributed group (gloo on CPU, NCCL on GPU) and runs callables the
driver sends it as ``fn(state, *args, **kwargs)``, where ``state`` is a dict
that lives as long as the actor: the driver's code installs its program (the
compiled stage, parameters, optimizer state) there once and calls into it on
later calls. It does not decide what runs where (``runtime/group.py`` starts
the workers; the compiler and executor build what they run).

A step answers early (``run_early``): the callable hands the driver its result (the
loss, once the forward has computed it) and runs on in the worker's step thread, so the
driver's next call is on its way while this one finishes its backward and update. Ray
runs an actor's calls one at a time, and each later ``run``, ``run_early`` or ``shutdown``
first waits for that rest and raises its error, if it had one, so no callable of the
driver's ever sees a half-finished step (``info`` and ``ping`` read no state and do not wait).

Arrays cross Ray as numpy (docs/design.md: a 16 MiB tensor pickles in 68 ms, the
numpy array is read zero-copy in 12 ms): ``run`` turns torch tensors in a
result into numpy arrays; callables rebuild tensors with ``torch.from_numpy``.

Keys ``run`` callables find in ``state`` (set by the worker, do not overwrite):
``rank``, ``host_index``, ``world_size`` and ``memory_started`` (after
``init_process_group``; ``device_memory.started_bytes``) and ``device``
(``torch.device('cpu')`` or the actor's one GPU).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray import cloudpickle

from .device_memory import release_freed, started_bytes
from .switches import WORKER_SWITCHES
from .wire import to_wire

logger = logging.getLogger(__name__)

WorkerFn = Callable[..., Any]

_OWN_KEYS = ("rank", "host_index", "device", "world_size")
"""``state`` entries a worker sets for itself, which ``DeviceWorker.clear`` keeps."""


def to_numpy(value: Any) -> Any:
    """``value`` with every torch tensor in nested lists, tuples and dicts replaced by a numpy array
    (``wire.Bits`` for a dtype numpy lacks, e.g. bfloat16: ``wire.from_wire`` gives it back)."""
    if isinstance(value, torch.Tensor):
        return to_wire(value)
    if isinstance(value, dict):
        return {k: to_numpy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):  # NamedTuples pass as they are
        return type(value)(to_numpy(v) for v in value)
    return value


class DeviceWorker:
    """One device: a torch.distributed rank and a persistent ``state`` dict for the driver's program."""

    def __init__(self, rank: int, host_index: int, threads: int, use_gpu: bool = False) -> None:
        # One intra-op pool per virtual device: spinning OpenMP pools oversubscribe (docs/design.md).
        torch.set_num_threads(threads)
        device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")  # Ray shows each actor its one GPU
        if use_gpu:
            torch.cuda.set_device(device)
        self.state: dict[str, Any] = {"rank": rank, "host_index": host_index, "device": device}
        self._steps: ThreadPoolExecutor | None = None
        """The thread early-answering calls run in (``run_early``), started by the first."""
        self._rest: _EarlyCall | None = None
        """The part of the last early-answered call still running after its answer."""

    def info(self) -> dict[str, Any]:
        """Where this worker runs: pid, hostname, Ray node id, rank, torch threads."""
        return {"pid": os.getpid(), "hostname": socket.gethostname(), "rank": self.state["rank"],
                "node_id": ray.get_runtime_context().get_node_id(), "threads": torch.get_num_threads()}

    def pid(self) -> int:
        """The worker's process id."""
        return os.getpid()

    def hostname(self) -> str:
        """The name of the machine the worker runs on."""
        return socket.gethostname()

    def ping(self) -> bool:
        """True; answers once the actor is up and not busy."""
        return True

    def host_store(self, host: str, world_size: int, timeout_s: float = 60.0) -> int:
        """Rank 0: start the rendezvous store on ``host`` at a port the OS picks while binding it
        (no port is chosen first and bound later, so no other process can take it in between);
        returns the port."""
        store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        self.state["_store"] = store
        return int(store.port)

    def init_process_group(self, rank: int, world_size: int, master_addr: str, master_port: int,
                           backend: str, timeout_s: float = 60.0) -> bool:
        """Join the torch.distributed group of ``world_size`` ranks whose store rank 0 hosts at
        ``master_addr:master_port`` (``host_store``)."""
        assert rank == self.state["rank"], f"rank {rank} sent to the worker of rank {self.state['rank']}"
        timeout = datetime.timedelta(seconds=timeout_s)
        store = self.state.pop("_store", None) or dist.TCPStore(master_addr, master_port, world_size,
                                                                 is_master=False, timeout=timeout)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        self.state["world_size"] = world_size
        self.state["memory_started"] = started_bytes(self.state["device"])  # what a plan's peak counts from
        return True

    def run(self, fn: bytes | WorkerFn, *args: Any, **kwargs: Any) -> Any:
        """``fn(self.state, *args, **kwargs)``, tensors in the result as numpy (``fn``: a callable or
        its ``ray.cloudpickle`` bytes), after the rest of an early-answered call (``run_early``)."""
        self._finish_rest()
        return to_numpy(_loaded(fn)(self.state, *args, **kwargs))

    def run_early(self, fn: bytes | WorkerFn, *args: Any, **kwargs: Any) -> Any:
        """``fn(self.state, *args, answer=answer, **kwargs)``, returning as soon as it calls ``answer(value)``:
        ``value`` (as numpy), while the rest of ``fn`` runs on; its return value where it never
        answers. The worker's next call waits for the rest (module docstring)."""
        self._finish_rest()
        if self._steps is None:
            device = self.state["device"]
            self._steps = ThreadPoolExecutor(1, thread_name_prefix="step", initializer=(
                (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None))
        call = _EarlyCall(_loaded(fn), args, kwargs)
        self._steps.submit(call.run, self.state)
        call.ready.wait()
        self._rest = call
        if call.answered:
            return call.answer
        self._finish_rest()  # it ended without answering: its result, or its own error
        return call.result

    def _finish_rest(self) -> None:
        """Wait for the rest of the last early-answered call; raise its error."""
        call, self._rest = self._rest, None
        if call is None:
            return
        call.ended.wait()
        if call.error is not None and not call.answered:
            raise call.error
        if call.error is not None:
            raise StepRestError(f"the previous call failed after it had answered (its loss was already returned): "
                                f"{type(call.error).__name__}: {call.error}") from call.error

    def clear(self) -> int:
        """Forget every deployment, as if this worker had just joined its process group: finish the
        last call (raising its error), drop every ``state`` entry but the worker's own (``rank``,
        ``host_index``, ``device``, ``world_size``), give the freed memory back and count the plans'
        peaks from here (``memory_started``). A kept group (``group.KEEP_WORKERS_ENV``) is cleared so.
        Returns how many process groups besides the world's this process holds: a deployment's meshes
        make new ones each time, and they stay (destroying them made a later deployment of the same
        meshes fail: "Could not resolve the process group registered under the name 6", something of
        torch's still naming a destroyed group)."""
        import gc

        self._finish_rest()
        for key in [k for k in self.state if k not in _OWN_KEYS]:
            del self.state[key]
        gc.collect()
        release_freed(self.state["device"])
        self.state["memory_started"] = started_bytes(self.state["device"])
        world = dist.group.WORLD if dist.is_initialized() else None
        return sum(g is not world for g in dist.distributed_c10d._world.pg_map)

    def shutdown(self) -> bool:
        """Finish the last call, leave the process group (the actor itself is killed by the group)."""
        try:
            self._finish_rest()
        except StepRestError as exc:
            logger.warning("at shutdown: %s", exc)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self.state.pop("world_size", None)
        return True


@dataclass(frozen=True)
class SharedCall:
    """``fn`` with the leading arguments every rank gets, which the driver pickles once for all
    ranks (``WorkerGroup.call_all``); called as ``fn(state, *args, *rest, **kwargs, **more)``."""

    fn: WorkerFn
    args: tuple
    kwargs: dict

    def __call__(self, state: dict, *rest: Any, **more: Any) -> Any:
        return self.fn(state, *self.args, *rest, **self.kwargs, **more)


class _EarlyCall:
    """One call of ``DeviceWorker.run_early``: its answer, its result or error, and when it ended
    (``ended``: after it let go of its arguments)."""

    def __init__(self, fn: WorkerFn, args: tuple, kwargs: dict) -> None:
        self._job: tuple | None = (fn, args, kwargs)
        self.ready = threading.Event()
        """Answered, or ended."""
        self.ended = threading.Event()
        self.answered = False
        self.answer: Any = None
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self, state: dict) -> None:
        fn, args, kwargs = self._job
        self._job = None
        try:
            self.result = to_numpy(fn(state, *args, answer=self._answer, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller (run_early / _finish_rest)
            self.error = exc
        finally:
            del fn, args, kwargs
            self.ended.set()
            self.ready.set()

    def _answer(self, value: Any) -> None:
        if not self.answered:
            self.answer, self.answered = to_numpy(value), True
            self.ready.set()


class StepRestError(RuntimeError):
    """What an early-answered call (``DeviceWorker.run_early``) raised after its answer."""


def _loaded(fn: bytes | WorkerFn) -> WorkerFn:
    """``fn``, unpickled if it came as ``ray.cloudpickle`` bytes (the driver pickles a callable
    once and sends the same bytes to every rank)."""
    return cloudpickle.loads(fn) if isinstance(fn, (bytes, bytearray, memoryview)) else fn


RemoteDeviceWorker = ray.remote(DeviceWorker)
"""``DeviceWorker`` as a Ray actor class; ``runtime/group.py`` sets its resources per cluster."""


def actor_env(threads: int, oversubscribed: bool) -> dict[str, str]:
    """Environment of a worker process: thread pools sized before torch loads, and the runtime's
    switches as the driver's environment sets them (``switches.WORKER_SWITCHES``)."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env.update({name: os.environ[name] for name in WORKER_SWITCHES if name in os.environ})
    if oversubscribed:
        env["OMP_WAIT_POLICY"] = "PASSIVE"  # spinning pools on shared cores ran 2-4x slower (docs/design.md)
    return env

