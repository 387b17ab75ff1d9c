"""Losing a host mid-training: the step plans again for the host left and continues.

A Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``, as
``test_two_nodes.py``); the zoo GPT trains on both with ``max_restarts`` and a checkpoint
directory; one node is removed after step 2. Steps 3 and 4 must then run on the node left,
on a plan made for it, from the checkpoint of step 2, and give the losses of a run that
loads that checkpoint onto a one-node cluster (and of eager training). Slow (two Ray nodes
start on two cores): ``python -m pytest -m slow tests/test_lose_host.py``; CI runs it.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from tests.conftest import two_ray_nodes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    """A head node and a second node, one CPU each; this process connected to them."""
    yield from two_ray_nodes(include_dashboard=False)


def test_losing_a_host_plans_again_for_the_one_left_and_continues(two_nodes, tmp_path):
    from alpa_torch import parallelize
    from alpa_torch.zoo import GPT, GPTConfig, make_batch, make_optimizer, train_step
    from runtime.discovery import cluster_from_ray

    ray_cluster, second = two_nodes
    torch.manual_seed(0)
    eager = GPT(GPTConfig.tiny())
    model = copy.deepcopy(eager)
    eager_opt, opt = make_optimizer("adamw", eager), make_optimizer("adamw", model)
    batches = [make_batch("gpt", 8, seed=i) for i in range(4)]
    expected = [float(train_step(eager, eager_opt, b).detach()) for b in batches]

    cluster = cluster_from_ray()
    assert cluster.num_hosts == 2
    step = parallelize(train_step, cluster, max_restarts=1, checkpoint_dir=str(tmp_path / "ck"), host_timeout_s=5,
                       plan_cache=False)
    try:
        losses = [float(step(model, opt, b)) for b in batches[:2]]
        assert len({info.node_ip + "/" + str(info.host_index) for info in step.group.infos}) == 2
        shutil.copytree(tmp_path / "ck", tmp_path / "step2")  # what the one-node reference run loads
        ray_cluster.remove_node(second)
        losses += [float(step(model, opt, b)) for b in batches[2:]]
        assert step.restarts == 1
        assert (step.cluster.num_hosts, step.cluster.num_devices) == (1, 1), step.cluster.describe()
        assert [s.device_ids for s in step.plan.stages] == [(0,)]
        assert len(step.group.infos) == 1
    finally:
        step.shutdown()
    assert losses == pytest.approx(expected, abs=1e-5)

    fresh = GPT(GPTConfig.tiny())
    fresh_opt = make_optimizer("adamw", fresh)
    one_node = parallelize(train_step, cluster_from_ray(), plan_cache=False)
    try:
        assert one_node.load(str(tmp_path / "step2")) == 2
        reference = [float(one_node(fresh, fresh_opt, b)) for b in batches[2:]]
    finally:
        one_node.shutdown()
    assert losses[2:] == pytest.approx(reference, abs=1e-6)
