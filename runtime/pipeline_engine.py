"""Driver side of pipelined execution: deploy stages on submeshes, run steps.

Every worker receives the whole graph (as node records), the programs of all
stages, the crossings and its stage's compute order; each then builds the
DeviceMesh of every stage in the same order (creating process groups is
collective) and keeps its own stage's runner. A step is one call per worker
with the microbatches; the loss comes back from the stage that computes it.
``save_shards`` has every device write its stage's shards (``checkpoint.py``);
failures name the device and its stage (``engine.stage_failure``).
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass

import numpy as np

from alpa_torch.batch import check_divisible, split_flags
from alpa_torch.errors import WorkerError

from .engine import keep_freed_memory, stage_failure, with_loss_norms
from .group import WorkerGroup
from .interpreter import serialize_graph
from .partition import partition
from .schedule import BACKWARD, FORWARD, gpipe, one_f_one_b

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StageDeployment:
    """Where a stage runs and how it is sharded."""

    ranks: tuple[int, ...]
    mesh_shape: tuple[int, int]
    sharding: object
    """``intra_ilp.stage.StageSharding`` of the stage's operators."""


def _psetup(state: dict, records_bytes: bytes, setup: dict, stage: int) -> bool:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    import alpa_torch.capture  # noqa: F401 - registers alpa.grad

    from .comm import mesh_placement
    from .interpreter import StageRunner
    from .pipeline import PipelineRunner

    keep_freed_memory()
    records = pickle.loads(records_bytes)
    meshes = [DeviceMesh("cpu", torch.tensor(r).view(*s)) for r, s in zip(setup["ranks"], setup["shapes"])]
    spec = setup["shardings"][stage]
    runner = StageRunner(records, spec["value_specs"], spec["input_specs"], setup["io"], meshes[stage],
                         seed=setup["seed"])
    state["pipe"] = PipelineRunner(
        runner, stage, setup["programs"][stage], setup["crossings"],
        [mesh_placement(r, s) for r, s in zip(setup["ranks"], setup["shapes"])],
        [s["value_specs"] for s in setup["shardings"]], setup["value_meta"], setup["orders"][stage],
        setup["loss_node"], setup["gather"], setup["combine"],
    )
    return True


def _pload(state: dict, values: dict) -> bool:
    state["pipe"].runner.load_state(values)
    return True


def _pstep(state: dict, microbatches: list, scalars: dict):
    return state["pipe"].step(microbatches, scalars)


def _pgather(state: dict) -> dict:
    return state["pipe"].runner.gather_state()


def _psave(state: dict, directory: str) -> dict | None:
    from .checkpoint import save_runner

    return save_runner(state["pipe"].runner, directory, state["rank"])


def compute_order(schedule: str, num_stages: int, num_microbatches: int) -> list[list[tuple[str, int]]]:
    make = {"gpipe": gpipe, "1f1b": one_f_one_b}[schedule]
    out = []
    for program in make(num_stages, num_microbatches):
        out.append([("F" if i.kind == FORWARD else "B", i.microbatch)
                    for i in program if i.kind in (FORWARD, BACKWARD)])
    return out


