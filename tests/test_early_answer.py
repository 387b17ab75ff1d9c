"""A step answers with its loss once the forward has it (``runtime/worker.py``, ``run_early``).

The driver's step returns while the workers still run their backward and update; the next
call on the workers waits for that rest, so what it reads is the finished step; an error in
the rest is raised by that next call, naming the rank and the error; and
``ALPA_TORCH_EARLY_ANSWER=0`` makes a step wait for its update. Each case slows the end of the
workers' step by ``SLOW_S`` (``StageRunner.end_step`` runs after the update) so the order is
plain without measuring speed: a tiny MLP's step is far shorter than that on any machine.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from alpa_torch import Cluster, parallelize
from alpa_torch.core.errors import WorkerError
from alpa_torch.zoo import build, make_optimizer, train_step

pytestmark = pytest.mark.usefixtures("ray_session")

SLOW_S = 3.0
PLANS = {"one stage": {"pipeline": False}, "two-stage pipeline": {"num_stages": 2, "num_microbatches": 2}}


def _slow_end(state: dict, seconds: float, fail_on_rank: int | None = None) -> bool:
    """Worker: the end of each later step sleeps ``seconds`` (and raises on ``fail_on_rank``)."""
    runner = state["runner"]
    inner = runner.end_step

    def end_step():
        time.sleep(seconds)
        if state["rank"] == fail_on_rank:
            raise RuntimeError("the update broke on purpose")
        inner()

    runner.end_step = end_step
    return True


def _started(options: dict):
    model, batch = build("mlp")
    reference = copy.deepcopy(model)
    opt, ref_opt = make_optimizer("adamw", model), make_optimizer("adamw", reference)
    step = parallelize(train_step, Cluster.local(1, 2), tune=False, plan_cache=False, **options)
    losses = [float(step(model, opt, batch)), float(train_step(reference, ref_opt, batch).detach())]
    return step, model, opt, reference, ref_opt, batch, losses


@pytest.mark.parametrize("plan", list(PLANS))
def test_the_step_returns_before_its_update_and_the_next_call_sees_it_done(plan):
    step, model, opt, reference, ref_opt, batch, losses = _started(PLANS[plan])
    try:
        assert abs(losses[0] - losses[1]) < 1e-5
        step.group.call_all(_slow_end, SLOW_S)
        t0 = time.monotonic()
        got = float(step(model, opt, batch))
        answered = time.monotonic() - t0
        step.sync(model, opt)  # waits for the rest of the step on every worker
        finished = time.monotonic() - t0
        want = float(train_step(reference, ref_opt, batch).detach())
        assert answered < SLOW_S <= finished, (answered, finished)
        assert abs(got - want) < 1e-5
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-5, rtol=0, msg=name)
    finally:
        step.shutdown()


def test_with_early_answers_off_the_step_waits_for_its_update(monkeypatch):
    monkeypatch.setenv("ALPA_TORCH_EARLY_ANSWER", "0")
    step, model, opt, *_, batch, _ = _started(PLANS["one stage"])
    try:
        step.group.call_all(_slow_end, SLOW_S)
        t0 = time.monotonic()
        step(model, opt, batch)
        assert time.monotonic() - t0 >= SLOW_S
    finally:
        step.shutdown()


def test_an_error_after_the_answer_is_raised_by_the_next_call():
    step, model, opt, *_, batch, _ = _started(PLANS["one stage"])
    try:
        step.group.call_all(_slow_end, 0.0, fail_on_rank=1)
        assert torch.isfinite(step(model, opt, batch))  # the loss came before the update failed
        with pytest.raises(WorkerError, match=r"(?s)device rank\(s\) \[1\].*failed after it had answered.*"
                                              r"RuntimeError: the update broke on purpose"):
            step(model, opt, batch)
    finally:
        step.shutdown()
