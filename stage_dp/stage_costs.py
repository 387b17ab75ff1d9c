"""Stage costs for the stage DP: one intra-op ILP per distinct layer and mesh, stitched.

Owns: the latency and memory of every candidate stage (layers i..j on a
logical mesh), priced with ``intra_ilp`` (``build_stage_instance`` +
``solve_instance``, the maths of ``intra_ilp.stage``). Does not own the DP
(``dp.py``), the choice of microbatches or the plan (``search.py``).

Why per layer. One ILP costs 1-8 s here (mostly Pyomo model building), and a
stage search on 64 devices has ~40 logical meshes and O(L²) layer ranges.
So we solve one ILP per (distinct layer, mesh) and stitch ranges:

    t(i..j) = Σ_{l=i..j} t_l + Σ_{i<=a<b<=j} x_ab

- t_l: the ILP optimum of layer l alone (its forward, backward and update
  operators; values from other layers are ILP sources with a free spec; only
  the layer's own operators' compute is counted, see ``layer_parts.phase_parts``;
  its gradient reductions priced as the runtime's buckets run them,
  ``layer_parts.with_bucketed_gradients``);
- x_ab: the resharding between the specs layer a's solution gives a value and
  the input spec layer b's solution wants for it (``cost_model.reshard_s``; ``stitching.py``),
  summed over every edge between layers a and b (both directions). The
  stitched specs are exactly what ``stage_sharding`` hands the runtime, so x
  is the true price of running the per-layer solutions together, but a joint
  ILP over i..j may find a cheaper compromise (an upper bound on the ILP).
- layers with the same signature (``layer_assign.LayerSignatures``: same
  operator targets, shapes, dtypes, phases and wiring, as the blocks of a
  transformer) share one ILP solve.

Memory adds up the same way: persistent (parameters, optimizer state,
gradients) and activation (forward values kept for backward) bytes per device.

Each cost is split by phase: forward+backward (``fb``: paid per microbatch)
and ``update`` (paid once per step), so ``search.py`` can scale them apart.
An ILP edge counts in the phase of the operator consuming it, so the gradient
all-reduce before the optimizer is update cost; so is a gradient reduction the runtime
runs once a step in buckets wherever the ILP placed it (``layer_parts.bucketed_edges``:
bandwidth per gradient, α per bucket). Of the forward/backward parts, the
fixed costs (``overhead_fb_s``: the cost per operator execution; ``latency_fb_s``:
the α of each collective) are kept apart: every microbatch pays them in full.

Variants (``MeshConfig.variant``), each its own column of the DP:

- ``fast``: the time-optimal ILP;
- ``lean``: least time with each layer within ``MeshConfig.layer_budget_bytes``
  (``search`` sets it to the device memory over the layers a stage on that
  submesh holds in a proportional split, ceil(L n / D)); a layer whose
  ``fast`` solution already fits reuses it, and a cap no strategy meets is
  raised to 1.02 × the least achievable peak;
- ``min``: least time within 1.02 × the least achievable peak
  (``ilp.min_peak_memory``), tried only when nothing else fits.

A ``lean`` column may stand in for its ILPs before they are solved
(``MeshConfig.bound``): each layer whose fast solution exceeds the cap is then
priced by a lower bound, the fast solution's times (the lean ILP minimises the
same objective under one more constraint, so its optimum is no faster) with
the least bytes any strategy choice gives each counted value
(``LayerCost.least_persistent_bytes``...), and no resharding between layers.
``search`` solves a bound column's ILPs only when the stage DP picks it. The
bound is exact up to the ILP's gap and one approximation: the DP weighs a
stage's fixed per-microbatch costs (``overhead_fb_s``, ``latency_fb_s``) apart
from the rest, and a lean solution with smaller fixed costs than the fast one's
could price below it there.

In the memory rows of ``lean`` / ``min`` ILPs activations weigh
``activation_scale`` (one microbatch of the largest candidate B).
``sharding=False``: only (n, 1) meshes, and parameters, optimizer state,
buffers and the update's operators are forced replicated (a 1e3 s penalty on
every other spec): every device holds the whole model state and updates all of
it, as in data parallelism (the ILP still picks how each forward and backward
operator splits its work; the batch dim is the cheap one).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from alpa_torch.core.errors import InfeasibleMemoryError
from alpa_torch.core.remat import recompute_nodes
from alpa_torch.core.sharding import StageSharding
from intra_ilp import cost_model as cm
from intra_ilp.highs_direct import load_compiler
from intra_ilp.ilp import min_peak_memory, solve_instance
from intra_ilp.stage import build_stage_instance, stage_sharding

from .checkpointing import range_max
from .fork_pool import default_workers, fork_map
from .layer_assign import LayerAssignment, LayerSignatures
from .layer_parts import accumulate_s, bucketed_edges, fixed_fb_parts, phase_parts, with_bucketed_gradients
from .stitching import Stitching

logger = logging.getLogger(__name__)

REPLICATE_PENALTY_S = 1e3
LEAN_SLACK = 1.02
_PARTS = ("compute_fb_s", "comm_fb_s", "compute_update_s", "comm_update_s",
          "persistent_bytes", "activation_bytes", "recompute_s", "kept_bytes",
          "overhead_fb_s", "latency_fb_s", "accumulate_s")


@dataclass(frozen=True, slots=True)
class MeshConfig:
    """One column of the DP's config axis: a logical mesh on a submesh, and an ILP variant."""

    submesh_index: int
    submesh: tuple[int, int]
    logical_shape: tuple[int, int]
    variant: str = "fast"
    """'fast', 'lean' or 'min' (module docstring)."""
    layer_budget_bytes: float | None = None
    """'lean' only: the memory cap of each layer's ILP."""
    recompute: bool = False
    """The activation-checkpointing twin: the same ILP solutions, every layer of the
    stage recomputed in its backward (``checkpointing.py``)."""
    bound: bool = False
    """'lean' only: the layers whose lean ILP is unsolved are priced by their lower bound
    (module docstring); the solved ones exactly."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCost:
    """One layer on one logical mesh, at the batch the graph was captured with."""

    compute_fb_s: float
    comm_fb_s: float
    """Collectives + resharding of forward/backward operators."""
    compute_update_s: float
    comm_update_s: float
    persistent_bytes: float
    activation_bytes: float
    sharding: StageSharding
    """Specs keyed by the names of the signature's representative layer."""
    recompute_s: float = 0.0
    """Activation checkpointing (``checkpointing.py``): the time of the forward
    operators ``alpa_torch.core.remat`` copies into the backward, under this sharding."""
    kept_bytes: float = 0.0
    """Activation bytes the layer keeps when it is recomputed (what its copies read
    from outside the layer)."""
    overhead_fb_s: float = 0.0
    """The part of ``compute_fb_s`` that is the fixed cost per operator execution
    (``cost_model.operator_s``): paid in full by every microbatch, it does not shrink with it."""
    latency_fb_s: float = 0.0
    """The part of ``comm_fb_s`` that is collective latency (α of every collective of the
    forward/backward reshards): also paid in full by every microbatch."""
    accumulate_s: float = 0.0
    """Adding one microbatch's gradients of the layer into the step's sums
    (``layer_parts.accumulate_s``): paid by every microbatch after the first."""
    least_persistent_bytes: float = 0.0
    least_activation_bytes: float = 0.0
    least_kept_bytes: float = 0.0
    """The least ``persistent_bytes``, ``activation_bytes`` and ``kept_bytes`` any strategy
    choice of the layer gives (each counted value at its smallest layout): what a
    ``MeshConfig.bound`` column charges for a layer whose capped ILP is not solved yet."""

    def lower_bound(self) -> LayerCost:
        """This (fast) solution as the lower bound of a capped ILP of the same layer (module
        docstring): its times, the least bytes, and no specs (no stitching priced)."""
        return dataclasses.replace(
            self, persistent_bytes=self.least_persistent_bytes, activation_bytes=self.least_activation_bytes,
            kept_bytes=self.least_kept_bytes,
            sharding=dataclasses.replace(self.sharding, value_specs={}, input_specs={}))


