"""Evaluation and inference on the cluster: a forward-only function of the model, run in parallel.

``step.evaluate(fn)`` (``fn(model, batch)``: a validation loss, metrics, logits, a greedy
generation loop that calls the model several times) gives a callable that runs ``fn`` on
the training step's workers against the live trained state, never moving it through the
driver; ``parallelize(fn, cluster)`` on such a function runs it on workers of its own. The
first call, and a call whose batch or model mode differs from the captured one, captures
``fn`` forward-only (``capture_forward``) and plans it for inference: one stage on every
device, its sharding (its own batch split included) chosen by the ILP with no optimizer
state and no backward (``stage_dp.planner.plan_forward``). Its state comes from the
training deployment (``runtime/evaluation.py``): read in place where the training plan is
one stage on the same mesh (the parameters keep their training placements), otherwise
moved tile by tile from the stages that hold it, once after each training step.

A call returns what ``fn`` returns, its tensors whole (on the driver's CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from alpa_torch.core.cluster import Cluster
from alpa_torch.core.errors import StepUsageError
from alpa_torch.core.spec import ShardingSpec
from runtime.state_sources import Values
from runtime.wire import from_wire, to_wire_dict
from stage_dp.planner import plan_forward

from .batch import register_dataclasses
from .capture import check_precision
from .capture_forward import capture_forward, rebuild
from .initial_state import model_sources
from .live import LiveState

log = logging.getLogger(__name__)


class ParallelEval:
    """``fn(model, batch)`` run forward-only on a cluster (module docstring). Bound to a training
    ``step`` (``step.evaluate(fn)``), or on workers of its own (``parallelize(fn, cluster)``)."""

    def __init__(self, fn: Callable, *, step=None, cluster: Cluster | None = None, precision: str | None = None,
                 init_fn=None, weights: str | None = None):
        self.fn, self.step = fn, step
        self.cluster = step.cluster if step is not None else (cluster or Cluster.local(1, 2))
        self.precision = check_precision(precision or (step.precision if step is not None else "fp32"))
        self.init_fn, self.weights = init_fn, weights
        self.graph = None
        self.sharding = None
        self._engine = None
        self._captured: tuple | None = None
        """What the graph was captured for: batch layout, input shapes, the model's modes, the deployment."""
        self._group = None
        self._live: LiveState | None = None
        self._model = None

    def __call__(self, model: torch.nn.Module, batch: Any) -> Any:
        """``fn(model, batch)``, run on the cluster."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"the parallel forward function takes (model, batch), got a {type(model).__name__} where "
                            "a torch.nn.Module belongs")
        if self.step is not None:
            return self._bound_call(model, batch)
        return self._own_call(model, batch)

    # ---------------------------------------------------------------- bound to a training step
    def _bound_call(self, model, batch):
        step = self.step
        step._check_open()
        if step.engine is None:
            raise StepUsageError("step.evaluate(fn) runs on the training step's workers, which start at its first "
                                 "call. Fix: call the step once first, or use parallelize(fn, cluster) on its own")
        if model is not step._trains[0]():
            raise StepUsageError("step.evaluate(fn) evaluates the model this step trains; it was called with another "
                                 "model object. Fix: pass the trained model, or run another model with "
                                 "parallelize(fn, cluster)")
        with step._own_use():
            step._push_user_values()
            key = self._key(model, batch, step.deployments)
            if key != self._captured:
                self._plan_bound(model, batch, step)
                self._captured = key
            return self._run(batch)

    def _plan_bound(self, model, batch, step) -> None:
        from runtime.evaluation import EvalEngine

        graph = capture_forward(self.fn, model, batch, precision=self.precision, device_type=self.cluster.device_type)
        train, names = step.plan, {s.name: s.node for s in step.graph.inputs}
        device_bytes = self.cluster.device.memory_bytes
        budget = device_bytes - max(s.persistent_bytes for s in train.stages)
        stage = train.stages[0]
        if len(train.stages) == 1 and len(stage.device_ids) == self.cluster.num_devices:
            force = {s.node: stage.sharding.value_specs.get(names[s.name], ShardingSpec.replicated(2))
                     for s in graph.inputs if s.kind in ("param", "buffer")}
            kept = sum(force[s.node].local_numel(s.shape, stage.logical_mesh) * s.nbytes / max(1, _numel(s.shape))
                       for s in graph.inputs if s.kind in ("param", "buffer"))
            self.sharding = plan_forward(graph, self.cluster, memory_budget_bytes=budget + kept,
                                         mesh_shape=tuple(stage.logical_mesh),
                                         force={k: str(v) for k, v in force.items()})
            self._engine = EvalEngine(step.group, graph, self.sharding, self._name(), "alias", seed=step._seed)
        else:
            self.sharding = plan_forward(graph, self.cluster, memory_budget_bytes=budget)
            stored = [{n: str(st.sharding.value_specs.get(names[n], ShardingSpec.replicated(2)))
                       for n in (step.engine.sources[k] if step.engine.sources is not None else names)
                       if n in names} for k, st in enumerate(train.stages)]
            train_stages = [(st.device_ids, st.logical_mesh, held) for st, held in zip(train.stages, stored)]
            self._engine = EvalEngine(step.group, graph, self.sharding, self._name(), "moved",
                                      train_stages=train_stages, seed=step._seed)
        self.graph = graph
        log.info("evaluation %s planned on mesh %s (%s)", getattr(self.fn, "__name__", "fn"),
                 tuple(self.sharding.mesh_shape), self._engine.state)

    # ---------------------------------------------------------------- on workers of its own
    def _own_call(self, model, batch):
        from runtime.evaluation import EvalEngine
        from runtime.group import WorkerGroup

        if self._model is not None and model is not self._model:
            raise StepUsageError("this parallel forward function runs the model of its first call (its weights are on "
                                 "the workers); it was called with another model. Fix: create another one with "
                                 "parallelize(fn, cluster)")
        with self._own_use():
            if self._live is not None:
                changes = self._live.changes()
                if changes.values:
                    self._engine.load([Values(to_wire_dict(changes.values))])
                    self._live.sent(changes.values)
            key = self._key(model, batch, None)
            if key != self._captured:
                self.graph = capture_forward(self.fn, model, batch, precision=self.precision,
                                             device_type=self.cluster.device_type)
                self.sharding = plan_forward(self.graph, self.cluster,
                                             memory_budget_bytes=self.cluster.device.memory_bytes)
                if self._group is None:
                    self._group = WorkerGroup.start(self.cluster)
                self._engine = EvalEngine(self._group, self.graph, self.sharding, self._name(), "own",
                                          seed=torch.initial_seed())
                self._engine.load(model_sources(self.graph, model, None, seed=torch.initial_seed(),
                                                init_fn=self.init_fn, weights=self.weights))
                self._captured = key
            out = self._run(batch)
        if self._live is None:
            self._model = model
            self._live = LiveState(model, (), fetch=lambda part: None, tensors=self._tensors, size_bytes=lambda _: 0,
                                   limit_bytes=lambda: float("inf"))
            self._live.fetched("model")  # the workers hold what the model holds
        return out

    def _tensors(self, part: str) -> dict[str, torch.Tensor]:
        names = {s.name for s in self.graph.inputs if s.kind in ("param", "buffer")} if part == "model" else set()
        return {n: t for n, t in [*self._model.named_parameters(), *self._model.named_buffers()] if n in names}

    def _own_use(self):
        import contextlib

        return self._live.internal() if self._live is not None else contextlib.nullcontext()

    def shutdown(self) -> None:
        """Stop the workers of a forward function run on its own (a bound one uses the step's)."""
        if self._group is not None:
            self._group.shutdown()
            self._group = self._engine = None
        if self._live is not None:
            self._live.detach()

    # ---------------------------------------------------------------- both
    def _key(self, model, batch, deployment) -> tuple:
        """What a capture holds for: the batch's structure, constants, shapes and dtypes, the model's
        modes, and the training deployment it reads."""
        register_dataclasses(batch)
        leaves, spec = pytree.tree_flatten(batch)
        kinds = tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("constant", repr(v))
                      for v in leaves)
        return (spec, kinds, tuple(m.training for m in model.modules()), deployment)

    def _run(self, batch) -> Any:
        leaves = pytree.tree_leaves(batch)
        wire = to_wire_dict({f"batch.{i}": v.detach() for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)})
        outs = self._engine.run(wire)
        return rebuild(self.graph, [from_wire(v) for v in outs])

    def _name(self) -> str:
        return f"eval-{id(self)}"


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
