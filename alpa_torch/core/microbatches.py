"""How a batch splits into microbatches: which leaves are cut along dim 0, and where.

Every tensor leaf whose dim 0 is the batch size is cut along dim 0 into equal parts; 0-dim
tensors and leaves without the batch dimension (a mask shared by every sample) go whole to
every microbatch. The driver captures the step on one microbatch by this rule and the
runtime cuts every batch by it (``runtime.engine``).
"""

from __future__ import annotations

import torch

from .errors import BatchSplitError


def batch_size(shapes: list[tuple[int, ...]]) -> int | None:
    """The batch size: the most common dim 0 among tensor leaves of rank >= 1 (ties: the
    first leaf's), or None if every leaf is 0-dim."""
    firsts = [s[0] for s in shapes if len(s) >= 1]
    if not firsts:
        return None
    return max(dict.fromkeys(firsts), key=firsts.count)


def split_flags(shapes: list[tuple[int, ...]]) -> list[bool]:
    """Per tensor leaf: cut along dim 0 into microbatches (True), or given whole to every
    microbatch (0-dim, or dim 0 is not the batch size: a tensor shared by every sample)."""
    b = batch_size(shapes)
    return [len(s) >= 1 and s[0] == b for s in shapes]


def check_divisible(shapes: list[tuple[int, ...]], names: list[str], num_microbatches: int) -> None:
    """``BatchSplitError`` naming the first split leaf whose dim 0 does not divide into
    ``num_microbatches``."""
    for shape, name, split in zip(shapes, names, split_flags(shapes)):
        if split and shape[0] % num_microbatches:
            raise BatchSplitError(
                f"{name} of shape {tuple(shape)} does not split into {num_microbatches} microbatches along dim 0 "
                f"(the batch size); use a batch size divisible by {num_microbatches} or set num_microbatches")


def microbatch(tensors: list[torch.Tensor], num_microbatches: int, index: int = 0) -> list[torch.Tensor]:
    """Microbatch ``index`` of ``tensors`` (``split_flags`` decides which are cut)."""
    flags = split_flags([tuple(t.shape) for t in tensors])
    out = []
    for t, split in zip(tensors, flags):
        if split:
            size = t.shape[0] // num_microbatches
            t = t[index * size:(index + 1) * size]
        out.append(t)
    return out
