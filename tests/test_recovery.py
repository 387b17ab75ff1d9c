"""Worker loss: a dead worker gives a ``WorkerError`` naming its device and stage within 30 s and
leaves no process behind; with ``max_restarts`` the step restarts the workers from the last
checkpoint, retries the failed step, and the losses equal those of a run nobody interrupted.
Also: local clusters rendezvous on 127.0.0.1.

The worker tests share the session's Ray; each starts its own workers.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from alpa_torch import CheckpointError, Cluster, WorkerError, parallelize
from alpa_torch.core.errors import WorkerFailure
from alpa_torch.zoo import ZOO, make_batch, make_optimizer, train_step
from runtime.engine import stage_failure

ATOL = 1e-5


def _alive(pid: int) -> bool:
    from runtime.group import _alive as alive

    return alive(pid)


@pytest.mark.usefixtures("ray_session")
def test_killed_worker_restarts_from_checkpoint_then_fails_cleanly(tmp_path):
    eager, _ = ZOO["mlp"]()
    eager_opt = make_optimizer("adam", eager)
    batches = [make_batch("mlp", 8, seed=i) for i in range(5)]
    expected = [float(train_step(eager, eager_opt, b).detach()) for b in batches]

    model = ZOO["mlp"]()[0]
    optimizer = make_optimizer("adam", model)
    step = parallelize(train_step, cluster=Cluster.local(1, 2), plan_cache=False, max_restarts=1,
                       checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=1)
    try:
        losses = [float(step(model, optimizer, b)) for b in batches[:2]]
        first_pids = step.group.pids()
        os.kill(first_pids[1], signal.SIGKILL)  # between steps 2 and 3
        losses += [float(step(model, optimizer, b)) for b in batches[2:4]]
        assert step.restarts == 1 and not any(_alive(p) for p in first_pids)
        assert losses == pytest.approx(expected[:4], abs=ATOL), "recovery must not change the losses"

        # Restarts spent: the next death is an error naming the device and its stage, and
        # every worker process is gone when it is raised.
        pids = step.group.pids()
        stage = next(k for k, s in enumerate(step.plan.stages) if 1 in s.device_ids)
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=rf"step 5: device 1 of stage {stage}.*died(?s:.*)max_restarts=1"):
            step(model, optimizer, batches[4])
        assert time.monotonic() - t0 < 30
        assert not any(_alive(p) for p in pids), "no orphan worker processes"
    finally:
        step.shutdown()


def test_stage_failure_names_the_stage_of_the_dead_device():
    def failure(rank, died):
        return WorkerFailure(rank=rank, host=rank // 2, pid=100 + rank, hostname="h", died=died, error="...")

    exc = WorkerError("_pstep failed on device rank(s) [3, 0] (died: [3], raised: [0]); group shut down.\n...",
                      failures=(failure(3, True), failure(0, False)))
    named = stage_failure(exc, [(0, 1), (2, 3)])
    assert str(named).startswith("device 3 of stage 1 (stage devices [2, 3]) failed: _pstep failed")
    assert named.stages == (1,) and named.failed_ranks == [3] and named.failures[0].pid == 103
    late = WorkerError("_step: device rank(s) [0, 1] (host(s) [0]) did not answer within 600 s; done: []",
                       failures=(failure(0, False), failure(1, False)))
    assert str(stage_failure(late, [(0, 1)])).startswith("device 0 of stage 0 (stage devices [0, 1]); device 1 of")


@pytest.mark.parametrize("kwargs,message", [
    ({"max_restarts": 2}, "max_restarts=2 needs checkpoint_dir"),
    ({"max_restarts": -1, "checkpoint_dir": "x"}, "max_restarts=-1"),
    ({"checkpoint_every": 0, "checkpoint_dir": "x"}, "checkpoint_every=0"),
    ({"host_timeout_s": -1}, "host_timeout_s=-1 must be a number of seconds"),
])
def test_bad_restart_options(kwargs, message):
    with pytest.raises(CheckpointError, match=message):
        parallelize(train_step, cluster=Cluster.local(1, 1), **kwargs)


def test_save_before_the_first_step_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="call it once"):
        parallelize(train_step, cluster=Cluster.local(1, 1)).save(str(tmp_path / "ck"))


# ---------------------------------------------------------------- loopback
def _rendezvous_host(state):
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    while hasattr(store, "underlying_store"):  # PrefixStore around the TCPStore
        store = store.underlying_store
    return store.host


@pytest.mark.usefixtures("ray_session")
def test_local_cluster_rendezvous_is_loopback():
    from runtime.group import WorkerGroup

    with WorkerGroup.start(Cluster.local(1, 1)) as group:
        assert group.call(0, _rendezvous_host) == "127.0.0.1"


def test_local_ray_is_asked_for_loopback(monkeypatch):
    import ray

    from runtime import ray_env

    calls = []
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # keep ensure_ray's auth set-up out of this test
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    ray_env._start_local_ray(Cluster.local(1, 2), log_to_driver=False)
    assert calls[0]["address"] == "local" and calls[0]["_node_ip_address"] == "127.0.0.1"
