"""The intra-op sharding ILP as data: ``ILPInstance``, its JSON and ``.npz`` files.

This module owns the *abstract* problem the intra-op planner solves, nothing
about PyTorch: the graph-side builder turns a traced graph (each node with a list
of candidate sharding strategies, costed by the cost model) into an
``ILPInstance``; ``reduce.py`` shrinks it, ``ilp.py`` builds and solves the
Pyomo model, ``solve.py`` is the command line. Pure numpy, no torch.

The problem
-----------
Choose one strategy ``s_v`` in ``0..k_v-1`` for every node ``v`` to minimise::

    sum_v  compute_s[v][s_v] + comm_s[v][s_v]  +  sum_(u->v)  reshard_s[u->v][s_u, s_v]

subject to

- memory, at every liveness point ``t``:
  ``constant_memory_bytes + sum_{v in liveness[t]} memory_bytes[v][s_v] <= memory_budget_bytes``
  (a node listed twice at one point counts twice; the budget may be ``inf``);
- followers ``(f, l, mapping)``: ``s_f == mapping[s_l]``, and ``mapping[s_l] == -1``
  forbids that strategy of the leader (elementwise ops, views, aliases);
- tie groups: every member takes the same strategy index (repeated layers).

Costs and memory must be finite (memory >= 0): to forbid a strategy, leave it
out or forbid it through a follower mapping. An edge ``u -> u`` prices the
diagonal ``reshard_s[s_u, s_u]``; parallel edges add up.

File formats (both round-trip exactly; float64 values, ``int`` indices)
-----------------------------------------------------------------------
JSON (``.json``), one object::

    {"format": "alpa-torch/intra-ilp-instance", "version": 1,
     "metadata": {...any JSON...},
     "constant_memory_bytes": 0.0,
     "memory_budget_bytes": 1.6e10,          # null = unlimited (inf)
     "nodes": [{"name": "mm_3", "strategies": ["RS(1)", ...],   # k_v names
                "compute_s": [k_v floats], "comm_s": [k_v floats],
                "memory_bytes": [k_v floats]}, ...],
     "edges": [{"src": 0, "dst": 3,                              # node indices
                "reshard_s": [[k_dst floats], ...k_src rows]}, ...],
     "liveness": [[node indices live at point 0], ...],
     "followers": [{"follower": 4, "leader": 3, "mapping": [k_leader ints]}, ...],
     "tie_groups": [[node indices], ...]}

``reshard_s`` is row-major: row ``a`` (the producer's strategy) has ``k_dst``
entries. Floats are written with Python's shortest round-trip ``repr``; the
file never contains NaN or Infinity (an unlimited budget is ``null``).

NPZ (``.npz``, ``numpy.load(path, allow_pickle=False)``); ragged lists are CSR
pairs ``*_offsets`` (int64, length n+1) + flat values::

    format_version          int64 scalar (1)
    metadata_json           str scalar (the metadata as JSON text)
    constant_memory_bytes, memory_budget_bytes   float64 scalars (inf allowed)
    node_names              str [N]
    strategy_offsets        int64 [N+1]; node v owns entries offsets[v]:offsets[v+1] of
    strategy_names (str), compute_s, comm_s, memory_bytes (float64)   [sum k_v]
    edge_src, edge_dst      int64 [E]
    reshard_offsets         int64 [E+1]; reshard_s float64 flat, row-major k_src x k_dst
    liveness_offsets, liveness_nodes          int64
    follower, leader        int64 [F]; mapping_offsets int64 [F+1], mapping int64
    tie_offsets, tie_nodes  int64
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_NAME = "alpa-torch/intra-ilp-instance"
FORMAT_VERSION = 1


def _frozen_array(values: Any, dtype: type, ndim: int, what: str) -> np.ndarray:
    arr = np.array(values, dtype=dtype, copy=True)
    if arr.ndim != ndim:
        raise ValueError(f"{what} must be {ndim}-D, got shape {arr.shape}")
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, slots=True, eq=False)
class ILPNode:
    """One graph node and its candidate strategies (k of them)."""

    name: str
    """Unique node name (e.g. the fx node name)."""
    strategy_names: tuple[str, ...]
    """Printable name of each strategy, e.g. ``'S(0)R -> RS(1)'``."""
    compute_s: np.ndarray
    """float64 [k]: compute time of the node under each strategy."""
    comm_s: np.ndarray
    """float64 [k]: collective time inside the node (e.g. a Partial all-reduce)."""
    memory_bytes: np.ndarray
    """float64 [k]: bytes the node's output occupies per device while live."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "strategy_names", tuple(str(s) for s in self.strategy_names))
        k = len(self.strategy_names)
        if k == 0:
            raise ValueError(f"node {self.name!r} has no candidate strategy")
        for attr in ("compute_s", "comm_s", "memory_bytes"):
            arr = _frozen_array(getattr(self, attr), np.float64, 1, f"node {self.name!r} {attr}")
            if arr.shape != (k,):
                raise ValueError(f"node {self.name!r} {attr} has shape {arr.shape}, expected ({k},)")
            if not np.all(np.isfinite(arr)):
                raise ValueError(f"node {self.name!r} {attr} must be finite, got {arr.tolist()}")
            set_(self, attr, arr)
        if np.any(self.memory_bytes < 0):
            raise ValueError(f"node {self.name!r} memory_bytes must be >= 0, got {self.memory_bytes.tolist()}")

    @property
    def num_strategies(self) -> int:
        return len(self.strategy_names)


