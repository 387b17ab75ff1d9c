"""Whether a step couples the samples of its batch, so that microbatches would change it.

The pipeline runtime splits the batch into B microbatches along dim 0 and
averages their losses and gradients (``runtime/pipeline.py``). That equals the
full-batch step when the loss is a mean of per-sample terms; two things break it:

- BatchNorm in training mode normalises every sample with statistics of the
  whole batch;
- a statistic pooled over the batch and then used nonlinearly: the
  load-balancing loss of a mixture-of-experts model (Switch Transformer,
  Mixtral's ``output_router_logits=True``: ``E * sum_e f_e * P_e``, a product of
  two batch means), a hand-written batch norm, a masked mean whose count comes
  from the data. Microbatches compute it per microbatch: another number.

How the second is found (``_pooled_used_nonlinearly``): the forward is walked
once with the sample dim followed as a DTensor shard, using the same operator
rules as the planner (``intra_ilp.strategies.node_strategies`` on a 1 x 2
mesh): batch leaves with the batch dimension are ``S(0)`` (``batch.split_flags``), every
other input ``R``; an operator's
output placement is that of a strategy that accepts its inputs' placements
without moving data (a batch-independent ``R`` input may be sliced). A
reduction over the samples yields ``P`` (a partial sum: a pooled statistic).
An operator that reads a ``P`` input which none of its strategies accepts
there (``P * P``, ``P / P``, ``x - P``) is nonlinear in it: coupled.

Operators whose rule cannot follow the sample dim (a sort of all tokens, a
gather by computed indices: mixture-of-experts dispatch; HF's mask indexing)
are taken to keep the samples along dim 0 (``_guess``), so a pooling after them
is still seen. Known over-approximation: mixture-of-experts dispatch through a
grouped GEMM counts the tokens of each expert over the batch (``histc`` ->
``cumsum`` offsets) and compares the counts with row indices; the result is
per token again, but the check sees a pooled count read nonlinearly, so such
models run with one microbatch (exact, with a larger pipeline bubble).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from alpa_torch.core.graph import OpGraph, source_line
from alpa_torch.core.microbatches import split_flags
from alpa_torch.core.spec import Placement, R, S
from intra_ilp.strategies import Strategy, node_strategies

_MESH = (1, 2)
"""Axis 1 (two devices) stands for the microbatches; axis 0 (one device) stays R."""
_BATCH_NORM = ("_native_batch_norm_legit_functional", "native_batch_norm")
_S0 = S(0)
_COUPLED = object()
"""``_propagate``'s answer for an operator that reads a pooled value nonlinearly."""

State = Placement | None | list
"""R, S(d) or P on the microbatch axis; None: unknown; a list for a tuple-valued operator."""


def batch_coupling(graph: OpGraph) -> str | None:
    """Why microbatches would change this step's numbers (a sentence), or None."""
    if _batch_norm_training(graph):
        return "BatchNorm in training mode normalises with statistics of the whole batch"
    node = _pooled_used_nonlinearly(graph)
    if node is None:
        return None
    where = f", {source_line(node)}" if source_line(node) else ""
    return (f"{node.target} ({node.name}{where}) reads a value pooled over the whole batch (a sum, mean or count "
            "over its samples) nonlinearly, so each microbatch would compute its own (e.g. a mixture-of-experts "
            "load-balancing loss)")


def _batch_norm_training(graph) -> bool:
    """A batch norm in training mode (its ``training`` argument, args[5], true) anywhere in the step."""
    for node in graph.gm.graph.nodes:
        if node.op == "call_function" and any(k in str(node.target) for k in _BATCH_NORM):
            if node.args[5] if len(node.args) > 5 else True:
                return True
    return False


def _pooled_used_nonlinearly(graph) -> fx.Node | None:
    """The first forward operator that reads a pooled (P) value nonlinearly, or None."""
    return _forward_states(graph)[1]


