"""A step's loss where the plan leaves it partial over a mesh: what each device returns
(``device_part``, for ``StageRunner``) and how the driver adds the parts up (``total_loss``,
for ``engine.Engine.step``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from torch.distributed.tensor import DTensor

from .grad_buckets import plain_partial


class LossPart(NamedTuple):
    """One device's share of a loss the plan leaves partial over the mesh: the driver adds the
    ``value`` of every ``counted`` device (one per group of replicas) and divides by ``divisor``
    (the mesh axes that average), instead of an all-reduce at the end of every step."""

    value: float
    counted: bool
    divisor: int


def device_part(loss, mesh, replicate: Callable) -> float | LossPart:
    """The loss as the driver adds it up: this device's summand where it is a partial sum (or
    average) over ``mesh``, else its value (``replicate(loss)``: whole here, by a collective if
    need be)."""
    if not isinstance(loss, DTensor):
        return float(loss)
    placements = loss.placements
    if all(p.is_replicate() or (plain_partial(p) and p.reduce_op in ("sum", "avg")) for p in placements) \
            and any(p.is_partial() for p in placements):
        coords = mesh.get_coordinate()
        counted = all(c == 0 for c, p in zip(coords, placements) if p.is_replicate())
        divisor = math.prod(mesh.size(a) for a, p in enumerate(placements) if p.is_partial() and p.reduce_op == "avg")
        return LossPart(float(loss.to_local()), counted, divisor)
    return float(replicate(loss).to_local())


def total_loss(results: list) -> float:
    """The step's loss from every device's result (rank order): a float each, or ``LossPart``s
    added in rank order in float32, as the devices' all-reduce would."""
    if not isinstance(results[0], LossPart):
        return float(results[0])
    total = np.float32(0.0)
    for part in results:
        if part.counted:
            total += np.float32(part.value)
    return float(total / np.float32(results[0].divisor))


__all__ = ["LossPart", "device_part", "total_loss"]
