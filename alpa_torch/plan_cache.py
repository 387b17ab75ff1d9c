"""An on-disk cache of plans, keyed by everything a plan depends on.

Planning is deterministic: the same graph, cluster and options give the same
stages and shardings (only timing statistics such as ``plan_s`` differ; see
``plan_decisions``). So a plan can be stored and reused. The key is a SHA-256
over (as sorted JSON):

    graph_fingerprint(graph)                the model, optimizer and batch shapes, and the
                                            precision ('bf16' / 'fp16': ``parallelize(precision=...)``)
    cluster.to_dict()                       devices, links, calibration
    PlanOptions.to_dict()                   num_microbatches, num_stages, ... (the planner's options)
    intra_ilp.cost_model.COST_MODEL_VERSION a new cost model prices plans differently
    plan.FORMAT_VERSION, CACHE_VERSION      a new plan or entry format, or a planner that plans differently

An entry ``<root>/<key>.json`` holds those fields, the plan and the warnings
the planner logged as JSON (never pickle); a hit logs those warnings again, so a
cached plan tells the user what the planning run told them. ``get`` uses an
entry only if it parses, its fields equal the ones asked for, and the plan
validates against the graph and cluster; anything else is logged and treated
as a miss, and the caller's ``put`` overwrites it. Writes
go to a temporary file renamed over the entry, so readers never see half a file.
``put_data`` / ``get_data`` keep plain JSON data beside the plans under key fields of
their own (``alpa_torch.calibration``: the cost corrections measured for a step on a cluster).

Root: ``plan_cache=<path>``, else ``$ALPA_TORCH_CACHE``, else ``~/.cache/alpa_torch/plans``;
``plan_cache=False`` disables the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alpa_torch.core import plan as plan_format
from alpa_torch.core.cluster import Cluster
from alpa_torch.core.errors import PlanError
from alpa_torch.core.graph import OpGraph
from alpa_torch.core.options import PlanOptions
from alpa_torch.core.plan import ParallelPlan, graph_fingerprint
from stage_dp.planner import make_plan

log = logging.getLogger(__name__)

CACHE_VERSION = 10  # 2: tied weights in one stage; 3: activation checkpointing; 4: no empty shards;
# 5: sharding=False replicates the update (as DDP); 6: layers have a FLOPs floor (balanced pipelines);
# 7: a stack of repeated blocks is cut between whole blocks; 8: regular cuts of such stacks preferred;
# 9: views of a weight's cast copy keep its layout (autocast plans); 10: the layer ILPs price gradient
# reductions as buckets, convolutions never shard a dim on two mesh axes, and what only the update
# reads is update phase
ENTRY_FORMAT = "alpa-torch-plan-cache"
DATA_FORMAT = "alpa-torch-cache-data"
"""An entry holding JSON data beside the plans (``put_data``: a cluster's measured cost corrections)."""
ENV_VAR = "ALPA_TORCH_CACHE"
PLANNER_LOGGERS = ("intra_ilp", "stage_dp")
TIMING_KEYS = frozenset({"plan_s", "ilp_s", "build_s", "solve_s"})
"""Statistics that measure the planner's own run time: they differ from run to run."""


def default_root() -> Path:
    """``$ALPA_TORCH_CACHE`` or ``~/.cache/alpa_torch/plans``."""
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else Path.home() / ".cache" / "alpa_torch" / "plans"


def key_fields(graph: OpGraph, cluster: Cluster, options: PlanOptions) -> dict[str, Any]:
    """What the plan depends on, as JSON data (module docstring)."""
    from intra_ilp import cost_model  # read at call time: a new version must miss

    fields = {"graph_fingerprint": graph_fingerprint(graph), "cluster": cluster.to_dict(),
              "options": options.to_dict(),
              "cost_model_version": cost_model.COST_MODEL_VERSION,
              "plan_format_version": plan_format.FORMAT_VERSION, "cache_version": CACHE_VERSION}
    return json.loads(json.dumps(fields, sort_keys=True, default=repr))  # tuples -> lists, as stored


def cache_key(fields: dict[str, Any]) -> str:
    """32 hex digits of SHA-256 over ``fields`` as sorted JSON."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def plan_decisions(plan: ParallelPlan) -> dict:
    """The plan as JSON without run-time statistics: equal for equal decisions."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in TIMING_KEYS}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(json.loads(json.dumps(plan.to_dict())))


class PlanCache:
    """Plans stored as JSON files under ``root``."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    @staticmethod
    def from_option(option: bool | str | os.PathLike[str] | None) -> PlanCache | None:
        """``parallelize``'s ``plan_cache``: False -> no cache, None/True -> default root, a path -> it."""
        if option is False:
            return None
        root = Path(default_root() if option is None or option is True else option)
        blocked = next((p for p in (root, *root.parents) if p.exists() and not p.is_dir()), None)
        if blocked is not None:
            raise PlanError(
                f"plan_cache={str(root)!r}: {str(blocked)!r} is a file, not a directory. Fix: pass a directory "
                f"(it is created if missing; ${ENV_VAR} sets the default), or plan_cache=False for no cache")
        return PlanCache(root)

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def get(self, fields: dict[str, Any], graph, cluster) -> tuple[ParallelPlan, list] | None:
        """``(plan, warnings)`` cached for ``fields`` if a valid entry exists, else None (a miss)."""
        path = self.path(cache_key(fields))
        if not path.is_file():
            return None
        try:
            entry = _checked_entry(path, fields, ENTRY_FORMAT)
            plan = ParallelPlan.from_dict(entry["plan"])
            plan.validate(graph, cluster)
            warnings = entry.get("warnings", [])
            if not all(isinstance(w, list) and [type(x) for x in w] == [str, int, str] for w in warnings):
                raise ValueError("its warnings are not [logger, level, message] triples")
        except Exception as exc:  # noqa: BLE001 - any defect means: do not use it, plan again
            log.warning("ignoring plan cache entry %s (%s); planning again and overwriting it", path, exc)
            return None
        log.info("plan loaded from cache %s", path)
        return plan, warnings

    def put(self, fields: dict[str, Any], plan: ParallelPlan, warnings: list | None = None) -> Path | None:
        """Store ``plan`` (and the planner's ``warnings``) under ``fields`` (atomic replace);
        None if the cache is not writable."""
        return self._write(fields, {"format": ENTRY_FORMAT, "fields": fields, "plan": plan.to_dict(),
                                    "warnings": warnings or []})

    def get_data(self, fields: dict[str, Any]) -> dict | None:
        """The JSON dict ``put_data`` stored under ``fields``, or None (none, or a damaged entry: logged)."""
        path = self.path(cache_key(fields))
        if not path.is_file():
            return None
        try:
            entry = _checked_entry(path, fields, DATA_FORMAT)
            if not isinstance(entry.get("data"), dict):
                raise ValueError("its data is not a dict")
        except Exception as exc:  # noqa: BLE001 - any defect means: do not use it
            log.warning("ignoring cache entry %s (%s)", path, exc)
            return None
        return entry["data"]

    def put_data(self, fields: dict[str, Any], data: dict) -> Path | None:
        """Store a JSON dict under ``fields`` (atomic replace); None if the cache is not writable."""
        return self._write(fields, {"format": DATA_FORMAT, "fields": fields, "data": data})

    def _write(self, fields: dict[str, Any], entry: dict) -> Path | None:
        path = self.path(cache_key(fields))
        tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entry, indent=1, allow_nan=False) + "\n")
            os.replace(tmp, path)
        except (OSError, ValueError) as exc:
            log.warning("could not write the plan cache entry %s (%s); continuing without caching", path, exc)
            tmp.unlink(missing_ok=True)
            return None
        return path


