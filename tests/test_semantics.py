"""The parallel step keeps every promise of the user's step, or refuses by name.

Each case writes a step and its batches the way people write them and runs 3 steps on
``Cluster.local(1, 2)`` against eager single-device training: the only allowed outcomes
are "equal to eager within 1e-5" (losses and every parameter) or a named alpa-torch
error that says what to do, raised before any worker runs.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from alpa_torch import AlpaTorchError, Cluster, parallelize

pytestmark = pytest.mark.usefixtures("ray_session")
ATOL = 1e-5
CLUSTER = Cluster.local(1, 2)


def _mlp(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(dtype)


def _xy(i: int, n: int = 8, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(n, 16, generator=g, dtype=dtype), torch.randint(0, 8, (n,), generator=g)


def compare(step_fn, batches, *, make_model=_mlp, make_opt=None, schedule=None, cluster=CLUSTER,
            refusal_ok: bool = False, context: str = "", loss_rtol: float = 0.0, param_atol: float = ATOL,
            between=None, **options):
    """Run ``step_fn`` eagerly and through ``parallelize`` on ``batches``; assert equal losses and
    parameters (within ``ATOL``, or ``loss_rtol`` / ``param_atol`` where given).
    ``schedule(optimizer)``: an LR scheduler stepped after every step (or None);
    ``between(model, optimizer, step)``: what the loop does with the model between steps (``step``:
    the parallel step, None for eager); what it returns must agree within ``param_atol``;
    ``refusal_ok``: a named ``AlpaTorchError`` at the first call, before any worker starts, is
    an allowed outcome too (returns None); ``context`` goes into every assertion's message."""
    make_opt = make_opt or (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01))
    eager = make_model()
    model = copy.deepcopy(eager)
    eager_opt, opt = make_opt(eager), make_opt(model)
    eager_sched = schedule(eager_opt) if schedule else None
    sched = schedule(opt) if schedule else None
    step = parallelize(step_fn, cluster, **options)
    try:
        for i, batch in enumerate(batches):
            want = float(step_fn(eager, eager_opt, batch).detach())
            try:
                got = float(step(model, opt, batch))
            except AlpaTorchError:
                if not refusal_ok:
                    raise
                assert i == 0 and step.group is None, f"step {i}: an error after the workers started {context}"
                return None
            assert got == pytest.approx(want, abs=ATOL, rel=loss_rtol), f"step {i}: {got} != eager {want} {context}"
            for s in (eager_sched, sched):
                if s is not None:
                    s.step()
            if between is not None:
                seen = [between(m, o, p) for m, o, p in ((eager, eager_opt, None), (model, opt, step))]
                for a, b in zip(*(torch.utils._pytree.tree_leaves(x) for x in seen)):
                    torch.testing.assert_close(b, a, atol=param_atol, rtol=0, msg=f"between steps {i} {context}")
        state = step.state_dict()["model"]
    finally:
        step.shutdown()
    if between is not None:  # what the loop wrote after the last step is in the model object, as in eager
        state = dict(model.named_parameters())
    for name, p in eager.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), atol=param_atol, rtol=0, msg=f"{name} {context}")
    return step


def plain(model, optimizer, batch):
    x, y = batch
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


# ---------------------------------------------------------------- what the step reads


def test_a_float_in_the_batch_reaches_every_call():
    def weighted(model, optimizer, batch):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["y"]) * batch["weight"]
        loss.backward()
        optimizer.step()
        return loss

    batches = [{"x": x, "y": y, "weight": w} for (x, y), w in zip(map(_xy, range(3)), (1.0, 0.25, 3.0))]
    compare(weighted, batches)


def test_a_float_the_step_branches_on_is_captured_again_when_it_changes(caplog):
    def clipped(model, optimizer, batch):
        x, y, clip = batch
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if clip > 0:  # Python control flow on the float: a constant of the capture
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        return loss

    with caplog.at_level(logging.WARNING, logger="alpa_torch.api"):
        compare(clipped, [(*_xy(0), 0.5), (*_xy(1), 0.5), (*_xy(2), 0.0)])
    assert any("capturing and planning the step again" in r.message for r in caplog.records)


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    temperature: float = 1.0


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@pytest.mark.sweep
def test_dataclass_and_named_tuple_batches():
    def step_dc(model, optimizer, batch):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch.x) / batch.temperature, batch.y)
        loss.backward()
        optimizer.step()
        return loss

    compare(step_dc, [Batch(*_xy(i), temperature=t) for i, t in enumerate((1.0, 2.0, 0.5))])
    compare(plain, [Pair(*_xy(i)) for i in range(3)])


def test_non_tensor_entries_that_change_capture_again():
    def tagged(model, optimizer, batch):
        optimizer.zero_grad()
        logits = model(batch["x"])
        if batch["mode"] == "smooth":
            loss = F.cross_entropy(logits, batch["y"], label_smoothing=0.1)
        else:
            loss = F.cross_entropy(logits, batch["y"])
        loss.backward()
        optimizer.step()
        return loss

    batches = [{"x": x, "y": y, "mode": m} for (x, y), m in zip(map(_xy, range(3)), ("plain", "smooth", "plain"))]
    batches[2]["extra"] = None  # the set of entries changes too
    compare(tagged, batches)


