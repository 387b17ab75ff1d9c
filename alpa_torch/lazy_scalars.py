"""Python numbers that stay graph values while ``torch.optim``'s own code is traced.

An optimizer's ``step()`` computes with Python floats: the hyper-parameters of its groups
(``lr``, betas, weight decay, ...) and ``step_t.item()`` (bias corrections). Traced as they
are, those numbers would be baked into the graph, and a learning-rate schedule or the step
count would need a new capture every step. While ``optim.py`` traces a step it hands the
optimizer ``LazyScalar``s instead: a 0-dim float64 graph value (a hyper-parameter input, or
``item()`` of a state tensor) that behaves like a Python float:

- arithmetic (``+ - * / ** //``, ``abs``, ``-``) gives ``LazyScalar``s computed in float64, as
  Python computes floats (``LazyMode`` turns ``Tensor.item()`` into one);
- a torch function that receives one (``param.mul_(1 - lr * wd)``, ``exp_avg.lerp_(g, 1 - b1)``,
  ``param.addcdiv_(m, d, value=-step_size)``) gets the value as a tensor, computed the way the
  kernel computes with a Python scalar: in the operator's math type (float32 for bf16 / fp16
  tensors) and rounded once (``_with_scalars``); ``alpha=`` and ``value=`` arguments, which
  only take numbers, become the product they stand for;
- Python decisions: a comparison, ``bool``, ``float`` or ``int`` of a value known on the host
  (one computed from hyper-parameters alone) takes its current value and is recorded as a
  ``Guard``: the caller re-evaluates the guards on every call and captures again when one
  changes. ``min`` / ``max`` of a value the host cannot know (a norm's ``item()``, the step
  count) become ``torch.minimum`` / ``torch.maximum`` (``lazy_min`` / ``lazy_max``, put in the
  optimizer's module while tracing); any other decision on such a value raises
  ``DecidesOnDeviceValue`` (the caller may retry with the optimizer's ``capturable`` form,
  which makes those decisions with ``torch.where``).

This module knows nothing of optimizers; ``optim.py`` decides what becomes a ``LazyScalar``.
"""

from __future__ import annotations

import builtins
import contextlib
import math
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.overrides import TorchFunctionMode

LOW_PRECISION = (torch.bfloat16, torch.float16)


class DecidesOnDeviceValue(Exception):
    """Python control flow on a value only the device knows (a norm, a step count in a branch)."""


@dataclass(frozen=True, slots=True)
class Guard:
    """A Python decision the traced graph took: ``compute(hyper)`` had ``value`` at capture."""

    compute: Callable[[dict], object]
    value: object
    what: str

    def holds(self, hyper: dict) -> bool:
        return self.compute(hyper) == self.value


