"""Sharding specs: how one tensor is laid out on a 1D or 2D logical mesh.

A ``ShardingSpec`` holds one ``Placement`` per mesh axis:

- ``R``     replicate: every device along the axis holds the whole tensor,
- ``S(d)``  shard tensor dim ``d`` evenly-ish along the axis (``torch.chunk``
            semantics, the same as DTensor: chunk size ``ceil(n / k)``, the last
            chunks may be smaller or empty),
- ``P``     partial sum: every device holds a summand; the tensor is their sum.

Placements apply left to right over the mesh axes, exactly as in DTensor: with
``S(0)S(0)`` on a 2x4 mesh, dim 0 is first chunked in 2 along axis 0 and each
chunk again in 4 along axis 1.

This module is pure Python: no torch.distributed, so specs can be built,
hashed, printed and compared in the planner. ``runtime`` converts them to
DTensor placements.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    """One mesh axis of a spec: kind 'R', 'S' (with ``dim``) or 'P'."""

    kind: str
    dim: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("R", "S", "P"):
            raise ValueError(f"placement kind must be 'R', 'S' or 'P', got {self.kind!r}")
        if (self.kind == "S") != (self.dim is not None):
            raise ValueError(f"only 'S' carries a dim, got kind={self.kind!r} dim={self.dim!r}")

    def __repr__(self) -> str:
        return f"S({self.dim})" if self.kind == "S" else self.kind

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    @property
    def is_partial(self) -> bool:
        return self.kind == "P"

    @property
    def is_replicate(self) -> bool:
        return self.kind == "R"


R = Placement("R")
P = Placement("P")


def S(dim: int) -> Placement:
    """Shard tensor dim ``dim`` along a mesh axis."""
    return Placement("S", dim)


_TOKEN = re.compile(r"R|P|S\((\d+)\)")


@dataclass(frozen=True, slots=True)
class ShardingSpec:
    """Placement of one tensor on a logical mesh: one ``Placement`` per mesh axis."""

    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        if not self.placements:
            raise ValueError("a ShardingSpec needs at least one mesh axis")

    def __repr__(self) -> str:
        return "".join(repr(p) for p in self.placements)

    __str__ = __repr__

    @staticmethod
    def parse(text: str) -> ShardingSpec:
        """Inverse of ``repr``: ``ShardingSpec.parse('S(0)R')``."""
        pos, out = 0, []
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                raise ValueError(f"cannot parse sharding spec {text!r} at position {pos}")
            out.append(S(int(m.group(1))) if m.group(1) is not None else Placement(m.group(0)))
            pos = m.end()
        return ShardingSpec(tuple(out))

    @staticmethod
    def replicated(mesh_ndim: int) -> ShardingSpec:
        return ShardingSpec((R,) * mesh_ndim)

    @property
    def mesh_ndim(self) -> int:
        return len(self.placements)

    @property
    def is_replicated(self) -> bool:
        return all(p.is_replicate for p in self.placements)

    @property
    def has_partial(self) -> bool:
        return any(p.is_partial for p in self.placements)

    def shard_count(self, mesh_shape: Sequence[int], dim: int) -> int:
        """How many pieces tensor dim ``dim`` is cut into."""
        return math.prod(n for p, n in zip(self.placements, mesh_shape) if p.is_shard and p.dim == dim)

    def local_shape(self, global_shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, ...]:
        """The largest local shard shape (the one device 0 holds)."""
        shape = list(global_shape)
        for p, n in zip(self.placements, mesh_shape):
            if p.is_shard:
                shape[p.dim] = -(-shape[p.dim] // n)  # ceil, torch.chunk semantics
        return tuple(shape)

    def local_numel(self, global_shape: Sequence[int], mesh_shape: Sequence[int]) -> int:
        return math.prod(self.local_shape(global_shape, mesh_shape))

    def validate(self, tensor_ndim: int, mesh_shape: Sequence[int]) -> None:
        """Raise ValueError if this spec cannot describe a tensor of rank ``tensor_ndim``."""
        if len(mesh_shape) != self.mesh_ndim:
            raise ValueError(f"spec {self} has {self.mesh_ndim} mesh axes, mesh {tuple(mesh_shape)} "
                             f"has {len(mesh_shape)}")
        for p in self.placements:
            if p.is_shard and not 0 <= p.dim < tensor_ndim:
                raise ValueError(f"spec {self} shards dim {p.dim} of a rank-{tensor_ndim} tensor")

    def local_slices(
        self, global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int]
    ) -> tuple[slice, ...]:
        """The global index range (one slice per dim) held by the device at mesh ``coord``.

        Partial placements hold a summand of the full range, so they do not
        narrow the slice.
        """
        bounds = [(0, n) for n in global_shape]
        for p, n, c in zip(self.placements, mesh_shape, coord):
            if not p.is_shard:
                continue
            lo, hi = bounds[p.dim]
            bounds[p.dim] = chunk_bounds(lo, hi, n, c)
        return tuple(slice(lo, hi) for lo, hi in bounds)


def chunk_bounds(lo: int, hi: int, parts: int, index: int) -> tuple[int, int]:
    """Bounds of piece ``index`` when [lo, hi) is cut like ``torch.chunk(parts)``.

    ``torch.chunk`` uses pieces of ``ceil(n / parts)``; trailing pieces may be
    short or empty (DTensor's ``Shard`` follows the same rule).
    """
    size = -(-(hi - lo) // parts) if hi > lo else 0
    start = min(lo + index * size, hi)
    return start, min(start + size, hi)


def all_specs(tensor_ndim: int, mesh_ndim: int, allow_partial: bool = False) -> list[ShardingSpec]:
    """Every spec of a rank-``tensor_ndim`` tensor on a mesh of ``mesh_ndim`` axes."""
    options: list[Placement] = [R] + [S(d) for d in range(tensor_ndim)]
    if allow_partial:
        options.append(P)
    specs = [()]  # type: list[tuple[Placement, ...]]
    for _ in range(mesh_ndim):
        specs = [s + (p,) for s in specs for p in options]
    return [ShardingSpec(s) for s in specs]




def to_dtensor_placements(spec: ShardingSpec) -> tuple:
    from torch.distributed.tensor import Partial, Replicate, Shard

    return tuple(
        Shard(p.dim) if p.is_shard else Partial() if p.is_partial else Replicate() for p in spec.placements
    )


def from_dtensor_placements(placements) -> ShardingSpec | None:
    """Our spec of DTensor placements; None when ``ShardingSpec`` cannot say it.

    Only plain ``Shard``, ``Replicate`` and ``Partial`` of a sum or a mean map.
    A mean (``Partial('avg')``: a mean-reduced loss over a sharded batch) is
    priced as ``P``: it reduces with the same collectives as a sum, and the
    runtime keeps DTensor's own reduce op for a value already partial. A view
    that flattens a sharded inner dim yields ``_StridedShard`` (a strided, not a
    contiguous, chunk) and ``amax`` a ``Partial('max')``; reading those as
    ``S(d)``, ``R`` or ``P`` would price and run a wrong layout, so strategies
    using them are dropped.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = []
    for p in placements:
        if type(p) is Shard:
            out.append(S(p.dim))
        elif isinstance(p, Partial) and p.reduce_op in ("sum", "avg"):
            out.append(P)
        elif isinstance(p, Replicate):
            out.append(R)
        else:
            return None
    return ShardingSpec(tuple(out))
