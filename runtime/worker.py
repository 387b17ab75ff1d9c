"""One device's worker: the Ray actor that owns a device, its process group and its state.

Owns ``DeviceWorker`` (a plain class, so it can be tested in-process) and
``RemoteDeviceWorker`` (the same class as a Ray actor). A worker joins the
torch.distributed group (gloo on CPU, NCCL on GPU) and runs callables the
driver sends it as ``fn(state, *args, **kwargs)``, where ``state`` is a dict
that lives as long as the actor: the driver's code installs its program (the
compiled stage, parameters, optimizer state) there once and calls into it on
later calls. It does not decide what runs where (``runtime/group.py`` starts
the workers; the compiler and executor build what they run).

Arrays cross Ray as numpy (docs/design.md: a 16 MiB tensor pickles in 68 ms, the
numpy array is read zero-copy in 12 ms): ``run`` turns torch tensors in a
result into numpy arrays; callables rebuild tensors with ``torch.from_numpy``.

Keys ``run`` callables find in ``state`` (set by the worker, do not overwrite):
``rank``, ``host_index``, ``world_size`` (after ``init_process_group``) and
``device`` (``torch.device('cpu')`` or the actor's one GPU).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray import cloudpickle

from .wire import to_wire

logger = logging.getLogger(__name__)

WorkerFn = Callable[..., Any]


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
        return True

    def run(self, fn: bytes | WorkerFn, *args: Any, **kwargs: Any) -> Any:
        """``fn(self.state, *args, **kwargs)``, tensors in the result as numpy.

        ``fn`` is a callable or its ``ray.cloudpickle`` bytes (the driver pickles a
        callable once and sends the same bytes to every rank).
        """
        if isinstance(fn, (bytes, bytearray, memoryview)):
            fn = cloudpickle.loads(fn)
        return to_numpy(fn(self.state, *args, **kwargs))

    def shutdown(self) -> bool:
        """Leave the process group (the actor itself is killed by the group)."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self.state.pop("world_size", None)
        return True


RemoteDeviceWorker = ray.remote(DeviceWorker)
"""``DeviceWorker`` as a Ray actor class; ``runtime/group.py`` sets its resources per cluster."""


def actor_env(threads: int, oversubscribed: bool) -> dict[str, str]:
    """Environment of a worker process: thread pools sized before torch loads."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if oversubscribed:
        env["OMP_WAIT_POLICY"] = "PASSIVE"  # spinning pools on shared cores ran 2-4x slower (docs/design.md)
    return env

