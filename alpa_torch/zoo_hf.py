"""Published Hugging Face architectures: their configurations, training step and batches.

What it owns: nine models as their authors published them (``PUBLISHED``: the values
of each model's ``config.json`` on the Hub, written here; nothing is downloaded), the
sequence length and global batch a user of each trains with, the training step Hugging
Face documents (``hf_train_step``: ``loss = model(**batch).loss`` with ``labels`` in the
batch), and a batch per task (``hf_batch``). ``hf_published(name)`` builds one on the
``meta`` device for planning (``bench/plan_zoo.py``); ``hf_twin(name)`` builds the same
class at a small size with real weights for training against eager
(``tests/test_hf_twins.py``). What it does not own: capture, planning, running.

    model, optimizer, batch, step = hf_published("llama3-8b")   # meta device, AdamW
    graph = capture(step, model, optimizer, batch, precision="bf16")

Every model keeps transformers' default attention (sdpa) and, for Mixtral, its default
experts; nothing is forced to eager. Training switches from the published configs:
``use_cache=False`` (no KV cache while training) and, for Mixtral,
``output_router_logits=True`` (the load-balancing loss joins the loss, as HF's MoE
training docs say). A twin also sets dropout to 0 (eager and parallel runs would draw
different masks) and shrinks the sizes (``PublishedModel.twin``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .zoo import make_optimizer

TASKS = ("causal_lm", "masked_lm", "seq2seq", "image_classification")
IGNORE = -100
"""Hugging Face's ``ignore_index``: label positions that carry no loss."""
MLM_PROBABILITY = 0.15
"""BERT's share of masked tokens (Devlin et al. 2019, §3.1)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PublishedModel:
    """One architecture as published, and how a user trains it."""

    name: str
    hub_id: str
    """Where the configuration below was published (not downloaded)."""
    model_class: str
    """The transformers class, e.g. 'LlamaForCausalLM'; its config class is ``config_class``."""
    config_class: str
    task: str
    """One of ``TASKS``: picks the batch (``hf_batch``)."""
    config: dict[str, Any]
    """The published ``config.json`` values (architecture and token ids)."""
    seq_len: int
    """Tokens per sample (encoder side for seq2seq); for images, ignored (``config['image_size']``)."""
    global_batch: int
    """Samples per optimizer step."""
    setting: str
    """Where ``seq_len`` and ``global_batch`` come from."""
    target_len: int = 0
    """Decoder labels per sample (seq2seq only)."""
    training: dict[str, Any] = field(default_factory=dict)
    """Config changes for training (module docstring)."""
    twin: dict[str, Any] = field(default_factory=dict)
    """Config changes of the small twin: sizes, dropout 0 (module docstring)."""
    mask_token_id: int = 103
    """[MASK] of a masked LM's vocabulary (bert-large-uncased's vocab.txt; its twin keeps 128 ids)."""

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"{self.name}: task {self.task!r} is not one of {TASKS}")
        if self.task == "seq2seq" and self.target_len < 1:
            raise ValueError(f"{self.name}: a seq2seq model needs target_len >= 1")


# Sizes every twin shares: 2 layers, width 64, 4 heads (2 key/value heads where GQA), vocab 96.
_DECODER_TWIN = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, bos_token_id=1,
                     eos_token_id=2, attention_dropout=0.0)
_TRAIN = dict(use_cache=False)

PUBLISHED: dict[str, PublishedModel] = {m.name: m for m in (
    PublishedModel(
        name="llama3-8b", hub_id="meta-llama/Meta-Llama-3-8B", model_class="LlamaForCausalLM",
        config_class="LlamaConfig", task="causal_lm",
        config=dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                    attention_bias=False, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
        seq_len=4096, global_batch=128,
        setting="fine-tuning at 4096 tokens, 128 sequences = 0.5M tokens per step (Llama 3 pre-trained at "
                "8192; 4096 is the common fine-tuning length)",
        training=_TRAIN, twin=_DECODER_TWIN),
    PublishedModel(
        name="llama3-70b", hub_id="meta-llama/Meta-Llama-3-70B", model_class="LlamaForCausalLM",
        config_class="LlamaConfig", task="causal_lm",
        config=dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                    num_attention_heads=64, num_key_value_heads=8, hidden_act="silu",
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                    attention_bias=False, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
        seq_len=4096, global_batch=128,
        setting="fine-tuning at 4096 tokens, 128 sequences = 0.5M tokens per step", training=_TRAIN,
        twin=_DECODER_TWIN),
    PublishedModel(
        name="mistral-7b", hub_id="mistralai/Mistral-7B-v0.1", model_class="MistralForCausalLM",
        config_class="MistralConfig", task="causal_lm",
        config=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                    max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
        seq_len=8192, global_batch=64,
        setting="8192 tokens, Mistral 7B's training context (Jiang et al. 2023), so the 4096-token "
                "sliding window is active; 64 sequences = 0.5M tokens per step",
        # twin: a window of 8 inside 16-token sequences, so the window matters there too
        training=_TRAIN, twin={**_DECODER_TWIN, "sliding_window": 8}),
    PublishedModel(
        name="mixtral-8x7b", hub_id="mistralai/Mixtral-8x7B-v0.1", model_class="MixtralForCausalLM",
        config_class="MixtralConfig", task="causal_lm",
        config=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                    max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
                    num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
        seq_len=4096, global_batch=64,
        setting="fine-tuning at 4096 tokens, 64 sequences = 0.25M tokens per step (the load-balancing "
                "loss pools over the batch: one microbatch)",
        training={**_TRAIN, "output_router_logits": True}, twin=_DECODER_TWIN),
    PublishedModel(
        name="qwen2-7b", hub_id="Qwen/Qwen2-7B", model_class="Qwen2ForCausalLM", config_class="Qwen2Config",
        task="causal_lm",
        config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                    num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
                    max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    use_sliding_window=False, sliding_window=131072, max_window_layers=28,
                    tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643),
        seq_len=4096, global_batch=128,
        setting="4096 tokens (Qwen2's pre-training length before long-context training), 128 sequences",
        training=_TRAIN, twin={**_DECODER_TWIN, "max_window_layers": 2}),
    PublishedModel(
        name="gpt2-xl", hub_id="openai-community/gpt2-xl", model_class="GPT2LMHeadModel",
        config_class="GPT2Config", task="causal_lm",
        config=dict(vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48, n_head=25,
                    activation_function="gelu_new", layer_norm_epsilon=1e-5, resid_pdrop=0.1, embd_pdrop=0.1,
                    attn_pdrop=0.1, bos_token_id=50256, eos_token_id=50256),
        seq_len=1024, global_batch=512,
        setting="GPT-2's own: 1024-token context, 512 sequences per batch (Radford et al. 2019, §2.3)",
        training=_TRAIN,
        twin=dict(vocab_size=96, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0, bos_token_id=95, eos_token_id=95)),
    PublishedModel(
        name="bert-large", hub_id="google-bert/bert-large-uncased", model_class="BertForMaskedLM",
        config_class="BertConfig", task="masked_lm",
        config=dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                    intermediate_size=4096, hidden_act="gelu", hidden_dropout_prob=0.1,
                    attention_probs_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=2,
                    layer_norm_eps=1e-12, pad_token_id=0),
        seq_len=512, global_batch=256,
        setting="BERT's pre-training phase 2: 512 tokens, 256 sequences (Devlin et al. 2019, A.2)",
        twin=dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    PublishedModel(
        name="t5-large", hub_id="google-t5/t5-large", model_class="T5ForConditionalGeneration",
        config_class="T5Config", task="seq2seq",
        config=dict(vocab_size=32128, d_model=1024, d_kv=64, d_ff=4096, num_layers=24, num_decoder_layers=24,
                    num_heads=16, relative_attention_num_buckets=32, dropout_rate=0.1, layer_norm_epsilon=1e-6,
                    feed_forward_proj="relu", tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
                    decoder_start_token_id=0),
        seq_len=512, target_len=128, global_batch=128,
        setting="T5's pre-training: 512 input tokens, 128 sequences per batch (Raffel et al. 2020, §3.1.2); "
                "span-corruption targets (114 tokens) padded to 128",
        training=_TRAIN,
        twin=dict(vocab_size=96, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                  dropout_rate=0.0)),
    PublishedModel(
        name="vit-l16", hub_id="google/vit-large-patch16-224", model_class="ViTForImageClassification",
        config_class="ViTConfig", task="image_classification",
        config=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                    hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                    image_size=224, patch_size=16, num_channels=3, qkv_bias=True, layer_norm_eps=1e-12,
                    num_labels=1000),
        seq_len=197, global_batch=512,
        setting="ImageNet-1k fine-tuning at 224 px (196 patches + CLS), batch 512 (Dosovitskiy et al. "
                "2021, B.1.1)",
        twin=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  image_size=32, patch_size=8, num_labels=10)),
)}


def _transformers(name: str):
    return getattr(importlib.import_module("transformers"), name)


def _entry(name: str) -> PublishedModel:
    if name not in PUBLISHED:
        raise KeyError(f"unknown published model {name!r}; choose one of {sorted(PUBLISHED)}")
    return PUBLISHED[name]


DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
                "dropout_rate", "attention_dropout")
"""Config keys of dropout probabilities (GPT-2, BERT / ViT, T5, LLaMA-style)."""


def hf_config(name: str, *, twin: bool = False, dropout: bool = True):
    """The transformers config of ``name``: published values, training changes, and the
    twin's sizes when ``twin``; every dropout 0 unless ``dropout``. Default attention
    (nothing forces eager)."""
    m = _entry(name)
    values = {**m.config, **m.training, **(m.twin if twin else {})}
    if not dropout:
        values.update({k: 0.0 for k in DROPOUT_KEYS if k in values})
    return _transformers(m.config_class)(**values)


def hf_train_step(model: nn.Module, optimizer, batch: dict) -> torch.Tensor:
    """The training step of Hugging Face's docs: the model computes its own loss from ``labels``
    (``optimizer``: one, or a tuple or list of them, as Muon's users pair it with AdamW)."""
    optimizers = optimizer if isinstance(optimizer, (tuple, list)) else (optimizer,)
    for opt in optimizers:
        opt.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    for opt in optimizers:
        opt.step()
    return loss


# ---------------------------------------------------------------- batches
# Built as a user's data pipeline hands them over: tokenizer outputs (input_ids, attention_mask)
# with right padding, and labels with IGNORE wherever no loss is wanted. On the meta device the
# tensors only have shapes and dtypes (zeros): planning needs no values.


def _ints(low: int, high: int, shape, gen: torch.Generator | None, device) -> torch.Tensor:
    if torch.device(device).type == "meta":
        return torch.zeros(shape, dtype=torch.long, device="meta")
    return torch.randint(low, high, shape, generator=gen, device=device)


def _padded(ids: torch.Tensor, gen, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) of ``ids`` [B, T] right-padded by a different number
    of tokens per sample (0 to T/2 - 1: some samples have none), labels IGNORE at the padding.
    Different counts per sample make every shard and microbatch hold its own number of
    ignored labels: the case where a mean over each part is not the batch's mean."""
    if ids.device.type == "meta":
        return ids, torch.ones_like(ids), ids.clone()
    b, t = ids.shape
    num_pad = torch.randperm(b, generator=gen) * (t // 2) // b  # [B], distinct while B <= T/2
    pad = torch.arange(t) >= (t - num_pad)[:, None]  # [B, T], True on the padding
    return ids.masked_fill(pad, pad_id), (~pad).long(), ids.masked_fill(pad, IGNORE)


def _causal_lm(cfg, m: PublishedModel, b: int, t: int, gen, device) -> dict:
    input_ids, attention_mask, labels = _padded(_ints(3, cfg.vocab_size, (b, t), gen, device), gen,
                                                cfg.eos_token_id)
    # labels = input_ids: the model shifts them itself (ForCausalLMLoss)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def _masked_lm(cfg, m: PublishedModel, b: int, t: int, gen, device) -> dict:
    """BERT's recipe: ``MLM_PROBABILITY`` of the tokens replaced by [MASK]; labels only there."""
    ids = _ints(m.mask_token_id + 1, cfg.vocab_size, (b, t), gen, device)  # ids above the special tokens
    if ids.device.type == "meta":
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())
    masked = torch.rand(b, t, generator=gen) < MLM_PROBABILITY  # [B, T]
    return dict(input_ids=ids.masked_fill(masked, m.mask_token_id), attention_mask=torch.ones_like(ids),
                labels=ids.masked_fill(~masked, IGNORE))


def _seq2seq(cfg, m: PublishedModel, b: int, t: int, gen, device) -> dict:
    """Padded sources (attention_mask) and padded targets (IGNORE), as in HF's T5 training docs."""
    input_ids, attention_mask, _ = _padded(_ints(2, cfg.vocab_size, (b, t), gen, device), gen, cfg.pad_token_id)
    tt = m.target_len if t == m.seq_len else max(2, t // 2)
    _, _, labels = _padded(_ints(2, cfg.vocab_size, (b, tt), gen, device), gen, cfg.pad_token_id)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def _image_classification(cfg, m: PublishedModel, b: int, t: int, gen, device) -> dict:
    shape = (b, cfg.num_channels, cfg.image_size, cfg.image_size)
    if torch.device(device).type == "meta":
        pixels = torch.zeros(shape, device="meta")
    else:
        pixels = torch.randn(shape, generator=gen, device=device)
    return dict(pixel_values=pixels, labels=_ints(0, cfg.num_labels, (b,), gen, device))


_BATCHES: dict[str, Callable[..., dict]] = {"causal_lm": _causal_lm, "masked_lm": _masked_lm,
                                            "seq2seq": _seq2seq, "image_classification": _image_classification}


def hf_batch(name: str, config, batch_size: int, seq_len: int, *, device="cpu", seed: int = 0) -> dict:
    """The batch of ``name``'s task for ``config`` (published or twin): ``batch_size`` samples of
    ``seq_len`` tokens (seq2seq targets: ``target_len``, a twin's ``seq_len // 2``), values drawn
    from ``seed``."""
    m = _entry(name)
    gen = torch.Generator().manual_seed(seed)
    return _BATCHES[m.task](config, m, batch_size, seq_len, gen, device)


# ---------------------------------------------------------------- models


def hf_published(name: str, *, batch_size: int | None = None, seq_len: int | None = None,
                 optimizer: str = "adamw", dropout: bool = True
                 ) -> tuple[nn.Module, torch.optim.Optimizer, dict, Callable]:
    """``(model, optimizer, batch, hf_train_step)`` of the published ``name`` on the meta device
    (no memory, nothing downloaded), at its ``global_batch`` and ``seq_len`` unless given;
    ``dropout=False`` sets the published dropout probabilities to 0.
    fp32 parameters: with ``capture(..., precision='bf16')`` they are the master weights."""
    m = _entry(name)
    cfg = hf_config(name, dropout=dropout)
    with torch.device("meta"):
        model = _transformers(m.model_class)(cfg)
    model.train()
    batch = hf_batch(name, cfg, batch_size or m.global_batch, seq_len or m.seq_len, device="meta")
    return model, make_optimizer(optimizer, model), batch, hf_train_step


TWIN_BATCH, TWIN_SEQ = 8, 16
"""Batch and sequence length the twins train on."""


def hf_twin(name: str, seed: int = 0) -> nn.Module:
    """``name``'s transformers class at its twin's size (``PublishedModel.twin``) with random
    weights from ``seed``, in train mode; the global RNG is left untouched."""
    m = _entry(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _transformers(m.model_class)(hf_config(name, twin=True))
    return model.train()
