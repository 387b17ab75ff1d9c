"""The runtime on a GPU: one CUDA device, NCCL, equal to eager CUDA training; profiling it.

Marked ``gpu`` and skipped where CUDA is absent (every CI machine of this project): the
default run never depends on a GPU. Run them on a machine with one: ``python -m pytest -m gpu``.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _gpu_cluster():
    from alpa_torch.core.cluster import Cluster
    from runtime.discovery import builtin_device_for_cuda

    return Cluster.simulated(1, 1, builtin_device_for_cuda(torch.cuda.get_device_name(0)) or "a100-80gb")


@pytest.fixture
def ray_gpu():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_gpus=1, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.mark.usefixtures("ray_gpu")
def test_zoo_gpt_trains_on_one_cuda_device_like_eager_cuda():
    from alpa_torch import parallelize
    from alpa_torch.zoo import GPT, GPTConfig, make_batch, make_optimizer, train_step

    torch.manual_seed(0)
    eager = GPT(GPTConfig.small()).cuda()
    model = copy.deepcopy(eager)
    eager_opt, opt = make_optimizer("adamw", eager), make_optimizer("adamw", model)
    cluster = _gpu_cluster()
    assert cluster.backend == "nccl"
    step = parallelize(train_step, cluster)
    try:
        for i in range(3):
            x, y = (t.cuda() for t in make_batch("gpt", 8, seed=i))
            want = float(train_step(eager, eager_opt, (x, y)).detach())
            got = float(step(model, opt, (x, y)))
            assert got == pytest.approx(want, abs=1e-5), f"step {i}: {got} != eager {want}"
        state = step.state_dict()
        assert step.group.infos and all(i.node_ip for i in step.group.infos)
    finally:
        step.shutdown()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(state["model"][name], p.detach().cpu(), atol=1e-5, rtol=0, msg=name)


@pytest.mark.usefixtures("ray_gpu")
def test_profile_the_cuda_device():
    from runtime.profile import profile_cluster

    profiled = profile_cluster(_gpu_cluster(), sizes_bytes=(4 << 10, 1 << 20), repeats=3, matmul_sizes=(1024, 2048))
    assert profiled.profiled and profiled.device.peak_flops["float32"] > 1e12  # a GPU, not a CPU
