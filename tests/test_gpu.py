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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["causal", "mask", "bool-mask", "gqa"])
def test_fused_attention_on_cuda_equals_eager_sdpa(kind, dtype):
    """``alpa::attention`` and its backward on CUDA against eager's ``scaled_dot_product_attention``:
    the same kernels (flash, or memory-efficient with eager's mask preparation), so equal to rounding."""
    import torch.nn.functional as F

    import alpa_torch.core.attention_op  # noqa: F401 - registers the operator

    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, t, d = 2, 4, 100, 64
    kv = 2 if kind == "gqa" else h
    q, k, v = (torch.randn(b, n, t, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
               for n in (h, kv, kv))
    mask = None
    if kind == "mask":
        mask = torch.randn(b, 1, t, t, device="cuda", dtype=dtype, generator=g)
    if kind == "bool-mask":
        mask = torch.ones(b, 1, t, t, device="cuda", dtype=torch.bool).tril()
    causal, gqa = kind in ("causal", "gqa"), kind == "gqa"
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    additive = mask
    if mask is not None and mask.dtype == torch.bool:
        additive = torch.zeros(mask.shape, dtype=dtype, device="cuda").masked_fill(~mask, float("-inf"))
    got = torch.ops.alpa.attention(q, k, v, additive, 0.0, causal, None, gqa)[0]
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    for name, a, e in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(a, e, **tol, msg=f"grad {name}")
