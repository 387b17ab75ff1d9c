"""From a captured graph (or one pipeline stage of it) to a solved ``StageSharding``.

``build_stage_instance`` turns the operators of a stage into an ``ILPInstance``:

- one ILP node per value: every operator (strategies from ``strategies.py``),
  and every value the stage reads but does not compute (parameters, optimizer
  state, batch, values from other stages), whose choices are its specs;
- node cost = compute time of the operator's local share (roofline);
- one edge per operator input: the resharding cost from each producer spec to
  the spec each consumer strategy wants (``cost_model.reshard_matrix_s``);
- an edge from each updated parameter / optimizer state / buffer back to its
  stored input: storing it in another layout costs a reshard every step;
- ``getitem`` of a multi-output operator follows its producer (a Follower);
- one memory point (the forward/backward boundary, where training peaks):
  parameters, optimizer state and buffers, gradients, and forward values the
  backward reads.

``solve_stage`` solves it (``ilp.solve_instance``) and returns the
``StageSharding``: a spec for every value and the input specs of every
operator, which the runtime executes as is.
"""

from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx

from . import cost_model as cm
from .instance import Follower, ILPEdge, ILPInstance, ILPNode
from .spec import ShardingSpec
from .strategies import Strategy, node_strategies, source_specs

GRAD_MARKER_NAME = "alpa.grad.default"


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSharding:
    """The intra-op plan of one stage on one logical mesh."""

    mesh_shape: tuple[int, int]
    value_specs: dict
    """value (fx node) name -> spec of its (first) tensor output."""
    input_specs: dict
    """operator name -> spec of each unique tensor input (``all_input_nodes`` order)."""
    compute_s: float
    comm_s: float
    reshard_s: float
    persistent_bytes: float
    """Per device: parameters, optimizer state, buffers, gradients."""
    activation_bytes: float
    """Per device and microbatch in flight: forward values kept for backward."""
    solver_status: str = "optimal"
    gap: float = 0.0
    build_s: float = 0.0
    solve_s: float = 0.0
    num_vars: int = 0
    num_constraints: int = 0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.reshard_s

    def memory_bytes(self, in_flight: int = 1) -> float:
        return self.persistent_bytes + in_flight * self.activation_bytes

    def to_dict(self) -> dict:
        d = {f: getattr(self, f) for f in self.__slots__ if f not in ("value_specs", "input_specs")}
        d["mesh_shape"] = list(self.mesh_shape)
        d["value_specs"] = {k: str(v) for k, v in self.value_specs.items()}
        d["input_specs"] = {k: [str(s) for s in v] for k, v in self.input_specs.items()}
        return d

    @staticmethod
    def from_dict(d: dict) -> "StageSharding":
        d = dict(d)
        d["mesh_shape"] = tuple(d["mesh_shape"])
        d["value_specs"] = {k: ShardingSpec.parse(v) for k, v in d["value_specs"].items()}
        d["input_specs"] = {k: tuple(ShardingSpec.parse(s) for s in v) for k, v in d["input_specs"].items()}
        return StageSharding(**d)


def _val(node: fx.Node):
    return node.meta.get("val")


def _itemsize(v: torch.Tensor) -> int:
    return v.element_size()


def _local_fraction(st: Strategy, shapes: list, mesh_shape) -> float:
    """Share of the operator's work one device does: the smallest local share of any
    of its tensors (a partial-sum output holds a full-size summand, so it counts 1)."""
    frac = 1.0
    for spec, shape in zip(st.inputs + st.outputs, shapes):
        if spec is None or shape is None or spec.has_partial and spec in st.outputs:
            continue
        full = max(math.prod(shape), 1)
        frac = min(frac, spec.local_numel(shape, mesh_shape) / full)
    return frac


