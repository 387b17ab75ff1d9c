"""Attention stays one fused operator (``alpa_torch/core/attention_op.py``), planned and sharded.

- The capture keeps ``scaled_dot_product_attention`` as ``alpa::attention`` (and its backward)
  where eager takes a fused kernel, with no ``[B, H, T, T]`` value in the graph; it decomposes
  it only where eager does (dropout on CPU), saying why; attention written by hand stays as
  written. Hugging Face LLaMA, Mistral, Qwen2 and GPT-2 with their default attention.
- The operators' sharding rules offer replicated, batch-split and heads-split (key / value
  heads of grouped-query attention with them) on every mesh axis, and plans forced to each
  equal eager within 1e-5 over 3 steps on 1x2 and 2x2 (causal, masked, grouped-query).
- Their FLOPs are attention's own (causal halves them).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from alpa_torch import Cluster
from alpa_torch.capture import capture
from alpa_torch.zoo import GPT, GPTConfig, train_step

ATOL = 1e-5


def _targets(graph) -> set[str]:
    return {str(n.target) for n in graph.gm.graph.nodes if n.op == "call_function"}


def _square_scores(graph, t: int) -> list[str]:
    """Graph values holding a T x T score matrix."""
    return [n.name for n in graph.gm.graph.nodes
            if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].dim() >= 2 and tuple(n.meta["val"].shape[-2:]) == (t, t)]


def _gpt(attention="sdpa", t=16):
    """No biases: the key projection's bias gets a gradient of pure rounding noise (softmax ignores what
    it adds), which AdamW turns into +-lr: no two summation orders agree on it."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=t, n_layer=2, n_head=4, n_embd=32, attention=attention,
                         bias=False))


def _tokens(t=16, seed=0, batch=4):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 64, (batch, t + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def test_sdpa_is_captured_as_one_fused_operator():
    model = _gpt()
    graph = capture(train_step, model, torch.optim.AdamW(model.parameters(), lr=1e-3), _tokens())
    targets = _targets(graph)
    assert "alpa.attention.default" in targets and "alpa.attention_backward.default" in targets
    assert not _square_scores(graph, 16), "no T x T value: the fused kernel keeps none"
    explicit = _gpt("explicit")  # attention written by hand stays as written
    g2 = capture(train_step, explicit, torch.optim.AdamW(explicit.parameters(), lr=1e-3), _tokens())
    assert "alpa.attention.default" not in _targets(g2) and _square_scores(g2, 16)


def test_dropout_in_attention_takes_the_math_path_as_eager_does(caplog):
    class Dropped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            q = self.proj(x).view(2, 2, 4, 4)
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True).sum()

    model = Dropped()

    def step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = model(batch)
        loss.backward()
        optimizer.step()
        return loss

    with caplog.at_level(logging.INFO, logger="alpa_torch.tracing"):
        graph = capture(step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4, 8))
    assert "alpa.attention.default" not in _targets(graph)
    assert "math" in caplog.text and "dropout" in caplog.text


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt2"])
def test_hugging_face_default_attention_is_fused(family):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, num_hidden_layers=2, max_position_embeddings=32)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_positions=32,
                                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        model_cls = transformers.GPT2LMHeadModel
    else:
        cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                              "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                              "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
        config = cfg_cls(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         **common)
    model = model_cls(config)
    assert model.config._attn_implementation == "sdpa"

    def step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        return loss

    ids = torch.randint(0, 64, (2, 12))  # a length no width of the model has
    graph = capture(step, model, torch.optim.AdamW(model.parameters(), lr=1e-3), ids)
    assert "alpa.attention.default" in _targets(graph), family
    assert not _square_scores(graph, 12), family



