"""stage_dp kernels: numba == pure-Python twin == brute force.

Hypothesis draws small instances with dyadic costs (every sum exact, so ties
are real and the tie-breaking must agree to the last stage); seeded numpy
instances add continuous costs, medium sizes (checked against solving the DP
at every t_max, as Alpa's shipped code does) and the error paths.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from stage_dp import (
    NoFeasiblePlanError,
    brute_force_cluster_layers,
    brute_force_stage_dp,
    cluster_layers,
    cluster_layers_detailed,
    solve_stage_dp,
)
from stage_dp import dp as dp_mod
from stage_dp.kernels import NO_NUMBA_ENV, kernels

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _outcome(fn, *args, **kwargs):
    """(total, t_max, sum, stages) or the string 'infeasible'."""
    try:
        r = fn(*args, **kwargs)
    except NoFeasiblePlanError:
        return "infeasible"
    return (r.total_s, r.t_max_s, r.sum_s, r.stages)


def _check_plan(res, cost, mns, sizes, num_devices, num_microbatches):
    """The returned stages are a valid plan whose own T, max and sum are the reported ones."""
    stages = res.stages
    assert stages[0][0] == 0 and stages[-1][1] == cost.shape[0] - 1
    assert all(a[1] + 1 == b[0] for a, b in zip(stages, stages[1:]))
    assert sum(int(sizes[s]) for _, _, s, _ in stages) == num_devices
    costs = [cost[l, i, s, c] for l, i, s, c in stages]
    assert all(mns[l, i, s, c] >= len(stages) - 1 - k for k, (l, i, s, c) in enumerate(stages))
    sum_s = 0.0
    for t in reversed(costs):
        sum_s = t + sum_s
    assert (res.sum_s, res.t_max_s) == (sum_s, max(costs))
    assert res.total_s == sum_s + (num_microbatches - 1) * max(costs)


# ----------------------------------------------------------------------------- stage DP
@st.composite
def dp_instances(draw):
    num_layers = draw(st.sampled_from([4, 3, 5, 2, 1]))  # favour several stages
    num_sub = draw(st.integers(1, 2 if num_layers == 5 else 3))
    num_cfg = draw(st.integers(1, 1 if num_layers == 5 else 2))
    shape = (num_layers, num_layers, num_sub, num_cfg)
    finite = (st.sampled_from([1.0, 2.0, 3.0, 4.0]) if draw(st.booleans())
              else st.integers(1, 2 ** 20).map(lambda k: k / 1024.0))  # dyadic: exact sums
    cost = draw(hnp.arrays(np.float64, shape, elements=finite))
    absent = draw(hnp.arrays(bool, shape, elements=st.integers(0, 5).map(lambda k: k == 0)))
    cost[absent] = np.inf
    mns = draw(hnp.arrays(np.int64, shape, elements=st.sampled_from([3, 2, 1, 0, -1])))
    sizes = draw(hnp.arrays(np.int64, (num_sub,), elements=st.sampled_from([1, 1, 2, 3])))
    # mostly a D that some choice of one submesh per stage tiles, sometimes any D
    picks = draw(st.lists(st.integers(0, num_sub - 1), min_size=max(1, num_layers - 2),
                          max_size=num_layers))
    devices = draw(st.sampled_from([int(sizes[picks].sum()), 1, 2, 3, 4]))
    return dict(stage_cost_s=cost, max_n_succ_stages=mns, submesh_sizes=sizes,
                num_devices=devices, num_microbatches=draw(st.integers(1, 16)),
                max_stages=draw(st.none() | st.integers(1, 4)))


@SETTINGS
@given(dp_instances())
def test_stage_dp_numba_python_brute_force_agree(inst):
    expected = _outcome(brute_force_stage_dp, **inst)
    assert _outcome(solve_stage_dp, **inst, use_numba=False) == expected
    assert _outcome(solve_stage_dp, **inst, use_numba=True) == expected
    if expected != "infeasible":
        res = solve_stage_dp(**inst)
        _check_plan(res, inst["stage_cost_s"], inst["max_n_succ_stages"],
                    inst["submesh_sizes"], inst["num_devices"], inst["num_microbatches"])


def _random_instance(rng, num_layers, num_sub, num_cfg, inf_frac=0.1, mns_hi=4):
    shape = (num_layers, num_layers, num_sub, num_cfg)
    cost = rng.random(shape) * 10
    cost[rng.random(shape) < inf_frac] = np.inf
    return cost, rng.integers(-1, mns_hi, shape), rng.integers(1, 5, num_sub)


def test_stage_dp_continuous_costs_match_brute_force():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(60):
        num_layers = int(rng.integers(1, 6))
        cost, mns, sizes = _random_instance(rng, num_layers, int(rng.integers(1, 3)), 2)
        args = (cost, mns, sizes, int(rng.integers(1, 5)), int(rng.integers(1, 64)))
        expected = _outcome(brute_force_stage_dp, *args)
        assert _outcome(solve_stage_dp, *args, use_numba=True) == expected
        assert _outcome(solve_stage_dp, *args, use_numba=False) == expected
        checked += expected != "infeasible"
    assert checked >= 20


def test_stage_dp_minimises_a_schedules_step_time_with_its_own_weights():
    """ZB-H1 weighs the stages' sum by 1/3 (``core/schedule.py``): the DP's optimum is brute force's,
    and the schedule's step time of its stages is 1/3 of the DP's total (one optimum for both)."""
    from alpa_torch.core.schedule import schedule_named

    zb, rng, checked = schedule_named("zb-h1"), np.random.default_rng(1), 0
    for _ in range(40):
        num_layers = int(rng.integers(1, 6))
        cost, mns, sizes = _random_instance(rng, num_layers, int(rng.integers(1, 3)), 2)
        args = (cost, mns, sizes, int(rng.integers(1, 5)), int(rng.integers(1, 64)))
        expected = _outcome(brute_force_stage_dp, *args, schedule=zb)
        assert _outcome(solve_stage_dp, *args, schedule=zb, use_numba=False) == expected
        if expected != "infeasible":
            res = solve_stage_dp(*args, schedule=zb)
            times = [cost[i, j, s, c] for i, j, s, c in res.stages]
            assert zb.step_time(times, args[4]) == pytest.approx(res.total_s * zb.sum_weight(args[4]))
            checked += 1
    assert checked >= 10


def test_stage_dp_integer_costs_many_stages_ties_match_brute_force():
    """Small-integer costs on many 1-2 device stages: ties everywhere, tie-breaks must agree."""
    rng = np.random.default_rng(1)
    multi = 0
    for _ in range(150):
        num_layers, num_sub = int(rng.integers(2, 6)), int(rng.integers(1, 3))
        shape = (num_layers, num_layers, num_sub, int(rng.integers(1, 3)))
        cost = rng.integers(1, 4, shape).astype(np.float64)
        cost[rng.random(shape) < 0.1] = np.inf
        mns = rng.integers(-1, num_layers, shape)
        sizes = rng.integers(1, 3, num_sub)
        devices = int(sizes[rng.integers(0, num_sub, rng.integers(2, num_layers + 1))].sum())
        args = (cost, mns, sizes, devices, int(rng.integers(1, 9)))
        expected = _outcome(brute_force_stage_dp, *args)
        assert _outcome(solve_stage_dp, *args, use_numba=True) == expected
        assert _outcome(solve_stage_dp, *args, use_numba=False) == expected
        multi += expected != "infeasible" and len(expected[3]) > 1
    assert multi >= 50


def _every_tmax(cost, mns, sizes, num_devices, num_microbatches):
    """min over every distinct cost t of G(t) + (B-1) t: Alpa's shipped, slow search."""
    k = kernels(True)
    cands = dp_mod.build_candidates(cost, mns, sizes, num_devices, None)
    best = (np.inf, np.inf)
    for t in np.unique(cands.ent_cost_s):
        g = dp_mod._table(k, cands, num_devices, t, False)[1:, 0, num_devices].min()
        best = min(best, (g + (num_microbatches - 1) * t, t))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_stage_dp_medium_equals_every_tmax_search(seed):
    rng = np.random.default_rng(100 + seed)
    num_layers, num_devices = int(rng.integers(6, 13)), int(rng.choice([8, 16]))
    span = np.arange(num_layers)[None, :] - np.arange(num_layers)[:, None] + 1.0
    sizes = np.array([1, 2, 4, 8, 16])
    cost = (span[:, :, None, None] / sizes[None, None, :, None]
            * (1 + 0.3 * rng.random((num_layers, num_layers, 5, 3))) + 0.05)
    mns = rng.integers(-1, num_layers, cost.shape)
    for b in (1, 4, 128):
        res = solve_stage_dp(cost, mns, sizes, num_devices, b)
        assert (res.total_s, res.t_max_s) == _every_tmax(cost, mns, sizes, num_devices, b)
        _check_plan(res, cost, mns, sizes, num_devices, b)
    assert solve_stage_dp(cost, mns, sizes, num_devices, 128, use_numba=False) == res


