"""Scalars the driver computes: the arithmetic of the hyper-parameters, taken out of the step.

``torch.optim`` computes, for every parameter, the same numbers from its group's
hyper-parameters (``1 - beta1``, ``1 - lr * weight_decay``, each then cast to the
parameter's math dtype). Traced, that is a chain of 0-dim operators repeated for every
parameter: about a third of Adam's update operators, each one more node to plan.
``hoist`` takes every operator whose inputs are host scalars (the hyper-parameter inputs),
or operators of that kind, out of the graph: each distinct value the rest of the graph
reads becomes one more ``host_scalar`` input (``host.0``, ``host.1``, ...: after every other
input), and the repeated chains go. ``HostProgram.values`` computes those inputs on the
driver on every call, from the hyper-parameters as they are then (a learning-rate schedule
moves them), by the same operators on the CPU: float64 arithmetic as Python's floats (which
eager ``torch.optim`` computes these numbers with), then the same cast.

Values that depend on the devices (a step count's ``item()``) stay in the graph, and so does
a random operator. The device graph then holds no value shared by the updates of
parameters on different pipeline stages, which ``partition`` could not move.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

PREFIX = "host."
"""Names of the hoisted inputs: ``host.{i}``."""


@dataclass(frozen=True, slots=True)
class _Ref:
    """An argument that is another value of the program (a host scalar's key or a step's name)."""

    name: str


@dataclass(frozen=True, slots=True)
class HostProgram:
    """The hoisted operators, as data (it pickles and prints): ``steps`` in order, each
    ``(name, operator, args, kwargs)`` with ``_Ref``s to host scalars and earlier steps;
    ``outputs``: ``(input name, step name)`` per hoisted input."""

    steps: tuple[tuple[str, Any, tuple, dict], ...]
    outputs: tuple[tuple[str, str], ...]

    def values(self, scalars: Mapping[str, float]) -> dict[str, torch.Tensor]:
        """The hoisted inputs (0-dim CPU tensors of their dtypes) from the host scalars' values now."""
        env: dict[str, torch.Tensor] = {}

        def arg(a):
            if not isinstance(a, _Ref):
                return a
            if a.name not in env:
                env[a.name] = torch.tensor(float(scalars[a.name]), dtype=torch.float64)
            return env[a.name]

        for name, target, args, kwargs in self.steps:
            env[name] = target(*fx.node.map_aggregate(args, arg), **fx.node.map_aggregate(kwargs, arg))
        return {key: env[step] for key, step in self.outputs}


def _hoistable(node: fx.Node, host: Mapping[str, str]) -> bool:
    val = node.meta.get("val")
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded not in node.target.tags
            and isinstance(val, torch.Tensor) and val.dim() == 0
            and bool(node.all_input_nodes) and all(u.name in host for u in node.all_input_nodes))


def hoist(gm: fx.GraphModule, host_inputs: Mapping[str, str]) -> HostProgram | None:
    """Take the operators of host scalars alone out of ``gm`` (module docstring). ``host_inputs``:
    placeholder name -> host scalar key. Returns the program, whose outputs are the new
    placeholders in order (after every other one), or None when there is nothing to hoist."""
    key_of = dict(host_inputs)  # fx node name -> its key: a host scalar, or a step's canonical name
    canonical: dict[tuple, str] = {}  # structure -> the step computing it
    steps, hoisted = [], []
    for node in gm.graph.nodes:
        if not _hoistable(node, key_of):
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda u: _Ref(key_of[u.name]))
        if kwargs.get("device") is not None:  # planned for CUDA: the driver computes on its CPU
            kwargs = {**kwargs, "device": torch.device("cpu")}
        structure = (node.target, repr(args), repr(sorted(kwargs.items())))
        if structure not in canonical:
            canonical[structure] = node.name
            steps.append((node.name, node.target, args, kwargs))
        key_of[node.name] = canonical[structure]
        hoisted.append(node)
    if not hoisted:
        return None
    names = {n.name for n in hoisted}
    frontier: dict[str, list[fx.Node]] = {}  # canonical step -> the hoisted nodes of that value read outside
    for node in hoisted:
        if any(u.name not in names for u in node.users):
            frontier.setdefault(key_of[node.name], []).append(node)
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    outputs = []
    for i, (step, nodes) in enumerate(frontier.items()):
        with gm.graph.inserting_after(last):
            ph = gm.graph.placeholder(f"host_{i}")
        ph.meta["val"] = nodes[0].meta["val"]
        for node in nodes:
            node.replace_all_uses_with(ph, delete_user_cb=lambda user: user.name not in names)
        outputs.append((f"{PREFIX}{i}", step))
        last = ph
    for node in reversed(hoisted):
        gm.graph.erase_node(node)
    gm.recompile()
    return HostProgram(tuple(steps), tuple(outputs))
