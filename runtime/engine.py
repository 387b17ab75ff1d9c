"""Driver side of the runtime: a plan deployed on a ``WorkerGroup``, and its steps.

One engine for every plan. A plan is a list of stages (devices, logical mesh, sharding);
one stage on every device with one microbatch runs each device's whole step as one
program (``interpreter.StageRunner``: its gradients reduced in flat buckets), anything
else runs each stage's forward, backward and update programs in the schedule's order
(``pipeline.PipelineRunner``, with cross-mesh resharding between stages).

The driver pickles the captured graph once and sends it, with every stage's program and
sharding, to every worker (``WorkerGroup.call_all``); every worker builds the mesh of
every stage in the same order (creating process groups is collective) and keeps its own
stage's runner. It loads the model state as wire arrays (``wire.py``: numpy, bit for bit
whatever the dtype), and each step sends only the batch (cut into microbatches by the
rule of ``alpa_torch.core.microbatches``) and the host scalars. State stays on the workers
until ``gather_state``, or each worker writes its own shards of it (``save_shards``,
format in ``checkpoint.py``). A step returns its loss when the forward has it; the rest of
the step overlaps the driver's next call (``worker.DeviceWorker.run_early``). A failed step
raises ``WorkerError`` naming the failed device and its stage (``stage_failure``); the
``WorkerGroup`` has then shut itself down.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass

import numpy as np

from alpa_torch.core.errors import WorkerError
from alpa_torch.core.microbatches import check_divisible, split_flags
from alpa_torch.core.partition import partition, phase_lists
from alpa_torch.core.schedule import DEFAULT_SCHEDULE, schedule_named
from alpa_torch.core.sharding import StageSharding

from .device_memory import keep_freed_memory, peak_bytes, release_freed
from .group import WorkerGroup
from .loss_parts import total_loss
from .program import graph_bytes
from .state_sources import Values
from .switches import EARLY_ANSWER_ENV, switch_on
from .wire import from_wire, to_wire_dict

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StageDeployment:
    """Where a stage runs and how it is sharded."""

    ranks: tuple[int, ...]
    mesh_shape: tuple[int, int]
    sharding: StageSharding


# ---------------------------------------------------------------- worker side


class _OneStage:
    """One stage on every device, one microbatch: the runner's whole step as one program."""

    def __init__(self, runner, recorder):
        self.runner, self.recorder = runner, recorder

    def step(self, microbatches: list[dict], scalars: dict, answer=None):
        self.recorder.begin_step()
        with self.recorder.span("step", "step"):  # forward, backward and update: one program
            return self.runner.step(microbatches[0], scalars, answer)


def _release(state: dict) -> None:
    """Drop this worker's previous deployment, if any, and free its tensors now.

    A stage program's objects refer to each other (the runner, its generated code, the
    pipeline schedule, the recorder), so dropping the last reference does not free them:
    they wait for Python's cyclic collector, which may not run for many steps. Measured
    plan selection deploys several plans on the same workers: without this, each worker
    of the wide GPT on 1x4 kept a replaced trial deployment's state (91 MB of tensors)
    next to the kept plan's for the whole run. The memory freed goes back to the OS (or
    the GPU's cache is emptied), so the next deployment's peak is its own (``Engine.memory``)."""
    import gc

    for key in ("program", "runner", "recorder", "evals"):  # an evaluation reads the runner it was planned for
        state.pop(key, None)
    gc.collect()
    release_freed(state["device"])  # the next deployment measures its own peak (device_memory.py)
    state["memory_left"] = peak_bytes(state["device"], state.get("memory_started", 0.0))  # what is left


def _install(state: dict, records_bytes: bytes, setup: dict, stage: int) -> bool:
    """Build every stage's mesh (in the same order on every rank) and this rank's stage program,
    after releasing the previous deployment's (``_release``)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    import alpa_torch.core.grad_op  # noqa: F401 - registers the alpa.grad operator the graph calls

    from .comm import mesh_placement
    from .interpreter import StageRunner
    from .pipeline import PipelineRunner
    from .timeline import StepRecorder

    _release(state)
    state["state_version"] = state.get("state_version", 0) + 1
    keep_freed_memory()
    records = pickle.loads(records_bytes)
    device_type = state["device"].type
    meshes = [DeviceMesh(device_type, torch.tensor(r).view(*s)) for r, s in zip(setup["ranks"], setup["shapes"])]
    spec = setup["shardings"][stage]
    runner = StageRunner(records, spec["value_specs"], spec["input_specs"], setup["io"], meshes[stage],
                         seed=setup["seed"], compile_regions=setup["compile"], region_cache=setup["compile_cache"])
    state["runner"], state["stage"] = runner, stage
    state["first_of_stage"] = state["rank"] == setup["ranks"][stage][0]
    state["recorder"] = recorder = StepRecorder()
    if not setup["pipelined"]:
        state["program"] = _OneStage(runner, recorder)
        if runner.buckets is not None:  # a bucket's all-reduce overlapping the backward, in the trace
            runner.buckets.recorder = recorder
        return True
    state["program"] = PipelineRunner(
        runner, stage, setup["programs"][stage], setup["crossings"],
        [mesh_placement(r, s) for r, s in zip(setup["ranks"], setup["shapes"])],
        [s["value_specs"] for s in setup["shardings"]], setup["value_meta"], setup["orders"][stage],
        setup["loss_node"], setup["gather"], setup["combine"], recorder,
    )
    return True


def _memory(state: dict) -> tuple[float, float]:
    return peak_bytes(state["device"], state.get("memory_started", 0.0)), state.get("memory_left", 0.0)


def _record(state: dict, on: bool) -> bool:
    state["recorder"].on = on
    return True


def _events(state: dict) -> list:
    return state["recorder"].events


def _new_state(state: dict) -> None:
    """The training state is about to change: the evaluations' copies of it go (``evaluation.py``)."""
    from .evaluation import drop_copies

    drop_copies(state)
    state["state_version"] = state.get("state_version", 0) + 1


