"""``parallelize``: the one call a user needs.

    step = parallelize(train_step, cluster=Cluster.local(1, 4))
    for batch in data:
        loss = step(model, optimizer, batch)   # runs on the cluster
    torch.save(model.state_dict(), path)       # the model object holds the trained state

The first call captures the step (``capture``), plans it (``intra_ilp``: the
sharding of every operator on each logical mesh of the cluster, the cheapest
kept), starts one Ray worker per device (``runtime``) and loads the model's
and optimizer's state onto them. Every call, the first included, runs one
training step on the cluster and returns its loss. The live state stays sharded
on the workers; the model and optimizer objects follow it (``live.py``: a read
brings it back, a write is sent at the next step).

Reliability (``runtime/checkpoint.py`` has the format)::

    step.save("ckpt")                     # every worker writes its shards; atomic commit
    step2 = parallelize(train_step, cluster=Cluster.local(1, 4))
    step2.load("ckpt")                    # any plan or cluster size: resharded on load
    model_sd, optim_sd = load_checkpoint("ckpt")   # or load_into(model, optimizer, "ckpt")

With ``max_restarts=N, checkpoint_dir=d`` a failed step restarts its workers from the
last checkpoint, or plans again for the hosts left when one is lost (``resilience.py``).

Plans are cached on disk (``plan_cache.py``): the same graph, cluster and
options give the same plan, so the second ``make_plan`` loads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import os
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from alpa_torch.core.cluster import Cluster
from alpa_torch.core.errors import (
    AlpaTorchError,
    BatchSplitError,
    CaptureError,
    PlanError,
)
from alpa_torch.core.microbatches import check_divisible, microbatch, split_flags
from alpa_torch.core.options import PlanOptions
from alpa_torch.core.plan import ParallelPlan
from runtime.state_sources import Values
from runtime.wire import from_wire, to_wire_dict
from stage_dp.coupling import loss_combine
from stage_dp.planner import check_plan

from . import calibration, viz
from . import tune as tuner
from .batch import BatchLayout, check_indices, index_rules
from .capture import capture, check_precision, optimizers_of
from .deploy import deploy_plan
from .initial_state import checkpoint_source
from .live import PARTS, LiveState
from .measured_selection import MeasuredSelection
from .optim import OptimizerSet
from .plan_cache import PlanCache, cached_plan
from .resilience import ResilientStep, check_reliability_options
from .step_objects import StepObjects

log = logging.getLogger(__name__)

_PLANNED = ("graph", "plan", "plan_source", "tuning", "_layout", "_index_rules", "_functional", "run_graph",
            "_combine", "_recomputed")
"""What capturing and planning set on a ``ParallelStep`` (a failed re-capture puts them back)."""


def _first_microbatch(layout: BatchLayout, batch: Any, num_microbatches: int) -> Any:
    """``batch`` as the graph takes it, each tensor with the batch dimension cut to its first
    ``1 / num_microbatches`` (``alpa_torch.core.microbatches.split_flags``: the rest go whole)."""
    leaves = pytree.tree_leaves(layout.graph_batch(batch))
    index = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in index]
    check_divisible([tuple(t.shape) for t in tensors], [layout.name(i) for i in index], num_microbatches)
    for i, t in zip(index, microbatch(tensors, num_microbatches)):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, layout.spec)


class ParallelStep(StepObjects, ResilientStep, MeasuredSelection):
    """A training step bound to a cluster; call it like the original step."""

    def __init__(self, train_step: Callable, cluster: Cluster | None = None, *, plan=None,
                 options: PlanOptions | None = None, progress: Callable[[str], None] | None = None,
                 precision: str = "fp32", plan_cache: bool | str | None = None, max_restarts: int = 0,
                 checkpoint_dir: str | None = None, checkpoint_every: int = 1, tune: bool | None = None,
                 init_fn: Callable[[torch.nn.Module], None] | None = None, weights: str | None = None,
                 host_timeout_s: float = 60.0, trace: bool = False, driver_state_limit_bytes: float | None = None,
                 compile: bool | None = None, **option_fields: Any):
        """See ``parallelize``; ``option_fields``: ``PlanOptions``'s fields (or ``options``)."""
        check_reliability_options(max_restarts, checkpoint_dir, checkpoint_every, host_timeout_s)
        functools.update_wrapper(self, train_step)  # the decorated step keeps its name and docstring
        self.train_step = train_step
        self.cluster = cluster or Cluster.local(1, 2)
        self.forced_plan = plan
        self.precision = check_precision(precision)
        if options is not None and option_fields:
            raise PlanError(f"pass options=PlanOptions(...) or its fields, not both ({sorted(option_fields)})")
        try:
            self.options = options or PlanOptions(**option_fields)
        except TypeError as exc:  # an unknown keyword: name the options there are
            raise TypeError(f"parallelize: {exc}. Its options are PlanOptions's fields "
                            f"({', '.join(f.name for f in dataclasses.fields(PlanOptions))}), plan, progress, "
                            "precision, plan_cache, max_restarts, checkpoint_dir, checkpoint_every, host_timeout_s, "
                            "tune, init_fn, weights, trace, driver_state_limit_bytes, compile") from None
        self.tune = tuner.enabled(tune)
        self.tuning: list[dict] = []
        """The candidates of measured plan selection (``alpa_torch.tune.Candidate.to_dict``), in order."""
        self.init_fn, self.weights = init_fn, weights
        """How a model built on the meta device gets its values (``alpa_torch.initial_state``)."""
        if not isinstance(trace, bool):
            raise TypeError(f"parallelize: trace={trace!r} must be True or False")
        self.trace = trace
        """Record what every worker does in each step (``measured_trace``)."""
        if compile is not None and not isinstance(compile, bool):
            raise TypeError(f"parallelize: compile={compile!r} must be True, False or None (the default: "
                            "measured plan selection decides)")
        self.compile = compile
        """Workers compile their programs' runs of local kernels with Inductor (``runtime/regions.py``):
        True, False, or None (measured plan selection decides; without it, False)."""
        self.compiled = compile is True
        """Whether the deployed plan's workers run compiled programs (``compile``, or what measured
        plan selection kept)."""
        if driver_state_limit_bytes is not None and not (isinstance(driver_state_limit_bytes, (int, float))
                                                         and driver_state_limit_bytes >= 0):
            raise TypeError(f"parallelize: driver_state_limit_bytes={driver_state_limit_bytes!r} must be a number of "
                            "bytes >= 0 (the most state a read of the model or optimizer brings to this process)")
        self.driver_state_limit_bytes = driver_state_limit_bytes
        """The most state a read of the model or optimizer after a step brings here (``alpa_torch.live``);
        None: half of the memory this machine has available at the time of the read."""
        self._live: LiveState | None = None
        """Keeps the model and optimizer objects in step with the workers (``alpa_torch.live``)."""
        self.deployments = 0
        """Plans deployed on the workers so far (an evaluation planned against one re-plans after)."""
        self.progress = progress
        self.plan_cache = PlanCache.from_option(plan_cache)
        self._layout: BatchLayout | None = None
        """What each leaf of the batch is to the graph (``alpa_torch.batch``), from the capture."""
        self._index_rules: dict = {}
        """Batch input -> the index ranges the operators reading it accept (checked every call)."""
        self._trains: tuple[weakref.ref, tuple[weakref.ref, ...]] | None = None
        """The model and optimizer objects of the first call: the only ones this step trains."""
        self._closed = False
        """``shutdown()`` was called: the live state is gone."""
        self._combine = "mean"
        """How the microbatches' losses and gradients add up (``coupling.loss_combine``)."""
        self._seed = 0
        """The seed of the random operators on the workers (``runtime/rng.py``): the driver's
        ``torch.initial_seed()`` at the first call."""
        self.max_restarts, self.checkpoint_every, self.host_timeout_s = max_restarts, checkpoint_every, host_timeout_s
        self.checkpoint_dir = checkpoint_dir
        self.restarts = 0
        """Worker restarts so far (at most ``max_restarts``)."""
        self.graph = None
        self.run_graph = None
        self.plan = None
        self.plan_source: str | None = None
        """'search', 'cache' or 'forced': where ``self.plan`` came from."""
        self.group = None
        self.engine = None
        self._functional: OptimizerSet | None = None
        """The user's optimizer(s), as the captured step runs them (``alpa_torch.optim``)."""
        self._step = 0
        self._pending: tuple | None = None  # (path, manifest) of a load() before the first call
        self._recomputed: dict[str, str] = {}
        """Activation checkpointing: copy node -> original node in ``run_graph`` (``remat.py``)."""

    # ------------------------------------------------------------------ call
    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``step(model, optimizer, batch)``: one training step on the cluster; returns the loss."""
        model, optimizer, batch = _step_arguments(getattr(self, "__name__", "step"), args, kwargs)
        self._check_open()
        with self._own_use():
            if self.engine is None:
                self._start(model, optimizer, batch)
            else:
                self._check_same_objects(model, optimizer)
                change = (self._user_changes() or self._layout.change(batch)
                          or self._functional.constants_changed(self._step))
                if change:
                    self._recapture(model, optimizer, batch, change)
            leaves = self._batch_leaves(batch)
            loss = self._run_step(leaves, model, optimizer, batch)
        self._live.after_step()
        for opt in optimizers_of(optimizer):
            opt._opt_called = True  # as optimizer.step() leaves it: LR schedulers check it
        if not math.isfinite(loss):
            warnings.warn(
                f"step {self._step}: the loss is {loss}; check the learning rate and the data of this step "
                "(the parameters may now hold NaN/Inf too)", RuntimeWarning, stacklevel=2)
        return torch.tensor(loss)

    def make_plan(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                  **override: Any) -> ParallelPlan:
        """Capture and plan without running anything (``self.plan``, ``self.graph``); ``override``:
        ``PlanOptions`` fields that replace the step's own for this planning."""
        self.graph = self._capture(model, optimizer, batch)
        options = self.options.replace(**override)
        choice = None if self.forced_plan is not None or not self.tune else \
            tuner.cached_choice(self.plan_cache, self.graph, self.cluster, options)
        if self.forced_plan is not None:
            self.plan, self.plan_source = self._load_plan(self.forced_plan), "forced"
        elif choice is not None:
            self.plan, self.plan_source = choice, "measured (cache)"
            self.tuning = choice.options.get("tuning", [])
            if self.compile is None:
                self.compiled = tuner.kept_compiled(self.tuning)
        else:
            self.plan, self.plan_source = cached_plan(self.plan_cache, self.graph, self._planning_cluster(), options,
                                                      self.progress)
        check_plan(self.graph, self.plan)
        log.info("plan (%s):\n%s", self.plan_source, self.plan.table())
        return self.plan

    def _planning_cluster(self) -> Cluster:
        """The cluster the planner prices: with measured plan selection, the step's cluster with the
        cost corrections earlier runs of this step measured on it (``alpa_torch.calibration``)."""
        return calibration.load(self.plan_cache, self.cluster, self.graph) if self.tune else self.cluster

    def _capture(self, model, optimizer, batch):
        """The step's graph, the batch's layout and the index rules: floats of the batch as data
        (0-dim tensors); if the step cannot take them as tensors (it branches on one, or hands
        one to an operator that wants a Python number), as constants of the capture instead."""
        layout = BatchLayout.of(batch)
        try:
            graph = capture(self.train_step, model, optimizer, layout.graph_batch(batch), precision=self.precision,
                            optimizers=self._functional, device_type=self.cluster.device_type)
        except CaptureError as exc:
            if not layout.scalars_as_data:
                raise
            log.info("the step does not take the batch's floats as tensors (%s); capturing them as constants: a "
                     "change of one captures the step again", str(exc).splitlines()[0])
            layout = BatchLayout.of(batch, scalars_as_data=False)
            graph = capture(self.train_step, model, optimizer, batch, precision=self.precision,
                            optimizers=self._functional, device_type=self.cluster.device_type)
        self._layout = layout
        self._index_rules = index_rules(graph.gm, {s.name: s.node for s in graph.inputs if s.kind == "batch"})
        return graph

    def _load_plan(self, forced):
        from alpa_torch.core.plan import ParallelPlan

        plan = ParallelPlan.from_json(forced) if not isinstance(forced, ParallelPlan) else forced
        plan.validate(self.graph, self.cluster)
        return plan

    def _start(self, model, optimizer, batch) -> None:
        self._trains = (weakref.ref(model), tuple(weakref.ref(o) for o in optimizers_of(optimizer)))
        self._seed = torch.initial_seed()
        t0 = time.perf_counter()
        self._functional = self._optimizer_set(model, optimizer)
        self._step = self._functional.step_count()
        self.make_plan(model, optimizer, batch)
        self.run_graph = self._runtime_graph(model, optimizer, batch)
        self._batch_leaves(batch)  # shapes and index ranges: wrong data fails here, before any worker starts
        if self._pending is not None:
            sources = [checkpoint_source(self.graph, *self._pending)]
            self._step, self._pending = self._pending[1]["step"], None
        else:
            sources = self._initial_state(model)
        t1 = time.perf_counter()
        self._launch(sources)
        log.info("planned in %.2f s, deployed in %.2f s", t1 - t0, time.perf_counter() - t1)
        if self.tune and self.plan_source in ("search", "cache"):
            self._tune(model, optimizer, batch, sources)
        if self.checkpoint_dir is not None:
            self._warn_overwrite()
            self.save(self.checkpoint_dir)  # the state a restart before the first periodic save returns to
        self._live = LiveState(model, optimizers_of(optimizer), fetch=self._fetch, tensors=self._object_tensors,
                               size_bytes=self._part_bytes, limit_bytes=self._limit_bytes)

    def _launch(self, sources: list, reserve_timeout_s: float | None = None) -> None:
        """Start the workers (``reserve_timeout_s``: how long to wait for their resources; None: the
        group's default), deploy the plan and load the state ``sources`` give onto them."""
        from runtime.group import WorkerGroup

        self.group = WorkerGroup.start(self.cluster, reserve_timeout_s=reserve_timeout_s)
        try:
            self.engine = self._deploy()
            self.engine.load(sources)
        except BaseException:
            self._stop_workers()
            raise

    def _runtime_graph(self, model, optimizer, batch):
        """The graph the workers run: the step on one microbatch (before activation checkpointing)."""
        b = self.plan.num_microbatches
        if b == 1:
            return self.graph
        specs = [(i, s) for i, s in enumerate(self._batch_specs()) if s is not None]
        flags = split_flags([s.shape for _, s in specs])
        shared = [self._layout.name(i) for (i, s), cut in zip(specs, flags) if s.shape and not cut]
        hint = (f" ({', '.join(shared)} go whole to every microbatch: no batch dimension)" if shared else
                ": a tensor shared by every sample whose first dimension equals the batch size is cut too")
        try:
            graph = capture(self.train_step, model, optimizer, _first_microbatch(self._layout, batch, b),
                            precision=self.precision, optimizers=self._functional,
                            device_type=self.cluster.device_type)
        except CaptureError as exc:
            raise BatchSplitError(
                f"the plan runs {b} microbatches, and capturing the step on one of them (each batch entry with the "
                f"batch dimension cut along dim 0{hint}) failed: {exc}. Fix: num_microbatches=1, or give every "
                "per-sample entry the batch size as its first dimension") from exc
        if set(graph.nodes) != set(self.graph.nodes):
            raise PlanError(
                "the step's graph on a microbatch differs from the full-batch graph (shape-dependent "
                "control flow?); use num_microbatches=1"
            )
        self._combine = loss_combine(self.graph, graph, b)
        if self._combine is None:
            why = ("the step's loss is neither a mean nor a sum over the batch's samples (e.g. a product or ratio "
                   "of batch statistics), so adding up microbatches would change it")
            if self.forced_plan is not None or self.options.num_microbatches not in (None, 1):
                raise PlanError(f"the plan runs {b} microbatches, but {why}. Fix: num_microbatches=1, or make the "
                                "loss a mean (or sum) of per-sample terms")
            log.warning("%s: planning again with one microbatch", why)
            self.make_plan(model, optimizer, batch, num_microbatches=1)
            self._combine = "mean"
            return self.graph
        return graph

    def _batch_specs(self) -> list:
        """Per leaf of the batch, its graph input (``IOSpec``), or None for a constant."""
        specs = {s.name: s for s in self.graph.inputs if s.kind == "batch"}
        return [specs.get(f"batch.{i}") for i in range(len(self._layout.kinds))]

    def evaluate(self, fn: Callable) -> Any:
        """``fn(model, batch)`` (forward only: a validation loss, metrics, a generation loop) as a
        callable ``evaluate(model, batch)`` that runs on this step's workers against the live
        trained state, planned for inference (``alpa_torch.evaluate``)."""
        from .evaluate import ParallelEval

        return ParallelEval(fn, step=self)

    def _deploy(self):
        self.deployments += 1
        engine, self._recomputed = deploy_plan(self.group, self.plan, self.run_graph, self.cluster, self._seed,
                                               self._combine, self.compiled, self._compile_cache())
        if self.trace:
            engine.record(True)
        return engine

    def _compile_cache(self) -> str | None:
        """Where workers keep compiled regions: beside the plans (``<plan cache>/compiled``); None
        without a plan cache (``plan_cache=False``) or without compiling."""
        return str(self.plan_cache.root / "compiled") if self.compiled and self.plan_cache else None

    def measured_trace(self, path: str | os.PathLike[str] | None = None) -> dict:
        """What every worker did in the last step, when: a Chrome/Perfetto trace (``viz.trace_from_events``;
        needs ``parallelize(..., trace=True)``), also written to ``path`` if given. Beside the
        predicted one (``viz.predicted_trace(step.plan)``),
        ``viz.compare_traces`` draws both."""
        if not self.trace:
            raise RuntimeError("this step does not record its runs: create it with parallelize(..., trace=True)")
        if self.engine is None:
            raise RuntimeError("no step has run yet: call the step once, then ask for its trace")
        out = viz.trace_from_events(self.engine.events(), self.plan)
        if path is not None:
            viz.write_trace(out, path)
        return out

    def _recapture(self, model, optimizer, batch, change: str) -> None:
        """Capture and plan the step again for what changed, and run it on the same workers from the
        live state (the trained state carries over; state the new step adds starts as on a first call).
        Capturing and planning come first: if they fail (the user's new input is wrong, as eager
        would find), the step is left as it was, workers and state untouched, and the error raised."""
        log.warning("%s: capturing and planning the step again (the trained state carries over)", change)
        kept = {k: getattr(self, k) for k in _PLANNED}
        try:
            self._functional = self._optimizer_set(model, optimizer)
            self.make_plan(model, optimizer, batch)
            self.run_graph = self._runtime_graph(model, optimizer, batch)
            self._batch_leaves(batch)
        except BaseException:
            for k, v in kept.items():
                setattr(self, k, v)
            raise
        behind = [part for part in PARTS if self._live.stale[part]]  # the objects hold the rest as it is
        names = [n for part in behind for n in self._part_names(part, kept["graph"])]
        live = {k: from_wire(v) for k, v in self.engine.gather_state(names).items()} if names else {}
        self.engine = self._deploy()
        self.engine.load([Values(to_wire_dict(live)), *self._initial_state(model)])  # live first: it wins
        self._live.recaptured()

    def _batch_leaves(self, batch) -> dict:
        """The batch's data leaves as the workers receive them, after checking their shapes and
        the index ranges the operators reading them accept (``alpa_torch.batch``)."""
        expected = {s.name: s.shape for s in self.graph.inputs if s.kind == "batch"}  # full batch
        tensors, names = {}, {}
        for i, leaf in self._layout.data_leaves(batch).items():
            name = f"batch.{i}"
            if name not in expected:
                continue
            if tuple(leaf.shape) != expected[name]:
                raise BatchSplitError(
                    f"{self._layout.name(i)} has shape {tuple(leaf.shape)} but the step was planned for "
                    f"{expected[name]}; keep batch shapes fixed (drop or pad the last batch) or "
                    "create a new parallelize(...) step for the new shape"
                )
            tensors[name], names[name] = leaf.detach(), self._layout.name(i)
        check_indices(self._index_rules, tensors, names)
        return to_wire_dict(tensors)

    def shutdown(self) -> None:
        """Bring the trained state into the model and optimizer objects (where it may come to this
        process: ``alpa_torch.live``), then stop the workers. The step cannot be called again."""
        if self._live is not None and self.engine is not None:
            for part in PARTS:
                with contextlib.suppress(AlpaTorchError):  # too large, or on the meta device: reads say so
                    self._live.read(part)
            self._live.close("step.shutdown() was called")
        self._closed = self._closed or self.engine is not None
        self._stop_workers()

    def _stop_workers(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = self.engine = None

    def __del__(self):
        try:
            self._stop_workers()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def load_checkpoint(directory: str) -> tuple[dict[str, torch.Tensor], dict]:
    """``(model_state_dict, optimizer_state_dict)`` of a checkpoint written by ``ParallelStep.save``,
    whole tensors for a single-device model (``runtime.checkpoint.load_checkpoint``)."""
    from runtime.checkpoint import load_checkpoint as load

    return load(directory)


def load_into(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, directory: str) -> int:
    """Copy a checkpoint into a plain ``model`` and ``optimizer``; returns its step count."""
    from runtime.checkpoint import load_into as load

    return load(model, optimizer, directory)


def _step_arguments(name: str, args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    """``(model, optimizer, batch)`` of a call of the parallel step, or a ``TypeError`` that says how
    to call it: the step takes exactly what ``train_step(model, optimizer, batch)`` takes."""
    try:
        bound = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                   for n in ("model", "optimizer", "batch")]).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"the parallel step {name} takes (model, optimizer, batch) like train_step, got {len(args)} positional "
            f"argument(s){' and ' + ', '.join(kwargs) if kwargs else ''} ({exc}). Fix: put every input of the step "
            "in one batch: step(model, optimizer, (x, y)) or a dict, and read it inside train_step") from None
    model, optimizer = bound.arguments["model"], bound.arguments["optimizer"]
    opts = optimizers_of(optimizer)
    if not isinstance(model, torch.nn.Module) or not opts or not all(isinstance(o, torch.optim.Optimizer)
                                                                       for o in opts):
        raise TypeError(f"the parallel step {name} takes (model, optimizer, batch): got a {type(model).__name__} "
                        f"and a {type(optimizer).__name__} where a torch.nn.Module and a torch.optim.Optimizer (or a "
                        "tuple or list of them) belong")
    return model, optimizer, bound.arguments["batch"]


