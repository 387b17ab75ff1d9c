"""Golden tests: Hugging Face models, unchanged, through ``parallelize`` on 2x2 devices.

Each case builds a transformers model from a config (random weights, nothing
downloaded; ``alpa_torch/zoo.py``), runs 3 steps of the automatically planned step on
``Cluster.local(2, 2)`` (the session Ray) and compares every step's loss and every
parameter afterwards with eager single-device training (fp32, atol 1e-5).

Families: GPT-2 and LLaMA (causal LM), BERT (sequence classification and masked LM),
T5 (encoder-decoder with labels). Planning takes 20-40 s per model on 2 cores, so
BERT-MLM's automatic plan and T5's pipeline of two microbatches are ``slow`` tests (CI runs
them); the other cases, whose models the twins of ``tests/test_hf_twins.py``
also train, are a sweep (``python -m pytest -m sweep tests/test_hf.py``). GPT-2 also runs by
default in ``test_runtime.test_automatic_plan_matches_eager``. BERT-MLM and T5 tie weights (the
decoder to the word embeddings, T5's shared embedding): the stage DP keeps each tied
weight's readers in one stage (``stage_dp.tables.tied_spans``); T5 also holds a graph
constant (``get_attr``) that every pipeline stage makes itself.
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never the network

import pytest
import torch

from alpa_torch import Cluster, parallelize
from alpa_torch.zoo import build, make_batch, make_optimizer, train_step

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("ray_session")
ATOL = 1e-5
STEPS = 3


def run_golden(name: str, opt: str = "adamw", **options):
    """3 planned steps on 2x2 local devices vs eager; returns the plan."""
    eager, _ = build(name)
    model = copy.deepcopy(eager)
    eager_opt, optimizer = make_optimizer(opt, eager), make_optimizer(opt, model)
    step = parallelize(train_step, cluster=Cluster.local(2, 2), **options)
    try:
        for i in range(STEPS):
            batch = make_batch(name, 8, seed=i)
            expected = float(train_step(eager, eager_opt, batch).detach())
            got = float(step(model, optimizer, batch))
            assert got == pytest.approx(expected, abs=ATOL), f"{name} step {i}: loss {got} != eager {expected}"
        state = step.state_dict()
        plan = step.plan
    finally:
        step.shutdown()
    assert sum(s.num_devices for s in plan.stages) == 4
    for pname, p in eager.named_parameters():
        torch.testing.assert_close(state["model"][pname], p.detach(), atol=ATOL, rtol=0, msg=f"{name}: {pname}")
    return plan


@pytest.mark.sweep
def test_bert_sequence_classification_matches_eager():
    run_golden("hf_bert")


@pytest.mark.sweep
@pytest.mark.parametrize("name,opt", [("hf_gpt2", "adamw"), ("hf_llama", "adamw")])
def test_causal_lm_matches_eager(name, opt):
    run_golden(name, opt)


@pytest.mark.sweep
def test_bert_masked_lm_one_stage_matches_eager():
    """BertForMaskedLM ties its decoder to the word embeddings; one stage forced."""
    assert len(run_golden("hf_bert_mlm", "adam", pipeline=False).stages) == 1


@pytest.mark.sweep
def test_t5_one_stage_matches_eager():
    """T5 with labels=, one stage and one microbatch (each device's whole step as one program)."""
    plan = run_golden("hf_t5", pipeline=False, num_microbatches=1)
    assert len(plan.stages) == 1 and plan.num_microbatches == 1


# Automatic plans of models with tied parameters (BERT-MLM's decoder is its word embeddings,
# T5's embedding is shared by encoder and decoder): read by the first and the last layer, so
# the stage DP starts no stage inside a tied weight's layer span. T5's _shift_right writes
# `ids[..., 0] = decoder_start_token_id`, a graph constant every pipeline stage that reads it
# makes itself (runtime/pipeline.PipelineRunner._base_env).
@pytest.mark.slow
def test_bert_masked_lm_automatic_plan():
    plan = run_golden("hf_bert_mlm", "adam")
    assert plan.options["num_stages"] is None and not plan.options["num_microbatches"]  # nothing forced


@pytest.mark.parametrize("options", [pytest.param({}, marks=pytest.mark.sweep),
                                     pytest.param({"num_microbatches": 2}, marks=pytest.mark.slow)],
                         ids=["automatic", "microbatches"])
def test_t5_pipeline_engine(options):
    plan = run_golden("hf_t5", **options)
    if options:  # two microbatches: the pipelined programs (forward, backward, update) run
        assert plan.num_microbatches == 2


# Models trained the way Hugging Face documents it: ``model(**batch).loss`` with ``labels=``
# (HF's own shifted cross-entropy, ignore_index -100), no wrapper, on Cluster.local(1, 2).
def hf_labels_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss


def run_hf_labels(model, cluster=(1, 2), param_atol=ATOL, **options):
    """3 planned steps of ``hf_labels_step`` vs eager on a deep copy (AdamW); returns the plan.
    Losses agree within ATOL, parameters within ``param_atol``; ``options`` go to ``parallelize``."""
    eager = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = parallelize(hf_labels_step, Cluster.local(*cluster), plan_cache=False, **options)
    try:
        for i in range(STEPS):
            ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(i))
            batch = dict(input_ids=ids, labels=ids.clone())
            expected = float(hf_labels_step(eager, eager_opt, batch).detach())
            got = float(step(model, optimizer, batch))
            assert got == pytest.approx(expected, abs=ATOL), f"step {i}: loss {got} != eager {expected}"
        state, plan = step.state_dict(), step.plan
    finally:
        step.shutdown()
    for pname, p in eager.named_parameters():
        torch.testing.assert_close(state["model"][pname], p.detach(), atol=param_atol, rtol=0)
    return plan


@pytest.mark.sweep
@pytest.mark.parametrize("attn", [None, "eager"], ids=["default_attention", "eager_attention"])
def test_llama_labels_loss_matches_eager(attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    extra = {} if attn is None else {"attn_implementation": attn}
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      use_cache=False, **extra)
    torch.manual_seed(0)
    run_hf_labels(LlamaForCausalLM(cfg))


@pytest.mark.sweep
def test_mixtral_router_aux_loss_matches_eager():
    """Mixtral's default 'grouped_mm' experts (float32 F.grouped_mm: decomposed at capture,
    alpa_torch/grouped_mm.py) and its load-balancing loss, a product of batch means
    (output_router_logits=True: one microbatch, alpa_torch/coupling.py).

    Parameters within 1e-4, not 1e-5: AdamW divides each gradient entry by its own
    magnitude, so an entry near zero moves by up to lr on rounding alone. Transformers' own
    eager experts implementations ('grouped_mm' vs 'batched_mm') differ by 5.6e-5 in
    layers.1.self_attn.o_proj after these 3 steps, the planned step by 6.2e-5."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=32, use_cache=False,
                        output_router_logits=True)
    torch.manual_seed(0)
    plan = run_hf_labels(MixtralForCausalLM(cfg), param_atol=1e-4)
    assert plan.num_microbatches == 1
