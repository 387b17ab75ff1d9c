"""A step's loss where the plan leaves it partial over a mesh: what each device returns
(``StageRunner._loss_out``) and how the driver adds the parts up (``engine.Engine.step``)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class LossPart(NamedTuple):
    """One device's share of a loss the plan leaves partial over the mesh: the driver adds the
    ``value`` of every ``counted`` device (one per group of replicas) and divides by ``divisor``
    (the mesh axes that average), instead of an all-reduce at the end of every step."""

    value: float
    counted: bool
    divisor: int


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


__all__ = ["LossPart", "total_loss"]