def parallelize(train_step: Callable | Cluster | None = None, cluster: Cluster | None = None,
                **options: Any) -> ParallelStep | Callable[[Callable], ParallelStep]:
    """Return ``train_step`` running on ``cluster`` with an automatically found plan.

    Every form works::

        step = parallelize(train_step, cluster)            # or cluster=cluster
        @parallelize(cluster)                              # or @parallelize(cluster=cluster)
        def train_step(model, optimizer, batch): ...
        @parallelize                                       # the default cluster
        def train_step(model, optimizer, batch): ...

    Options (all optional, keywords): ``plan`` (a ``ParallelPlan`` or a plan JSON path to
    run instead of searching), ``num_microbatches``, ``num_stages``,
    ``num_layers``, ``pipeline=False`` (one stage on all devices),
    ``sharding=False`` (data parallel and pipeline only), ``memory_budget_bytes``
    per device, ``schedule`` (a pipeline schedule's name: '1f1b', 'gpipe', 'zb-h1' or one defined with
    ``alpa_torch.core.schedule.PipelineSchedule``), ``progress`` (a callable receiving planner
    messages), ``plan_cache`` (False, or a directory; default ``$ALPA_TORCH_CACHE`` or
    ``~/.cache/alpa_torch/plans``), ``checkpointing``
    (activation checkpointing: 'auto' recomputes layers only where a stage would
    not fit otherwise or where that makes the plan faster, 'none', 'full' = every
    layer, or a number of bytes per device the stages must fit in), ``tune`` (default
    True unless ``$ALPA_TORCH_TUNE`` is 0: where the cost model cannot tell the searched
    plan, the best one-stage plan and the data-parallel plan apart, the first call runs
    each for a few steps on the cluster and keeps the fastest measured whose own part of
    its devices' measured memory fits, remembered in the
    plan cache; ``step.tuning`` lists them; ``alpa_torch.tune``), ``trace`` (default False:
    True records when each worker ran each forward, backward, update, transfer and gradient
    reduction of a step; ``step.measured_trace(path)`` gives the last step's as a Perfetto
    trace), ``compile`` (True compiles each worker's runs of local kernels with Inductor after
    the first step, kept beside the plans so that a second run of the script loads them and
    compiles nothing; a run that fails to compile runs as before, logged; ``runtime/regions.py``.
    The default, None, leaves it to measured plan selection, which runs the fastest replayed
    plan (and the next within ``tune.COMPILE_MARGIN`` of it) compiled too and keeps the fastest;
    without ``tune`` it is False). The default cluster is ``Cluster.local(1, 2)``.

    Mixed precision: ``precision`` is 'fp32' (default), 'bf16' or 'fp16'. With 'bf16' /
    'fp16' the step's forward and loss run under ``torch.autocast`` (matmuls in the low
    precision, priced at the device's bf16/fp16 peak) while parameters, gradients and
    optimizer state stay fp32 (master weights). 'fp16' adds dynamic loss scaling like
    ``torch.amp.GradScaler`` inside the graph (scale 2**16, halved and the update
    skipped on an inf/NaN gradient, doubled after 2000 good steps; its state is in
    ``state_dict()['optimizer']`` as ``amp.*``) and runs on one stage without
    microbatches.

    Reliability: ``checkpoint_dir`` (a checkpoint is written there at start and
    every ``checkpoint_every`` steps, default 1) and ``max_restarts`` (on a worker
    failure, restart the workers from the last checkpoint and retry the failed step,
    at most this many times; needs ``checkpoint_dir``). Steps between the checkpoint
    and the failure are not replayed (their batches are gone): with
    ``checkpoint_every=k`` up to k - 1 steps of progress are lost. On real hosts, a
    restart waits ``host_timeout_s`` (default 60) for a lost host to come back, then
    plans again for the hosts left and continues there from the checkpoint.

    A step returns its loss as soon as the workers' forward has it; their backward and
    update run on while the caller prepares the next step, and an error there is raised by
    the next call that reaches the workers (the next step, ``sync``, ``state_dict``, a
    save), naming the step's rank and error. ``ALPA_TORCH_EARLY_ANSWER=0`` in the
    environment makes each step return only after its update (``runtime/worker.py``).

    The model and optimizer objects stay the trained ones (``alpa_torch.live``): a read between
    steps brings the state from the workers (at most ``driver_state_limit_bytes``, default half
    of the memory the machine has free), a write reaches them at the next step.
    ``step.evaluate(fn)`` runs a forward-only ``fn(model, batch)`` on the workers; and
    ``parallelize(fn, cluster)`` on a function of ``(model, batch)`` returns a parallel forward
    function instead of a training step (``alpa_torch.evaluate``).

    A model built on the meta device (``alpa_torch.empty_weights()``): ``weights`` (a
    directory of safetensors files, Hugging Face's layout) or ``init_fn`` (called on each
    module after its ``reset_parameters``) give its values on the workers, each reading
    or making only its slices (``alpa_torch.initial_state``).
    """
    if isinstance(train_step, Cluster):  # @parallelize(cluster)
        if cluster is not None:
            raise TypeError("parallelize got two clusters; pass one: parallelize(train_step, cluster)")
        train_step, cluster = None, train_step
    if cluster is not None and not isinstance(cluster, Cluster):
        raise TypeError(f"parallelize's cluster is a {type(cluster).__name__}, not an alpa_torch.Cluster; "
                        "describe it with Cluster.local(hosts, devices_per_host), Cluster.simulated(...) or "
                        "cluster_from_ray()")
    if train_step is None:
        return lambda fn: parallelize(fn, cluster, **options)
    if not callable(train_step):
        raise TypeError(f"parallelize's first argument is a {type(train_step).__name__}; pass the training step "
                        "function: parallelize(train_step, cluster)")
    if _forward_only(train_step):
        from .evaluate import ParallelEval

        allowed = {"precision", "init_fn", "weights"}
        if set(options) - allowed:
            raise TypeError(f"parallelize({train_step.__name__}) runs a forward function (model, batch) for inference, "
                            f"which takes {sorted(allowed)} of parallelize's options, not "
                            f"{sorted(set(options) - allowed)}")
        return ParallelEval(train_step, cluster=cluster, **options)
    return ParallelStep(train_step, cluster, **options)


def _forward_only(fn: Callable) -> bool:
    """``fn`` takes exactly (model, batch): a forward function to run for inference, not a training step."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: a training step
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    return len(required) == 2 and not any(p.kind == p.VAR_POSITIONAL for p in params)