class LazyScalar:
    """A Python number that is a 0-dim float64 graph value (module docstring). ``compute(hyper)``
    gives its value from the hyper-parameters where the host knows it (None: only the device does)."""

    __slots__ = ("tensor", "compute", "what", "ctx")

    def __init__(self, tensor: torch.Tensor, compute: Callable[[dict], float] | None, what: str, ctx: Scalars):
        self.tensor, self.compute, self.what, self.ctx = tensor, compute, what, ctx

    def __repr__(self) -> str:
        return f"LazyScalar({self.what})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """A torch function given a ``LazyScalar`` (the argument parser hands it here, as to any
        tensor-like object): computed with its value as a tensor (``_with_scalars``)."""
        kwargs = kwargs or {}
        ctx = next(x.ctx for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, LazyScalar))
        return _with_scalars(func, args, kwargs, ctx)

    # -------------------------------------------------------------- arithmetic
    def _op(self, other, op, symbol: str, reverse: bool = False) -> LazyScalar | torch.Tensor:
        if isinstance(other, torch.Tensor):  # with a tensor: a tensor, the number as weak as a Python float
            mine = _as(self, torch.float32 if other.dtype in LOW_PRECISION else other.dtype)
            return op(other, mine) if reverse else op(mine, other)
        a, b = (other, self) if reverse else (self, other)
        ca, cb = (_compute(x) for x in (a, b))
        compute = None if ca is None or cb is None else (lambda h, ca=ca, cb=cb: op(ca(h), cb(h)))
        what = f"({_what(a)} {symbol} {_what(b)})"
        return LazyScalar(self.ctx.once(what, compute, lambda: op(_tensor(a), _tensor(b))), compute, what, self.ctx)

    def __add__(self, o): return self._op(o, operator.add, "+")
    def __radd__(self, o): return self._op(o, operator.add, "+", True)
    def __sub__(self, o): return self._op(o, operator.sub, "-")
    def __rsub__(self, o): return self._op(o, operator.sub, "-", True)
    def __mul__(self, o): return self._op(o, operator.mul, "*")
    def __rmul__(self, o): return self._op(o, operator.mul, "*", True)
    def __truediv__(self, o): return self._op(o, operator.truediv, "/")
    def __rtruediv__(self, o): return self._op(o, operator.truediv, "/", True)
    def __floordiv__(self, o): return self._op(o, operator.floordiv, "//")
    def __rfloordiv__(self, o): return self._op(o, operator.floordiv, "//", True)
    def __pow__(self, o): return self._op(o, operator.pow, "**")
    def __rpow__(self, o): return self._op(o, operator.pow, "**", True)

    def __neg__(self):
        c = self.compute
        compute, what = None if c is None else (lambda h: -c(h)), f"-{self.what}"
        return LazyScalar(self.ctx.once(what, compute, lambda: -self.tensor), compute, what, self.ctx)

    def __pos__(self):
        return self

    def __abs__(self):
        c = self.compute
        return LazyScalar(self.tensor.abs(), None if c is None else (lambda h: abs(c(h))), f"|{self.what}|",
                          self.ctx)

    # -------------------------------------------------------------- decisions
    def _decide(self, op, other, symbol: str):
        ca, cb = _compute(self), _compute(other)
        if ca is None or cb is None:
            raise DecidesOnDeviceValue(f"{self.what} {symbol} {_what(other)}")
        compute = lambda h: op(ca(h), cb(h))  # noqa: E731 - the guard's own function
        value = compute(self.ctx.hyper)
        self.ctx.guards.append(Guard(compute, value, f"{self.what} {symbol} {_what(other)}"))
        return value

    def __lt__(self, o): return self._decide(operator.lt, o, "<")
    def __le__(self, o): return self._decide(operator.le, o, "<=")
    def __gt__(self, o): return self._decide(operator.gt, o, ">")
    def __ge__(self, o): return self._decide(operator.ge, o, ">=")
    def __eq__(self, o): return self._decide(operator.eq, o, "==")
    def __ne__(self, o): return self._decide(operator.ne, o, "!=")
    __hash__ = None

    def _baked(self, cast, name: str):
        c = self.compute
        if c is None:
            raise DecidesOnDeviceValue(f"{name}({self.what})")
        value = cast(c(self.ctx.hyper))
        self.ctx.guards.append(Guard(lambda h: cast(c(h)), value, f"{name}({self.what})"))
        return value

    def __bool__(self): return self._baked(bool, "bool")
    def __float__(self): return self._baked(float, "float")
    def __int__(self): return self._baked(int, "int")
    def __index__(self): return self._baked(operator.index, "int")


class Scalars:
    """The ``LazyScalar``s of one traced step: the hyper-parameter values (by key) they are
    evaluated with on the host, and the guards the trace took."""

    def __init__(self, hyper: dict):
        self.hyper = hyper
        self.guards: list[Guard] = []
        self._known: dict[str, torch.Tensor] = {}

    def once(self, what: str, compute, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The graph value of expression ``what``: made once where the host knows it (``compute`` is
        not None; torch.optim computes the same expressions again for every parameter), else each time."""
        if compute is None:
            return make()
        if what not in self._known:
            self._known[what] = make()
        return self._known[what]

    def input(self, tensor: torch.Tensor, key: str) -> LazyScalar:
        """Hyper-parameter ``key`` as the graph input ``tensor`` (0-dim float64)."""
        return LazyScalar(tensor, lambda h: h[key], key, self)


