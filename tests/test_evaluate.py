"""Evaluation and inference on the cluster (``alpa_torch.evaluate``) equal eager.

``step.evaluate(fn)`` runs a forward-only function on the training step's workers against
the live trained state: read in place where the training plan is one stage (1x2), moved
from a pipeline's stages otherwise (2x2, two stages). ``parallelize(fn, cluster)`` on a
function of (model, batch) runs it on workers of its own. Each is compared with eager
after every training step, within 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from alpa_torch import CaptureError, Cluster, parallelize

from .test_model_object import ATOL, _batches, _net, train_step

pytestmark = pytest.mark.usefixtures("ray_session")


def validation(model, batch):
    x, y = batch
    logits = model(x)
    return {"loss": F.cross_entropy(logits, y), "predicted": logits.argmax(-1), "n": len(y)}


def greedy(model, batch):
    """A generation-style loop: the model called on its own outputs, four times."""
    x = batch[0]
    outs = []
    for _ in range(4):
        logits = model(x)
        outs.append(logits.argmax(-1))
        x = torch.cat([x[:, 8:], logits], dim=1)
    return torch.stack(outs, dim=1)


def _eager(fn, model, batch):
    with torch.no_grad():
        return fn(model, batch)


def _same(got, want) -> None:
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    else:
        assert got == want


@pytest.mark.parametrize("cluster, options, tags", [
    ((1, 2), {}, True),
    pytest.param((2, 2), {"num_stages": 2, "num_microbatches": 2}, True, marks=pytest.mark.slow),
    pytest.param((2, 2), {"num_stages": 2, "num_microbatches": 2}, False, marks=pytest.mark.sweep),
], ids=["1x2", "2x2-pipeline", "2x2-pipeline-untagged"])
def test_evaluation_on_the_training_workers_equals_eager(monkeypatch, cluster, options, tags):
    """``untagged``: every point-to-point message with tag 0 (``ALPA_TORCH_P2P_TAGS=0``), as NCCL
    matches them: the pipeline's crossings and the state moved to the evaluation's plan alike."""
    if not tags:
        from runtime.switches import P2P_TAGS_ENV

        monkeypatch.setenv(P2P_TAGS_ENV, "0")
    eager = _net()
    model = copy.deepcopy(eager)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = parallelize(train_step, Cluster.local(*cluster), **options)
    evaluate, generate = step.evaluate(validation), step.evaluate(greedy)
    held_out = _batches(6)[5]
    try:
        for b in _batches(3):
            train_step(eager, eager_opt, b)
            step(model, opt, b)
            _same(evaluate(model, held_out), _eager(validation, eager, held_out))
            _same(generate(model, held_out), _eager(greedy, eager, held_out))
        with torch.no_grad():  # a write between steps: the evaluation sees it
            model[3].weight.mul_(0.5)
            eager[3].weight.mul_(0.5)
        _same(evaluate(model, held_out), _eager(validation, eager, held_out))
        assert evaluate._engine.state == ("alias" if cluster == (1, 2) else "moved")
    finally:
        step.shutdown()


def test_a_forward_function_runs_on_its_own_workers():
    model = _net()
    infer = parallelize(validation, Cluster.local(1, 2))
    try:
        for b in _batches(2):
            _same(infer(model, b), _eager(validation, model, b))
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)  # the user's new weights reach the workers
        b = _batches(3)[2]
        _same(infer(model, b), _eager(validation, model, b))
    finally:
        infer.shutdown()


def test_an_evaluation_that_writes_buffers_is_refused_by_name():
    def with_bn():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8))
    infer = parallelize(lambda model, batch: model(batch[0]).sum(), Cluster.local(1, 2))
    try:
        with pytest.raises(CaptureError, match="model.eval()"):
            infer(with_bn(), _batches(1)[0])
    finally:
        infer.shutdown()
