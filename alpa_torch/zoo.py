"""The model zoo: small models for the demo, the tests and the benchmarks, their batches, one plain step.

What it owns: the models that tests and benchmarks parallelize (an MLP, a
nanoGPT-style GPT, a BatchNorm CNN, and Hugging Face GPT-2 / Llama built from
configs with random weights), deterministic batches for them, the optimizers
used with them, and ONE generic single-device ``train_step`` written exactly as
a user would write it. What it does not own: capture, planning or execution;
those take ``train_step`` and a model from here as their input.

Every zoo model exposes ``loss(batch) -> scalar tensor`` (mean cross-entropy),
so ``model_loss`` needs no per-kind dispatch. Nothing here touches the network:
Hugging Face models are built from configs, never downloaded.

    model, batch = ZOO["gpt"]()              # seeded model + batch of size 8
    opt = make_optimizer("adamw", model)
    loss = train_step(model, opt, batch)
    batch2 = make_batch("gpt", batch_size=8, seed=1)

Reading order: ``train_step`` / ``make_optimizer``, then the models, then ``ZOO``.
Published Hugging Face architectures at full size (on the meta device, for planning) and
their small twins live in ``zoo_hf.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]

# ---------------------------------------------------------------- training step


def model_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Forward + loss for any zoo model (each one defines ``loss(batch)``)."""
    loss_fn = getattr(model, "loss", None)
    if not callable(loss_fn):
        raise TypeError(
            f"{type(model).__name__} has no `loss(batch)` method; zoo models define one. "
            "Wrap your model in a module whose `loss(batch)` returns a scalar tensor."
        )
    return loss_fn(batch)


def train_step(model: nn.Module, optimizer, batch: Batch) -> torch.Tensor:
    """One plain single-device training step, exactly as a user writes it (``optimizer``: one, or a
    tuple or list of them: Muon's users pair it with AdamW)."""
    optimizers = optimizer if isinstance(optimizer, (tuple, list)) else (optimizer,)
    for opt in optimizers:
        opt.zero_grad()
    loss = model_loss(model, batch)  # forward + loss
    loss.backward()
    for opt in optimizers:
        opt.step()
    return loss


OPTIMIZERS = ("sgd", "adam", "adamw", "muon")


def muon_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The hidden weight matrices Muon is for (its docs): 2-D parameters, not the input embeddings or
    the output head (a Hugging Face model's ``get_output_embeddings``), which go to AdamW."""
    skip = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    skip |= {id(p) for p in head.parameters()} if head is not None else set()
    return [p for p in model.parameters() if p.dim() == 2 and id(p) not in skip]


def make_optimizer(kind: str, model: nn.Module, lr: float | None = None,
                   foreach: bool | None = False) -> torch.optim.Optimizer | tuple:
    """torch.optim optimizer of ``kind`` in ``OPTIMIZERS`` with the zoo's settings.

    sgd: lr 1e-2, momentum 0.9, weight_decay 1e-4; adam: lr 1e-3;
    adamw: lr 1e-3, weight_decay 0.01; muon: a tuple, ``torch.optim.Muon`` (lr 0.02) on the hidden
    matrices (``muon_parameters``) and AdamW on the rest. ``foreach=False`` by default so the
    traced update is one op chain per parameter on every device (CUDA would
    otherwise pick the multi-tensor ``_foreach_*`` kernels); pass None for
    torch's own default.
    """
    params = model.parameters()
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2 if lr is None else lr, momentum=0.9, weight_decay=1e-4,
                               foreach=foreach)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3 if lr is None else lr, foreach=foreach)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3 if lr is None else lr, weight_decay=0.01, foreach=foreach)
    if kind == "muon":
        matrices = muon_parameters(model)
        ids = {id(p) for p in matrices}
        return (torch.optim.Muon(matrices, lr=0.02 if lr is None else lr),
                torch.optim.AdamW([p for p in model.parameters() if id(p) not in ids], lr=1e-3, weight_decay=0.01,
                                  foreach=foreach))
    raise ValueError(f"unknown optimizer kind {kind!r}; choose one of {OPTIMIZERS}")


# ---------------------------------------------------------------- MLP