def _checked_entry(path: Path, fields: dict[str, Any], entry_format: str) -> dict:
    """The entry stored at ``path``; ValueError unless it is an ``entry_format`` entry for ``fields``."""
    entry = json.loads(path.read_text())
    if not isinstance(entry, dict) or entry.get("format") != entry_format:
        raise ValueError(f"not a {entry_format} entry")
    if entry.get("fields") != fields:
        raise ValueError("its key fields differ from the ones asked for (graph / cluster / options)")
    return entry


def cached_plan(cache: PlanCache | None, graph: OpGraph, cluster: Cluster, options: PlanOptions,
                progress: Callable[[str], None] | None = None) -> tuple[ParallelPlan, str]:
    """``(plan, source)``: from ``cache`` ('cache') or ``stage_dp.planner.make_plan`` ('search'),
    then stored in the cache."""
    if cache is None:
        return make_plan(graph, cluster, options, progress=progress), "search"
    fields = key_fields(graph, cluster, options)
    hit = cache.get(fields, graph, cluster)
    if hit is not None:
        plan, warnings = hit
        for name, level, message in warnings:
            logging.getLogger(name).log(level, "%s [cached plan]", message)
        if progress is not None:
            progress(f"plan loaded from cache {cache.path(cache_key(fields))}: {plan.summary()}")
        return plan, "cache"
    recorder = _WarningRecorder()
    for name in PLANNER_LOGGERS:
        logging.getLogger(name).addHandler(recorder)
    try:
        plan = make_plan(graph, cluster, options, progress=progress)
    finally:
        for name in PLANNER_LOGGERS:
            logging.getLogger(name).removeHandler(recorder)
    cache.put(fields, plan, recorder.records)
    return plan, "search"


class _WarningRecorder(logging.Handler):
    """Collects the planner's warnings as ``[logger, level, message]``."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[list] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append([record.name, record.levelno, record.getMessage()])
