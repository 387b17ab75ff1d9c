"""Cross-mesh resharding as tile arithmetic: which box of a tensor goes where.

A tensor lives on a source mesh under one ``ShardingSpec`` and must end up on
a destination mesh (other devices, or the same ones) under another. Every
device holds one *tile*: the global index box ``ShardingSpec.local_slices``
gives it. This module plans the move; ``runtime/comm.py`` executes it. Pure
Python plus torch only for the reference executor: no torch.distributed.

The plan (Alpa §5, "cross-mesh resharding"):

- Distinct non-empty source tiles partition the tensor (replicas hold equal
  tiles). For each destination tile ``T`` and each source tile ``U`` the
  box ``T ∩ U`` is needed; it is sent once, from ONE replica holding ``U``:
  the destination device itself if it holds ``U`` (a local copy), else the
  least-loaded replica so far (round-robin when boxes are equal).
- ``allow_dst_gather=True`` (Alpa's local all-gather): destination devices
  that differ only along replicated destination mesh axes hold the same
  tile. Each needed box then crosses once, cut into ``n`` pieces along its
  largest dim, piece ``i`` to group member ``i``; a ``Gather`` step
  all-gathers the pieces inside the destination mesh. Cross-mesh bytes drop
  from ``n·|box|`` to ``|box|``; the all-gather adds ``(n − 1)·|box|`` of
  local traffic. Both counts are on the plan (``cross_bytes``,
  ``local_gather_bytes``) so a cost model can choose.

Partial (``P``) placements are refused on either side: reduce first.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from alpa_torch.core.spec import ShardingSpec, chunk_bounds


@dataclass(frozen=True, slots=True)
class MeshPlacement:
    """A logical device mesh: its shape and the global device ids laid out row-major on it."""

    shape: tuple[int, ...]
    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
        if not self.shape or any(n < 1 for n in self.shape):
            raise ValueError(f"mesh shape must be non-empty with positive sizes, got {self.shape}")
        if len(self.devices) != math.prod(self.shape) or len(set(self.devices)) != len(self.devices):
            raise ValueError(
                f"mesh {self.shape} needs {math.prod(self.shape)} distinct device ids, got {self.devices}")

    @staticmethod
    def contiguous(shape: Sequence[int], first_device: int = 0) -> MeshPlacement:
        """Mesh of ``shape`` over devices ``first_device, first_device + 1, ...``."""
        return MeshPlacement(tuple(shape), tuple(range(first_device, first_device + math.prod(shape))))

    def __repr__(self) -> str:
        return f"Mesh({'x'.join(map(str, self.shape))}:{','.join(map(str, self.devices))})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def coord(self, device: int) -> tuple[int, ...]:
        """Mesh coordinate of ``device`` (row-major)."""
        try:
            flat = self.devices.index(device)
        except ValueError:
            raise ValueError(f"device {device} is not in {self}") from None
        coord = []
        for n in reversed(self.shape):
            flat, c = divmod(flat, n)
            coord.append(c)
        return tuple(reversed(coord))


@dataclass(frozen=True, slots=True)
class Box:
    """A half-open global index box ``[lo, hi)`` per tensor dim."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @staticmethod
    def from_slices(slices: Sequence[slice]) -> Box:
        return Box(tuple(s.start for s in slices), tuple(s.stop for s in slices))

    def __repr__(self) -> str:
        return "[" + ",".join(f"{a}:{b}" for a, b in zip(self.lo, self.hi)) + "]"

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in zip(self.lo, self.hi))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(max(b - a, 0) for a, b in zip(self.lo, self.hi))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_empty(self) -> bool:
        return self.numel == 0

    def intersect(self, other: Box) -> Box:
        lo = tuple(max(a, b) for a, b in zip(self.lo, other.lo))
        hi = tuple(max(min(a, b), l) for a, b, l in zip(self.hi, other.hi, lo))
        return Box(lo, hi)

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """This box as local slices of a tensor holding ``outer``."""
        return tuple(slice(a - o, b - o) for a, b, o in zip(self.lo, self.hi, outer.lo))

    def split(self, parts: int, index: int) -> Box:
        """Piece ``index`` of ``parts`` along the largest dim (``torch.chunk`` rule; may be empty)."""
        dim = max(range(len(self.shape)), key=lambda d: (self.shape[d], -d))
        lo, hi = chunk_bounds(self.lo[dim], self.hi[dim], parts, index)
        return Box(self.lo[:dim] + (lo,) + self.lo[dim + 1:], self.hi[:dim] + (hi,) + self.hi[dim + 1:])


@dataclass(frozen=True, slots=True)
class Transfer:
    """Copy ``box`` from ``src_device``'s tile to ``dst_device``'s tile (local copy if equal)."""

    src_device: int
    dst_device: int
    box: Box

    def __repr__(self) -> str:
        return f"{self.src_device}->{self.dst_device}{self.box}"

    @property
    def is_local(self) -> bool:
        return self.src_device == self.dst_device


