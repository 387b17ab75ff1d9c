"""``ParallelPlan``: what the planner decided, as data.

Owns the plan record (``ParallelPlan``, ``StagePlan``), its JSON form, its
text table, its validation against a graph and a cluster, the Alpa submesh
tiling (``tile_submeshes``) and the graph fingerprint. Does not search
(``stage_dp.search.plan`` builds plans) or run anything (``runtime``).

Units: a stage's ``time_s``, ``compute_s`` and ``comm_s`` are per microbatch
(the stage DP's t_k, update cost spread over the microbatches); its
``update_s`` is per step; its ``sharding`` (a ``StageSharding``) carries the
ILP's own figures for the whole captured batch. The plan's
``predicted_step_s = compute_s + communication_s + bubble_s``: B × the
slowest stage's compute and communication, plus the pipeline bubble
T - B·t_max = Σ t_k - t_max (Alpa eq. 2).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from .cluster import Cluster, GiB
from .errors import ClusterSpecError, PlanError
from .graph import OpGraph
from .schedule import schedule_named
from .sharding import StageSharding

FORMAT_VERSION = 1


def graph_fingerprint(graph: OpGraph) -> str:
    """16 hex digits of a SHA-256 over the graph's inputs and operators (targets, shapes,
    dtypes, phases, wiring) and its mixed precision (``graph.meta['precision']``, left out
    for fp32 so fp32 fingerprints are unchanged): equal graphs give equal fingerprints
    across processes, and plans (and the plan cache, keyed on it) never mix precisions."""
    h = hashlib.sha256()
    precision = getattr(graph, "meta", {}).get("precision", "fp32")
    if precision != "fp32":
        h.update(repr(("precision", precision)).encode())
    for s in graph.inputs:
        h.update(repr((s.kind, s.name, tuple(s.shape), s.dtype)).encode())
    for name, n in graph.nodes.items():
        h.update(repr((name, n.target, n.shape, n.dtype, n.phase, n.inputs)).encode())
    return h.hexdigest()[:16]


def tile_submeshes(cluster: Cluster, shapes: list[tuple[int, int]]) -> list[tuple[int, ...]]:
    """Device ids of each submesh, tiling the cluster the Alpa way: largest first,
    packed host by host ((n, M) take whole free hosts, (1, m) the first host with m
    free devices). Raises PlanError if they do not fit."""
    per_host = cluster.devices_per_host
    used = [0] * cluster.num_hosts
    out: list[tuple[int, ...] | None] = [None] * len(shapes)
    for k in sorted(range(len(shapes)), key=lambda k: (-shapes[k][0] * shapes[k][1], k)):
        n, m = shapes[k]
        if n > 1 or m == per_host:
            hosts = next((h for h in range(cluster.num_hosts - n + 1)
                          if all(used[h + i] == 0 for i in range(n))), None)
            if hosts is None or m != per_host:
                raise PlanError(f"submeshes {list(shapes)} do not tile the {cluster.num_hosts}x{per_host} "
                                f"cluster: no {n} free whole hosts for {(n, m)}")
            offset = hosts * per_host
            for i in range(n):
                used[hosts + i] = per_host
        else:
            host = next((h for h in range(cluster.num_hosts) if per_host - used[h] >= m), None)
            if host is None:
                raise PlanError(f"submeshes {list(shapes)} do not tile the {cluster.num_hosts}x{per_host} "
                                f"cluster: no host has {m} free devices for {(n, m)}")
            offset = host * per_host + used[host]
            used[host] += m
        out[k] = tuple(cluster.submesh_device_ids((n, m), offset))
    return out  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """One pipeline stage: layers, devices, logical mesh and sharding."""

    index: int
    layer_start: int
    layer_end: int
    """Inclusive."""
    submesh: tuple[int, int]
    """(hosts, devices per host)."""
    device_ids: tuple[int, ...]
    """Global device ids (host-major), row-major into ``logical_mesh``."""
    logical_mesh: tuple[int, int]
    variant: str
    """ILP variant (``stage_dp.stage_costs``): 'fast' (least time), 'lean' (least time
    within a per-layer memory cap) or 'min' (least time near the least memory)."""
    sharding: StageSharding
    time_s: float
    """Per microbatch: compute + comm (the DP's stage cost)."""
    compute_s: float
    comm_s: float
    """Per microbatch: collectives, resharding and the cross-stage transfer."""
    cross_stage_s: float
    """Per microbatch: the part of ``comm_s`` receiving activations / sending gradients."""
    update_s: float
    """Per step: the optimizer part (also inside time_s, divided by the microbatches)."""
    persistent_bytes: float
    activation_bytes: float
    """Per device and microbatch in flight."""
    in_flight: int
    """Microbatches whose activations the stage holds at once (``PipelineSchedule.in_flight``)."""
    memory_bytes: float
    """Peak per device, the runtime's allocations simulated (``stage_dp.memory_sim``; the
    rewritten programs for a stage recomputing layers). The DP's own rule, persistent +
    in_flight × activation, decided feasibility and can be lower."""
    recompute_layers: tuple[int, ...] = ()
    """Layers whose forward the backward recomputes (activation checkpointing,
    ``stage_dp.checkpointing``); their activations count as what they keep, and
    ``persistent_bytes`` includes one recomputed layer's activations."""

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["sharding"] = self.sharding.to_dict()
        return d

    @staticmethod
    def from_dict(d: dict) -> StagePlan:
        d = dict(d)
        d["sharding"] = StageSharding.from_dict(d["sharding"])
        for key in ("submesh", "device_ids", "logical_mesh", "recompute_layers"):
            d[key] = tuple(d.get(key, ()))
        return StagePlan(**d)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelPlan:
    """A whole plan: pipeline stages over the layers, each sharded on its submesh."""

    stages: tuple[StagePlan, ...]
    schedule: str
    """The pipeline schedule's name (``alpa_torch.core.schedule.schedule_named``)."""
    num_microbatches: int
    num_layers: int
    layer_of: dict[str, int]
    """Layer of every graph node; stage k runs the nodes with layer in its range."""
    predicted_step_s: float
    compute_s: float
    communication_s: float
    bubble_s: float
    peak_memory_bytes: float
    """Largest per-device memory over the stages."""
    memory_budget_bytes: float
    cluster: dict
    """``Cluster.to_dict()``."""
    cluster_description: str
    graph_fingerprint: str
    options: dict = field(default_factory=dict)
    """Planner options and statistics (plan_s, ILPs solved, ...), JSON-native values."""
    format_version: int = FORMAT_VERSION

    # --------------------------------------------------------------- queries
    def stage_nodes(self, index: int) -> list[str]:
        """Graph node names (placeholders included) that stage ``index`` owns."""
        st = self.stages[index]
        return [n for n, l in self.layer_of.items() if st.layer_start <= l <= st.layer_end]

    # --------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stages"] = [s.to_dict() for s in self.stages]
        return d

    @staticmethod
    def from_dict(d: dict) -> ParallelPlan:
        d = dict(d)
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise PlanError(f"plan format version {version!r} is not supported (this alpa-torch reads "
                            f"{FORMAT_VERSION}); re-plan with this version")
        d["stages"] = tuple(StagePlan.from_dict(s) for s in d["stages"])
        return ParallelPlan(**d)

    def to_json(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")

    @staticmethod
    def from_json(path: str | os.PathLike[str]) -> ParallelPlan:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise PlanError(f"{str(path)!r} is not a plan file (invalid JSON: {exc})") from exc
        return ParallelPlan.from_dict(data)

    # --------------------------------------------------------------- printing
    def table(self) -> str:
        """A text table: one row per stage, then the predicted step time."""
        head = ("stage", "layers", "submesh", "devices", "mesh", "ILP", "t/mb ms", "compute ms",
                "comm ms", "update ms", "mem GiB", "recompute")
        rows = [head]
        for s in self.stages:
            rows.append((str(s.index), f"{s.layer_start}-{s.layer_end}", f"{s.submesh[0]}x{s.submesh[1]}",
                         _ranges(s.device_ids), f"{s.logical_mesh[0]}x{s.logical_mesh[1]}", s.variant,
                         f"{s.time_s * 1e3:.3f}", f"{s.compute_s * 1e3:.3f}", f"{s.comm_s * 1e3:.3f}",
                         f"{s.update_s * 1e3:.3f}", f"{s.memory_bytes / GiB:.3f}",
                         _ranges(s.recompute_layers) or "-"))
        lines = text_table(rows)
        lines.append(f"step {self.predicted_step_s * 1e3:.3f} ms = compute {self.compute_s * 1e3:.3f} + "
                     f"comm {self.communication_s * 1e3:.3f} + bubble {self.bubble_s * 1e3:.3f}; "
                     f"{self.num_microbatches} microbatches, {self.schedule}, {self.num_layers} layers; "
                     f"peak {self.peak_memory_bytes / GiB:.3f} of {self.memory_budget_bytes / GiB:.3f} GiB")
        lines.append(self.cluster_description)
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: stages as layers@submesh/mesh."""
        parts = [f"L{s.layer_start}-{s.layer_end}@{s.submesh[0]}x{s.submesh[1]}/"
                 f"{s.logical_mesh[0]}x{s.logical_mesh[1]}"
                 + (f" ckpt {_ranges(s.recompute_layers)}" if s.recompute_layers else "") for s in self.stages]
        return f"B={self.num_microbatches} " + " | ".join(parts)

    @property
    def recompute_layers(self) -> tuple[int, ...]:
        """Every layer whose forward the backward recomputes, over all stages."""
        return tuple(l for s in self.stages for l in s.recompute_layers)

    # --------------------------------------------------------------- checks
    def validate(self, graph: OpGraph, cluster: Cluster) -> None:
        """Raise ``PlanError`` unless this plan fits ``graph`` and ``cluster``."""
        fp = graph_fingerprint(graph)
        if fp != self.graph_fingerprint:
            raise PlanError(f"the plan was made for another graph (fingerprint {self.graph_fingerprint}, "
                            f"this graph {fp}): the model, optimizer or batch shapes changed; re-plan")
        if (cluster.num_hosts, cluster.devices_per_host) != (self.cluster.get("num_hosts"),
                                                             self.cluster.get("devices_per_host")):
            raise PlanError(f"the plan was made for a {self.cluster.get('num_hosts')}x"
                            f"{self.cluster.get('devices_per_host')} cluster, this one is "
                            f"{cluster.num_hosts}x{cluster.devices_per_host}; re-plan for it")
        schedule_named(self.schedule)  # raises on an unknown name
        if self.num_microbatches < 1:
            raise PlanError(f"num_microbatches {self.num_microbatches} invalid: use >= 1 microbatch")
        self._check_layers(graph)
        self._check_tiling(cluster)

    def _check_layers(self, graph) -> None:
        expect = 0
        for s in self.stages:
            if s.layer_start != expect or s.layer_end < s.layer_start:
                raise PlanError(f"stage {s.index} covers layers {s.layer_start}-{s.layer_end}, but the next "
                                f"uncovered layer is {expect}: stages must cover layers 0..{self.num_layers - 1} "
                                "contiguously, each once, in order")
            expect = s.layer_end + 1
        if expect != self.num_layers:
            raise PlanError(f"stages cover layers 0..{expect - 1} of 0..{self.num_layers - 1}")
        names = [n.name for n in graph.gm.graph.nodes if n.op in ("placeholder", "call_function")]
        missing = [n for n in names if n not in self.layer_of]
        bad = {n: l for n, l in self.layer_of.items() if not 0 <= l < self.num_layers}
        if missing or bad:
            raise PlanError(f"layer_of misses nodes {missing[:5]} or has layers out of range "
                            f"{dict(list(bad.items())[:5])}")

    def _check_tiling(self, cluster) -> None:
        seen: set[int] = set()
        for s in self.stages:
            try:
                expect = cluster.submesh_device_ids(s.submesh, s.device_ids[0] if s.device_ids else -1)
            except ClusterSpecError as exc:
                raise PlanError(f"stage {s.index}: submesh {s.submesh} at devices {s.device_ids} is not a "
                                f"submesh of this cluster ({exc})") from exc
            if tuple(expect) != tuple(s.device_ids):
                raise PlanError(f"stage {s.index}: devices {s.device_ids} are not the {s.submesh} submesh "
                                f"starting at device {s.device_ids[0]} ({tuple(expect)})")
            if s.logical_mesh[0] * s.logical_mesh[1] != len(s.device_ids):
                raise PlanError(f"stage {s.index}: logical mesh {s.logical_mesh} does not have "
                                f"{len(s.device_ids)} devices")
            overlap = seen & set(s.device_ids)
            if overlap:
                raise PlanError(f"stage {s.index} reuses devices {sorted(overlap)}: submeshes must not overlap")
            seen |= set(s.device_ids)
        if seen != set(range(cluster.num_devices)):
            raise PlanError(f"the submeshes leave devices {sorted(set(range(cluster.num_devices)) - seen)} "
                            "idle: they must tile the whole cluster")


def text_table(rows, indent: str = "") -> list[str]:
    """Rows of strings as lines of left-aligned columns two spaces apart, each after ``indent``."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _ranges(ids) -> str:
    """(0, 1, 2, 3, 8, 9) -> '0-3,8-9'."""
    out, start = [], None
    for k, d in enumerate(ids):
        if start is None:
            start = d
        if k + 1 == len(ids) or ids[k + 1] != d + 1:
            out.append(f"{start}-{d}" if d != start else f"{d}")
            start = None
    return ",".join(out)
