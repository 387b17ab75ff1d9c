"""Numba kernels of ``stage_dp``, each also runnable as plain Python.

Owns the inner loops of the stage DP (``dp.py``) and of operator clustering
(``layering.py``) and nothing else: no validation, no search, no logging.
Every kernel is written once, in the subset of Python that numba compiles;
``kernels(use_numba)`` hands out either the ``numba.njit(cache=True)``
versions or the very same functions run by the interpreter (the "twins").
The tests run both on random inputs and require identical results, and the
callers check both against brute force (``brute_force.py``).

The one switch: ``use_numba`` arguments default to ``numba_default()``,
which is False when the environment variable ``ALPA_TORCH_NO_NUMBA`` is set
to anything but ``""``/``"0"``/``"false"``/``"no"`` when this module is imported.

Kernels are leaves (they call no other kernel), so the jitted and the
interpreted versions never mix.

Stage DP tables (Alpa OSDI'22 eq. 3-5), for a fixed ``t_max_s``::

    F[0, L, 0] = 0
    F[q, l, d] = min over stage (l..i, s, c) with cost <= t_max and
                 max_n_succ >= q - 1 of  cost + F[q-1, i+1, d - size[s]]

``bottleneck=True`` replaces ``cost + F`` by ``max(cost, F)``: then
``min_q F[q, 0, D]`` is the smallest feasible t_max.

Layer clustering tables (Alpa §5.2), over suffixes of the op sequence,
for layer candidates [a, b) with flops(a, b) <= cap (a band per a)::

    P[0, n] = 0;  P[r, a] = min_b max(C(a, b), P[r-1, b])          (phase 1)
    H[0, n] = 0;  H[r, a] = min_{b: C <= C*} C(a, b) + H[r-1, b]  (phase 2)
    M[0, n] = 0;  M[r, a] = min_{b tight in H} max(F(a, b), M[r-1, b])
"""

from __future__ import annotations

import functools
import os
import types

import numpy as np

NO_NUMBA_ENV = "ALPA_TORCH_NO_NUMBA"


def numba_default() -> bool:
    """Whether kernels run compiled by default: unless ``ALPA_TORCH_NO_NUMBA`` is set (read at each call)."""
    return os.environ.get(NO_NUMBA_ENV, "").strip().lower() in ("", "0", "false", "no")


INT_INF = np.iinfo(np.int64).max // 4  # "infinite" bytes; sums of a few stay < int64 max


def resolve_use_numba(use_numba: bool | None) -> bool:
    """``use_numba`` if given, else the module default (env ``ALPA_TORCH_NO_NUMBA``)."""
    return numba_default() if use_numba is None else bool(use_numba)


# ----------------------------------------------------------------------------- stage DP
def stage_dp_table(t_max_s, bottleneck, q_max, num_devices, grp_start, grp_end,
                   grp_size, ent_start, ent_cost_s, ent_mns):
    """F[q, l, d] of the module docstring; float64 ``[q_max+1, L+1, D+1]``.

    Candidates come grouped by (l, i, s), groups of layer l in
    ``grp_start[l]:grp_start[l+1]`` sorted by end layer ``grp_end``; each
    group's configs ``ent_start[g]:ent_start[g+1]`` sorted by (cost, config) with
    strictly increasing ``ent_mns``, so the first with ``mns >= q-1`` is the best.
    """
    num_layers = grp_start.shape[0] - 1
    f = np.full((q_max + 1, num_layers + 1, num_devices + 1), np.inf)
    d_lo = np.full((q_max + 1, num_layers + 1), num_devices + 1, np.int64)
    d_hi = np.full((q_max + 1, num_layers + 1), -1, np.int64)
    f[0, num_layers, 0] = 0.0
    d_lo[0, num_layers] = 0
    d_hi[0, num_layers] = 0
    for q in range(1, q_max + 1):
        for l in range(num_layers - q + 1):
            row = f[q, l]
            for g in range(grp_start[l], grp_start[l + 1]):
                nxt = grp_end[g] + 1
                if nxt > num_layers - q + 1:
                    break  # the q-1 later stages need >= q-1 layers
                if d_hi[q - 1, nxt] < 0:
                    continue
                e = ent_start[g]
                while e < ent_start[g + 1] and ent_mns[e] < q - 1:
                    e += 1
                if e == ent_start[g + 1] or ent_cost_s[e] > t_max_s:
                    continue
                cost = ent_cost_s[e]
                size = grp_size[g]
                prev = f[q - 1, nxt]
                lo = d_lo[q - 1, nxt] + size
                hi = min(d_hi[q - 1, nxt] + size, num_devices)
                if lo > hi:
                    continue
                d_lo[q, l] = min(d_lo[q, l], lo)
                d_hi[q, l] = max(d_hi[q, l], hi)
                if bottleneck:
                    for d in range(lo, hi + 1):
                        row[d] = min(row[d], max(cost, prev[d - size]))
                else:
                    for d in range(lo, hi + 1):
                        row[d] = min(row[d], cost + prev[d - size])
    return f


