"""Operator clustering into layers (Alpa OSDI'22 §5.2), exact DP.

Owns: cutting a topologically ordered op sequence (n ops) into ``num_layers``
contiguous layers for the stage DP. Does not own: the op graph (captured by
``alpa_torch.capture``) or what a layer is used for (``stage_dp.dp``).

Layer [a, b) holds ops a..b-1. With prefix FLOPs P (``np.cumsum``, P[0] = 0):

    F(a, b) = P[b] - P[a]                                  layer FLOPs
    C(a, b) = sum of bytes of edges u -> v, u < a <= v < b  bytes entering it
    cap     = (1 + imbalance) * P[n] / num_layers
    floor   = max(0, 1 - imbalance) * P[n] / num_layers

Objective, lexicographic over plans with every floor <= F(a, b) <= cap:
(1) least max C, (2) least sum C, (3) least max F, (4) smallest boundaries.
If no plan meets the bounds the imbalance is relaxed (×2, at least 0.25) until
one does; the cap then reaches 2 × P[n] and the floor 0, which every plan meets.
The floor matters: without it, (2) favours layers of a few FLOP-free operators
wherever a cut crosses fewer bytes (the loss's scalar tail of a language model),
which leaves the other layers up to (1 + imbalance) x the average and the stage
DP nothing to balance a pipeline with.

Exactness: (1) is a bottleneck DP, (2) a sum DP over layers with C <= C*,
(3) a bottleneck DP over the layers that are tight in (2) (an optimal plan is
exactly a path of tight layers), and the trace takes the smallest next
boundary that stays optimal (``kernels.layer_tables`` / ``layer_trace``).
C and its sums are int64, so the comparisons are exact.

Cost: C is built only inside the band of layers meeting the cap, row by row
with C(a, b+1) = C(a, b) + (bytes into op b from ops < a): memory is the
band size (at most n²/2 int64: 64 MB at n = 4000, usually n × n/L), time
O(band × in-degree) to build and O(3 × num_layers × band) for the DPs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .kernels import INT_INF, kernels, resolve_use_numba

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, eq=False)
class LayerClustering:
    """The chosen layers and what they cost."""

    boundaries: np.ndarray
    """int64 [num_layers]: index of the first op of each layer; boundaries[0] = 0."""
    layer_flops: np.ndarray
    """float64 [num_layers]: FLOPs of each layer (prefix differences)."""
    layer_in_bytes: np.ndarray
    """int64 [num_layers]: C, bytes of the edges entering each layer from earlier ops."""
    imbalance: float
    """The imbalance finally used (after relaxation)."""


def validate_graph(flops, edge_src, edge_dst, edge_bytes, num_layers):
    """Checked float64 / int64 copies; ValueError names the offending input."""
    flops = np.asarray(flops, dtype=np.float64).reshape(-1)
    src = np.asarray(edge_src).reshape(-1)
    dst = np.asarray(edge_dst).reshape(-1)
    nbytes = np.asarray(edge_bytes).reshape(-1)
    n = flops.size
    if not (1 <= int(num_layers) <= n):
        raise ValueError(f"num_layers must be in [1, {n}] (number of ops), got {num_layers}")
    if not np.isfinite(flops).all() or (flops < 0).any():
        raise ValueError("flops must be finite and >= 0 for every op")
    if not (src.shape == dst.shape == nbytes.shape):
        raise ValueError(f"edge arrays differ in length: {src.shape}, {dst.shape}, {nbytes.shape}")
    if src.size and (src.min() < 0 or dst.max() >= n or (src >= dst).any()):
        raise ValueError("edges must satisfy 0 <= src < dst < n (ops in topological order)")
    if nbytes.size and ((nbytes < 0).any() or (nbytes != np.round(nbytes)).any()):
        raise ValueError("edge_bytes must be non-negative integers")
    return flops, src.astype(np.int64), dst.astype(np.int64), nbytes.astype(np.int64)


def imbalance_schedule(imbalance: float, num_layers: int):
    """imbalance, then ×2 (at least 0.25) until the cap is 2 × total FLOPs."""
    imb = float(imbalance)
    if imb < 0:
        raise ValueError(f"imbalance must be >= 0, got {imbalance}")
    while True:
        yield imb
        if 1.0 + imb >= 2.0 * num_layers:
            return
        imb = max(2.0 * imb, 0.25)


def layer_bounds(total_flops: float, num_layers: int, imbalance: float) -> tuple[float, float]:
    """(cap, floor) on a layer's FLOPs at ``imbalance`` (module docstring)."""
    mean = total_flops / num_layers
    return (1.0 + imbalance) * mean, max(0.0, 1.0 - imbalance) * mean


def cluster_layers_detailed(flops, edge_src, edge_dst, edge_bytes, num_layers, *,
                            imbalance=0.5, use_numba=None) -> LayerClustering:
    """Cluster n ops into ``num_layers`` layers (module docstring) with their costs."""
    flops, src, dst, nbytes = validate_graph(flops, edge_src, edge_dst, edge_bytes, num_layers)
    k = kernels(resolve_use_numba(use_numba))
    n, num_layers = flops.size, int(num_layers)
    prefix = np.concatenate(([0.0], np.cumsum(flops)))
    order = np.lexsort((src, dst))  # in-edges of each op, sorted by source
    in_ptr = np.searchsorted(dst[order], np.arange(n + 1)).astype(np.int64)
    in_src, in_bytes = src[order], nbytes[order]
    for imb in imbalance_schedule(imbalance, num_layers):
        cap, floor = layer_bounds(prefix[n], num_layers, imb)
        band_ptr, band_c = k.layer_band(prefix, cap, floor, in_ptr, in_src, in_bytes)
        _, h, m, c_star = k.layer_tables(num_layers, prefix, band_ptr, band_c)
        if c_star < INT_INF:
            break
        logger.info("no %d-layer clustering within imbalance %g; relaxing", num_layers, imb)
    starts = k.layer_trace(num_layers, prefix, band_ptr, band_c, h, m, c_star)
    ends = np.r_[starts[1:], n]
    return LayerClustering(boundaries=starts, layer_flops=prefix[ends] - prefix[starts],
                           layer_in_bytes=band_c[band_ptr[starts] + ends - starts - 1],
                           imbalance=imb)


def cluster_layers(flops, edge_src, edge_dst, edge_bytes, num_layers, *,
                   imbalance=0.5, use_numba=None) -> np.ndarray:
    """int64 [num_layers] index of each layer's first op; see ``cluster_layers_detailed``."""
    return cluster_layers_detailed(flops, edge_src, edge_dst, edge_bytes, num_layers,
                                   imbalance=imbalance, use_numba=use_numba).boundaries
