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
* the same two *sustained with every worker busy at once* (``_busy_rate``): after a
  barrier every worker repeats the matmul (the middle size) or the copy for a fixed
  window, rate = work done / window, median of 3 windows. On ``Cluster.local`` the
  devices are processes sharing the machine's cores (4 devices on 2 cores run at
  about half speed each), and the machine may be loaded by other work: the busy rates
  are what a step's operators get, so they become the device's ``peak_flops`` and
  ``memory_bandwidth_bytes_per_s`` (the best-of figures stay in ``profiled``);
* the fixed cost of one operator execution (``_op_overhead``), all workers at once:
  chains of tiny operators (add, mul, two views) run by the runtime's own interpreter
  (``StageRunner``) repeated for the all-busy window, seconds per operator = 1 / the
  sustained operator rate (without a window: the slope between chains of 40 and 200,
  median of ``repeats``), once on plain tensors
  (``DeviceSpec.op_overhead_s``: the runtime's path on a one-device mesh) and once on
  DTensors sharded over a mesh of all the workers (``sharded_op_overhead_s``: the
  path on a multi-device mesh as later steps take it, after a first step that learns
  the replay: ``runtime/replay.py``);
* collectives for each message size ``b`` in ``sizes_bytes``, on the groups a
  mesh axis uses: *intra* = the devices of one host (every host at once),
  *inter* = local device i of every host (every i at once). After a warm-up
  pass, ``repeats`` passes each time every (collective, size) once, right after
  a barrier; per rank the median over passes, over ranks the slowest median
  (a collective ends when its last rank does). All ranks take part in every
  measurement; the buffers of one size (~2 b per rank) are shared by its collectives.

The collectives are timed twice: as above (each call right after a barrier, every rank
idle: the link itself), and *busy*: each rank first runs ``BUSY_OPS_BETWEEN`` DTensor
operators through the interpreter (and, on CPU devices, ``BUSY_WORK_S`` of matmuls: a
step's compute per collective), then calls the collective without a barrier, as in a
step, so the call also waits for ranks the OS descheduled (on 4 devices sharing 2 cores
that wait is most of a small collective's cost). With ``busy_window_s`` > 0 the busy
fits price the links (the idle ones stay in ``profiled['idle_links']``).

Fitting: ``profile_fit.py`` (Alpa's alpha-beta fit, on relative residuals). The link
gets the all-reduce fit (``alpha_s = α``, bandwidth ``1 / β``); every other
collective's ``β_c / β_allreduce`` becomes ``collective_beta_scale[c]``. With both
intra and inter groups measured, the scales come from the intra fit (both sets are
kept in ``profiled``).

CPU (gloo) and GPU (NCCL) run the same code; on CUDA tensors every timing is
bracketed by ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from alpa_torch.core.cluster import COLLECTIVES, Cluster, LinkSpec

from .profile_fit import ProfileError, fit_alpha_beta, regressor_bytes

logger = logging.getLogger(__name__)

_KiB, _MiB = 2**10, 2**20
DEFAULT_SIZES_BYTES = (4 * _KiB, 64 * _KiB, 1 * _MiB, 4 * _MiB, 16 * _MiB)
"""Message sizes ``b`` (the cost model's b): ~4 KiB, where α dominates, to 16 MiB, where β does."""
_FLOAT32_BYTES = 4
_SUFFIX = "-profiled"


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
    busy_window_s: float = 0.0
    """Seconds of each window of the all-busy rates (``_busy_rate``); 0: not measured."""


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


def _busy_rate(op: Callable[[], Any], work: float, device: torch.device, window_s: float,
               windows: int = 3) -> float:
    """Work per second of ``op`` (``work`` units per call) sustained while every worker runs it:
    after a barrier each worker repeats ``op`` for ``window_s``; the median over ``windows``."""
    op()
    rates = []
    for _ in range(windows):
        _barrier(device)
        calls, t0 = 0, time.perf_counter()
        while True:
            op()
            calls += 1
            _sync(device)
            elapsed = time.perf_counter() - t0
            if elapsed >= window_s:
                break
        rates.append(calls * work / elapsed)
    return statistics.median(rates)


def _busy_matmul_flops(device: torch.device, sizes: Sequence[int] | None, window_s: float) -> dict[str, float]:
    """{dtype: FLOP/s} of the middle matmul size, sustained with every worker busy (``_busy_rate``)."""
    sizes = sorted(sizes or ((2048, 4096, 8192) if device.type == "cuda" else (256, 512, 1024)))
    n = sizes[len(sizes) // 2]
    out = {}
    for dtype in _matmul_dtypes(device):
        a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
        out[str(dtype).removeprefix("torch.")] = _busy_rate(lambda: a @ b, 2 * n**3, device, window_s)  # noqa: B023
    return out


def _busy_copy_bandwidth(device: torch.device, nbytes: int | None, window_s: float) -> float:
    """Bytes/s of ``copy_`` (read + write) sustained with every worker busy (``_busy_rate``)."""
    nbytes = nbytes or (1024 * _MiB if device.type == "cuda" else 64 * _MiB)
    src = torch.ones(nbytes // _FLOAT32_BYTES, device=device)
    dst = torch.empty_like(src)
    return _busy_rate(lambda: dst.copy_(src), 2 * src.nbytes, device, window_s)


BUSY_OPS_BETWEEN = 24
"""DTensor operators each rank runs before each collective of the busy link measurement
(about a step's operators per collective on a sharded GPT stage: 1,200 for 50)."""
BUSY_WORK_S = 0.008
"""Compute each rank does (as matmuls, at its all-busy rate) before each collective of the busy
link measurement, besides ``BUSY_OPS_BETWEEN``: a step's compute per collective on a sharded
GPT stage (0.33 s of operators for 40 collectives in ``bench/fidelity.py``'s one-stage plans).
With devices sharing cores the ranks drift apart by up to a scheduler time slice over that
much work, and a collective waits for the last of them: a wait that 24 replayed operators
(~0.1 ms) would not show."""
BUSY_MATMUL_N = 128
"""Side of the square matmuls of ``BUSY_WORK_S``."""
OP_CHAIN_LENGTHS = (40, 200)
"""Operators in the short and the long chain ``_op_overhead`` times (multiples of 4)."""


def _chain_records(n: int, shape: tuple[int, ...]) -> list[tuple]:
    """Serialized graph (``program.serialize_graph``) of ``n`` chained aten operators on inputs
    ``x``, ``y``: add, mul, flatten view, view back, repeated."""
    import torch.fx as fx

    from .interpreter import serialize_graph

    aten = torch.ops.aten
    g = fx.Graph()
    cur, y = g.placeholder("x"), g.placeholder("y")
    for _ in range(n // 4):
        cur = g.call_function(aten.add.Tensor, (cur, y))
        cur = g.call_function(aten.mul.Tensor, (cur, 0.5))
        cur = g.call_function(aten.view.default, (cur, [-1]))
        cur = g.call_function(aten.view.default, (cur, list(shape)))
    g.output(cur)
    return serialize_graph(fx.GraphModule({}, g))


@dataclass(frozen=True)
class _OneDevice:
    """What ``StageRunner`` asks of a one-device mesh (it then runs plain tensors, no DTensor):
    each worker times the one-device path on its own, without creating process groups."""

    device_type: str
    ndim = 2

    @staticmethod
    def size() -> int:
        return 1


def _chain_runner(n: int, x: torch.Tensor, mesh: Any, spec: str):
    """A ``StageRunner`` (the runtime's interpreter) of ``_chain_records(n)`` with every value and
    operator input in ``spec``, and its step: ``run() -> result``."""
    from .interpreter import StageRunner

    records = _chain_records(n, tuple(x.shape))
    ops = [r for r in records if r[0] == "call_function"]
    value_specs = {r[1]: spec for r in records if r[0] in ("placeholder", "call_function")}
    input_specs = {r[1]: [spec] * len(r[5]) for r in ops}
    io = {"inputs": [("batch", "x", "x"), ("batch", "y", "y")], "outputs": []}
    runner = StageRunner(records, value_specs, input_specs, io, mesh)
    y = torch.full_like(x, 0.25)
    if mesh.size() > 1:
        from torch.distributed.tensor import distribute_tensor

        placements = runner.value_specs["x"]
        x, y = (distribute_tensor(t, mesh, placements) for t in (x, y))

    def run():
        env = {"x": x, "y": y}
        runner.enter(env)
        return runner.run(runner.program, env)

    if runner.learning:  # the first step learns the replay; time the path later steps take
        run()
        runner.end_step()
    return run


def _op_overhead(device: torch.device, repeats: int, window_s: float = 0.0) -> dict[str, float]:
    """Seconds per operator execution through the runtime's interpreter (``StageRunner.run``:
    argument resolution, liveness, input placement checks, the call), every worker at once,
    on tiny tensors (their roofline time is ~0): 'local' on a one-device mesh (plain
    tensors), 'sharded' with every value S(0) over a mesh of all the workers (DTensor on the
    first run, then timed as replayed, as every step after the first; no communication). With ``window_s`` > 0: the
    inverse of the operator rate sustained over windows of that length (``_busy_rate``,
    the longer chain of ``OP_CHAIN_LENGTHS``), so time slices lost to other processes count
    as they do in a step; else the slope between the two chains, median of ``repeats``
    (a chain of a few milliseconds often runs within one time slice, hiding shared cores)."""
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    x = torch.ones(4 * world, 4, device=device)
    mesh = DeviceMesh(device.type, torch.arange(world).view(world, 1))
    out = {}
    short, long = OP_CHAIN_LENGTHS
    for kind, (m, spec) in (("local", (_OneDevice(device.type), "RR")), ("sharded", (mesh, "S(0)R"))):
        runs = {n: _chain_runner(n, x, m, spec) for n in (short, long)}
        if window_s > 0:
            out[kind] = 1.0 / _busy_rate(runs[long], long, device, window_s)
            continue
        times = {n: statistics.median(_time_calls(runs[n], repeats, device)) for n in (short, long)}
        out[kind] = max(0.0, (times[long] - times[short]) / (long - short))
    return out


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


def _time_after(op: Callable[[], Any], between: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call of the collective ``op`` right after this rank's share of ``between``
    (no barrier: ranks arrive when their work is done, as in a step)."""
    between()
    _sync(device)
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
    gather = dist.all_gather_single
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


def _link_times(state: dict[str, Any], groups: list[list[int]], plan: _Plan,
                between: Callable[[], Any] | None = None) -> dict[str, dict[str, float]]:
    """{collective: {size: median seconds on this rank}} on this rank's group of ``groups``.

    ``between``: work each rank does before each timed call instead of the barrier (as a
    step's operators do): the call then also waits for ranks the OS descheduled.

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
            samples[key].append(_time_once(op, device) if between is None else _time_after(op, between, device))
    return {name: {str(b): statistics.median(samples[name, b]) / (2 if name == "p2p" else 1)
                   for b in plan.sizes_bytes} for name in COLLECTIVES}


def _measure(state: dict[str, Any], plan: _Plan) -> dict[str, Any]:
    """Everything one worker measures (runs on every rank at once via ``WorkerGroup.call_all``)."""
    from torch.distributed.device_mesh import DeviceMesh

    device = state["device"]
    result: dict[str, Any] = {"matmul_flops_per_s": _matmul_flops(device, plan.matmul_sizes, plan.repeats)}
    _barrier(device)
    result["memory_bandwidth_bytes_per_s"] = _copy_bandwidth(device, plan.copy_bytes, plan.repeats)
    if plan.busy_window_s > 0:
        result["busy_matmul_flops_per_s"] = _busy_matmul_flops(device, plan.matmul_sizes, plan.busy_window_s)
        result["busy_memory_bandwidth_bytes_per_s"] = _busy_copy_bandwidth(device, plan.copy_bytes,
                                                                           plan.busy_window_s)
    _barrier(device)
    result["op_overhead_s"] = _op_overhead(device, plan.repeats, plan.busy_window_s)
    result["links"] = {kind: _link_times(state, groups, plan) for kind, groups in plan.groups.items()}
    if plan.busy_window_s > 0 and plan.groups:
        world = dist.get_world_size()
        chain = _chain_runner(BUSY_OPS_BETWEEN, torch.ones(4 * world, 4, device=device),
                              DeviceMesh(device.type, torch.arange(world).view(world, 1)), "S(0)R")
        rate = result["busy_matmul_flops_per_s"]["float32"]
        a = torch.ones(BUSY_MATMUL_N, BUSY_MATMUL_N, device=device)
        # CPU devices only: GPUs do not share cores (and would need ~10^5 such matmuls)
        n_mm = max(1, round(BUSY_WORK_S * rate / (2 * BUSY_MATMUL_N**3))) if device.type == "cpu" else 0

        def work():
            chain()
            for _ in range(n_mm):
                torch.mm(a, a)

        result["busy_links"] = {kind: _link_times(state, groups, plan, between=work)
                                for kind, groups in plan.groups.items()}
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
    best_flops, best_bw = dict(flops), mem_bw
    busy = "busy_matmul_flops_per_s" in results[0]
    if busy:  # what a step gets with every device busy (module docstring) prices compute
        flops = {dtype: statistics.median(r["busy_matmul_flops_per_s"][dtype] for r in results)
                 for dtype in results[0]["busy_matmul_flops_per_s"]}
        mem_bw = statistics.median(r["busy_memory_bandwidth_bytes_per_s"] for r in results)
    overheads = {}
    if "op_overhead_s" in results[0]:
        overheads = {"op_overhead_s": statistics.median(r["op_overhead_s"]["local"] for r in results),
                     "sharded_op_overhead_s": statistics.median(r["op_overhead_s"]["sharded"] for r in results)}
    device = dataclasses.replace(cluster.device, name=cluster.device.name.removesuffix(_SUFFIX) + _SUFFIX,
                                 peak_flops=flops, memory_bandwidth_bytes_per_s=mem_bw, compute_efficiency=1.0,
                                 **overheads)
    def fits(key: str) -> dict[str, Any]:
        return {kind: _fit_link([r[key][kind] for r in results], len(groups[0]), plan.sizes_bytes)
                for kind, groups in plan.groups.items()}

    idle_links = None
    if plan.groups and "busy_links" in results[0]:  # collectives as a step meets them price the links
        try:
            links = fits("busy_links")
        except ProfileError as exc:
            logger.warning("busy collective timings could not be fitted (%s); using the idle ones", exc)
            links = fits("links")
        else:
            try:
                idle_links = fits("links")
            except ProfileError as exc:  # noisy idle timings: the busy fits price the links anyway
                idle_links = {"error": str(exc)}
    else:
        links = fits("links")
    source = "intra" if "intra" in links else "inter" if "inter" in links else None
    profiled = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "backend": cluster.backend, "repeats": plan.repeats,
        "sizes_bytes": list(plan.sizes_bytes), "scales_from": source,
        "matmul_flops_per_s": _rank_median(results, "matmul_flops_per_s"),
        "memory_bandwidth_bytes_per_s": best_bw, "links": links,
    }
    if busy:
        profiled.update(best_flops_per_s=best_flops, busy_window_s=plan.busy_window_s,
                        busy_flops_per_s=flops, busy_memory_bandwidth_bytes_per_s=mem_bw)
    if idle_links is not None:
        profiled["idle_links"] = idle_links
        profiled["busy_ops_between"] = BUSY_OPS_BETWEEN
        profiled["busy_work_s"] = BUSY_WORK_S
    if overheads:
        profiled["op_overhead_s"] = overheads | {"chain_lengths": list(OP_CHAIN_LENGTHS), "per_rank": [
            [r["op_overhead_s"]["local"], r["op_overhead_s"]["sharded"]] for r in results]}
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
                    copy_bytes: int | None = None, timeout_s: float = 600.0,
                    busy_window_s: float = 0.3) -> Cluster:
    """Measure ``cluster`` on its workers and return a calibrated copy (module docstring: what and how).

    ``group``: a running ``WorkerGroup`` of this cluster's shape to measure on (left running);
    without one, a group is started and shut down here (and Ray with it, if this started Ray).
    ``matmul_sizes`` / ``copy_bytes`` default by device (CPU: 256-1024 / 64 MiB; CUDA: 2048-8192 / 1 GiB).
    ``busy_window_s``: seconds of each all-busy window (0 keeps the best-of rates as the device's).
    """
    sizes = tuple(int(b) for b in sizes_bytes)
    if len(set(sizes)) < 2 or min(sizes) < _FLOAT32_BYTES:
        raise ValueError(f"sizes_bytes = {tuple(sizes_bytes)!r} needs >= 2 distinct sizes of >= 4 bytes. "
                         "Fix: e.g. (4096, 1 << 20, 16 << 20).")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats = {repeats!r} must be an integer >= 1. Fix: use e.g. 7.")
    if not (isinstance(busy_window_s, (int, float)) and math.isfinite(busy_window_s) and busy_window_s >= 0):
        raise ValueError(f"busy_window_s = {busy_window_s!r} must be a number >= 0. Fix: use e.g. 0.3.")
    plan = _Plan(sizes_bytes=sizes, repeats=repeats, groups=link_groups(cluster), copy_bytes=copy_bytes,
                 matmul_sizes=tuple(matmul_sizes) if matmul_sizes else None, busy_window_s=float(busy_window_s))
    if group is not None:
        return _profile_on(group, cluster, plan, timeout_s)
    from runtime.group import WorkerGroup  # ray: only when a group must be started

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