def _forward_states(graph) -> tuple[dict[str, State], fx.Node | None]:
    """Every forward value's state (sample dim split ``S(0)``, pooled ``P``, or ``R``) and the first
    operator that reads a pooled value nonlinearly (None if none: then every state is known)."""
    batch = [s for s in graph.inputs if s.kind == "batch"]
    split = dict(zip((s.node for s in batch), split_flags([tuple(s.shape) for s in batch])))
    state: dict[str, State] = {s.node: _S0 if split.get(s.node) and s.shape[0] > 1 else R for s in graph.inputs}
    for node in graph.gm.graph.nodes:
        facts = graph.nodes.get(node.name)
        if node.op != "call_function" or facts is None or facts.phase != "forward":
            continue
        if node.target is operator.getitem:
            src = state.get(node.args[0].name, R)
            state[node.name] = src[node.args[1]] if isinstance(src, list) else src
            continue
        ins = [state.get(a.name, R) for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        outs = _propagate(node, ins)
        if outs is _COUPLED:
            return state, node
        state[node.name] = outs
    return state, None


# ---------------------------------------------------------------- how microbatches add up

_MEAN_OPS = {torch.ops.aten.mean.default, torch.ops.aten.mean.dim}
_SUM_OPS = {torch.ops.aten.sum.default, torch.ops.aten.sum.dim_IntList}
_NLL_OPS = {torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss2d_forward.default}
_aten = torch.ops.aten
_REDUCED_LOSSES = {_aten.mse_loss.default: 2, _aten.smooth_l1_loss.default: 2, _aten.huber_loss.default: 2,
                   _aten.binary_cross_entropy.default: 3, _aten.binary_cross_entropy_with_logits.default: 4}
"""Loss operators with a ``reduction`` argument (its position; absent: 1, the mean)."""
_SCALE_OPS = {torch.ops.aten.mul.Tensor: "mul", torch.ops.aten.div.Tensor: "div"}
_ADD_OPS = {torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor}


def loss_combine(graph: OpGraph, microbatch_graph: OpGraph, num_microbatches: int) -> str | None:
    """How the losses (and gradients) of ``num_microbatches`` microbatches add up to the whole batch's:
    'mean' (the loss is a mean over samples: a mean, a sum divided by the batch size, or a masked mean
    ``masked_mean`` made exact), 'sum' (a sum over samples), or None (anything else: a microbatch
    pipeline cannot reproduce it). ``microbatch_graph``: the same step captured on one microbatch,
    whose constants tell a division by the batch size (8 on the batch, 4 on half of it) from a
    division by a fixed number."""
    states, coupled = _forward_states(graph)
    if coupled is not None:
        return None
    small = {n.name: n for n in microbatch_graph.gm.graph.nodes}
    kinds: dict[str, str | None | list] = {}
    norms = {n.name for n in graph.gm.graph.nodes if n.op == "placeholder" and n.name.startswith("loss_norm_")}
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or node.name not in states:
            continue
        if node.target in (torch.ops.aten._to_copy.default,) and node.args[0].name in norms:
            norms.add(node.name)
        kinds[node.name] = _kind(node, states, kinds, small.get(node.name), num_microbatches, norms)
    out = next(n for n in graph.gm.graph.nodes if n.op == "output")
    loss = out.args[0][0]
    state = states.get(loss.name, R)
    if state == R:
        return "mean"  # the same on every microbatch
    return kinds.get(loss.name) if isinstance(state, Placement) and state.is_partial else None


def _kind(node: fx.Node, states: dict, kinds: dict, small: fx.Node | None, m: int, norms: set[str]):
    """'mean' / 'sum' / None of a forward value pooled over the samples (a list for several outputs)."""
    state = states[node.name]
    pooled = [a for a in node.all_input_nodes if _is_pooled(states.get(a.name))]
    if isinstance(state, list):
        if node.target in _NLL_OPS and not pooled:
            return ["sum" if node.args[3] == 2 else None, "sum"]
        return [None] * len(state)
    if not _is_pooled(state):
        return None
    if node.target is operator.getitem:
        src = kinds.get(node.args[0].name)
        return src[node.args[1]] if isinstance(src, list) else src
    if not pooled:  # pooled here, from split samples
        if node.target in _REDUCED_LOSSES:
            at = _REDUCED_LOSSES[node.target]
            reduction = node.args[at] if len(node.args) > at else node.kwargs.get("reduction", 1)
            return {1: "mean", 2: "sum"}.get(reduction)
        return "mean" if node.target in _MEAN_OPS else "sum" if node.target in _SUM_OPS else None
    first = kinds.get(pooled[0].name)
    if node.target in _ADD_OPS:
        others = [kinds.get(a.name) for a in pooled[1:]]
        if len(pooled) == 2:
            return first if others[0] == first else None
        return first if first == "mean" else None  # P + R: right for a mean only (each microbatch adds R)
    if node.target in _SCALE_OPS and len(pooled) == 1 and node.args[0] is pooled[0]:
        factor = node.args[1]
        if isinstance(factor, fx.Node):
            return "mean" if factor.name in norms and first == "sum" else first
        if small is None or not isinstance(small.args[1], (int, float)):
            return None
        ratio = factor / small.args[1] if small.args[1] else None
        if ratio == 1:
            return first
        by_batch = m if _SCALE_OPS[node.target] == "div" else 1 / m
        return "mean" if first == "sum" and ratio is not None and abs(ratio - by_batch) < 1e-9 else None
    return first if len(pooled) == 1 else None


def _is_pooled(state) -> bool:
    return isinstance(state, Placement) and state.is_partial


def _propagate(node: fx.Node, ins: list[State]) -> State:
    """The node's output state(s) given its inputs', or ``_COUPLED``."""
    n_out = len(node.meta["val"]) if isinstance(node.meta.get("val"), (list, tuple)) else 1
    if all(s == R for s in ins):
        return R if n_out == 1 else [R] * n_out
    strategies = [st for st in node_strategies(node, _MESH) if all(sp.placements[0] == R for sp in st.inputs)]
    match = next((st for st in strategies if _accepts(st, ins, exact=True)), None)
    match = match or next((st for st in strategies if _accepts(st, ins, exact=False)), None)
    if match is None:
        if any(s is not None and s.is_partial for s in ins):
            return _COUPLED
        return _guess(node, ins)
    if any(s is None for s in ins):
        return _guess(node, ins)
    outs = [o.placements[1] if o is not None else R for o in match.outputs]
    return outs[0] if n_out == 1 else outs + [R] * (n_out - len(outs))


def _guess(node: fx.Node, ins: list[State]) -> State:
    """Outputs of an operator whose rule cannot follow the samples (or whose input is unknown).

    Such operators in training steps route tokens (a sort of all tokens by expert, a gather
    by the sorted order, the inverse permutation: mixture-of-experts dispatch) or index the
    batch by position (HF's mask building, T5's shifted labels): row i of the output still
    belongs to a sample, so an output whose dim 0 has several rows is taken as split along
    dim 0, which keeps a later pooling visible; anything else is unknown.
    """
    val = node.meta.get("val")
    vals = list(val) if isinstance(val, (list, tuple)) else [val]
    carries = any(s is None or s.is_shard for s in ins)
    outs = [_S0 if carries and isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] > 1 else None
            for v in vals]
    return outs[0] if not isinstance(val, (list, tuple)) else outs


def _accepts(st: Strategy, ins: list[State], exact: bool) -> bool:
    """Whether ``st`` reads the inputs as they are (``exact=False``: an R input may be sliced, an
    unknown one is anything)."""
    for spec, s in zip(st.inputs, ins):
        want = spec.placements[1]
        if want == s:
            continue
        if exact or not (s is None or (s == R and want.is_shard)):
            return False
    return True
