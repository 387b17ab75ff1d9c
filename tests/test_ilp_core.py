"""Intra-op ILP core against brute force: instance files, reductions, Pyomo + HiGHS solve, CLI.

Random small instances (<= 12 nodes, <= 4 strategies, random edges, followers,
tie groups, liveness and budgets) are solved by enumerating every assignment
(numpy, vectorised) and by ``solve_instance`` with and without reductions,
LP first or not. No torch needed.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from alpa_torch.core.errors import InfeasibleMemoryError
from intra_ilp.ilp import min_peak_memory, solve_instance
from intra_ilp.instance import ILPEdge, ILPInstance, ILPNode
from intra_ilp.reduce import ContradictoryConstraintsError, reduce_instance

REPO = Path(__file__).resolve().parents[1]
MAX_ASSIGNMENTS = 20_000
SIZES = st.sampled_from([8, 12, 10, 6, 11, 4, 9, 2, 7, 1, 5, 3])  # st.integers would favour tiny graphs


def random_instance(seed: int, n: int, budget_kind: str) -> ILPInstance:
    """A random instance; ``budget_kind`` in inf / loose / tight / infeasible."""
    rng = np.random.default_rng(seed)
    ks = list(rng.integers(1, 5, size=n))
    while math.prod(ks) > MAX_ASSIGNMENTS:
        ks[int(np.argmax(ks))] -= 1
    integer = rng.random() < 0.4  # small integer costs create ties, dominance and separable edges

    def draw(*shape):
        return rng.integers(0, 4, size=shape).astype(float) if integer else rng.random(shape)

    nodes = [ILPNode(f"n{v}", [f"s{j}" for j in range(k)], draw(k), draw(k), rng.integers(0, 100, k) * 1.0)
             for v, k in enumerate(ks)]
    edges = []
    for _ in range(rng.integers(0, 2 * n + 1)):
        u, v = (int(x) for x in rng.integers(0, n, 2))
        m = draw(ks[u], ks[v]) if rng.random() < 0.8 else np.full((ks[u], ks[v]), 0.5)
        edges.append(ILPEdge(u, v, m))
    followers = []
    for _ in range(rng.integers(0, n // 3 + 1)):
        f, l = (int(x) for x in rng.choice(n, 2, replace=False)) if n > 1 else (0, 0)
        if f != l:
            mapping = rng.integers(0, ks[f], ks[l])
            mapping[rng.random(ks[l]) < 0.15] = -1
            followers.append((f, l, mapping))
    ties = []
    for k in set(ks):
        same = [v for v in range(n) if ks[v] == k]
        if len(same) > 1 and rng.random() < 0.5:
            ties.append([int(v) for v in rng.choice(same, rng.integers(2, len(same) + 1), replace=False)])
    liveness = [sorted(rng.choice(n, rng.integers(1, n + 1), replace=True).tolist()) for _ in range(rng.integers(0, 5))]
    inst = ILPInstance(nodes=nodes, edges=edges, followers=followers, tie_groups=ties, liveness=liveness,
                       constant_memory_bytes=float(rng.integers(0, 10)), metadata={"seed": seed})
    if budget_kind == "inf" or not liveness:
        return inst
    ref = brute_force(inst)
    if ref["min_peak"] is None:
        return inst
    lo, hi = ref["min_peak"], ref["max_peak"]
    budget = {"loose": hi + 1, "tight": lo + (hi - lo) * rng.random(), "infeasible": lo * 0.9 - 1}[budget_kind]
    return _with_budget(inst, budget if budget > 0 else lo + 1)


def _with_budget(inst: ILPInstance, budget: float) -> ILPInstance:
    return ILPInstance(nodes=inst.nodes, edges=inst.edges, followers=inst.followers, tie_groups=inst.tie_groups,
                       liveness=inst.liveness, constant_memory_bytes=inst.constant_memory_bytes,
                       memory_budget_bytes=budget, metadata=inst.metadata)


def brute_force(inst: ILPInstance) -> dict:
    """Optimum, min and max peak memory over every assignment obeying followers and ties."""
    ks = inst.num_strategies
    s = np.array(list(itertools.product(*[range(k) for k in ks])), dtype=np.int64).reshape(-1, len(ks))
    ok = np.ones(len(s), dtype=bool)
    for f in inst.followers:
        target = f.mapping[s[:, f.leader]]
        ok &= (target >= 0) & (s[:, f.follower] == target)
    for g in inst.tie_groups:
        ok &= np.all(s[:, g] == s[:, g[:1]], axis=1)
    cost = sum(v.compute_s[s[:, i]] + v.comm_s[s[:, i]] for i, v in enumerate(inst.nodes))
    cost = cost + sum((e.reshard_s[s[:, e.src], s[:, e.dst]] for e in inst.edges), np.zeros(len(s)))
    mem = [inst.constant_memory_bytes + sum((inst.nodes[v].memory_bytes[s[:, v]] for v in live), np.zeros(len(s)))
           for live in inst.liveness]
    peak = np.max(mem, axis=0) if mem else np.full(len(s), inst.constant_memory_bytes)
    fits = ok & (peak <= inst.memory_budget_bytes)
    return {"optimum": float(cost[fits].min()) if fits.any() else None,
            "min_peak": float(peak[ok].min()) if ok.any() else None,
            "max_peak": float(peak[ok].max()) if ok.any() else None}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-7, abs_tol=1e-9)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=SIZES,
       budget_kind=st.sampled_from(["inf", "loose", "tight", "tight", "infeasible"]))
@example(seed=441, n=7, budget_kind="tight")  # HiGHS's MIP after the LP gave another point's values
def test_ilp_matches_brute_force(seed: int, n: int, budget_kind: str) -> None:
    inst = random_instance(seed, n, budget_kind)
    ref = brute_force(inst)
    for reduce, lp_first in [(True, True), (False, True), (True, False), (False, False)]:
        if ref["min_peak"] is None:  # followers / ties contradict each other
            with pytest.raises(ContradictoryConstraintsError):
                solve_instance(inst, mip_gap=0.0, reduce=reduce, lp_first=lp_first)
        elif ref["optimum"] is None:
            with pytest.raises(InfeasibleMemoryError) as info:
                solve_instance(inst, mip_gap=0.0, reduce=reduce, lp_first=lp_first)
            assert _close(info.value.required_bytes, ref["min_peak"])
            assert "pipeline stages" in str(info.value) and "checkpointing" in str(info.value)
        else:
            sol = solve_instance(inst, mip_gap=0.0, reduce=reduce, lp_first=lp_first)
            assert _close(sol.objective_s, ref["optimum"]), (reduce, lp_first, sol, ref)
            assert not inst.violations(sol.strategy_index)
            assert sol.peak_memory_bytes <= inst.memory_budget_bytes * (1 + 1e-9)
            assert sol.status == "optimal" and sol.gap <= 1e-6
            assert _close(sol.objective_s, sol.compute_s + sol.comm_s + sol.reshard_s)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=SIZES, budget_kind=st.sampled_from(["inf", "tight"]))
def test_reduced_problem_prices_every_choice_exactly(seed: int, n: int, budget_kind: str) -> None:
    """For every reduced assignment: reduced objective == original objective of its expansion,
    kept memory rows == the original points, and the reduced optimum == brute force."""
    inst = random_instance(seed, n, budget_kind)
    ref = brute_force(inst)
    if ref["min_peak"] is None:
        return
    prob = reduce_instance(inst)
    best = math.inf
    for choice in itertools.product(*[range(k) for k in prob.num_strategies]):
        red = prob.offset_s + sum(float(prob.cost_s[i][s]) for i, s in enumerate(choice))
        red += sum(float(m[choice[a], choice[b]]) for a, b, m in prob.edges)
        full = prob.expand(choice)
        assert not inst.violations(full)
        assert _close(red, math.fsum(inst.cost_parts(full).values()))
        mem = inst.memory_at(full)
        rows_ok = True
        for row in prob.memory_rows:
            val = row.constant_bytes + sum(float(c[choice[i]]) for i, c in row.terms)
            assert _close(val, mem[row.point])
            rows_ok &= val <= prob.memory_budget_bytes
        if rows_ok:
            assert max(mem, default=0.0) <= inst.memory_budget_bytes  # dropped rows were implied
            best = min(best, red)
    if ref["optimum"] is not None:
        assert _close(best, ref["optimum"])


def test_tie_groups_shrink_to_one_layer() -> None:
    """24 identical chained layers reduce to the variables of about one layer."""
    rng = np.random.default_rng(0)
    layer = [rng.random(4) for _ in range(3)]
    nodes, edges, ties = [], [], [[] for _ in range(3)]
    for i in range(24):
        for j in range(3):
            ties[j].append(len(nodes))
            nodes.append(ILPNode(f"l{i}.{j}", ["a", "b", "c", "d"], layer[j], layer[j] * 0.1, np.ones(4)))
        base = 3 * i
        edges += [ILPEdge(base, base + 1, rng.random((4, 4))), ILPEdge(base + 1, base + 2, rng.random((4, 4)))]
        if i:
            edges.append(ILPEdge(base - 1, base, rng.random((4, 4))))
    inst = ILPInstance(nodes=nodes, edges=edges, tie_groups=ties)
    prob = reduce_instance(inst)
    assert len(prob.num_strategies) <= 3
    a, b = solve_instance(inst, mip_gap=0.0), solve_instance(inst, mip_gap=0.0, reduce=False)
    assert _close(a.objective_s, b.objective_s)


def test_infeasible_memory_reports_min_peak() -> None:
    nodes = [ILPNode(f"n{i}", ["R", "S"], [1.0, 2.0], [0.0, 0.5], [8.0, 4.0 + i]) for i in range(3)]
    inst = ILPInstance(nodes=nodes, edges=[ILPEdge(0, 1, [[0, 1], [1, 0]]), ILPEdge(1, 2, [[0, 1], [1, 0]])],
                       liveness=[[0, 1], [1, 2]], constant_memory_bytes=1.0, memory_budget_bytes=9.0)
    with pytest.raises(InfeasibleMemoryError) as info:
        solve_instance(inst)
    assert info.value.required_bytes == 12.0  # 1 + (4 + 1) + (4 + 2) at point 1, all sharded
    assert "12" in str(info.value) and "budget" in str(info.value)
    assert min_peak_memory(inst)[0] == 12.0
    assert solve_instance(_with_budget(inst, 12.0)).strategy_index == (1, 1, 1)


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_round_trip(tmp_path: Path, suffix: str) -> None:
    for seed in range(8):
        inst = random_instance(seed, 7, "tight")
        path = tmp_path / f"i{seed}{suffix}"
        inst.save(path)
        back = ILPInstance.load(path)
        assert back == inst
        assert back.to_json() == inst.to_json()  # bit-exact floats, same layout
        for a, b in zip(back.nodes, inst.nodes):
            assert a.compute_s.tobytes() == b.compute_s.tobytes()
    empty = ILPInstance(nodes=[ILPNode("only", ["R"], [1.0], [0.0], [0.0])], metadata={"mesh": [2, 4]})
    empty.save(tmp_path / f"e{suffix}")
    assert ILPInstance.load(tmp_path / f"e{suffix}") == empty
    assert json.loads(empty.to_json())["memory_budget_bytes"] is None


def test_invalid_instances_raise() -> None:
    node = ILPNode("a", ["R", "S"], [1, 2], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="shape"):
        ILPInstance(nodes=[node], edges=[ILPEdge(0, 0, np.zeros((2, 3)))])
    with pytest.raises(ValueError, match="mapping"):
        ILPInstance(nodes=[node, ILPNode("b", ["R"], [1], [0], [1])], followers=[(1, 0, [0, 1])])
    with pytest.raises(ValueError, match="own follower"):
        ILPInstance(nodes=[node], followers=[(0, 0, [0, 1])])
    with pytest.raises(ValueError, match="finite"):
        ILPNode("c", ["R"], [math.nan], [0], [0])
    with pytest.raises(ValueError, match="unique"):
        ILPInstance(nodes=[node, node])


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_cli(tmp_path: Path, suffix: str) -> None:
    inst = random_instance(3, 8, "tight")
    path = tmp_path / f"inst{suffix}"
    inst.save(path)
    proc = subprocess.run([sys.executable, "-m", "intra_ilp.solve", str(path), "--gap", "0", "--time-limit", "20"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 1, f"stdout holds more than the solution: {proc.stdout[:500]}"
    out = json.loads(proc.stdout)
    ref = solve_instance(inst, mip_gap=0.0)
    assert _close(out["objective_s"], ref.objective_s) and out["status"] == "optimal"
    assert list(out["strategies"]) == [v.name for v in inst.nodes]
    assert all(out["strategies"][v.name] in v.strategy_names for v in inst.nodes)
    bad = _with_budget(inst, 1.0)
    bad.save(path)
    proc = subprocess.run([sys.executable, "-m", "intra_ilp.solve", str(path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and json.loads(proc.stdout)["status"] == "infeasible_memory"


def synthetic_gpt_instance(num_layers: int = 24, *, seed: int = 0, nodes_per_layer: int = 30,
                           memory_budget_bytes: float = math.inf) -> ILPInstance:
    """An instance shaped like a GPT training graph: identical layers of ``nodes_per_layer`` nodes
    with 4-16 strategies, a chain plus residual and attention edges, elementwise followers,
    tie groups across layers, and forward/backward liveness with saved activations."""
    rng = np.random.default_rng(seed)
    p = nodes_per_layer
    ks = [int(rng.choice([4, 8, 16])) for _ in range(p)]
    follow = {j: j - 1 for j in range(4, p, 5)}  # elementwise ops after a matmul-like op
    for j, l in follow.items():
        ks[j] = ks[l]
    shard = [rng.choice([1, 2, 4, 8], size=k) for k in ks]  # shard factor of each strategy
    base_compute, base_mem = rng.uniform(1e-4, 1e-2, p), rng.uniform(1e6, 1e8, p)
    comm = [rng.random(k) * 2e-3 * (rng.random(k) < 0.5) for k in ks]

    def reshard(ku: int, kv: int) -> np.ndarray:
        m = rng.uniform(1e-4, 4e-3, (ku, kv)) * (rng.random((ku, kv)) < 0.8)
        np.fill_diagonal(m, 0.0)
        return m

    saved = [j for j in (1, 6, 12, 18, 24) if j < p]  # forward outputs kept for the backward half
    inner = [(j, j + 1) for j in range(p - 1)] + [(0, p // 2), (p // 2, p - 1), (2, 5), (3, 5)]
    inner += [(j, p - 1 - j) for j in saved if j < p // 2]  # saved activation -> its backward op
    inner_m = {(u, v): reshard(ks[u], ks[v]) for u, v in inner}
    cross = {(p - 1, 0): reshard(ks[-1], ks[0]), (p - 1, p // 2): reshard(ks[-1], ks[p // 2])}
    nodes, edges, followers, ties = [], [], [], [[] for _ in range(p)]
    for i in range(num_layers):
        for j in range(p):
            ties[j].append(len(nodes))
            nodes.append(ILPNode(f"l{i}.op{j}", [f"st{s}" for s in range(ks[j])], base_compute[j] / shard[j],
                                 comm[j], base_mem[j] / shard[j]))
        b = i * p
        edges += [ILPEdge(b + u, b + v, m) for (u, v), m in inner_m.items()]
        edges += [ILPEdge(b - p + u, b + v, m) for (u, v), m in cross.items() if i]
        followers += [(b + j, b + l, np.arange(ks[l])) for j, l in follow.items()]
    fwd = [[i * p + j for i in range(t + 1) for j in saved] + [t * p + p - 1] for t in range(num_layers)]
    liveness = fwd + [live[:-1] + [t * p] for t, live in reversed(list(enumerate(fwd)))]
    return ILPInstance(nodes=nodes, edges=edges, followers=followers, tie_groups=[g for g in ties if len(g) > 1],
                       liveness=liveness, constant_memory_bytes=2e8, memory_budget_bytes=memory_budget_bytes,
                       metadata={"model": f"synthetic-gpt-{num_layers}l", "nodes_per_layer": p, "seed": seed})


@pytest.mark.parametrize("budget", ["inf", "binding"])
def test_synthetic_gpt_reduced_equals_direct(budget: str) -> None:
    inst = synthetic_gpt_instance(2)
    if budget == "binding":
        free = solve_instance(inst, mip_gap=0.0)
        low = min_peak_memory(inst)[0]
        inst = _with_budget(inst, (free.peak_memory_bytes + low) / 2)
    a = solve_instance(inst, mip_gap=0.0)
    b = solve_instance(inst, mip_gap=0.0, reduce=False)
    assert a.extra["reduced_vars"] <= 30 < b.extra["reduced_vars"]
    assert _close(a.objective_s, b.objective_s), (a.objective_s, b.objective_s)


@pytest.mark.sweep
def test_synthetic_gpt_24_layers() -> None:
    inst = synthetic_gpt_instance(24)
    sol = solve_instance(inst, mip_gap=0.0)
    assert sol.extra["reduced_vars"] <= 30 and sol.build_s < 30
    low = min_peak_memory(inst)[0]
    tight = solve_instance(_with_budget(inst, (sol.peak_memory_bytes + low) / 2), mip_gap=0.0)
    assert tight.objective_s >= sol.objective_s and tight.peak_memory_bytes <= (sol.peak_memory_bytes + low) / 2