@dataclass(frozen=True, kw_only=True, slots=True)
class RangeCosts:
    """float64 [L, L] per part (entry [i, j], i <= j: layers i..j), captured batch."""

    compute_fb_s: np.ndarray
    comm_fb_s: np.ndarray
    compute_update_s: np.ndarray
    comm_update_s: np.ndarray
    persistent_bytes: np.ndarray
    activation_bytes: np.ndarray
    recompute_s: np.ndarray
    kept_bytes: np.ndarray
    remat_peak_bytes: np.ndarray
    """Max over the range of (activation - kept): one layer rematerialized at a time."""
    overhead_fb_s: np.ndarray
    """Part of ``compute_fb_s``: fixed cost per operator (``LayerCost.overhead_fb_s``)."""
    latency_fb_s: np.ndarray
    """Part of ``comm_fb_s``: collective latency (``LayerCost.latency_fb_s``, and the α of the
    forward/backward reshards stitching the layers)."""
    accumulate_s: np.ndarray
    """Not in ``compute_fb_s``: one microbatch's gradient accumulation (``LayerCost.accumulate_s``)."""


def batch_size(graph) -> int:
    """Leading dim of the first batch input the graph was captured with (1 if none)."""
    shapes = graph.meta.get("batch_shapes") or []
    return int(shapes[0][0]) if shapes and len(shapes[0]) else 1


