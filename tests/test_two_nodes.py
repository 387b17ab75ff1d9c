"""A Ray cluster of two nodes on this machine (Ray's own ``ray.cluster_utils.Cluster``).

``cluster_from_ray`` finds it as 2 hosts; the zoo GPT trains on it with the automatic plan
and with forced plans that cross hosts (a pipeline with one stage per host; data parallel
across hosts), its workers run on both nodes, and every loss and parameter equals eager
training. Slow (two Ray nodes start on two cores): ``python -m pytest -m slow tests/test_two_nodes.py``;
CI runs it. Ray job submission of the demo to the same two-node cluster is a sweep (``-m sweep``):
``tests/test_quickstart.py`` submits its job to such a cluster in CI.
"""

from __future__ import annotations

import copy
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from tests.conftest import two_ray_nodes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes():
    """Two Ray nodes of one CPU each, this process connected to them; the dashboard (job server) on the head."""
    dash = _free_port()
    for cluster, _ in two_ray_nodes(include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=dash):
        yield cluster, dash


def _train(cluster, **options):
    """3 steps of the zoo GPT on ``cluster`` against eager; returns the plan and the nodes the workers ran on."""
    from alpa_torch import parallelize
    from alpa_torch.zoo import GPT, GPTConfig, make_batch, make_optimizer, train_step

    torch.manual_seed(0)
    eager = GPT(GPTConfig.tiny())
    model = copy.deepcopy(eager)
    eager_opt, opt = make_optimizer("adamw", eager), make_optimizer("adamw", model)
    step = parallelize(train_step, cluster, plan_cache=False, **options)
    try:
        for i in range(3):
            batch = make_batch("gpt", 8, seed=i)
            want = float(train_step(eager, eager_opt, batch).detach())
            got = float(step(model, opt, batch))
            assert got == pytest.approx(want, abs=1e-5), f"step {i}: {got} != eager {want}"
        nodes = {info.node_ip + "/" + str(info.host_index) for info in step.group.infos}
        state, plan = step.state_dict(), step.plan
    finally:
        step.shutdown()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(state["model"][name], p.detach(), atol=1e-5, rtol=0, msg=name)
    return plan, nodes


@pytest.mark.slow
def test_two_nodes_are_two_hosts_and_train_like_eager(two_nodes):
    from runtime.discovery import cluster_from_ray

    cluster = cluster_from_ray()
    assert (cluster.num_hosts, cluster.devices_per_host) == (2, 1) and not cluster.is_local
    plan, nodes = _train(cluster)  # the automatic plan
    assert len(nodes) == 2, f"workers ran on {nodes}"
    pipeline, nodes = _train(cluster, num_stages=2, num_microbatches=2)  # one stage per host
    assert [s.device_ids for s in pipeline.stages] == [(0,), (1,)] and len(nodes) == 2
    data_parallel, nodes = _train(cluster, pipeline=False)  # one stage across both hosts
    assert data_parallel.stages[0].device_ids == (0, 1) and len(nodes) == 2


@pytest.mark.sweep
def test_ray_job_submission_to_two_nodes(two_nodes):
    _, dash = two_nodes
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    # No --working-dir upload (tests/test_ray_job.py covers it on one node): here the job's driver started
    # in an unpacked working directory that no longer existed (os.getcwd() failed at import), most likely
    # cleaned by the other node's runtime-env agent, since both nodes of this one-machine cluster share a
    # session directory. The installed package and the script's path suffice.
    demo = os.path.join(REPO, "examples", "train_gpt.py")
    job = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address",
                          f"http://127.0.0.1:{dash}", "--", "python", demo, "--steps", "3", "--check"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out[-3000:]
    assert "2x1 cluster" in out, out[-3000:]  # the job's driver found both nodes
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", out)]
    assert len(losses) == 3 and "(ok," in out, out[-3000:]
