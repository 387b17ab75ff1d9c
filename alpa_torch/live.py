"""The user's model and optimizer objects stay the trained ones between parallel steps.

A parallel step trains the state on its workers. Left alone, the model object the user
passed in would keep its initial weights: an evaluation, a checkpoint, ``generate`` or an
EMA of the weights between steps would read them silently. DDP and FSDP users never meet
this, because the module they pass in is the module that trains. So ``LiveState`` makes
the objects follow the workers:

- **Reads fetch once.** Every module of the model and the optimizer get a subclass of
  their own class (as FSDP2's ``fully_shard`` does): the methods and attributes that reach
  the values (calling the module, ``__getattr__`` for parameters, buffers and submodules,
  ``parameters()`` / ``named_parameters()`` / ``buffers()``, ``state_dict()``, ``_apply``
  (``.to()``, ``.float()``), pickling and ``copy.deepcopy``, the optimizer's ``state`` and
  ``state_dict()``) first bring the state the workers hold into the objects, if a step has
  run since the last time: one gather of the model's state, one of the optimizer's, not one
  transfer per parameter. A loop that never reads pays a flag per step. Pickles and deep
  copies are of the original classes.
- **Writes reach the workers.** Whatever was read may have been written (``p.data.copy_``,
  ``load_state_dict``, an EMA written back, a re-initialised head, ``requires_grad_``).
  The next step call compares what the objects hold with a checksum taken when the values
  came from the workers and sends the tensors that changed; a change of structure (other
  parameter objects, shapes, dtypes, ``requires_grad``) or of a module's train / eval
  mode is reported for the step to capture again (``Changes``).
- **Where the state must not come to the driver** (a model built under
  ``alpa_torch.empty_weights()``, or more state than ``limit_bytes``), a read raises
  ``StateOnWorkersError`` naming what to use instead, before anything is returned.

Not followed: a tensor reference taken before a step (``w = model.fc.weight`` kept
across steps, or the tensors in ``optimizer.param_groups``) is the object a later read
refreshes, but reading it without going through the model or the optimizer reads what it
held when it was last refreshed; and gradients stay on the workers (``.grad`` is not
part of the state a step leaves). The optimizer's ``param_groups`` (learning rates and
the other hyper-parameters) are the user's own: the step reads them on every call.

This module knows nothing of Ray or plans: ``api.ParallelStep`` gives it the functions
that fetch and send state.
"""

from __future__ import annotations

import contextlib
import copyreg
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from alpa_torch.core.errors import StateOnWorkersError

PARTS = ("model", "optimizer")


