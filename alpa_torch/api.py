"""``parallelize``: the one call a user needs.

    step = parallelize(train_step, cluster=Cluster.local(1, 4))
    for batch in data:
        loss = step(model, optimizer, batch)   # runs on the cluster
    step.sync(model, optimizer)                # pull the trained state back

The first call captures the step (``capture``), plans it (``intra_ilp``: the
sharding of every operator on each logical mesh of the cluster, the cheapest
kept), starts one Ray worker per device (``runtime``) and loads the model's
and optimizer's state onto them. Every call, the first included, runs one
training step on the cluster and returns its loss. The model and optimizer
objects are only read on the first call; the live state stays sharded on the
workers until ``sync`` or ``state_dict``.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from .capture import capture
from .cluster import Cluster
from .errors import BatchSplitError, PlanError
from .optim import FunctionalOptimizer

log = logging.getLogger(__name__)


_BATCH_COUPLED = ("_native_batch_norm_legit_functional", "native_batch_norm")


def couples_batch(graph) -> bool:
    """True if an operator mixes samples of the batch in training (BatchNorm
    statistics): microbatches would then change the numbers, so B must be 1."""
    for node in graph.gm.graph.nodes:
        if node.op == "call_function" and any(k in str(node.target) for k in _BATCH_COUPLED):
            training = node.args[5] if len(node.args) > 5 else True
            if training:
                return True
    return False


def _microbatch(batch: Any, num_microbatches: int) -> Any:
    """The first of ``num_microbatches`` equal slices of every tensor leaf (dim 0)."""
    def first(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.dim() == 0 or t.shape[0] % num_microbatches:
            raise BatchSplitError(
                f"a batch tensor of shape {tuple(t.shape)} does not split into {num_microbatches} microbatches "
                f"along dim 0; use a batch size divisible by {num_microbatches} or set num_microbatches"
            )
        return t[: t.shape[0] // num_microbatches]

    return pytree.tree_map(first, batch)


class ParallelStep:
    """A training step bound to a cluster; call it like the original step."""

    def __init__(self, train_step: Callable, cluster: Cluster | None = None, *, plan=None,
                 num_microbatches: int | None = None, num_stages: int | None = None, num_layers: int | None = None,
                 pipeline: bool = True, sharding: bool = True, memory_budget_bytes: float | None = None,
                 schedule: str = "1f1b", progress: Callable[[str], None] | None = None):
        """See ``parallelize``."""
        self.train_step = train_step
        self.cluster = cluster or Cluster.local(1, 2)
        self.forced_plan = plan
        self.options = dict(num_microbatches=num_microbatches, num_stages=num_stages, num_layers=num_layers,
                            pipeline=pipeline, sharding=sharding, memory_budget_bytes=memory_budget_bytes,
                            schedule=schedule, progress=progress)
        self.graph = None
        self.run_graph = None
        self.plan = None
        self.group = None
        self.engine = None
        self._functional: FunctionalOptimizer | None = None
        self._step = 0

    # ------------------------------------------------------------------ call
    def __call__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        if self.engine is None:
            self._start(model, optimizer, batch)
        self._functional.check_unchanged()
        leaves = self._batch_leaves(batch)
        self._step += 1
        loss = self.engine.step(leaves, self._functional.host_scalars(self._step))
        if not math.isfinite(loss):
            warnings.warn(
                f"step {self._step}: the loss is {loss}; check the learning rate and the data of this step "
                "(the parameters may now hold NaN/Inf too)", RuntimeWarning, stacklevel=2)
        return torch.tensor(loss)

    def make_plan(self, model, optimizer, batch):
        """Capture and plan without running anything (``self.plan``, ``self.graph``)."""
        from stage_dp.search import plan as search

        self.graph = capture(self.train_step, model, optimizer, batch)
        opts = dict(self.options)
        if couples_batch(self.graph):
            if opts["num_microbatches"] not in (None, 1):
                raise PlanError(
                    f"num_microbatches={opts['num_microbatches']} with BatchNorm in training mode would change "
                    "its batch statistics; use num_microbatches=1 (or GroupNorm/LayerNorm)"
                )
            opts["num_microbatches"] = 1
        if self.forced_plan is not None:
            self.plan = self._load_plan(self.forced_plan)
        else:
            self.plan = search(self.graph, self.cluster, **opts)
        log.info("plan:\n%s", self.plan.table())
        return self.plan

    def _load_plan(self, forced):
        from .plan import ParallelPlan

        plan = ParallelPlan.from_json(forced) if not isinstance(forced, ParallelPlan) else forced
        plan.validate(self.graph, self.cluster)
        return plan

    def _start(self, model, optimizer, batch) -> None:
        from runtime.engine import to_numpy_dict
        from runtime.group import WorkerGroup

        t0 = time.perf_counter()
        self.make_plan(model, optimizer, batch)
        self._functional = FunctionalOptimizer(optimizer, {id(p): n for n, p in model.named_parameters()})
        self._step = self._functional.step_count()
        self.run_graph = self._runtime_graph(model, optimizer, batch)
        t1 = time.perf_counter()
        self.group = WorkerGroup.start(self.cluster)
        try:
            self.engine = self._deploy()
            self.engine.load_state(to_numpy_dict(self._initial_state(model)))
        except BaseException:
            self.shutdown()
            raise
        log.info("planned in %.2f s, deployed in %.2f s", t1 - t0, time.perf_counter() - t1)

    def _runtime_graph(self, model, optimizer, batch):
        """The graph the workers run: the step on one microbatch."""
        b = self.plan.num_microbatches
        if b == 1:
            return self.graph
        graph = capture(self.train_step, model, optimizer, _microbatch(batch, b))
        if set(graph.nodes) != set(self.graph.nodes):
            raise PlanError(
                "the step's graph on a microbatch differs from the full-batch graph (shape-dependent "
                "control flow?); use num_microbatches=1"
            )
        return graph

    def _deploy(self):
        from runtime.engine import Engine
        from runtime.partition import stage_of_nodes
        from runtime.pipeline_engine import PipelineEngine, StageDeployment

        plan = self.plan
        if len(plan.stages) == 1 and plan.num_microbatches == 1:
            return Engine(self.group, self.run_graph, plan.stages[0].sharding)
        ranges = [(s.layer_start, s.layer_end) for s in plan.stages]
        stage_of = stage_of_nodes(self.run_graph, plan.layer_of, ranges)
        stages = [StageDeployment(s.device_ids, s.logical_mesh, s.sharding) for s in plan.stages]
        return PipelineEngine(self.group, self.run_graph, stages, stage_of, plan.num_microbatches, plan.schedule,
                              cluster=self.cluster)

    def _initial_state(self, model) -> dict[str, torch.Tensor]:
        params = dict(model.named_parameters())
        values = {n: p for n, p in params.items()}
        values.update(dict(model.named_buffers()))
        for name in self._functional.names:
            for key, v in self._functional.initial_state(name, params[name]).items():
                values[f"{name}.{key}"] = v
        return values

    def _batch_leaves(self, batch) -> dict:
        leaves = pytree.tree_leaves(batch)
        out = {}
        expected = {s.name: s.shape for s in self.graph.inputs if s.kind == "batch"}  # full batch
        for i, leaf in enumerate(leaves):
            name = f"batch.{i}"
            if name not in expected:
                continue
            if tuple(leaf.shape) != expected[name]:
                raise BatchSplitError(
                    f"batch leaf {i} has shape {tuple(leaf.shape)} but the step was planned for "
                    f"{expected[name]}; keep batch shapes fixed (drop or pad the last batch) or "
                    "create a new parallelize(...) step for the new shape"
                )
            out[name] = leaf.detach().cpu().numpy()
        if len(out) != len(expected):
            raise PlanError(f"the batch has {len(out)} tensors, the captured step had {len(expected)}")
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Full model and optimizer state, gathered from the workers."""
        if self.engine is None:
            raise PlanError("the step has not run yet: call it once before asking for its state")
        full = {k: torch.from_numpy(v) for k, v in self.engine.gather_state().items()}
        model_keys = set(self.graph.input_names("param")) | set(self.graph.input_names("buffer"))
        return {
            "model": {k: v for k, v in full.items() if k in model_keys},
            "optimizer": {k: v for k, v in full.items() if k not in model_keys},
            "step": self._step,
        }

    def sync(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Copy the trained state into ``model`` (and ``optimizer``), as eager training would leave them."""
        sd = self.state_dict()
        with torch.no_grad():
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                t.copy_(sd["model"][name])
        if optimizer is not None:
            states = {n: {k: sd["optimizer"][f"{n}.{k}"] for k in self._functional.state_names(n)}
                      for n in self._functional.names}
            self._functional.optimizer = optimizer
            self._functional.write_back(states, self._step)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = self.engine = None

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def parallelize(train_step: Callable | None = None, *, cluster: Cluster | None = None, **options):
    """Return ``train_step`` running on ``cluster`` with an automatically found plan.

    Usable as ``parallelize(step, cluster=...)`` or as ``@parallelize(cluster=...)``.
    Options (all optional): ``plan`` (a ``ParallelPlan`` or a plan JSON path to
    run instead of searching), ``num_microbatches``, ``num_stages``,
    ``num_layers``, ``pipeline=False`` (one stage on all devices),
    ``sharding=False`` (data parallel and pipeline only), ``memory_budget_bytes``
    per device, ``schedule`` ('1f1b' or 'gpipe'), ``progress`` (a callable
    receiving planner messages). The default cluster is ``Cluster.local(1, 2)``.
    """
    if train_step is None:
        return lambda fn: ParallelStep(fn, cluster, **options)
    return ParallelStep(train_step, cluster, **options)