class MLP(nn.Module):
    """``depth`` Linear layers with GELU between them: in_dim -> hidden ... -> out_dim."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, depth: int = 2):
        super().__init__()
        if depth < 1:
            raise ValueError(f"MLP depth must be >= 1, got {depth}")
        dims = [in_dim] + [hidden] * (depth - 1) + [out_dim]
        layers: list[nn.Module] = []
        for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
            layers.append(nn.Linear(d_in, d_out))
            if i < depth - 1:
                layers.append(nn.GELU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # [B, in_dim] -> [B, out_dim]

    def loss(self, batch: Batch) -> torch.Tensor:
        x, y = batch  # [B, in_dim] float, [B] long
        return F.cross_entropy(self(x), y)


# ---------------------------------------------------------------- GPT (nanoGPT-style)


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Shape of a nanoGPT-style pre-LN decoder (dropout is always 0)."""

    vocab_size: int
    """Number of token ids."""
    block_size: int
    """Longest sequence; size of the learned position table and causal mask."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int
    """Model width d."""
    bias: bool = True
    """Bias in Linear and LayerNorm layers (GPT-2/GPT-3 style)."""
    tie_weights: bool = False
    """Share the token embedding with ``lm_head`` (GPT-3's counts assume True)."""
    attention: str = "explicit"
    """'explicit': matmul, mask, softmax, matmul (what the planner splits op by op); 'sdpa':
    ``F.scaled_dot_product_attention``, as nanoGPT and Hugging Face models call it (one fused
    operator, ``alpa_torch/core/attention_op.py``)."""

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide n_embd={self.n_embd}")
        if self.attention not in ("explicit", "sdpa"):
            raise ValueError(f"attention={self.attention!r}: use 'explicit' or 'sdpa'")

    @classmethod
    def tiny(cls, **kw) -> GPTConfig:
        return cls(**{**dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32), **kw})

    @classmethod
    def small(cls, **kw) -> GPTConfig:
        return cls(**{**dict(vocab_size=128, block_size=32, n_layer=4, n_head=4, n_embd=64), **kw})

    @classmethod
    def deep(cls, **kw) -> GPTConfig:
        """Many thin layers: for stage (pipeline) partitioning tests."""
        return cls(**{**dict(vocab_size=64, block_size=16, n_layer=8, n_head=2, n_embd=32), **kw})

    def num_params(self) -> int:
        """Exact parameter count of ``GPT(self)`` (shared tensors counted once)."""
        d, b = self.n_embd, int(self.bias)
        ln = d * (1 + b)
        # ln_1 + qkv [d,3d] + proj [d,d] + ln_2 + fc [d,4d] + proj [4d,d]
        block = 2 * ln + 12 * d * d + b * (3 * d + d + 4 * d + d)
        embeddings = self.vocab_size * d + self.block_size * d
        head = 0 if self.tie_weights else self.vocab_size * d
        return self.n_layer * block + embeddings + ln + head


# GPT-3 paper (Brown et al. 2020, Table 2.1) shapes, as used in Alpa's GPT
# benchmark: name -> (n_layer, n_embd, n_head); seq 1024, vocab 51200.
_GPT3_SHAPES = {
    "1.3b": (24, 2048, 32),
    "2.6b": (32, 2560, 32),
    "6.7b": (32, 4096, 32),
    "15b": (48, 5120, 40),
    "39b": (48, 8192, 64),
}