def test_a_batch_whose_dtype_changes_is_captured_again():
    batches = [_xy(0), _xy(1, dtype=torch.float64), _xy(2)]

    def cast(model, optimizer, batch):
        x, y = batch
        return plain(model, optimizer, (x.float(), y))

    compare(cast, batches)


@pytest.mark.parametrize("make_schedule", [
    lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10),
    lambda opt: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2),
    lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, 1e-3, 1e-2, step_size_up=1),
], ids=["OneCycleLR", "CosineAnnealingWarmRestarts", "CyclicLR"])
def test_schedulers_that_move_momentum_and_lr(make_schedule):
    compare(plain, [_xy(i) for i in range(3)], schedule=make_schedule)


def test_sgd_momentum_cycled_by_one_cycle():
    compare(plain, [_xy(i) for i in range(3)],
            make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            schedule=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10))


# ---------------------------------------------------------------- eager semantics



def test_zero_grad_after_the_update_is_eager_semantics():
    def late_zero(model, optimizer, batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    compare(late_zero, [_xy(i) for i in range(3)])



def test_bf16_parameters_with_the_default_precision():
    """bfloat16 parameters plan and train. The automatic plan on 1x2 splits the MLP's matmuls
    (tensor parallel), so a sum runs across devices and each device rounds its part to bfloat16
    before it: one rounding of the low precision apart from eager, the bounds of
    ``tests/test_mixed_precision.py`` (loss 2^-8 relative; AdamW parameters 2 lr per step)."""
    batches = [_xy(i, dtype=torch.bfloat16) for i in range(3)]
    step = compare(plain, batches, make_model=lambda: _mlp(dtype=torch.bfloat16),
                   loss_rtol=2.0**-8, param_atol=2 * 1e-2 * len(batches))
    assert step.graph.inputs[0].dtype == "bfloat16"





def test_bf16_parameters_in_a_pipeline():
    """AdamW reads a float32 copy of each bfloat16 parameter that nothing before the update reads:
    the pipeline's update program computes it (it was left to the backward, and the update failed
    with a KeyError on every worker)."""
    compare(plain, [_xy(i, dtype=torch.bfloat16) for i in range(3)], make_model=lambda: _mlp(dtype=torch.bfloat16),
            num_stages=2)


def test_a_shared_tensor_goes_whole_to_every_microbatch():
    def masked(model, optimizer, batch):
        x, y, mask = batch
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x) + mask.sum() * 0.0 + mask[0, 0], y)
        loss.backward()
        optimizer.step()
        return loss

    mask = torch.randn(5, 5)
    compare(masked, [(*_xy(i), mask) for i in range(3)], num_microbatches=2, num_stages=2)


# ---------------------------------------------------------------- how microbatches and shards add up


def _padded(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch whose labels ignore (-100) a different number of rows in each half."""
    x, y = _xy(i)
    y[: 1 + i] = -100
    return x, y


def test_a_sum_reduced_loss_over_microbatches():
    def summed(model, optimizer, batch):
        x, y = batch
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
        optimizer.step()
        return loss

    compare(summed, [_xy(i) for i in range(3)], num_stages=2, num_microbatches=2)


def test_a_mean_over_padded_labels_over_microbatches():
    def masked(model, optimizer, batch):
        x, y = batch
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)  # ignore_index=-100: a mean over the labels kept
        loss.backward()
        optimizer.step()
        return loss

    step = compare(masked, [_padded(i) for i in range(3)], num_stages=2, num_microbatches=2)
    assert [s.name for s in step.graph.inputs if s.name.startswith("loss_norm.")] == ["loss_norm.0"]


def test_a_mean_over_padded_labels_over_a_sharded_batch():
    """DTensor's own rule averages the shards' means (``Partial('avg')``); the captured sum over
    the whole batch's count (``alpa_torch/masked_mean.py``) is exact on a data-parallel plan."""
    from alpa_torch.capture import capture
    from alpa_torch.optim import OptimizerSet
    from intra_ilp.cost_model import MeshCost
    from intra_ilp.stage import solve_stage
    from runtime.engine import Engine
    from runtime.group import WorkerGroup
    from runtime.wire import to_wire_dict

    eager = _mlp()
    model = copy.deepcopy(eager)
    eager_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model))
    graph = capture(plain, model, opt, _padded(0))
    force = {s.name: ("RS(0)" if s.kind == "batch" and s.shape else "RR") for s in graph.inputs
             if s.kind in ("batch", "param", "opt_state")}
    sharding = solve_stage(graph, MeshCost.from_cluster(CLUSTER, (1, 2), (1, 2)), force=force)
    functional = OptimizerSet((opt,), {id(p): n for n, p in model.named_parameters()})
    state = {**dict(model.named_parameters()), **{f"{n}.{k}": v for n, p in model.named_parameters()
                                                  for k, v in functional.initial_state(n, p).items()}}
    with WorkerGroup.start(CLUSTER) as group:
        engine = Engine(group, graph, sharding)
        engine.load_state(to_wire_dict(state))
        for i in range(3):
            batch = _padded(i)
            leaves = {"batch.0": batch[0], "batch.1": batch[1]}
            want = float(plain(eager, eager_opt, batch).detach())
            got = engine.step(to_wire_dict(leaves), functional.host_scalars())
            assert got == pytest.approx(want, abs=ATOL), f"step {i}: {got} != eager {want}"
