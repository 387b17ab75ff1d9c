"""Tensors across Ray: numpy arrays, with the dtypes numpy has no type for carried as raw bits.

Arrays cross Ray zero-copy as numpy (docs/design.md: a 16 MiB tensor pickles in 68 ms, the
numpy array is read in 12 ms), but numpy has no bfloat16, float8 or complex32: a tensor
of such a dtype travels as a ``Bits`` record (its bytes as a uint8 array, its dtype and
shape) and comes back as the same tensor, bit for bit. ``to_wire`` / ``from_wire`` are
the two directions; the driver and the workers use them for state, batches and results.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch


class Bits(NamedTuple):
    """A tensor numpy cannot hold: its bytes, its dtype's name and its shape."""

    data: np.ndarray
    dtype: str
    shape: tuple[int, ...]


def _numpy_has(dtype: torch.dtype) -> bool:
    try:
        torch.empty(0, dtype=dtype).numpy()
    except (TypeError, RuntimeError):
        return False
    return True


_NATIVE: dict[torch.dtype, bool] = {}


def to_wire(t: torch.Tensor) -> np.ndarray | Bits:
    """``t`` (any device) as a numpy array, or as ``Bits`` when numpy has no such dtype."""
    t = t.detach().cpu()
    native = _NATIVE.get(t.dtype)
    if native is None:
        native = _NATIVE[t.dtype] = _numpy_has(t.dtype)
    if native:
        return t.numpy()
    return Bits(t.contiguous().reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."),
                tuple(t.shape))


def from_wire(value: Any, copy: bool = False) -> torch.Tensor:
    """The tensor ``to_wire`` sent (CPU). It shares the array's memory unless ``copy`` is asked or the
    array is read-only (read zero-copy from Ray's object store): a tensor over read-only memory would
    be written by the first in-place operator."""
    data = value.data if isinstance(value, Bits) else value
    if isinstance(data, np.ndarray):
        t = torch.from_numpy(data.copy() if copy or not data.flags.writeable else data)
        return t.view(getattr(torch, value.dtype)).reshape(value.shape) if isinstance(value, Bits) else t
    return torch.as_tensor(value)


def to_wire_dict(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray | Bits]:
    return {k: to_wire(v) for k, v in tensors.items()}