def _tensor(x):
    return x.tensor if isinstance(x, LazyScalar) else x


def _compute(x) -> Callable[[dict], float] | None:
    if isinstance(x, LazyScalar):
        return x.compute
    return lambda h, x=x: x


def _what(x) -> str:
    return x.what if isinstance(x, LazyScalar) else repr(x)


def lazy_max(*args, **kwargs):
    """``max`` where a ``LazyScalar`` only the device knows may be an argument: ``torch.maximum``."""
    return _extreme(builtins.max, torch.maximum, args, kwargs)


def lazy_min(*args, **kwargs):
    """``min`` where a ``LazyScalar`` only the device knows may be an argument: ``torch.minimum``."""
    return _extreme(builtins.min, torch.minimum, args, kwargs)


def _extreme(python, torch_fn, args, kwargs):
    values = list(args[0]) if len(args) == 1 else list(args)
    device = [v for v in values if isinstance(v, LazyScalar) and v.compute is None]
    if not device or kwargs:
        return python(*args, **kwargs)
    out = values[0]
    for v in values[1:]:
        ctx = next(x.ctx for x in (out, v) if isinstance(x, LazyScalar))
        t = torch_fn(*(torch.as_tensor(_tensor(x), dtype=torch.float64) for x in (out, v)))
        out = LazyScalar(t, None, f"{python.__name__}({_what(out)}, {_what(v)})", ctx)
    return out


def lazy_sqrt(x):
    """``math.sqrt`` of a ``LazyScalar``: ``torch.sqrt`` (the same IEEE square root)."""
    if not isinstance(x, LazyScalar):
        return math.sqrt(x)
    c = x.compute
    return LazyScalar(torch.sqrt(x.tensor), None if c is None else (lambda h: math.sqrt(c(h))), f"sqrt({x.what})",
                      x.ctx)


# ---------------------------------------------------------------- torch functions


_ALPHA = ("add", "add_", "sub", "sub_")
_VALUE = ("addcmul", "addcmul_", "addcdiv", "addcdiv_")


def _name(func) -> str:
    return getattr(func, "__name__", "")


def _has_lazy(tree) -> bool:
    return any(isinstance(x, LazyScalar) for x in pytree.tree_leaves(tree))


class LazyMode(TorchFunctionMode):
    """While an optimizer's step is traced: ``Tensor.item()`` gives a ``LazyScalar`` of ``ctx``, and
    a torch function given one computes with its value as a tensor (module docstring)."""

    def __init__(self, ctx: Scalars):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.square_:  # functionalize refuses it (torch 2.13); pow_(2) is its kernel
            return args[0].pow_(2)
        if func is torch.Tensor.item:
            t = args[0]
            return LazyScalar(t.detach().to(torch.float64), None, f"item of {tuple(t.shape)} tensor", self.ctx)
        if not _has_lazy((args, kwargs)):
            return func(*args, **kwargs)
        return _with_scalars(func, args, kwargs, self.ctx)


def _with_scalars(func, args: tuple, kwargs: dict, ctx: Scalars):
    """``func(*args, **kwargs)`` where some arguments are ``LazyScalar``s (module docstring)."""
    name = _name(func)
    if func in (torch.as_tensor, torch.tensor, torch.scalar_tensor):
        t = args[0].tensor
        return t.to(kwargs.get("dtype") or torch.get_default_dtype())
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if not tensors:  # a function of scalars alone (torch.sqrt(lazy)): a scalar again
        out = func(*pytree.tree_map(_tensor, args), **pytree.tree_map(_tensor, kwargs))
        return LazyScalar(out.to(torch.float64), None, f"{name}(...)", ctx) if out.dim() == 0 else out
    self_ = tensors[0]
    math_dtype = torch.float32 if self_.dtype in LOW_PRECISION else self_.dtype
    if name in _ALPHA and "alpha" in kwargs and isinstance(args[1], torch.Tensor):
        # add(x, y, alpha=a): the kernel's fused x + a * y (one rounding) is addcmul's with value 1; a
        # low-precision kernel rounds alpha to the tensor's dtype first, then computes in float32
        alpha = _as(kwargs.pop("alpha"), self_.dtype).to(math_dtype)
        alpha = alpha if name.startswith("add") else -alpha
        return _fused("addcmul", name, args[0], args[1].to(math_dtype), alpha, math_dtype)
    if name in _VALUE and "value" in kwargs:
        # addcmul / addcdiv(x, t1, t2, value=v) = x + (v * t1) [*/] t2: the same kernel with v * t1 and value 1
        value = _as(kwargs.pop("value"), math_dtype)
        t1, t2 = (_as(a, math_dtype) for a in args[1:3])
        return _fused(name.rstrip("_"), name, args[0], value * t1, t2, math_dtype)
    # Any other operator: the scalar as a tensor of the math type; low precision computed in float32
    # and rounded once, as the kernel does with a Python scalar. An argument that takes only a
    # number (addmm's beta and alpha) gets the number itself, kept as a guard (``_numbers``).
    try:
        return _as_tensors(func, name, self_, args, kwargs)
    except DataDependentOutputException:
        return func(*_numbers(args), **_numbers(kwargs))


