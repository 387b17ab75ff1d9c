"""Loops users copy, run with ``parallelize`` beside the same loop run eagerly (within 1e-5).

- nanoGPT's loop (``user_loops.py``): hand-set learning rate, accumulation, clipping,
  ``set_to_none``, ``estimate_loss()`` between iterations, a ``torch.save`` checkpoint mid-run,
  reloaded in a fresh process that continues training;
- a Hugging Face causal LM fine-tuned, then ``generate()``d greedily: the same tokens;
- an EMA of the weights updated after every step;
- a validation loop with BatchNorm in eval mode, on the driver and with ``step.evaluate``.

Each on ``Cluster.local(1, 2)`` (nanoGPT's, resumed in a fresh process, as a slow test: CI runs it);
the 2x2 runs are a sweep (``python -m pytest -m sweep tests/test_user_loops.py``).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from alpa_torch import Cluster, parallelize

from . import user_loops as nano

pytestmark = pytest.mark.usefixtures("ray_session")
ATOL = 1e-5
REPO = Path(__file__).resolve().parents[1]
CLUSTERS = [(1, 2), pytest.param((2, 2), marks=pytest.mark.sweep)]


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=ATOL, rtol=0, msg=k)


def _resumed_in_a_fresh_process(checkpoint: Path, cluster, iters: int) -> dict:
    import ray

    out = checkpoint.with_suffix(".resumed")
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "tests.user_loops", str(checkpoint), str(out),
                    f"{cluster[0]}x{cluster[1]}", str(iters)], cwd=REPO, env=env, check=True, timeout=600)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("cluster", [pytest.param((1, 2), marks=pytest.mark.slow), CLUSTERS[1]])
def test_nanogpt_loop_with_evaluation_and_a_checkpoint_resumed_elsewhere(cluster, tmp_path):
    eager, eager_opt = nano.make_model_and_optimizer()
    model, optimizer = nano.make_model_and_optimizer()
    step = parallelize(nano.train_step, Cluster.local(*cluster))
    checkpoint = tmp_path / "ckpt.pt"
    try:
        for it in range(6):
            for opt in (eager_opt, optimizer):
                nano.set_lr(opt, it)
            if it % 3 == 0:  # estimate_loss between iterations reads the trained weights
                assert nano.estimate_loss(model) == pytest.approx(nano.estimate_loss(eager), abs=ATOL)
            if it == 4:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": it},
                           checkpoint)
            batch = nano.get_batch(it)
            want = float(nano.train_step(eager, eager_opt, batch))
            assert float(step(model, optimizer, batch)) == pytest.approx(want, abs=ATOL)
    finally:
        step.shutdown()
    _close(model.state_dict(), eager.state_dict())
    # The checkpoint holds what training had reached at iteration 4; a new process resumes from it.
    saved = torch.load(checkpoint, weights_only=False)
    resumed = _resumed_in_a_fresh_process(checkpoint, cluster, 2)
    ref, ref_opt = nano.make_model_and_optimizer()
    ref.load_state_dict(saved["model"])
    ref_opt.load_state_dict(saved["optimizer"])
    losses = []
    for it in (5, 6):
        nano.set_lr(ref_opt, it)
        losses.append(float(nano.train_step(ref, ref_opt, nano.get_batch(it))))
    assert resumed["losses"] == pytest.approx(losses, abs=ATOL)
    _close(resumed["model"], ref.state_dict())


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_hf_causal_lm_fine_tuned_then_generates_the_same_tokens(cluster):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config)
    model = copy.deepcopy(eager)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=5e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)

    def fine_tune(model, optimizer, batch):
        optimizer.zero_grad()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        return loss

    step = parallelize(fine_tune, Cluster.local(*cluster))
    g = torch.Generator().manual_seed(3)
    try:
        for _ in range(3):
            ids = torch.randint(0, 64, (4, 12), generator=g)
            assert float(step(model, opt, ids)) == pytest.approx(float(fine_tune(eager, eager_opt, ids)), abs=ATOL)
        prompt = torch.randint(0, 64, (2, 5), generator=g)
        kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(prompt, **kwargs), eager.generate(prompt, **kwargs))
    finally:
        step.shutdown()


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_ema_of_the_weights_updated_between_steps(cluster):
    from .test_model_object import Twins, _batches

    t = Twins(cluster=Cluster.local(*cluster))
    emas = [copy.deepcopy(t.model), copy.deepcopy(t.eager)]
    try:
        for b in _batches(4):
            t.train([b])
            for ema, m in zip(emas, (t.model, t.eager)):
                with torch.no_grad():
                    for e, p in zip(ema.parameters(), m.parameters()):
                        e.mul_(0.9).add_(p, alpha=0.1)
        _close(emas[0].state_dict(), emas[1].state_dict())
        t.same(t.model.state_dict(), t.eager.state_dict())
    finally:
        t.step.shutdown()


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def _images(i: int):
    g = torch.Generator().manual_seed(50 + i)
    return torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 5, (8,), generator=g)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_validation_loop_with_batchnorm_in_eval_mode(cluster):
    torch.manual_seed(0)
    eager = ConvNet()
    model = copy.deepcopy(eager)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step_fn(model, optimizer, batch):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        return loss

    def val(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    step = parallelize(step_fn, Cluster.local(*cluster))
    on_cluster = step.evaluate(val)
    try:
        for i in range(4):
            assert float(step(model, opt, _images(i))) == pytest.approx(float(step_fn(eager, eager_opt, _images(i))),
                                                                        abs=ATOL)
            for m in (model, eager):
                m.eval()
            with torch.no_grad():
                want = float(val(eager, _images(10)))
                assert float(val(model, _images(10))) == pytest.approx(want, abs=ATOL)
            assert float(on_cluster(model, _images(10))) == pytest.approx(want, abs=ATOL)
            for m in (model, eager):
                m.train()
        _close(model.state_dict(), eager.state_dict())  # running statistics included
    finally:
        step.shutdown()
