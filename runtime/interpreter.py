"""The local program of one device: a planned graph executed on DTensors.

Each operator runs on DTensors whose placements are the ones the plan chose:
before an operator, every input is redistributed to the spec of the chosen
strategy (``StageSharding.input_specs``), which inserts exactly the
collectives the ILP priced (all-reduce for P -> R, all-gather for S -> R, ...);
DTensor's own rules then compute the local result. Operators DTensor has no
rule for run on the full (replicated) values, as the planner assumed.

This module runs inside a worker process; the driver side is ``engine.py``.
It needs a default process group (gloo or NCCL) spanning the mesh's ranks.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from intra_ilp.spec import ShardingSpec
from intra_ilp.strategies import to_dtensor_placements

log = logging.getLogger(__name__)
GRAD_MARKER_NAME = "alpa.grad.default"


class Ref(str):
    """A reference to another node's value inside a serialized node's arguments."""


def serialize_graph(gm: fx.GraphModule) -> list[tuple]:
    """The graph as picklable records ``(op, name, target, args, kwargs, inputs)``.

    Workers execute records directly: no re-tracing, no code generation."""
    records = []
    for n in gm.graph.nodes:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: Ref(a.name))
        target = n.target
        if isinstance(target, torch._ops.OpOverload):
            target = f"op:{target}"  # e.g. 'op:aten.mm.default'; OpOverloads do not pickle
        elif target is operator.getitem:
            target = "getitem"
        if n.op == "get_attr":
            target, args = n.target, (getattr(gm, n.target).detach().clone(),)
        records.append((n.op, n.name, target, args, kwargs, tuple(a.name for a in n.all_input_nodes)))
    return records


def _target(t):
    if t == "getitem":
        return operator.getitem
    if isinstance(t, str) and t.startswith("op:"):
        ns, name, overload = t[3:].split(".")
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    return t


def _resolve(value, env):
    return pytree.tree_map(lambda a: env[a] if isinstance(a, Ref) else a, value)


class StageRunner:
    """Holds one device's shards of the model state and runs the planned step."""

    def __init__(self, records: list[tuple], value_specs: dict[str, str], input_specs: dict[str, list[str]],
                 io: dict, mesh: DeviceMesh):
        self.mesh = mesh
        self.rep = (Replicate(),) * self.mesh.ndim
        self.value_specs = {k: to_dtensor_placements(ShardingSpec.parse(v)) for k, v in value_specs.items()}
        self.input_specs = {k: [to_dtensor_placements(ShardingSpec.parse(s)) for s in v] for k, v in input_specs.items()}
        self.inputs = io["inputs"]  # [(kind, name, node)]
        self.outputs = io["outputs"]
        self.state: dict[str, DTensor] = {}
        self.local_only: set[str] = set()
        self.nodes = [(op, name, _target(t) if op == "call_function" else t, a, k, i)
                      for op, name, t, a, k, i in records]

    # ---------------------------------------------------------------- state
    def _distribute(self, node: str, value: np.ndarray | torch.Tensor) -> DTensor:
        t = torch.as_tensor(value)
        placements = self.value_specs.get(node, self.rep)
        return distribute_tensor(t, self.mesh, placements, src_data_rank=None)

    def load_state(self, values: dict[str, Any]) -> None:
        """Take full values of params / buffers / optimizer state; keep this device's shards.

        Values not in ``values`` (state of other stages) are skipped."""
        for kind, name, node in self.inputs:
            if kind in ("param", "buffer", "opt_state") and name in values:
                self.state[name] = self._distribute(node, values[name])

    def gather_state(self) -> dict[str, np.ndarray]:
        """Full values of this runner's state (a collective among its mesh's devices)."""
        return {name: value.full_tensor().numpy() for name, value in self.state.items()}

    # ---------------------------------------------------------------- step
    def step(self, batch: dict[str, np.ndarray], scalars: dict[str, float]) -> float:
        env: dict[str, Any] = {}
        for kind, name, node in self.inputs:
            if kind == "batch":
                env[node] = self._distribute(node, batch[name])
            elif kind == "host_scalar":
                env[node] = self._distribute(node, torch.tensor(scalars[name], dtype=torch.float64))
            else:
                env[node] = self.state[name]
        results = self._execute(env)
        loss = None
        for (kind, name, node), value in zip(self.outputs, results):
            if kind == "loss":
                loss = value.full_tensor() if isinstance(value, DTensor) else value
                continue
            stored = next(n for k, nm, n in self.inputs if k == kind and nm == name)
            self.state[name] = self._place(value, self.value_specs.get(stored, self.rep))
        return float(loss)

    def _place(self, value, placements) -> DTensor:
        if not isinstance(value, DTensor):
            value = DTensor.from_local(torch.as_tensor(value), self.mesh, self.rep, run_check=False)
        if tuple(value.placements) != tuple(placements):
            if any(p.is_partial() and p != q for p, q in zip(placements, value.placements)):
                # Turning a value into a partial sum is DTensor-internal: its
                # dispatcher does it when the operator's rule asks for it.
                return value
            value = value.redistribute(self.mesh, placements)
        return value

    def _execute(self, env: dict[str, Any]) -> list:
        return self.run_records(self.nodes, env)

    def run_records(self, records, env: dict[str, Any]) -> list | None:
        """Run ``records`` in order, reading and writing ``env``; the output's values if reached."""
        for op, name, target, args, kwargs, inputs in records:
            if op == "placeholder":
                continue
            if op == "output":
                return [env[a] if isinstance(a, Ref) else a for a in pytree.tree_leaves(args[0])]
            if op == "get_attr":
                env[name] = self._place(args[0], self.rep)
                continue
            env[name] = self._run_node(name, target, args, kwargs, inputs, env)
        return None

    def _run_node(self, name, target, args, kwargs, inputs, env: dict[str, Any]):
        if target is operator.getitem:
            return env[args[0]][args[1]]
        if str(target) == GRAD_MARKER_NAME:
            return env[args[0]]
        tensor_inputs = [a for a in inputs if isinstance(env[a], torch.Tensor)]
        specs = self.input_specs.get(name)
        placed = {}
        for j, a in enumerate(tensor_inputs):
            want = specs[j] if specs is not None and j < len(specs) else self.rep
            placed[a] = self._place(env[a], want)
        lookup = {**{a: env[a] for a in inputs}, **placed}
        args, kwargs = _resolve((args, kwargs), lookup)
        if name not in self.local_only:
            try:
                return target(*args, **kwargs)
            except NotImplementedError:  # no DTensor rule: the plan kept it replicated
                self.local_only.add(name)
        return self._run_replicated(target, args, kwargs)

    def _run_replicated(self, target, args, kwargs):
        def full(v):
            return v.redistribute(self.mesh, self.rep).to_local() if isinstance(v, DTensor) else v

        args, kwargs = pytree.tree_map(full, (args, kwargs))
        out = target(*args, **kwargs)
        return pytree.tree_map(
            lambda v: DTensor.from_local(v, self.mesh, self.rep, run_check=False) if isinstance(v, torch.Tensor) else v,
            out,
        )
