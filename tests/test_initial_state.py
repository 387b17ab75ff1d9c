"""Models built on the meta device: initialised or loaded on the workers, equal to one device.

The driver decides where each tensor comes from (``alpa_torch/initial_state.py``) and every
worker reads only its slices (``runtime/state_sources.py``). Reference for initialisation:
``alpa_torch.init_weights`` (the same module-by-module initialisation on one device); for
weights: Hugging Face's ``from_pretrained`` of the same directory.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import alpa_torch
from alpa_torch import Cluster, PlanError, parallelize
from alpa_torch.zoo import GPT, GPTConfig, make_batch, train_step
from runtime.state_sources import ModuleInit, SafetensorsWeights, owners

ATOL = 1e-4  # three AdamW steps through a pipeline: reductions in another order (measured 1.8e-5)


def _meta_gpt(**cfg) -> GPT:
    with alpa_torch.empty_weights():
        return GPT(GPTConfig.tiny(**cfg))


def test_empty_weights_puts_parameters_on_meta_and_keeps_buffers():
    model = _meta_gpt()
    assert all(p.is_meta for p in model.parameters())
    mask = model.blocks[0].attn.causal_mask
    assert not mask.is_meta and torch.equal(mask, torch.ones(16, 16, dtype=torch.bool).triu(1))


def test_module_init_reads_what_init_weights_gives_tied_weights_included():
    model = _meta_gpt(tie_weights=True)
    ref = alpa_torch.init_weights(copy.deepcopy(model), GPT._init_weights, seed=7)
    assert ref.lm_head.weight is ref.wte.weight  # still tied after materialising
    names = [n for n, _ in model.named_parameters()]
    source = ModuleInit(model, GPT._init_weights, 7, names)
    want = dict(ref.named_parameters())
    for name in names:
        shape = want[name].shape
        box = [[0, n] for n in shape]
        torch.testing.assert_close(source.read(name, box, torch.float32), want[name].detach(), atol=0, rtol=0)
        half = [[shape[0] // 2, shape[0]]] + box[1:]  # a shard is the same slice of the same values
        torch.testing.assert_close(source.read(name, half, torch.float32), want[name].detach()[shape[0] // 2:],
                                   atol=0, rtol=0)
    assert owners(model)["wte.weight"] == "lm_head"  # the last module holding a tied weight initialises it


def test_init_weights_differs_by_seed_and_module():
    a = alpa_torch.init_weights(_meta_gpt(), GPT._init_weights, seed=0)
    b = alpa_torch.init_weights(_meta_gpt(), GPT._init_weights, seed=1)
    assert not torch.equal(a.wte.weight, b.wte.weight)
    assert not torch.equal(a.blocks[0].mlp[0].weight, a.blocks[1].mlp[0].weight)


@pytest.mark.usefixtures("ray_session")
def test_meta_gpt_trains_like_init_weights_on_one_device():
    """The automatic plan on 1x2 (a two-stage pipeline for this model): weights initialised on the workers."""
    torch.manual_seed(3)
    model = _meta_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = alpa_torch.init_weights(_meta_gpt(), GPT._init_weights, seed=3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    batches = [make_batch("gpt", 8, seed=i) for i in range(3)]
    step = parallelize(train_step, Cluster.local(1, 2), init_fn=GPT._init_weights)
    try:
        for batch in batches:
            want = float(train_step(ref, ref_opt, batch).detach())
            assert float(step(model, opt, batch)) == pytest.approx(want, abs=ATOL)
        step.sync(model, opt)
    finally:
        step.shutdown()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=ATOL, rtol=0, msg=name)
    assert all(p in {id(q) for q in model.parameters()} for p in map(id, opt.param_groups[0]["params"]))
    assert len(opt.state) == len(list(model.parameters()))  # sync left a usable optimizer


@pytest.mark.usefixtures("ray_session")
@pytest.mark.sweep
def test_sharded_plan_initialises_and_reloads_only_its_slices(tmp_path):
    """A plan that splits weights and optimizer state over two devices: each worker initialises
    its slices; a checkpoint of that plan loads back tile by tile into a new step."""
    from tests.test_checkpoint import _sharding_cluster

    batches = [make_batch("gpt", 8, seed=i) for i in range(3)]
    ref = alpa_torch.init_weights(_meta_gpt(), GPT._init_weights, seed=5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    want = [float(train_step(ref, ref_opt, b).detach()) for b in batches]
    model = _meta_gpt()
    step = parallelize(train_step, _sharding_cluster(), pipeline=False, init_fn=GPT._init_weights, tune=False)
    torch.manual_seed(5)  # the step's seed: torch.initial_seed() at its first call
    try:
        got = [float(step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches[0]))]
        sharded = [n for n, s in step.plan.stages[0].sharding.value_specs.items() if not s.is_replicated]
        state = {s.node: s.name for s in step.graph.inputs if s.kind in ("param", "opt_state")}
        assert any(n in state for n in sharded), "the free-communication cluster should shard state"
        step.save(str(tmp_path / "ck"))
    finally:
        step.shutdown()
    again = _meta_gpt()
    resumed = parallelize(train_step, _sharding_cluster(), pipeline=False, tune=False)
    try:
        resumed.load(str(tmp_path / "ck"))
        opt = torch.optim.AdamW(again.parameters(), lr=1e-3)
        got += [float(resumed(again, opt, b)) for b in batches[1:]]
    finally:
        resumed.shutdown()
    assert got == pytest.approx(want, abs=ATOL)


def test_a_buffer_lost_on_the_meta_device_is_named_before_workers_start():
    with torch.device("meta"):
        model = GPT(GPTConfig.tiny())
    step = parallelize(train_step, Cluster.local(1, 2), init_fn=GPT._init_weights, tune=False)
    with pytest.raises(PlanError, match=r"causal_mask.*empty_weights"):
        step(model, torch.optim.AdamW(model.parameters()), make_batch("gpt", 8))
    assert step.group is None


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.gain


def test_a_parameter_nothing_initialises_is_named():
    with alpa_torch.empty_weights():
        model = nn.Sequential(nn.Linear(8, 8), _Scale())

    def step_fn(m, o, batch):
        o.zero_grad()
        loss = m(batch).square().mean()
        loss.backward()
        o.step()
        return loss

    step = parallelize(step_fn, Cluster.local(1, 2), tune=False)
    with pytest.raises(PlanError, match=r"1\.gain.*init_fn"):
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8))
    assert step.group is None


# ---------------------------------------------------------------- Hugging Face weights
transformers = pytest.importorskip("transformers")


def _llama_config():
    return transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def hf_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = model(**batch).loss  # Hugging Face's documented training step
    loss.backward()
    optimizer.step()
    return loss


def test_sharded_hf_checkpoint_loads_into_the_plans_shards(tmp_path):
    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(_llama_config())
    saved.save_pretrained(tmp_path, max_shard_size="60KB")
    files = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(files) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    source, meta = SafetensorsWeights.scan(tmp_path)
    assert set(source.file_of.values()) == set(files) and meta["lm_head.weight"] == ((128, 64), "float32")

    eager = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    with alpa_torch.empty_weights():
        model = transformers.LlamaForCausalLM(_llama_config())
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = parallelize(hf_step, Cluster.local(1, 2), weights=str(tmp_path))
    try:
        for _ in range(2):
            want = float(hf_step(eager, eager_opt, batch).detach())
            assert float(step(model, opt, batch)) == pytest.approx(want, abs=1e-5)
    finally:
        step.shutdown()


# ---------------------------------------------------------------- larger than the driver
@pytest.mark.slow
def test_a_model_whose_state_outgrows_the_driver_trains_and_equals_eager():
    """``bench/driver_memory.py`` size 'l' (127M parameters, AdamW state 1.5 GB) in its own driver
    process: the driver's peak RSS stays under half the state, each of the four workers holds
    about a quarter of it, and the losses equal eager training of ``init_weights`` (another process)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "driver_memory.py"
    out = subprocess.run([sys.executable, str(bench), "--sizes", "l", "--eager", "l"], capture_output=True,
                         text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.splitlines()[0])
    assert line["adamw_state_bytes"] > 1.4e9
    assert line["driver_peak_rss_bytes"] < line["adamw_state_bytes"] / 2, line
    assert all(0.24 <= s <= 0.3 for s in line["worker_state_share"]), line["worker_state_share"]
    assert line["max_loss_diff"] <= 1e-4, (line["losses"], line["eager_losses"])


