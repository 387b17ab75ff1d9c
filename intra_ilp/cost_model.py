"""Cost model of the intra-op ILP: compute, collectives, resharding, memory.

What it owns: the numbers the ILP minimises. Every cost is in seconds
(``_s``), every size in bytes (``_bytes``). It does not own strategies (which
specs an operator may take) nor the ILP itself; its inputs are a ``MeshCost``
(built from the cluster description by ``MeshCost.from_cluster``, or by hand
in tests) and ``ShardingSpec``s from ``alpa_torch.core.spec``.

Formulas
--------
Compute, roofline (docs/design.md "Cost model")::

    compute_s = max(flops / (peak_flops(dtype) * compute_efficiency),
                    bytes_accessed / memory_bandwidth_bytes_per_s)

An operator the runtime executes also pays a fixed cost per execution
(``operator_s = compute_s + op_overhead_s``): dispatch and kernel launch, and on a
multi-device mesh DTensor's sharding propagation, tens of microseconds of CPU that
dominate small operators on CPU devices (``Cluster.profile`` measures it). Graph
nodes the runtime skips (``getitem``, gradient markers) cost nothing.

``peak_flops(dtype)`` is the device's peak for the operator's (output) dtype:
mixed precision (``parallelize(precision='bf16'|'fp16')``) runs matmuls in
bf16/fp16, which tensor cores do 8-16x faster than fp32 (``DeviceSpec.peak_flops``:
V100 fp16 125 vs fp32 15.7 TFLOP/s, A100 312 vs 19.5, H100 989 vs 67, B200 2250
vs 80). A dtype the device does not list (bf16 on a V100, anything on a CPU
device unless ``Cluster.profile`` measured it) falls back to the mesh's
``peak_flops_per_s``. Message and memory sizes already use each tensor's
element size, so bf16/fp16 values cost half of fp32 ones.

Collectives along one mesh axis of ``n`` devices, ``b`` bytes, link ``(α, β)``
(Alpa, OSDI'22, §4.1 / its ``mesh_profiling`` alpha-beta model; ``b`` is the
size of the tensor as the ``n`` devices of the group see it together, as in
Alpa's ``LogicalDeviceMesh.*_cost(num_bytes, mesh_dim)``)::

    all-reduce      α + 2 β b (n-1)/n
    all-gather      α +   β b (n-1)/n      b = gathered (output) size
    reduce-scatter  α +   β b (n-1)/n      b = input size
    all-to-all      α +   β b (n-1)/n²     b = size across the group
    p2p             α +   β b

and 0 when ``n == 1``. Each β is multiplied by a per-collective scale
(``MeshCost.*_beta_scale``): gloo on CPU runs all_gather / reduce_scatter
3–4x slower per byte than all_reduce (docs/design.md), NCCL does not. Alpa's code
also adds tiny tie-break constants and an ``n/2`` penalty on all-to-all; both
are left out here.

Resharding (Alpa §4.1 "resharding cost"): a tensor moves from spec ``src`` to
spec ``dst`` by single-axis steps, each changing the placement on one mesh
axis ``a`` while the other axes stay put:

    P → R     all-reduce          S(d) → R     all-gather
    P → S(d)  reduce-scatter      S(d) → S(e)  all-to-all
    R → S(d)  local slice, free   R → P        keep one summand, zero the rest: free

(S→P is S→R→P.) The message size of a step is the local shard size at that
point with axis ``a`` taken as unsharded, so shards on the other axis make
messages smaller. A step that adds or removes ``S(d)`` on axis ``a`` is only
correct when no later axis shards dim ``d`` too: placements nest left to
right (``spec.py``), so with ``S(0)S(0)`` axis 1 must be gathered before
axis 0. ``reshard_s`` is the cheapest sequence of such steps: a shortest path
(Dijkstra) over the specs of the tensor. That covers both axis orders, the
forced order of nested shards and hierarchical sequences (reduce-scatter on
one axis, all-reduce the smaller shard on the other, all-gather back) where
they win.

A mesh that spans every device of the cluster (``MeshCost.world``: a one-stage
plan) is the runtime's default process group, and on a 2-D one the runtime
takes one collective over all ``N = n0·n1`` devices where DTensor would take one
per axis (``runtime/grad_buckets.py``, ``replicate_over_world``): ``P P`` to any
spec without P is one all-reduce then local slices, ``S(d) S(d) → R R`` (``d``
split evenly) one all-gather. The model prices those paths so, in place of the
per-axis ones, with the slower axis' link (a ring over every device crosses it)
and ``b`` the whole tensor:

    world all-reduce  max α + 2 max β b (N-1)/N
    world all-gather  max α +   max β b (N-1)/N

Priced per axis, a 2-D data-parallel gradient's reduce-scatter on one axis and
all-gather on the other looked cheaper than two all-reduces, where the runtime
runs one bucketed all-reduce.

Memory: ``bytes_per_device`` is the largest local shard (ceil chunks, as
``ShardingSpec.local_shape``); a Partial placement holds a full-size summand.

Caches: Dijkstra results and reshard matrices are memoised with
``functools.lru_cache`` on pure, hashable keys (mesh, specs, shape, itemsize);
there is no other module state.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from alpa_torch.core.spec import P, Placement, R, S, ShardingSpec

logger = logging.getLogger(__name__)

#: Bump whenever a formula changes: plan caches are keyed on it.
#: 2: compute priced at the peak FLOP/s of the operator's dtype (mixed precision).
#: 3: a fixed cost per operator execution (``MeshCost.op_overhead_s``, ``operator_s``).
#: 4: one collective over a whole-cluster 2-D mesh (``MeshCost.world``).
#: 5: a batch leaf wanted replicated costs nothing (``intra_ilp.stage``: every device receives the batch).
#: 6: gradient reductions priced as the runtime's buckets run them (``stage_dp.layer_parts.bucketed_edges``).
#: 7: a pipeline's gradient accumulation over microbatches (``stage_dp.layer_parts.accumulate_s``).
COST_MODEL_VERSION = "alpa-alpha-beta-7"
WORLD_AXIS = -1
"""``ReshardStep.axis`` of a collective over every axis at once (``MeshCost.world``)."""

_SCALE_FIELDS = {
    "allreduce": "allreduce_beta_scale",
    "allgather": "allgather_beta_scale",
    "reducescatter": "reducescatter_beta_scale",
    "alltoall": "alltoall_beta_scale",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshCost:
    """Everything the cost model knows about one logical 2D device mesh."""

    mesh_shape: tuple[int, int]
    """Devices along mesh axis 0 and axis 1; a 1D mesh is ``(1, n)`` or ``(n, 1)``."""
    alpha_s: tuple[float, float]
    """Latency of one collective call along each mesh axis, seconds."""
    beta_s_per_byte: tuple[float, float]
    """Inverse bandwidth along each mesh axis, seconds per byte."""
    peak_flops_per_s: float
    """Peak FLOP/s of one device for the dtype in use (the default of ``flops_per_s``)."""
    peak_flops_by_dtype: tuple[tuple[str, float], ...] = ()
    """Peak FLOP/s of one device per dtype name, e.g. ``(('bfloat16', 312e12), ('float32', 19.5e12))``
    (a dict is accepted); ``flops_per_s(dtype)`` reads it, falling back to ``peak_flops_per_s``."""
    memory_bandwidth_bytes_per_s: float
    """Device memory bandwidth, bytes per second (the roofline's memory bound)."""
    compute_efficiency: float = 1.0
    """Fraction of ``peak_flops_per_s`` real kernels reach, in (0, 1]."""
    allreduce_beta_scale: float = 1.0
    """Multiplier on β for all-reduce."""
    allgather_beta_scale: float = 1.0
    """Multiplier on β for all-gather (~3.5 on a profiled gloo cluster)."""
    reducescatter_beta_scale: float = 1.0
    """Multiplier on β for reduce-scatter (~3.5 on a profiled gloo cluster)."""
    alltoall_beta_scale: float = 1.0
    """Multiplier on β for all-to-all."""
    op_overhead_s: float = 0.0
    """Fixed seconds every operator execution costs on one device of this mesh besides its
    roofline time (dispatch, kernel launch; on a multi-device mesh the runtime's replay of
    the local kernels): ``operator_s`` adds it. ``from_cluster`` takes the device's
    ``op_overhead_s`` for a one-device mesh, ``sharded_op_overhead_s`` otherwise (the runtime
    runs plain tensors on one device, replayed DTensor decisions on several)."""
    world: bool = False
    """The mesh spans every device of the cluster, so the runtime's process group is the mesh:
    a value partial or sharded over both axes of a 2-D mesh becomes replicated in one
    collective over all devices (module docstring). ``from_cluster`` sets it for a submesh
    of the whole cluster."""

    def __post_init__(self) -> None:
        # Coerce lists to tuples so the object stays hashable (it keys caches).
        for name in ("mesh_shape", "alpha_s", "beta_s_per_byte"):
            value = tuple(getattr(self, name))
            if len(value) != 2:
                raise ValueError(f"MeshCost.{name} needs one entry per mesh axis (2), got {value!r}")
            object.__setattr__(self, name, value)
        table = self.peak_flops_by_dtype
        table = table.items() if isinstance(table, dict) else table
        object.__setattr__(self, "peak_flops_by_dtype",
                           tuple(sorted((str(k).removeprefix("torch."), float(v)) for k, v in table)))
        if any(not (math.isfinite(v) and v > 0) for _, v in self.peak_flops_by_dtype):
            raise ValueError(f"MeshCost.peak_flops_by_dtype must be > 0, got {self.peak_flops_by_dtype!r}")
        if any(int(n) != n or n < 1 for n in self.mesh_shape):
            raise ValueError(f"MeshCost.mesh_shape must be positive integers, got {self.mesh_shape!r}")
        object.__setattr__(self, "mesh_shape", tuple(int(n) for n in self.mesh_shape))
        if any(not (math.isfinite(x) and x >= 0) for x in self.alpha_s + self.beta_s_per_byte):
            raise ValueError(f"MeshCost alpha_s / beta_s_per_byte must be finite and >= 0, "
                             f"got {self.alpha_s!r} / {self.beta_s_per_byte!r}")
        positive = ("peak_flops_per_s", "memory_bandwidth_bytes_per_s", *_SCALE_FIELDS.values())
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"MeshCost.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.compute_efficiency <= 1:
            raise ValueError(f"MeshCost.compute_efficiency must be in (0, 1], got {self.compute_efficiency!r}")
        if not (math.isfinite(self.op_overhead_s) and self.op_overhead_s >= 0):
            raise ValueError(f"MeshCost.op_overhead_s must be finite and >= 0, got {self.op_overhead_s!r}")

    @property
    def num_devices(self) -> int:
        return self.mesh_shape[0] * self.mesh_shape[1]

    def axis_alpha_s(self, axis: int) -> float:
        """Latency of one collective along ``axis``, or over the whole mesh (``WORLD_AXIS``)."""
        return _axis_link(self, axis, 0)[1]

    def flops_per_s(self, dtype: str | None = None) -> float:
        """Peak FLOP/s for ``dtype`` ('torch.' prefix allowed); ``peak_flops_per_s`` if None or unlisted."""
        if dtype is not None:
            key = str(dtype).removeprefix("torch.")
            for name, flops in self.peak_flops_by_dtype:
                if name == key:
                    return flops
        return self.peak_flops_per_s

    @classmethod
    def from_cluster(
        cls, cluster: Any, submesh: Any, logical_shape: Sequence[int], dtype: str = "float32"
    ) -> MeshCost:
        """Build from a cluster description (duck-typed, see ``alpa_torch`` Cluster).

        Uses ``cluster.device.flops_per_s(dtype)`` (and ``cluster.device.peak_flops``, the
        per-dtype table, if present),
        ``cluster.device.memory_bandwidth_bytes_per_s``,
        ``cluster.device.compute_efficiency``,
        ``cluster.mesh_axis_links(submesh, logical_shape)`` (two links with
        ``.alpha_s`` and ``.beta_s_per_byte``) and, if present,
        ``cluster.collective_beta_scale`` (``{"all_gather": 3.5, ...}``; keys
        are matched ignoring case and underscores) and, if present,
        ``cluster.device.op_overhead_s`` (one-device mesh) / ``sharded_op_overhead_s``;
        ``world`` when ``submesh`` holds ``cluster.num_devices`` devices.
        """
        shape = tuple(int(n) for n in logical_shape)
        links = tuple(cluster.mesh_axis_links(submesh, logical_shape))
        if len(shape) != 2 or len(links) != 2:
            raise ValueError(
                f"from_cluster needs a 2D logical shape and two axis links, got shape {shape} "
                f"and {len(links)} links; write a 1D mesh as (1, n)"
            )
        scales: dict[str, float] = {}
        for key, value in (getattr(cluster, "collective_beta_scale", None) or {}).items():
            field = _SCALE_FIELDS.get(str(key).lower().replace("_", "").replace("-", ""))
            if field is None:
                logger.debug("ignoring collective_beta_scale[%r]: no such collective in the cost model", key)
            else:
                scales[field] = float(value)
        device = cluster.device
        return cls(
            mesh_shape=shape,
            alpha_s=tuple(float(link.alpha_s) for link in links),
            beta_s_per_byte=tuple(float(link.beta_s_per_byte) for link in links),
            peak_flops_per_s=float(device.flops_per_s(dtype)),
            peak_flops_by_dtype=dict(getattr(device, "peak_flops", None) or {}),
            memory_bandwidth_bytes_per_s=float(device.memory_bandwidth_bytes_per_s),
            compute_efficiency=float(device.compute_efficiency),
            op_overhead_s=float(getattr(device, "op_overhead_s" if math.prod(shape) == 1
                                        else "sharded_op_overhead_s", 0.0)),
            world=_spans(submesh, getattr(cluster, "num_devices", None)),
            **scales,
        )


def _spans(submesh: Any, num_devices: Any) -> bool:
    """Whether ``submesh`` (a shape like ``(hosts, devices)``) holds all ``num_devices`` devices."""
    if not isinstance(submesh, (tuple, list)) or not all(isinstance(n, int) for n in submesh):
        return False
    return isinstance(num_devices, int) and math.prod(submesh) == num_devices


# ---------------------------------------------------------------- collectives


def _axis_link(mesh: MeshCost, axis: int, nbytes: float) -> tuple[int, float, float]:
    """(devices, α, β) of a collective along ``axis``; ``WORLD_AXIS``: over every device of
    the mesh, on the slower axis' link (a ring over every device crosses it)."""
    if axis not in (0, 1, WORLD_AXIS):
        raise ValueError(f"mesh axis must be 0 or 1, got {axis!r}")
    if nbytes < 0:
        raise ValueError(f"message size must be >= 0 bytes, got {nbytes!r}")
    if axis == WORLD_AXIS:
        return mesh.num_devices, max(mesh.alpha_s), max(mesh.beta_s_per_byte)
    return mesh.mesh_shape[axis], mesh.alpha_s[axis], mesh.beta_s_per_byte[axis]


def allreduce_s(mesh: MeshCost, axis: int, nbytes: float) -> float:
    """All-reduce of ``nbytes`` along ``axis``: α + 2β·b·(n−1)/n (Alpa, OSDI'22, §4.1 / mesh_profiling)."""
    n, alpha, beta = _axis_link(mesh, axis, nbytes)
    return 0.0 if n == 1 else alpha + 2 * beta * mesh.allreduce_beta_scale * nbytes * (n - 1) / n


def allgather_s(mesh: MeshCost, axis: int, nbytes: float) -> float:
    """All-gather to ``nbytes`` (gathered size) along ``axis``: α + β·b·(n−1)/n (Alpa §4.1)."""
    n, alpha, beta = _axis_link(mesh, axis, nbytes)
    return 0.0 if n == 1 else alpha + beta * mesh.allgather_beta_scale * nbytes * (n - 1) / n


def reducescatter_s(mesh: MeshCost, axis: int, nbytes: float) -> float:
    """Reduce-scatter of ``nbytes`` (input size) along ``axis``: α + β·b·(n−1)/n (Alpa §4.1)."""
    n, alpha, beta = _axis_link(mesh, axis, nbytes)
    return 0.0 if n == 1 else alpha + beta * mesh.reducescatter_beta_scale * nbytes * (n - 1) / n


def alltoall_s(mesh: MeshCost, axis: int, nbytes: float) -> float:
    """All-to-all of a tensor of ``nbytes`` across the group: α + β·b·(n−1)/n² (Alpa §4.1)."""
    n, alpha, beta = _axis_link(mesh, axis, nbytes)
    return 0.0 if n == 1 else alpha + beta * mesh.alltoall_beta_scale * nbytes * (n - 1) / (n * n)


def world_allreduce_s(mesh: MeshCost, nbytes: float) -> float:
    """All-reduce of ``nbytes`` over every device of the mesh: max α + 2 max β·b·(N−1)/N."""
    return allreduce_s(mesh, WORLD_AXIS, nbytes)


def world_allgather_s(mesh: MeshCost, nbytes: float) -> float:
    """All-gather to ``nbytes`` over every device of the mesh: max α + max β·b·(N−1)/N."""
    return allgather_s(mesh, WORLD_AXIS, nbytes)


def p2p_s(mesh: MeshCost, axis: int, nbytes: float) -> float:
    """Point-to-point send of ``nbytes`` between two devices along ``axis``: α + β·b."""
    n, alpha, beta = _axis_link(mesh, axis, nbytes)
    return 0.0 if n == 1 else alpha + beta * nbytes


def compute_s(mesh: MeshCost, flops: float, bytes_accessed: float, dtype: str | None = None) -> float:
    """Roofline time of one operator on one device (docs/design.md "Cost model").

    max(flops / (flops_per_s(dtype) × compute_efficiency), bytes_accessed / memory_bandwidth_bytes_per_s);
    ``dtype``: the operator's (output) dtype name, None for the mesh's default peak.
    """
    if flops < 0 or bytes_accessed < 0:
        raise ValueError(f"flops and bytes_accessed must be >= 0, got {flops!r}, {bytes_accessed!r}")
    return max(
        flops / (mesh.flops_per_s(dtype) * mesh.compute_efficiency),
        bytes_accessed / mesh.memory_bandwidth_bytes_per_s,
    )


def operator_s(mesh: MeshCost, flops: float, bytes_accessed: float, dtype: str | None = None, *,
               runs: bool = True) -> float:
    """Time of one operator execution on one device: ``compute_s`` + ``mesh.op_overhead_s``.

    ``runs=False`` for graph nodes the runtime does not execute as operators (``getitem``
    of a multi-output operator, the gradient markers): they cost nothing. A view runs (it
    is dispatched like any operator, DTensor included) and pays the overhead, though it
    moves no data. Every microbatch pays the overhead again: it does not shrink with the
    microbatch as FLOPs and bytes do (``stage_dp.search`` keeps it out of the 1/B scaling).
    """
    if not runs:
        return 0.0
    return compute_s(mesh, flops, bytes_accessed, dtype) + mesh.op_overhead_s


# ---------------------------------------------------------------- memory

State = tuple[Placement, ...]


def _placements(spec: ShardingSpec, mesh_shape: Sequence[int], tensor_ndim: int) -> State:
    """The spec's placements on the 2D mesh, validated.

    A 1-axis spec is accepted on a 1D mesh ``(1, n)`` / ``(n, 1)`` and lands on
    the axis of size n (the size-1 axis gets R).
    """
    placements = spec.placements
    if len(placements) == 1 and len(mesh_shape) == 2 and 1 in mesh_shape:
        placements = (placements[0], R) if mesh_shape[1] == 1 and mesh_shape[0] != 1 else (R, placements[0])
    ShardingSpec(placements).validate(tensor_ndim, mesh_shape)
    return placements


def _local_numel(state: State, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int:
    """Elements of the largest local shard (ceil chunks, as ``ShardingSpec.local_shape``)."""
    local = list(shape)
    for p, n in zip(state, mesh_shape):
        if p.kind == "S":
            local[p.dim] = -(-local[p.dim] // n)
    return math.prod(local)


def bytes_per_device(
    spec: ShardingSpec, global_shape: Sequence[int], itemsize: int, mesh_shape: Sequence[int]
) -> int:
    """Bytes of the largest local shard of a tensor in ``spec``.

    Ceil division per sharded dim, as ``ShardingSpec.local_shape``; a Partial
    placement does not shrink the tensor (each device holds a full-size summand).
    """
    shape, mesh = tuple(int(x) for x in global_shape), tuple(int(n) for n in mesh_shape)
    return _local_numel(_placements(spec, mesh, len(shape)), shape, mesh) * int(itemsize)


# ---------------------------------------------------------------- resharding


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """One single-axis step of a resharding sequence (for inspection and tests)."""

    axis: int
    """Mesh axis, or ``WORLD_AXIS``: every axis in one collective."""
    src: ShardingSpec
    dst: ShardingSpec
    collective: str  # all_reduce | all_gather | reduce_scatter | all_to_all | slice | zero | relabel
    nbytes: int
    cost_s: float


def _innermost(state: State, axis: int, dim: int) -> bool:
    """True if no axis after ``axis`` shards ``dim`` (placements nest left to right)."""
    return not any(p.kind == "S" and p.dim == dim for p in state[axis + 1 :])


def _steps_from(mesh: MeshCost, state: State, shape: tuple[int, ...], itemsize: int):
    """Yield ``(next_state, cost_s, collective, axis, nbytes)`` for every legal single-axis step."""
    targets = (R, P) + tuple(S(d) for d in range(len(shape)))
    for axis, n in enumerate(mesh.mesh_shape):
        cur = state[axis]
        # Size of the tensor as the n devices of this axis group see it together.
        group_bytes = _local_numel(state[:axis] + (R,) + state[axis + 1 :], shape, mesh.mesh_shape) * itemsize
        for new in targets:
            if new == cur:
                continue
            nxt = state[:axis] + (new,) + state[axis + 1 :]
            if n == 1:  # every placement is the same layout on a size-1 axis
                yield nxt, 0.0, "relabel", axis, 0
                continue
            if cur.kind == "S" and not _innermost(state, axis, cur.dim):
                continue
            if new.kind == "S" and not _innermost(state, axis, new.dim):
                continue
            if cur.kind == "R":
                yield nxt, 0.0, ("zero" if new.kind == "P" else "slice"), axis, 0
            elif cur.kind == "P" and new.kind == "R":
                yield nxt, allreduce_s(mesh, axis, group_bytes), "all_reduce", axis, group_bytes
            elif cur.kind == "P":
                yield nxt, reducescatter_s(mesh, axis, group_bytes), "reduce_scatter", axis, group_bytes
            elif new.kind == "R":
                yield nxt, allgather_s(mesh, axis, group_bytes), "all_gather", axis, group_bytes
            elif new.kind == "S":
                yield nxt, alltoall_s(mesh, axis, group_bytes), "all_to_all", axis, group_bytes
            # S -> P has no single step: it goes S -> R -> P.


@lru_cache(maxsize=8192)
def _shortest_from(mesh: MeshCost, src: State, shape: tuple[int, ...], itemsize: int):
    """Dijkstra from ``src`` over all specs of the tensor: (cost_s, back-pointers) per state.

    Internal and cached: callers must not mutate the returned dicts.
    """
    dist: dict[State, float] = {src: 0.0}
    back: dict[State, tuple[State, str, int, int, float]] = {}
    tie = itertools.count()
    heap = [(0.0, next(tie), src)]
    done: set[State] = set()
    while heap:
        cost, _, state = heapq.heappop(heap)
        if state in done:
            continue
        done.add(state)
        for nxt, step_s, collective, axis, nbytes in _steps_from(mesh, state, shape, itemsize):
            total = cost + step_s
            if total < dist.get(nxt, math.inf):
                dist[nxt] = total
                back[nxt] = (state, collective, axis, nbytes, step_s)
                heapq.heappush(heap, (total, next(tie), nxt))
    return dist, back


def _world_path(mesh: MeshCost, src: State, dst: State, shape: tuple[int, ...], itemsize: int) -> list | None:
    """The runtime's one-collective path from ``src`` to ``dst`` on a whole-cluster 2-D mesh
    (module docstring) as ``(prev, next, collective, axis, nbytes, cost_s)`` steps, or None where
    the runtime goes per axis: from ``P P`` to a spec without P, one all-reduce then local slices
    (on axis 0, then axis 1: placements nest left to right); from ``S(d) S(d)`` (``d`` split
    evenly) to ``R R``, one all-gather. The runtime takes these whenever they apply, so the
    model does too, cheaper or not than the per-axis path."""
    if not mesh.world or min(mesh.mesh_shape) == 1:
        return None
    nbytes = math.prod(shape) * itemsize
    rep = (R,) * len(src)
    if all(p.kind == "P" for p in src) and not any(p.kind == "P" for p in dst):
        steps = [(src, rep, "all_reduce", WORLD_AXIS, nbytes, world_allreduce_s(mesh, nbytes))]
        if dst[0] != R:
            steps.append((rep, (dst[0], R), "slice", 0, 0, 0.0))
        if dst[1] != R:
            steps.append(((dst[0], R), dst, "slice", 1, 0, 0.0))
        return steps
    if (dst == rep and all(p.kind == "S" for p in src) and len({p.dim for p in src}) == 1
            and shape[src[0].dim] % mesh.num_devices == 0):
        return [(src, rep, "all_gather", WORLD_AXIS, nbytes, world_allgather_s(mesh, nbytes))]
    return None


@lru_cache(maxsize=4096)
def _all_pairs(mesh: MeshCost, shape: tuple[int, ...], itemsize: int) -> tuple[dict[State, int], np.ndarray]:
    """``(index of each state, dist[from, to])``: the cheapest ``_steps_from`` sequence between
    every two states, Floyd-Warshall; one table for every source, not a Dijkstra per source
    (-8 % planning CPU on LLaMA-3-8B at 8x8). Internal and cached: the table is read-only."""
    kinds = (R, P) + tuple(S(d) for d in range(len(shape)))
    states = list(itertools.product(kinds, repeat=len(mesh.mesh_shape)))
    index = {state: i for i, state in enumerate(states)}
    dist = np.where(np.eye(len(states), dtype=bool), 0.0, np.inf)
    for i, state in enumerate(states):
        for nxt, step_s, *_ in _steps_from(mesh, state, shape, itemsize):
            dist[i, index[nxt]] = min(dist[i, index[nxt]], step_s)
    for k in range(len(states)):
        np.minimum(dist, dist[:, k, None] + dist[None, k, :], out=dist)
    dist.flags.writeable = False
    return index, dist


def _cost(mesh: MeshCost, src: State, dst: State, canonical: tuple) -> float:
    """``reshard_s`` between two states, ``canonical`` = ``_canonical(shape, itemsize, ...)``."""
    world = _world_path(mesh, src, dst, *canonical)
    if world is not None:
        return math.fsum(step[-1] for step in world)
    index, dist = _all_pairs(mesh, *canonical)
    return float(dist[index[src], index[dst]])


def _key(mesh: MeshCost, spec: ShardingSpec, shape: Sequence[int]) -> State:
    return _placements(spec, mesh.mesh_shape, len(shape))


def _canonical(shape: tuple[int, ...], itemsize: int, mesh_shape: tuple[int, int]) -> tuple[tuple[int, ...], int]:
    """A (shape, itemsize) with the same local shard bytes under every spec, shared by many tensors.

    A dim divisible by N = n0·n1 is cut exactly by every spec (each shard count
    divides N), so only the product of such dims (and the itemsize) matters:
    they become (N, ..., N, rest) with itemsize 1. Tensors of equal size then
    share one Dijkstra run: the "(spec, local size)" cache key.
    """
    full = mesh_shape[0] * mesh_shape[1]
    exact = [i for i, d in enumerate(shape) if d > 0 and d % full == 0]
    if not exact:
        return shape, itemsize
    out = list(shape)
    for i in exact[:-1]:
        out[i] = full
    out[exact[-1]] = math.prod(shape[i] for i in exact) * itemsize // full ** (len(exact) - 1)
    return tuple(out), 1


def reshard_s(
    mesh: MeshCost, src: ShardingSpec, dst: ShardingSpec, global_shape: Sequence[int], itemsize: int
) -> float:
    """Seconds to convert a tensor from ``src`` to ``dst`` on ``mesh`` (module docstring).

    The cheapest sequence of single-axis collectives / local slices (Alpa,
    OSDI'22, §4.1 resharding cost, with its alpha-beta collective model).
    """
    shape = tuple(int(x) for x in global_shape)
    return _cost(mesh, _key(mesh, src, shape), _key(mesh, dst, shape),
                 _canonical(shape, int(itemsize), mesh.mesh_shape))


def reshard_path(
    mesh: MeshCost, src: ShardingSpec, dst: ShardingSpec, global_shape: Sequence[int], itemsize: int
) -> tuple[ReshardStep, ...]:
    """The step sequence ``reshard_s`` prices, first step first (zero-cost relabels dropped)."""
    shape = tuple(int(x) for x in global_shape)
    src_state, state = _key(mesh, src, shape), _key(mesh, dst, shape)
    canonical = _canonical(shape, int(itemsize), mesh.mesh_shape)
    world = _world_path(mesh, src_state, state, *canonical)
    if world is not None:
        return tuple(ReshardStep(axis, ShardingSpec(a), ShardingSpec(b), collective, nbytes, cost)
                     for a, b, collective, axis, nbytes, cost in world)
    _, back = _shortest_from(mesh, src_state, *canonical)
    steps = []
    while state != src_state:
        prev, collective, axis, nbytes, step_s = back[state]
        if collective != "relabel":
            steps.append(ReshardStep(axis, ShardingSpec(prev), ShardingSpec(state), collective, nbytes, step_s))
        state = prev
    return tuple(reversed(steps))


@lru_cache(maxsize=4096)
def _matrix(mesh: MeshCost, srcs: tuple, dsts: tuple, shape: tuple[int, ...], itemsize: int) -> np.ndarray:
    src_states, dst_states = [_key(mesh, d, shape) for d in srcs], [_key(mesh, d, shape) for d in dsts]
    canonical = _canonical(shape, itemsize, mesh.mesh_shape)
    index, dist = _all_pairs(mesh, *canonical)
    out = dist[np.ix_([index[s] for s in src_states], [index[d] for d in dst_states])]
    if mesh.world and min(mesh.mesh_shape) > 1:  # the runtime's one-collective paths, where they apply
        for i, src in enumerate(src_states):
            if all(p.kind in ("P", "S") for p in src):
                for j, dst in enumerate(dst_states):
                    out[i, j] = _cost(mesh, src, dst, canonical)
    out.flags.writeable = False
    return out


def reshard_matrix_s(
    mesh: MeshCost,
    src_specs: Sequence[ShardingSpec],
    dst_specs: Sequence[ShardingSpec],
    shape: Sequence[int],
    itemsize: int,
) -> np.ndarray:
    """``out[i, j] = reshard_s(mesh, src_specs[i], dst_specs[j], shape, itemsize)``, float64.

    One shortest-path table per (mesh, canonical shape and itemsize, see
    ``_canonical``) for every source (``_all_pairs``); whole matrices are memoised too,
    so repeated edges (every layer of a transformer) cost a dict lookup.
    Returns a fresh writable array.
    """
    return _matrix(mesh, tuple(src_specs), tuple(dst_specs), tuple(int(x) for x in shape), int(itemsize)).copy()