def stage_dp_trace(f, q_stages, t_max_s, grp_start, grp_end, grp_size, grp_sub,
                   ent_start, ent_cost_s, ent_mns, ent_cfg):
    """Walk ``f`` from (q_stages, 0, D): the lexicographically smallest optimal plan.

    Returns int64 ``[q_stages, 4]`` rows (start, end, submesh, config); at
    each stage the first (end, submesh, config) whose value is exactly the
    table's minimum (it is one of the terms of that minimum).
    """
    num_layers = grp_start.shape[0] - 1
    out = np.full((q_stages, 4), -1, np.int64)
    l = 0
    d = f.shape[2] - 1
    for k in range(q_stages):
        q = q_stages - k
        for g in range(grp_start[l], grp_start[l + 1]):
            nxt = grp_end[g] + 1
            size = grp_size[g]
            if nxt > num_layers - q + 1:
                break
            e = ent_start[g]
            while e < ent_start[g + 1] and ent_mns[e] < q - 1:
                e += 1
            if e == ent_start[g + 1] or ent_cost_s[e] > t_max_s or size > d:
                continue
            if ent_cost_s[e] + f[q - 1, nxt, d - size] == f[q, l, d]:
                out[k, 0] = l
                out[k, 1] = nxt - 1
                out[k, 2] = grp_sub[g]
                out[k, 3] = ent_cfg[e]
                l = nxt
                d -= size
                break
    return out


# ----------------------------------------------------------------------------- layering
def layer_band(prefix_flops, cap_flops, floor_flops, in_ptr, in_src, in_bytes):
    """Candidate layers [a, b) with flops <= cap and their entering bytes C(a, b).

    ``b`` runs over ``a+1 .. band_end[a]`` (a layer holds >= 1 op even when that
    op alone exceeds the cap; such a layer is marked by C = INT_INF, as is a layer
    with fewer flops than ``floor_flops``).
    In-edges of op v are ``in_ptr[v]:in_ptr[v+1]`` sorted by source.
    C(a, b+1) = C(a, b) + bytes of edges into op b from ops < a: O(band) per a.
    Returns (band_ptr int64 [n+1], band_c int64 [sum of band widths]).
    """
    n = prefix_flops.shape[0] - 1
    band_end = np.empty(n, np.int64)
    b = 0
    for a in range(n):
        b = max(b, a + 1)
        while b < n and prefix_flops[b + 1] - prefix_flops[a] <= cap_flops:
            b += 1
        band_end[a] = b
    band_ptr = np.zeros(n + 1, np.int64)
    for a in range(n):
        band_ptr[a + 1] = band_ptr[a] + band_end[a] - a
    band_c = np.empty(band_ptr[n], np.int64)
    for a in range(n):
        c = 0
        for b in range(a + 1, band_end[a] + 1):
            v = b - 1
            j = in_ptr[v]
            while j < in_ptr[v + 1] and in_src[j] < a:
                c += in_bytes[j]
                j += 1
            band_c[band_ptr[a] + b - a - 1] = c if prefix_flops[b] - prefix_flops[a] >= floor_flops else INT_INF
        if prefix_flops[a + 1] - prefix_flops[a] > cap_flops:
            band_c[band_ptr[a]] = INT_INF
    return band_ptr, band_c


