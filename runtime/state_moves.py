"""Moving state between two deployments on the same workers: each tile to the rank that needs it.

A training plan keeps each parameter on its stage's devices under one ``ShardingSpec``;
an evaluation planned for every device may want it under another. ``move`` gives each
rank its destination tiles straight from the ranks holding the source tiles
(``resharding.plan_transfer``: the same tile arithmetic as the pipeline's crossings,
where source and destination meshes may share devices), with point-to-point operations;
a box a rank sends itself is a local copy. Nothing goes through the driver.

Every rank calls ``move`` with the same moves in the same order and posts, for each
move, its sends before its receives, so the messages between two ranks are issued in
one order on both sides (NCCL matches point-to-point messages by order and ignores tags).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from alpa_torch.core.spec import ShardingSpec

from .comm import wire_tag
from .resharding import MeshPlacement, plan_transfer


@dataclass(frozen=True, slots=True)
class Move:
    """One tensor of the state: from ``src_spec`` on ``src_mesh`` to ``dst_spec`` on ``dst_mesh``."""

    name: str
    shape: tuple[int, ...]
    src_spec: str
    src_mesh: MeshPlacement
    dst_spec: str
    dst_mesh: MeshPlacement


def move(moves: list[Move], held: dict[str, torch.Tensor | DTensor], device: torch.device,
         dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """This rank's destination tile of each move (local tensors; only moves whose destination mesh
    holds this rank), from ``held`` (name -> this rank's source value, for moves whose source mesh
    holds it)."""
    me = dist.get_rank()
    out = {}
    for tag, mv in enumerate(moves):
        plan = plan_transfer(mv.shape, ShardingSpec.parse(mv.src_spec), mv.src_mesh, ShardingSpec.parse(mv.dst_spec),
                             mv.dst_mesh, itemsize_bytes=0)
        sends, local = [], {}
        if me in mv.src_mesh.devices:
            value = held[mv.name]
            tile_value = value.to_local() if isinstance(value, DTensor) else value
            src_tile = plan.src_tile(me)
            for t in plan.transfers_from(me):
                piece = tile_value[t.box.relative_to(src_tile)]
                if t.is_local:
                    local[t.box] = piece
                else:
                    piece = piece.contiguous()
                    sends.append((dist.isend(piece, t.dst_device, tag=wire_tag(tag)), piece))
        if me in mv.dst_mesh.devices:
            dst_tile = plan.dst_tile(me)
            tile = torch.empty(dst_tile.shape, dtype=dtypes[mv.name], device=device)
            pending = []
            for t in plan.transfers_to(me):
                if t.is_local:
                    tile[t.box.relative_to(dst_tile)] = local[t.box]
                else:
                    buf = torch.empty(t.box.shape, dtype=tile.dtype, device=device)
                    pending.append((dist.irecv(buf, t.src_device, tag=wire_tag(tag)), buf, t.box))
            for work, buf, box in pending:
                work.wait()
                tile[box.relative_to(dst_tile)] = buf
            out[mv.name] = tile
        for work, _ in sends:
            work.wait()
    return out


def as_dtensor(local: torch.Tensor, shape: tuple[int, ...], spec: str, device_mesh) -> DTensor:
    """``local``, this rank's tile of a tensor of ``shape`` placed as ``spec`` on ``device_mesh``."""
    from alpa_torch.core.spec import to_dtensor_placements

    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, device_mesh, to_dtensor_placements(ShardingSpec.parse(spec)), run_check=False,
                              shape=torch.Size(shape), stride=stride)
