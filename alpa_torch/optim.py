"""Functional twins of ``torch.optim`` SGD, Adam and AdamW.

Why: ``torch.optim`` cannot be traced into a graph on CPU (docs/design.md:
``.item()`` on the step count, ``capturable`` refused for CPU tensors), so the
captured step replaces ``optimizer.step()`` by these functions. They follow the
single-tensor code path of torch 2.13 (``torch/optim/sgd.py``,
``torch/optim/adam.py``) operation by operation; tests check them against
``torch.optim`` on every zoo model.

Values that change from step to step or that a scheduler may change are not
baked into the graph: they are *host scalars*, computed here on the driver each
step from the user's ``param_groups`` and fed to the graph as 0-dim float64
tensors: ``lr``, Adam's bias corrections, Adam's ``beta1`` and SGD's
``momentum`` (``OneCycleLR`` and ``CyclicLR`` cycle them) and AdamW's decoupled
weight decay. The other hyper-parameters of a group (``beta2``, ``eps``,
Adam's coupled weight decay, SGD's dampening, nesterov's momentum, flags) are
baked in; ``FunctionalOptimizer.constants_changed`` tells the caller when one
of those moved, and the caller captures the step again.

Mixed precision with fp16 (``precision="fp16"``) adds dynamic loss scaling
(``LossScaler``, the maths of ``torch.amp.GradScaler``) as graph state, and a
step that overflows is skipped inside the graph. Whether a step is skipped is
then known only on the devices, so in that mode the optimizer's step count is
device state too (``amp.step``) and the host sends only ``lr`` per group; the
bias corrections and SGD's ``first_step`` are computed in the graph from the
device count (``device_scalars``, float64 like the host's Python floats), as
``torch.optim`` does when ``GradScaler.step`` skips ``optimizer.step()``.

This module owns the maths only; ``capture`` decides where it is called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from alpa_torch.core.errors import CaptureError

_SUPPORTED = ("SGD", "Adam", "AdamW")


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupConfig:
    """The constant hyper-parameters of one ``param_group``."""

    kind: str
    """'sgd' or 'adam' (AdamW is 'adam' with ``decoupled=True``)."""
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    maximize: bool = False
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    amsgrad: bool = False
    decoupled: bool = False
    """AdamW-style decay ``param *= 1 - lr * weight_decay``."""
    full_precision: bool = True
    """Every parameter of the group is float32 or float64: a Python-scalar factor of the update
    and the same factor as a 0-dim tensor give the same bits (for bf16 / fp16 parameters they
    do not: the kernels round a tensor factor to the low precision first)."""


def _group_config(optimizer: torch.optim.Optimizer, group: Mapping) -> GroupConfig:
    name = type(optimizer).__name__
    full = all(p.dtype in (torch.float32, torch.float64) for p in group["params"])
    if name == "SGD":
        return GroupConfig(
            kind="sgd", momentum=float(group["momentum"]), dampening=float(group["dampening"]),
            nesterov=bool(group["nesterov"]), weight_decay=float(group["weight_decay"]),
            maximize=bool(group["maximize"]), full_precision=full,
        )
    beta1, beta2 = (float(b) for b in group["betas"])
    return GroupConfig(
        kind="adam", weight_decay=float(group["weight_decay"]), maximize=bool(group["maximize"]),
        beta1=beta1, beta2=beta2, eps=float(group["eps"]), amsgrad=bool(group["amsgrad"]),
        decoupled=bool(group.get("decoupled_weight_decay", name == "AdamW")), full_precision=full,
    )


def state_names(cfg: GroupConfig) -> tuple[str, ...]:
    """Names of the per-parameter state tensors, as in ``optimizer.state[p]``."""
    if cfg.kind == "sgd":
        return ("momentum_buffer",) if cfg.momentum != 0 else ()
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if cfg.amsgrad else ("exp_avg", "exp_avg_sq")


def moving(cfg: GroupConfig) -> tuple[str, ...]:
    """The hyper-parameters of a group sent as host scalars every step (a scheduler may move
    them): the ones the update multiplies by a tensor, never an operator's Python scalar
    argument (nesterov's ``add(alpha=momentum)``, ``addcmul(value=1 - beta2)``), and only where
    that gives eager's bits (``GroupConfig.full_precision``). AdamW's decay is computed on the
    host whatever the dtype (``1 - lr * weight_decay``, a float64 factor either way)."""
    decay = ("weight_decay",) if cfg.kind == "adam" and cfg.decoupled else ()
    if not cfg.full_precision:
        return decay
    if cfg.kind == "sgd":
        return ("momentum",) if cfg.momentum != 0 and not cfg.nesterov else ()
    return ("beta1", *decay)


def baked(cfg: GroupConfig) -> tuple:
    """What the graph bakes in of a group: every field but the ``moving`` ones (and whether
    SGD's momentum is on at all: it decides the state the update keeps)."""
    skip = moving(cfg)
    return tuple((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name not in skip) + (
        ("momentum_on", cfg.momentum != 0),)


def host_scalars(cfg: GroupConfig, group: Mapping, step: int) -> dict[str, float]:
    """Per-step scalars of a group for the optimizer step number ``step`` (1-based), from the
    group's current values (``group``: the user's ``param_group``)."""
    lr = float(group["lr"])
    if cfg.kind == "sgd":
        out = {"neg_lr": -lr, "first_step": 1.0 if step == 1 else 0.0}
        if "momentum" in moving(cfg):
            out["momentum"] = float(group["momentum"])
        return out
    beta1 = float(group["betas"][0]) if "beta1" in moving(cfg) else cfg.beta1
    weight_decay = float(group["weight_decay"]) if "weight_decay" in moving(cfg) else cfg.weight_decay
    out = {
        "neg_step_size": -(lr / (1 - beta1**step)),
        "bias_correction2_sqrt": (1 - cfg.beta2**step) ** 0.5,
        "decay": 1 - lr * weight_decay,
    }
    if "beta1" in moving(cfg):
        out["one_minus_beta1"] = 1 - beta1
    return out


def _scaled(x: torch.Tensor, scalar: torch.Tensor, divide: bool = False) -> torch.Tensor:
    """``x * scalar`` (or ``x / scalar``) for a 0-dim float64 host scalar, rounded as torch's kernels
    round ``x.mul_(python_float)``: in float32 arithmetic for bf16 / fp16 ``x`` (the kernels' opmath
    type), the result rounded once to ``x``'s dtype; natively for float32 / float64."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return x / scalar if divide else x * scalar
    wide, s = x.float(), scalar.float()
    return (wide / s if divide else wide * s).to(x.dtype)


def _add_scaled(param: torch.Tensor, scalar: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor | None = None):
    """``param.add_(t1, alpha=s)`` / ``param.addcdiv_(t1, t2, value=s)`` for a 0-dim float64 host
    scalar ``s``: ``param + s * t1 (/ t2)``. For bf16 / fp16 ``param`` as torch's CPU kernels
    compute it: in float32, rounded once (``add``'s alpha is first rounded to the low precision,
    ``addcdiv``'s value is not)."""
    if param.dtype not in (torch.bfloat16, torch.float16):
        return param + scalar * t1 if t2 is None else param + scalar * t1 / t2
    if t2 is None:
        return (param.float() + scalar.to(param.dtype).float() * t1.float()).to(param.dtype)
    return (param.float() + scalar.float() * t1.float() / t2.float()).to(param.dtype)


def sgd_update(cfg: GroupConfig, param, grad, state: dict, scalars: dict):
    """``torch.optim.sgd._single_tensor_sgd`` for one parameter; returns (param, state)."""
    grad = -grad if cfg.maximize else grad
    if cfg.weight_decay != 0:
        grad = grad.add(param, alpha=cfg.weight_decay)
    new_state = {}
    if cfg.momentum != 0:
        buf = state["momentum_buffer"]
        # torch starts the buffer as a copy of the first gradient.
        momentum = scalars["momentum"] if "momentum" in scalars else cfg.momentum
        continued = buf.mul(momentum).add(grad, alpha=1 - cfg.dampening)
        buf = torch.where(scalars["first_step"] > 0, grad, continued)
        new_state["momentum_buffer"] = buf
        grad = grad.add(buf, alpha=cfg.momentum) if cfg.nesterov else buf
    return _add_scaled(param, scalars["neg_lr"], grad), new_state


def adam_update(cfg: GroupConfig, param, grad, state: dict, scalars: dict):
    """``torch.optim.adam._single_tensor_adam`` (non-capturable path) for one parameter."""
    grad = -grad if cfg.maximize else grad
    if cfg.weight_decay != 0:
        if cfg.decoupled:
            param = _scaled(param, scalars["decay"])
        else:
            grad = grad.add(param, alpha=cfg.weight_decay)
    # A moving beta1: 1 - beta1 computed in float64 on the host, then in the parameters' dtype
    # like lerp's Python-scalar weight (float32 / float64 only: GroupConfig.full_precision).
    weight = scalars["one_minus_beta1"].to(grad.dtype) if "one_minus_beta1" in scalars else 1 - cfg.beta1
    exp_avg = state["exp_avg"].lerp(grad, weight)
    exp_avg_sq = state["exp_avg_sq"].mul(cfg.beta2).addcmul(grad, grad, value=1 - cfg.beta2)
    new_state = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second = exp_avg_sq
    if cfg.amsgrad:
        second = torch.maximum(state["max_exp_avg_sq"], exp_avg_sq)
        new_state["max_exp_avg_sq"] = second
    denom = _scaled(second.sqrt(), scalars["bias_correction2_sqrt"], divide=True).add(cfg.eps)
    # addcdiv computes self + value * t1 / t2 in that order.
    return _add_scaled(param, scalars["neg_step_size"], exp_avg, denom), new_state


def update(cfg: GroupConfig, param, grad, state: dict, scalars: dict):
    fn = sgd_update if cfg.kind == "sgd" else adam_update
    return fn(cfg, param, grad, state, scalars)


def device_scalars(cfg: GroupConfig, lr: torch.Tensor, step: torch.Tensor) -> dict[str, torch.Tensor]:
    """``host_scalars`` computed in the graph from 0-dim tensors ``lr`` and ``step`` (the
    1-based number of the step being taken), in float64 as the host computes them."""
    lr, step = lr.to(torch.float64), step.to(torch.float64)
    if cfg.kind == "sgd":
        return {"neg_lr": -lr, "first_step": (step == 1).to(torch.float64)}
    bias_correction1 = 1 - torch.pow(cfg.beta1, step)
    bias_correction2 = 1 - torch.pow(cfg.beta2, step)
    return {
        "neg_step_size": -(lr / bias_correction1),
        "bias_correction2_sqrt": bias_correction2.sqrt(),
        "decay": 1 - lr * cfg.weight_decay,
    }


class LossScaler:
    """Dynamic loss scaling for fp16, functional: ``torch.amp.GradScaler``'s maths on graph state.

    State (kind ``opt_state``, names ``STATE``): the scale (float32, starts at
    ``init_scale``), the count of good steps since the last change (int32) and the
    optimizer's step count (float32, steps taken, skipped ones not counted). A step
    whose unscaled gradients hold an inf or NaN is skipped (``torch.where``: parameters
    and optimizer state keep their values) and halves the scale; ``growth_interval``
    good steps in a row double it (``torch._amp_update_scale_``)."""

    STATE = ("amp.loss_scale", "amp.growth_tracker", "amp.step")
    init_scale = 2.0**16
    growth_factor = 2.0
    backoff_factor = 0.5
    growth_interval = 2000

    @classmethod
    def initial_state(cls, step: int) -> dict[str, torch.Tensor]:
        """Fresh scaler state for an optimizer that has taken ``step`` steps."""
        return {"amp.loss_scale": torch.tensor(cls.init_scale, dtype=torch.float32),
                "amp.growth_tracker": torch.tensor(0, dtype=torch.int32),
                "amp.step": torch.tensor(float(step), dtype=torch.float32)}

    @staticmethod
    def found_inf(grads) -> torch.Tensor:
        """0-dim bool: some gradient holds an inf or NaN. ``g * 0`` is 0 for finite values and
        NaN otherwise, so the sum is NaN exactly then (a sum cannot overflow: all terms are 0)."""
        total = None
        for g in grads:
            term = (g * 0).sum(dtype=torch.float32)
            total = term if total is None else total + term
        return torch.isnan(total) if total is not None else torch.tensor(False)

    @classmethod
    def update(cls, state: dict[str, torch.Tensor], found_inf: torch.Tensor) -> dict[str, torch.Tensor]:
        """The scaler state after a step (``torch._amp_update_scale_``)."""
        scale, tracker, step = state["amp.loss_scale"], state["amp.growth_tracker"], state["amp.step"]
        good = tracker + 1
        grow = good >= cls.growth_interval
        # One factor, so every operator on the scale follows found_inf (update phase, graph_facts).
        factor = torch.where(found_inf, cls.backoff_factor, torch.where(grow, cls.growth_factor, 1.0))
        new_scale = scale * factor.to(scale.dtype)
        new_scale = torch.where(torch.isfinite(new_scale), new_scale, scale)  # growth never overflows it
        new_tracker = torch.where(found_inf | grow, torch.zeros_like(tracker), good)
        new_step = torch.where(found_inf, step, step + 1)
        return {"amp.loss_scale": new_scale, "amp.growth_tracker": new_tracker, "amp.step": new_step}


class FunctionalOptimizer:
    """Reads a user's ``torch.optim`` optimizer and offers its functional twin.

    ``names[i]`` is the parameter name (as in ``model.named_parameters()``) of
    the i-th parameter the optimizer updates; ``group_of[name]`` its group.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, param_names: Mapping[int, str], *,
                 device_step: bool = False):
        """``device_step``: the step count is graph state (fp16 loss scaling, module
        docstring); ``host_scalars`` then sends only each group's ``lr``."""
        kind = type(optimizer).__name__
        if kind not in _SUPPORTED:
            raise CaptureError(
                f"optimizer {kind} is not supported yet; use one of {', '.join(_SUPPORTED)} "
                "(torch.optim), or open an issue naming the optimizer you need"
            )
        self.optimizer = optimizer
        self.device_step = bool(device_step)
        self.groups = [_group_config(optimizer, g) for g in optimizer.param_groups]
        self.group_of: dict[str, int] = {}
        self.names: list[str] = []
        self.param_of: dict[str, torch.Tensor] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in param_names:
                    raise CaptureError(
                        "the optimizer holds a tensor that is not a parameter of the model; "
                        "build the optimizer from model.parameters()"
                    )
                name = param_names[id(p)]
                self.group_of[name] = gi
                self.names.append(name)
                self.param_of[name] = p

    def constants_changed(self) -> str | None:
        """What moved among the hyper-parameters the graph bakes in (``baked``) since capture, in
        words, or None. The caller captures the step again when one did."""
        if len(self.optimizer.param_groups) != len(self.groups):
            return (f"the optimizer has {len(self.optimizer.param_groups)} parameter groups, it had "
                    f"{len(self.groups)}")
        for gi, (old, group) in enumerate(zip(self.groups, self.optimizer.param_groups)):
            new = _group_config(self.optimizer, group)
            # fp16's update computes its scalars in the graph from lr alone: everything else is baked
            fixed, now = (tuple(dataclasses.asdict(c).items()) if self.device_step else baked(c) for c in (old, new))
            if fixed != now:
                moved = [f"{k} {a!r} -> {b!r}" for (k, a), (_, b) in zip(fixed, now) if a != b]
                return f"optimizer group {gi}: {', '.join(moved)}"
        return None

    def state_names(self, name: str) -> tuple[str, ...]:
        return state_names(self.groups[self.group_of[name]])

    def step_count(self) -> int:
        """Steps the user's optimizer has taken so far (0 for a fresh one).

        SGD keeps no step counter; a momentum buffer shows it took at least
        one step, which is all its maths needs (``first_step`` is 0, so the
        buffer is continued rather than restarted from the gradient).
        """
        for state in self.optimizer.state.values():
            step = state.get("step")
            if step is not None:
                return int(step)
            if state.get("momentum_buffer") is not None:
                return 1
        return 0

    def host_scalars(self, step: int) -> dict[str, float]:
        """Every host scalar of every group for step ``step``, keyed ``g{i}.{name}``."""
        out = {}
        for gi, (cfg, group) in enumerate(zip(self.groups, self.optimizer.param_groups)):
            if self.device_step:
                out[f"g{gi}.lr"] = float(group["lr"])
                continue
            for key, value in host_scalars(cfg, group, step).items():
                out[f"g{gi}.{key}"] = value
        return out

    def initial_state(self, name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state tensors of ``name``: the user's, or zeros for a fresh optimizer."""
        pstate = self.user_state(name)
        out = {}
        for key in self.state_names(name):
            value = pstate.get(key)
            out[key] = value.detach() if value is not None else torch.zeros_like(param)
        return out

    def user_state(self, name: str) -> dict:
        return self.optimizer.state.get(self.param_of[name], {})

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """State name (``{param}.{key}``, as the graph names it) -> the tensor the user's optimizer holds."""
        out = {}
        for name in self.names:
            state = self.user_state(name)
            for key in self.state_names(name):
                if isinstance(state.get(key), torch.Tensor):
                    out[f"{name}.{key}"] = state[key]
        return out

    def write_back(self, states: Mapping[str, torch.Tensor], step: int, trained: set[str] | None = None) -> None:
        """Store functional state (by state name) into the user's optimizer, as torch.optim would hold it.
        ``trained``: the parameters the step updates (None: all); torch.optim keeps no state for a
        parameter that never had a gradient (a frozen one left in the optimizer), so neither does this."""
        for name in self.names:
            p = self.param_of[name]
            if trained is not None and name not in trained and not self.user_state(name):
                continue
            entry = {k: states[f"{name}.{k}"].detach().clone() for k in self.state_names(name)}
            if self.groups[self.group_of[name]].kind == "adam":
                entry["step"] = torch.tensor(float(step))
            self.optimizer.state[p] = entry
