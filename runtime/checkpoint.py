"""Checkpoints: every worker writes its own shards, the driver writes the manifest and commits.

A checkpoint is a directory::

    ckpt/manifest.json      JSON (``FORMAT_VERSION``): step, plan, tensors, optimizer, files
    ckpt/rank0.safetensors  the tiles device 0 holds, one entry per state tensor
    ckpt/rank1.safetensors  ...

A *tile* is a box ``[[start, stop], ...]`` (one pair per dim) of a tensor's global
index space: the local shard a device holds under the plan that saved it (DTensor's
``compute_local_shape_and_global_offset``). Replicated copies are written once, by
the device at coordinate 0 of every replicated mesh axis, so the tiles of a tensor
partition it. Loading assembles each tensor on the driver from its tiles and hands
the full values to the current plan, which shards them again: the same plan,
another plan, another cluster size, or a plain model (``load_checkpoint``).

Atomic commit: everything is written into a sibling ``ckpt.tmp-<uuid>`` and fsync'ed;
then an existing ``ckpt`` is renamed to ``ckpt.old-<uuid>``, the new directory to
``ckpt``, and only after that rename succeeded is the old one removed. A crash leaves
the old or the new checkpoint whole; between the two renames only ``ckpt.old-*``
exists, and ``resolve`` falls back to it. One writer per directory is assumed.
Workers on other hosts write into the same path, so it must be shared storage.

Safety: only JSON and safetensors are read, never pickle, so loading a checkpoint
cannot run code. The manifest is checked key by key (``check_manifest``); shard
files must be named ``rank<N>.safetensors``, lie in the directory, and match their
recorded size and SHA-256.

This module owns the format; ``engine.py`` calls
``save_runner`` on the workers, ``alpa_torch.api.ParallelStep`` the driver side.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from alpa_torch.core.errors import CheckpointError
from alpa_torch.core.graph import optimizers_of

log = logging.getLogger(__name__)

FORMAT = "alpa-torch-checkpoint"
FORMAT_VERSION = 2
"""2: every optimizer state key as torch.optim holds it (Adam's ``step`` included), the optimizer a list
where the step took several, no ``amp.step``. Version 1 (the hand-written SGD/Adam/AdamW) is refused
by name."""
MANIFEST = "manifest.json"
SHARD_FILE = re.compile(r"rank(\d{1,6})\.safetensors")
MANIFEST_KEYS = frozenset({"format", "format_version", "step", "graph_fingerprint", "plan", "tensors",
                           "optimizer", "files"})
TENSOR_KEYS = {"param": {"kind", "shape", "dtype"}, "buffer": {"kind", "shape", "dtype"},
               "opt_state": {"kind", "shape", "dtype", "param", "key"}}
FILE_KEYS = frozenset({"file", "rank", "bytes", "sha256", "tiles"})
OPTIMIZER_KEYS = frozenset({"type", "param_names", "param_groups"})
DTYPES = {name: getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")}
_FIX = "Fix: point at a directory written by ParallelStep.save, or save the checkpoint again."

Box = list[list[int]]
"""``[[start, stop], ...]``, one pair per tensor dim."""


# ---------------------------------------------------------------- worker side
def local_box(shape, mesh, placements) -> Box:
    """The box of a tensor of ``shape`` that this device of ``mesh`` holds under ``placements``
    (DTensor's ``compute_local_shape_and_global_offset``; a partial placement holds every index)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    whole = [Replicate() if p.is_partial() else p for p in placements]
    sizes, offset = compute_local_shape_and_global_offset(shape, mesh, whole)
    return [[o, o + n] for o, n in zip(offset, sizes)]


def local_tiles(state: dict[str, Any]) -> dict[str, tuple[torch.Tensor, Box]]:
    """This device's tiles of ``state`` (name -> DTensor): ``name -> (local tensor, box)``.

    Replicated copies are kept only on coordinate 0 of each replicated mesh axis.
    A partial sum is reduced first: a collective, so every device of the mesh must call
    this with the same names in the same order (a stage's runners do)."""
    from torch.distributed.tensor import DTensor, Replicate

    out = {}
    for name, value in state.items():
        if not isinstance(value, DTensor):
            value = torch.as_tensor(value)
            out[name] = (value.detach().cpu().contiguous().clone(), [[0, n] for n in value.shape])
            continue
        placements = list(value.placements)
        if any(p.is_partial() for p in placements):
            placements = [Replicate() if p.is_partial() else p for p in placements]
            value = value.redistribute(value.device_mesh, placements)
        coordinate = value.device_mesh.get_coordinate()
        if any(p.is_replicate() and coordinate[axis] != 0 for axis, p in enumerate(placements)):
            continue
        box = local_box(value.shape, value.device_mesh, placements)
        local = value.to_local()
        assert tuple(local.shape) == tuple(b - a for a, b in box), (name, local.shape, box)
        if local.numel() == 0:
            continue  # an uneven shard can be empty
        # clone: safetensors refuses tensors that share storage
        out[name] = (local.detach().cpu().contiguous().clone(), box)
    return out


def write_shard_file(directory: str | os.PathLike[str], rank: int,
                     tiles: dict[str, tuple[torch.Tensor, Box]]) -> dict | None:
    """Write ``rank<rank>.safetensors`` into ``directory`` (fsync'ed); its manifest entry, or
    None when the rank holds no tile of its own. The boxes are in the file's metadata too."""
    from safetensors.torch import save

    if not tiles:
        return None
    boxes = {name: box for name, (_, box) in tiles.items()}
    data = save({name: t for name, (t, _) in tiles.items()},
                metadata={"format": FORMAT + "-shard", "tiles": json.dumps(boxes)})
    name = f"rank{rank}.safetensors"
    with open(Path(directory) / name, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"file": name, "rank": rank, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "tiles": boxes}


def save_runner(runner, directory: str, rank: int) -> dict | None:
    """Inside a worker: write this device's tiles of a ``StageRunner``'s state."""
    return write_shard_file(directory, rank, local_tiles(runner.state))


def export_runner(runner, directory: str, file: str | None, order: list[str], mine: list[str]) -> None:
    """Inside a worker: gather each tensor of ``order`` whole (a collective of the stage's devices,
    called in the same order on each) and write those in ``mine`` to ``directory/file``
    (Hugging Face's safetensors layout: whole tensors, format "pt")."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    keep, state = {}, runner.state
    for name in order:
        value = state[name]
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if name in mine:
            keep[name] = full.detach().cpu().contiguous().clone()
        del full  # one gathered tensor at a time besides those kept
    if file is not None:
        save_file(keep, str(Path(directory) / file), metadata={"format": "pt"})


# ---------------------------------------------------------------- driver: write
def save_checkpoint(directory: str | os.PathLike[str], write_shards: Callable[[str], list[dict | None]],
                    meta: dict) -> Path:
    """Write a checkpoint atomically (module docstring) and return its path.

    ``write_shards(tmp_dir)`` makes the workers write their files and returns their
    entries; ``meta`` holds the other manifest keys (step, graph_fingerprint, plan,
    tensors, optimizer)."""
    final = Path(os.path.abspath(directory))  # workers may run in another cwd
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex}")
    tmp.mkdir()
    try:
        files = sorted((f for f in write_shards(str(tmp)) if f is not None), key=lambda f: f["rank"])
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **meta, "files": files}
        check_manifest(manifest)  # never commit what load would refuse
        _write_json(tmp / MANIFEST, manifest)
        _fsync_dir(tmp)
        _commit(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("checkpoint of step %d written to %s (%d shard files)", meta.get("step", -1), final, len(files))
    return final


def _commit(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` is moved aside first and removed last."""
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for stale in final.parent.glob(f"{final.name}.old-*"):  # left by a crash between the renames
        shutil.rmtree(stale, ignore_errors=True)


def _write_json(path: Path, value: dict) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(value, indent=1, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory handles
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_value(value: Any) -> Any:
    """``value`` as JSON data (tuples become lists, 1-element tensors numbers); None if impossible."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        items = [plain_value(v) for v in value]  # None items stay (Adafactor's eps = (None, 1e-3))
        return None if any(v is None and u is not None for u, v in zip(value, items)) else items
    return None


def describe_optimizer(optimizer: torch.optim.Optimizer, param_names: list[str]) -> dict:
    """The optimizer's type and hyper-parameters as JSON, its groups' params as indices
    into ``param_names`` (``torch.optim`` state_dict convention)."""
    groups, start = [], 0
    for group in optimizer.param_groups:
        g = {k: plain_value(v) for k, v in group.items() if k != "params"}
        g = {k: v for k, v in g.items() if v is not None or group[k] is None}
        g["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        groups.append(g)
    return {"type": type(optimizer).__name__, "param_names": list(param_names), "param_groups": groups}


# ---------------------------------------------------------------- driver: read
def resolve(directory: str | os.PathLike[str]) -> Path:
    """The checkpoint directory to read: ``directory``, or its ``.old-*`` twin if a crash
    interrupted a commit between its two renames."""
    final = Path(os.path.abspath(directory))
    if (final / MANIFEST).is_file():
        return final
    olds = [p for p in final.parent.glob(f"{final.name}.old-*") if (p / MANIFEST).is_file()]
    if olds:
        chosen = max(olds, key=lambda p: p.stat().st_mtime)
        log.warning("%s has no %s (a save was interrupted); reading the previous checkpoint %s",
                    final, MANIFEST, chosen)
        return chosen
    raise CheckpointError(f"no checkpoint at {str(final)!r}: it has no {MANIFEST}. {_FIX}")


def read_manifest(directory: str | os.PathLike[str]) -> tuple[Path, dict]:
    """``(path, manifest)`` of the checkpoint at ``directory``, checked (``check_manifest``)."""
    path = resolve(directory)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{str(path / MANIFEST)!r} is not JSON ({exc}); the checkpoint is damaged. "
                              f"{_FIX}") from exc
    check_manifest(manifest, where=str(path))
    return path, manifest


def check_manifest(m: Any, where: str = "the manifest") -> None:
    """Raise ``CheckpointError`` unless ``m`` is a manifest of exactly this format."""
    if not isinstance(m, dict):
        raise CheckpointError(f"{where}: the manifest is a {type(m).__name__}, not a JSON object. {_FIX}")
    if m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{where}: format {m.get('format')!r} version {m.get('format_version')!r} is not "
                              f"{FORMAT!r} version {FORMAT_VERSION}, the one this alpa-torch reads. "
                              "Fix: load it with the alpa-torch version that wrote it, or save it again.")
    _check_keys(m, MANIFEST_KEYS, where, "manifest")
    if not isinstance(m["step"], int) or m["step"] < 0:
        raise CheckpointError(f"{where}: step {m['step']!r} is not a step count >= 0. {_FIX}")
    if not isinstance(m["tensors"], dict) or not isinstance(m["files"], list):
        raise CheckpointError(f"{where}: 'tensors' must be an object and 'files' a list. {_FIX}")
    for name, entry in m["tensors"].items():
        _check_tensor(name, entry, where)
    for entry in m["files"]:
        _check_file(entry, m["tensors"], where)
    opts = m["optimizer"] if isinstance(m["optimizer"], list) else [m["optimizer"]]
    for opt in opts:
        if not isinstance(opt, dict):
            raise CheckpointError(f"{where}: 'optimizer' must be an object (or a list of them). {_FIX}")
        _check_keys(opt, OPTIMIZER_KEYS, where, "optimizer")


def _check_keys(d: dict, allowed: frozenset | set, where: str, what: str) -> None:
    unexpected, missing = sorted(set(d) - set(allowed)), sorted(set(allowed) - set(d))
    if unexpected or missing:
        raise CheckpointError(f"{where}: the {what} has unexpected keys {unexpected} and lacks keys {missing} "
                              f"(expected exactly {sorted(allowed)}); it was not written by this version of "
                              f"alpa-torch or was edited. {_FIX}")


def _check_tensor(name: str, e: Any, where: str) -> None:
    if not isinstance(e, dict) or e.get("kind") not in TENSOR_KEYS:
        raise CheckpointError(f"{where}: tensor {name!r} has no kind in {sorted(TENSOR_KEYS)}. {_FIX}")
    _check_keys(e, TENSOR_KEYS[e["kind"]], where, f"entry of tensor {name!r}")
    shape = e["shape"]
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise CheckpointError(f"{where}: tensor {name!r} has shape {shape!r}, not a list of sizes. {_FIX}")
    if e["kind"] == "opt_state" and not (isinstance(e["param"], str) and isinstance(e["key"], str)):
        raise CheckpointError(f"{where}: optimizer state {name!r} needs 'param' and 'key' strings. {_FIX}")
    if e["dtype"] not in DTYPES:
        raise CheckpointError(f"{where}: tensor {name!r} has dtype {e['dtype']!r}; readable dtypes are "
                              f"{sorted(DTYPES)}. {_FIX}")


def _check_file(e: Any, tensors: dict, where: str) -> None:
    name = e.get("file") if isinstance(e, dict) else None
    if not isinstance(name, str) or not SHARD_FILE.fullmatch(name):
        raise CheckpointError(
            f"{where}: the manifest names the file {name!r}, which is not a shard file of this format "
            "(rank<N>.safetensors in the checkpoint directory). alpa-torch reads only JSON and safetensors and "
            f"never unpickles (a pickle could run code). {_FIX}")
    _check_keys(e, FILE_KEYS, where, f"entry of file {name!r}")
    if not (isinstance(e["rank"], int) and isinstance(e["bytes"], int) and isinstance(e["sha256"], str)
            and isinstance(e["tiles"], dict)):
        raise CheckpointError(f"{where}: the entry of {name} needs an int rank and bytes, a sha256 string and "
                              f"a tiles object. {_FIX}")
    for tensor, box in e["tiles"].items():
        shape = tensors.get(tensor, {}).get("shape")
        ok = (shape is not None and isinstance(box, list) and len(box) == len(shape)
              and all(isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) for x in b)
                      and 0 <= b[0] < b[1] <= n for b, n in zip(box, shape)))
        if not ok:
            raise CheckpointError(f"{where}: {name} holds a tile {box!r} of {tensor!r}, which is not a box "
                                  f"inside its shape {shape}. {_FIX}")


def open_checked(path: Path, entry: dict):
    """``safe_open`` the shard of manifest ``entry`` after checking that it is safetensors and has its
    recorded size and SHA-256 (read in 16 MiB blocks: a large shard is never held whole)."""
    from safetensors import safe_open

    file = path / entry["file"]
    if not file.is_file() or file.is_symlink():
        raise CheckpointError(f"{str(file)!r} is missing (or a link); the checkpoint is incomplete. {_FIX}")
    digest, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        head = f.read(9)  # safetensors: the header's length (8 bytes, little-endian), then its JSON
        if head[8:9] != b"{" and head[:1] == b"\x80":  # a length's first byte may be 0x80 too
            raise CheckpointError(f"{str(file)!r} is a pickle, not safetensors; alpa-torch never unpickles "
                                  f"checkpoint files (it could run code). {_FIX}")
        f.seek(0)
        while block := f.read(16 << 20):
            digest.update(block)
            size += len(block)
    if size != entry["bytes"] or digest.hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{str(file)!r} has {size} bytes / a SHA-256 that differ from the manifest "
                              f"({entry['bytes']} bytes): it was truncated or changed. {_FIX}")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{str(file)!r} is not a safetensors file ({exc}). {_FIX}") from exc


def assemble(path: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path``, whole, built from its tiles (on this process)."""
    out = {n: torch.empty(e["shape"], dtype=DTYPES[e["dtype"]]) for n, e in manifest["tensors"].items()}
    covered = {n: torch.zeros(e["shape"], dtype=torch.bool) for n, e in manifest["tensors"].items()}
    for entry in manifest["files"]:
        with open_checked(path, entry) as f:
            for name, box in entry["tiles"].items():
                tile = f.get_tensor(name)
                where = tuple(slice(a, b) for a, b in box)
                if tuple(tile.shape) != tuple(b - a for a, b in box) or tile.dtype != out[name].dtype:
                    raise CheckpointError(f"{entry['file']}: tile {box} of {name!r} is {tuple(tile.shape)} "
                                          f"{tile.dtype}, the manifest says {out[name].dtype}. {_FIX}")
                out[name][where] = tile
                covered[name][where] = True
    for name, mask in covered.items():
        if not bool(mask.all()):
            raise CheckpointError(f"tensor {name!r}: {int((~mask).sum())} of {mask.numel()} elements are in no "
                                  f"shard file; the checkpoint at {str(path)!r} is incomplete. {_FIX}")
    return out


# ---------------------------------------------------------------- plain models
def load_checkpoint(directory: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """``(model_state_dict, optimizer_state_dict)`` of a checkpoint, for a single-device model.

    The first is name -> tensor for parameters and buffers; the second has the form
    of ``torch.optim.Optimizer.state_dict()`` (``{'state': {i: ...}, 'param_groups': [...]}``,
    params numbered in the order the saving optimizer held them)."""
    _, model_sd, opt_sd = _load_plain(directory)
    return model_sd, opt_sd


def _load_plain(directory) -> tuple[dict, dict[str, torch.Tensor], dict]:
    path, manifest = read_manifest(directory)
    values = assemble(path, manifest)
    tensors = manifest["tensors"]
    model = {n: values[n] for n, e in tensors.items() if e["kind"] in ("param", "buffer")}
    return manifest, model, _optimizer_state_dict(manifest, values)


def _optimizer_state_dict(manifest: dict, values: dict[str, torch.Tensor]):
    """The saved optimizer's ``state_dict()`` (a list of them for a step of several optimizers)."""
    by_param: dict[str, dict] = {}
    for n, e in manifest["tensors"].items():
        if e["kind"] == "opt_state" and e["param"] != "<amp>":
            by_param.setdefault(e["param"], {})[e["key"]] = values[n]
    out = []
    for opt in manifest["optimizer"] if isinstance(manifest["optimizer"], list) else [manifest["optimizer"]]:
        state = {}
        if manifest["step"] > 0:  # torch.optim holds no state before the first step
            state = {i: dict(by_param[p]) for i, p in enumerate(opt["param_names"]) if by_param.get(p)}
        groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
                  for g in opt["param_groups"]]
        out.append({"state": state, "param_groups": groups})
    return out if isinstance(manifest["optimizer"], list) else out[0]


def load_into(model: torch.nn.Module, optimizer, directory: str | os.PathLike[str]) -> int:
    """Copy a checkpoint into a plain ``model`` (and ``optimizer``, or the tuple of optimizers the step
    took); returns its step count."""
    manifest, model_sd, opt_sd = _load_plain(directory)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    missing, unexpected = sorted(set(targets) - set(model_sd)), sorted(set(model_sd) - set(targets))
    bad = sorted(n for n in set(targets) & set(model_sd) if tuple(targets[n].shape) != tuple(model_sd[n].shape))
    if missing or unexpected or bad:
        raise CheckpointError(f"the checkpoint does not fit this model: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}, other shapes {bad[:5]}. Fix: build the model the way the "
                              "saved one was built.")
    several = isinstance(manifest["optimizer"], list)
    opts = () if optimizer is None else optimizers_of(optimizer)
    saved_all = manifest["optimizer"] if several else [manifest["optimizer"]]
    names = {id(p): n for n, p in model.named_parameters()}
    for opt, saved in zip(opts, saved_all):
        order = [names.get(id(p)) for g in opt.param_groups for p in g["params"]]
        if order != saved["param_names"] or type(opt).__name__ != saved["type"] or len(opts) != len(saved_all):
            raise CheckpointError(f"the optimizer ({type(opt).__name__}, {len(order)} params; {len(opts)} "
                                  f"optimizer(s)) is not the saved one ({saved['type']}, {len(saved['param_names'])} "
                                  f"params in the same order; {len(saved_all)} optimizer(s)). Fix: build it the same "
                                  "way, e.g. from model.parameters().")
    with torch.no_grad():
        for name, t in targets.items():
            t.copy_(model_sd[name])
    for opt, sd in zip(opts, opt_sd if several else [opt_sd]):
        opt.load_state_dict(sd)
    return manifest["step"]