@dataclass(frozen=True, slots=True, eq=False)
class ILPEdge:
    """Producer ``src`` feeds consumer ``dst``; resharding cost per strategy pair."""

    src: int
    dst: int
    reshard_s: np.ndarray
    """float64 [k_src, k_dst]: time to reshard src's output into dst's input spec."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "src", int(self.src))
        object.__setattr__(self, "dst", int(self.dst))
        arr = _frozen_array(self.reshard_s, np.float64, 2, f"edge {self.src}->{self.dst} reshard_s")
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"edge {self.src}->{self.dst} reshard_s must be finite")
        object.__setattr__(self, "reshard_s", arr)


@dataclass(frozen=True, slots=True, eq=False)
class Follower:
    """``s_follower == mapping[s_leader]``; ``-1`` forbids that leader strategy."""

    follower: int
    leader: int
    mapping: np.ndarray
    """int64 [k_leader] -> follower strategy index, or -1."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "follower", int(self.follower))
        object.__setattr__(self, "leader", int(self.leader))
        object.__setattr__(self, "mapping", _frozen_array(self.mapping, np.int64, 1, "follower mapping"))


@dataclass(frozen=True, slots=True, eq=False, kw_only=True)
class ILPInstance:
    """A whole intra-op sharding problem; see the module docstring for the maths."""

    nodes: tuple[ILPNode, ...]
    edges: tuple[ILPEdge, ...] = ()
    liveness: tuple[tuple[int, ...], ...] = ()
    """Node indices live at each time point (one memory constraint per point)."""
    followers: tuple[Follower, ...] = ()
    """Nodes whose strategy is a function of a leader's (may also be given as tuples)."""
    tie_groups: tuple[tuple[int, ...], ...] = ()
    """Groups of nodes taking the same strategy index (same k, same strategy names)."""
    constant_memory_bytes: float = 0.0
    """Bytes per device counted at every liveness point (e.g. runtime buffers)."""
    memory_budget_bytes: float = math.inf
    """Device memory available to the plan; ``inf`` disables the memory constraints."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Free-form JSON-serialisable description (model name, mesh shape, ...)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "nodes", tuple(self.nodes))
        set_(self, "edges", tuple(e if isinstance(e, ILPEdge) else ILPEdge(*e) for e in self.edges))
        set_(self, "liveness", tuple(tuple(int(v) for v in t) for t in self.liveness))
        set_(self, "followers", tuple(f if isinstance(f, Follower) else Follower(*f) for f in self.followers))
        set_(self, "tie_groups", tuple(tuple(int(v) for v in g) for g in self.tie_groups))
        set_(self, "constant_memory_bytes", float(self.constant_memory_bytes))
        set_(self, "memory_budget_bytes", float(self.memory_budget_bytes))
        set_(self, "metadata", dict(self.metadata))
        self._validate()

    def _validate(self) -> None:
        n, ks = len(self.nodes), self.num_strategies
        names = [v.name for v in self.nodes]
        if len(set(names)) != n:
            dup = sorted({x for x in names if names.count(x) > 1})
            raise ValueError(f"node names must be unique; duplicates: {dup}")

        def check(v: int, what: str) -> None:
            if not 0 <= v < n:
                raise ValueError(f"{what} refers to node {v}, but there are {n} nodes")

        for e in self.edges:
            check(e.src, "edge src"), check(e.dst, "edge dst")
            if e.reshard_s.shape != (ks[e.src], ks[e.dst]):
                raise ValueError(f"edge {e.src}->{e.dst} reshard_s shape {e.reshard_s.shape} "
                                 f"!= ({ks[e.src]}, {ks[e.dst]})")
        for t, live in enumerate(self.liveness):
            for v in live:
                check(v, f"liveness[{t}]")
        for f in self.followers:
            check(f.follower, "follower"), check(f.leader, "leader")
            if f.follower == f.leader:
                raise ValueError(f"node {f.follower} is listed as its own follower")
            if f.mapping.shape != (ks[f.leader],) or np.any(f.mapping < -1) or np.any(f.mapping >= ks[f.follower]):
                raise ValueError(f"follower {f.follower} of {f.leader}: mapping {f.mapping.tolist()} must have "
                                 f"{ks[f.leader]} entries in [-1, {ks[f.follower]})")
        for g in self.tie_groups:
            for v in g:
                check(v, "tie group")
            if len(set(g)) != len(g):
                raise ValueError(f"tie group {list(g)} lists a node twice")
            if len({self.nodes[v].strategy_names for v in g}) > 1:
                raise ValueError(f"tie group {list(g)} mixes nodes with different strategy lists")
        if self.constant_memory_bytes < 0 or not self.memory_budget_bytes > 0:
            raise ValueError(f"need constant_memory_bytes >= 0 and memory_budget_bytes > 0, got "
                             f"{self.constant_memory_bytes} and {self.memory_budget_bytes}")

    # ------------------------------------------------------------------ queries
    @property
    def num_strategies(self) -> tuple[int, ...]:
        return tuple(v.num_strategies for v in self.nodes)

    def cost_parts(self, strategy_index: Sequence[int]) -> dict[str, float]:
        """Objective of a full assignment, split into ``compute_s``, ``comm_s``, ``reshard_s``."""
        s = strategy_index
        compute = math.fsum(float(v.compute_s[s[i]]) for i, v in enumerate(self.nodes))
        comm = math.fsum(float(v.comm_s[s[i]]) for i, v in enumerate(self.nodes))
        reshard = math.fsum(float(e.reshard_s[s[e.src], s[e.dst]]) for e in self.edges)
        return {"compute_s": compute, "comm_s": comm, "reshard_s": reshard}

    def memory_at(self, strategy_index: Sequence[int]) -> list[float]:
        """Bytes per device at each liveness point (``constant_memory_bytes`` included)."""
        mem = [float(v.memory_bytes[strategy_index[i]]) for i, v in enumerate(self.nodes)]
        return [self.constant_memory_bytes + math.fsum(mem[v] for v in live) for live in self.liveness]

    def peak_memory_bytes(self, strategy_index: Sequence[int]) -> float:
        return max(self.memory_at(strategy_index), default=self.constant_memory_bytes)

    def violations(self, strategy_index: Sequence[int]) -> list[str]:
        """Follower and tie constraints the assignment breaks (memory not checked)."""
        s, out = strategy_index, []
        for f in self.followers:
            if f.mapping[s[f.leader]] == -1 or s[f.follower] != f.mapping[s[f.leader]]:
                out.append(f"follower {f.follower} of {f.leader}")
        for g in self.tie_groups:
            if len({s[v] for v in g}) > 1:
                out.append(f"tie group {list(g)}")
        return out

    # ----------------------------------------------------------------- equality
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ILPInstance):
            return NotImplemented
        return _to_json_obj(self) == _to_json_obj(other)

    __hash__ = None  # type: ignore[assignment]

    # ----------------------------------------------------------------- file I/O
    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(_to_json_obj(self), allow_nan=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @staticmethod
    def from_json(text_or_path: str | Path) -> ILPInstance:
        text = str(text_or_path)
        if isinstance(text_or_path, Path) or not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        return _from_json_obj(json.loads(text))

    def save(self, path: str | Path) -> None:
        """Write ``.json`` or ``.npz`` (chosen by the suffix)."""
        path = Path(path)
        if path.suffix == ".json":
            self.to_json(path)
        elif path.suffix == ".npz":
            save_npz(self, path)
        else:
            raise ValueError(f"instance file must end in .json or .npz, got {path}")

    @staticmethod
    def load(path: str | Path) -> ILPInstance:
        path = Path(path)
        if path.suffix == ".npz":
            return load_npz(path)
        if path.suffix == ".json":
            return ILPInstance.from_json(path)
        raise ValueError(f"instance file must end in .json or .npz, got {path}")


def _floats(arr: np.ndarray) -> list:
    return arr.tolist()  # tolist() gives Python floats; json writes their round-trip repr


def _to_json_obj(inst: ILPInstance) -> dict:
    budget = inst.memory_budget_bytes
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "metadata": inst.metadata,
        "constant_memory_bytes": inst.constant_memory_bytes,
        "memory_budget_bytes": None if math.isinf(budget) else budget,
        "nodes": [{"name": v.name, "strategies": list(v.strategy_names), "compute_s": _floats(v.compute_s),
                   "comm_s": _floats(v.comm_s), "memory_bytes": _floats(v.memory_bytes)} for v in inst.nodes],
        "edges": [{"src": e.src, "dst": e.dst, "reshard_s": _floats(e.reshard_s)} for e in inst.edges],
        "liveness": [list(t) for t in inst.liveness],
        "followers": [{"follower": f.follower, "leader": f.leader, "mapping": f.mapping.tolist()}
                      for f in inst.followers],
        "tie_groups": [list(g) for g in inst.tie_groups],
    }


def _from_json_obj(obj: dict) -> ILPInstance:
    if obj.get("format") != FORMAT_NAME or obj.get("version") != FORMAT_VERSION:
        raise ValueError(f"not an intra-ILP instance v{FORMAT_VERSION}: format={obj.get('format')!r} "
                         f"version={obj.get('version')!r}")
    budget = obj.get("memory_budget_bytes")
    return ILPInstance(
        nodes=[ILPNode(n["name"], n["strategies"], n["compute_s"], n["comm_s"], n["memory_bytes"])
               for n in obj["nodes"]],
        edges=[ILPEdge(e["src"], e["dst"], np.array(e["reshard_s"], dtype=np.float64).reshape(
            len(obj["nodes"][e["src"]]["strategies"]), len(obj["nodes"][e["dst"]]["strategies"])))
               for e in obj["edges"]],
        liveness=obj.get("liveness", []),
        followers=[Follower(f["follower"], f["leader"], f["mapping"]) for f in obj.get("followers", [])],
        tie_groups=obj.get("tie_groups", []),
        constant_memory_bytes=obj.get("constant_memory_bytes", 0.0),
        memory_budget_bytes=math.inf if budget is None else budget,
        metadata=obj.get("metadata", {}),
    )


def _csr(lists: Sequence[Sequence], dtype: type) -> tuple[np.ndarray, np.ndarray]:
    parts = [np.asarray(x, dtype=dtype).ravel() for x in lists]  # matrices flatten row-major
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(x) for x in parts])
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype)
    return offsets, flat.astype(dtype, copy=False)


def _split(offsets: np.ndarray, flat: np.ndarray) -> list[np.ndarray]:
    return [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def save_npz(inst: ILPInstance, path: str | Path) -> None:
    """Write ``inst`` as the ``.npz`` layout described in the module docstring."""
    nodes = inst.nodes
    s_off, s_names = _csr([v.strategy_names for v in nodes], np.str_)
    _, compute = _csr([v.compute_s for v in nodes], np.float64)
    _, comm = _csr([v.comm_s for v in nodes], np.float64)
    _, memory = _csr([v.memory_bytes for v in nodes], np.float64)
    r_off, reshard = _csr([e.reshard_s for e in inst.edges], np.float64)
    l_off, l_nodes = _csr(inst.liveness, np.int64)
    m_off, mapping = _csr([f.mapping for f in inst.followers], np.int64)
    t_off, t_nodes = _csr(inst.tie_groups, np.int64)
    np.savez(
        path, format_version=np.int64(FORMAT_VERSION), metadata_json=np.str_(json.dumps(inst.metadata)),
        constant_memory_bytes=np.float64(inst.constant_memory_bytes),
        memory_budget_bytes=np.float64(inst.memory_budget_bytes),
        node_names=np.array([v.name for v in nodes], dtype=np.str_), strategy_offsets=s_off,
        strategy_names=s_names, compute_s=compute, comm_s=comm, memory_bytes=memory,
        edge_src=np.array([e.src for e in inst.edges], np.int64),
        edge_dst=np.array([e.dst for e in inst.edges], np.int64),
        reshard_offsets=r_off, reshard_s=reshard, liveness_offsets=l_off, liveness_nodes=l_nodes,
        follower=np.array([f.follower for f in inst.followers], np.int64),
        leader=np.array([f.leader for f in inst.followers], np.int64),
        mapping_offsets=m_off, mapping=mapping, tie_offsets=t_off, tie_nodes=t_nodes)


def load_npz(path: str | Path) -> ILPInstance:
    with np.load(path, allow_pickle=False) as z:
        if int(z["format_version"]) != FORMAT_VERSION:
            raise ValueError(f"{path}: npz format_version {int(z['format_version'])} != {FORMAT_VERSION}")
        s_off = z["strategy_offsets"]
        names, comp, comm, mem = (_split(s_off, z[k])
                                  for k in ("strategy_names", "compute_s", "comm_s", "memory_bytes"))
        nodes = [ILPNode(str(nm), [str(s) for s in names[i]], comp[i], comm[i], mem[i])
                 for i, nm in enumerate(z["node_names"])]
        ks = np.diff(s_off)
        flat_edges = _split(z["reshard_offsets"], z["reshard_s"])
        edges = [ILPEdge(int(u), int(v), flat_edges[j].reshape(ks[u], ks[v]))
                 for j, (u, v) in enumerate(zip(z["edge_src"], z["edge_dst"]))]
        maps = _split(z["mapping_offsets"], z["mapping"])
        followers = [Follower(int(f), int(l), maps[i]) for i, (f, l) in enumerate(zip(z["follower"], z["leader"]))]
        return ILPInstance(
            nodes=nodes, edges=edges,
            liveness=[t.tolist() for t in _split(z["liveness_offsets"], z["liveness_nodes"])],
            followers=followers, tie_groups=[g.tolist() for g in _split(z["tie_offsets"], z["tie_nodes"])],
            constant_memory_bytes=float(z["constant_memory_bytes"]),
            memory_budget_bytes=float(z["memory_budget_bytes"]), metadata=json.loads(str(z["metadata_json"])))
