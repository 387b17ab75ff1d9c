"""Cluster profiling: measure the real workers and fit the cost model's numbers to them.

Owns ``profile_cluster`` (behind ``Cluster.profile``): it runs one measuring
function on every worker of a ``WorkerGroup`` (started here unless one is
given), fits the cost model's alpha-beta formulas to the timings, and returns a
new ``Cluster`` whose ``DeviceSpec`` / ``LinkSpec``s are the fitted ones (names
suffixed '-profiled'), with ``collective_beta_scale`` and the raw fits in
``profiled``. It does not price anything itself (``intra_ilp/cost_model.py``
reads the result through ``MeshCost.from_cluster``).

What is measured, on all workers at once (every device busy, as in a step):

* matmul FLOP/s per dtype (float32; bfloat16, float16 where supported): square
  matmuls of a few sizes, best of ``repeats``; the device peak is the best size,
  so ``compute_efficiency`` is 1.0 (the peak *is* what a matmul reaches);
* memory bandwidth: one large ``copy_``, 2 x bytes (read + write) / best time;
* collectives for each message size ``b`` in ``sizes_bytes``, on the groups a
  mesh axis uses: *intra* = the devices of one host (every host at once),
  *inter* = local device i of every host (every i at once). After a warm-up
  pass, ``repeats`` passes each time every (collective, size) once, right after
  a barrier; per rank the median over passes, over ranks the slowest median
  (a collective ends when its last rank does). All ranks take part in every
  measurement; the buffers of one size (~2 b per rank) are shared by its collectives.

Fitting (Alpa, OSDI'22 §4.1 / its ``mesh_profiling``): each collective's time
is ``t = α + β·x`` with the regressor ``x`` of the cost model, ``b`` as there::

    all-reduce      x = 2 b (n-1)/n       all-gather      x = b (n-1)/n  (b = output)
    reduce-scatter  x =   b (n-1)/n  (b = input)          all-to-all      x = b (n-1)/n²
    p2p             x = b                 (ping-pong between pairs, t = round trip / 2)

``α, β`` minimise Σ_i ((α + β x_i − t_i) / t_i)²: least squares on *relative*
residuals, so a 4 KiB call (≈ α) counts as much as a 16 MiB one (≈ β x); plain
least squares lets the millisecond noise of large messages swamp α. If the
intercept comes out negative, α = 0 and β is refitted through the origin.
The link gets the all-reduce fit (``alpha_s = α``, bandwidth ``1 / β``); every
other collective's ``β_c / β_allreduce`` becomes ``collective_beta_scale[c]``.
With both intra and inter groups measured, the scales come from the intra fit
(both sets are kept in ``profiled``).

CPU (gloo) and GPU (NCCL) run the same code; on CUDA tensors every timing is
bracketed by ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from alpa_torch.cluster import COLLECTIVES, Cluster, LinkSpec
from alpa_torch.errors import AlpaTorchError

logger = logging.getLogger(__name__)

_KiB, _MiB = 2**10, 2**20
DEFAULT_SIZES_BYTES = (4 * _KiB, 64 * _KiB, 1 * _MiB, 4 * _MiB, 16 * _MiB)
"""Message sizes ``b`` (the cost model's b): ~4 KiB, where α dominates, to 16 MiB, where β does."""
_FLOAT32_BYTES = 4
_SUFFIX = "-profiled"


class ProfileError(AlpaTorchError, RuntimeError):
    """Measurements could not be fitted (e.g. time does not grow with message size)."""


# ------------------------------------------------------------------------ fitting (pure)
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


# ------------------------------------------------------------------- worker side
@dataclass(frozen=True, kw_only=True, slots=True)
class _Plan:
    """What every worker measures (the same plan on every rank: collectives must match)."""

    sizes_bytes: tuple[int, ...]
    repeats: int
    matmul_sizes: tuple[int, ...] | None
    copy_bytes: int | None
    groups: dict[str, list[list[int]]]
    """'intra' / 'inter' -> rank groups along that link; every rank is in one group of each kind."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    """All ranks line up: a one-element all-reduce (works on gloo and NCCL alike), then a device sync."""
    dist.all_reduce(torch.zeros(1, device=device))
    _sync(device)


def _time_calls(op: Callable[[], Any], repeats: int, device: torch.device) -> list[float]:
    """Seconds per call of the local ``op``: one warm-up (allocator, kernels), a barrier, ``repeats`` calls."""
    op()
    _barrier(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        op()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _matmul_dtypes(device: torch.device) -> list[torch.dtype]:
    if device.type == "cuda":
        return [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    try:
        torch.ones(8, 8, dtype=torch.bfloat16) @ torch.ones(8, 8, dtype=torch.bfloat16)
    except RuntimeError:
        return [torch.float32]
    return [torch.float32, torch.bfloat16]


def _matmul_flops(device: torch.device, sizes: Sequence[int] | None, repeats: int) -> dict[str, dict[str, float]]:
    """{dtype: {size: FLOP/s}}: 2 n³ / best time of an (n, n) @ (n, n) matmul."""
    sizes = sizes or ((2048, 4096, 8192) if device.type == "cuda" else (256, 512, 1024))
    out: dict[str, dict[str, float]] = {}
    for dtype in _matmul_dtypes(device):
        out[str(dtype).removeprefix("torch.")] = per_size = {}
        for n in sizes:
            a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
            per_size[str(n)] = 2 * n**3 / min(_time_calls(lambda: a @ b, repeats, device))  # noqa: B023
    return out


def _copy_bandwidth(device: torch.device, nbytes: int | None, repeats: int) -> float:
    """Bytes/s of a large ``copy_`` (each byte read once and written once)."""
    nbytes = nbytes or (1024 * _MiB if device.type == "cuda" else 64 * _MiB)
    src = torch.ones(nbytes // _FLOAT32_BYTES, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / min(_time_calls(lambda: dst.copy_(src), repeats, device))


def _chunk_elems(nbytes: int, n: int) -> int:
    """float32 elements per rank's chunk, so that the whole message is n equal chunks of ~``nbytes``;
    a multiple of n, since all-to-all splits each rank's chunk n ways."""
    return n * max(1, round(nbytes / _FLOAT32_BYTES / n**2))


def _time_once(op: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call of the collective ``op``, started right after a barrier (little entry skew)."""
    _barrier(device)
    t0 = time.perf_counter()
    op()
    _sync(device)
    return time.perf_counter() - t0


def _buffers(nbytes: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(full, part, out) for a message of ~``nbytes`` over n ranks: b, b/n and b/n bytes of float32 zeros
    (zeros: repeated all-reduces of them stay 0, never inf). Shared by the collectives of one size."""
    chunk = _chunk_elems(nbytes, n)
    return (torch.zeros(chunk * n, device=device), torch.zeros(chunk, device=device),
            torch.zeros(chunk, device=device))


def _collective_op(name: str, buffers: tuple[torch.Tensor, ...], ranks: list[int], group: Any) -> Callable[[], Any]:
    """One call of ``name`` on ``group`` (global ``ranks``) with the cost model's b = ``full.nbytes``."""
    n, me = len(ranks), dist.get_rank()
    full, part, out = buffers
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 renames
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if name == "allreduce":
        return lambda: dist.all_reduce(full, group=group)
    if name == "allgather":
        return lambda: gather(full, part, group=group)
    if name == "reducescatter":
        return lambda: scatter(part, full, group=group)
    if name == "alltoall":  # each rank holds b / n and sends (n-1)/n of it
        return lambda: dist.all_to_all_single(out, part, group=group)
    assert name == "p2p", name
    i = ranks.index(me)
    peer = ranks[i ^ 1] if (i ^ 1) < n else None  # pairs (0,1), (2,3), ...; an odd last rank idles
    if peer is None:
        return lambda: None

    def ping_pong() -> None:  # the first of a pair sends first; t = round trip / 2 is taken by the caller
        for send in ((True, False) if i % 2 == 0 else (False, True)):
            (dist.send if send else dist.recv)(full, peer)
    return ping_pong


def _subgroup(state: dict[str, Any], groups: list[list[int]]) -> Any:
    """This rank's process group among ``groups``; created once per worker, by all ranks in the same order."""
    cache = state.setdefault("profile_groups", {})
    key = tuple(tuple(g) for g in groups)
    if key not in cache:
        cache[key], _ = dist.new_subgroups_by_enumeration(groups)
    return cache[key]


def _link_times(state: dict[str, Any], groups: list[list[int]], plan: _Plan) -> dict[str, dict[str, float]]:
    """{collective: {size: median seconds on this rank}} on this rank's group of ``groups``.

    ``repeats`` passes, each timing every (collective, size) once after a warm-up pass: a burst of
    interference from other work on the machine then spoils one sample of each point, not all of them.
    """
    device, me = state["device"], dist.get_rank()
    group = _subgroup(state, groups)
    ranks = next(g for g in groups if me in g)
    ops = {}
    for nbytes in plan.sizes_bytes:
        buffers = _buffers(nbytes, len(ranks), device)
        ops.update({(name, nbytes): _collective_op(name, buffers, ranks, group) for name in COLLECTIVES})
    for op in ops.values():
        op()
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in ops}
    for _ in range(plan.repeats):
        for key, op in ops.items():
            samples[key].append(_time_once(op, device))
    return {name: {str(b): statistics.median(samples[name, b]) / (2 if name == "p2p" else 1)
                   for b in plan.sizes_bytes} for name in COLLECTIVES}


def _measure(state: dict[str, Any], plan: _Plan) -> dict[str, Any]:
    """Everything one worker measures (runs on every rank at once via ``WorkerGroup.call_all``)."""
    device = state["device"]
    result: dict[str, Any] = {"matmul_flops_per_s": _matmul_flops(device, plan.matmul_sizes, plan.repeats)}
    _barrier(device)
    result["memory_bandwidth_bytes_per_s"] = _copy_bandwidth(device, plan.copy_bytes, plan.repeats)
    result["links"] = {kind: _link_times(state, groups, plan) for kind, groups in plan.groups.items()}
    return result


# ------------------------------------------------------------------- driver side
def link_groups(cluster: Cluster) -> dict[str, list[list[int]]]:
    """Rank groups per link kind (host-major ranks): 'intra' = each host's devices (if >= 2 per host),
    'inter' = local device i of every host, for each i (if >= 2 hosts)."""
    n, m = cluster.num_hosts, cluster.devices_per_host
    groups = {}
    if m >= 2:
        groups["intra"] = [[h * m + i for i in range(m)] for h in range(n)]
    if n >= 2:
        groups["inter"] = [[h * m + i for h in range(n)] for i in range(m)]
    return groups


def _fit_link(per_rank: list[dict[str, dict[str, float]]], n: int, sizes: Sequence[int]) -> dict[str, Any]:
    """Fits of every collective on one link kind, from each rank's median times (slowest rank wins)."""
    fits: dict[str, Any] = {}
    for name in COLLECTIVES:
        nbytes = [_chunk_elems(b, n) * n * _FLOAT32_BYTES for b in sizes]  # the bytes actually moved
        t = [max(r[name][str(b)] for r in per_rank) for b in sizes]
        fit = fit_alpha_beta([regressor_bytes(name, b, n) for b in nbytes], t)
        fits[name] = dataclasses.asdict(fit) | {"bytes": nbytes, "time_s": t}
    beta_ar = fits["allreduce"]["beta_s_per_byte"]
    scales = {k: v["beta_s_per_byte"] / beta_ar for k, v in fits.items() if k != "allreduce"}
    return {"group_size": n, "fits": fits, "scales": scales}


def _profiled_link(base: LinkSpec, fitted: dict[str, Any]) -> LinkSpec:
    ar = fitted["fits"]["allreduce"]
    return LinkSpec(name=base.name.removesuffix(_SUFFIX) + _SUFFIX, alpha_s=ar["alpha_s"],
                    bandwidth_bytes_per_s=1.0 / ar["beta_s_per_byte"])


def _calibrated(cluster: Cluster, results: list[dict[str, Any]], plan: _Plan) -> Cluster:
    """A new Cluster from every rank's measurements: median over ranks for the device, fits for the links."""
    flops = {dtype: statistics.median(max(r["matmul_flops_per_s"][dtype].values()) for r in results)
             for dtype in results[0]["matmul_flops_per_s"]}
    mem_bw = statistics.median(r["memory_bandwidth_bytes_per_s"] for r in results)
    device = dataclasses.replace(cluster.device, name=cluster.device.name.removesuffix(_SUFFIX) + _SUFFIX,
                                 peak_flops=flops, memory_bandwidth_bytes_per_s=mem_bw, compute_efficiency=1.0)
    links = {kind: _fit_link([r["links"][kind] for r in results], len(groups[0]), plan.sizes_bytes)
             for kind, groups in plan.groups.items()}
    source = "intra" if "intra" in links else "inter" if "inter" in links else None
    profiled = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "backend": cluster.backend, "repeats": plan.repeats,
        "sizes_bytes": list(plan.sizes_bytes), "scales_from": source,
        "matmul_flops_per_s": _rank_median(results, "matmul_flops_per_s"),
        "memory_bandwidth_bytes_per_s": mem_bw, "links": links,
    }
    intra, inter = cluster.intra_host_link, cluster.inter_host_link  # kept where nothing was measured
    return dataclasses.replace(
        cluster, device=device,
        intra_host_link=_profiled_link(intra, links["intra"]) if "intra" in links else intra,
        inter_host_link=_profiled_link(inter, links["inter"]) if "inter" in links else inter,
        collective_beta_scale=links[source]["scales"] if source else cluster.collective_beta_scale,
        profiled=profiled)


