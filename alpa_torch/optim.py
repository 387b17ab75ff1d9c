"""The user's ``torch.optim`` optimizer(s), traced into the captured step: eager's own code.

``OptimizerSet`` reads one optimizer (or several: Muon for the matrices, AdamW for the rest)
and, while ``capture`` traces the step, runs each optimizer's real ``step()`` on the traced
parameters, gradients and state (``update``). Nothing of the update maths is written here:
what the graph holds is what ``torch.optim`` computes, for every optimizer, every option
(``maximize``, ``amsgrad``, ``nesterov``, ``centered``, decoupled weight decay, per-group
settings) and several optimizers in one step. What tracing cannot give by itself, and how:

- **The numbers a step computes in Python** (bias corrections from ``step_t.item()``, the
  group's ``lr``, betas, weight decay): every float hyper-parameter of every group is a graph
  input (a host scalar read from ``param_groups`` on every call, so schedulers and hand-set
  learning rates work), and the optimizer computes with ``LazyScalar``s that stay graph
  values (``lazy_scalars.py``). A Python decision on a hyper-parameter (``if weight_decay !=
  0``) is a guard: when it would go the other way, ``constants_changed`` says so and the step
  is captured again; so does a change of any other setting (a flag, an int).
- **A decision on a value only the devices know** (RAdam's ``rho_t > 5`` on the step count,
  ASGD's ``mu != 1``): the optimizer's own ``capturable`` form makes it with ``torch.where``;
  the trace retries with it (its arithmetic is ``torch.optim``'s too, in another order:
  equal to eager within float32 rounding). An optimizer without that form raises by name.
- **The state a fresh optimizer creates in its first step.** ``torch.optim`` fills it lazily
  (zeros, ``lr``, ones, a step count of 0) inside ``step()``. The graph takes the state as
  input, so it is created before: each optimizer's first step is run on small stand-in
  tensors (``_Layout``) to learn each state tensor's shape, dtype and the value every element
  starts at; a second run from those values must end bit for bit where the first ended (SGD's
  momentum buffer, a copy of the first gradient, passes from zeros with ``dampening=0``). A
  state that fails it is created by the graph of the first step (``first_step``), and the
  step is captured again after it, with the state as input.
- ``foreach`` and ``fused`` select kernels, not maths: the trace runs the single-tensor code.
- **Refused by name** (``REFUSED``): ``LBFGS`` (its closure re-runs the forward several times
  per step) and ``SparseAdam`` (sparse gradients).

Mixed precision with fp16 adds dynamic loss scaling (``LossScaler``, the maths of
``torch.amp.GradScaler``) as graph state; a step that overflows keeps every parameter and
state tensor (``torch.optim``'s step count included) as it was.

This module owns reading the optimizers and tracing their update; ``capture`` decides where.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from alpa_torch.core.errors import CaptureError

from . import lazy_scalars
from .lazy_scalars import DecidesOnDeviceValue, Guard, LazyMode, Scalars

REFUSED = {
    "LBFGS": ("its step(closure) re-runs the forward and backward several times per step, which one captured step "
              "cannot; use Adam, AdamW or another torch.optim optimizer"),
    "SparseAdam": ("it takes sparse gradients (nn.Embedding(sparse=True)), which the planner does not shard; use "
                   "Adam or AdamW with dense gradients"),
}
_KERNEL_FLAGS = {"foreach": False, "fused": False, "differentiable": False}
_STAND_IN_DIMS = (2, 3, 5, 7, 11, 13, 17, 19)
"""Sizes of a stand-in's dims: distinct primes, so a state dim's size names the parameter dim it follows."""


@dataclass(frozen=True, slots=True)
class StateEntry:
    """One state tensor of a parameter, as ``torch.optim`` keeps it under ``key``."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float | None
    """Every element's value in a fresh optimizer's state (None: the user's tensor)."""


def _hyper_keys(group: Mapping) -> list[tuple[str, tuple]]:
    """(name, path) of every float hyper-parameter of a group: a float, or an element of a tuple of floats."""
    out = []
    for key, value in group.items():
        if key == "params":
            continue
        if _is_float(value):
            out.append((key, (key,)))
        elif isinstance(value, (tuple, list)) and value and all(_is_float(v) for v in value):
            out += [(f"{key}.{j}", (key, j)) for j in range(len(value))]
    return out


def _is_float(v) -> bool:
    return (isinstance(v, float) and not isinstance(v, bool)) or (isinstance(v, torch.Tensor) and v.numel() == 1
                                                                   and v.is_floating_point())


