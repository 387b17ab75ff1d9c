"""From a captured graph (or one pipeline stage of it) to a solved ``StageSharding``.

``build_stage_instance`` turns the operators of a stage into an ``ILPInstance``:

- one ILP node per value: every operator (strategies from ``strategies.py``),
  and every value the stage reads but does not compute (parameters, optimizer
  state, batch, values from other stages), whose choices are its specs;
- node cost = compute time of the operator's local share (roofline: the FLOP
  share of the strategy, the bytes it really reads and writes, ``_local_work``)
  plus the mesh's fixed cost per operator execution (``cost_model.operator_s``;
  ``getitem`` and gradient markers, which the runtime does not run, cost nothing);
  feeding the batch costs its local bytes / memory bandwidth (sharded is cheaper);
- one edge per operator input: the resharding cost from each producer spec to
  the spec each consumer strategy wants (``cost_model.reshard_matrix_s``); a batch
  leaf wanted replicated costs nothing (every device receives the whole batch);
- an edge from each updated parameter / optimizer state / buffer back to its
  stored input: storing it in another layout costs a reshard every step;
- Followers: ``getitem`` of a multi-output operator follows its producer; a view
  of a stored value or of its cast copy keeps the source's layout (``_alias``:
  gathers are transient);
- tie groups (``exploit_repetition``): nodes of repeated layers take the same
  strategy (``_Builder.tie_groups``);
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
import re
import time

import numpy as np
import torch
import torch.fx as fx

from alpa_torch.core.errors import PlanError
from alpa_torch.core.grad_op import GRAD_MARKER_NAME
from alpa_torch.core.graph import OpGraph, source_line
from alpa_torch.core.sharding import StageSharding
from alpa_torch.core.spec import ShardingSpec

from . import cost_model as cm
from .instance import Follower, ILPEdge, ILPInstance, ILPNode
from .reshard_paths import reshard_matrix_s
from .strategies import Strategy, node_strategies, source_specs

WL_ROUNDS = 3
"""Rounds of label refinement for ``exploit_repetition`` (the radius of the likeness test)."""


def _val(node: fx.Node):
    return node.meta.get("val")


def _itemsize(v: torch.Tensor) -> int:
    return v.element_size()


def _local_work(st: Strategy, tensors: list, mesh_shape) -> tuple[float, float]:
    """(share of the FLOPs, bytes moved) of one device running strategy ``st``.

    ``tensors`` are the fake values of the inputs then the outputs (None for a
    non-tensor). The FLOP share is the smallest local share of any tensor (a
    matmul with one operand cut in n does 1/n of the products; a partial-sum
    output holds a full-size summand, so it does not count). Bytes are what the
    device really reads and writes: each tensor at its local size, a partial
    output at full size (an embedding over vocab shards still writes every row).
    """
    frac, nbytes = 1.0, 0.0
    for spec, val in zip(st.inputs + st.outputs, tensors):
        if spec is None or val is None:
            continue
        shape = tuple(val.shape)
        local = spec.local_numel(shape, mesh_shape)
        nbytes += local * val.element_size()
        if spec.has_partial and spec in st.outputs:
            continue
        frac = min(frac, local / max(math.prod(shape), 1))
    return frac, nbytes


class _Builder:
    def __init__(self, graph, mesh: cm.MeshCost, names: set[str] | None, force: dict[str, str] | None = None,
                 memo: dict | None = None):
        self.graph, self.mesh = graph, mesh
        by_input = {s.name: s.node for s in graph.inputs}
        self.force = {by_input.get(k, k): ShardingSpec.parse(v) for k, v in (force or {}).items()}
        self.gm_nodes = {n.name: n for n in graph.gm.graph.nodes}
        calls = [n for n in graph.gm.graph.nodes if n.op == "call_function"]
        self.ops = [n for n in calls if names is None or n.name in names]
        op_names = self.op_names = {n.name for n in self.ops}
        sources = {a.name for n in self.ops for a in n.all_input_nodes if a.name not in op_names}
        self.stored = {s.node for s in graph.inputs if s.kind in ("param", "opt_state", "buffer")}
        self.fed = {s.node for s in graph.inputs if s.kind == "batch"}
        self.order = [n.name for n in graph.gm.graph.nodes if n.name in sources or n.name in op_names]
        self.index = {name: i for i, name in enumerate(self.order)}
        self.options: dict[str, list[Strategy]] = {}
        self.followers: list[Follower] = []
        # Repeated layers: equal strategy lists are one object, so costs, names and reshard
        # matrices are computed once per list (keyed by id) instead of once per node. A
        # ``memo`` shares them between builders on one mesh (other layers of one model);
        # an id-keyed entry keeps its list alive and is used only for that very list.
        memo = {} if memo is None else memo
        if memo.setdefault("mesh", mesh) != mesh:
            raise ValueError("build_stage_instance: this memo was filled on another mesh")
        self._lists: dict[tuple, list[Strategy]] = memo.setdefault("lists", {})
        self._names: dict[int, tuple] = memo.setdefault("names", {})
        self._matrices: dict[tuple, tuple] = memo.setdefault("matrices", {})
        self._node_costs: dict[tuple, tuple] = memo.setdefault("node_costs", {})

    def _shared(self, strategies: list[Strategy]) -> list[Strategy]:
        return self._lists.setdefault(tuple(strategies), strategies)

    def names_of(self, name: str) -> tuple[str, ...]:
        opts = self.options[name]
        hit = self._names.get(id(opts))
        if hit is None or hit[0] is not opts:
            hit = self._names[id(opts)] = (opts, tuple(st.name for st in opts))
        return hit[1]

    def strategies(self) -> None:
        self.weights = self._weights()
        for name in self.order:
            node = self.gm_nodes[name]
            if name not in self.op_names:  # a value the stage reads: a placeholder or another stage's
                self.options[name] = self._shared([Strategy((), (s,)) for s in source_specs(_val(node), 2)])
            elif node.target is operator.getitem:
                self._getitem(node)
            elif str(node.target) == GRAD_MARKER_NAME:
                src = node.all_input_nodes[0]
                specs = source_specs(_val(src), 2, allow_partial=True)
                self.options[name] = self._shared([Strategy((s,), (s,)) for s in specs])
            else:
                self.options[name] = node_strategies(node, self.mesh.mesh_shape)
                self._alias(node)
            if name in self.force:
                self._restrict(name)

    def _restrict(self, name: str) -> None:
        """Keep only the strategies whose output is the forced spec."""
        want = self.force[name]
        kept = [st for st in self.options[name] if st.outputs and st.outputs[0] == want]
        if not kept:
            have = sorted({str(st.outputs[0]) for st in self.options[name] if st.outputs})
            raise PlanError(f"cannot force {name!r} to {want}: its possible specs here are {have}")
        self.options[name] = kept

    def _alias(self, node: fx.Node) -> None:
        """A view of a stored value (``t(weight)``), or of the cast copy autocast makes of one
        (``t(_to_copy(weight))``), keeps its source's layout (a Follower).

        The view aliases its source, so a gather for a consumer happens at that consumer and
        is transient (freed after use), as in FSDP; the backward's view pays its own gather
        again. Were the gather allowed into the view's input, the gathered weight would live
        from the forward to the backward while the memory row, which follows views to their
        storage root, counted only the sharded original: on LLaMA-3-8B (bf16, one stage on
        8x8 V100s) 14 GiB per device that the stage DP's rule did not see. A plan that wants
        the gathered copy kept gathers it into the cast, where it is counted.
        """
        facts = self.graph.nodes.get(node.name)
        src = node.all_input_nodes[0] if node.all_input_nodes else None
        if facts is None or not facts.is_view or src is None or src.name not in self.weights:
            return
        opts = self.options[node.name]
        mapping = []
        for st in self.options[src.name]:
            spec = st.outputs[0]
            mapping.append(next((k for k, o in enumerate(opts) if o.inputs and o.inputs[0] == spec), -1))
        self.followers.append(Follower(self.index[node.name], self.index[src.name], np.array(mapping)))

    def _weights(self) -> set[str]:
        """The stored values, and the operators of this stage that cast or view one of them or
        the output of such an operator (``_to_copy(weight)``, ``t(_to_copy(weight))``)."""
        out = set(self.stored)
        for name in self.order:  # producers first
            node, facts = self.gm_nodes[name], self.graph.nodes.get(name)
            if name not in self.op_names or facts is None or not node.all_input_nodes:
                continue
            src = node.all_input_nodes[0].name
            cast = node.target is torch.ops.aten._to_copy.default
            if (cast or facts.is_view) and src in out:
                out.add(name)
        return out

    def _getitem(self, node: fx.Node) -> None:
        producer, idx = node.args
        outs, mapping = [], []
        for st in self.options[producer.name]:
            spec = st.outputs[idx] if idx < len(st.outputs) else None
            spec = spec or ShardingSpec.replicated(2)
            if spec not in outs:
                outs.append(spec)
            mapping.append(outs.index(spec))
        self.options[node.name] = self._shared([Strategy((), (s,)) for s in outs])
        self.followers.append(Follower(self.index[node.name], self.index[producer.name], np.array(mapping)))

    def ilp_nodes(self) -> list[ILPNode]:
        cache = self._node_costs  # repeated layers: one costing per (strategy list, shapes)
        out = []
        for name in self.order:
            node, opts = self.gm_nodes[name], self.options[name]
            val = _val(node)
            tensors = [_val(a) for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor)]
            tensors += [v if isinstance(v, torch.Tensor) else None for v in _as_list(val)]
            facts = self.graph.nodes.get(name) if name in self.op_names else None
            role = "op" if facts is not None else "fed" if name in self.fed else "source"
            if str(node.target) == GRAD_MARKER_NAME or node.target is operator.getitem:
                role = "free"  # an identity / a tuple element the runtime does not run as an operator
            key = (id(opts), role, facts and (facts.flops, facts.is_view),
                   tuple((tuple(t.shape), t.dtype) if t is not None else None for t in tensors))
            hit = cache.get(key)
            if hit is None or hit[0] is not opts:
                try:
                    hit = cache[key] = (opts, *self._costs(opts, val, tensors, role, facts))
                except Exception as exc:
                    exc.add_note(f"while pricing the strategies of operator {name} ({node.target}, output "
                                 f"{tuple(getattr(val, 'shape', ()))}) on mesh {tuple(self.mesh.mesh_shape)}"
                                 f"{', from ' + source_line(node) if source_line(node) else ''}")
                    raise
            _, comp, mem = hit
            out.append(ILPNode(name=name, strategy_names=self.names_of(name), compute_s=comp,
                               comm_s=np.zeros(len(opts)), memory_bytes=mem))
        return out

    def _costs(self, opts, val, tensors, role, facts):
        """(compute_s, memory_bytes) of one node."""
        mem = np.array([self._bytes(s.outputs[0] if s.outputs else None, val) for s in opts], dtype=float)
        comp = np.zeros(len(opts))
        if role == "fed":
            # Input load: the batch is written into each device's memory every step at its
            # local size, so feeding it sharded costs less (and a free R -> S slice later
            # does not leave the choice to chance). Values of other stages / layers are
            # priced by whoever moves them (the stage DP, cross-mesh resharding).
            comp = mem / self.mesh.memory_bandwidth_bytes_per_s
        elif role == "op":
            for k, st in enumerate(opts):
                frac, nbytes = _local_work(st, tensors, self.mesh.mesh_shape)
                nbytes = 0.0 if facts.is_view else nbytes  # views move no data
                # + the fixed cost per operator
                comp[k] = cm.operator_s(self.mesh, facts.flops * frac, nbytes, facts.dtype)
        return comp, mem

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
                out.append(self._edge(src.name, node.name, j))
        inputs = {}
        for s in self.graph.inputs:  # the first input of each (kind, name), as a linear search finds
            inputs.setdefault((s.kind, s.name), s)
        for spec in self.graph.outputs:
            stored = inputs.get((spec.kind, spec.name))
            if (stored is None or spec.node == stored.node or spec.node not in self.index
                    or stored.node not in self.index):
                continue
            out.append(self._edge(spec.node, stored.node, None))
        return out

    def _edge(self, src: str, dst: str, j: int | None) -> ILPEdge:
        """Resharding from ``src``'s output to ``dst``'s input ``j`` (None: ``dst``'s stored spec)."""
        val = _val(self.gm_nodes[src])
        src_opts, dst_opts = self.options[src], self.options[dst]
        fed = src in self.fed and j is not None
        key = (id(src_opts), id(dst_opts), j, tuple(val.shape), _itemsize(val), fed)
        hit = self._matrices.get(key)
        if hit is None or hit[0] is not src_opts or hit[1] is not dst_opts:
            src_specs = [st.outputs[0] if st.outputs and st.outputs[0] else ShardingSpec.replicated(2)
                         for st in src_opts]
            dst_specs = [st.outputs[0] if j is None else st.inputs[j] for st in dst_opts]
            matrix = reshard_matrix_s(self.mesh, src_specs, dst_specs, key[3], key[4])
            if fed:  # every device receives the whole batch: replicating a leaf is a lookup (StageRunner.put_batch)
                matrix[:, [k for k, spec in enumerate(dst_specs) if spec.is_replicated]] = 0.0
            hit = self._matrices[key] = (src_opts, dst_opts, matrix)
        return ILPEdge(self.index[src], self.index[dst], hit[2])

    def tie_groups(self, rounds: int = WL_ROUNDS) -> list[tuple[int, ...]]:
        """Nodes of repeated layers, which must take the same strategy index.

        Weisfeiler-Lehman refinement: a node's first label is what fixes its
        strategy list (operator, non-tensor arguments, output shapes, the list
        itself; for a graph input its kind, shape and name with the layer index
        blanked, ``blocks.#.mlp.0.weight``); each round adds the labels of its
        inputs (in order) and of its users (with the argument position). After
        ``rounds`` rounds two nodes share a label when their neighbourhoods of
        that radius look alike: the same operator in another copy of a layer.
        The first label contains the strategy list, so tied nodes always have
        identical lists (what ``ILPInstance`` requires); nodes within ``rounds``
        hops of the model's ends keep their own variables. Followers are never
        tied themselves.
        """
        names = {s.node: s for s in self.graph.inputs}
        ins = [[self.index[a.name] for a in self.gm_nodes[n].all_input_nodes if a.name in self.index]
               if n in self.op_names else [] for n in self.order]
        users: list[list[tuple[int, int]]] = [[] for _ in self.order]
        for v, us in enumerate(ins):
            for pos, u in enumerate(us):
                users[u].append((v, pos))
        intern: dict[tuple, int] = {}
        labels = []
        for n in self.order:
            node, val = self.gm_nodes[n], _val(self.gm_nodes[n])
            what = (tuple(val.shape), str(val.dtype)) if isinstance(val, torch.Tensor) else repr(val)
            if n in self.op_names:
                args = fx.node.map_arg((node.args, node.kwargs), lambda a: "#")
                args = () if str(node.target) == GRAD_MARKER_NAME else args  # its int names the parameter
                key = ("op", str(node.target), repr(args), repr(what))
            elif n in names:
                key = ("input", names[n].kind, re.sub(r"\d+", "#", names[n].name, count=1), repr(what))
            else:
                key = ("value", repr(what))
            labels.append(intern.setdefault(key + (self.names_of(n),), len(intern)))
        for _ in range(rounds):
            labels = [intern.setdefault((labels[v], tuple(labels[u] for u in ins[v]),
                                         tuple(sorted((labels[w], p) for w, p in users[v]))), len(intern))
                      for v in range(len(self.order))]
        # Followers (getitems, aliasing views) already move with their leader; tying them
        # too would join groups whose tables are not injective, a product in reduce.py.
        followers = {f.follower for f in self.followers}
        groups: dict[int, list[int]] = {}
        for v, lab in enumerate(labels):
            if v not in followers:
                groups.setdefault(lab, []).append(v)
        return [tuple(g) for g in groups.values() if len(g) > 1]

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


def build_stage_instance(graph: OpGraph, mesh: cm.MeshCost, *, names: set[str] | None = None,
                         memory_budget_bytes: float = math.inf, exploit_repetition: bool = True,
                         force: dict[str, str] | None = None, memo: dict | None = None):
    """The ILP of the operators ``names`` (all when None) on ``mesh``; returns (instance, builder).

    ``memo``: a dict to share costings and reshard matrices between calls on the same
    ``mesh`` (e.g. the layers of one model); the instances are the same with or without.

    ``exploit_repetition`` ties the nodes of repeated layers (``_Builder.tie_groups``):
    one strategy choice per operator of a layer instead of one per layer, which
    shrinks the reduced ILP about L-fold; every tied plan is a valid plan of the
    untied problem, possibly not its optimum (boundary layers keep their own).
    ``force`` fixes the spec of values: ``{'batch.0': 'RS(0)', 'fc.weight': 'RR'}``
    (graph input names or fx node names), for experts and tests.
    """
    b = _Builder(graph, mesh, names, force, memo)
    b.strategies()
    nodes = b.ilp_nodes()
    persistent, saved = b.memory_point()
    instance = ILPInstance(
        nodes=tuple(nodes), edges=tuple(b.edges()), liveness=(tuple(sorted(set(persistent) | set(saved))),),
        followers=tuple(b.followers), memory_budget_bytes=memory_budget_bytes,
        tie_groups=tuple(b.tie_groups()) if exploit_repetition else (),
        metadata={"model": graph.meta.get("model", ""), "mesh_shape": list(mesh.mesh_shape)},
    )
    b.memory_rows = (persistent, saved)
    return instance, b


def solve_stage(graph: OpGraph, mesh: cm.MeshCost, *, names: set[str] | None = None,
                memory_budget_bytes: float = math.inf, time_limit_s: float = 60.0,
                mip_gap: float = 0.01, exploit_repetition: bool = True,
                force: dict[str, str] | None = None) -> StageSharding:
    """Solve the sharding of a stage (``names``) on ``mesh``."""
    from .ilp import solve_instance

    t0 = time.perf_counter()
    instance, b = build_stage_instance(graph, mesh, names=names, memory_budget_bytes=memory_budget_bytes,
                                       exploit_repetition=exploit_repetition, force=force)
    build_s = time.perf_counter() - t0
    sol = solve_instance(instance, time_limit_s=time_limit_s, mip_gap=mip_gap)
    return stage_sharding(b, instance, sol, (sol.compute_s, sol.comm_s, sol.reshard_s), build_s=build_s)


def stage_sharding(builder, instance: ILPInstance, sol, costs: tuple[float, float, float], *,
                   ops: set[str] | None = None, build_s: float = 0.0) -> StageSharding:
    """The ``StageSharding`` of a solved stage instance (what ``build_stage_instance`` returned and
    what the solver chose): every value's spec, the input specs of ``ops`` (default: every operator
    of the stage), ``costs`` = (compute_s, comm_s, reshard_s) and the per-device memory of the
    chosen strategies (persistent: state and gradients; activation: what a microbatch keeps)."""
    chosen = {name: builder.options[name][k] for name, k in zip(builder.order, sol.strategy_index)}
    ops = builder.op_names if ops is None else ops
    persistent, saved = builder.memory_rows
    mem = [float(instance.nodes[i].memory_bytes[sol.strategy_index[i]]) for i in range(len(instance.nodes))]
    return StageSharding(
        mesh_shape=tuple(builder.mesh.mesh_shape),
        value_specs={n: st.outputs[0] for n, st in chosen.items() if st.outputs and st.outputs[0] is not None},
        input_specs={n: st.inputs for n, st in chosen.items() if n in ops},
        compute_s=costs[0], comm_s=costs[1], reshard_s=costs[2],
        persistent_bytes=math.fsum(mem[i] for i in persistent), activation_bytes=math.fsum(mem[i] for i in saved),
        solver_status=sol.status, gap=sol.gap, build_s=build_s + sol.build_s, solve_s=sol.solve_s,
        num_vars=sol.num_vars, num_constraints=sol.num_constraints,
    )