def _load(state: dict, sources: list, metas: dict) -> bool:
    _new_state(state)
    state["runner"].load_from(sources, metas)
    return True


def _restart(state: dict) -> bool:
    state["runner"].rng.restart()
    return True


def _step(state: dict, microbatches: list, scalars: dict, answer=None):
    """One step; ``answer(loss)`` as soon as this rank has its part of the loss (``run_early``)."""
    _new_state(state)
    return state["program"].step(microbatches, scalars, answer)


def _gather(state: dict, names: frozenset[str] | None = None) -> dict | None:
    full = state["runner"].gather_state(names)  # a collective of the stage's devices
    return full if state["first_of_stage"] else None


def _save(state: dict, directory: str) -> dict | None:
    from .checkpoint import save_runner

    return save_runner(state["runner"], directory, state["rank"])


def _export(state: dict, directory: str, file: str | None, order: list[str], mine: list[str]) -> None:
    from .checkpoint import export_runner

    export_runner(state["runner"], directory, file, order, mine)


# ---------------------------------------------------------------- driver side


class Engine:
    """A plan deployed on every worker of a ``WorkerGroup``.

    ``stages``: the plan's stages, or one ``StageSharding`` for one stage on every device;
    ``stage_of``: graph node -> stage (``alpa_torch.core.partition.stage_of_nodes``; one stage:
    None). ``combine``: how microbatches add up (``stage_dp.coupling.loss_combine``). ``compile``: each
    worker compiles its program's runs of local kernels (``regions.py``), saving and loading the
    compiled artifacts in the directory ``compile_cache`` if given."""

    def __init__(self, group: WorkerGroup, graph, stages: list[StageDeployment] | StageSharding,
                 stage_of: dict[str, int] | None = None, num_microbatches: int = 1, schedule: str = DEFAULT_SCHEDULE, *,
                 cluster=None, dst_gather: bool | None = None, step_timeout_s: float = 600.0, seed: int = 0,
                 combine: str = "mean", compile: bool = False, compile_cache: str | None = None):
        if isinstance(stages, StageSharding):
            stages = [StageDeployment(tuple(range(group.world_size)), tuple(stages.mesh_shape), stages)]
        self.group, self.graph, self.stages = group, graph, list(stages)
        self.num_microbatches, self.step_timeout_s = num_microbatches, step_timeout_s
        self.pipelined = len(self.stages) > 1 or num_microbatches > 1
        self.stage_of_rank = {r: k for k, st in enumerate(self.stages) for r in st.ranks}
        if sorted(self.stage_of_rank) != list(range(group.world_size)):
            raise ValueError(f"stages cover ranks {sorted(self.stage_of_rank)}, the group has {group.world_size}")
        io = {"inputs": [(s.kind, s.name, s.node) for s in graph.inputs],
              "outputs": [(s.kind, s.name, s.node) for s in graph.outputs]}
        setup = {"ranks": [list(st.ranks) for st in self.stages], "shapes": [list(st.mesh_shape) for st in self.stages],
                 "shardings": [_sharding_strings(st.sharding) for st in self.stages], "io": io, "seed": seed,
                 "pipelined": self.pipelined, "combine": combine, "compile": compile,
                 "compile_cache": compile_cache}
        self.sources: list[set[str]] | None = None
        """Per stage, the state it holds (pipelines; one stage holds all)."""
        self.loss_stage = 0
        if self.pipelined:
            self._pipeline_setup(setup, stage_of, schedule, cluster, dst_gather)
        t0 = time.perf_counter()
        group.call_all(_install, graph_bytes(graph.gm), setup,
                       per_rank_args=[(self.stage_of_rank[r],) for r in range(group.world_size)])
        log.info("deployed %d stage(s), %d microbatch(es) (%s) in %.2f s", len(self.stages), num_microbatches,
                 schedule, time.perf_counter() - t0)

    def _pipeline_setup(self, setup: dict, stage_of: dict[str, int], schedule: str, cluster, dst_gather) -> None:
        """The stages' programs, crossings and compute orders, into ``setup``."""
        graph = self.graph
        programs, crossings = partition(graph, stage_of, len(self.stages))
        pipeline_schedule = schedule_named(schedule)
        split = pipeline_schedule.splits_backward(len(self.stages), self.num_microbatches)
        meta = {n.name: n.meta.get("val") for n in graph.gm.graph.nodes}
        names_of = {s.node: s.name for s in graph.inputs}
        loss_node = next(s.node for s in graph.outputs if s.kind == "loss")
        self.loss_stage = stage_of[loss_node]
        self.sources = [{names_of[n] for n in p.sources} for p in programs]
        setup.update(
            programs=[phase_lists(graph, p, crossings, split) for p in programs],
            crossings=crossings, loss_node=loss_node,
            value_meta={c.value: (tuple(meta[c.value].shape), str(meta[c.value].dtype).removeprefix("torch."))
                        for c in crossings},
            orders=pipeline_schedule.compute_order(len(self.stages), self.num_microbatches))
        setup["gather"] = self._gather_flags(crossings, setup, cluster, dst_gather)

    def _gather_flags(self, crossings, setup: dict, cluster, dst_gather: bool | None) -> list[bool]:
        """Per crossing: use Alpa's local all-gather in the destination mesh? (cost model decides)."""
        if dst_gather is not None:
            return [dst_gather] * len(crossings)
        from .comm import mesh_placement, prefer_dst_gather

        meshes = [mesh_placement(r, sh) for r, sh in zip(setup["ranks"], setup["shapes"])]
        flags = []
        for c in crossings:
            specs = setup["shardings"]
            src = specs[c.src]["value_specs"].get(c.value, "RR").replace("P", "R")
            dst = specs[c.dst]["value_specs"].get(c.value, "RR")
            shape, _ = setup["value_meta"][c.value]
            cross_beta, local_beta = 1.0, 1.0
            if cluster is not None:
                cross_beta = cluster.link_between(self.stages[c.src].ranks, self.stages[c.dst].ranks).beta_s_per_byte
                local_beta = cluster.intra_host_link.beta_s_per_byte
            flags.append(prefer_dst_gather(shape, src, meshes[c.src], dst, meshes[c.dst], 4, cross_beta, local_beta))
        return flags

    # ------------------------------------------------------------------ state
    def load_state(self, values: dict[str, np.ndarray]) -> None:
        """Full values of the state (wire arrays); each device keeps its stage's shards."""
        self.load([Values(values)])

    def load(self, sources: list) -> None:
        """The state ``sources`` have (``state_sources``: the first to have a name gives it); each
        device reads only its stage's shards. Full values (``Values``) go only to their stage's devices."""
        metas = {s.name: (tuple(s.shape), s.dtype) for s in self.graph.inputs
                 if s.kind in ("param", "buffer", "opt_state") and any(s.name in src.names for src in sources)}
        if self.sources is None:  # one stage: every device loads everything (sent once)
            self.group.call_all(_load, sources, metas)
            return
        per_rank = []
        for r in range(self.group.world_size):
            names = self.sources[self.stage_of_rank[r]] & set(metas)
            own = [src.only(names) if isinstance(src, Values) else src for src in sources]
            per_rank.append((own, {n: metas[n] for n in names}))
        self.group.call_all(_load, per_rank_args=per_rank)

    def restart(self, sources: list) -> None:
        """Load the state ``sources`` have and count steps from the start, as a new deployment of the
        same plan would, keeping the programs the workers have learned and compiled."""
        self.load(sources)
        self.group.call_all(_restart)

    def memory(self) -> list[tuple[float, float]]:
        """Per rank, in bytes: the most memory its device held since this plan was deployed
        (``device_memory.peak_bytes``: the caching allocator's reserve on GPU, the resident set
        above the started worker's on CPU), and how much of it earlier deployments on the
        worker had left when this one began."""
        return [tuple(m) for m in self.group.call_all(_memory)]

    def record(self, on: bool = True) -> None:
        """Record, on every worker, when each phase, transfer and wait of a step runs (``timeline.py``)."""
        self.group.call_all(_record, on)

    def events(self) -> list[tuple[int, int, list]]:
        """(stage, rank, that worker's events of the last step) for every rank (``record``)."""
        per_rank = self.group.call_all(_events)
        return [(self.stage_of_rank[r], r, events) for r, events in enumerate(per_rank)]

    def gather_state(self, names=None) -> dict[str, np.ndarray]:
        """Full values of every stage's state (wire arrays; only ``names`` if given), gathered in each
        stage's first device."""
        results = self.group.call_all(_gather, None if names is None else frozenset(names))
        out = {}
        for st in self.stages:
            out.update(results[st.ranks[0]])
        return out

    def save_shards(self, directory: str) -> list[dict | None]:
        """Every device writes its stage's tiles of the state into ``directory`` (``checkpoint.save_runner``)."""
        try:
            return self.group.call_all(_save, directory)
        except WorkerError as exc:
            raise stage_failure(exc, [st.ranks for st in self.stages]) from exc

    def export_weights(self, directory: str, names: list[str]) -> dict[str, str]:
        """Write the state ``names`` whole into Hugging Face's layout in ``directory``, each tensor
        by one device of its stage (the least loaded so far), none through the driver: files
        ``model-0000k-of-0000n.safetensors``; returns tensor name -> file (the index's weight map)."""
        size = {s.name: s.nbytes for s in self.graph.inputs}
        order, load, mine = [[] for _ in self.stages], [0] * self.group.world_size, {}
        for name in names:
            k = 0 if self.sources is None else next(i for i, src in enumerate(self.sources) if name in src)
            order[k].append(name)
            rank = min(self.stages[k].ranks, key=lambda r: load[r])
            load[rank] += size[name]
            mine.setdefault(rank, []).append(name)
        writers = sorted(mine)
        files = {r: f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors" for i, r in enumerate(writers)}
        self.group.call_all(_export, directory, per_rank_args=[
            (files.get(r), order[self.stage_of_rank[r]], mine.get(r, [])) for r in range(self.group.world_size)])
        return {name: files[r] for r, ns in mine.items() for name in ns}

    # ------------------------------------------------------------------ steps
    def split(self, batch: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """The microbatches: leaves with the batch dimension cut along dim 0, the others (0-dim, or
        shared by every sample) whole in each (``alpa_torch.core.microbatches``)."""
        m, names = self.num_microbatches, list(batch)
        if m == 1:
            return [batch]
        shapes = [tuple(batch[k].shape) for k in names]
        check_divisible(shapes, names, m)
        cut = dict(zip(names, split_flags(shapes)))
        return [{k: np.ascontiguousarray(np.split(v, m)[i]) if cut[k] else v for k, v in batch.items()}
                for i in range(m)]

    def step(self, batch: dict[str, np.ndarray], scalars: dict[str, float]) -> float:
        """One training step on the batch (wire arrays); its loss, returned once the forward has it:
        the workers' backward and update go on while the caller prepares the next step, and a
        failure there is raised by the next call on the workers (``DeviceWorker.run_early``)."""
        microbatches = self.split(with_loss_norms(self.graph, batch, self.num_microbatches))
        scalars = self.graph.host_inputs(scalars)
        try:
            results = self.group.call_all(_step, microbatches, scalars, timeout_s=self.step_timeout_s,
                                          answer_early=switch_on(EARLY_ANSWER_ENV))
        except WorkerError as exc:
            raise stage_failure(exc, [st.ranks for st in self.stages]) from exc
        if not self.pipelined:
            return total_loss(results)
        return float(results[self.stages[self.loss_stage].ranks[0]])


def with_loss_norms(graph, batch: dict, num_microbatches: int) -> dict:
    """``batch`` (wire values) with the graph's loss normalisers of the whole batch
    (``OpGraph.loss_norms``) added, unless the caller sent them."""
    if not graph.meta.get("loss_norms") or all(k in batch for k in graph.meta["loss_norms"]):
        return batch
    norms = graph.loss_norms({k: from_wire(v) for k, v in batch.items()}, num_microbatches)
    return {**batch, **to_wire_dict(norms)}


def stage_failure(exc: WorkerError, stage_ranks: list[tuple[int, ...]]) -> WorkerError:
    """``exc`` with the stage of each failed rank named first (the ranks that died, if any died,
    else every rank that failed or timed out: ``WorkerError.failed_ranks``)."""
    parts = []
    for rank in exc.failed_ranks:
        stage = next((k for k, rs in enumerate(stage_ranks) if rank in rs), None)
        if stage is not None:
            parts.append(f"device {rank} of stage {stage} (stage devices {list(stage_ranks[stage])})")
    where = "; ".join(parts) or f"a device of stage(s) {list(range(len(stage_ranks)))}"
    stages = tuple(sorted({k for k, rs in enumerate(stage_ranks) for r in exc.failed_ranks if r in rs}))
    return WorkerError(f"{where} failed: {exc}", failures=exc.failures, stages=stages)


def _sharding_strings(sharding: StageSharding) -> dict:
    d = sharding.to_dict()
    return {"value_specs": d["value_specs"], "input_specs": d["input_specs"]}