class _Builder:
    def __init__(self, graph, mesh: cm.MeshCost, names: set[str] | None):
        self.graph, self.mesh = graph, mesh
        self.gm_nodes = {n.name: n for n in graph.gm.graph.nodes}
        calls = [n for n in graph.gm.graph.nodes if n.op == "call_function"]
        self.ops = [n for n in calls if names is None or n.name in names]
        op_names = {n.name for n in self.ops}
        sources = {a.name for n in self.ops for a in n.all_input_nodes if a.name not in op_names}
        self.order = [n.name for n in graph.gm.graph.nodes if n.name in sources or n.name in op_names]
        self.index = {name: i for i, name in enumerate(self.order)}
        self.options: dict[str, list[Strategy]] = {}
        self.followers: list[Follower] = []

    def out_spec(self, name: str, k: int) -> ShardingSpec | None:
        return self.options[name][k].outputs[0] if self.options[name][k].outputs else None

    def strategies(self) -> None:
        for name in self.order:
            node = self.gm_nodes[name]
            if node.op != "call_function":
                self.options[name] = [Strategy((), (s,)) for s in source_specs(_val(node), 2)]
            elif node.target is operator.getitem:
                self._getitem(node)
            elif str(node.target) == GRAD_MARKER_NAME:
                src = node.all_input_nodes[0]
                specs = source_specs(_val(src), 2, allow_partial=True)
                self.options[name] = [Strategy((s,), (s,)) for s in specs]
            else:
                self.options[name] = node_strategies(node, self.mesh.mesh_shape)

    def _getitem(self, node: fx.Node) -> None:
        producer, idx = node.args
        outs, mapping = [], []
        for st in self.options[producer.name]:
            spec = st.outputs[idx] if idx < len(st.outputs) else None
            spec = spec or ShardingSpec.replicated(2)
            if spec not in outs:
                outs.append(spec)
            mapping.append(outs.index(spec))
        self.options[node.name] = [Strategy((), (s,)) for s in outs]
        self.followers.append(Follower(self.index[node.name], self.index[producer.name], np.array(mapping)))

    def ilp_nodes(self) -> list[ILPNode]:
        out = []
        for name in self.order:
            node, opts = self.gm_nodes[name], self.options[name]
            val = _val(node)
            mem = [self._bytes(s.outputs[0] if s.outputs else None, val) for s in opts]
            comp = np.zeros(len(opts))
            if node.op == "call_function" and name in self.graph.nodes:
                facts = self.graph.nodes[name]
                shapes = [tuple(_val(a).shape) for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor)]
                shapes += [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in _as_list(val)]
                for k, st in enumerate(opts):
                    frac = _local_fraction(st, shapes, self.mesh.mesh_shape)
                    comp[k] = cm.compute_s(self.mesh, facts.flops * frac, (facts.bytes_read + facts.bytes_written) * frac)
            out.append(ILPNode(name=name, strategy_names=tuple(s.name for s in opts), compute_s=comp,
                               comm_s=np.zeros(len(opts)), memory_bytes=np.array(mem, dtype=float)))
        return out

    def _bytes(self, spec, val) -> float:
        if spec is None or not isinstance(val, torch.Tensor):
            return 0.0
        return float(cm.bytes_per_device(spec, tuple(val.shape), _itemsize(val), self.mesh.mesh_shape))

    def edges(self) -> list[ILPEdge]:
        out = []
        for node in self.ops:
            if node.target is operator.getitem:
                continue
            inputs = [a for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor)]
            for j, src in enumerate(inputs):
                out.append(self._edge(src.name, node.name, [st.inputs[j] for st in self.options[node.name]]))
        for spec in self.graph.outputs:
            stored = next((s for s in self.graph.inputs if s.kind == spec.kind and s.name == spec.name), None)
            if stored is None or spec.node == stored.node or spec.node not in self.index or stored.node not in self.index:
                continue
            out.append(self._edge(spec.node, stored.node, [s.outputs[0] for s in self.options[stored.node]]))
        return out

    def _edge(self, src: str, dst: str, dst_specs: list[ShardingSpec]) -> ILPEdge:
        val = _val(self.gm_nodes[src])
        src_specs = [self.out_spec(src, k) or ShardingSpec.replicated(2) for k in range(len(self.options[src]))]
        matrix = cm.reshard_matrix_s(self.mesh, src_specs, dst_specs, tuple(val.shape), _itemsize(val))
        return ILPEdge(self.index[src], self.index[dst], matrix)

    def memory_point(self) -> tuple[list[int], list[int]]:
        """(persistent, activation) ILP node indices live at the forward/backward boundary."""
        persistent = [self.index[s.node] for s in self.graph.inputs
                      if s.kind in ("param", "opt_state", "buffer") and s.node in self.index]
        persistent += [self.index[n] for n in self.graph.grad_of.values() if n in self.index]
        saved = set()
        for name in self.order:
            facts = self.graph.nodes.get(name)
            if facts is None or facts.phase != "backward":
                continue
            for a in facts.inputs:
                base = self._storage_root(a)
                if base in self.graph.nodes and self.graph.nodes[base].phase == "forward" and base in self.index:
                    saved.add(self.index[base])
        return persistent, sorted(saved)

    def _storage_root(self, name: str) -> str:
        while name in self.graph.nodes and self.graph.nodes[name].is_view:
            node = self.gm_nodes[name]
            name = node.all_input_nodes[0].name
        return name


