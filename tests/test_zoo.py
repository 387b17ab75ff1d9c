"""Tests of the model zoo: every model trains eagerly, is deterministic, traces.

Also checks the GPT-3 planning shapes against an analytic parameter count and
that Hugging Face models build offline from configs.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # building from configs must never need the network

import collections

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from alpa_torch.zoo import (
    GPT,
    OPTIMIZERS,
    ZOO,
    GPTConfig,
    build,
    gpt_config,
    hf_gpt2,
    hf_llama,
    make_batch,
    make_optimizer,
    model_loss,
    train_step,
)

NAMES = sorted(ZOO)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("name", NAMES)
def test_trains_three_steps(name, kind):
    model, batch = ZOO[name]()
    assert batch[0].shape[0] == 8
    before = _snapshot(model)
    opt = make_optimizer(kind, model)
    losses = [train_step(model, opt, batch).item() for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    # Same batch, small lr: the loss must move, and should go down.
    assert losses[-1] < losses[0], losses
    after = model.state_dict()
    for pname, p in model.named_parameters():
        assert not torch.equal(before[pname], p.detach()), f"{name}/{kind}: {pname} unchanged"
    if name == "cnn":  # BatchNorm buffers are mutated by the forward pass
        assert after["features.1.num_batches_tracked"].item() == 3
        assert not torch.equal(before["features.1.running_mean"], after["features.1.running_mean"])


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_and_leaves_global_rng(name):
    state = torch.get_rng_state()
    (m1, b1), (m2, b2) = ZOO[name](), ZOO[name]()
    assert torch.equal(torch.get_rng_state(), state)
    for (k, v1), v2 in zip(m1.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(v1, v2), k
    assert all(torch.equal(x, y) for x, y in zip(b1, b2))
    fresh = make_batch(name, batch_size=4, seed=1)
    assert fresh[0].shape[0] == 4 and not torch.equal(fresh[0], b1[0][:4])
    assert build(name, seed=1)[1][0].shape == b1[0].shape


@pytest.mark.parametrize("name", NAMES)
def test_loss_traces_with_plain_make_fx(name):
    """No data-dependent control flow: the capture layer can trace every model."""
    model, batch = ZOO[name]()
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def loss_fn(state, x, y):
        with torch.nn.utils.stateless._reparametrize_module(model, state):
            return model_loss(model, (x, y))

    gm = make_fx(loss_fn)(state, *batch)
    ops = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    assert not [op for op in ops if "scaled_dot_product" in op or "dropout" in op], ops
    if name == "gpt":
        assert ops["aten.masked_fill.Scalar"] == GPTConfig.tiny().n_layer
    if name != "cnn":  # BatchNorm's traced graph updates buffers; compare the pure ones
        torch.testing.assert_close(gm(state, *batch), model_loss(model, batch))


def test_lm_batches_are_next_token_targets():
    idx, targets = make_batch("gpt", batch_size=8, seed=3)
    assert idx.dtype == targets.dtype == torch.long and idx.shape == targets.shape
    assert torch.equal(idx[:, 1:], targets[:, :-1])


@pytest.mark.parametrize("builder", [hf_gpt2, hf_llama])
def test_hf_loss_matches_builtin_shifted_loss(builder):
    """Our loss equals HF's ``labels=`` loss once HF's internal shift is undone."""
    torch.manual_seed(0)
    model = builder()
    idx, targets = make_batch("hf_gpt2", batch_size=4, seed=0)
    out = model.hf(input_ids=idx, labels=idx, use_cache=False)
    # HF predicts labels[:, t+1] from position t and drops the last position.
    ours = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), targets[:, :-1].flatten())
    torch.testing.assert_close(out.loss, ours)
    torch.testing.assert_close(model(idx), out.logits)


def test_weight_tying_flags():
    tied, untied = GPT(GPTConfig.tiny(tie_weights=True)), GPT(GPTConfig.tiny())
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.lm_head.weight is not untied.wte.weight
    for cfg, model in ((tied.config, tied), (untied.config, untied)):
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    for builder in (hf_gpt2, hf_llama):
        hf_tied, hf_untied = builder(tie_weights=True).hf, builder().hf
        assert hf_tied.get_output_embeddings().weight is hf_tied.get_input_embeddings().weight
        assert hf_untied.get_output_embeddings().weight is not hf_untied.get_input_embeddings().weight
        assert hf_tied.config._attn_implementation == "eager"


def test_no_bias_preset_count():
    cfg = GPTConfig.small(bias=False)
    assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.num_params()


def test_gpt_1_3b_on_meta():
    cfg = gpt_config("1.3b")
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size) == (
        24, 2048, 32, 1024, 51200)
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n == cfg.num_params() == 1_420_414_976  # untied lm_head adds V*d = 104.9M
    assert all(p.is_meta for p in model.parameters())
    tied = gpt_config("1.3b", tie_weights=True).num_params()
    assert tied == n - 51200 * 2048 and abs(tied / 1.3e9 - 1) < 0.02


@pytest.mark.parametrize("name,nominal", [
    ("1.3b", 1.3e9), ("2.6b", 2.7e9), ("6.7b", 6.7e9), ("15b", 15e9), ("39b", 39e9),
])
def test_gpt3_shapes_match_nominal_size(name, nominal):
    # GPT-3 sizes count tied embeddings; "2.6b" is GPT-3's 2.7B row.
    assert abs(gpt_config(name, tie_weights=True).num_params() / nominal - 1) < 0.03


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="n_head=3"):
        GPTConfig.tiny(n_head=3)
    with pytest.raises(ValueError, match="'lamb'"):
        make_optimizer("lamb", torch.nn.Linear(2, 2))
    with pytest.raises(KeyError, match="'resnet'"):
        make_batch("resnet")
    with pytest.raises(ValueError, match="'175b'"):
        gpt_config("175b")
    with pytest.raises(TypeError, match="loss"):
        model_loss(torch.nn.Linear(2, 2), (torch.zeros(1, 2), torch.zeros(1)))