class PipelineEngine:
    """A multi-stage plan deployed on a ``WorkerGroup``."""

    def __init__(self, group: WorkerGroup, graph, stages: list[StageDeployment], stage_of: dict[str, int],
                 num_microbatches: int, schedule: str = "1f1b", step_timeout_s: float = 600.0,
                 cluster=None, dst_gather: bool | None = None, seed: int = 0, combine: str = "mean"):
        self.group, self.graph, self.stages = group, graph, stages
        self.num_microbatches = num_microbatches
        self.step_timeout_s = step_timeout_s
        programs, crossings = partition(graph, stage_of, len(stages))
        self.programs = programs
        self.stage_of_rank = {r: k for k, st in enumerate(stages) for r in st.ranks}
        if sorted(self.stage_of_rank) != list(range(group.world_size)):
            raise ValueError(f"stages cover ranks {sorted(self.stage_of_rank)}, the group has {group.world_size}")
        meta = {n.name: n.meta.get("val") for n in graph.gm.graph.nodes}
        names_of = {s.node: s.name for s in graph.inputs}
        loss_node = next(s.node for s in graph.outputs if s.kind == "loss")
        self.loss_stage = stage_of[loss_node]
        self.sources = [{names_of[n] for n in p.sources} for p in programs]
        setup = {
            "ranks": [list(st.ranks) for st in stages], "shapes": [list(st.mesh_shape) for st in stages],
            "shardings": [_sharding_strings(st.sharding) for st in stages],
            "programs": [{"forward": p.forward, "backward": p.backward, "update": p.update} for p in programs],
            "crossings": crossings,
            "value_meta": {c.value: (tuple(meta[c.value].shape), str(meta[c.value].dtype).removeprefix("torch."))
                           for c in crossings},
            "orders": compute_order(schedule, len(stages), num_microbatches),
            "io": {"inputs": [(s.kind, s.name, s.node) for s in graph.inputs],
                   "outputs": [(s.kind, s.name, s.node) for s in graph.outputs]},
            "loss_node": loss_node,
            "seed": seed,
            "combine": combine,
        }
        setup["gather"] = self._gather_flags(crossings, setup, cluster, dst_gather)
        records = pickle.dumps(serialize_graph(graph.gm))
        group.call_all(_psetup, records, setup,
                       per_rank_args=[(self.stage_of_rank[r],) for r in range(group.world_size)])
        log.info("deployed %d stages, %d crossings, %d microbatches (%s)", len(stages), len(crossings),
                 num_microbatches, schedule)

    def _gather_flags(self, crossings, setup: dict, cluster, dst_gather: bool | None) -> list[bool]:
        """Per crossing: use Alpa's local all-gather in the destination mesh? (cost model decides)."""
        if dst_gather is not None:
            return [dst_gather] * len(crossings)
        from .comm import mesh_placement, prefer_dst_gather

        flags = []
        for c in crossings:
            specs = setup["shardings"]
            src = specs[c.src]["value_specs"].get(c.value, "RR").replace("P", "R")
            dst = specs[c.dst]["value_specs"].get(c.value, "RR")
            shape, dtype = setup["value_meta"][c.value]
            cross_beta, local_beta = 1.0, 1.0
            if cluster is not None:
                hosts = {cluster.num_hosts > 1 and r // cluster.devices_per_host for r in self.stages[c.src].ranks}
                hosts_dst = {cluster.num_hosts > 1 and r // cluster.devices_per_host for r in self.stages[c.dst].ranks}
                same_host = hosts == hosts_dst and len(hosts) == 1
                cross_link = cluster.intra_host_link if same_host else cluster.inter_host_link
                cross_beta, local_beta = cross_link.beta_s_per_byte, cluster.intra_host_link.beta_s_per_byte
            meshes = [mesh_placement(r, sh) for r, sh in zip(setup["ranks"], setup["shapes"])]
            flags.append(prefer_dst_gather(shape, src, meshes[c.src], dst, meshes[c.dst], 4, cross_beta, local_beta))
        return flags

    def load_state(self, values: dict[str, np.ndarray]) -> None:
        per_rank = [({k: v for k, v in values.items() if k in self.sources[self.stage_of_rank[r]]},)
                    for r in range(self.group.world_size)]
        self.group.call_all(_pload, per_rank_args=per_rank)

    def split(self, batch: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """The microbatches: leaves with the batch dimension cut along dim 0, the others (0-dim, or
        shared by every sample) whole in each (``alpa_torch.batch.split_flags``)."""
        m, names = self.num_microbatches, list(batch)
        shapes = [tuple(batch[k].shape) for k in names]
        check_divisible(shapes, names, m)
        cut = dict(zip(names, split_flags(shapes)))
        return [{k: np.ascontiguousarray(np.split(v, m)[i]) if cut[k] else v for k, v in batch.items()}
                for i in range(m)]

    def step(self, batch: dict[str, np.ndarray], scalars: dict[str, float]) -> float:
        microbatches = self.split(with_loss_norms(self.graph, batch, self.num_microbatches))
        try:
            results = self.group.call_all(_pstep, microbatches, scalars, timeout_s=self.step_timeout_s)
        except WorkerError as exc:
            raise stage_failure(exc, [st.ranks for st in self.stages]) from exc
        return float(results[self.stages[self.loss_stage].ranks[0]])

    def save_shards(self, directory: str) -> list[dict | None]:
        """Every device writes its stage's tiles of the state into ``directory``."""
        try:
            return self.group.call_all(_psave, directory)
        except WorkerError as exc:
            raise stage_failure(exc, [st.ranks for st in self.stages]) from exc

    def gather_state(self) -> dict[str, np.ndarray]:
        results = self.group.call_all(_pgather)
        out = {}
        for st in self.stages:
            out.update(results[st.ranks[0]])
        return out


def _sharding_strings(sharding) -> dict:
    d = sharding.to_dict()
    return {"value_specs": d["value_specs"], "input_specs": d["input_specs"]}