def test_stage_dp_gpt_bench_case_equals_every_tmax_search():
    path = os.path.join(os.path.dirname(__file__), "..", "bench", "stage_dp_kernels.py")
    spec = importlib.util.spec_from_file_location("bench_stage_dp_kernels", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cost, mns, sizes = bench.gpt_costs(24, 2)
    res = solve_stage_dp(cost, mns, sizes, 16, 128)
    assert (res.total_s, res.t_max_s) == _every_tmax(cost, mns, sizes, 16, 128)
    assert res == solve_stage_dp(cost, mns, sizes, 16, 128)  # deterministic


def test_stage_dp_infeasible_reasons():
    inf = np.full((2, 2, 1, 1), np.inf)
    ok = np.array([[[[1.0]], [[2.0]]], [[[np.inf]], [[1.0]]]])
    with pytest.raises(NoFeasiblePlanError, match="usable"):
        solve_stage_dp(inf, np.zeros(inf.shape, int), [1], 2, 4)
    with pytest.raises(NoFeasiblePlanError, match="memory"):
        # two 1-device stages are needed, but every candidate allows 0 successors
        solve_stage_dp(ok, np.zeros(ok.shape, int), [1], 2, 4)
    with pytest.raises(NoFeasiblePlanError, match="tiled"):
        solve_stage_dp(ok, np.ones(ok.shape, int), [2], 3, 4)
    with pytest.raises(NoFeasiblePlanError, match="at most 1 stage"):
        solve_stage_dp(ok, np.ones(ok.shape, int), [1], 2, 4, max_stages=1)
    assert solve_stage_dp(ok, np.ones(ok.shape, int), [1], 2, 4).stages == ((0, 0, 0, 0), (1, 1, 0, 0))


def test_stage_dp_rejects_bad_inputs():
    cost = np.ones((2, 2, 1, 1))
    with pytest.raises(ValueError, match="shape"):
        solve_stage_dp(np.ones((2, 3, 1, 1)), np.ones((2, 3, 1, 1), int), [1], 1, 1)
    with pytest.raises(ValueError, match="NaN"):
        solve_stage_dp(cost * np.nan, np.ones(cost.shape, int), [1], 1, 1)
    with pytest.raises(ValueError, match="submesh_sizes"):
        solve_stage_dp(cost, np.ones(cost.shape, int), [0], 1, 1)


def test_numba_switch_reads_env_var():
    code = "import stage_dp.kernels as k; print(k.numba_default(), k.resolve_use_numba(True))"
    env = {**os.environ, NO_NUMBA_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.join(os.path.dirname(__file__), ".."), check=True)
    assert out.stdout.split() == ["False", "True"]


# ----------------------------------------------------------------------------- clustering
@st.composite
def graphs(draw):
    n = draw(st.integers(1, 9))
    flop = (st.sampled_from([0.0, 1.0, 2.0, 5.0]) if draw(st.booleans())
            else st.integers(0, 2 ** 16).map(lambda k: k / 64.0))
    flops = draw(hnp.arrays(np.float64, (n,), elements=flop))
    pairs = st.integers(0, max(n - 2, 0)).flatmap(
        lambda a: st.tuples(st.just(a), st.integers(a + 1, n - 1), st.integers(0, 8)))
    edges = draw(st.lists(pairs, max_size=2 * n)) if n > 1 else []
    src, dst, nbytes = (np.array(x, np.int64) for x in zip(*edges)) if edges else \
        (np.zeros(0, np.int64),) * 3
    return dict(flops=flops, edge_src=src, edge_dst=dst, edge_bytes=nbytes,
                num_layers=draw(st.integers(1, n)),
                imbalance=draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])))


