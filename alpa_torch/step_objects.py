"""The user's model and optimizer objects and the trained state of a ``ParallelStep``.

``StepObjects`` is the part of ``alpa_torch.api.ParallelStep`` that deals with the objects the
user trains and the state the workers hold for them: what the user changed in the model or
optimizer between steps is sent to the workers, a read of them brings the trained state back
(``live.py`` decides when), and the whole state is handed out on request (``state_dict``,
``save_pretrained``, ``sync``). It reads what ``ParallelStep`` sets up: ``engine``, ``graph``,
``_live``, ``_functional``, ``_trains``, ``_closed``, ``_step``, ``_seed``, ``precision``,
``init_fn``, ``weights`` and ``driver_state_limit_bytes``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os

import torch

from alpa_torch.core.errors import PlanError, StepUsageError
from runtime.state_sources import Values
from runtime.wire import from_wire, to_wire_dict

from .capture import optimizers_of
from .initial_state import give_storage, model_sources
from .live import PARTS
from .optim import OptimizerSet

log = logging.getLogger(__name__)


class StepObjects:
    """The model and optimizer objects' side of a parallel step (module docstring)."""

    def _check_open(self) -> None:
        if self._closed:
            raise StepUsageError(
                "this parallel step was shut down (step.shutdown()): its workers and the state they trained are "
                "gone. Fix: create a new step with parallelize(...); to keep trained state, call "
                "step.sync(model, optimizer) or step.save(dir) before shutdown()")

    def _optimizer_set(self, model, optimizer) -> OptimizerSet:
        """The user's optimizer(s) as the step runs them (``steps_taken``: what the workers have done)."""
        return OptimizerSet(optimizers_of(optimizer), {id(p): n for n, p in model.named_parameters()},
                            device_step=self.precision == "fp16", steps_taken=self._step)

    def _initial_state(self, model) -> list:
        """Where the workers get the model's and optimizer's state (``alpa_torch.initial_state``)."""
        return model_sources(self.graph, model, self._functional, seed=self._seed, init_fn=self.init_fn,
                             weights=self.weights)

    def _own_use(self):
        """alpa-torch's own reads and writes of the model and optimizer objects (``alpa_torch.live``)."""
        return self._live.internal() if self._live is not None else contextlib.nullcontext()

    def _user_changes(self) -> str | None:
        """Send the tensors the user changed in the model or optimizer since the last step to the
        workers; a change that needs the step captured again, in words (``alpa_torch.live``)."""
        changes = self._live.changes()
        if changes.recapture is None:
            self._send(changes.values)
        return changes.recapture

    def _push_user_values(self) -> None:
        """Send the values the user changed since the last step (before an evaluation reads them)."""
        self._send(self._live.changes(values_only=True).values)

    def _send(self, values: dict[str, torch.Tensor]) -> None:
        if values:
            log.info("sending %d tensor(s) changed in the model or optimizer since the last step to the workers",
                     len(values))
            self.engine.load([Values(to_wire_dict(values))])
            self._live.sent(values)

    def _part_names(self, part: str, graph=None) -> list[str]:
        """The state names of ``part`` ('model': parameters and buffers; 'optimizer': its state)."""
        graph = graph or self.graph
        kinds = ("param", "buffer") if part == "model" else ("opt_state",)
        return [s.name for s in graph.inputs if s.kind in kinds]

    def _part_bytes(self, part: str) -> int:
        names = set(self._part_names(part))
        return sum(s.nbytes for s in self.graph.inputs if s.name in names)

    def _limit_bytes(self) -> float:
        if self.driver_state_limit_bytes is not None:
            return float(self.driver_state_limit_bytes)
        try:
            return 0.5 * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # no such counter on this system
            return math.inf

    def _object_tensors(self, part: str) -> dict[str, torch.Tensor]:
        """State name -> the tensor the user's objects hold for it now."""
        if part == "optimizer":
            return self._functional.state_tensors()
        model, names = self._trains[0](), set(self._part_names("model"))
        return {n: t for n, t in [*model.named_parameters(), *model.named_buffers()] if n in names}

    def _fetch(self, part: str) -> None:
        """Bring ``part``'s state from the workers into the user's objects (one gather)."""
        full = {k: from_wire(v) for k, v in self.engine.gather_state(self._part_names(part)).items()}
        if part == "model":
            self._write_model(self._trains[0](), full)
        else:
            self._write_optimizer(full)

    def _write_model(self, model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                if name in full:  # else a buffer the step never reads (HF's original_inv_freq):
                    t.copy_(full[name])  # no stage holds it, and the step left it as it was

    def _write_optimizer(self, full: dict[str, torch.Tensor]) -> None:
        self._functional.write_back(full, trained=set(self.graph.grad_of))

    def _check_same_objects(self, model, optimizer) -> None:
        model_ref, optimizer_refs = self._trains
        opts = optimizers_of(optimizer)
        pairs = [("model", model, model_ref)] + [("optimizer", o, r) for o, r in zip(opts, optimizer_refs)]
        if len(opts) != len(optimizer_refs):
            pairs.append(("optimizer", optimizer, lambda: None))
        for what, obj, ref in pairs:
            if obj is not ref():
                raise StepUsageError(
                    f"this parallel step trains the {what} of its first call (its live state is on the workers) "
                    f"and was called with another {what} object ({type(obj).__name__}). Fix: call it with the same "
                    f"{what}; for another model, create a new step with parallelize(...) (call "
                    "step.sync(model, optimizer) first to keep what this one trained)")

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Full model and optimizer state, gathered from the workers."""
        self._check_open()
        if self.engine is None:
            raise PlanError("the step has not run yet: call it once before asking for its state")
        full = {k: from_wire(v) for k, v in self.engine.gather_state().items()}
        model_keys = set(self.graph.input_names("param")) | set(self.graph.input_names("buffer"))
        return {
            "model": {k: v for k, v in full.items() if k in model_keys},
            "optimizer": {k: v for k, v in full.items() if k not in model_keys},
            "step": self._step,
        }

    def save_pretrained(self, directory: str) -> str:
        """The model's trained weights in Hugging Face's layout, written by the workers (each
        tensor gathered whole on one device of its stage, none through the driver): files
        ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` in
        ``directory``. The keys are the model's ``state_dict()`` keys (tied weights once,
        non-persistent buffers left out), so ``parallelize(..., weights=directory)`` and
        transformers' ``from_pretrained`` (with the model's ``config.json`` beside) read them.
        Returns the directory's absolute path."""
        self._check_open()
        if self.engine is None:
            raise PlanError("the step has not run yet: call it once before save_pretrained()")
        model = self._trains[0]()
        with self._own_use():
            keys = set(model.state_dict()) if model is not None else None
        names = [s.name for s in self.graph.inputs
                 if s.kind in ("param", "buffer") and (keys is None or s.name in keys)]
        path = os.path.abspath(directory)
        os.makedirs(path, exist_ok=True)
        weight_map = self.engine.export_weights(path, names)
        total = sum(s.nbytes for s in self.graph.inputs if s.name in weight_map)
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        return path

    def sync(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Copy the trained state into ``model`` (and ``optimizer``), as eager training would leave them.
        A read of the model or optimizer after a step does this by itself (``alpa_torch.live``); ``sync``
        also gives a model built on the meta device memory (new parameter objects, which the
        optimizer then holds)."""
        with self._own_use():
            sd = self.state_dict()
            give_storage(model, optimizers_of(optimizer) if optimizer is not None else self._functional.optimizers,
                         self._functional)  # a meta-device model
            self._write_model(model, sd["model"])
            if optimizer is not None:
                self._functional.write_back(sd["optimizer"], trained=set(self.graph.grad_of),
                                            into=optimizers_of(optimizer))
        if self._live is not None and model is self._live.model:
            for part in PARTS if optimizer is not None else ("model",):
                self._live.fetched(part)


__all__ = ["StepObjects"]
