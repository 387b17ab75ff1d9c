"""Ray device workers: start-up, collectives through callables, persistent state, failure, clean shutdown.

The worker-group tests share one Ray (``ray_session``) and start their own
1x2 local group each (about 4 s on 2 cores); the resource-plan and auth tests
need no Ray at all.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from alpa_torch.core.cluster import Cluster
from alpa_torch.core.errors import ClusterSpecError, WorkerError
from runtime.group import KEEP_WORKERS_ENV, WorkerGroup, _alive
from runtime.ray_env import _configure_token_auth, alive_nodes, plan_resources


def _all_reduce_rank_plus_one(state):
    """Every rank contributes rank + 1; returns the sum as a torch tensor (the worker sends numpy)."""
    import torch
    import torch.distributed as dist

    x = torch.full((4,), float(state["rank"] + 1))
    dist.all_reduce(x)
    return x


def _wait_gone(pids, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def group(ray_session):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(KEEP_WORKERS_ENV, raising=False)  # the tests keep workers (conftest.py); a user's group does not
        with WorkerGroup.start(Cluster.local(1, 2), timeout_s=120) as g:
            yield g
    assert _wait_gone(g.pids()) == [], "worker processes outlived shutdown()"


# --------------------------------------------------------------- with workers
def test_one_process_per_device(group):
    pids = group.pids()
    assert len(pids) == 2 and len(set(pids)) == 2 and os.getpid() not in pids
    assert [i.rank for i in group.infos] == [0, 1] and {i.host_index for i in group.infos} == {0}
    assert set(group.startup_s) == {"ray", "placement", "actors", "process_group"}
    def threads(state):
        import torch

        return os.environ["OMP_NUM_THREADS"], torch.get_num_threads()

    assert group.call_all(threads) == [("1", 1), ("1", 1)]


def test_all_reduce_through_callable_returns_numpy(group):
    results = group.call_all(_all_reduce_rank_plus_one)
    for out in results:
        assert isinstance(out, np.ndarray)  # tensors come back as numpy, never pickled tensors
        np.testing.assert_array_equal(out, np.full(4, 3.0, dtype=np.float32))


def test_state_persists_and_args_reach_each_rank(group):
    class Counter:  # stands in for the lead's compiled program object
        def __init__(self, start):
            self.count = start

        def step(self, by):
            self.count += by
            return self.count

    def install(state, start):
        state["program"] = Counter(start + state["rank"])

    def step(state, by, scale=1):
        return state["program"].step(by) * scale

    group.call_all(install, 10)
    assert group.call_all(step, 1) == [11, 12]
    assert group.call_all(step, per_rank_args=[(5,), (7,)], scale=2) == [32, 38]
    assert group.call(1, step, 0) == 19 and group.call(0, step, 0) == 16

    big = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: goes through the object store once
    assert group.call_all(lambda state, a: float(a.sum()), big) == [float(big.sum())] * 2
    assert group.call_all(lambda state, *, a: float(a[-1]), a=big) == [float(big[-1])] * 2


def test_error_in_callable_names_rank_and_shuts_down(ray_session):
    g = WorkerGroup.start(Cluster.local(1, 2), timeout_s=120)
    pids = g.pids()

    def fail_on_rank_1(state):
        if state["rank"] == 1:
            raise ValueError("bad shape on purpose")
        return state["rank"]

    with pytest.raises(WorkerError, match=r"rank\(s\) \[1\].*\n.*ValueError: bad shape on purpose"):
        g.call_all(fail_on_rank_1, timeout_s=30)
    with pytest.raises(WorkerError, match="shut down"):
        g.call_all(fail_on_rank_1)
    assert _wait_gone(pids) == []


def test_kept_workers_are_taken_cleared_by_the_next_start_of_the_same_cluster(ray_session, monkeypatch):
    monkeypatch.setenv(KEEP_WORKERS_ENV, "1")

    def deploy(state):  # what a deployment leaves: state entries and a running rest
        state["program"] = object()

    def left(state):
        return sorted(state)

    first = WorkerGroup.start(Cluster.local(1, 2), timeout_s=120)
    pids = first.pids()
    first.call_all(deploy)
    first.call_all(lambda state, *, answer: answer(state["rank"]), answer_early=True)
    first.shutdown()
    with pytest.raises(WorkerError, match="shut down"):  # the old handle is closed, as without keeping
        first.call_all(left)
    assert all(_alive(p) for p in pids)

    second = WorkerGroup.start(Cluster.local(1, 2), timeout_s=120)
    try:
        assert second.pids() == pids and "kept" in second.startup_s and "actors" not in second.startup_s
        own = ["device", "host_index", "memory_started", "rank", "world_size"]
        assert second.call_all(left) == [own] * 2
        np.testing.assert_array_equal(second.call_all(_all_reduce_rank_plus_one)[0], np.full(4, 3.0))
    finally:
        second.shutdown()
    with WorkerGroup.start(Cluster.local(1, 1), timeout_s=120) as other:  # another cluster: a new worker
        assert other.pids()[0] not in pids and "actors" in other.startup_s
        assert _wait_gone(pids) == [], "the kept workers were shut down for the other cluster"
    monkeypatch.delenv(KEEP_WORKERS_ENV)
    with WorkerGroup.start(Cluster.local(1, 1), timeout_s=120) as fresh:  # not kept, not taken
        assert "actors" in fresh.startup_s
    assert _wait_gone(fresh.pids()) == []


def test_workers_holding_too_many_process_groups_are_not_kept(ray_session, monkeypatch):
    monkeypatch.setenv(KEEP_WORKERS_ENV, "1")
    monkeypatch.setattr("runtime.group._KEEP_MAX_GROUPS", 2)

    def make_groups(state, n):
        import torch.distributed as dist

        state["groups"] = [dist.new_group([0, 1]) for _ in range(n)]

    with WorkerGroup.start(Cluster.local(1, 2), timeout_s=120) as g:
        g.call_all(make_groups, 3)
    assert _wait_gone(g.pids()) == []


def test_an_early_answer_returns_before_the_rest_and_the_next_call_waits_for_it():
    """``run_early`` (a step answers with its loss after the forward) on a worker in this process:
    the answer comes back while the rest still runs, and the next call starts only after it."""
    import threading

    from runtime.worker import DeviceWorker

    w = DeviceWorker(0, 0, threads=1)
    release, log = threading.Event(), []

    def step(state, x, answer):
        answer(x + 1)
        release.wait(10)  # the "backward and update", held until the test lets it go
        log.append("rest done")
        return "final"

    assert w.run_early(step, 41) == 42
    assert log == []  # the answer came first
    threading.Timer(0.2, release.set).start()
    assert w.run(lambda state: list(log)) == ["rest done"]  # the next call saw the finished rest
    assert w.run_early(lambda state, answer: "never answered") == "never answered"  # no answer: its result


def test_a_failure_after_the_early_answer_is_raised_by_the_next_call(ray_session):
    g = WorkerGroup.start(Cluster.local(1, 2), timeout_s=120)
    pids = g.pids()

    def answer_then_fail_on_rank_1(state, *, answer):
        answer(state["rank"])
        if state["rank"] == 1:
            raise ValueError("backward broke on purpose")
        return state["rank"]

    assert g.call_all(answer_then_fail_on_rank_1, answer_early=True, timeout_s=30) == [0, 1]
    with pytest.raises(WorkerError, match=r"rank\(s\) \[1\][\s\S]*StepRestError: the previous call failed after it "
                                          r"had answered[\s\S]*ValueError: backward broke on purpose"):
        g.call_all(lambda state: state["rank"], timeout_s=30)
    assert _wait_gone(pids) == []


def test_killed_worker_raises_worker_error_naming_rank(ray_session):
    g = WorkerGroup.start(Cluster.local(1, 2), timeout_s=120)
    pids = g.pids()
    np.testing.assert_array_equal(g.call_all(_all_reduce_rank_plus_one)[0], np.full(4, 3.0))
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"failed on device rank\(s\) \[1(, 0)?\] \(died: \[1\]") as info:
        g.call_all(_all_reduce_rank_plus_one, timeout_s=30)
    assert time.monotonic() - t0 < 30
    assert "host 0" in str(info.value) and str(pids[1]) in str(info.value)
    assert _wait_gone(pids) == []  # the survivor (maybe stuck in the all_reduce) is killed too
    g.shutdown()  # idempotent


def test_busy_ray_times_out_with_a_clear_error(group):
    import ray

    if len(alive_nodes()) > 1:
        pytest.skip("needs a one-node Ray (the local session Ray)")
    ray_cpus = int(ray.cluster_resources()["CPU"])  # `group` holds 2 of them, so this cannot be reserved
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=rf"could not reserve {ray_cpus} bundle\(s\).*within 2 s: available"):
        WorkerGroup.start(Cluster.local(1, ray_cpus), timeout_s=2)
    assert time.monotonic() - t0 < 10
    assert group.call_all(_all_reduce_rank_plus_one)[0][0] == 3.0  # the running group is untouched


def test_cluster_larger_than_ray_fails_before_any_actor(ray_session):
    import ray

    before = len(ray.util.placement_group_table())
    with pytest.raises(ClusterSpecError, match=r"needs 2 Ray node\(s\) with >= 8 GPU"):
        WorkerGroup.start(Cluster.simulated(2, 8, "h100-80gb"), timeout_s=10)
    assert len(ray.util.placement_group_table()) == before  # nothing reserved, so no actor either


# ------------------------------------------------------------- without Ray
def _node(cpus, gpus=0):
    return {"Alive": True, "NodeID": f"n{cpus}-{gpus}", "NodeManagerAddress": "10.0.0.1",
            "Resources": {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}}


def test_plan_local_gives_threads_or_an_even_share():
    plan = plan_resources(Cluster.local(1, 2, threads_per_device=2), [_node(8)])
    assert (plan.cpus_per_device, plan.strategy, plan.bundles) == (2.0, "PACK", ({"CPU": 2.0}, {"CPU": 2.0}))
    assert [plan.bundle_index(r, 2) for r in range(2)] == [0, 1]
    plan = plan_resources(Cluster.local(2, 2), [_node(2)])  # 4 devices on 2 CPUs: oversubscribed
    assert plan.cpus_per_device == 0.5 and len(plan.bundles) == 4


def test_plan_gpu_hosts_one_bundle_per_host_or_error_with_numbers():
    plan = plan_resources(Cluster.simulated(2, 4), [_node(32, 4), _node(16, 4), _node(64)])
    assert plan.strategy == "STRICT_SPREAD" and plan.gpus_per_device == 1
    assert plan.bundles == ({"CPU": 4.0, "GPU": 4.0},) * 2
    assert [plan.bundle_index(r, 4) for r in range(8)] == [0] * 4 + [1] * 4
    with pytest.raises(ClusterSpecError, match=r"needs 2 Ray node\(s\) with >= 4 GPU.*has 1 such"):
        plan_resources(Cluster.simulated(2, 4), [_node(32, 4), _node(16, 2)])


def test_token_auth_uses_env_token_and_respects_user_settings():
    env: dict[str, str] = {}
    assert _configure_token_auth(env)
    assert env["RAY_AUTH_MODE"] == "token" and len(env["RAY_AUTH_TOKEN"]) == 64
    user = {"RAY_AUTH_MODE": "disabled"}
    assert not _configure_token_auth(user)
    assert user == {"RAY_AUTH_MODE": "disabled"}


def test_a_worker_killed_for_memory_is_named_so_with_a_memory_fix():
    """Ray's memory monitor kills a worker with ``OutOfMemoryError``: the rank counts as died and the
    fix says how to need less memory, not to correct the callable."""
    import ray

    group = WorkerGroup.__new__(WorkerGroup)
    group.cluster, group.infos = Cluster.local(1, 2), []
    exc = group._failure("_step", {1: ray.exceptions.OutOfMemoryError("1 worker(s) were killed due to the node "
                                                                       "running low on memory")})
    text = str(exc)
    assert "(died: [1], raised: [])" in text and "running low on memory" in text
    assert "ran out of memory" in text and "memory_budget_bytes" in text and "correct the error" not in text