def _rank_median(results: list[dict[str, Any]], key: str) -> dict[str, dict[str, float]]:
    """{dtype: {size: median over ranks}} of a per-rank {dtype: {size: value}} table."""
    first = results[0][key]
    return {d: {s: statistics.median(r[key][d][s] for r in results) for s in first[d]} for d in first}


def profile_cluster(cluster: Cluster, *, sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES, repeats: int = 7,
                    group: Any = None, matmul_sizes: Sequence[int] | None = None,
                    copy_bytes: int | None = None, timeout_s: float = 600.0) -> Cluster:
    """Measure ``cluster`` on its workers and return a calibrated copy (module docstring: what and how).

    ``group``: a running ``WorkerGroup`` of this cluster's shape to measure on (left running);
    without one, a group is started and shut down here (and Ray with it, if this started Ray).
    ``matmul_sizes`` / ``copy_bytes`` default by device (CPU: 256-1024 / 64 MiB; CUDA: 2048-8192 / 1 GiB).
    """
    sizes = tuple(int(b) for b in sizes_bytes)
    if len(set(sizes)) < 2 or min(sizes) < _FLOAT32_BYTES:
        raise ValueError(f"sizes_bytes = {tuple(sizes_bytes)!r} needs >= 2 distinct sizes of >= 4 bytes. "
                         "Fix: e.g. (4096, 1 << 20, 16 << 20).")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats = {repeats!r} must be an integer >= 1. Fix: use e.g. 7.")
    plan = _Plan(sizes_bytes=sizes, repeats=repeats, groups=link_groups(cluster), copy_bytes=copy_bytes,
                 matmul_sizes=tuple(matmul_sizes) if matmul_sizes else None)
    if group is not None:
        return _profile_on(group, cluster, plan, timeout_s)
    from runtime.group import WorkerGroup  # noqa: PLC0415 (ray: only when a group must be started)

    with WorkerGroup.start(cluster) as own:
        return _profile_on(own, cluster, plan, timeout_s)


def _profile_on(group: Any, cluster: Cluster, plan: _Plan, timeout_s: float) -> Cluster:
    shape = (group.cluster.num_hosts, group.cluster.devices_per_host)
    want = (cluster.num_hosts, cluster.devices_per_host)
    if shape != want:
        raise ValueError(f"the worker group is {shape[0]}x{shape[1]} but the cluster to profile is "
                         f"{want[0]}x{want[1]}. Fix: pass a group started for this cluster, or none.")
    if not plan.groups:
        logger.warning("a 1x1 cluster has no link to measure; profiling the device only")
    t0 = time.perf_counter()
    results = group.call_all(_measure, plan, timeout_s=timeout_s)
    profiled = _calibrated(cluster, results, plan)
    logger.info("profiled in %.1f s: %s", time.perf_counter() - t0, profiled.describe())
    return profiled
