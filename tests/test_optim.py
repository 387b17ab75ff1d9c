"""Tests of alpa_torch.optim: the functional twins against torch.optim.

The reference is torch.optim itself (single-tensor path, ``foreach=False``):
both take five steps from the same random parameters and gradients, with
hyper-parameters drawn by hypothesis, two param groups that differ, and an lr
that changes every step (as a scheduler would change it: a host scalar, not a
constant). Parameters and every state tensor must agree within 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alpa_torch.core.errors import CaptureError
from alpa_torch.optim import FunctionalOptimizer, update

ATOL = 1e-6
STEPS = 5
SHAPES = [(3, 4), (5,), (2, 3)]  # three parameters; the last one alone in group 1

lrs = st.floats(1e-4, 0.1)
lr_factors = st.lists(st.floats(0.1, 2.0), min_size=STEPS, max_size=STEPS)
weight_decays = st.sampled_from([0.0, 1e-3, 0.1])


def _functional_step(fo: FunctionalOptimizer, params, grads, states, step):
    """One step of every parameter through ``alpa_torch.optim.update``, scalars as 0-dim float64."""
    scalars = {k: torch.tensor(v, dtype=torch.float64) for k, v in fo.host_scalars(step).items()}
    for name in fo.names:
        gi = fo.group_of[name]
        mine = {k.split(".", 1)[1]: v for k, v in scalars.items() if k.startswith(f"g{gi}.")}
        params[name], states[name] = update(fo.groups[gi], params[name], grads[name], states[name], mine)


def _assert_close(name, what, a, b):
    diff = (a.detach() - b).abs().max().item()
    assert diff <= ATOL, f"{name} {what}: |torch - functional| = {diff}"


def run_against_torch(make, groups_kw, factors, seed=0, warm_steps=0):
    """``make(groups)`` builds a torch.optim optimizer; compare ``STEPS`` steps.

    ``warm_steps`` eager steps are taken first, so the functional side starts
    from a trained optimizer's state (``initial_state``, ``step_count``).
    """
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(s, generator=gen, dtype=torch.float32).requires_grad_() for s in SHAPES]
    optimizer = make([{"params": tensors[:2], **groups_kw[0]}, {"params": tensors[2:], **groups_kw[1]}])
    grad_of = lambda: [torch.randn(s, generator=gen) for s in SHAPES]  # noqa: E731
    for _ in range(warm_steps):
        for t, g in zip(tensors, grad_of()):
            t.grad = g
        optimizer.step()
    names = {id(t): f"p{i}" for i, t in enumerate(tensors)}
    fo = FunctionalOptimizer(optimizer, names)
    params = {names[id(t)]: t.detach().clone() for t in tensors}
    states = {n: {k: v.clone() for k, v in fo.initial_state(n, params[n]).items()} for n in fo.names}
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    for step, factor in enumerate(factors, start=fo.step_count() + 1):
        for group, base in zip(optimizer.param_groups, base_lrs):
            group["lr"] = base * factor  # a scheduler's doing: read back through host_scalars
        grads = grad_of()
        for t, g in zip(tensors, grads):
            t.grad = g.clone()
        optimizer.step()
        _functional_step(fo, params, {names[id(t)]: g for t, g in zip(tensors, grads)}, states, step)
        for t in tensors:
            name = names[id(t)]
            _assert_close(name, f"param after step {step}", t, params[name])
            for key in fo.state_names(name):
                _assert_close(name, f"{key} after step {step}", optimizer.state[t][key], states[name][key])
    return optimizer, fo, states


@st.composite
def sgd_groups(draw):
    def one():
        momentum = draw(st.sampled_from([0.0, 0.5, 0.9]))
        nesterov = momentum > 0 and draw(st.booleans())
        dampening = 0.0 if nesterov else draw(st.sampled_from([0.0, 0.1, 0.5]))
        return dict(lr=draw(lrs), momentum=momentum, dampening=dampening, nesterov=nesterov,
                    weight_decay=draw(weight_decays), maximize=draw(st.booleans()))
    return [one(), one()]


@st.composite
def adam_groups(draw):
    def one():
        return dict(lr=draw(lrs), betas=(draw(st.sampled_from([0.0, 0.8, 0.9])), draw(st.sampled_from([0.9, 0.999]))),
                    eps=draw(st.sampled_from([1e-8, 1e-6, 1e-3])), weight_decay=draw(weight_decays),
                    amsgrad=draw(st.booleans()), maximize=draw(st.booleans()))
    return [one(), one()]


def _sgd(groups):
    return torch.optim.SGD(groups, lr=0.1, foreach=False)


def _adam(groups):
    return torch.optim.Adam(groups, foreach=False)


def _adamw(groups):
    return torch.optim.AdamW(groups, foreach=False)


@settings(max_examples=40, deadline=None)
@given(groups=sgd_groups(), factors=lr_factors, seed=st.integers(0, 2**16))
def test_sgd_matches_torch(groups, factors, seed):
    run_against_torch(_sgd, groups, factors, seed)


@settings(max_examples=40, deadline=None)
@given(groups=adam_groups(), factors=lr_factors, seed=st.integers(0, 2**16))
def test_adam_matches_torch(groups, factors, seed):
    run_against_torch(_adam, groups, factors, seed)


@settings(max_examples=40, deadline=None)
@given(groups=adam_groups(), factors=lr_factors, seed=st.integers(0, 2**16))
def test_adamw_matches_torch(groups, factors, seed):
    run_against_torch(_adamw, groups, factors, seed)


@pytest.mark.parametrize("make, groups", [
    (_sgd, [dict(momentum=0.9, dampening=0.1), dict(momentum=0.9, nesterov=True)]),
    (_adam, [dict(lr=1e-2, amsgrad=True), dict(lr=1e-2, weight_decay=0.1)]),
    (_adamw, [dict(lr=1e-2, amsgrad=True), dict(lr=1e-2, weight_decay=0.1)]),
])
def test_resumes_from_a_trained_torch_optimizer(make, groups):
    """Start from a torch optimizer that already took 3 steps: momentum and step count carry on."""
    run_against_torch(make, groups, [1.0] * STEPS, warm_steps=3)


@pytest.mark.parametrize("make, groups", [
    (_sgd, [dict(momentum=0.9), dict(momentum=0.0)]),
    (_adam, [dict(amsgrad=True), dict()]),
    (_adamw, [dict(), dict(weight_decay=0.1)]),
])
def test_write_back_gives_the_state_torch_would_hold(make, groups):
    """After ``write_back`` a torch optimizer continues exactly as if it had taken the steps."""
    trained, fo, states = run_against_torch(make, groups, [1.0] * STEPS)
    fresh_params = [p.detach().clone().requires_grad_() for g in trained.param_groups for p in g["params"]]
    fresh = make([{**g, "params": fresh_params[:2] if i == 0 else fresh_params[2:]}
                  for i, g in enumerate(trained.param_groups)])
    fo.optimizer = fresh
    fo.param_of = dict(zip(fo.names, fresh_params))
    fo.write_back({f"{n}.{k}": v for n, st in states.items() for k, v in st.items()}, STEPS)
    for p_old, p_new in zip((p for g in trained.param_groups for p in g["params"]), fresh_params):
        assert set(fresh.state[p_new]) == set(trained.state[p_old])
    for p_old, p_new in zip((p for g in trained.param_groups for p in g["params"]), fresh_params):
        grad = torch.randn(p_old.shape)
        p_old.grad, p_new.grad = grad, grad.clone()
    trained.step()
    fresh.step()
    for p_old, p_new in zip((p for g in trained.param_groups for p in g["params"]), fresh_params):
        assert (p_old - p_new).abs().max().item() <= ATOL


def test_constant_hyper_parameter_change_is_detected():
    opt = torch.optim.AdamW([torch.zeros(2, requires_grad=True)], lr=1e-3)
    fo = FunctionalOptimizer(opt, {id(opt.param_groups[0]["params"][0]): "w"})
    opt.param_groups[0]["lr"] = 1e-4  # lr, beta1 and AdamW's decay are host scalars: fine
    opt.param_groups[0]["betas"] = (0.8, 0.999)
    opt.param_groups[0]["weight_decay"] = 0.5
    assert fo.constants_changed() is None
    opt.param_groups[0]["eps"] = 1e-6
    assert fo.constants_changed() == "optimizer group 0: eps 1e-08 -> 1e-06"


def test_unsupported_optimizer_and_foreign_tensor_are_errors():
    w = torch.zeros(2, requires_grad=True)
    with pytest.raises(CaptureError, match="RMSprop is not supported"):
        FunctionalOptimizer(torch.optim.RMSprop([w]), {id(w): "w"})
    with pytest.raises(CaptureError, match="not a parameter of the model"):
        FunctionalOptimizer(torch.optim.SGD([w], lr=0.1), {})