def test_padded_batches_planned_for_cuda_keep_attention_fused():
    """A right-padded batch (a mask, as HF's LLaMA builds it from attention_mask) planned for a CUDA
    cluster: memory-efficient attention takes the mask in eager, so the capture keeps it fused."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 12))
    padding = torch.ones_like(ids)
    padding[1, 9:] = 0

    def step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = model(input_ids=batch[0], attention_mask=batch[1], labels=batch[0]).loss
        loss.backward()
        optimizer.step()
        return loss

    graph = capture(step, model, torch.optim.AdamW(model.parameters(), lr=1e-3), (ids, padding), device_type="cuda")
    node = next(n for n in graph.gm.graph.nodes if n.target == torch.ops.alpa.attention.default)
    assert node.args[3] is not None, "the padding mask reaches the fused operator"


@pytest.mark.parametrize("tk", [12, 16])
def test_a_mask_is_prepared_for_memory_efficient_attention_as_eager_prepares_it(tk):
    """CUDA's memory-efficient kernel reads mask rows aligned to 8 elements: an unaligned mask is
    copied into padded rows, an aligned one is used as it is; both expand to [B, H, Tq, Tk]."""
    from alpa_torch.core.attention_op import efficient_bias

    q, k = torch.zeros(2, 4, 5, 8), torch.zeros(2, 4, tk, 8)
    mask = torch.randn(2, 1, 5, tk)
    bias = efficient_bias(mask, q, k)
    assert bias.shape == (2, 4, 5, tk) and torch.equal(bias, mask.expand(2, 4, 5, tk))
    assert all(s % 8 == 0 for s in bias.stride()[:-1]) and bias.stride(-1) == 1
    assert (bias.data_ptr() == mask.data_ptr()) == (tk % 8 == 0)
    assert torch.equal(efficient_bias(mask[0, 0], q, k), mask[0, 0].expand(2, 4, 5, tk))
    assert efficient_bias(None, q, k) is None


@pytest.mark.parametrize("kind", ["flash", "efficient-mask", "efficient-fp32", "flash-gqa"])
def test_the_cuda_kernels_are_called_as_their_schemas_and_meta_functions_ask(kind):
    """The CUDA branches of ``alpa::attention`` and its backward, run on the meta device (the GPU
    tests run them on CUDA): every argument is of the kind the kernel's schema takes (a dense
    batch's cumulative sequence lengths are None: a tensor there selects the variable-length
    kernel) and every result has the shape eager's kernels give."""
    from alpa_torch.core.attention_op import attention, attention_backward

    dtype = torch.float32 if kind == "efficient-fp32" else torch.bfloat16
    b, h, t, d = 2, 4, 12, 64
    kv = 2 if kind.endswith("gqa") else h
    q, k, v = (torch.empty(b, n, t, d, device="meta", dtype=dtype) for n in (h, kv, kv))
    mask = torch.empty(b, 1, t, t, device="meta", dtype=dtype) if kind == "efficient-mask" else None
    gqa = kind.endswith("gqa")
    with _Calls() as calls:
        out, lse = attention._init_fn(q, k, v, mask, 0.0, mask is None, None, gqa)
        dq, dk, dv = attention_backward._init_fn(torch.empty_like(out), q, k, v, out, lse, mask, 0.0, mask is None,
                                                 None, gqa)
    assert out.shape == q.shape and lse.shape == (b, h, t) and lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    flash = [args for op, args in calls if op is torch.ops.aten._scaled_dot_product_flash_attention_backward.default]
    assert len(flash) == kind.startswith("flash")
    for args in flash:
        assert args[6] is None and args[7] is None, "cumulative sequence lengths of a dense batch"


class _Calls(TorchDispatchMode):
    """The aten operators called under it, with their arguments."""

    def __enter__(self):
        self.calls = []
        super().__enter__()
        return self.calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


def test_flops_are_attentions_own_and_causal_halves_them():
    from torch.utils.flop_counter import flop_registry

    import alpa_torch.core.attention_op  # noqa: F401 - registers the formulas

    fwd = flop_registry[torch.ops.alpa.attention]
    b, h, t, d = 2, 4, 128, 16
    full = fwd((b, h, t, d), (b, h, t, d), (b, h, t, d), None, 0.0, False)
    assert full == 4 * b * h * t * t * d
    assert fwd((b, h, t, d), (b, h, t, d), (b, h, t, d), None, 0.0, True) == full / 2
    bwd = flop_registry[torch.ops.alpa.attention_backward]
    assert bwd((b, h, t, d), (b, h, t, d), (b, h, t, d), (b, h, t, d), None, None, None, 0.0, False) == 2.5 * full


def test_rules_offer_replicated_batch_and_heads_on_every_axis():
    """The fused operator's strategies on a 2x2 mesh: each axis replicates, splits the batch or splits
    the heads (grouped key/value heads too, where they divide)."""
    from intra_ilp.strategies import node_strategies

    model = _gpt()
    graph = capture(train_step, model, torch.optim.AdamW(model.parameters(), lr=1e-3), _tokens())
    node = next(n for n in graph.gm.graph.nodes if n.target == torch.ops.alpa.attention.default)
    outputs = {str(s.outputs[0]) for s in node_strategies(node, (2, 2))}
    for spec in ("RR", "S(0)R", "RS(0)", "S(1)R", "RS(1)", "S(0)S(1)", "S(1)S(0)"):
        assert spec in outputs, (spec, sorted(outputs))


