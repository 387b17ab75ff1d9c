"""What the workers start from: where each tensor of the state comes from, decided on the driver.

The driver never holds a full tensor it does not already have. For each parameter,
buffer and optimizer state of the step (``OpGraph.inputs``) it picks one source
(``runtime.state_sources``), and each worker then reads only the slices it holds:

- a weight the user's model holds (materialised): its value, sent by the driver;
- a weight on the meta device: from ``weights`` (a directory of safetensors files,
  Hugging Face's layout) when it is there, else initialised on the workers, module by
  module, with ``init_fn(module)`` or the module's ``reset_parameters()``, seeded so
  that the values equal ``alpa_torch.init_weights(model, init_fn)`` on one device;
- optimizer state: the user's optimizer's if it has some, else what a fresh ``torch.optim``
  optimizer starts with (zeros, ``lr``, a step count of 0: ``optim.StateEntry.fill``) made on
  the workers, for any model;
- a checkpoint (``ParallelStep.load``): its tiles, read by the workers (the driver
  reads the manifest only).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from alpa_torch.core.errors import CheckpointError, PlanError
from alpa_torch.core.graph import OpGraph
from runtime import state_sources
from runtime.state_sources import (
    CheckpointTiles,
    Filled,
    ModuleInit,
    SafetensorsWeights,
    Values,
    materialise_module,
    owners,
    uninitialisable,
)
from runtime.wire import to_wire_dict

from .optim import LossScaler, OptimizerSet

log = logging.getLogger(__name__)

STATE_KINDS = ("param", "buffer", "opt_state")


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build a model whose parameters are on the meta device (no memory, no initialisation run)
    while its buffers keep the values ``__init__`` computes (causal masks, rotary tables)::

        with alpa_torch.empty_weights():
            model = GPT(config)

    Each parameter is allocated (never touched, so it takes no memory) and replaced by a meta
    tensor as the module registers it, before the module's own initialisation runs."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def model_sources(graph: OpGraph, model: torch.nn.Module, functional: OptimizerSet | None, *, seed: int,
                  init_fn=None, weights: str | Path | None = None) -> list:
    """The sources of the step's initial state (the first source that has a name gives it):
    ``weights``' files, the values the driver holds, zeros, the initialisation on the workers."""
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    values, fills = {}, {}
    meta = [n for kind in ("param", "buffer") for n in graph.input_names(kind) if tensors[n].is_meta]
    for n, t in tensors.items():
        if not t.is_meta:
            values[n] = t.detach()
    for name in functional.names if functional is not None else ():  # initial_state's rule, fills made on workers
        user = functional.user_state(name)
        for entry in functional.layout.get(name, ()):
            key, value = entry.key, user.get(entry.key)
            if value is None:
                fills[f"{name}.{key}"] = entry.fill
            elif value.is_meta:
                raise PlanError(f"the optimizer's state {key!r} of {name} is on the meta device: it holds no values. "
                                "Fix: create the optimizer fresh (its state then starts at zero on the workers), or "
                                "load its state with step.load(checkpoint)")
            else:
                values[f"{name}.{key}"] = value.detach()
    if functional is not None and functional.device_step:  # fp16 loss scaling state
        values.update(LossScaler.initial_state())
    sources: list = []
    if weights is not None:  # first: the files' weights win over the model's own values
        sources.append(weights_source(graph, weights))
        meta = [n for n in meta if n not in sources[0].names]
        values = {k: v for k, v in values.items() if k not in sources[0].names}
    sources.append(Values(to_wire_dict(values)))
    if fills:
        sources.append(Filled(fills))
    if meta:
        missing = uninitialisable(model, meta, init_fn)
        if missing:
            lack = " and the weights lack them" if weights else ""
            raise PlanError(
                f"{len(missing)} tensor(s) of the model are on the meta device and nothing gives their values: "
                f"{missing[:5]} (their modules have no reset_parameters{lack}). "
                "Fix: pass parallelize(..., init_fn=fn) where fn(module) initialises a module's own parameters and "
                "buffers (Hugging Face: init_fn=model._init_weights), or weights=<directory of safetensors files>")
        check_buffers_set(model, meta, init_fn, seed)
        sources.append(ModuleInit(model, init_fn, seed, meta))
        log.info("%d tensor(s) of the meta-device model are initialised on the workers", len(meta))
    return sources


def give_storage(model: torch.nn.Module, optimizers: tuple, functional: OptimizerSet) -> None:
    """Give a model built on the meta device storage before state is copied into it: its meta
    parameters become new ``Parameter`` objects, which ``optimizers`` and ``functional`` then hold."""
    replaced = state_sources.give_storage(model)
    if not replaced:
        return
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [replaced.get(id(p), p) for p in group["params"]]
    functional.param_of = {n: replaced.get(id(p), p) for n, p in functional.param_of.items()}


def check_buffers_set(model: torch.nn.Module, names: list[str], init_fn, seed: int) -> None:
    """Initialise, on a copy, each module owning some of ``names`` whose own meta tensors are all
    buffers (small: masks, rotary tables), so that a buffer the initialisation does not set (one
    computed in ``__init__``, lost on the meta device) is named here, before any worker starts."""
    own = owners(model)
    modules = dict(model.named_modules())
    for owner in sorted({own[n] for n in names}):
        module = modules[owner]
        if module._buffers and not any(p is not None and p.is_meta for p in module._parameters.values()):
            materialise_module(copy.deepcopy(module), owner, init_fn, seed)


def weights_source(graph: OpGraph, directory: str | Path) -> SafetensorsWeights:
    """The safetensors weights in ``directory`` that are state of ``graph``, checked against its shapes."""
    source, found = SafetensorsWeights.scan(directory)
    want = {s.name: tuple(s.shape) for s in graph.inputs if s.kind in ("param", "buffer")}
    differ = [(k, found[k][0], want[k]) for k in sorted(set(found) & set(want)) if found[k][0] != want[k]]
    if differ:
        raise CheckpointError(f"the weights in {str(directory)!r} do not fit the model: {differ[:3]} (name, shape in "
                              "the files, shape in the model). Fix: build the model with the configuration the "
                              "weights were saved from")
    unused = sorted(set(found) - set(want))
    if unused:
        log.warning("%d tensor(s) in %s are not in the model and are ignored: %s", len(unused), directory, unused[:5])
    return SafetensorsWeights(source.directory, {k: f for k, f in source.file_of.items() if k in want})


def checkpoint_source(graph: OpGraph, path: Path, manifest: dict) -> CheckpointTiles:
    """The checkpoint's tiles, after checking (in the manifest) that they are exactly ``graph``'s state."""
    want = {s.name: (s.kind, list(s.shape), s.dtype) for s in graph.inputs if s.kind in STATE_KINDS}
    have = {n: (e["kind"], e["shape"], e["dtype"]) for n, e in manifest["tensors"].items()}
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    differ = sorted(n for n in set(want) & set(have) if want[n] != have[n])
    if missing or unexpected or differ:
        raise CheckpointError(
            f"the checkpoint at {str(path)!r} does not hold this step's state: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, other kind/shape/dtype {[(n, have[n], want[n]) for n in differ[:3]]}."
            " Fix: load it with the model and optimizer type it was saved from.")
    return CheckpointTiles(path, manifest)
