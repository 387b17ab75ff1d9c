"""Moves DTensor values between stages: the communication half of resharding.

``resharding.plan_transfer`` says which box of the tensor each destination
device receives from which source device (pure tile arithmetic); this module
sends those boxes with non-blocking point-to-point operations and assembles
each destination device's shard. Both sides compute the same plan from the
same specs, so no metadata travels. Tags make every message unique
(crossing index, microbatch), so the order in which sends and receives are
posted cannot deadlock on gloo; NCCL ignores tags, and ``ALPA_TORCH_P2P_TAGS=0``
(``wire_tag``) runs a plan as NCCL would match its messages: by the order of
posting alone.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from alpa_torch.core.spec import ShardingSpec

from .devices import mesh_device
from .resharding import MeshPlacement, plan_transfer
from .switches import P2P_TAGS_ENV, switch_on

_TAG_STRIDE = 1 << 12  # microbatches per crossing
_TAGS = switch_on(P2P_TAGS_ENV)


def wire_tag(tag: int) -> int:
    """The tag a message carries: its own, or 0 under ``ALPA_TORCH_P2P_TAGS=0`` (``switches.py``)."""
    return tag if _TAGS else 0


def mesh_placement(ranks, shape) -> MeshPlacement:
    return MeshPlacement(tuple(shape), tuple(ranks))


_GATHER_TAG = 1 << 29


@cache
def _plan(shape, src_spec: str, src_mesh: MeshPlacement, dst_spec: str, dst_mesh: MeshPlacement,
          gather: bool = False):
    return plan_transfer(shape, ShardingSpec.parse(src_spec), src_mesh, ShardingSpec.parse(dst_spec), dst_mesh,
                         allow_dst_gather=gather)


def prefer_dst_gather(shape, src_spec: str, src_mesh, dst_spec: str, dst_mesh, itemsize: int,
                      cross_beta_s: float, local_beta_s: float) -> bool:
    """Alpa's local all-gather: send each box across once and complete the
    replicas inside the destination mesh, when that moves fewer seconds of bytes."""
    direct = _plan(tuple(shape), src_spec, src_mesh, dst_spec, dst_mesh, False)
    gathered = _plan(tuple(shape), src_spec, src_mesh, dst_spec, dst_mesh, True)
    direct_s = direct.cross_bytes * cross_beta_s
    gathered_s = gathered.cross_bytes * cross_beta_s + gathered.local_gather_bytes * local_beta_s
    return itemsize > 0 and gathered_s < direct_s


def _no_partial(value: DTensor) -> DTensor:
    if any(p.is_partial() for p in value.placements):
        placements = tuple(Replicate() if p.is_partial() else p for p in value.placements)
        value = value.redistribute(value.device_mesh, placements)
    return value


def _spec_of(value: DTensor) -> str:
    from alpa_torch.core.spec import from_dtensor_placements

    return str(from_dtensor_placements(value.placements))


def send(value: DTensor | torch.Tensor, dst_spec: str, src_mesh: MeshPlacement, dst_mesh: MeshPlacement, tag: int,
         gather: bool = False) -> list:
    """Post the sends of this device's boxes of ``value``; returns the pending works.

    Partial placements are reduced on the source mesh first (collective among its devices).
    A plain tensor is a value replicated on the source mesh (a one-device stage runs without DTensor)."""
    if isinstance(value, DTensor):
        value = _no_partial(value)
        spec, local = _spec_of(value), value.to_local()
    else:
        spec, local = "R" * len(src_mesh.shape), value
    shape = tuple(value.shape)
    plan = _plan(shape, spec, src_mesh, dst_spec, dst_mesh, gather)
    me = dist.get_rank()
    tile = plan.src_tile(me)
    works = []
    for t in plan.transfers_from(me):
        piece = local[t.box.relative_to(tile)].contiguous()
        works.append((dist.isend(piece, t.dst_device, tag=wire_tag(tag)), piece))
    return works


def recv(shape, dtype, src_spec: str, dst_spec: str, src_mesh: MeshPlacement, dst_mesh: MeshPlacement,
         device_mesh, tag: int, gather: bool = False, dtensor: bool = True) -> DTensor | torch.Tensor:
    """Receive this device's shard of a value sent with ``send``; returns it as a DTensor, or with
    ``dtensor=False`` the local shard alone (what a runner on one device, or replaying, reads:
    wrapping it costs as much CPU as the transfer itself)."""
    from alpa_torch.core.spec import to_dtensor_placements

    shape = tuple(shape)
    plan = _plan(shape, src_spec, src_mesh, dst_spec, dst_mesh, gather)
    me = dist.get_rank()
    tile = plan.dst_tile(me)
    device = mesh_device(device_mesh)
    local = torch.empty(tile.shape, dtype=dtype, device=device)
    pending = []
    for t in plan.transfers_to(me):
        buf = torch.empty(t.box.shape, dtype=dtype, device=device)
        pending.append((dist.irecv(buf, t.src_device, tag=wire_tag(tag)), buf, t.box))
    for work, buf, box in pending:
        work.wait()
        local[box.relative_to(tile)] = buf
    _gather_within_destination(plan, me, tile, local, tag + _GATHER_TAG)
    if not dtensor:
        return local
    placements = to_dtensor_placements(ShardingSpec.parse(dst_spec))
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, device_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def _gather_within_destination(plan, me: int, tile, local: torch.Tensor, tag: int) -> None:
    """Complete this device's tile from the pieces its destination group received."""
    sends, recvs = [], []
    for g in plan.gathers:
        if me not in g.devices:
            continue
        mine = g.pieces[g.devices.index(me)]
        piece = local[mine.relative_to(tile)].contiguous()
        for device, box in zip(g.devices, g.pieces):
            if device == me:
                continue
            if mine.numel:
                sends.append((dist.isend(piece, device, tag=wire_tag(tag)), piece))
            if box.numel:
                buf = torch.empty(box.shape, dtype=local.dtype, device=local.device)
                recvs.append((dist.irecv(buf, device, tag=wire_tag(tag)), buf, box))
    for work, buf, box in recvs:
        work.wait()
        local[box.relative_to(tile)] = buf
    for work, _ in sends:
        work.wait()


def make_tag(crossing_index: int, microbatch: int) -> int:
    return crossing_index * _TAG_STRIDE + microbatch