def _as_list(val):
    return list(val) if isinstance(val, (list, tuple)) else [val]


def build_stage_instance(graph, mesh: cm.MeshCost, *, names: set[str] | None = None,
                         memory_budget_bytes: float = math.inf):
    """The ILP of the operators ``names`` (all when None) on ``mesh``; returns (instance, builder)."""
    b = _Builder(graph, mesh, names)
    b.strategies()
    nodes = b.ilp_nodes()
    persistent, saved = b.memory_point()
    instance = ILPInstance(
        nodes=tuple(nodes), edges=tuple(b.edges()), liveness=(tuple(sorted(set(persistent) | set(saved))),),
        followers=tuple(b.followers), memory_budget_bytes=memory_budget_bytes,
        metadata={"model": graph.meta.get("model", ""), "mesh_shape": list(mesh.mesh_shape)},
    )
    b.memory_rows = (persistent, saved)
    return instance, b


def solve_stage(graph, mesh: cm.MeshCost, *, names: set[str] | None = None,
                memory_budget_bytes: float = math.inf, time_limit_s: float = 60.0,
                mip_gap: float = 0.01) -> StageSharding:
    """Solve the sharding of a stage (``names``) on ``mesh``."""
    from .ilp import solve_instance

    t0 = time.perf_counter()
    instance, b = build_stage_instance(graph, mesh, names=names, memory_budget_bytes=memory_budget_bytes)
    build_s = time.perf_counter() - t0
    sol = solve_instance(instance, time_limit_s=time_limit_s, mip_gap=mip_gap)
    chosen = {name: b.options[name][k] for name, k in zip(b.order, sol.strategy_index)}
    persistent, saved = b.memory_rows
    mem = [instance.nodes[i].memory_bytes[sol.strategy_index[i]] for i in range(len(instance.nodes))]
    return StageSharding(
        mesh_shape=tuple(mesh.mesh_shape),
        value_specs={n: st.outputs[0] for n, st in chosen.items() if st.outputs and st.outputs[0] is not None},
        input_specs={n: st.inputs for n, st in chosen.items() if b.gm_nodes[n].op == "call_function"},
        compute_s=sol.compute_s, comm_s=sol.comm_s, reshard_s=sol.reshard_s,
        persistent_bytes=float(sum(mem[i] for i in persistent)),
        activation_bytes=float(sum(mem[i] for i in saved)),
        solver_status=sol.status, gap=sol.gap, build_s=build_s + sol.build_s, solve_s=sol.solve_s,
        num_vars=sol.num_vars, num_constraints=sol.num_constraints,
    )