def _get(group: Mapping, path: tuple) -> float:
    v = group[path[0]] if len(path) == 1 else group[path[0]][path[1]]
    return float(v)


def _baked(group: Mapping) -> tuple:
    """What the graph bakes in of a group: its settings that are not float hyper-parameters."""
    floats = {path[0] for _, path in _hyper_keys(group)}
    return tuple(sorted((k, repr(v)) for k, v in group.items() if k != "params" and k not in floats)) + (
        ("hyper-parameters", tuple(name for name, _ in _hyper_keys(group))),)


class LossScaler:
    """Dynamic loss scaling for fp16, functional: ``torch.amp.GradScaler``'s maths on graph state.

    State (kind ``opt_state``, names ``STATE``): the scale (float32, starts at ``init_scale``)
    and the count of good steps since the last change (int32). A step whose unscaled gradients
    hold an inf or NaN is skipped (``torch.where``: parameters and optimizer state, its step
    count included, keep their values) and halves the scale; ``growth_interval`` good steps in
    a row double it (``torch._amp_update_scale_``)."""

    STATE = ("amp.loss_scale", "amp.growth_tracker")
    init_scale = 2.0**16
    growth_factor = 2.0
    backoff_factor = 0.5
    growth_interval = 2000

    @classmethod
    def initial_state(cls) -> dict[str, torch.Tensor]:
        """Fresh scaler state."""
        return {"amp.loss_scale": torch.tensor(cls.init_scale, dtype=torch.float32),
                "amp.growth_tracker": torch.tensor(0, dtype=torch.int32)}

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
        scale, tracker = state["amp.loss_scale"], state["amp.growth_tracker"]
        good = tracker + 1
        grow = good >= cls.growth_interval
        # One factor, so every operator on the scale follows found_inf (update phase, graph_facts).
        factor = torch.where(found_inf, cls.backoff_factor, torch.where(grow, cls.growth_factor, 1.0))
        new_scale = scale * factor.to(scale.dtype)
        new_scale = torch.where(torch.isfinite(new_scale), new_scale, scale)  # growth never overflows it
        new_tracker = torch.where(found_inf | grow, torch.zeros_like(tracker), good)
        return {"amp.loss_scale": new_scale, "amp.growth_tracker": new_tracker}