@dataclass(frozen=True, slots=True)
class Gather:
    """All-gather inside the destination mesh: ``devices[i]`` holds ``pieces[i]``; afterwards all hold ``box``."""

    devices: tuple[int, ...]
    box: Box
    pieces: tuple[Box, ...]

    def __repr__(self) -> str:
        return f"gather{{{','.join(map(str, self.devices))}}}{self.box}"

    @property
    def numel_moved(self) -> int:
        """Elements received over all members: (n - 1)·|box|."""
        return sum(self.box.numel - p.numel for p in self.pieces)


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Everything one resharding does: cross/local transfers first, then gathers."""

    global_shape: tuple[int, ...]
    src_spec: ShardingSpec
    src_mesh: MeshPlacement
    dst_spec: ShardingSpec
    dst_mesh: MeshPlacement
    transfers: tuple[Transfer, ...]
    gathers: tuple[Gather, ...] = ()
    itemsize_bytes: int = 4

    def __repr__(self) -> str:
        return (f"TransferPlan({self.src_spec}@{self.src_mesh} -> {self.dst_spec}@{self.dst_mesh}, "
                f"{len(self.transfers)} transfers, {len(self.gathers)} gathers, "
                f"cross_bytes={self.cross_bytes}, local_gather_bytes={self.local_gather_bytes})")

    @property
    def cross_bytes(self) -> int:
        """Bytes sent between different devices by the transfers (local copies excluded)."""
        return self.itemsize_bytes * sum(t.box.numel for t in self.transfers if not t.is_local)

    @property
    def local_gather_bytes(self) -> int:
        """Bytes the destination-mesh all-gathers move."""
        return self.itemsize_bytes * sum(g.numel_moved for g in self.gathers)

    def transfers_to(self, device: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst_device == device]

    def transfers_from(self, device: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src_device == device]

    def src_tile(self, device: int) -> Box:
        return _box_of(self.src_spec, self.global_shape, self.src_mesh, device)

    def dst_tile(self, device: int) -> Box:
        return _box_of(self.dst_spec, self.global_shape, self.dst_mesh, device)

    def table(self) -> str:
        """Human-readable listing, one line per destination device."""
        lines = [repr(self)]
        for d in self.dst_mesh.devices:
            lines.append(f"  dev {d} {self.dst_tile(d)}: " + " ".join(map(repr, self.transfers_to(d))))
        lines += [f"  {g}" for g in self.gathers]
        return "\n".join(lines)


def tile_of(spec: ShardingSpec, global_shape: Sequence[int], mesh: MeshPlacement, device: int) -> tuple[slice, ...]:
    """The global index box (one slice per dim) that ``device`` holds under ``spec`` on ``mesh``."""
    return spec.local_slices(tuple(global_shape), mesh.shape, mesh.coord(device))


def _box_of(spec: ShardingSpec, global_shape: Sequence[int], mesh: MeshPlacement, device: int) -> Box:
    return Box.from_slices(tile_of(spec, global_shape, mesh, device))


def _check(global_shape: Sequence[int], spec: ShardingSpec, mesh: MeshPlacement, side: str) -> None:
    if any(n < 0 for n in global_shape):
        raise ValueError(f"global shape must be non-negative, got {tuple(global_shape)}")
    spec.validate(len(global_shape), mesh.shape)
    if spec.has_partial:
        raise ValueError(
            f"{side} spec {spec} has a Partial placement: reduce before resharding "
            "(all-reduce or reduce-scatter on its mesh, then reshard the result)")


def _source_groups(
    global_shape: Sequence[int], spec: ShardingSpec, mesh: MeshPlacement
) -> list[tuple[Box, tuple[int, ...]]]:
    """Distinct non-empty source tiles, each with the devices that hold it (in mesh order)."""
    groups: dict[Box, list[int]] = {}
    for d in mesh.devices:
        box = _box_of(spec, global_shape, mesh, d)
        if not box.is_empty:
            groups.setdefault(box, []).append(d)
    return [(box, tuple(devs)) for box, devs in groups.items()]


def _destination_groups(
    global_shape: Sequence[int], spec: ShardingSpec, mesh: MeshPlacement, gather_axes: Iterable[int]
) -> list[tuple[Box, tuple[int, ...]]]:
    """Destination devices grouped so that members differ only along replicated ``gather_axes``.

    Members hold identical tiles; groups of one device when ``gather_axes`` is empty.
    """
    axes = {a for a in gather_axes if spec.placements[a].is_replicate}
    groups: dict[tuple[int, ...], list[int]] = {}
    for d in mesh.devices:
        coord = mesh.coord(d)
        key = tuple(c for a, c in enumerate(coord) if a not in axes)
        groups.setdefault(key, []).append(d)
    out = []
    for devs in groups.values():
        tile = _box_of(spec, global_shape, mesh, devs[0])
        if not tile.is_empty:
            out.append((tile, tuple(devs)))
    return out


def _pick_source(replicas: tuple[int, ...], dst: int, load: Counter) -> int:
    """The destination itself if it holds the box, else the least-loaded replica (ties: mesh order)."""
    if dst in replicas:
        return dst
    return min(replicas, key=lambda d: load[d])


def plan_transfer(
    global_shape: Sequence[int],
    src_spec: ShardingSpec,
    src_mesh: MeshPlacement,
    dst_spec: ShardingSpec,
    dst_mesh: MeshPlacement,
    *,
    allow_dst_gather: bool = False,
    gather_axes: Sequence[int] | None = None,
    itemsize_bytes: int = 4,
) -> TransferPlan:
    """Plan moving a tensor from ``src_spec`` on ``src_mesh`` to ``dst_spec`` on ``dst_mesh``.

    Every destination tile is covered exactly once by the boxes it receives
    (plus, with ``allow_dst_gather``, the pieces its group all-gathers).
    ``gather_axes`` limits the all-gather to some destination mesh axes
    (default: every axis the destination replicates along).
    """
    global_shape = tuple(int(n) for n in global_shape)
    _check(global_shape, src_spec, src_mesh, "source")
    _check(global_shape, dst_spec, dst_mesh, "destination")
    axes = range(dst_mesh.ndim) if gather_axes is None else gather_axes
    if any(not 0 <= a < dst_mesh.ndim for a in axes):
        raise ValueError(f"gather_axes {tuple(axes)} out of range for {dst_mesh}")
    sources = _source_groups(global_shape, src_spec, src_mesh)
    load: Counter = Counter()  # elements each source device has sent across so far
    transfers: list[Transfer] = []
    gathers: list[Gather] = []
    for tile, members in _destination_groups(global_shape, dst_spec, dst_mesh, axes if allow_dst_gather else ()):
        for src_tile, replicas in sources:
            box = tile.intersect(src_tile)
            if box.is_empty:
                continue
            n = len(members) if box.shape else 1  # a 0-d box cannot be cut: no gather
            pieces = [box.split(n, i) for i in range(n)] if n > 1 else [box] * len(members)
            if n > 1:
                gathers.append(Gather(members, box, tuple(pieces)))
            for member, piece in zip(members, pieces):
                if piece.is_empty:
                    continue
                src = _pick_source(replicas, member, load)
                if src != member:
                    load[src] += piece.numel
                transfers.append(Transfer(src, member, piece))
    return TransferPlan(global_shape, src_spec, src_mesh, dst_spec, dst_mesh, tuple(transfers), tuple(gathers),
                        itemsize_bytes)


def plan_candidates(
    global_shape: Sequence[int],
    src_spec: ShardingSpec,
    src_mesh: MeshPlacement,
    dst_spec: ShardingSpec,
    dst_mesh: MeshPlacement,
    itemsize_bytes: int = 4,
) -> tuple[TransferPlan, TransferPlan]:
    """(direct plan, local-all-gather plan): compare their ``cross_bytes`` / ``local_gather_bytes``."""
    args = (global_shape, src_spec, src_mesh, dst_spec, dst_mesh)
    return (plan_transfer(*args, itemsize_bytes=itemsize_bytes),
            plan_transfer(*args, allow_dst_gather=True, itemsize_bytes=itemsize_bytes))


def apply_plan_locally(plan: TransferPlan, full_tensor: torch.Tensor) -> dict[int, torch.Tensor]:
    """Reference executor on one process: the tile every destination device ends with.

    Source tiles are cut from ``full_tensor``; transfers copy boxes between
    tiles, then gathers copy each member's piece to the rest of its group.
    Raises AssertionError if any destination element is written other than once.
    """
    if tuple(full_tensor.shape) != plan.global_shape:
        raise ValueError(f"tensor shape {tuple(full_tensor.shape)} != plan's global shape {plan.global_shape}")
    src_local = {d: full_tensor[plan.src_tile(d).slices].clone() for d in plan.src_mesh.devices}
    tiles = {d: plan.dst_tile(d) for d in plan.dst_mesh.devices}
    out = {d: torch.empty(tile.shape, dtype=full_tensor.dtype) for d, tile in tiles.items()}
    writes = {d: torch.zeros(tile.shape, dtype=torch.int32) for d, tile in tiles.items()}

    def write(dst: int, box: Box, data: torch.Tensor) -> None:
        out[dst][box.relative_to(tiles[dst])] = data
        writes[dst][box.relative_to(tiles[dst])] += 1

    for t in plan.transfers:
        write(t.dst_device, t.box, src_local[t.src_device][t.box.relative_to(plan.src_tile(t.src_device))])
    for g in plan.gathers:
        for owner, piece in zip(g.devices, g.pieces):
            data = out[owner][piece.relative_to(tiles[owner])].clone()
            for member in g.devices:
                if member != owner and not piece.is_empty:
                    write(member, piece, data)
    for d, count in writes.items():
        if count.numel() and not bool((count == 1).all()):
            raise AssertionError(
                f"device {d}: tile {tiles[d]} written {count.min()}..{count.max()} times per element")
    return out
