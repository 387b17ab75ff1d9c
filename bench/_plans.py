"""Shared pieces of the plan benchmarks (``fidelity.py``, ``auto_vs_manual.py``, ``peers.py``).

What it owns:

- ``profiled_cluster``: ``profile_cluster(Cluster.local(h, d))`` once, cached as JSON
  under ``/tmp/alpa_torch_bench`` (``--reprofile`` measures again);
- ``Workload``: one seeded GPT (``_common.build_model``), its AdamW,
  the step captured at the global batch, and the initial state as numpy;
- deployers: ``plan_deployer`` (a ``ParallelPlan``, exactly as
  ``alpa_torch.api.ParallelStep._deploy`` deploys it) and
  ``sharding_deployer`` (one forced ``StageSharding`` on every device, as
  ``tests/test_runtime.py`` runs them);
- ``run_on_workers``: deploy on fresh (or given) workers and measure step
  time, losses, memory and, optionally, where each worker's step went;
- ``spearman``, ``rel_err``: the fidelity statistics.

What it does not own: planning (``stage_dp.search.plan``), the runtime, the
PyTorch baselines (``bench/_common.py``) and the worker-side step timers
(reused from ``bench/runtime_vs_torch.py``).

Memory protocol (per worker process, MB = 2**20 bytes): ``rss_start_mb`` right
after the worker starts (torch imported); ``rss_base_mb`` after the plan is
deployed (graph unpickled, DeviceMeshes and process groups built, DTensor
imported) but before the model state is loaded; at that moment the kernel's
peak-RSS counter is reset (``/proc/self/clear_refs`` = 5), so ``peak_mb`` is
``VmHWM`` since then: loading the state and every step. ``model_mb`` =
``peak_mb - rss_base_mb`` is what the plan's predicted per-device memory
(the simulated peak of ``stage_dp.memory_sim``) is compared with. ``live_mb``
is the same difference for the live heap (glibc ``mallinfo2``: bytes malloc has
handed out and not got back), its peak sampled after every operator of one extra
step: what the program holds, without the freed pages the allocator keeps (RSS
grows to about twice the live peak over a few steps on this runtime). It also contains what the
runtime holds that the planner does not model
(during the functional optimizer update the old and the new parameters and
optimizer state at once, the batch, transient DTensor / gloo buffers, modules
and caches first loaded by a step, allocator slack), and misses nothing the
model holds.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from _common import BenchConfig, build_model, global_batch, median
from runtime_vs_torch import _breakdown, _worker_install_timers, _worker_read_timers

from alpa_torch.zoo import make_optimizer, train_step

log = logging.getLogger("bench.plans")
CACHE_DIR = Path("/tmp/alpa_torch_bench")
_MiB = 2.0**20


def _ship_by_value() -> None:
    """Ray workers cannot import ``bench/``: send this module's and the timers' functions by value."""
    import runtime_vs_torch
    from ray import cloudpickle

    for module in (sys.modules[__name__], runtime_vs_torch):
        cloudpickle.register_pickle_by_value(module)


# ---------------------------------------------------------------- cluster


def profiled_cluster(hosts: int, devices: int, *, reprofile: bool = False, cache_dir: Path = CACHE_DIR):
    """``(cluster, cached)``: the profiled ``Cluster.local(hosts, devices)``, from the cache if there."""
    from alpa_torch.core.cluster import Cluster
    from runtime.profile import profile_cluster

    path = Path(cache_dir) / f"cluster_local_{hosts}x{devices}.json"
    if path.exists() and not reprofile:
        return Cluster.from_json(path), True
    t0 = time.perf_counter()
    cluster = profile_cluster(Cluster.local(hosts, devices))
    path.parent.mkdir(parents=True, exist_ok=True)
    cluster.to_json(path)
    log.info("profiled %dx%d in %.1f s -> %s", hosts, devices, time.perf_counter() - t0, path)
    return cluster, False


def cluster_summary(cluster) -> dict:
    """The calibration numbers the cost model reads, rounded for a JSON line."""
    return {"flops_f32": round(cluster.device.flops_per_s("float32") / 1e9, 1),
            "mem_bw_gbs": round(cluster.device.memory_bandwidth_bytes_per_s / 1e9, 2),
            "intra_alpha_ms": round(cluster.intra_host_link.alpha_s * 1e3, 3),
            "intra_gbs": round(cluster.intra_host_link.bandwidth_bytes_per_s / 1e9, 3),
            "inter_alpha_ms": round(cluster.inter_host_link.alpha_s * 1e3, 3),
            "inter_gbs": round(cluster.inter_host_link.bandwidth_bytes_per_s / 1e9, 3),
            "beta_scale": {k: round(v, 2) for k, v in cluster.collective_beta_scale.items()},
            "op_overhead_us": round(getattr(cluster.device, "op_overhead_s", 0.0) * 1e6, 2),
            "sharded_op_overhead_us": round(getattr(cluster.device, "sharded_op_overhead_s", 0.0) * 1e6, 2),
            "profiled": cluster.profiled.get("date")}


# ---------------------------------------------------------------- workload


@dataclass
class Workload:
    """A seeded GPT, its optimizer, the captured full-batch step and the initial state."""

    cfg: BenchConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    graph: object
    functional: object
    state: dict
    """Parameters, buffers and optimizer state as numpy, keyed by graph input name."""
    _micro: dict

    def microbatch_graph(self, num_microbatches: int):
        """The step captured on one of ``num_microbatches`` slices (what a pipeline stage runs)."""
        from alpa_torch.capture import capture

        if num_microbatches == 1:
            return self.graph
        if num_microbatches not in self._micro:
            size = self.cfg.global_batch // num_microbatches
            self._micro[num_microbatches] = capture(train_step, self.model, self.optimizer,
                                                    global_batch(self.cfg, 0, batch_size=size))
        return self._micro[num_microbatches]


def workload(cfg: BenchConfig) -> Workload:
    from alpa_torch.capture import capture
    from alpa_torch.optim import OptimizerSet

    model = build_model(cfg)
    opt = make_optimizer("adamw", model)
    graph = capture(train_step, model, opt, global_batch(cfg, 0))
    functional = OptimizerSet((opt,), {id(p): n for n, p in model.named_parameters()})
    values = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name in functional.names:
        for key, v in functional.initial_state(name, values[name]).items():
            values[f"{name}.{key}"] = v
    state = {k: v.detach().numpy().copy() for k, v in values.items()}
    return Workload(cfg=cfg, model=model, optimizer=opt, graph=graph, functional=functional, state=state,
                    _micro={})


# ---------------------------------------------------------------- plans


def forced_plan(cost_model, stages, num_microbatches: int = 1, schedule: str = "1f1b"):
    """A ``ParallelPlan`` of the given stages, priced by the planner's own tables.

    ``stages``: ``[(layer_start, layer_end, submesh, logical_shape), ...]``, each stage
    on the 'fast' ILP of that logical mesh (``cost_model`` must offer it: use
    ``logical_shapes='all'`` for meshes Alpa's space leaves out). This is what
    ``bench/plan_gpt.py`` does for its manual plans; the plan is exactly what the
    search would emit had it chosen these stages.
    """
    from stage_dp.search import build_plan, candidate_columns
    from stage_dp.tables import build_tables

    budget = float(cost_model.cluster.device.memory_bytes)
    scale = 1.0 / num_microbatches
    columns = candidate_columns(cost_model, cost_model.configs, budget, scale, lean_all=False)
    tables = build_tables(cost_model, columns, num_microbatches, budget, schedule, scale)
    picked = []
    for lo, hi, submesh, shape in stages:
        s = cost_model.submeshes.index(tuple(submesh))
        c = next((c for c, cfg in enumerate(columns[s])
                  if cfg.logical_shape == tuple(shape) and cfg.variant == "fast"), None)
        if c is None:
            raise ValueError(f"logical mesh {shape} on submesh {submesh} is not among the cost model's meshes "
                             f"{[cfg.logical_shape for cfg in columns[s]]}")
        picked.append((lo, hi, s, c))
    options = {"forced_stages": [[lo, hi, list(sub), list(sh)] for lo, hi, sub, sh in stages],
               "microbatch_candidates": [num_microbatches], "sharding": cost_model.sharding}
    return build_plan(cost_model.graph, cost_model, tables, picked, schedule, budget, options)


# Megatron-LM tensor parallelism of a GPT block (Shoeybi et al. 2019, §3): the first
# Linear of attention (fused qkv) and of the MLP split by output features (weight
# [out, in] dim 0, bias dim 0: column parallel), the second by input features (weight
# dim 1, bias replicated: row parallel); the LM head split by vocabulary (dim 0).
MEGATRON_DIM = {"attn.c_attn.weight": 0, "attn.c_attn.bias": 0, "attn.c_proj.weight": 1,
                "mlp.0.weight": 0, "mlp.0.bias": 0, "mlp.2.weight": 1, "lm_head.weight": 0}
FAMILIES = ("dp", "zero1", "zero3", "tp", "dp_tp")


def _spec(mesh_shape, dims_by_axis) -> str:
    """Spec string on a 2D mesh: ``dims_by_axis[a]`` is the tensor dim sharded along axis a, or None.
    A size-1 axis is always R. Two axes sharding one dim nest left to right (S(0)S(0))."""
    return "".join("R" if n == 1 or d is None else f"S({d})" for n, d in zip(mesh_shape, dims_by_axis))


def _all_axes(mesh_shape, dim):
    return _spec(mesh_shape, (dim, dim))


def family_force(graph, family: str, mesh_shape) -> dict[str, str]:
    """``solve_stage(force=...)`` of a manual plan family on ``mesh_shape``; the ILP places the rest.

    - ``dp``: batch split over every device, parameters and optimizer state replicated
      (DDP's layout; the ILP chooses where gradients are reduced and the update runs);
    - ``zero1``: as ``dp``, optimizer state split by dim 0 over every device (ZeRO-1/2);
    - ``zero3``: as ``zero1``, parameters split too (ZeRO-3 / FSDP: gathered where used);
    - ``tp``: batch replicated, Megatron weights (``MEGATRON_DIM``) split over every device;
    - ``dp_tp`` (2D meshes): batch split along axis 0, Megatron weights along axis 1.

    A tensor whose dim does not divide by the devices it is split over keeps R.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    if family == "dp_tp" and 1 in mesh_shape:
        raise ValueError(f"dp_tp needs a 2D mesh, got {tuple(mesh_shape)}")
    n_all = mesh_shape[0] * mesh_shape[1]
    by_param = {s.name: s for s in graph.inputs if s.kind == "param"}

    def owner(name):
        return next((p for p in by_param if name.startswith(p + ".")), None)

    def split(shape, dim, devices, spec):
        return spec if len(shape) > dim and shape[dim] % devices == 0 else _spec(mesh_shape, (None, None))

    force = {}
    for s in graph.inputs:
        param = s.name if s.kind == "param" else owner(s.name) if s.kind == "opt_state" else None
        if s.kind == "batch" and s.shape:
            force[s.name] = (_spec(mesh_shape, (None, None)) if family == "tp" else
                             _spec(mesh_shape, (0, None)) if family == "dp_tp" else _all_axes(mesh_shape, 0))
        elif s.kind == "buffer":
            force[s.name] = _spec(mesh_shape, (None, None))
        elif param is not None and tuple(s.shape) == tuple(by_param[param].shape):
            meg = next((d for key, d in MEGATRON_DIM.items() if param.endswith(key)), None)
            if family == "dp" or (family == "zero1" and s.kind == "param"):
                force[s.name] = _spec(mesh_shape, (None, None))
            elif family in ("zero1", "zero3"):
                force[s.name] = split(s.shape, 0, n_all, _all_axes(mesh_shape, 0))
            elif family == "tp" and meg is not None:
                force[s.name] = split(s.shape, meg, n_all, _all_axes(mesh_shape, meg))
            elif family == "dp_tp" and meg is not None:
                force[s.name] = split(s.shape, meg, mesh_shape[1], _spec(mesh_shape, (None, meg)))
    return force


def solve_forced(graph, cluster, submesh, mesh_shape, force: dict[str, str] | None):
    """The ILP's sharding of the whole step on ``mesh_shape`` (a logical mesh of ``submesh``) with ``force``."""
    from intra_ilp.cost_model import MeshCost
    from intra_ilp.stage import solve_stage

    mesh = MeshCost.from_cluster(cluster, tuple(submesh), tuple(mesh_shape))
    return solve_stage(graph, mesh, force=force)


class Planner:
    """Cost models shared by every plan of a run (ILP solutions are shared between them too)."""

    def __init__(self, graph, cluster):
        from stage_dp.layer_assign import assign_layers
        from stage_dp.stage_costs import StageCostModel

        self.graph, self.cluster = graph, cluster
        self.layers = assign_layers(graph, boundaries_by_module="blocks")
        cache: dict = {}
        self._models = {}
        self._auto_model = None
        self._make = lambda sharding, shapes: StageCostModel(graph, cluster, self.layers, sharding=sharding,
                                                             logical_shapes=shapes, solution_cache=cache)

    def model(self, sharding: bool = True, shapes: str = "alpa"):
        key = (sharding, shapes)
        if key not in self._models:
            self._models[key] = self._make(sharding, shapes)
        return self._models[key]

    def auto(self, min_microbatch: int = 1):
        """The plan ``parallelize(train_step, cluster=self.cluster)`` searches (default layering and
        options); with ``min_microbatch`` > 1 only microbatch counts B leaving at least that many
        samples per microbatch are searched (the best of one search per allowed B)."""
        from stage_dp.search import plan
        from stage_dp.stage_costs import batch_size
        from stage_dp.tables import microbatch_candidates

        if min_microbatch <= 1:
            return plan(self.graph, self.cluster)
        if self._auto_model is None:
            from stage_dp.layer_assign import assign_layers
            from stage_dp.stage_costs import StageCostModel

            self._auto_model = StageCostModel(self.graph, self.cluster, assign_layers(self.graph, None))
        size = batch_size(self.graph)
        plans = [plan(self.graph, self.cluster, cost_model=self._auto_model, num_microbatches=b)
                 for b in microbatch_candidates(self.graph, None) if size // b >= min_microbatch]
        return min(plans, key=lambda p: p.predicted_step_s)

    def plan(self, kind: str, spec):
        """kind 'auto': ``self.auto(spec)``; 'search': ``stage_dp.search.plan(**spec)`` on the block
        layers; 'forced': ``forced_plan`` of
        ``(stages, B)`` ('L' = the last layer); 'family': a ``StageSharding`` of
        ``(family, submesh, mesh_shape)`` (``family_force`` + ``solve_forced``)."""
        from stage_dp.search import plan

        if kind == "auto":
            return self.auto(spec)
        if kind == "family":
            family, submesh, mesh_shape = spec
            return solve_forced(self.graph, self.cluster, submesh, mesh_shape,
                                family_force(self.graph, family, mesh_shape))
        if kind == "search":
            opts = dict(spec)
            return plan(self.graph, self.cluster, cost_model=self.model(opts.get("sharding", True)), **opts)
        stages, b = spec
        last = self.layers.num_layers - 1
        stages = [(lo, last if hi == "L" else hi, sub, mesh) for lo, hi, sub, mesh in stages]
        return forced_plan(self.model(True, "all"), stages, b)


def stage_op_counts(plan, graph) -> list[dict]:
    """Per stage, operators (call_function nodes, views and getitems included) of its layers:
    ``fb`` forward + backward ones (run once per microbatch), ``update`` the optimizer's (once
    per step), ``per_step`` = B * fb + update."""
    counts = [{"fb": 0, "update": 0} for _ in plan.stages]
    for name, node in graph.nodes.items():
        layer = plan.layer_of.get(name)
        for k, st in enumerate(plan.stages):
            if layer is not None and st.layer_start <= layer <= st.layer_end:
                counts[k]["update" if node.phase == "update" else "fb"] += 1
    for c in counts:
        c["per_step"] = plan.num_microbatches * c["fb"] + c["update"]
    return counts


# ---------------------------------------------------------------- deployers


def plan_deployer(plan, wl: Workload, cluster):
    """``group -> engine`` for ``plan``, deployed as ``ParallelStep`` does (``api.deploy_plan``)."""
    from alpa_torch.api import deploy_plan
    from alpa_torch.core.errors import PlanError

    graph = wl.microbatch_graph(plan.num_microbatches)
    if set(graph.nodes) != set(wl.graph.nodes):  # ParallelStep._runtime_graph refuses it the same way
        raise PlanError(f"the step's graph on a microbatch of {wl.cfg.global_batch // plan.num_microbatches} "
                        f"sample(s) differs from the full-batch graph (B={plan.num_microbatches}): "
                        "parallelize would raise here too")

    def deploy(group):
        return deploy_plan(group, plan, graph, cluster)[0]
    return deploy


def sharding_deployer(wl: Workload, sharding):
    """``group -> engine``: one stage on every device of the group with ``sharding``."""
    from runtime.engine import Engine

    return lambda group: Engine(group, wl.graph, sharding)


# ---------------------------------------------------------------- worker probes (run in the Ray actors)


def _status_mb(key: str) -> float:
    from runtime.device_memory import status_bytes

    return status_bytes(key) / _MiB


def _worker_rss(state: dict) -> float:
    return _status_mb("VmRSS")


def _heap_in_use() -> float:
    """``runtime.device_memory.heap_in_use_bytes``; -1 without glibc's ``mallinfo2``."""
    from runtime.device_memory import heap_in_use_bytes

    value = heap_in_use_bytes()
    return -1.0 if value is None else value


def _worker_install_live_probe(state: dict) -> bool:
    """Sample the live heap (``_heap_in_use``) after every operator of the next steps; the
    highest sample is kept in ``state['bench_live_peak']`` (``_worker_live_peak``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    state["bench_live_peak"] = -1.0

    class _Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            state["bench_live_peak"] = max(state["bench_live_peak"], _heap_in_use())
            return out

    owner = state["pipe"] if "pipe" in state else state["runner"]
    step = owner.step

    def probed(*args, **kwargs):
        with _Probe():
            return step(*args, **kwargs)
    owner.step = probed
    return True


def _worker_live_peak(state: dict) -> float:
    return state.get("bench_live_peak", -1.0)


def _worker_reset_peak(state: dict) -> dict:
    """Reset the peak-RSS counter (``clear_refs`` 5, Linux >= 4.0); the RSS and the live heap at that moment."""
    import gc

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    return {"rss_mb": _status_mb("VmRSS"), "reset": reset, "heap_mb": _heap_in_use() / _MiB}


def _worker_peak(state: dict) -> float:
    return _status_mb("VmHWM")


def _worker_lifetime_peak(state: dict) -> float:
    """The worker's ``VmHWM`` as if the runtime had not reset it between deployments, MiB."""
    from runtime.device_memory import lifetime_peak_bytes

    return lifetime_peak_bytes(state["device"]) / _MiB


# ---------------------------------------------------------------- measuring


def _steps(engine, wl: Workload, count: int, first: int) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for step in range(first, first + count):
        idx, tgt = global_batch(wl.cfg, step)
        batch = {"batch.0": idx.numpy(), "batch.1": tgt.numpy()}
        t0 = time.perf_counter()
        loss = engine.step(batch, wl.functional.host_scalars())
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return times, losses


def run_on_workers(cluster, deploy, wl: Workload, *, warmup: int = 2, timed: int = 5, breakdown_steps: int = 0,
                   group=None, live_steps: int = 1, trace_steps: int = 0) -> dict:
    """Deploy with ``deploy(group)`` and measure (module docstring: memory protocol).

    Fresh workers are started (and stopped) unless ``group`` is given; memory figures
    are only meaningful on fresh workers. Steps: ``warmup`` + ``timed`` uninstrumented
    ones (``step_s`` = median driver wall time of the timed ones), then
    ``breakdown_steps`` with per-worker timers (``breakdown``, from
    ``runtime_vs_torch``; each worker's step split into DTensor redistributions,
    pipeline send / receive-and-wait, gradient buckets and the rest), then
    ``live_steps`` with the live heap sampled after every operator (``live_mb``:
    its peak minus the live heap when ``rss_base_mb`` was taken). With ``trace_steps``, that
    many more steps recorded by the runtime (``Engine.record``, ``runtime/timeline.py``):
    ``events``, the last one's (stage, rank, events) per worker.
    """
    from runtime.group import WorkerGroup

    _ship_by_value()
    own = group is None
    t0 = time.perf_counter()
    group = WorkerGroup.start(cluster) if own else group
    try:
        start_s = time.perf_counter() - t0
        rss_start = group.call_all(_worker_rss)
        t1 = time.perf_counter()
        engine = deploy(group)
        base = group.call_all(_worker_reset_peak)
        engine.load_state(wl.state)
        deploy_s = time.perf_counter() - t1
        times, losses = _steps(engine, wl, warmup + timed, 0)
        peak = group.call_all(_worker_peak)
        events = None
        if trace_steps:
            engine.record(True)
            _steps(engine, wl, trace_steps, warmup + timed)
            events = engine.events()
            engine.record(False)
        timers = None
        if breakdown_steps:
            group.call_all(_worker_install_timers)
            extra, _ = _steps(engine, wl, breakdown_steps, warmup + timed + trace_steps)
            timers = group.call_all(_worker_read_timers)
        live = None
        if live_steps:
            group.call_all(_worker_install_live_probe)
            _steps(engine, wl, live_steps, warmup + timed + trace_steps + breakdown_steps)
            live = group.call_all(_worker_live_peak)
    finally:
        if own:
            group.shutdown()
    out = {"step_s": median(times[warmup:]), "steps_s": times, "losses": losses,
           "start_s": start_s, "deploy_s": deploy_s,
           "rss_start_mb": rss_start, "rss_base_mb": [b["rss_mb"] for b in base], "peak_mb": peak,
           "peak_reset": all(b["reset"] for b in base)}
    out["model_mb"] = [p - b for p, b in zip(peak, out["rss_base_mb"])] if out["peak_reset"] else \
        [p - s for p, s in zip(peak, rss_start)]
    if timers is not None:
        out["breakdown"] = _breakdown(extra, timers)
    if events is not None:
        out["events"] = events
    if live is not None and all(x >= 0 for x in live) and all(b["heap_mb"] >= 0 for b in base):
        out["live_mb"] = [x / _MiB - b["heap_mb"] for x, b in zip(live, base)]
    return out


# ---------------------------------------------------------------- statistics


def _ranks(xs) -> np.ndarray:
    """Ranks 1..n, ties get their average rank."""
    xs = np.asarray(xs, dtype=float)
    order = np.argsort(xs, kind="stable")
    ranks = np.empty(len(xs))
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs, ys) -> float:
    """Spearman's rank correlation (Pearson's r of the tie-averaged ranks)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"need two equal-length lists of >= 2 values, got {len(xs)} and {len(ys)}")
    rx, ry = _ranks(xs), _ranks(ys)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float(np.sqrt((rx**2).sum() * (ry**2).sum()))
    return float((rx * ry).sum() / den) if den else float("nan")


def rel_err(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured."""
    return abs(predicted - measured) / measured


def machine_info() -> dict:
    """Date, CPU count, load and the code's commit: what a reader needs to judge a timing."""
    load = os.getloadavg()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "load_1_5_15": [round(x, 2) for x in load],
            "torch": torch.__version__, "commit": _commit()}


def _commit() -> str | None:
    """The checkout's commit (with ``+`` if tracked files differ from it), or None outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


def dumps(line: dict) -> str:
    return json.dumps(line, allow_nan=True)