class StageCostModel:
    """Prices stages of ``graph`` on ``cluster`` for the stage DP (module docstring).

    Holds its own caches (one ILP per distinct layer, mesh and variant): share one
    object between ``plan`` calls on the same graph, cluster and layers.
    ``logical_shapes``: 'alpa' (Alpa's ``single_node_model_parallel`` space of
    ``get_one_submesh_autosharding_config_choices``: every (dp, tp) with tp <= devices
    per host and dp dividing the batch size) or 'all'. A mesh (a, b), a < b, whose axes
    use the same links as (b, a) is left out: it is (b, a) with the axes swapped.
    ``solution_cache``: a dict to keep per-layer ILP solutions in, shareable between
    models of the same graph and layers on other clusters (a solution depends only on
    the layer and the ``MeshCost``, so e.g. local 1x4 and 2x2 clusters share most).
    ``dtype``: whose peak FLOP/s prices compute; default the first parameter's dtype.
    ``workers``: processes for ``solve_many`` (default ``fork_pool.default_workers()``, at
    most 2; 1 solves everything in this process).
    ``submeshes``: the submesh shapes stages may take (default every one of the cluster's,
    ``Cluster.submesh_shapes``); a one-stage search needs only the whole cluster's
    (``search.planned_submeshes``), and prices a sixth of the meshes on 8x8.
    """

    def __init__(self, graph, cluster, layers: LayerAssignment, *, sharding: bool = True,
                 logical_shapes: str = "alpa", ilp_time_limit_s: float = 60.0, mip_gap: float = 0.01,
                 progress: Callable[[str], None] | None = None, solution_cache: dict | None = None,
                 dtype: str | None = None, workers: int | None = None,
                 submeshes: Sequence[tuple[int, int]] | None = None):
        if logical_shapes not in ("alpa", "all"):
            raise ValueError(f"logical_shapes must be 'alpa' or 'all', got {logical_shapes!r}")
        self.graph, self.cluster, self.layers = graph, cluster, layers
        self.sharding, self.logical_shapes = bool(sharding), logical_shapes
        self.ilp_time_limit_s, self.mip_gap = ilp_time_limit_s, mip_gap
        self.workers = default_workers() if workers is None else max(1, int(workers))
        self.progress = progress or (lambda msg: None)
        params = [s.dtype for s in graph.inputs if s.kind == "param"]
        self.dtype = dtype or (params[0] if params else "float32")
        self.fx_nodes = {n.name: n for n in graph.gm.graph.nodes}
        self.sigs = LayerSignatures(graph, layers)
        shapes = cluster.submesh_shapes()
        self.submeshes: tuple[tuple[int, int], ...] = shapes if submeshes is None else tuple(map(tuple, submeshes))
        if not set(self.submeshes) <= set(shapes):
            raise ValueError(f"submeshes {list(self.submeshes)} are not all among the cluster's {list(shapes)}")
        self.configs: tuple[MeshConfig, ...] = self._configs()
        self.stitching = Stitching(graph, self.fx_nodes, layers, self.sigs)
        self._solutions: dict[tuple, LayerCost] = {} if solution_cache is None else solution_cache
        self._key = (id(graph), hash(tuple(layers.layer_of.items())), self.sharding)
        self._ranges: dict[tuple, RangeCosts] = {}
        self._instances: dict[tuple, tuple] = {}  # (rep, MeshCost) -> (instance, builder): variants share one
        self._memos: dict[cm.MeshCost, dict] = {}  # ``build_stage_instance`` memo per mesh
        self.num_ilps = 0
        self.ilp_s = 0.0

    # ------------------------------------------------------------ configs
    def mesh_cost(self, cfg: MeshConfig) -> cm.MeshCost:
        return cm.MeshCost.from_cluster(self.cluster, cfg.submesh, cfg.logical_shape, self.dtype)

    def _configs(self) -> tuple[MeshConfig, ...]:
        out = []
        for s, sub in enumerate(self.submeshes):
            shapes = list(self.cluster.logical_mesh_shapes(sub))
            if not self.sharding:
                shapes = [(a, b) for a, b in shapes if b == 1]
            elif self.logical_shapes == "alpa":
                batch = batch_size(self.graph)
                shapes = [(a, b) for a, b in shapes if b <= self.cluster.devices_per_host and batch % a == 0]
            for a, b in shapes:
                if a < b and (b, a) in shapes and self._symmetric(sub, (a, b)):
                    continue
                out.append(MeshConfig(s, tuple(sub), (a, b)))
        return tuple(out)

    def _symmetric(self, sub, shape) -> bool:
        m1 = cm.MeshCost.from_cluster(self.cluster, sub, shape)
        m2 = cm.MeshCost.from_cluster(self.cluster, sub, shape[::-1])
        return m1.alpha_s == m2.alpha_s[::-1] and m1.beta_s_per_byte == m2.beta_s_per_byte[::-1]

    # ------------------------------------------------------------ per-layer ILPs
    def _solution_key(self, layer: int, cfg: MeshConfig, activation_scale: float) -> tuple:
        rep, mesh = self.sigs.rep_of[layer], self.mesh_cost(cfg)
        if cfg.variant == "fast" or not self.sharding:
            return (self._key, rep, mesh, "fast", None, None)
        return (self._key, rep, mesh, cfg.variant, cfg.layer_budget_bytes, activation_scale)

    def _fast_cost(self, layer: int, cfg: MeshConfig) -> LayerCost:
        """The fast solution of ``layer`` on ``cfg``'s mesh (solved here if need be)."""
        return self.layer_cost(layer, dataclasses.replace(cfg, variant="fast", layer_budget_bytes=None, bound=False))

    def _fast_fits(self, layer: int, cfg: MeshConfig, activation_scale: float) -> bool:
        """'lean' only: the fast solution (solved here) already fits the layer cap."""
        fast = self._fast_cost(layer, cfg)
        return fast.persistent_bytes + activation_scale * fast.activation_bytes <= cfg.layer_budget_bytes

    def solved(self, layer: int, cfg: MeshConfig, activation_scale: float = 1.0) -> bool:
        """``layer_cost`` of ``layer`` on ``cfg`` needs no ILP solve (solved, or a 'lean'
        layer whose fast solution fits)."""
        key = self._solution_key(layer, cfg, activation_scale)
        return key in self._solutions or (key[3] == "lean" and self._fast_fits(layer, cfg, activation_scale))

    def layer_cost(self, layer: int, cfg: MeshConfig, activation_scale: float = 1.0) -> LayerCost:
        """The ILP solution of ``layer`` on ``cfg`` (cached by signature); for a ``bound``
        column whose ILP is unsolved, its lower bound (module docstring)."""
        key = self._solution_key(layer, cfg, activation_scale)
        if cfg.bound and not self.solved(layer, cfg, activation_scale):
            return self._fast_cost(layer, cfg).lower_bound()
        if key not in self._solutions:
            _, rep, mesh, variant, cap, _ = key
            if variant == "lean" and self._fast_fits(layer, cfg, activation_scale):  # reuse it
                self._solutions[key] = self._fast_cost(layer, cfg)
            else:
                self.progress(f"ILP {self.num_ilps + 1}: layer {rep} ({len(self.sigs.ops[rep])} ops) on mesh "
                              f"{cfg.logical_shape} of submesh {cfg.submesh}, {variant}")
                t0 = time.perf_counter()
                self._solutions[key] = self._solve(rep, mesh, variant, cap, activation_scale)
                self.num_ilps += 1
                self.ilp_s += time.perf_counter() - t0
        return self._solutions[key]

    def solve_many(self, requests) -> None:
        """Solve the ILPs ``layer_cost`` would for every (layer, cfg, activation_scale) in
        ``requests`` and cache them as it does, on up to ``workers`` forked processes
        (``fork_pool``). One job per mesh: its fast ILPs, then its capped ones (a 'lean'
        layer whose fast solution fits the cap reuses it, no ILP), so a mesh's strategies
        and instances are built once, in one process; one job per ILP where there are fewer
        meshes than processes and no mesh has both kinds. ``ilp_s`` adds up the jobs' seconds."""
        jobs: dict[cm.MeshCost, dict[tuple, tuple]] = {}
        for layer, cfg, scale in sorted(requests, key=lambda r: r[1].variant != "fast"):
            key = self._solution_key(layer, cfg, scale)
            if key not in self._solutions:
                jobs.setdefault(key[2], {}).setdefault(key, (layer, cfg, scale))
        if not jobs:
            return
        # the biggest jobs first (ILPs x devices of the mesh: bigger meshes have more strategies),
        # so that no process is left with a big one while the others are done
        todo = [list(group.items()) for group in jobs.values()]
        if len(todo) < self.workers and all(len({key[3] == "fast" for key, _ in g}) == 1 for g in todo):
            # fewer meshes than processes (the search's rounds of lean ILPs): one job per ILP keeps every
            # process busy; a mesh's strategies are then costed in each process that has one of its ILPs
            todo = [[item] for g in todo for item in g]
        todo.sort(key=lambda g: -len(g) * math.prod(g[0][0][2].mesh_shape))
        self.progress(f"{sum(map(len, todo))} ILPs at most on {len(todo)} meshes, "
                      f"{min(self.workers, len(todo))} process(es)")

        def job(group):
            out = []
            for key, (layer, cfg, scale) in group:
                if key[3] == "lean" and self._fast_fits(layer, cfg, scale):
                    continue  # ``layer_cost`` reuses the fast solution
                t0 = time.perf_counter()
                self._solutions[key] = self._solve(*key[1:5], scale)  # this process's copy: the lean check
                out.append((key, self._solutions[key], time.perf_counter() - t0))
            for key, _ in group:  # the mesh is done: its instances are not needed again
                self._instances.pop((key[1], key[2]), None)
                self._memos.pop(key[2], None)
            return out

        def describe(group) -> str:
            mesh = group[0][0][2]
            layers = sorted({layer for _, (layer, _, _) in group})
            return f"solving the sharding ILPs of layer(s) {layers} on the {tuple(mesh.mesh_shape)} mesh"

        load_compiler()  # once here, not in every forked process
        for results in fork_map(job, todo, self.workers, describe):
            for key, cost, seconds in results:
                self._solutions[key] = cost
                self.num_ilps += 1
                self.ilp_s += seconds
        for group in todo:  # the lean ones a job skipped: their fast solution, so no later batch sends them again
            for key, (layer, cfg, scale) in group:
                if key not in self._solutions:
                    self.layer_cost(layer, cfg, scale)

    def _solve(self, rep: int, mesh: cm.MeshCost, variant: str, cap: float | None,
               scale: float) -> LayerCost:
        instance, b = self._instance(rep, mesh)
        # b.memory_rows: which nodes are persistent state and which a microbatch keeps (``intra_ilp.stage``)
        persistent, saved = b.memory_rows
        work = with_bucketed_gradients(instance, b, mesh, self.fx_nodes)
        if not self.sharding:
            work = _with_replicated_state(work, b, self.graph)
        if variant != "fast":
            work = _with_scaled_memory(work, saved, scale)
            if variant == "min":
                cap = min_peak_memory(work, time_limit_s=self.ilp_time_limit_s)[0] * LEAN_SLACK + 1.0
        sol = self._solve_capped(work, cap)
        choice = sol.strategy_index
        ops = set(self.sigs.ops[rep])
        # the layer's operators, plus the batch inputs it loads (priced as loads: ``build_stage_instance``)
        bucketed, bucket_s = bucketed_edges(instance, choice, ops, b, mesh, self.fx_nodes)
        p = phase_parts(instance, choice, self.graph, ops | set(b.fed), skip=bucketed)
        p["reshard_update"] += bucket_s
        mem = [float(instance.nodes[i].memory_bytes[choice[i]]) for i in range(len(instance.nodes))]
        sharding = stage_sharding(b, instance, sol, (p["compute_fb"] + p["compute_update"],
                                                     p["comm_fb"] + p["comm_update"],
                                                     p["reshard_fb"] + p["reshard_update"]), ops=ops)
        least = [float(np.min(node.memory_bytes)) for node in instance.nodes]
        recompute_s, kept = self._remat_parts(rep, instance, choice, mem)
        least_kept, least_act = self._remat_parts(rep, instance, choice, least)[1], math.fsum(least[i] for i in saved)
        overhead_fb, latency_fb = fixed_fb_parts(instance, choice, self.graph, ops, b, mesh, self.fx_nodes,
                                                 skip=bucketed)
        return LayerCost(compute_fb_s=p["compute_fb"], comm_fb_s=p["comm_fb"] + p["reshard_fb"],
                         compute_update_s=p["compute_update"],
                         comm_update_s=p["comm_update"] + p["reshard_update"],
                         persistent_bytes=sharding.persistent_bytes,
                         activation_bytes=sharding.activation_bytes, sharding=sharding,
                         recompute_s=recompute_s, kept_bytes=min(kept, sharding.activation_bytes),
                         overhead_fb_s=overhead_fb, latency_fb_s=latency_fb,
                         accumulate_s=accumulate_s(instance, choice, ops, b, mesh, self.fx_nodes),
                         least_persistent_bytes=math.fsum(least[i] for i in persistent),
                         least_activation_bytes=least_act, least_kept_bytes=min(least_kept, least_act))

    @functools.cached_property
    def _recompute_nodes(self) -> dict[int, list[str]]:
        """``recompute_nodes`` of every layer, in one pass over the graph (each layer's set
        depends on that layer alone)."""
        return recompute_nodes(self.graph, self.layers.layer_of, range(self.layers.num_layers))

    def _remat_parts(self, rep: int, instance, choice, mem) -> tuple[float, float]:
        """(recompute seconds, kept bytes) of layer ``rep`` under the ILP's ``choice``
        (``LayerCost``): the copied operators' compute and collectives and the resharding
        into them; the bytes of the values they read from outside the layer (forward
        values and batch inputs, not the persistent state)."""
        copies = set(self._recompute_nodes.get(rep, ()))
        index = {node.name: i for i, node in enumerate(instance.nodes)}
        t = [float(instance.nodes[i].compute_s[choice[i]] + instance.nodes[i].comm_s[choice[i]])
             for name, i in index.items() if name in copies]
        t += [float(e.reshard_s[choice[e.src], choice[e.dst]]) for e in instance.edges
              if instance.nodes[e.dst].name in copies]
        batch = {s.node for s in self.graph.inputs if s.kind == "batch"}
        read = {a for n in copies for a in self.graph.nodes[n].inputs if a not in copies}
        kept = [mem[index[a]] for a in read if a in index and (
            a in batch or (a in self.graph.nodes and self.graph.nodes[a].phase == "forward"))]
        return math.fsum(t), math.fsum(kept)

    def _instance(self, rep: int, mesh: cm.MeshCost):
        """``build_stage_instance`` of layer ``rep`` on ``mesh``, built once for all variants."""
        key = (rep, mesh)
        if key not in self._instances:
            memo = self._memos.setdefault(mesh, {})  # the layers on one mesh share costings
            self._instances[key] = build_stage_instance(self.graph, mesh, names=set(self.sigs.ops[rep]), memo=memo)
        return self._instances[key]

    def _solve_capped(self, instance, cap: float | None):
        """``solve_instance`` within ``cap`` bytes, raised to LEAN_SLACK × the least
        achievable peak when no strategy choice meets it."""
        limits = dict(time_limit_s=self.ilp_time_limit_s, mip_gap=self.mip_gap)
        if cap is None:
            return solve_instance(instance, **limits)
        try:
            return solve_instance(dataclasses.replace(instance, memory_budget_bytes=cap), **limits)
        except InfeasibleMemoryError as exc:
            cap = exc.required_bytes * LEAN_SLACK + 1.0
            return solve_instance(dataclasses.replace(instance, memory_budget_bytes=cap), **limits)

    def range_costs(self, cfg: MeshConfig, activation_scale: float = 1.0) -> RangeCosts:
        """Every layer range i..j on ``cfg`` (module docstring), at the captured batch."""
        key = (cfg, activation_scale if cfg.variant != "fast" else None)
        if cfg.bound:  # priced anew as its layers get solved
            key += (tuple(self.solved(l, cfg, activation_scale) for l in range(self.layers.num_layers)),)
        if key not in self._ranges:
            num_layers = self.layers.num_layers
            lc = [self.layer_cost(l, cfg, activation_scale) for l in range(num_layers)]
            x_fb, x_up, x_lat = self.stitching.costs(self.mesh_cost(cfg), lc)
            per_layer = {p: np.array([getattr(c, p) for c in lc]) for p in _PARTS}
            arrays = {p: _range_sums(v) for p, v in per_layer.items()}
            arrays["comm_fb_s"] = arrays["comm_fb_s"] + _pair_sums(x_fb)
            arrays["comm_update_s"] = arrays["comm_update_s"] + _pair_sums(x_up)
            arrays["latency_fb_s"] = arrays["latency_fb_s"] + _pair_sums(x_lat)
            arrays["remat_peak_bytes"] = range_max(per_layer["activation_bytes"] - per_layer["kept_bytes"])
            self._ranges[key] = RangeCosts(**arrays)
        return self._ranges[key]

    def stage_sharding(self, start: int, end: int, cfg: MeshConfig,
                       activation_scale: float = 1.0) -> StageSharding:
        """The per-layer specs of layers start..end under the stage's node names; costs
        at the captured batch, ``reshard_s`` including the stitching between layers."""
        lc = {l: self.layer_cost(l, cfg, activation_scale) for l in range(start, end + 1)}
        value_specs, input_specs, owned = {}, {}, {}
        for l in range(start, end + 1):
            for name, rep_name in self.sigs.to_rep[l].items():
                sh = lc[l].sharding
                if rep_name in sh.input_specs and name in self.graph.nodes:
                    input_specs[name] = sh.input_specs[rep_name]
                if rep_name in sh.value_specs:
                    mine = self.layers.layer_of.get(name) == l
                    if mine or name not in owned:
                        value_specs[name], owned[name] = sh.value_specs[rep_name], mine
        rc = self.range_costs(cfg, activation_scale)
        parts = [lc[l].sharding for l in lc]
        stitch = sum(float(getattr(rc, p)[start, end]) for p in ("comm_fb_s", "comm_update_s")) \
            - sum(lc[l].comm_fb_s + lc[l].comm_update_s for l in lc)
        return StageSharding(
            mesh_shape=tuple(cfg.logical_shape), value_specs=value_specs, input_specs=input_specs,
            compute_s=math.fsum(p.compute_s for p in parts), comm_s=math.fsum(p.comm_s for p in parts),
            reshard_s=math.fsum(p.reshard_s for p in parts) + max(stitch, 0.0),
            persistent_bytes=float(rc.persistent_bytes[start, end]),
            activation_bytes=float(rc.activation_bytes[start, end]),
            solver_status=_worst(p.solver_status for p in parts), gap=max(p.gap for p in parts),
            build_s=math.fsum(p.build_s for p in parts), solve_s=math.fsum(p.solve_s for p in parts),
            num_vars=sum(p.num_vars for p in parts), num_constraints=sum(p.num_constraints for p in parts))


