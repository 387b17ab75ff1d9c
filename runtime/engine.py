"""Driver side of the runtime: deploys a planned stage on the workers and runs steps.

The driver pickles the captured graph once, sends it with the stage's sharding
to every worker (``WorkerGroup.call_all``), loads the model state as numpy
(FINDINGS.md: numpy crosses Ray zero-copy, torch tensors do not), and then
each step sends only the batch and the optimizer's host scalars; the loss comes
back from rank 0. State stays on the workers until ``gather_state``, or each
worker writes its own shards of it (``save_shards``, format in ``checkpoint.py``).
A failed step raises ``WorkerError`` naming the failed device and its stage
(``stage_failure``); the ``WorkerGroup`` has then shut itself down.
"""

from __future__ import annotations

import logging
import pickle
import re
import time

import numpy as np

from alpa_torch.errors import WorkerError

from .group import WorkerGroup
from .interpreter import serialize_graph, total_loss
from .wire import from_wire, to_wire_dict

log = logging.getLogger(__name__)


def keep_freed_memory() -> None:
    """Worker processes: let glibc reuse freed memory instead of giving it back to the OS.

    The runtime frees every value after its last reader; with glibc's default
    (dynamic) thresholds the freed top of the heap and large blocks go back to the
    kernel and the next step faults every page in again: 3,000-11,000 minor faults
    and +0.03 s of system time per step and device on the GPT benchmark, none for
    DDP. Blocks up to 32 MiB (glibc's maximum) come from the heap, and the heap is
    trimmed only above 1 GiB free. Not glibc (``mallopt`` missing): nothing to do."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        log.debug("mallopt unavailable: allocator left as is")


def heap_in_use_bytes() -> float | None:
    """Bytes glibc's malloc has handed out and not got back (every arena, mmapped blocks
    included): the live heap, without the freed pages RSS keeps (``keep_freed_memory``).
    None without glibc's ``mallinfo2``."""
    import ctypes

    class _MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return float(info.uordblks + info.hblkhd)


def _setup(state: dict, gm_bytes: bytes, sharding: dict, io: dict, ranks: list[int], mesh_shape, seed: int) -> bool:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    import alpa_torch.capture  # noqa: F401 - registers the alpa.grad operator the graph calls

    from .interpreter import StageRunner

    keep_freed_memory()
    records = pickle.loads(gm_bytes)
    mesh = DeviceMesh("cpu", torch.tensor(ranks).view(*mesh_shape))
    state["runner"] = StageRunner(records, sharding["value_specs"], sharding["input_specs"], io, mesh, seed=seed)
    return True


def _load(state: dict, values: dict) -> bool:
    state["runner"].load_state(values)
    return True


def _step(state: dict, batch: dict, scalars: dict) -> float:
    return state["runner"].step(batch, scalars)


def _gather(state: dict) -> dict | None:
    full = state["runner"].gather_state()
    return full if state.get("rank", 0) == 0 else None


def _save(state: dict, directory: str) -> dict | None:
    from .checkpoint import save_runner

    return save_runner(state["runner"], directory, state["rank"])


class Engine:
    """One planned stage spanning every worker of a ``WorkerGroup``."""

    def __init__(self, group: WorkerGroup, graph, sharding, *, step_timeout_s: float = 600.0, seed: int = 0):
        self.group = group
        self.graph = graph
        self.sharding = sharding
        self.step_timeout_s = step_timeout_s
        io = {
            "inputs": [(s.kind, s.name, s.node) for s in graph.inputs],
            "outputs": [(s.kind, s.name, s.node) for s in graph.outputs],
        }
        d = sharding.to_dict()
        t0 = time.perf_counter()
        ranks = list(range(group.world_size))
        specs = {"value_specs": d["value_specs"], "input_specs": d["input_specs"]}
        group.call_all(_setup, pickle.dumps(serialize_graph(graph.gm)), specs, io, ranks, list(sharding.mesh_shape),
                       seed)
        group.call_all(_mark_rank, per_rank_args=[(r,) for r in ranks])
        log.info("deployed %d-device stage in %.2f s", len(ranks), time.perf_counter() - t0)

    def load_state(self, values: dict[str, np.ndarray]) -> None:
        self.group.call_all(_load, values)

    def step(self, batch: dict[str, np.ndarray], scalars: dict[str, float]) -> float:
        batch = with_loss_norms(self.graph, batch, 1)
        try:
            losses = self.group.call_all(_step, batch, scalars, timeout_s=self.step_timeout_s)
        except WorkerError as exc:
            raise stage_failure(exc, [tuple(range(self.group.world_size))]) from exc
        return total_loss(losses)

    def gather_state(self) -> dict[str, np.ndarray]:
        return self.group.call_all(_gather)[0]

    def save_shards(self, directory: str) -> list[dict | None]:
        """Every device writes its tiles of the state into ``directory`` (``checkpoint.save_runner``)."""
        try:
            return self.group.call_all(_save, directory)
        except WorkerError as exc:
            raise stage_failure(exc, [tuple(range(self.group.world_size))]) from exc


def with_loss_norms(graph, batch: dict, num_microbatches: int) -> dict:
    """``batch`` (wire values) with the graph's loss normalisers of the whole batch
    (``OpGraph.loss_norms``) added, unless the caller sent them."""
    if not graph.meta.get("loss_norms") or all(k in batch for k in graph.meta["loss_norms"]):
        return batch
    norms = graph.loss_norms({k: from_wire(v) for k, v in batch.items()}, num_microbatches)
    return {**batch, **to_wire_dict(norms)}


def _mark_rank(state: dict, rank: int) -> bool:
    state["rank"] = rank
    return True


_DIED = re.compile(r"died: \[([\d, ]*)\]")
_FAILED = re.compile(r"device rank\(s\) \[([\d, ]*)\]")


def stage_failure(exc: WorkerError, stage_ranks: list[tuple[int, ...]]) -> WorkerError:
    """``exc`` (from ``WorkerGroup``, which names ranks) with the stage of each failed rank named first.

    The ranks are read from the group's message: the dead ones if any died, else every
    rank that failed or timed out."""
    text = str(exc)
    died, failed = _DIED.search(text), _FAILED.search(text)
    ranks = [int(r) for r in died.group(1).replace(",", " ").split()] if died else []
    if not ranks and failed:
        ranks = [int(r) for r in failed.group(1).replace(",", " ").split()]
    parts = []
    for rank in ranks:
        stage = next((k for k, rs in enumerate(stage_ranks) if rank in rs), None)
        if stage is not None:
            parts.append(f"device {rank} of stage {stage} (stage devices {list(stage_ranks[stage])})")
    where = "; ".join(parts) or f"a device of stage(s) {list(range(len(stage_ranks)))}"
    return WorkerError(f"{where} failed: {text}")
