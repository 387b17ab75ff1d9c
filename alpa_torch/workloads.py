"""Workloads for the ``alpa-torch`` command: a model, optimizer, batch and step from a name.

Owns the MODEL argument of the CLI: zoo models (``alpa_torch/zoo.py``),
GPT-3 shapes built on the meta device, Hugging Face families from configs, or a user
``MODULE:FUNCTION``. ``cli.py`` parses arguments and runs commands; this module only builds.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alpa_torch.core.errors import require_extra

REPO_ROOT = Path(__file__).resolve().parents[1]
GPT3_SIZES = ("1.3b", "2.6b", "6.7b", "15b", "39b")
HF_FAMILIES = {"hf-gpt2": "hf_gpt2", "hf-llama": "hf_llama", "hf-bert": "hf_bert", "hf-bert-mlm": "hf_bert_mlm",
               "hf-t5": "hf_t5"}
ZOO_MODELS = ("mlp", "gpt", "cnn", "demo")
MODEL_HELP = (f"a zoo model ({', '.join(ZOO_MODELS)}; 'demo' is the GPT of examples/train_gpt.py), a GPT-3 "
              f"config built on the meta device (gpt-{', gpt-'.join(GPT3_SIZES)}), a Hugging Face family from a "
              f"config with random weights ({', '.join(HF_FAMILIES)}), or MODULE:FUNCTION (a module or a .py "
              "file) returning (model, optimizer, batch, train_step)")

class UsageError(Exception):
    """A bad argument found after parsing (exit 2)."""


@dataclass(frozen=True, slots=True)
class Workload:
    """What a training step needs: the model, its optimizer, one batch and the step function."""

    name: str
    model: Any
    optimizer: Any
    batch: Any
    train_step: Callable
    batch_fn: Callable[[int], Any] | None = None
    """Batch of step i (``train``); None: every step reuses ``batch``."""


def _zoo():
    """The model zoo (``alpa_torch/zoo.py``)."""
    from . import zoo

    return zoo


def _model_kwargs(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--model-arg {pair!r} is not KEY=VALUE")
        try:
            out[key] = int(value)
        except ValueError:
            out[key] = {"true": True, "false": False}.get(value.lower(), value)
    return out


def load_workload(spec: str, *, batch_size: int | None = None, dtype: str | None = None,
                  optimizer: str = "adamw", model_args: list[str] | None = None) -> Workload:
    """Resolve MODEL (see ``MODEL_HELP``) into a ``Workload``."""
    import torch

    kwargs = _model_kwargs(model_args)
    if ":" in spec:
        return _user_workload(spec, kwargs)
    zoo = _zoo()
    if optimizer not in zoo.OPTIMIZERS:
        raise UsageError(f"--optimizer {optimizer!r} is not one of {zoo.OPTIMIZERS}")
    if m := re.fullmatch(r"gpt-(\d+(?:\.\d+)?b)", spec):
        if m[1] not in GPT3_SIZES:
            raise UsageError(f"model {spec!r}: GPT-3 sizes are {', '.join('gpt-' + s for s in GPT3_SIZES)}")
        try:
            cfg = zoo.gpt_config(m[1], **kwargs)
        except TypeError as exc:
            raise UsageError(f"--model-arg for {spec}: {exc}") from exc
        with torch.device("meta"):
            model = zoo.GPT(cfg).to(getattr(torch, dtype or "float16"))
        tokens = torch.zeros(batch_size or 1024, cfg.block_size, dtype=torch.long, device="meta")
        return Workload(spec, model, zoo.make_optimizer(optimizer, model), (tokens, tokens), zoo.train_step)
    name = HF_FAMILIES.get(spec, spec.replace("-", "_"))
    if name not in zoo._ENTRIES and name != "demo":
        raise UsageError(f"unknown model {spec!r}: use {MODEL_HELP}")
    if name.startswith("hf_"):
        require_extra("transformers", "hf", f"the Hugging Face model {spec}")
    data = "gpt" if name == "demo" else name
    builder = {"demo": lambda **kw: zoo.GPT(zoo.GPTConfig.small(**kw)), "gpt": lambda **kw: zoo.GPT(
        zoo.GPTConfig.tiny(**kw))}.get(name) or zoo._ENTRIES[name][0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            model = builder(**kwargs).train()
        except TypeError as exc:
            raise UsageError(f"--model-arg for {spec}: {exc}") from exc
    if dtype:
        model = model.to(getattr(torch, dtype))
    size = batch_size or 8
    return Workload(spec, model, zoo.make_optimizer(optimizer, model), zoo.make_batch(data, size, seed=0),
                    zoo.train_step, batch_fn=lambda i: zoo.make_batch(data, size, seed=i))


def _importable(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):  # a parent package that does not import
        return False


def _user_workload(spec: str, kwargs: dict) -> Workload:
    module_name, _, fn_name = spec.rpartition(":")
    # MODULE is a .py file, a module of the current directory (mymodel -> ./mymodel.py) or an
    # importable module; a file is loaded from its path, nothing is added to sys.path. An
    # importable module is imported even where its file is under the current directory
    # (alpa_torch.zoo_hf from the repository's root): loaded as a file, its relative imports fail.
    path = Path(module_name if module_name.endswith(".py") else module_name.replace(".", os.sep) + ".py")
    try:
        if module_name.endswith(".py") or (path.is_file() and not _importable(module_name)):
            loader = importlib.util.spec_from_file_location(path.stem, path)
            if loader is None or not path.is_file():
                raise UsageError(f"model {spec!r}: no file {module_name!r}")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"model {spec!r}: cannot import {module_name!r} ({exc})") from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UsageError(f"model {spec!r}: {module_name!r} has no function {fn_name!r}")
    out = fn(**kwargs)
    if not isinstance(out, tuple) or len(out) not in (4, 5):
        raise UsageError(f"model {spec!r}: {fn_name}() must return (model, optimizer, batch, train_step"
                         f"[, batch_of_step]), got {type(out).__name__}")
    return Workload(spec, out[0], out[1], out[2], out[3], out[4] if len(out) == 5 else None)