def checksum(t: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (any dtype, any layout)."""
    data = t.detach()
    if data.is_meta:
        return 0
    data = data.to("cpu").contiguous().reshape(-1)
    return zlib.crc32(memoryview(data.view(torch.uint8).numpy()))


@dataclass(frozen=True, slots=True)
class Changes:
    """What the user changed in the objects since the workers' state was last the objects' state."""

    values: dict[str, torch.Tensor] = field(default_factory=dict)
    """State name -> the tensor the objects now hold (its values differ from the workers')."""
    recapture: str | None = None
    """Why the step must be captured again (mode, structure), or None."""


class LiveState:
    """Keeps one model and its optimizer(s) in step with the workers (module docstring).

    ``fetch(part)``: bring ``part``'s state ('model' or 'optimizer') from the workers into the
    objects; ``tensors(part)``: state name -> the tensor the objects hold now; ``size_bytes(part)``:
    the bytes a fetch of ``part`` moves; ``limit_bytes()``: the most a read may bring now."""

    def __init__(self, model: torch.nn.Module, optimizers: tuple, *, fetch: Callable[[str], None],
                 tensors: Callable[[str], Mapping[str, torch.Tensor]], size_bytes: Callable[[str], int],
                 limit_bytes: Callable[[], float]):
        self.model, self.optimizers = model, optimizers
        self._fetch, self._tensors, self._size_bytes = fetch, tensors, size_bytes
        self.limit_bytes = limit_bytes
        self._internal = 0
        self.stale = dict.fromkeys(PARTS, False)
        """Per part: a step ran since the objects last held the workers' state."""
        self.touched = False
        """Some read or write reached the objects since the last step call."""
        self.closed: str | None = None
        """Why the workers' state can no longer come (the step was shut down), or None."""
        self._sums: dict[str, tuple[int, int]] = {}
        """State name -> (id of the tensor, checksum) the workers hold the same values as."""
        self._structure = self._structure_now()
        self._modes = self._modes_now()
        self._classes: dict[type, type] = {}
        objects = [*model.modules(), *optimizers]
        watched = (_WatchedModule, _WatchedOptimizer)
        for earlier in {type(obj)._alpa_live for obj in objects if isinstance(obj, watched)}:
            earlier.detach()  # an earlier step's: this one follows the objects now
        for obj in objects:
            obj.__class__ = self._watched(type(obj))

    # ---------------------------------------------------------------- the step's side
    @contextlib.contextmanager
    def internal(self) -> Iterator[None]:
        """alpa-torch's own use of the objects (capture, loading, fetching): no hook fires."""
        self._internal += 1
        try:
            yield
        finally:
            self._internal -= 1

    def after_step(self) -> None:
        """A step changed the workers' state: the objects are behind until the next read."""
        self.stale = dict.fromkeys(PARTS, True)

    def changes(self, values_only: bool = False) -> Changes:
        """What the user changed since the objects last matched the workers (``Changes``); the
        caller sends ``values`` to the workers (then calls ``sent``) or captures again.
        ``values_only``: the changed values alone, the rest left for the next step to see (an
        evaluation runs in whatever mode the model is in)."""
        if not self.touched:
            return Changes()
        with self.internal():
            if values_only:
                return Changes(values=self._changed_values())
            self.touched = False
            modes = self._modes_now()
            if modes != self._modes:
                name, (_, now) = next(iter(_diff(self._modes, modes)))
                return Changes(recapture=f"{'model.' + name if name else 'the model'} is in "
                                         f"{'train' if now else 'eval'} mode, not the mode the step was captured in")
            structure = self._structure_now()
            if structure != self._structure:
                name, (was, now) = next(iter(_diff(self._structure, structure)))
                return Changes(recapture=f"{name} changed: {_what_changed(was, now)}")
            return Changes(values=self._changed_values())

    def _changed_values(self) -> dict[str, torch.Tensor]:
        changed = {}
        for part in PARTS:
            if self.stale[part]:
                continue  # the user never read it since the last step: it is the workers' state
            for name, t in self._tensors(part).items():
                if self._sums.get(name) != (id(t), checksum(t)):
                    changed[name] = t
        return changed

    def sent(self, names) -> None:
        """The workers now hold what the objects hold for ``names``."""
        with self.internal():
            for part in PARTS:
                tensors = self._tensors(part)
                for name in names:
                    if name in tensors:
                        self._sums[name] = (id(tensors[name]), checksum(tensors[name]))

    def recaptured(self) -> None:
        """The step was captured again from the objects as they are: their structure, modes and
        values are the step's (the caller loaded the values it keeps)."""
        self._structure, self._modes = self._structure_now(), self._modes_now()
        self.touched = False

    def fetched(self, part: str) -> None:
        """``part`` was brought from the workers (by the caller, e.g. ``step.sync``)."""
        self.stale[part] = False
        self._structure = self._structure_now()
        self._note_values((part,))

    def close(self, why: str) -> None:
        """The workers' state is gone (``why``): reads of a part that is behind raise from now on."""
        self.closed = why

    def detach(self) -> None:
        """Give every object its own class back; the objects are plain again."""
        originals = {watched: cls for cls, watched in self._classes.items()}
        for obj in [*self.model.modules(), *self.optimizers]:
            obj.__class__ = originals.get(type(obj), type(obj))

    # ---------------------------------------------------------------- the user's side
    def read(self, part: str) -> None:
        """A hooked method of ``part`` is about to run for the user (module docstring)."""
        if self._internal:
            return
        self.touched = True
        if not self.stale[part]:
            return
        if self.closed is not None:
            raise StateOnWorkersError(
                f"the {part}'s trained state was on the workers of a parallel step that is gone ({self.closed}), "
                "so this object still holds what it held before those steps. Fix: call step.sync(model, optimizer) "
                "or step.save(dir) before step.shutdown(), or load a checkpoint with alpa_torch.load_into")
        size = self._size_bytes(part)
        with self.internal():
            meta = [n for n, t in self._tensors(part).items() if t.is_meta]
            if part == "optimizer":  # its state belongs to parameters that have no memory either
                meta += [n for n, t in self.model.named_parameters() if t.is_meta][:1]
        if meta:
            raise StateOnWorkersError(
                f"the {part} was built without memory (alpa_torch.empty_weights(): {meta[0]} is on the meta device), "
                f"so its trained state lives only on the workers and a read cannot see it. Fix: step.save(dir) or "
                "step.save_pretrained(dir) to write it, step.evaluate(fn) to run a function of the model on the "
                "workers, or step.sync(model, optimizer) to give the model memory and copy the state into it")
        limit = self.limit_bytes()
        if size > limit:
            raise StateOnWorkersError(
                f"reading the {part} after a parallel step brings its trained state ({size / 2**30:.2f} GiB) to this "
                f"process, more than the limit of {limit / 2**30:.2f} GiB (parallelize's "
                "driver_state_limit_bytes). Fix: step.save(dir) / step.save_pretrained(dir) to write it, "
                "step.evaluate(fn) to run a function of the model on the workers, or raise the limit")
        with self.internal():
            self._fetch(part)
        self.fetched(part)

    # ---------------------------------------------------------------- helpers
    def _note_values(self, parts) -> None:
        with self.internal():
            for part in parts:
                for name, t in self._tensors(part).items():
                    self._sums[name] = (id(t), checksum(t))

    def _structure_now(self) -> dict:
        with self.internal():
            out = {f"model.{name}": (id(t), tuple(t.shape), t.dtype, t.requires_grad)
                   for name, t in self.model.named_parameters()}
            out.update((f"model.{name}", (id(t), tuple(t.shape), t.dtype)) for name, t in self.model.named_buffers())
            for k, opt in enumerate(self.optimizers):
                out[f"optimizer {k}"] = tuple(tuple(id(p) for p in g["params"]) for g in opt.param_groups)
            return out

    def _modes_now(self) -> dict[str, bool]:
        with self.internal():
            return {name: m.training for name, m in self.model.named_modules()}

    def _watched(self, cls: type) -> type:
        """``cls`` with the hooks of the module docstring (one subclass per class, made once)."""
        if cls not in self._classes:
            mixin = _WatchedOptimizer if issubclass(cls, torch.optim.Optimizer) else _WatchedModule
            self._classes[cls] = type(cls.__name__, (mixin, cls), {
                "__module__": cls.__module__, "__qualname__": cls.__qualname__, "_alpa_live": self,
                "_alpa_class": cls})
        return self._classes[cls]


_FACETS = ("tensor object", "shape", "dtype", "requires_grad")


def _what_changed(was: tuple | None, now: tuple | None) -> str:
    """In words, what differs between two ``_structure_now`` entries."""
    if was is None or now is None:
        return "added" if was is None else "removed"
    if was and isinstance(was[0], tuple):  # an optimizer's groups of parameter objects
        return "its parameter groups hold other parameters"
    return ", ".join(f"{facet} {a!r} -> {b!r}" if facet != "tensor object" else "another tensor object"
                     for facet, a, b in zip(_FACETS, was, now) if a != b)


def _diff(before: dict, after: dict):
    """(key, (before, after)) for every key whose value differs (missing: None)."""
    for key in list(before) + [k for k in after if k not in before]:
        if before.get(key) != after.get(key):
            yield key, (before.get(key), after.get(key))


def _as_original(obj, reduced):
    """``reduced`` (what ``__reduce_ex__`` gave for ``obj``) naming the object's own class, not its
    watched subclass: a pickle or deep copy of a watched object is a plain object of the user's class."""
    if isinstance(reduced, tuple) and reduced[0] is copyreg.__newobj__ and reduced[1] == (type(obj),):
        # pickle insists that __newobj__ name the object's own class; copyreg's reconstructor (what
        # protocols 0 and 1 use) makes the same empty object of any class, and loads without alpa-torch
        reduced = (copyreg._reconstructor, (type(obj)._alpa_class, object, None), *reduced[2:])
    return reduced


class _WatchedModule(torch.nn.Module):
    """The hooks of a module (module docstring). ``_alpa_live`` and ``_alpa_class`` are set per subclass."""

    _alpa_live: LiveState
    _alpa_class: type

    def __getattr__(self, name: str):
        type(self)._alpa_live.read("model")
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        type(self)._alpa_live.read("model")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        type(self)._alpa_live.read("model")
        super().__delattr__(name)

    def __call__(self, *args, **kwargs):
        type(self)._alpa_live.read("model")
        return super().__call__(*args, **kwargs)

    def parameters(self, *args, **kwargs):
        type(self)._alpa_live.read("model")
        return super().parameters(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        type(self)._alpa_live.read("model")
        return super().named_parameters(*args, **kwargs)

    def buffers(self, *args, **kwargs):
        type(self)._alpa_live.read("model")
        return super().buffers(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        type(self)._alpa_live.read("model")
        return super().named_buffers(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        type(self)._alpa_live.read("model")
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        type(self)._alpa_live.read("model")
        return super().load_state_dict(*args, **kwargs)

    def _apply(self, *args, **kwargs):
        type(self)._alpa_live.read("model")
        return super()._apply(*args, **kwargs)

    def train(self, mode: bool = True):
        type(self)._alpa_live.read("model")
        return super().train(mode)

    def __reduce_ex__(self, protocol: int):
        type(self)._alpa_live.read("model")
        return _as_original(self, super().__reduce_ex__(protocol))


class _WatchedOptimizer(torch.optim.Optimizer):
    """The hooks of an optimizer (module docstring): its ``state`` is read through a property."""

    _alpa_live: LiveState
    _alpa_class: type

    @property
    def state(self):
        type(self)._alpa_live.read("optimizer")
        return self.__dict__["state"]

    @state.setter
    def state(self, value) -> None:
        type(self)._alpa_live.read("optimizer")
        self.__dict__["state"] = value

    def state_dict(self, *args, **kwargs):
        type(self)._alpa_live.read("optimizer")
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        type(self)._alpa_live.read("optimizer")
        return super().load_state_dict(*args, **kwargs)

    def add_param_group(self, *args, **kwargs):
        type(self)._alpa_live.read("optimizer")
        return super().add_param_group(*args, **kwargs)

    def __getstate__(self):
        type(self)._alpa_live.read("optimizer")
        return super().__getstate__()

    def __reduce_ex__(self, protocol: int):
        type(self)._alpa_live.read("optimizer")
        return _as_original(self, super().__reduce_ex__(protocol))
