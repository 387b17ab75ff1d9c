"""The model and optimizer objects a user passes to ``parallelize`` stay the trained ones.

Every read between steps (calling the model, ``state_dict()``, parameters, attribute
access, the optimizer's state, ``copy.deepcopy``, ``torch.save``) sees what the workers
hold; every write (``load_state_dict``, ``p.data.copy_``, a re-initialised layer,
``requires_grad_``, a mode change) reaches the workers at the next step; a call that
fails on the user's input leaves the step and its state as they were (``alpa_torch.live``).
Each case runs eagerly beside ``parallelize`` and must agree within 1e-5.
"""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
import torch.nn.functional as F

import alpa_torch
from alpa_torch import AlpaTorchError, Cluster, StateOnWorkersError, parallelize

pytestmark = pytest.mark.usefixtures("ray_session")
ATOL = 1e-5


def train_step(model, optimizer, batch):
    x, y = batch
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def _net(dropout: float = 0.0):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(32, 8))


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 8, (8,), generator=g)) for _ in range(n)]


class Twins:
    """An eager model and optimizer, and the same pair trained by ``parallelize``."""

    def __init__(self, cluster=None, make=_net, **options):
        self.eager = make()
        self.model = copy.deepcopy(self.eager)
        self.eager_opt = torch.optim.AdamW(self.eager.parameters(), lr=1e-2, weight_decay=0.01)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.step = parallelize(train_step, cluster or Cluster.local(1, 2), **options)

    def train(self, batches):
        for b in batches:
            want = float(train_step(self.eager, self.eager_opt, b).detach())
            got = float(self.step(self.model, self.opt, b))
            assert got == pytest.approx(want, abs=ATOL)

    def same(self, a: dict, b: dict) -> None:
        assert set(a) == set(b)
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=ATOL, rtol=0, msg=k)


def _optimizer_state(sd: dict) -> dict:
    return {f"{i}.{k}": v for i, st in sd["state"].items() for k, v in st.items()}


def test_every_read_between_steps_sees_the_trained_state():
    t = Twins()
    try:
        t.train(_batches(3))
        x = _batches(1)[0][0]
        with torch.no_grad():
            torch.testing.assert_close(t.model(x), t.eager(x), atol=ATOL, rtol=0)
        t.model.eval()
        t.eager.eval()
        torch.testing.assert_close(t.model(x), t.eager(x), atol=ATOL, rtol=0)  # autograd on: same values
        t.model.train()
        t.eager.train()
        t.same(t.model.state_dict(), t.eager.state_dict())
        t.same(dict(t.model.named_parameters()), dict(t.eager.named_parameters()))
        for p, q in zip(t.model.parameters(), t.eager.parameters()):
            torch.testing.assert_close(p, q, atol=ATOL, rtol=0)
        torch.testing.assert_close(t.model[3].weight, t.eager[3].weight, atol=ATOL, rtol=0)
        t.same(_optimizer_state(t.opt.state_dict()), _optimizer_state(t.eager_opt.state_dict()))
        copied = copy.deepcopy(t.model)
        assert type(copied) is torch.nn.Sequential and type(copied[0]) is torch.nn.Linear  # plain classes
        t.same(copied.state_dict(), t.eager.state_dict())
        buf = io.BytesIO()
        torch.save({"model": t.model, "optimizer": t.opt.state_dict(), "objects": (t.model, t.opt)}, buf)
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        assert type(loaded["model"]) is torch.nn.Sequential
        t.same(loaded["model"].state_dict(), t.eager.state_dict())
        t.same(_optimizer_state(loaded["optimizer"]), _optimizer_state(t.eager_opt.state_dict()))
        assert type(loaded["objects"][1]) is torch.optim.AdamW
        t.same(_optimizer_state(loaded["objects"][1].state_dict()), _optimizer_state(t.eager_opt.state_dict()))
        t.train(_batches(5)[3:])  # the reads changed nothing on the workers
        t.same(t.model.state_dict(), t.eager.state_dict())
    finally:
        t.step.shutdown()


def _load_earlier(m, o, saved):
    m.load_state_dict(saved[0])
    o.load_state_dict(saved[1])


def _copy_data(m, o, saved):
    with torch.no_grad():
        m[0].weight.data.copy_(m[0].weight.data * 0.5)


def _ema_written_back(m, o, saved):
    ema = {k: v.detach().clone() for k, v in saved[0].items()}
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(0.9 * ema[name] + 0.1 * p)


def _reinit_head(m, o, saved):
    torch.manual_seed(5)
    m[3].reset_parameters()


def _scale_moments(m, o, saved):
    for state in o.state.values():
        state["exp_avg"].mul_(0.5)