def _forced_run(cluster, mesh_shape, spec, make_model, batches):
    """The GPT trained on a plan whose attention operators (forward and backward) are forced to
    ``spec`` on ``mesh_shape``, against eager, 3 steps."""
    from intra_ilp.cost_model import MeshCost
    from intra_ilp.stage import solve_stage

    from .test_optimizers_parallel import engine_against_eager

    eager = make_model()
    model = copy.deepcopy(eager)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    graph = capture(train_step, model, opt, batches[0])
    attn = [n.name for n in graph.gm.graph.nodes
            if n.target in (torch.ops.alpa.attention.default, torch.ops.alpa.attention_backward.default)]
    force = {n: spec for n in attn}
    sharding = solve_stage(graph, MeshCost.from_cluster(cluster, (cluster.num_hosts, cluster.devices_per_host),
                                                       mesh_shape), force=force)
    assert all(str(sharding.value_specs[n]) == spec for n in attn if n in sharding.value_specs)
    engine_against_eager(cluster, graph, sharding, train_step, model, opt, eager, eager_opt, batches, spec)


class GQA(torch.nn.Module):
    """Grouped-query attention of width 16 in: ``heads`` query heads and ``kv_heads`` key/value heads
    of ``dim``; causal through a boolean padding-style mask (``mask``) or ``is_causal``."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, dim: int = 4, mask: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.kv_heads, self.dim, self.mask = heads, kv_heads, dim, mask
        self.q = torch.nn.Linear(16, heads * dim, bias=False)
        self.kv = torch.nn.Linear(16, 2 * kv_heads * dim, bias=False)
        self.out = torch.nn.Linear(heads * dim, 8)

    def loss(self, batch):
        x, y = batch
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(x).view(b, t, self.kv_heads, 2 * self.dim).transpose(1, 2).split(self.dim, dim=-1)
        keep = torch.ones(b, 1, t, t, dtype=torch.bool).tril() if self.mask else None
        y_ = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=not self.mask, enable_gqa=True)
        return F.cross_entropy(self.out(y_.transpose(1, 2).reshape(b, t, -1)).flatten(0, 1), y.flatten())


def _gqa_batches():
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(4, 8, 16, generator=g), torch.randint(0, 8, (4, 8), generator=g)) for _ in range(3)]


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("spec", ["RS(0)", "RS(1)"])
def test_attention_split_on_batch_or_heads_equals_eager_on_1x2(spec):
    _forced_run(Cluster.local(1, 2), (1, 2), spec, _gpt, [_tokens(seed=i) for i in range(3)])


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("spec", ["RS(1)", pytest.param("RS(0)", marks=pytest.mark.sweep)])
def test_grouped_query_masked_attention_split_equals_eager_on_1x2(spec):
    _forced_run(Cluster.local(1, 2), (1, 2), spec, GQA, _gqa_batches())


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("spec", [pytest.param("S(0)S(1)", marks=pytest.mark.slow),
                                  pytest.param("S(1)S(0)", marks=pytest.mark.sweep),
                                  pytest.param("S(0)S(0)", marks=pytest.mark.sweep)])
def test_attention_split_on_both_axes_equals_eager_on_2x2(spec):
    _forced_run(Cluster.local(2, 2), (2, 2), spec, _gpt, [_tokens(seed=i) for i in range(3)])
    if spec == "S(0)S(1)":
        _forced_run(Cluster.local(2, 2), (2, 2), spec, GQA, _gqa_batches())


def test_grouped_heads_split_only_where_the_key_value_heads_divide():
    """Causal GQA with 6 query and 3 key/value heads: never split in two, where a device's query
    heads (3 of 6) would miss their keys (DTensor itself would split 3 heads unevenly, 2 and 1); its
    batch still splits."""
    from intra_ilp.strategies import node_strategies

    def step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = model.loss(batch)
        loss.backward()
        optimizer.step()
        return loss

    model = GQA(heads=6, kv_heads=3, dim=8, mask=False)
    graph = capture(step, model, torch.optim.AdamW(model.parameters(), lr=1e-3), _gqa_batches()[0])
    for target in (torch.ops.alpa.attention.default, torch.ops.alpa.attention_backward.default):
        node = next(n for n in graph.gm.graph.nodes if n.target == target)
        specs = {str(s.outputs[0]) for s in node_strategies(node, (1, 2))}
        assert "RS(0)" in specs and "RS(1)" not in specs, (target, sorted(specs))