def gpt_config(name: str, **overrides) -> GPTConfig:
    """GPT-3 paper shapes for planning ('1.3b' ... '39b'); build on ``meta``.

    The nominal sizes count tied embeddings; with the default untied
    ``lm_head`` a model has ``vocab_size * n_embd`` more parameters
    (1.3b: 1.42e9 untied, 1.32e9 tied).
    """
    if name not in _GPT3_SHAPES:
        raise ValueError(f"unknown GPT size {name!r}; choose one of {sorted(_GPT3_SHAPES)}")
    n_layer, n_embd, n_head = _GPT3_SHAPES[name]
    cfg = GPTConfig(vocab_size=51200, block_size=1024, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    return replace(cfg, **overrides)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention, written with matmul/masked_fill/softmax (the explicit ops the
    sharding planner splits along heads or batch) or, with ``attention='sdpa'``, as one
    ``scaled_dot_product_attention`` call."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.sdpa = cfg.attention == "sdpa"
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # fused q, k, v
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        if not self.sdpa:  # True above the diagonal = a future position that must be hidden.
            future = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool).triu(1)
            self.register_buffer("causal_mask", future, persistent=False)  # [block, block]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # each [B, T, C]
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, hd]
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # [B, H, T, T]
            att = att.masked_fill(self.causal_mask[:T, :T], float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v  # [B, H, T, hd]
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT-like decoder; ``forward(idx)`` gives logits, ``loss`` the mean CE."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2 paper: scale residual projections by 1/sqrt(2 * n_layer).
        for block in self.blocks:
            for proj in (block.attn.c_proj, block.mlp[2]):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, T = idx.shape  # [B, T] long
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # [T]
        x = self.wte(idx) + self.wpe(pos)  # [B, T, C]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # [B, T, V]

    def loss(self, batch: Batch) -> torch.Tensor:
        return lm_loss(self(batch[0]), batch[1])


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token; ``targets`` are already next-token ids."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # [B*T, V] vs [B*T]


# ---------------------------------------------------------------- CNN


class CNN(nn.Module):
    """Two (conv, BatchNorm2d, ReLU, max-pool) stages and a linear head.

    BatchNorm mutates running_mean / running_var / num_batches_tracked in the
    forward pass in training mode: the buffer-update case for capture.
    """

    def __init__(self, in_channels: int = 3, width: int = 8, num_classes: int = 10,
                 image_size: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width * (image_size // 4) ** 2, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.features(images)  # [B, 2w, S/4, S/4]
        return self.head(x.flatten(1))  # [B, classes]

    def loss(self, batch: Batch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self(images), labels)


# ---------------------------------------------------------------- Hugging Face


class HFCausalLM(nn.Module):
    """Wraps a Hugging Face ``*ForCausalLM`` so its loss matches ``GPT.loss``.

    Batch is (input_ids [B, T], targets [B, T]) with targets already shifted,
    exactly as for ``GPT``. We compute the loss from the logits ourselves:
    HF's ``labels=`` loss shifts the labels again inside the model and drops
    the last position, so it is not the same number as ``GPT.loss``.

    An explicit all-ones ``attention_mask`` is passed on purpose: without one,
    transformers 5.x looks for packed sequences in ``position_ids`` with a
    data-dependent ``.all()`` (masking_utils.find_packed_sequence_indices) that
    plain ``make_fx`` tracing cannot get past.
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        attention_mask = torch.ones_like(input_ids)  # [B, T]: no padding
        return self.hf(input_ids=input_ids, attention_mask=attention_mask,
                       use_cache=False).logits  # [B, T, V]

    def loss(self, batch: Batch) -> torch.Tensor:
        return lm_loss(self(batch[0]), batch[1])


def hf_gpt2(n_layer: int = 2, n_embd: int = 32, n_head: int = 2, vocab: int = 64,
            n_positions: int = 32, tie_weights: bool = False) -> HFCausalLM:
    """``GPT2LMHeadModel`` from a config: random weights, eager attention, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        # The defaults (50256) lie outside a small vocab and make HF warn.
        bos_token_id=vocab - 1, eos_token_id=vocab - 1,
        tie_word_embeddings=tie_weights, use_cache=False, attn_implementation="eager",
    )
    return HFCausalLM(GPT2LMHeadModel(cfg))


def hf_llama(n_layer: int = 2, hidden: int = 32, intermediate: int = 64, n_head: int = 2,
             n_kv_head: int = 1, vocab: int = 64, max_positions: int = 32,
             tie_weights: bool = False) -> HFCausalLM:
    """``LlamaForCausalLM`` from a config: random weights, eager attention, GQA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv_head,
        max_position_embeddings=max_positions, attention_dropout=0.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
        tie_word_embeddings=tie_weights, use_cache=False, attn_implementation="eager",
    )
    return HFCausalLM(LlamaForCausalLM(cfg))


# ---------------------------------------------------------------- batches and ZOO

SEQ_LEN = 16  # tokens per sequence for every language-model entry
_MLP_DIMS = dict(in_dim=16, hidden=32, out_dim=8, depth=3)


def _lm_batch(vocab: int, batch_size: int, gen: torch.Generator) -> Batch:
    seq = torch.randint(0, vocab, (batch_size, SEQ_LEN + 1), generator=gen)  # [B, T+1]
    return seq[:, :-1].clone(), seq[:, 1:].clone()  # idx, next-token targets: [B, T] each


def _mlp_batch(batch_size: int, gen: torch.Generator) -> Batch:
    x = torch.randn(batch_size, _MLP_DIMS["in_dim"], generator=gen)
    return x, torch.randint(0, _MLP_DIMS["out_dim"], (batch_size,), generator=gen)


def _cnn_batch(batch_size: int, gen: torch.Generator) -> Batch:
    images = torch.randn(batch_size, 3, 16, 16, generator=gen)
    return images, torch.randint(0, 10, (batch_size,), generator=gen)


# name -> (model builder, batch builder(batch_size, generator))
_ENTRIES: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator], Batch]]] = {
    "mlp": (lambda: MLP(**_MLP_DIMS), _mlp_batch),
    "gpt": (lambda: GPT(GPTConfig.tiny()), lambda b, g: _lm_batch(64, b, g)),
    "cnn": (CNN, _cnn_batch),
    "hf_gpt2": (hf_gpt2, lambda b, g: _lm_batch(64, b, g)),
    "hf_llama": (hf_llama, lambda b, g: _lm_batch(64, b, g)),
}


def make_batch(name: str, batch_size: int = 8, seed: int = 0) -> Batch:
    """A fresh deterministic batch for zoo entry ``name``."""
    if name not in _ENTRIES:
        raise KeyError(f"unknown zoo model {name!r}; choose one of {sorted(_ENTRIES)}")
    gen = torch.Generator().manual_seed(seed)
    return _ENTRIES[name][1](batch_size, gen)


def build(name: str, seed: int = 0, batch_size: int = 8) -> tuple[nn.Module, Batch]:
    """Seeded model (train mode) and batch; the global RNG state is left untouched."""
    if name not in _ENTRIES:
        raise KeyError(f"unknown zoo model {name!r}; choose one of {sorted(_ENTRIES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _ENTRIES[name][0]()
    return model.train(), make_batch(name, batch_size, seed)


ZOO: dict[str, Callable[[], tuple[nn.Module, Batch]]] = {
    name: (lambda name=name: build(name)) for name in _ENTRIES
}


# ---------------------------------------------------------------- Hugging Face encoders and encoder-decoders
# Appended after ZOO on purpose (the entries above stay as they were): BERT and T5
# built from configs, random weights, eager attention, no dropout, nothing downloaded.
# Every loss is a plain mean over all its targets (no ignore_index=-100 positions), so
# the mean of equal microbatch means is the full-batch mean and pipelined training
# equals eager training exactly. No attention_mask is passed (unlike HFCausalLM): for
# these models transformers 5.x then skips mask creation, while an explicit all-ones mask
# makes it test ``padding_mask.all()`` (masking_utils._ignore_bidirectional_mask_sdpa), a
# data-dependent branch plain make_fx cannot trace (capture's fake tensors skip it).

BERT_CLASSES = 4
MASK_ID = 1  # the [MASK] token of the small vocabularies below (0 is padding)


class HFSequenceClassifier(nn.Module):
    """Wraps ``*ForSequenceClassification``; batch = (input_ids [B, T], labels [B])."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids).logits  # [B, classes]

    def loss(self, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])


class HFMaskedLM(nn.Module):
    """Wraps ``*ForMaskedLM``; batch = (masked input_ids [B, T], original ids [B, T]).

    The loss covers every position (the original token is the target everywhere),
    not only the masked ones as in BERT's recipe: a -100 target count that differs
    between microbatches would make the pipelined loss differ from the eager one.
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids).logits  # [B, T, V]

    def loss(self, batch: Batch) -> torch.Tensor:
        return lm_loss(self(batch[0]), batch[1])


class HFSeq2SeqLM(nn.Module):
    """Wraps an encoder-decoder ``*ForConditionalGeneration`` (T5); batch = (input_ids [B, T],
    labels [B, T]). The model's own ``labels=`` loss: it shifts the labels right into the
    decoder inputs itself and takes the mean cross-entropy over every label."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids, labels=labels, use_cache=False).loss

    def loss(self, batch: Batch) -> torch.Tensor:
        return self(batch[0], batch[1])


def _bert_config(n_layer: int, hidden: int, n_head: int, intermediate: int, vocab: int, max_positions: int,
                 **extra):
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=n_layer, num_attention_heads=n_head,
                      intermediate_size=intermediate, max_position_embeddings=max_positions,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
                      attn_implementation="eager", **extra)