def layer_tables(num_layers, prefix_flops, band_ptr, band_c):
    """Phases 1-3 of the module docstring; returns (P, H, M, c_star).

    P, H int64 and M float64, all ``[num_layers+1, n+1]``; infeasible entries
    hold INT_INF / inf.  H and M only use layers with C <= c_star = P[R, 0].
    """
    n = band_ptr.shape[0] - 1
    p = np.full((num_layers + 1, n + 1), INT_INF, np.int64)
    h = np.full((num_layers + 1, n + 1), INT_INF, np.int64)
    m = np.full((num_layers + 1, n + 1), np.inf)
    p[0, n] = 0
    h[0, n] = 0
    m[0, n] = 0.0
    for phase in range(3):
        c_star = p[num_layers, 0]
        for r in range(1, num_layers + 1):
            for a in range(num_layers - r, n - r + 1):
                best_p = INT_INF
                best_h = INT_INF
                best_m = np.inf
                for b in range(a + 1, min(band_ptr[a + 1] - band_ptr[a] + a, n - r + 1) + 1):
                    c = band_c[band_ptr[a] + b - a - 1]
                    if c >= INT_INF:
                        continue
                    if phase == 0:
                        best_p = min(best_p, max(c, p[r - 1, b]))
                    elif c <= c_star and h[r - 1, b] < INT_INF:
                        if phase == 1:
                            best_h = min(best_h, c + h[r - 1, b])
                        elif c + h[r - 1, b] == h[r, a]:
                            fl = prefix_flops[b] - prefix_flops[a]
                            best_m = min(best_m, max(fl, m[r - 1, b]))
                if phase == 0:
                    p[r, a] = best_p
                elif phase == 1:
                    h[r, a] = best_h
                else:
                    m[r, a] = best_m
        if p[num_layers, 0] >= INT_INF:
            break
    return p, h, m, p[num_layers, 0]


def layer_trace(num_layers, prefix_flops, band_ptr, band_c, h, m, c_star):
    """Smallest boundaries of a plan reaching (c_star, H[R, 0], M[R, 0]).

    At each layer, the smallest end b that keeps C <= c_star, is tight in H and
    keeps flops and the rest's M within M[R, 0]. Returns int64 ``[R]`` starts.
    """
    n = band_ptr.shape[0] - 1
    m_star = m[num_layers, 0]
    starts = np.zeros(num_layers, np.int64)
    a = 0
    for k in range(num_layers):
        r = num_layers - k
        starts[k] = a
        for b in range(a + 1, min(band_ptr[a + 1] - band_ptr[a] + a, n - r + 1) + 1):
            c = band_c[band_ptr[a] + b - a - 1]
            if c > c_star or h[r - 1, b] >= INT_INF or c + h[r - 1, b] != h[r, a]:
                continue
            if prefix_flops[b] - prefix_flops[a] <= m_star and m[r - 1, b] <= m_star:
                a = b
                break
    return starts


# ----------------------------------------------------------------------------- switch
_KERNELS = (stage_dp_table, stage_dp_trace, layer_band, layer_tables, layer_trace)


@functools.lru_cache(maxsize=2)
def kernels(use_numba: bool) -> types.SimpleNamespace:
    """The kernel set: jitted (``numba.njit(cache=True)``) or plain Python twins."""
    if not use_numba:
        return types.SimpleNamespace(**{k.__name__: k for k in _KERNELS})
    import numba  # imported only when asked for, so the twins run without numba

    return types.SimpleNamespace(
        **{k.__name__: numba.njit(cache=True, nogil=True)(k) for k in _KERNELS})
