"""``alpa_torch.optim``: torch.optim's own ``step()`` traced into the captured step equals torch.optim.

Every optimizer of ``torch.optim`` (but the two refused by name), with options combined, is
captured on one device and its graph run step after step (``OpGraph.run``, no workers)
beside eager training of the same model; the hyper-parameters move every step (a
hand-set ``lr``, betas and momentum as ``OneCycleLR`` moves them) without a new capture.
Parameters and every state tensor must agree within 1e-6 over 6 steps; a decision the
trace took that a new value would take the other way is reported (``constants_changed``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from alpa_torch.capture import capture
from alpa_torch.core.errors import CaptureError
from alpa_torch.optim import REFUSED, OptimizerSet

from .test_semantics import plain as train_step  # the plain step: zero_grad, loss, backward, step

ATOL = 1e-6
STEPS = 6


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _groups(model, **second):
    params = list(model.parameters())
    return [{"params": params[:2]}, {"params": params[2:], **second}]


OPTIMIZERS = {
    "SGD": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "SGD-nesterov-wd": lambda m: torch.optim.SGD(_groups(m, lr=0.05), lr=0.1, momentum=0.9, nesterov=True,
                                                 weight_decay=0.01),
    "SGD-maximize": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5, maximize=True),
    "Adam-amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, amsgrad=True, weight_decay=0.01),
    "AdamW": lambda m: torch.optim.AdamW(_groups(m, weight_decay=0.0), lr=0.01, weight_decay=0.1),
    "Adadelta": lambda m: torch.optim.Adadelta(m.parameters(), weight_decay=0.01),
    "Adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    "Adamax": lambda m: torch.optim.Adamax(m.parameters(), maximize=True),
    "ASGD": lambda m: torch.optim.ASGD(m.parameters(), lr=0.01, t0=2),
    "NAdam-decoupled": lambda m: torch.optim.NAdam(m.parameters(), decoupled_weight_decay=True, weight_decay=0.01),
    "RAdam-decoupled": lambda m: torch.optim.RAdam(m.parameters(), decoupled_weight_decay=True, weight_decay=0.01),
    "RMSprop-centered-momentum": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.9, centered=True),
    "Rprop": lambda m: torch.optim.Rprop(m.parameters(), lr=0.01),
    "Adafactor": lambda m: torch.optim.Adafactor(m.parameters(), lr=0.01),
    "Muon": lambda m: torch.optim.Muon([p for p in m.parameters() if p.dim() == 2], lr=0.02),
}


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _move(optimizer, i: int) -> None:
    """What schedulers and hand-written loops move between steps: lr, and betas / momentum."""
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * 0.9
        if "betas" in group:
            group["betas"] = (0.9 - 0.01 * i, group["betas"][1])
        if group.get("momentum"):
            group["momentum"] = 0.9 - 0.01 * i


class OneDevice:
    """A captured step run by ``OpGraph.run``: the graph's own arithmetic, state carried by hand."""

    def __init__(self, model, optimizer, batch, step_fn=train_step):
        self.model, self.optimizer, self.step_fn = model, optimizer, step_fn
        self.opts = OptimizerSet(_tuple(optimizer), {id(p): n for n, p in model.named_parameters()})
        self.graph = capture(step_fn, model, optimizer, batch, optimizers=self.opts)
        params = dict(model.named_parameters())
        self.values = {n: p.detach().clone() for n, p in params.items()} | dict(model.named_buffers())
        for n in self.opts.names:
            self.values |= {f"{n}.{k}": v.clone() for k, v in self.opts.initial_state(n, params[n]).items()}

    def __call__(self, batch) -> float:
        scalars = {k: torch.tensor(v, dtype=torch.float64) for k, v in self.opts.host_scalars().items()}
        out = self.graph.run({**self.values, **scalars, **{f"batch.{j}": t for j, t in enumerate(batch)}})
        for key, v in out.items():
            if key != "loss":
                self.values[key.split("/", 1)[1]] = v
        return float(out["loss"])


def _tuple(optimizer):
    return tuple(optimizer) if isinstance(optimizer, (tuple, list)) else (optimizer,)


def _compare(make, steps=STEPS, move=True):
    eager, model = _net(), _net()
    eager_opt, opt = make(eager), make(model)
    batches = _batches(steps)
    run = OneDevice(model, opt, batches[0])
    for i, b in enumerate(batches):
        want = float(train_step(eager, eager_opt, b))
        assert run(b) == pytest.approx(want, abs=ATOL), f"step {i}"
        assert run.opts.constants_changed(i + 1) is None, f"step {i}"
        if move:
            for o in (eager_opt, opt):
                _move(o, i)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(run.values[name], p.detach(), atol=ATOL, rtol=0, msg=name)
    params = dict(eager.named_parameters())
    for name in run.opts.names:
        for key in run.opts.state_names(name):
            # state grows beyond 1 (RMSprop's centered momentum buffer holds steps of ~6, a quotient): relative
            torch.testing.assert_close(run.values[f"{name}.{key}"], eager_opt.state[params[name]][key], atol=ATOL,
                                       rtol=1e-5, msg=lambda m, k=f"{name}.{key}": f"{k}: {m}")
    return run, eager, eager_opt


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_torch_optimizer_traced_equals_torch(name):
    run, _, _ = _compare(OPTIMIZERS[name])
    update_ops = [n for n in run.graph.nodes.values() if n.phase == "update"]
    assert update_ops, "the optimizer's maths is in the graph"


