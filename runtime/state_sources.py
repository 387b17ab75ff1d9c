"""Where a worker gets its shards of the state: each worker reads only the slices it holds.

A *source* answers ``read(name, box, dtype)``: the box ``[[start, stop], ...]`` of the
full tensor ``name`` (one pair per dim, the device's local shard under the plan:
DTensor's ``compute_local_shape_and_global_offset``), as a CPU tensor of ``dtype``.
Sources are plain picklable objects the driver builds from manifests and headers
only; the workers open the files or run the initialisation (``StageRunner.load_from``).

- ``Values``: full tensors the driver holds (a materialised model, small state);
- ``Filled``: a fresh optimizer's state, each tensor one value (``torch.optim`` starts its
  moments at zero, a step count at 0, Adagrad's sum at its initial value);
- ``CheckpointTiles``: an alpa-torch checkpoint (``checkpoint.py``): the tiles that
  overlap the box, from whichever plan wrote them;
- ``SafetensorsWeights``: a Hugging Face weights directory (``model.safetensors``, or
  ``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``), read
  with ``safe_open(...).get_slice``;
- ``ModuleInit``: a model built on the meta device, initialised module by module
  (``init_module``); a worker materialises only the modules owning the tensors it
  holds, one at a time, and keeps its slices. ``init_weights`` is the same
  initialisation of the whole model on one device: the reference it equals.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch
from ray import cloudpickle

from alpa_torch.core.errors import CheckpointError, PlanError

from .checkpoint import DTYPES, Box, local_box, open_checked
from .wire import from_wire

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


class Values:
    """Full tensors sent by the driver (wire arrays)."""

    def __init__(self, values: dict[str, Any]):
        self.values = values
        self.names = frozenset(values)

    def only(self, names) -> Values:
        """The values of ``names`` (what one stage needs: the rest is not sent to its devices)."""
        return Values({k: v for k, v in self.values.items() if k in names})

    def read(self, name: str, box: Box, dtype: torch.dtype) -> torch.Tensor:
        full = from_wire(self.values[name])
        part = full[_slices(box)].to(dtype)
        return part if part.numel() == full.numel() else part.clone()  # a view would keep the whole alive


class Filled:
    """State whose every element starts at one value (a fresh optimizer's: zero moments, ``lr``, a step
    count of 0): name -> value."""

    def __init__(self, fills: dict[str, float]):
        self.fills = dict(fills)
        self.names = frozenset(fills)

    def read(self, name: str, box: Box, dtype: torch.dtype) -> torch.Tensor:
        return torch.full(_shape(box), self.fills[name], dtype=dtype)


class CheckpointTiles:
    """The state of an alpa-torch checkpoint, read tile by tile (``checkpoint.py``)."""

    def __init__(self, path: Path, manifest: dict):
        self.path = Path(path)
        self.files = manifest["files"]
        self.names = frozenset(manifest["tensors"])
        self._open: dict[str, Any] = {}

    def __getstate__(self):
        return {"path": self.path, "files": self.files, "names": self.names, "_open": {}}

    def read(self, name: str, box: Box, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(_shape(box), dtype=dtype)
        covered = 0
        for entry in self.files:
            tile = entry["tiles"].get(name)
            overlap = None if tile is None else [[max(a, c), min(b, d)] for (a, b), (c, d) in zip(box, tile)]
            if overlap is None or any(a >= b for a, b in overlap):
                continue
            f = self._file(entry)
            part = f.get_slice(name)[tuple(slice(a - t0, b - t0) for (a, b), (t0, _) in zip(overlap, tile))]
            out[tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(overlap, box))] = part.to(dtype)
            covered += part.numel()
        if covered != out.numel():
            raise CheckpointError(f"{name!r}: {out.numel() - covered} elements of the box {box} are in no shard file "
                                  f"of the checkpoint at {str(self.path)!r}; it is incomplete. Fix: point at a "
                                  "directory written by ParallelStep.save, or save the checkpoint again.")
        return out

    def _file(self, entry: dict):
        if entry["file"] not in self._open:
            self._open[entry["file"]] = open_checked(self.path, entry)
        return self._open[entry["file"]]


class SafetensorsWeights:
    """Weights saved the Hugging Face way (``save_pretrained``): tensor key -> file, read by slices."""

    def __init__(self, directory: str | Path, keys: dict[str, str]):
        self.directory = Path(directory)
        self.file_of = keys
        self.names = frozenset(keys)
        self._open: dict[str, Any] = {}

    def __getstate__(self):
        return {"directory": self.directory, "file_of": self.file_of, "names": self.names, "_open": {}}

    @classmethod
    def scan(cls, directory: str | Path) -> tuple[SafetensorsWeights, dict[str, tuple[tuple[int, ...], str]]]:
        """The weights in ``directory`` and each tensor's ``(shape, dtype name)``, read from the
        index and the files' headers only."""
        from safetensors import safe_open

        d = Path(directory)
        if (d / INDEX_FILE).is_file():
            files = sorted(set(json.loads((d / INDEX_FILE).read_text())["weight_map"].values()))
        elif (d / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            raise CheckpointError(f"{str(d)!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}: not a directory of "
                                  "safetensors weights. Fix: pass the directory model.save_pretrained(...) wrote.")
        keys, meta = {}, {}
        for file in files:
            with safe_open(str(d / file), framework="pt") as f:
                for key in f.keys():
                    s = f.get_slice(key)
                    keys[key] = file
                    meta[key] = (tuple(s.get_shape()), _dtype_name(s.get_dtype()))
        return cls(d, keys), meta

    def read(self, name: str, box: Box, dtype: torch.dtype) -> torch.Tensor:
        file = self.file_of[name]
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = safe_open(str(self.directory / file), framework="pt")
        return self._open[file].get_slice(name)[_slices(box)].to(dtype)


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _dtype_name(code: str) -> str:
    return _SAFETENSORS_DTYPES.get(code, code.lower())


# ---------------------------------------------------------------- initialisation on the workers
def module_seed(seed: int, module_name: str) -> int:
    """The seed of one module's initialisation: the step's seed and the module's name, so every
    worker draws a module's values the same way whichever others it initialises."""
    return (seed * 1_000_003 + zlib.crc32(module_name.encode())) % (1 << 63)


def owners(model: torch.nn.Module) -> dict[str, str]:
    """State name (``named_parameters`` / ``named_buffers``) -> the module whose initialisation
    gives its value: the last module, in ``named_modules`` order, holding it directly (an
    initialisation later in the order overwrites an earlier one)."""
    canonical = {id(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}
    out = {}
    for mod_name, mod in model.named_modules():
        for t in (*mod._parameters.values(), *mod._buffers.values()):
            if t is not None and id(t) in canonical:
                out[canonical[id(t)]] = mod_name
    return out


def init_module(module: torch.nn.Module, name: str, init_fn, seed: int) -> None:
    """Initialise ``module``'s own tensors as a constructor followed by ``model.apply(init_fn)``
    does: its ``reset_parameters()`` if it has one, then ``init_fn(module)`` if given; the random
    generator seeded by ``module_seed`` (the caller's generator untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(seed, name))
        with torch.no_grad():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            if init_fn is not None:
                init_fn(module)


def uninitialisable(model: torch.nn.Module, names, init_fn) -> list[str]:
    """Of ``names``, those whose owning module has no way to be initialised (no ``init_fn``, no
    ``reset_parameters``)."""
    if init_fn is not None:
        return []
    own = owners(model)
    modules = dict(model.named_modules())
    return [n for n in names if not hasattr(modules[own[n]], "reset_parameters")]


def _meta_tensors(module: torch.nn.Module) -> list[tuple[dict, str]]:
    return [(store, k) for store in (module._parameters, module._buffers)
            for k, t in store.items() if t is not None and t.is_meta]


def _fill(slots: list[tuple[dict, str]], value: float, exact_value: int, replaced: dict[int, torch.Tensor]) -> None:
    """Give the tensors ``slots`` new CPU storage: ``value`` in floats, ``exact_value`` in integers and
    booleans. A meta parameter becomes a new ``Parameter`` (meta storage cannot be swapped in
    place), the same one wherever it is tied: ``replaced`` maps the meta tensor's id to it."""
    for store, k in slots:
        t = store[k]
        new = torch.full(t.shape, value if t.is_floating_point() else exact_value, dtype=t.dtype)
        if not t.is_meta and isinstance(t, torch.nn.Parameter):
            t.data = new
        elif id(t) in replaced:
            store[k] = replaced[id(t)]
            store[k].data = new
        else:
            store[k] = replaced[id(t)] = torch.nn.Parameter(new, t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else new


def materialise_module(module: torch.nn.Module, name: str, init_fn, seed: int,
                       replaced: dict[int, torch.Tensor] | None = None) -> list[tuple[dict, str]]:
    """Give ``module``'s meta tensors storage and initialise them (``init_module``); raise if the
    initialisation leaves one unset: floats start as NaN; integer and boolean tensors are
    initialised twice, from 0 and from 1, and must come out equal. ``replaced``: see ``_fill``.
    Returns the slots ``(store, key)`` it materialised."""
    replaced = {} if replaced is None else replaced
    slots = _meta_tensors(module)
    exact = [(store, k) for store, k in slots if not store[k].is_floating_point()]
    first = {}
    if exact:
        _fill(slots, float("nan"), 0, replaced)
        init_module(module, name, init_fn, seed)
        first = {k: store[k].detach().clone() for store, k in exact}
    _fill(slots, float("nan"), 1, replaced)
    init_module(module, name, init_fn, seed)
    unset = [k for store, k in slots
             if (torch.isnan(store[k]).any() if store[k].is_floating_point() else not torch.equal(store[k], first[k]))]
    if unset:
        how = " and ".join(w for w, has in (("reset_parameters()", hasattr(module, "reset_parameters")),
                                            ("init_fn", init_fn is not None)) if has) or "no initialisation"
        raise PlanError(
            f"{', '.join((name + '.' if name else '') + k for k in unset)} of the meta-device model: {how} of "
            f"{type(module).__name__} does not set it (a buffer computed in __init__ is lost on the meta device). "
            "Fix: pass parallelize(..., init_fn=fn) where fn(module) sets every parameter and buffer the module "
            "holds itself (Hugging Face: model._init_weights), or build the model under alpa_torch.empty_weights(), "
            "which puts only the parameters on the meta device")
    return slots


def _to_meta(slots: list[tuple[dict, str]]) -> None:
    for store, k in slots:
        t = store[k]
        empty = torch.empty(t.shape, dtype=t.dtype, device="meta")
        store[k] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty


def give_storage(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Give every meta tensor of ``model`` CPU storage (zeros, to be overwritten); returns the
    replacements by the meta tensor's id (``_fill``: a meta parameter becomes a new ``Parameter``)."""
    replaced: dict[int, torch.Tensor] = {}
    for module in model.modules():
        _fill(_meta_tensors(module), 0.0, 0, replaced)
    return replaced


def init_weights(model: torch.nn.Module, init_fn=None, seed: int | None = None) -> torch.nn.Module:
    """Give every meta-device tensor of ``model`` CPU storage and initialise it module by module
    (``materialise_module``, in ``named_modules`` order): the values ``parallelize`` gives a meta
    model on its workers with the same ``init_fn`` and seed (default: ``torch.initial_seed()``,
    what ``parallelize`` takes at its first call). Tensors already materialised are kept; a meta
    parameter becomes a new ``Parameter`` object (create the optimizer afterwards). Returns ``model``."""
    seed = torch.initial_seed() if seed is None else seed
    replaced: dict[int, torch.Tensor] = {}
    for name, module in model.named_modules():
        if _meta_tensors(module):
            materialise_module(module, name, init_fn, seed, replaced)
    return model


class ModuleInit:
    """State of a meta-device model, made on the workers by ``materialise_module``."""

    def __init__(self, model: torch.nn.Module, init_fn, seed: int, names):
        self.payload = cloudpickle.dumps((model, init_fn))  # one pickle: a bound init_fn keeps its model
        self.seed = seed
        self.names = frozenset(names)
        self._unpacked = None
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None

    def __getstate__(self):
        return {"payload": self.payload, "seed": self.seed, "names": self.names, "_unpacked": None, "_cached": None}

    def read(self, name: str, box: Box, dtype: torch.dtype) -> torch.Tensor:
        full = self._materialised(name)[name]
        return full[_slices(box)].to(dtype).clone()

    def _materialised(self, name: str) -> dict[str, torch.Tensor]:
        """The values of the state the owner of ``name`` initialises (one module's kept at a time)."""
        if self._unpacked is None:
            model, init_fn = cloudpickle.loads(self.payload)
            canonical = {id(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}
            slot_names = {(m, k): canonical[id(t)] for m, mod in model.named_modules()
                          for k, t in (*mod._parameters.items(), *mod._buffers.items()) if t is not None}
            self._unpacked = (init_fn, owners(model), dict(model.named_modules()), slot_names)
        init_fn, own, modules, slot_names = self._unpacked
        owner = own[name]
        if self._cached is not None and self._cached[0] == owner:
            return self._cached[1]
        slots = materialise_module(modules[owner], owner, init_fn, self.seed)
        values = {slot_names[(owner, k)]: store[k].detach() for store, k in slots}
        _to_meta(slots)  # free the module's storage: one module is materialised at a time
        self._cached = (owner, values)
        return values


# ---------------------------------------------------------------- a device's shards
def shard(sources: list, name: str, shape: tuple[int, ...], dtype: str, mesh, placements, device):
    """This device's part of state ``name`` (full ``shape``, ``dtype`` name) read from the first of
    ``sources`` that has it: a DTensor placed as ``placements`` on ``mesh`` (None: one device,
    a plain tensor). A partial placement holds the value at coordinate 0 of its axis, zeros elsewhere."""
    from torch.distributed.tensor import DTensor

    source = next((s for s in sources if name in s.names), None)
    if source is None:
        raise PlanError(f"no value for the state {name!r}: it is in none of the given weights or checkpoint and "
                        "the model holds no value for it. Fix: pass weights that hold it, or an init_fn")
    torch_dtype = DTYPES[dtype]
    if mesh is None:
        return source.read(name, [[0, n] for n in shape], torch_dtype).to(device)
    box = local_box(shape, mesh, placements)
    coordinate = mesh.get_coordinate()
    if any(p.is_partial() and coordinate[axis] != 0 for axis, p in enumerate(placements)):
        local = torch.zeros(_shape(box), dtype=torch_dtype)
    else:
        local = source.read(name, box, torch_dtype)
    return DTensor.from_local(local.to(device), mesh, tuple(placements), run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())