def _worst(statuses) -> str:
    statuses = list(statuses)
    return next((s for s in statuses if s != "optimal"), "optimal")


def _range_sums(per_layer: np.ndarray) -> np.ndarray:
    """[i, j] = sum of per_layer[i..j] (j >= i), 0 below the diagonal."""
    prefix = np.concatenate(([0.0], np.cumsum(per_layer)))
    out = prefix[None, 1:] - prefix[:-1, None]
    return np.triu(out)


def _pair_sums(x: np.ndarray) -> np.ndarray:
    """[i, j] = sum of x[a, b] over i <= a < b <= j."""
    num_layers = x.shape[0]
    out = np.zeros_like(x)
    for j in range(1, num_layers):
        col = np.cumsum(x[:j, j][::-1])[::-1]  # col[i] = sum_{a=i}^{j-1} x[a, j]
        out[:j, j] = out[:j, j - 1] + col
    return out


def _with_replicated_state(instance, builder, graph):
    """A copy of ``instance`` where parameters, optimizer state, buffers and the optimizer's update
    pay ``REPLICATE_PENALTY_S`` for any spec but Replicate (``sharding=False``): every device holds
    the whole state and runs the whole update on the reduced gradients, as DDP does."""
    state = {s.node for s in graph.inputs if s.kind in ("param", "opt_state", "buffer")}
    state |= {n for n, f in graph.nodes.items() if f.phase == "update"}
    nodes = []
    for node in instance.nodes:
        if node.name in state:
            specs = [st.outputs[0] if st.outputs else None for st in builder.options[node.name]]
            penalty = [0.0 if spec is None or spec.is_replicated else REPLICATE_PENALTY_S for spec in specs]
            node = dataclasses.replace(node, compute_s=node.compute_s + np.array(penalty))
        nodes.append(node)
    return dataclasses.replace(instance, nodes=tuple(nodes))


def _with_scaled_memory(instance, saved: list[int], scale: float):
    """A copy of ``instance`` whose activation nodes weigh ``scale`` of their bytes."""
    saved = set(saved)
    nodes = tuple(dataclasses.replace(n, memory_bytes=n.memory_bytes * scale) if i in saved else n
                  for i, n in enumerate(instance.nodes))
    return dataclasses.replace(instance, nodes=nodes)