class OptimizerSet:
    """The user's optimizer(s) as the captured step runs them (module docstring).

    ``names``: every parameter the optimizers update, by model name, in the optimizers'
    order; ``owner[name]``: (optimizer index, group index). ``steps_taken``: steps the workers
    have already taken (a re-capture after the first step: the state exists there, whatever
    the driver's objects hold)."""

    def __init__(self, optimizers, param_names: Mapping[int, str], *, device_step: bool = False,
                 steps_taken: int = 0):
        self.optimizers = tuple(optimizers)
        self.device_step = bool(device_step)
        for opt in self.optimizers:
            why = REFUSED.get(type(opt).__name__)
            if why is not None:
                raise CaptureError(f"optimizer {type(opt).__name__} cannot run in a parallel step: {why}")
        if self.device_step and len(self.optimizers) > 1:
            raise CaptureError("precision='fp16' runs one optimizer (its loss scale spans the step); use one "
                               "optimizer, or precision='bf16'")
        self.names: list[str] = []
        self.owner: dict[str, tuple[int, int]] = {}
        self.param_of: dict[str, torch.Tensor] = {}
        for k, opt in enumerate(self.optimizers):
            for gi, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    if id(p) not in param_names:
                        raise CaptureError("the optimizer holds a tensor that is not a parameter of the model; "
                                           "build the optimizer from model.parameters()")
                    name = param_names[id(p)]
                    if name in self.owner:
                        raise CaptureError(f"parameter {name} is in two optimizers (or twice in one); give each "
                                           "parameter to one optimizer")
                    self.owner[name], self.param_of[name] = (k, gi), p
                    self.names.append(name)
        self._baked = self._baked_now()
        self.guards: list[Guard] = []
        """The Python decisions the traced update took (``lazy_scalars.Guard``)."""
        self.layout, self.first_step = _Layout.learn(self, steps_taken)
        """Per parameter: its state tensors (``StateEntry``); the parameters whose state the first step creates."""

    # ---------------------------------------------------------------- what the graph reads
    def state_names(self, name: str) -> tuple[str, ...]:
        """The keys of ``name``'s state tensors, as in ``optimizer.state[p]``."""
        return tuple(e.key for e in self.layout.get(name, ()))

    def host_scalars(self) -> dict[str, float]:
        """Every float hyper-parameter of every group, as the step reads it now: ``o{k}.g{i}.{key}``."""
        return {f"o{k}.g{gi}.{name}": _get(group, path) for k, opt in enumerate(self.optimizers)
                for gi, group in enumerate(opt.param_groups) for name, path in _hyper_keys(group)}

    def initial_state(self, name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """``name``'s state tensors: the user's, or a fresh optimizer's (on the meta device for a meta ``param``)."""
        user = self.user_state(name)
        device = "meta" if param.is_meta else param.device
        return {e.key: user[e.key].detach() if e.fill is None else torch.full(e.shape, e.fill, dtype=e.dtype,
                                                                               device=device)
                for e in self.layout.get(name, ())}

    def user_state(self, name: str) -> dict:
        opt = self.optimizers[self.owner[name][0]]
        return opt.state.get(self.param_of[name], {})

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """State name (``{param}.{key}``, as the graph names it) -> the tensor the user's optimizer holds."""
        out = {}
        for name in self.names:
            state = self.user_state(name)
            for key in self.state_names(name):
                if isinstance(state.get(key), torch.Tensor):
                    out[f"{name}.{key}"] = state[key]
        return out

    def step_count(self) -> int:
        """Steps the user's optimizers have taken (0 for fresh ones): the largest ``step`` state."""
        steps = [int(st["step"]) for opt in self.optimizers for st in opt.state.values() if "step" in st]
        if steps:
            return max(steps)
        return int(any(st for opt in self.optimizers for st in opt.state.values()))

    def constants_changed(self, steps_taken: int) -> str | None:
        """What the captured update can no longer follow, in words, or None: a setting that is not a
        float hyper-parameter, a guard that now goes the other way, the first step having created its
        state. The caller captures the step again."""
        now = self._baked_now()
        if now != self._baked:
            for key in sorted(set(now) | set(self._baked)):
                old, new = dict(self._baked.get(key, ())), dict(now.get(key, ()))
                moved = [f"{a} {old.get(a)} -> {new.get(a)}" for a in sorted(set(old) | set(new))
                         if old.get(a) != new.get(a)]
                if moved or key not in now or key not in self._baked:
                    return f"optimizer {key[0]} group {key[1]}: {', '.join(moved[:3]) or 'added or removed'}"
        return self._guard_changed(steps_taken)

    def _guard_changed(self, steps_taken: int) -> str | None:
        if self.guards:
            hyper = self.host_scalars()
            for guard in self.guards:
                if not guard.holds(hyper):
                    return f"the optimizer's step decided on {guard.what}, which now goes the other way"
        if self.first_step and steps_taken > 0:
            return f"the optimizer's first step created the state of {sorted(self.first_step)[0]}"
        return None

    def _baked_now(self) -> dict:
        return {(k, gi): _baked(group) for k, opt in enumerate(self.optimizers)
                for gi, group in enumerate(opt.param_groups)}

    # ---------------------------------------------------------------- the traced update
    def update(self, k: int, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
               states: dict[str, dict[str, torch.Tensor]], scalars: dict[str, torch.Tensor]):
        """Optimizer ``k``'s ``step()`` traced on ``params`` (the graph's inputs), ``grads`` (None: no
        gradient), ``states`` and the host ``scalars``: ``(new params, new states)`` by name."""
        opt = self.optimizers[k]
        names = [n for n in self.names if self.owner[n][0] == k and grads.get(n) is not None]
        if not names:
            return {}, {}
        prefix = f"o{k}."
        keys = [key for key in scalars if key.startswith(prefix)]
        flat = [states[n][key] for n in names if n not in self.first_step for key in self.state_names(n)]
        for capturable in (False, True):
            ctx = Scalars({key: v for key, v in self.host_scalars().items()})
            pure = self._pure(opt, k, names, ctx, keys, capturable)
            try:
                new_params, new_state = torch.func.functionalize(pure)(
                    [params[n] for n in names], [grads[n] for n in names], flat, [scalars[key] for key in keys])
            except DecidesOnDeviceValue as exc:
                if capturable or not all("capturable" in g for g in opt.param_groups):
                    raise CaptureError(
                        f"optimizer {type(opt).__name__} decides in Python on a value only the devices know "
                        f"({exc}), and has no capturable form that decides on the device; it cannot run in a "
                        "parallel step") from None
                continue
            self.guards += ctx.guards
            break
        out_states, it = {}, iter(new_state)
        for n in names:
            out_states[n] = {key: next(it) for key in self.state_names(n)}
        return dict(zip(names, new_params)), out_states

    def _pure(self, opt, k: int, names: list[str], ctx: Scalars, keys: list[str], capturable: bool):
        """The function ``update`` functionalizes: inputs in, the optimizer's results out."""
        def pure(params, grads, flat_state, hyper):
            inputs = {key: ctx.input(t, key) for key, t in zip(keys, hyper)}
            work = [p.detach() for p in params]
            for w, g in zip(work, grads):
                w.grad = g
            it = iter(flat_state)
            state = defaultdict(dict)
            for n, w in zip(names, work):
                if n not in self.first_step:
                    state[w] = {key: next(it) for key in self.state_names(n)}
            shadow = _shadow(opt, names, dict(zip(names, work)), self.param_of, state,
                             lambda gi, path: inputs[f"o{k}.g{gi}.{path}"], capturable)
            with LazyMode(ctx), lazy_scalars.patched(_namespaces(opt)), _compiling(capturable):
                _unhooked_step(opt)(shadow)
            return work, [shadow.state[w][key] for n, w in zip(names, work) for key in self.state_names(n)]

        return pure

    # ---------------------------------------------------------------- the user's objects
    def write_back(self, states: Mapping[str, torch.Tensor], trained: set[str] | None = None, into=None) -> None:
        """Store the state (by state name) into the user's optimizers (or ``into``: optimizers with the
        same groups, their parameters in the same places), as torch.optim holds it. ``trained``: the
        parameters the step updates (None: all); torch.optim keeps no state for a parameter that never
        had a gradient (a frozen one left in the optimizer), so neither does this."""
        targets = tuple(into) if into is not None else self.optimizers
        for name in self.names:
            k, gi = self.owner[name]
            if trained is not None and name not in trained and not self.user_state(name):
                continue
            position = [id(p) for p in self.optimizers[k].param_groups[gi]["params"]].index(id(self.param_of[name]))
            p = targets[k].param_groups[gi]["params"][position]
            keys = [key for key in self.state_names(name) if f"{name}.{key}" in states]
            if keys:
                targets[k].state[p] = {key: states[f"{name}.{key}"].detach().clone() for key in keys}


def _shadow(opt, names: list[str], work: dict[str, torch.Tensor], param_of: dict, state, hyper, capturable: bool):
    """A copy of ``opt`` over the traced tensors: groups with ``work`` for its parameters (all of a
    group's, in order; those without a gradient left out, as torch.optim skips them), each float
    hyper-parameter ``hyper(group index, name)``, the single-tensor kernels, ``state``."""
    by_id = {id(param_of[n]): work[n] for n in names}
    shadow = copy.copy(opt)
    groups = []
    for gi, group in enumerate(opt.param_groups):
        g = dict(group, params=[by_id[id(p)] for p in group["params"] if id(p) in by_id])
        for name, path in _hyper_keys(group):
            if len(path) == 1:
                g[path[0]] = hyper(gi, name)
            else:
                g[path[0]] = tuple(hyper(gi, f"{path[0]}.{j}") for j in range(len(group[path[0]])))
        g.update({flag: value for flag, value in _KERNEL_FLAGS.items() if flag in g})
        if "capturable" in g:
            g["capturable"] = capturable
        groups.append(g)
    shadow.__dict__.update(param_groups=groups, state=state, defaults=dict(opt.defaults, differentiable=False))
    return shadow


def _unhooked_step(opt):
    """``type(opt).step`` without ``Optimizer``'s wrapper (its hooks and profiler ranges)."""
    step = type(opt).step
    return getattr(step, "__wrapped__", step)


def _namespaces(opt) -> list[dict]:
    """The global namespaces of the code of ``opt``'s ``step`` (where its maths is written)."""
    return [inspect.unwrap(type(opt).step).__globals__]


@contextlib.contextmanager
def _compiling(on: bool) -> Iterator[None]:
    """``torch.compiler.is_compiling()`` True: torch.optim's capturable form skips its check that the
    tensors are on a CUDA device (the trace's fake tensors are CPU ones)."""
    if not on:
        yield
        return
    original = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True
    try:
        yield
    finally:
        torch.compiler.is_compiling = original


class _Recorded(dict):
    """A parameter's state dict that keeps a copy of the first value set under each key."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in self.items()}

    def __setitem__(self, key, value) -> None:
        if key not in self.first:
            self.first[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        super().__setitem__(key, value)


class _Layout:
    """Learning a fresh optimizer's state from its first step on stand-ins (module docstring)."""

    @staticmethod
    def learn(opts: OptimizerSet, steps_taken: int) -> tuple[dict[str, tuple[StateEntry, ...]], set[str]]:
        layout, first_step = {}, set()
        for k, opt in enumerate(opts.optimizers):
            names = [n for n in opts.names if opts.owner[n][0] == k]
            have = {n for n in names if opts.user_state(n)}
            for n in have:
                layout[n] = tuple(StateEntry(key, tuple(v.shape), v.dtype, None)
                                  for key, v in opts.user_state(n).items() if isinstance(v, torch.Tensor))
            fresh = [n for n in names if n not in have and opts.param_of[n].requires_grad]
            if fresh:
                learned, unverified = _Layout._stand_in(opt, fresh, opts.param_of)
                layout.update(learned)
                if steps_taken == 0:
                    first_step |= unverified
        return layout, first_step

    @staticmethod
    def _stand_in(opt, names: list[str], param_of: dict) -> tuple[dict, set[str]]:
        """Two eager first steps of ``opt`` on small stand-ins of ``names`` (the rest without gradients):
        from no state, and from the fills the first recorded. The state tensors, and the parameters
        whose second run did not end bit for bit where the first did."""
        gen = torch.Generator().manual_seed(0)
        shapes = {}
        for n in names:
            ndim = param_of[n].dim()
            if ndim > len(_STAND_IN_DIMS):
                raise CaptureError(f"parameter {n} has {ndim} dims; the optimizer's state is learnt on stand-ins of "
                                   f"at most {len(_STAND_IN_DIMS)}")
            shapes[n] = _STAND_IN_DIMS[:ndim]
        start = {n: torch.randn(shapes[n], generator=gen).to(param_of[n].dtype) for n in names}
        grads = {n: torch.randn(shapes[n], generator=gen).to(param_of[n].dtype) for n in names}

        def run(initial):
            work = {n: start[n].clone() for n in names}
            for n in names:
                work[n].grad = grads[n].clone()
            state = defaultdict(_Recorded)
            for n in names:
                if initial is not None:
                    state[work[n]] = _Recorded(initial[n])
            shadow = _shadow(opt, names, work, param_of, state, lambda gi, path: _get(opt.param_groups[gi],
                                                                                      _path(path)), False)
            _unhooked_step(opt)(shadow)
            return work, {n: state[work[n]] for n in names}

        with torch.no_grad():
            work_a, state_a = run(None)
            fills = {n: {k: _fill(v) for k, v in state_a[n].first.items() if isinstance(v, torch.Tensor)}
                     for n in names}
            work_b, state_b = run({n: {k: torch.full(state_a[n].first[k].shape, 0.0 if f is None else f,
                                                     dtype=state_a[n].first[k].dtype) for k, f in fills[n].items()}
                                   for n in names})
        layout, unverified = {}, set()
        for n in names:
            same = torch.equal(work_a[n], work_b[n]) and all(
                torch.equal(state_a[n][k], state_b[n][k]) for k in fills[n])
            if not same:
                unverified.add(n)
            layout[n] = tuple(StateEntry(k, _real_shape(state_a[n].first[k].shape, param_of[n].shape, n, k),
                                         state_a[n].first[k].dtype, 0.0 if f is None else f)
                              for k, f in fills[n].items())
        return layout, unverified


def _path(name: str) -> tuple:
    key, _, j = name.partition(".")
    return (key,) if not j else (key, int(j))


def _fill(t: torch.Tensor) -> float | None:
    """The value every element of ``t`` holds, or None."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return 0.0
    return float(flat[0]) if bool((flat == flat[0]).all()) else None


def _real_shape(stand_in: torch.Size, param: torch.Size, name: str, key: str) -> tuple[int, ...]:
    """The shape a state tensor of the stand-in has for the real parameter: each dim is 1 or the
    parameter dim whose stand-in size it has."""
    out = []
    for size in stand_in:
        if size == 1:
            out.append(1)
        elif size in _STAND_IN_DIMS[:len(param)]:
            out.append(int(param[_STAND_IN_DIMS.index(size)]))
        else:
            raise CaptureError(f"the optimizer's state {key!r} of {name} has shape {tuple(stand_in)} on a stand-in "
                               f"of shape {_STAND_IN_DIMS[:len(param)]}, not one that follows the parameter's dims")
    return tuple(out)
