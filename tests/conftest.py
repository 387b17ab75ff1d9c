"""Shared test fixtures.

``ray_session``: one Ray for the whole test run, started the first time a test
asks for it (tests that never ask pay nothing) and stopped when the session
ends. Starting Ray costs 6-8 s here (docs/design.md), so runtime tests share it;
each test starts and shuts down its own ``WorkerGroup``, whose workers the next test
on the same cluster takes (``test_environment``).
With ``RAY_ADDRESS`` set, the tests use that cluster instead and leave it running.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Logical CPUs of the shared Ray: enough for a 2x4 local cluster at one thread per device.
# Ray's CPUs are a scheduling count, not cores, so this does not oversubscribe the machine.
_SESSION_HOSTS, _SESSION_DEVICES_PER_HOST = 2, 4


@pytest.fixture(scope="session", autouse=True)
def test_environment(tmp_path_factory) -> Iterator[None]:
    """Plans cached by tests go to a fresh directory, never the user's ~/.cache; steps plan by
    the cost model alone (``ALPA_TORCH_TUNE=0``): measured plan selection runs each candidate for
    a few steps, seconds per ``parallelize`` that the many short runs here would pay hundreds of
    times (``tests/test_tune.py`` passes ``tune=True``); a test's workers, shut down, are kept for the
    next test on the same cluster (``runtime.group.KEEP_WORKERS_ENV``: 4-7 s less per test)."""
    from runtime.group import KEEP_WORKERS_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALPA_TORCH_CACHE", str(tmp_path_factory.mktemp("plan_cache")))
        mp.setenv("ALPA_TORCH_TUNE", "0")
        mp.setenv(KEEP_WORKERS_ENV, os.environ.get(KEEP_WORKERS_ENV, "1"))  # =0: every test starts its own
        yield


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """A local Ray (127.0.0.1, no dashboard, token auth independent of ~/.ray) for this test session."""
    pytest.importorskip("ray")
    from alpa_torch.core.cluster import Cluster
    from runtime.ray_env import ensure_ray, stop_ray

    started = ensure_ray(Cluster.local(_SESSION_HOSTS, _SESSION_DEVICES_PER_HOST))
    try:
        yield
    finally:
        if started:
            stop_ray()


def two_ray_nodes(**head_args) -> Iterator[tuple]:
    """A Ray cluster of two nodes of one CPU each on this machine (``ray.cluster_utils.Cluster``),
    this process connected to it; yields ``(cluster, second_node)``. The session's single-node Ray
    is shut down first (a module of such tests needs its own cluster)."""
    import ray
    from ray.cluster_utils import Cluster as RayCluster

    from runtime.ray_env import _configure_token_auth, _refresh_ray_auth_config

    if ray.is_initialized():
        ray.shutdown()
    if _configure_token_auth(os.environ):
        _refresh_ray_auth_config()
    cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1, **head_args})
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        yield cluster, second
    finally:
        ray.shutdown()
        cluster.shutdown()