def hf_bert(n_layer: int = 2, hidden: int = 32, n_head: int = 2, intermediate: int = 64, vocab: int = 64,
            max_positions: int = 32, num_labels: int = BERT_CLASSES) -> HFSequenceClassifier:
    """``BertForSequenceClassification`` from a config: random weights, eager attention, no dropout."""
    from transformers import BertForSequenceClassification

    cfg = _bert_config(n_layer, hidden, n_head, intermediate, vocab, max_positions, num_labels=num_labels)
    return HFSequenceClassifier(BertForSequenceClassification(cfg))


def hf_bert_mlm(n_layer: int = 2, hidden: int = 32, n_head: int = 2, intermediate: int = 64, vocab: int = 64,
                max_positions: int = 32) -> HFMaskedLM:
    """``BertForMaskedLM`` from a config (its decoder tied to the word embeddings, as BERT's)."""
    from transformers import BertForMaskedLM

    return HFMaskedLM(BertForMaskedLM(_bert_config(n_layer, hidden, n_head, intermediate, vocab, max_positions)))


def hf_t5(n_layer: int = 2, d_model: int = 32, n_head: int = 2, d_kv: int = 16, d_ff: int = 64,
          vocab: int = 64) -> HFSeq2SeqLM:
    """``T5ForConditionalGeneration`` from a config: encoder and decoder of ``n_layer`` blocks each."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_kv, d_ff=d_ff, num_layers=n_layer,
                   num_decoder_layers=n_layer, num_heads=n_head, dropout_rate=0.0, pad_token_id=0,
                   eos_token_id=1, decoder_start_token_id=0, use_cache=False, attn_implementation="eager")
    return HFSeq2SeqLM(T5ForConditionalGeneration(cfg))


def _cls_batch(vocab: int, batch_size: int, gen: torch.Generator) -> Batch:
    ids = torch.randint(2, vocab, (batch_size, SEQ_LEN), generator=gen)  # [B, T], no pad / mask ids
    return ids, torch.randint(0, BERT_CLASSES, (batch_size,), generator=gen)  # [B]


def _mlm_batch(vocab: int, batch_size: int, gen: torch.Generator) -> Batch:
    ids = torch.randint(2, vocab, (batch_size, SEQ_LEN), generator=gen)  # [B, T] originals
    masked = torch.rand(batch_size, SEQ_LEN, generator=gen) < 0.15  # BERT's 15 %
    return ids.masked_fill(masked, MASK_ID), ids


def _seq2seq_batch(vocab: int, batch_size: int, gen: torch.Generator) -> Batch:
    source = torch.randint(2, vocab, (batch_size, SEQ_LEN), generator=gen)  # [B, T]
    return source, torch.randint(2, vocab, (batch_size, SEQ_LEN), generator=gen)  # labels [B, T]


_ENTRIES["hf_bert"] = (hf_bert, lambda b, g: _cls_batch(64, b, g))
_ENTRIES["hf_bert_mlm"] = (hf_bert_mlm, lambda b, g: _mlm_batch(64, b, g))
_ENTRIES["hf_t5"] = (hf_t5, lambda b, g: _seq2seq_batch(64, b, g))
ZOO["hf_bert"] = lambda: build("hf_bert")

ZOO_SLOW: dict[str, Callable[[], tuple[nn.Module, Batch]]] = {
    name: (lambda name=name: build(name)) for name in ("hf_bert_mlm", "hf_t5")
}
"""Built like ``ZOO``'s entries (``build``, ``make_batch`` take their names) but kept out of ``ZOO``:
the tests parametrized over ``ZOO`` (capture x every optimizer) would take minutes longer with
T5 (~30 s per capture here). ``tests/test_hf.py`` trains them against eager (slow tests)."""
