"""The published architectures are the published ones, and their batches are a user's.

``alpa_torch/zoo_hf.py`` writes each model's ``config.json`` values by hand: built on the
meta device, every model must have exactly the parameter count its authors published
(the Hub's safetensors metadata), which catches a wrong width, head count, vocabulary or
tie. Fast: nothing is captured or trained (``tests/test_hf_twins.py`` trains the twins).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never the network

import pytest
import torch

pytest.importorskip("transformers")
from alpa_torch.zoo_hf import (  # noqa: E402 - needs transformers
    IGNORE,
    PUBLISHED,
    TWIN_BATCH,
    TWIN_SEQ,
    hf_batch,
    hf_config,
    hf_published,
    hf_twin,
)

# Parameters of each published checkpoint (tied embeddings counted once; BERT with its MLM head
# and without the pooler, as BertForMaskedLM; ViT with its 1000-class head).
PUBLISHED_PARAMS = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "mistral-7b": 7_241_732_096,
                    "mixtral-8x7b": 46_702_792_704, "qwen2-7b": 7_615_616_512, "gpt2-xl": 1_557_611_200,
                    "bert-large": 335_174_458, "t5-large": 737_668_096, "vit-l16": 304_326_632}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_count(name):
    model, optimizer, batch, _ = hf_published(name)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[name]
    assert all(p.device.type == "meta" and p.dtype == torch.float32 for p in model.parameters())
    assert all(v.device.type == "meta" for v in batch.values())
    assert isinstance(optimizer, torch.optim.AdamW)
    assert model.config._attn_implementation == "sdpa"  # the default, not forced to eager


@pytest.mark.parametrize("name", ["llama3-8b", "t5-large"])
def test_padded_labels_differ_per_sample(name):
    """Right padding of a different length per sample: attention_mask 0 and labels IGNORE there."""
    model = hf_twin(name)
    batch = hf_batch(name, model.config, TWIN_BATCH, TWIN_SEQ, seed=0)
    inputs_pad = (batch["attention_mask"] == 0).sum(dim=1)  # [B]
    assert len(set(inputs_pad.tolist())) == TWIN_BATCH and 0 in inputs_pad.tolist()
    pads = (batch["labels"] == IGNORE).sum(dim=1)  # [B]; T5's 8 target tokens: 4 distinct lengths
    assert len(set(pads.tolist())) >= 4 and 0 in pads.tolist()
    width = batch["labels"].shape[1]
    for row, n in zip(batch["labels"], pads.tolist()):
        assert (row[width - n:] == IGNORE).all() and (row[:width - n] != IGNORE).all()  # at the end only
    if name == "llama3-8b":
        assert torch.equal(batch["attention_mask"] == 0, batch["labels"] == IGNORE)


def test_masked_lm_labels_only_the_masked_tokens():
    m = PUBLISHED["bert-large"]
    model = hf_twin("bert-large")
    batch = hf_batch("bert-large", model.config, TWIN_BATCH, TWIN_SEQ, seed=0)
    masked = batch["input_ids"] == m.mask_token_id
    assert masked.any() and torch.equal(masked, batch["labels"] != IGNORE)


def test_twins_keep_the_architecture():
    """A twin changes sizes and dropout only: Mistral's window still cuts its sequences,
    Mixtral still routes top-2 of 8 experts with its load-balancing loss."""
    mistral = hf_config("mistral-7b", twin=True)
    assert mistral.sliding_window < TWIN_SEQ
    mixtral = hf_config("mixtral-8x7b", twin=True)
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok, mixtral.output_router_logits) == (8, 2, True)
    gpt2 = hf_config("gpt2-xl", twin=True)
    assert gpt2.activation_function == "gelu_new" and gpt2.tie_word_embeddings
    assert (gpt2.resid_pdrop, gpt2.embd_pdrop, gpt2.attn_pdrop) == (0.0, 0.0, 0.0)
    assert hf_config("gpt2-xl").resid_pdrop == 0.1 and hf_config("gpt2-xl", dropout=False).resid_pdrop == 0.0


def test_the_cli_loads_the_published_builder_from_the_repository_root(monkeypatch):
    """``alpa-torch plan alpa_torch.zoo_hf:hf_published`` (bench/plan_targets.py, bench/plan_zoo.py)
    from the repository's root, where ``alpa_torch/zoo_hf.py`` is also a file of the current
    directory: imported as the module it is (loaded as a file, its relative imports failed)."""
    from pathlib import Path

    from alpa_torch.workloads import load_workload

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    work = load_workload("alpa_torch.zoo_hf:hf_published", model_args=["name=gpt2-xl"])
    assert sum(p.numel() for p in work.model.parameters()) == PUBLISHED_PARAMS["gpt2-xl"]
