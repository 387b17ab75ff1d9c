"""Inter-operator stage DP (Alpa OSDI'22 §5.1, eq. 2-5), exact and fast.

Owns: choosing how to slice L layers into pipeline stages and which submesh
shape and logical-mesh config each stage gets, given per-candidate costs.
Does not own: producing the costs (``stage_dp/search`` asks ``intra_ilp``),
the submesh enumeration (``alpa_torch`` Cluster) or the schedule (runtime).

Problem. ``cost[l, i, s, c]`` is the latency of one microbatch (forward and
backward) of stage = layers l..i on submesh shape s (``size[s]`` devices) with
config c; ``mns[l, i, s, c]`` the most stages that may follow it (the schedule's
microbatches in flight grow with the stages after a stage), -1 = never. A plan is
stages k = 0..K-1 covering 0..L-1 in order, with

    sum_k size[s_k] = D,   mns_k >= K-1-k,   K <= max_stages,
    T = sum_k t_k + w * max_k t_k

with ``w`` the pipeline schedule's weight of its slowest stage over that of the stages' sum
(``max_weight / sum_weight``, from ``alpa_torch.core.schedule``; B - 1 for GPipe and 1F1B: Alpa
eq. 2); the schedule's step time is ``sum_weight`` times this T, so both have one optimum.

Algorithm. For a bound t, F_t[q, l, d] (``kernels.stage_dp_table``) is the
least sum of stage costs over slicings of layers l..L-1 into q stages on
exactly d devices with every t_k <= t (eq. 3-5); G(t) = min_q F_t[q, 0, D]
is non-increasing in t, and min_t G(t) + w t over the distinct costs t
is the optimum T*. Instead of one DP per t (Alpa's shipped code):

1. one bottleneck DP (max instead of +) gives t_feas, the least feasible t;
2. T(t) >= G_lb + w t, where G_lb is a device- and memory-free bound, so
   only t in [t_feas, t_hi] with G_lb + w t_hi < T(t_feas) can win;
3. bisection over that window of sorted costs: an open interval (t_a, t_b)
   with G(t_a), G(t_b) known has T(t) >= G(t_b) + w t_{a+1}; it is
   dropped when that bound cannot beat the best, or when G(t_a) = G(t_b)
   (G constant there, so t_a is at least as good); else its middle is solved.

Each DP collapses the config axis (per (l, i, s) only configs not dominated
in (cost, mns) are kept) and skips candidates above t.

Ties (deterministic): least T, then least max t_k, then least sum (all fixed
by the smallest optimal t), then fewest stages, then the lexicographically
smallest tuple of (start, end, submesh, config) stages. Sums are taken from
the last stage backwards (t_0 + (t_1 + (...))) by the DP and by the brute
force alike, so results agree to the bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from alpa_torch.core.schedule import DEFAULT_SCHEDULE, PipelineSchedule, schedule_named

from .kernels import kernels, resolve_use_numba

logger = logging.getLogger(__name__)


class NoFeasiblePlanError(ValueError):
    """No slicing of the layers into stages satisfies devices, memory and stage limits."""


@dataclass(frozen=True, slots=True)
class StageDPResult:
    """The optimal pipeline plan found by the stage DP."""

    total_s: float
    """Step latency T = sum_s + w * t_max_s (module docstring)."""
    t_max_s: float
    """Latency of the slowest stage."""
    sum_s: float
    """Sum of the stage latencies."""
    stages: tuple[tuple[int, int, int, int], ...]
    """(start_layer, end_layer_inclusive, submesh_index, config_index) in pipeline order."""
    num_tmax_evaluated: int
    """Number of sum DPs solved (one per t_max tried)."""


@dataclass(frozen=True, slots=True)
class _Candidates:
    """Usable stage candidates grouped by (l, i, s) for the kernels (see stage_dp_table)."""

    grp_start: np.ndarray  # int64 [L+1]
    grp_end: np.ndarray    # int64 [G] end layer i
    grp_size: np.ndarray   # int64 [G] devices of submesh s
    grp_sub: np.ndarray    # int64 [G] submesh index s
    ent_start: np.ndarray  # int64 [G+1]
    ent_cost_s: np.ndarray  # float64 [E]
    ent_mns: np.ndarray    # int64 [E], clamped to q_cap - 1
    ent_cfg: np.ndarray    # int64 [E]
    q_max: int             # most stages worth tabulating


def validate_inputs(stage_cost_s, max_n_succ_stages, submesh_sizes, num_devices,
                    num_microbatches, max_stages):
    """Checked float64 / int64 copies of the inputs; ValueError names the bad one."""
    cost = np.asarray(stage_cost_s, dtype=np.float64)
    mns = np.asarray(max_n_succ_stages)
    sizes = np.asarray(submesh_sizes)
    if cost.ndim != 4 or cost.shape[0] != cost.shape[1] or cost.shape[0] == 0:
        raise ValueError(f"stage_cost_s must have shape [L, L, S, C] with L >= 1, got {cost.shape}")
    if mns.shape != cost.shape or not np.issubdtype(mns.dtype, np.integer):
        raise ValueError(f"max_n_succ_stages must be integer with shape {cost.shape}, "
                         f"got {mns.dtype} {mns.shape}")
    if sizes.shape != (cost.shape[2],) or not np.issubdtype(sizes.dtype, np.integer) \
            or (sizes < 1).any():
        raise ValueError(f"submesh_sizes must be {cost.shape[2]} positive ints, got {sizes!r}")
    if np.isnan(cost).any():
        raise ValueError("stage_cost_s contains NaN; use inf for absent candidates")
    if int(num_devices) < 1 or int(num_microbatches) < 1:
        raise ValueError(f"num_devices and num_microbatches must be >= 1, "
                         f"got {num_devices}, {num_microbatches}")
    if max_stages is not None and int(max_stages) < 1:
        raise ValueError(f"max_stages must be >= 1 or None, got {max_stages}")
    return cost, mns.astype(np.int64), sizes.astype(np.int64)


def usable_mask(cost, mns, sizes, num_devices):
    """bool [L, L, S, C]: l <= i, finite cost, mns >= 0, submesh fits in D."""
    num_layers = cost.shape[0]
    upper = np.arange(num_layers)[:, None] <= np.arange(num_layers)[None, :]
    return (upper[:, :, None, None] & np.isfinite(cost) & (mns >= 0)
            & (sizes <= num_devices)[None, None, :, None])


def build_candidates(cost, mns, sizes, num_devices, max_stages) -> _Candidates:
    """Group usable candidates by (l, i, s); keep configs not dominated in (cost, mns)."""
    num_layers, _, num_sub, _ = cost.shape
    q_cap = min(num_layers, num_devices // int(sizes.min()), max_stages or num_layers)
    l_idx, i_idx, s_idx, c_idx = np.nonzero(usable_mask(cost, mns, sizes, num_devices))
    ent_cost = cost[l_idx, i_idx, s_idx, c_idx]
    ent_mns = np.minimum(mns[l_idx, i_idx, s_idx, c_idx], q_cap - 1)
    gkey = (l_idx * num_layers + i_idx) * num_sub + s_idx
    order = np.lexsort((c_idx, ent_cost, gkey))  # by group, then cost, then config
    gkey, ent_cost, ent_mns, c_idx = gkey[order], ent_cost[order], ent_mns[order], c_idx[order]
    # Keep an entry iff its mns beats every cheaper entry of its group:
    # segmented running max via a per-group offset (mns in [0, q_cap-1]).
    _, gid = np.unique(gkey, return_inverse=True)
    shifted = ent_mns + gid * q_cap
    prev_max = np.concatenate(([-1], np.maximum.accumulate(shifted)[:-1]))
    keep = shifted > prev_max
    gkey, ent_cost, ent_mns, c_idx = gkey[keep], ent_cost[keep], ent_mns[keep], c_idx[keep]
    first = np.flatnonzero(np.r_[True, gkey[1:] != gkey[:-1]]) if gkey.size else np.zeros(0, int)
    g_lis = gkey[first]
    grp_l, grp_i, grp_s = g_lis // (num_layers * num_sub), (g_lis // num_sub) % num_layers, g_lis % num_sub
    q_max = min(q_cap, int(ent_mns.max()) + 1) if ent_mns.size else 0
    return _Candidates(
        grp_start=np.searchsorted(grp_l, np.arange(num_layers + 1)).astype(np.int64),
        grp_end=grp_i.astype(np.int64), grp_size=sizes[grp_s].astype(np.int64),
        grp_sub=grp_s.astype(np.int64),
        ent_start=np.r_[first, gkey.size].astype(np.int64),
        ent_cost_s=np.ascontiguousarray(ent_cost), ent_mns=ent_mns.astype(np.int64),
        ent_cfg=c_idx.astype(np.int64), q_max=q_max)


def slowest_weight(schedule: PipelineSchedule | None, num_microbatches: int) -> float:
    """w of the module docstring: ``schedule``'s (default: the default schedule's) for B microbatches."""
    schedule, b = schedule or schedule_named(DEFAULT_SCHEDULE), int(num_microbatches)
    return float(schedule.max_weight(b) / schedule.sum_weight(b))


def _table(k, cands: _Candidates, num_devices, t_max_s, bottleneck):
    return k.stage_dp_table(float(t_max_s), bool(bottleneck), cands.q_max, int(num_devices),
                            cands.grp_start, cands.grp_end, cands.grp_size,
                            cands.ent_start, cands.ent_cost_s, cands.ent_mns)


def _sum_lower_bound(cost, usable):
    """Least sum of stage costs over all slicings, ignoring devices and memory."""
    num_layers = cost.shape[0]
    best = np.where(usable, cost, np.inf).min(axis=(2, 3))  # [L, L]
    tail = np.full(num_layers + 1, np.inf)
    tail[num_layers] = 0.0
    for l in range(num_layers - 1, -1, -1):
        tail[l] = np.min(best[l, l:] + tail[l + 1:])
    return tail[0]


def _better(total_s, t_s, best):
    return best is None or total_s < best[0] or (total_s == best[0] and t_s < best[1])


def _search_tmax(k, cands, num_devices, b1, ts, a_idx, g_lb):
    """Bisection over sorted costs ``ts[a_idx:]`` (a_idx = t_feas), ``b1`` the weight w of the
    slowest stage; returns best state."""
    g_at = {}

    def evaluate(idx):
        f = _table(k, cands, num_devices, ts[idx], False)
        g_at[idx] = float(f[1:, 0, num_devices].min())
        total_s = g_at[idx] + b1 * ts[idx]
        nonlocal best
        if _better(total_s, ts[idx], best):
            best = (total_s, ts[idx], f)

    best = None
    evaluate(a_idx)
    # T(t) >= g_lb + w t, non-decreasing in t: the window is a prefix.
    hi_idx = max(a_idx, a_idx + int(np.count_nonzero(g_lb + b1 * ts[a_idx:] < best[0])) - 1)
    stack = []
    if hi_idx > a_idx:
        evaluate(hi_idx)
        stack.append((a_idx, hi_idx))
    while stack:
        a, b = stack.pop()
        if b - a <= 1 or g_at[a] == g_at[b]:
            continue
        bound_s = g_at[b] + b1 * ts[a + 1]
        if bound_s > best[0] or (bound_s == best[0] and ts[a + 1] >= best[1]):
            continue
        mid = (a + b) // 2
        evaluate(mid)
        stack.extend(((mid, b), (a, mid)))  # left half first: small t wins when B is large
    return best, len(g_at)


def _diagnose(k, cost, mns, sizes, num_devices, max_stages) -> str:
    """Why no plan exists, for the NoFeasiblePlanError message."""
    num_layers = cost.shape[0]
    usable = usable_mask(cost, mns, sizes, num_devices)
    limit = f" in at most {max_stages} stage(s)" if max_stages else ""
    if not usable.any():
        return ("no stage candidate is usable: every one has an infinite cost, "
                "max_n_succ_stages = -1, or a submesh larger than the "
                f"{num_devices} devices; profile more candidates or add devices")
    free = build_candidates(cost, np.where(mns >= 0, num_layers, mns), sizes, num_devices,
                            max_stages)
    if np.isfinite(_table(k, free, num_devices, np.inf, True)[1:, 0, num_devices]).any():
        return (f"slicings tiling the {num_devices} devices exist{limit}, but none fits in "
                "device memory: every one has a stage followed by more stages than its "
                "max_n_succ_stages allows (a stage holds more microbatches of activations the more "
                "stages follow it); use more devices, smaller microbatches or rematerialisation")
    return (f"the {num_devices} devices cannot be tiled exactly by submeshes of sizes "
            f"{sorted(set(sizes.tolist()))} over stages of finite cost covering all "
            f"{num_layers} layers{limit}; check the cluster and the submesh list")


def solve_stage_dp(stage_cost_s, max_n_succ_stages, submesh_sizes, num_devices,
                   num_microbatches, *, schedule: PipelineSchedule | None = None, max_stages=None,
                   use_numba=None) -> StageDPResult:
    """Optimal stage slicing (module docstring); raises NoFeasiblePlanError if none.

    ``schedule`` gives w (``slowest_weight``); default: the default schedule.

    stage_cost_s float [L, L, S, C] (inf = absent), max_n_succ_stages int
    [L, L, S, C] (-1 = never), submesh_sizes int [S]; entries with i < l ignored.
    """
    cost, mns, sizes = validate_inputs(stage_cost_s, max_n_succ_stages, submesh_sizes,
                                       num_devices, num_microbatches, max_stages)
    k = kernels(resolve_use_numba(use_numba))
    num_devices = int(num_devices)
    cands = build_candidates(cost, mns, sizes, num_devices, max_stages)
    t_feas_s = np.inf
    if cands.q_max > 0:
        t_feas_s = float(_table(k, cands, num_devices, np.inf, True)[1:, 0, num_devices].min())
    if not np.isfinite(t_feas_s):
        raise NoFeasiblePlanError(_diagnose(k, cost, mns, sizes, num_devices, max_stages))
    ts = np.unique(cands.ent_cost_s)
    g_lb = _sum_lower_bound(cost, usable_mask(cost, mns, sizes, num_devices))
    (total_s, t_max_s, f), n_eval = _search_tmax(
        k, cands, num_devices, slowest_weight(schedule, num_microbatches), ts,
        int(np.searchsorted(ts, t_feas_s)), g_lb)
    sums = f[1:, 0, num_devices]
    q_best = int(np.flatnonzero(sums == sums.min())[0]) + 1
    stages = k.stage_dp_trace(f, q_best, float(t_max_s), cands.grp_start, cands.grp_end,
                              cands.grp_size, cands.grp_sub, cands.ent_start,
                              cands.ent_cost_s, cands.ent_mns, cands.ent_cfg)
    assert (stages >= 0).all(), "trace must follow the table it was built from"
    logger.debug("stage DP: L=%d D=%d B=%d -> T=%.6g s, %d stages, %d of %d t_max solved",
                 cost.shape[0], num_devices, num_microbatches, total_s, q_best, n_eval, ts.size)
    return StageDPResult(total_s=float(total_s), t_max_s=float(t_max_s), sum_s=float(sums.min()),
                         stages=tuple(tuple(int(x) for x in row) for row in stages),
                         num_tmax_evaluated=n_eval)