def _as_tensors(func, name: str, self_: torch.Tensor, args: tuple, kwargs: dict):
    low = self_.dtype in LOW_PRECISION
    math_dtype = torch.float32 if low else self_.dtype
    conv = (lambda x: _as(x, math_dtype)) if low else (lambda x: _as(x, self_.dtype) if isinstance(x, LazyScalar)
                                                       else x)
    new_args, new_kwargs = pytree.tree_map(conv, (args, kwargs))
    if not low:
        return func(*new_args, **new_kwargs)
    inplace = name.endswith("_") and not name.endswith("__")
    if inplace:
        out = getattr(torch.Tensor, name[:-1])(*new_args, **new_kwargs)
        return args[0].copy_(out.to(args[0].dtype))
    out = func(*new_args, **new_kwargs)
    return out.to(self_.dtype) if isinstance(out, torch.Tensor) and out.is_floating_point() else out


def _numbers(tree):
    """``tree`` with every ``LazyScalar`` as the Python float it is now (a guard keeps it)."""
    return pytree.tree_map(lambda x: float(x) if isinstance(x, LazyScalar) else x, tree)


def _as(x, dtype: torch.dtype):
    """``x`` (a ``LazyScalar``, tensor or number) as a tensor of ``dtype``; a number stays a number."""
    if isinstance(x, LazyScalar):
        return x.ctx.once(f"{x.what} as {dtype}", x.compute, lambda: x.tensor.to(dtype))
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x


def _fused(fused: str, name: str, target: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, math_dtype):
    """``target + t1 * t2`` (``fused``: 'addcmul') or ``target + t1 / t2`` ('addcdiv') by that kernel with
    value 1, in place for an in-place ``name``; low precision computed in ``math_dtype`` (float32) and
    rounded once into the tensor's dtype."""
    inplace = name.endswith("_")
    if target.dtype == math_dtype:
        return getattr(target, f"{fused}_")(t1, t2, value=1) if inplace else getattr(torch, fused)(target, t1, t2,
                                                                                                 value=1)
    result = getattr(torch, fused)(target.to(math_dtype), t1, t2, value=1).to(target.dtype)
    return target.copy_(result) if inplace else result


@contextlib.contextmanager
def patched(namespaces: list[dict]) -> Iterator[None]:
    """``min``, ``max`` and ``math.sqrt`` made ``LazyScalar``-aware in ``namespaces`` (the global
    namespaces of an optimizer's code) while tracing."""
    saved = []
    shim = type("math", (), {**{k: getattr(math, k) for k in dir(math) if not k.startswith("_")},
                             "sqrt": staticmethod(lazy_sqrt)})
    for space in namespaces:
        for name, value in (("max", lazy_max), ("min", lazy_min), ("math", shim)):
            if name == "math" and space.get("math") is not math:
                continue
            saved.append((space, name, space.get(name, _MISSING)))
            space[name] = value
    try:
        yield
    finally:
        for space, name, value in reversed(saved):
            if value is _MISSING:
                del space[name]
            else:
                space[name] = value


_MISSING = object()