@pytest.mark.slow
def test_save_pretrained_writes_what_from_pretrained_and_weights_read(tmp_path):
    """Trained on two devices, exported by the workers in Hugging Face's layout: transformers'
    from_pretrained reads the trained weights, and weights= starts a new step from them."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    step = parallelize(hf_step, Cluster.local(1, 2), tune=False)
    try:
        step(model, opt, batch)
        out = step.save_pretrained(str(tmp_path / "export"))
        trained = step.state_dict()["model"]
        after = float(step(model, opt, batch))
    finally:
        step.shutdown()
    model.config.save_pretrained(out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    for name, p in loaded.state_dict().items():
        torch.testing.assert_close(p, trained[name], atol=0, rtol=0, msg=name)

    with alpa_torch.empty_weights():
        again = transformers.LlamaForCausalLM(_llama_config())
    resumed = parallelize(hf_step, Cluster.local(1, 2), weights=out, tune=False)
    try:  # the weights without the optimizer state: the first loss is the trained model's
        first = float(resumed(again, torch.optim.AdamW(again.parameters(), lr=1e-3), batch))
    finally:
        resumed.shutdown()
    assert first == pytest.approx(after, abs=1e-5)


def test_weights_win_over_the_values_of_a_materialised_model(tmp_path):
    """weights= with a model that holds values: the files give every tensor they have."""
    from alpa_torch.capture import capture
    from alpa_torch.initial_state import model_sources
    from alpa_torch.optim import OptimizerSet

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_llama_config()).save_pretrained(tmp_path)
    model = transformers.LlamaForCausalLM(_llama_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.zeros(2, 8, dtype=torch.long)
    graph = capture(hf_step, model, opt, {"input_ids": ids, "labels": ids})
    functional = OptimizerSet((opt,), {id(p): n for n, p in model.named_parameters()})
    sources = model_sources(graph, model, functional, seed=0, weights=str(tmp_path))
    first = {n: next(type(s).__name__ for s in sources if n in s.names) for n in graph.input_names("param")}
    assert set(first.values()) == {"SafetensorsWeights"}, first