def _as_tuple(r):
    return (r.boundaries.tolist(), r.layer_flops.tolist(), r.layer_in_bytes.tolist(), r.imbalance)


@SETTINGS
@given(graphs())
def test_clustering_numba_python_brute_force_agree(g):
    expected = _as_tuple(brute_force_cluster_layers(**g))
    assert _as_tuple(cluster_layers_detailed(**g, use_numba=False)) == expected
    assert _as_tuple(cluster_layers_detailed(**g, use_numba=True)) == expected
    assert cluster_layers(**g).tolist() == expected[0]


def _random_graph(rng, n, fanin=2, window=20):
    flops = rng.random(n) * 1e9
    flops[rng.random(n) < 0.3] = 0.0  # views, reshapes: free ops
    src, dst = [], []
    for v in range(1, n):
        for u in sorted(set(rng.integers(max(0, v - window), v, fanin).tolist())):
            src.append(u)
            dst.append(v)
    return flops, np.array(src), np.array(dst), rng.integers(1, 1 << 20, len(src))


def test_clustering_medium_twins_agree_and_relaxation():
    rng = np.random.default_rng(7)
    flops, src, dst, nbytes = _random_graph(rng, 80)
    for layers, imb in ((6, 0.5), (10, 0.0), (80, 0.2)):
        fast = cluster_layers_detailed(flops, src, dst, nbytes, layers, imbalance=imb)
        slow = cluster_layers_detailed(flops, src, dst, nbytes, layers, imbalance=imb,
                                       use_numba=False)
        assert _as_tuple(fast) == _as_tuple(slow)
        assert fast.layer_flops.max() <= (1 + fast.imbalance) * flops.sum() / layers * (1 + 1e-12)
    heavy = np.array([10.0, 1.0, 1.0, 1.0])  # op 0 alone exceeds any cap below 2.5x
    assert cluster_layers_detailed(heavy, [0], [1], [1], 2, imbalance=0.0).imbalance == 1.0


def test_clustering_large_graph_is_fast():
    flops, src, dst, nbytes = _random_graph(np.random.default_rng(3), 4000)
    res = cluster_layers_detailed(flops, src, dst, nbytes, 96)
    assert res.boundaries[0] == 0 and np.all(np.diff(res.boundaries) > 0)
    assert res.layer_flops.sum() == pytest.approx(flops.sum())


def test_clustering_rejects_bad_inputs():
    with pytest.raises(ValueError, match="num_layers"):
        cluster_layers([1.0, 2.0], [], [], [], 3)
    with pytest.raises(ValueError, match="topological"):
        cluster_layers([1.0, 2.0], [1], [0], [4], 1)
    with pytest.raises(ValueError, match="flops"):
        cluster_layers([1.0, -2.0], [], [], [], 1)
