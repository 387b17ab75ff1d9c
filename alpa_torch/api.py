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
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from .capture import capture
from .cluster import Cluster
from .errors import BatchSplitError, PlanError
from .optim import FunctionalOptimizer

log = logging.getLogger(__name__)


def plan_single_stage(graph, cluster: Cluster, *, memory_budget_bytes: float | None = None,
                      logical_shape: tuple[int, int] | None = None):
    """The best sharding of the whole step on all devices (no pipeline)."""
    from intra_ilp.cost_model import MeshCost
    from intra_ilp.stage import solve_stage

    submesh = (cluster.num_hosts, cluster.devices_per_host)
    budget = memory_budget_bytes or cluster.device.memory_bytes
    shapes = [logical_shape] if logical_shape else cluster.logical_mesh_shapes(submesh)
    best = None
    for shape in shapes:
        mesh = MeshCost.from_cluster(cluster, submesh, tuple(shape))
        sharding = solve_stage(graph, mesh, memory_budget_bytes=budget)
        log.info("logical mesh %s: predicted %.3f ms", shape, sharding.total_s * 1e3)
        if best is None or sharding.total_s < best.total_s - 1e-12:
            best = sharding
    return best


class ParallelStep:
    """A training step bound to a cluster; call it like the original step."""

    def __init__(self, train_step: Callable, cluster: Cluster | None = None, *,
                 memory_budget_bytes: float | None = None, logical_shape: tuple[int, int] | None = None):
        self.train_step = train_step
        self.cluster = cluster or Cluster.local(1, 2)
        self.memory_budget_bytes = memory_budget_bytes
        self.logical_shape = logical_shape
        self.graph = None
        self.sharding = None
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
            log.warning("step %d: loss is %s", self._step, loss)
        return torch.tensor(loss)

    def _start(self, model, optimizer, batch) -> None:
        from runtime.engine import Engine, to_numpy_dict
        from runtime.group import WorkerGroup

        t0 = time.perf_counter()
        self.graph = capture(self.train_step, model, optimizer, batch)
        self._functional = FunctionalOptimizer(optimizer, {id(p): n for n, p in model.named_parameters()})
        self._step = self._functional.step_count()
        self.sharding = plan_single_stage(self.graph, self.cluster, memory_budget_bytes=self.memory_budget_bytes,
                                          logical_shape=self.logical_shape)
        t1 = time.perf_counter()
        self.group = WorkerGroup.start(self.cluster)
        self.engine = Engine(self.group, self.graph, self.sharding)
        self.engine.load_state(to_numpy_dict(self._initial_state(model)))
        log.info("planned in %.2f s, deployed in %.2f s", t1 - t0, time.perf_counter() - t1)

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
        expected = {s.name: s.shape for s in self.graph.inputs if s.kind == "batch"}
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
    """
    if train_step is None:
        return lambda fn: ParallelStep(fn, cluster, **options)
    return ParallelStep(train_step, cluster, **options)
