"""Driver side of the runtime: deploys a planned stage on the workers and runs steps.

The driver pickles the captured graph once, sends it with the stage's sharding
to every worker (``WorkerGroup.call_all``), loads the model state as numpy
(FINDINGS.md: numpy crosses Ray zero-copy, torch tensors do not), and then
each step sends only the batch and the optimizer's host scalars; the loss comes
back from rank 0. State stays on the workers until ``gather_state``.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any

import numpy as np

from .group import WorkerGroup
from .interpreter import serialize_graph

log = logging.getLogger(__name__)


def _setup(state: dict, gm_bytes: bytes, sharding: dict, io: dict, ranks: list[int], mesh_shape) -> bool:
    import torch

    import alpa_torch.capture  # noqa: F401 - registers the alpa.grad operator the graph calls

    from .interpreter import StageRunner

    torch.manual_seed(0)
    from torch.distributed.device_mesh import DeviceMesh

    records = pickle.loads(gm_bytes)
    mesh = DeviceMesh("cpu", torch.tensor(ranks).view(*mesh_shape))
    state["runner"] = StageRunner(records, sharding["value_specs"], sharding["input_specs"], io, mesh)
    return True


def _load(state: dict, values: dict) -> bool:
    state["runner"].load_state(values)
    return True


def _step(state: dict, batch: dict, scalars: dict) -> float:
    return state["runner"].step(batch, scalars)


def _gather(state: dict) -> dict | None:
    full = state["runner"].gather_state()
    return full if state.get("rank", 0) == 0 else None


class Engine:
    """One planned stage spanning every worker of a ``WorkerGroup``."""

    def __init__(self, group: WorkerGroup, graph, sharding, *, step_timeout_s: float = 600.0):
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
        group.call_all(_setup, pickle.dumps(serialize_graph(graph.gm)), {"value_specs": d["value_specs"], "input_specs": d["input_specs"]},
                       io, ranks, list(sharding.mesh_shape))
        group.call_all(_mark_rank, per_rank_args=[(r,) for r in ranks])
        log.info("deployed %d-device stage in %.2f s", len(ranks), time.perf_counter() - t0)

    def load_state(self, values: dict[str, np.ndarray]) -> None:
        self.group.call_all(_load, values)

    def step(self, batch: dict[str, np.ndarray], scalars: dict[str, float]) -> float:
        losses = self.group.call_all(_step, batch, scalars, timeout_s=self.step_timeout_s)
        return float(losses[0])

    def gather_state(self) -> dict[str, np.ndarray]:
        return self.group.call_all(_gather)[0]


def _mark_rank(state: dict, rank: int) -> bool:
    state["rank"] = rank
    return True


def to_numpy_dict(tensors: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in tensors.items()}
