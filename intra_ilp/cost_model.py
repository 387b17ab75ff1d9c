"""Cost model of the intra-op ILP: compute, collectives, memory.

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

Resharding (the cheapest sequence of collectives between two specs, the
α-β prices above) is ``reshard_paths.py``'s.

Memory: ``bytes_per_device`` is the largest local shard (ceil chunks, as
``ShardingSpec.local_shape``); a Partial placement holds a full-size summand.

No module state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from alpa_torch.core.spec import Placement, R, ShardingSpec

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


def mesh_placements(spec: ShardingSpec, mesh_shape: Sequence[int], tensor_ndim: int) -> State:
    """The spec's placements on the 2D mesh, validated.

    A 1-axis spec is accepted on a 1D mesh ``(1, n)`` / ``(n, 1)`` and lands on
    the axis of size n (the size-1 axis gets R).
    """
    placements = spec.placements
    if len(placements) == 1 and len(mesh_shape) == 2 and 1 in mesh_shape:
        placements = (placements[0], R) if mesh_shape[1] == 1 and mesh_shape[0] != 1 else (R, placements[0])
    ShardingSpec(placements).validate(tensor_ndim, mesh_shape)
    return placements


def local_numel(state: State, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int:
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
    return local_numel(mesh_placements(spec, mesh, len(shape)), shape, mesh) * int(itemsize)
