"""The cost model's alpha-beta formulas fitted to measured collective timings (pure; no I/O).

Fitting (Alpa, OSDI'22 §4.1 / its ``mesh_profiling``): each collective's time
is ``t = α + β·x`` with the regressor ``x`` of the cost model, ``b`` as there::

    all-reduce      x = 2 b (n-1)/n       all-gather      x = b (n-1)/n  (b = output)
    reduce-scatter  x =   b (n-1)/n  (b = input)          all-to-all      x = b (n-1)/n²
    p2p             x = b                 (ping-pong between pairs, t = round trip / 2)

``α, β`` minimise Σ_i ((α + β x_i − t_i) / t_i)²: least squares on *relative*
residuals, so a 4 KiB call (≈ α) counts as much as a 16 MiB one (≈ β x); plain
least squares lets the millisecond noise of large messages swamp α. If the
intercept comes out negative, α = 0 and β is refitted through the origin.

What this file does not own: the measurements (``profile.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from alpa_torch.core.errors import AlpaTorchError


class ProfileError(AlpaTorchError, RuntimeError):
    """Measurements could not be fitted (e.g. time does not grow with message size)."""


def regressor_bytes(collective: str, nbytes: float, n: int) -> float:
    """The cost model's ``x`` in ``t = α + β x`` for ``collective`` of ``nbytes`` over ``n`` devices."""
    factors = {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "reducescatter": (n - 1) / n,
               "alltoall": (n - 1) / n**2, "p2p": 1.0}
    return nbytes * factors[collective]


@dataclass(frozen=True, kw_only=True, slots=True)
class AlphaBetaFit:
    """``t = alpha_s + beta_s_per_byte * x`` fitted to measured (x, t) points."""

    alpha_s: float
    """Intercept: latency of one call, seconds (>= 0)."""
    beta_s_per_byte: float
    """Slope: seconds per regressor byte (> 0)."""
    rel_rms: float
    """Root mean square of the relative residuals (α + β x − t) / t: 0.1 = typically 10 % off."""


def fit_alpha_beta(x_bytes: Sequence[float], t_s: Sequence[float]) -> AlphaBetaFit:
    """Least squares on relative residuals: minimise Σ ((α + β x_i − t_i) / t_i)² (module docstring).

    Rows scaled by 1/t_i turn it into ordinary least squares [1/t_i, x_i/t_i] · (α, β) ≈ 1.
    """
    x, t = np.asarray(x_bytes, dtype=float), np.asarray(t_s, dtype=float)
    if x.shape != t.shape or x.size < 2 or len(set(x.tolist())) < 2:
        raise ProfileError(f"fitting alpha and beta needs >= 2 distinct sizes, got x={x.tolist()}. "
                           "Fix: pass at least two different sizes_bytes.")
    if not (np.all(np.isfinite(t)) and np.all(t > 0)):
        raise ProfileError(f"timings must be finite and > 0, got {t.tolist()}")
    design = np.stack([1 / t, x / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0:  # the convex problem's optimum on α >= 0 is then at α = 0
        alpha, beta = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    if not beta > 0:
        raise ProfileError(f"time does not grow with message size (beta {beta:.3g} s/byte from x={x.tolist()}, "
                           f"t={t.tolist()}). Fix: include larger sizes_bytes (MiBs) or more repeats.")
    rel = (alpha + beta * x - t) / t
    return AlphaBetaFit(alpha_s=float(alpha), beta_s_per_byte=float(beta), rel_rms=float(np.sqrt(np.mean(rel**2))))
