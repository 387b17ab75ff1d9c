"""``OpGraph``: one functional aten graph of a whole training step.

Produced by ``alpa_torch.capture``; consumed by ``stage_dp`` (layering), by
``intra_ilp`` (strategies per node) and by ``runtime`` (execution).

The graph's inputs are, in this order: parameters, buffers, optimizer state,
host scalars (the optimizers' float hyper-parameters, read on every call) and the tensor
leaves of the batch; then the inputs computed on the driver: the loss normalisers
(``masked_mean.py``, batch kind) and the values of hyper-parameters alone (``host.*``,
host-scalar kind, ``host_inputs``). Its outputs: the loss, then the new parameters, buffers and
optimizer state (a forward-only graph, ``capture_forward``: parameters, buffers and
batch in, the function's tensors out, kind ``output``). Every ``call_function`` node has an ``OpNode`` record with its
output shape and dtype, FLOPs, bytes moved and phase:

- ``forward``  ancestors of the loss (and of updated buffers, e.g. BatchNorm
  running statistics),
- ``backward`` the rest of what leads to the gradients,
- ``update``   descendants of a gradient: clipping and the optimizer.

``grad_of[param]`` names the node holding that parameter's gradient (the
``alpa.grad`` marker placed when ``loss.backward()`` returned). The marker is
an identity; ``OpGraph.run`` executes it as one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

INPUT_KINDS = ("param", "buffer", "opt_state", "host_scalar", "batch")
OUTPUT_KINDS = ("loss", "param", "buffer", "opt_state", "output")
PHASES = ("forward", "backward", "update")


def optimizers_of(optimizer) -> tuple:
    """The optimizers a step is given: one, or a tuple or list of several."""
    return tuple(optimizer) if isinstance(optimizer, (tuple, list)) else (optimizer,)


def source_line(node: fx.Node) -> str:
    """The user's line that made ``node`` (``File "...", line N`` from its stack trace), or ''."""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").splitlines() if ln.strip().startswith("File")]
    return lines[-1] if lines else ""


@dataclass(frozen=True, slots=True)
class IOSpec:
    """One graph input or output."""

    kind: str
    """One of INPUT_KINDS / OUTPUT_KINDS."""
    name: str
    """Parameter / buffer name, ``{param}.{state}`` for optimizer state,
    ``g{group}.{scalar}`` for host scalars, ``batch.{i}`` for batch leaves."""
    shape: tuple[int, ...]
    dtype: str
    node: str
    """Name of the fx node (placeholder, or the node the output returns)."""

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True, slots=True)
class OpNode:
    """Facts about one ``call_function`` node of the graph."""

    name: str
    target: str
    """e.g. 'aten.mm.default'."""
    phase: str
    inputs: tuple[str, ...]
    """Names of the nodes (placeholders included) whose values it reads."""
    shape: tuple[int, ...] | None
    """Shape of the (first) tensor output; None if it returns no tensor."""
    dtype: str | None
    flops: float
    bytes_read: int
    bytes_written: int
    is_view: bool
    stack: str = ""
    """The user's source line that created it, when known."""


@dataclass(slots=True)
class OpGraph:
    """A captured training step: an executable fx graph plus per-node facts."""

    gm: fx.GraphModule
    inputs: tuple[IOSpec, ...]
    outputs: tuple[IOSpec, ...]
    nodes: dict[str, OpNode]
    """``call_function`` nodes in topological order."""
    grad_of: dict[str, str]
    """parameter name -> name of the node holding its gradient."""
    param_groups: dict[str, int]
    """parameter name -> optimizer group index (params the optimizer updates)."""
    meta: dict = field(default_factory=dict)
    """Capture facts: batch size, model class, optimizer kind, time taken."""

    def input_names(self, kind: str) -> list[str]:
        return [s.name for s in self.inputs if s.kind == kind]

    def loss_norms(self, batch: Mapping[str, torch.Tensor], num_microbatches: int = 1) -> dict[str, torch.Tensor]:
        """The inputs the step's mean losses divide by (``masked_mean.py``), from the batch leaves
        ``batch`` (name -> tensor) of the whole batch: each count of the targets that are not ignored
        (at least 1), divided by the number of microbatches it is split into. A graph captured on a
        microbatch counts the whole batch one microbatch at a time (its views have those shapes)."""
        out = {}
        captured = {s.name: s.shape for s in self.inputs}
        for name, (leaf, count) in self.meta.get("loss_norms", {}).items():
            value = torch.as_tensor(batch[leaf])
            parts = value.shape[0] // captured[leaf][0] if value.dim() and captured[leaf] else 1
            total = max(sum(int(count(part)) for part in value.chunk(parts)), 1)
            out[name] = torch.tensor(total / num_microbatches, dtype=torch.float32)
        return out

    def host_inputs(self, scalars: Mapping[str, float]) -> dict:
        """Every host-scalar input from the hyper-parameters ``scalars`` (key -> value now): those,
        and the values the capture took out of the step as operators of them alone
        (``host_program.py``), computed here."""
        program = self.meta.get("host_program")
        return {**scalars, **program.values(scalars)} if program is not None else dict(scalars)

    def run(self, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Execute on one device. ``values`` maps every input name to a tensor (the loss
        normalisers, ``loss_norms``, and the hoisted ``host_inputs`` are computed when missing); returns
        ``{kind/name: tensor}`` keyed like ``'loss'``, ``'param/l1.weight'``."""
        values = {**self.loss_norms(values), **values} if self.meta.get("loss_norms") else values
        hyper = {s.name: float(values[s.name]) for s in self.inputs if s.kind == "host_scalar" and s.name in values}
        values = {**self.host_inputs(hyper), **values}
        missing = [s.name for s in self.inputs if s.name not in values]
        if missing:
            raise KeyError(f"missing graph inputs: {missing[:5]}")
        flat = [values[s.name] for s in self.inputs]
        out = self.gm(*flat)
        return {_out_key(s): t for s, t in zip(self.outputs, out)}

    @property
    def num_ops(self) -> int:
        return len(self.nodes)

    def phase_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(PHASES, 0)
        for n in self.nodes.values():
            counts[n.phase] += 1
        return counts

    def total_flops(self, phase: str | None = None) -> float:
        return sum(n.flops for n in self.nodes.values() if phase is None or n.phase == phase)

    def summary(self) -> str:
        c = self.phase_counts()
        params = sum(s.nbytes for s in self.inputs if s.kind == "param")
        return (
            f"OpGraph({self.num_ops} ops: {c['forward']} forward, {c['backward']} backward, "
            f"{c['update']} update; {len(self.input_names('param'))} params, "
            f"{params / 2**20:.1f} MiB; {self.total_flops() / 1e9:.3f} GFLOP/step)"
        )

    def __repr__(self) -> str:
        return self.summary()


def _out_key(spec: IOSpec) -> str:
    return "loss" if spec.kind == "loss" else f"{spec.kind}/{spec.name}"


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