@pytest.mark.parametrize("write", [_load_earlier, _copy_data, _ema_written_back, _reinit_head, _scale_moments])
def test_writes_between_steps_reach_the_workers(write):
    t = Twins()
    try:
        t.train(_batches(1))
        saved = [(copy.deepcopy(m.state_dict()), copy.deepcopy(o.state_dict()))
                 for m, o in ((t.model, t.opt), (t.eager, t.eager_opt))]
        t.train(_batches(3)[1:])
        write(t.model, t.opt, saved[0])
        write(t.eager, t.eager_opt, saved[1])
        t.train(_batches(5)[3:])
        t.same(t.model.state_dict(), t.eager.state_dict())
        t.same(_optimizer_state(t.opt.state_dict()), _optimizer_state(t.eager_opt.state_dict()))
    finally:
        t.step.shutdown()


def test_freezing_a_layer_or_changing_mode_captures_again(caplog):
    t = Twins(make=lambda: _net(dropout=0.5))
    try:
        for m in (t.model, t.eager):
            m.eval()  # dropout off: the steps are deterministic, so they compare with eager's
        t.train(_batches(2))
        for m in (t.model, t.eager):
            m[0].requires_grad_(False)
        with caplog.at_level(logging.WARNING, logger="alpa_torch.api"):
            t.train(_batches(4)[2:])
        assert sum("capturing and planning the step again" in r.message for r in caplog.records) == 1
        assert "model.0.weight changed" in caplog.text
        t.same(t.model.state_dict(), t.eager.state_dict())
        caplog.clear()
        t.model[2].train()  # dropout on: the workers' masks are not eager's, so only the capture is checked
        with caplog.at_level(logging.WARNING, logger="alpa_torch.api"):
            t.step(t.model, t.opt, _batches(5)[4])
        assert "model.2 is in train mode" in caplog.text
    finally:
        t.step.shutdown()


def test_a_bad_batch_fails_before_the_workers_and_keeps_the_state():
    """A float64 batch after float32 ones: eager raises and leaves the model as it was; so does the
    parallel step (its re-capture finds the error), and training goes on from the same state."""
    t = Twins()
    try:
        t.train(_batches(2))
        bad = (_batches(3)[2][0].double(), _batches(3)[2][1])
        with pytest.raises(RuntimeError, match="same dtype"):
            train_step(t.eager, t.eager_opt, bad)
        with pytest.raises(AlpaTorchError, match="same dtype"):
            t.step(t.model, t.opt, bad)
        t.train(_batches(4)[2:])
        t.same(t.model.state_dict(), t.eager.state_dict())
    finally:
        t.step.shutdown()


def test_frozen_parameters_left_in_the_optimizer_keep_no_state():
    """As fine-tuning scripts do: freeze a layer, then build AdamW from all parameters. torch.optim
    keeps no state for a parameter that never had a gradient; neither does the synced optimizer."""
    def frozen():
        m = _net()
        m[0].requires_grad_(False)
        return m
    t = Twins(make=frozen)
    try:
        t.train(_batches(3))
        t.step.sync(t.model, t.opt)
        assert sorted(t.opt.state_dict()["state"]) == sorted(t.eager_opt.state_dict()["state"]) == [2, 3]
        t.same(_optimizer_state(t.opt.state_dict()), _optimizer_state(t.eager_opt.state_dict()))
    finally:
        t.step.shutdown()


def test_shutdown_brings_the_trained_state_home():
    t = Twins()
    t.train(_batches(2))
    t.step.shutdown()
    t.same(t.model.state_dict(), t.eager.state_dict())
    t.same(_optimizer_state(t.opt.state_dict()), _optimizer_state(t.eager_opt.state_dict()))


def test_state_that_must_stay_on_the_workers_is_named_not_read():
    """A model built without memory, or more state than the limit: a read raises by name before
    returning anything."""
    with alpa_torch.empty_weights():
        big = _net()
    opt = torch.optim.AdamW(big.parameters(), lr=1e-2)
    step = parallelize(train_step, Cluster.local(1, 2))
    try:
        step(big, opt, _batches(1)[0])
        with pytest.raises(StateOnWorkersError, match="empty_weights"):
            big.state_dict()
        with pytest.raises(StateOnWorkersError, match="empty_weights"):
            big(_batches(1)[0][0])
        with pytest.raises(StateOnWorkersError, match="empty_weights"):  # its state is the parameters'
            opt.state_dict()
    finally:
        step.shutdown()
    with pytest.raises(StateOnWorkersError, match="gone"):  # shutdown brought nothing home
        opt.state_dict()
    t = Twins(driver_state_limit_bytes=1000)
    try:
        t.train(_batches(1))
        with pytest.raises(StateOnWorkersError, match="driver_state_limit_bytes"):
            list(t.model.parameters())
        t.train(_batches(2)[1:])  # still usable
    finally:
        t.step.driver_state_limit_bytes = None
        t.step.shutdown()