def test_every_optimizer_of_torch_optim_is_covered_or_refused():
    names = {n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
             and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"}
    covered = {k.split("-")[0] for k in OPTIMIZERS}
    assert names == covered | set(REFUSED), sorted(names - covered - set(REFUSED))


def test_sgd_with_dampening_captures_again_after_its_first_step():
    """SGD's momentum buffer starts as a copy of the first gradient; with dampening that is not what
    the steady step gives from zeros, so the first step's graph creates it and the next is a new capture."""
    eager, model = _net(), _net()
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.3)  # noqa: E731
    eager_opt, opt = make(eager), make(model)
    b = _batches(2)
    run = OneDevice(model, opt, b[0])
    assert run.opts.first_step and run(b[0]) == pytest.approx(float(train_step(eager, eager_opt, b[0])), abs=ATOL)
    assert "first step created the state" in run.opts.constants_changed(1)
    for n, p in eager.named_parameters():
        torch.testing.assert_close(run.values[n], p.detach(), atol=ATOL, rtol=0)
        torch.testing.assert_close(run.values[f"{n}.momentum_buffer"], eager_opt.state[p]["momentum_buffer"],
                                   atol=ATOL, rtol=0)
    steady = OptimizerSet((opt,), {id(p): n for n, p in model.named_parameters()}, steps_taken=1)
    assert not steady.first_step


def test_a_decision_on_a_hyper_parameter_is_a_guard():
    """``if weight_decay != 0`` is taken at capture; a value that takes the other branch is reported."""
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01)
    run = OneDevice(model, opt, _batches(1)[0])
    opt.param_groups[0]["weight_decay"] = 0.02  # a new value, the same branch: read as an input
    assert run.opts.constants_changed(1) is None
    opt.param_groups[0]["weight_decay"] = 0.0
    assert "weight_decay" in run.opts.constants_changed(1)
    opt.param_groups[0]["weight_decay"] = 0.01
    opt.param_groups[0]["amsgrad"] = True  # a flag: baked
    assert "amsgrad" in run.opts.constants_changed(1)


def muon_pair(m):
    """Muon for the matrices, AdamW for the rest (how Muon's users pair them)."""
    return (torch.optim.Muon([p for p in m.parameters() if p.dim() == 2], lr=0.02),
            torch.optim.AdamW([p for p in m.parameters() if p.dim() != 2], lr=0.01))


def two_optimizer_step(model, optimizers, batch):
    """``train_step`` with a tuple of optimizers."""
    for o in optimizers:
        o.zero_grad()
    loss = F.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    for o in optimizers:
        o.step()
    return loss


def test_two_optimizers_in_one_step():
    """``muon_pair``: one step that runs two optimizers."""
    eager, model = _net(), _net()
    eager_opts, opts = muon_pair(eager), muon_pair(model)
    batches = _batches(4)
    run = OneDevice(model, opts, batches[0], two_optimizer_step)
    for b in batches:
        assert run(b) == pytest.approx(float(two_optimizer_step(eager, eager_opts, b)), abs=ATOL)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(run.values[name], p.detach(), atol=ATOL, rtol=0, msg=name)


def test_refused_optimizers_and_foreign_tensors_are_named():
    w = torch.zeros(2, 2, requires_grad=True)
    with pytest.raises(CaptureError, match="LBFGS cannot run.*closure"):
        OptimizerSet((torch.optim.LBFGS([w]),), {id(w): "w"})
    with pytest.raises(CaptureError, match="SparseAdam cannot run.*sparse"):
        OptimizerSet((torch.optim.SparseAdam([w]),), {id(w): "w"})
    with pytest.raises(CaptureError, match="not a parameter of the model"):
        OptimizerSet((torch.optim.SGD([w], lr=0.1),), {})
    with pytest.raises(CaptureError, match="in two optimizers"):
        OptimizerSet((torch.optim.SGD([w], lr=0.1), torch.optim.Adam([w])), {id(w): "w"})


def test_write_back_gives_the_state_torch_would_hold():
    """After ``write_back`` into a fresh optimizer of a copy of the model, both continue alike."""
    make = OPTIMIZERS["Adam-amsgrad"]
    run, eager, eager_opt = _compare(make, steps=3, move=False)
    twin = copy.deepcopy(eager)
    fresh = make(twin)
    run.opts.write_back({k: v for k, v in run.values.items()}, into=(fresh,))
    for p_old, p_new in zip(eager.parameters(), twin.parameters()):
        assert set(fresh.state[p_new]) == set(eager_opt.state[p_old])
    b = _batches(4)[3]
    train_step(eager, eager_opt, b)
    train_step(twin, fresh, b)
    for p_old, p_new in zip(eager.parameters(), twin.parameters()):
        torch.testing.assert_close(p_new, p_old, atol=ATOL, rtol=0)
