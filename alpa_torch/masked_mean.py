"""Exact masked means: a cross-entropy with ``ignore_index`` averaged over the whole batch.

``F.cross_entropy`` (and Hugging Face's ``labels=`` loss, which pads its shifted labels
with -100) averages over the targets that are not ``ignore_index``: a sum divided by a
count of the whole batch. Split the batch over devices or microbatches and each part
averages over its own count: DTensor's rule for ``nll_loss_forward`` says
``Partial('avg')`` (an average of the parts' means) and the pipeline averages the
microbatches' losses; both differ from eager as soon as the parts hold different numbers
of ignored targets (padding).

So capture rewrites every mean-reduced ``nll_loss_forward`` / ``nll_loss2d_forward`` whose
target is read straight from the batch (through views, slices and pads only) and that has
no class weights::

    loss = nll(x, t, reduction=mean)   ->   loss = nll(x, t, reduction=sum) / n
    nll_backward(g, ..., mean, w)      ->   nll_backward(g / n, ..., sum, n)  (a sum ignores w)

where ``n`` is a new 0-dim batch input, ``loss_norm.{k}``: the driver counts the targets
of the whole batch that are not ignored (``OpGraph.loss_norms``, replaying the views on the
real batch) and sends ``count / num_microbatches`` with every microbatch. A sum over a
sharded batch is a partial sum DTensor reduces exactly, and the pipeline's average of
its microbatches' ``sum_k / (count / B)`` is the whole batch's ``sum / count``.

Left as they are (and still exact when every part holds as many ignored targets, e.g. no
padding): a loss with class weights, whose targets are computed from the data, or on
bf16 / fp16 log-probabilities (their sum, rounded to 8 or 11 bits before the division, would
not be eager's mean; under ``precision='bf16'`` autocast computes log-softmax in float32, so
mixed precision is rewritten).
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from .batch import _PASS_THROUGH

log = logging.getLogger(__name__)
aten = torch.ops.aten

NORM_PREFIX = "loss_norm."
"""Batch input name prefix of the counts the rewrite divides by."""
_NLL = {aten.nll_loss_forward.default: aten.nll_loss_backward.default,
        aten.nll_loss2d_forward.default: aten.nll_loss2d_backward.default}
_MEAN, _SUM = 1, 2


def _target_chain(node: fx.Node, batch_nodes: set[str]) -> list[fx.Node] | None:
    """The pass-through operators from a batch placeholder to ``node`` (the placeholder first), or None."""
    chain = [node]
    while chain[-1].op != "placeholder":
        cur = chain[-1]
        if cur.op != "call_function" or cur.target not in _PASS_THROUGH:
            return None
        chain.append(cur.args[0])
    return chain[::-1] if chain[-1].name in batch_nodes else None


def _count_program(chain: list[fx.Node], ignore_index: int) -> fx.GraphModule:
    """A small module: the batch leaf -> the number of its targets (after the chain) not ignored."""
    g = fx.Graph()
    env = {chain[0].name: g.placeholder("leaf")}
    for node in chain[1:]:
        env[node.name] = g.node_copy(node, lambda a: env[a.name])
    kept = g.call_function(aten.ne.Scalar, (env[chain[-1].name], ignore_index))
    g.output(g.call_function(aten.sum.default, (kept,)))
    return fx.GraphModule(torch.nn.Module(), g)


def rewrite(gm: fx.GraphModule, batch_nodes: dict[str, str], add_input) -> dict[str, tuple[str, fx.GraphModule]]:
    """Rewrite the mean-reduced NLL losses of ``gm`` (module docstring), in place.

    ``batch_nodes``: batch input name -> placeholder name; ``add_input(name, example)``
    appends a batch input and returns its placeholder. Returns, per count input, the batch
    input it counts and the program that counts it."""
    graph = gm.graph
    by_placeholder = {v: k for k, v in batch_nodes.items()}
    forwards = [n for n in graph.nodes if n.op == "call_function" and n.target in _NLL and n.args[3] == _MEAN
                and n.args[2] is None and n.args[0].meta["val"].dtype in (torch.float32, torch.float64)]
    out = {}
    for k, fwd in enumerate(forwards):
        chain = _target_chain(fwd.args[1], set(by_placeholder))
        if chain is None:
            log.info("%s: its targets are computed, not read from the batch: left mean-reduced (exact while every "
                     "part of the batch holds as many ignored targets)", fwd.name)
            continue
        name = f"{NORM_PREFIX}{k}"
        norm = add_input(name, torch.tensor(1.0))
        _rewrite_one(graph, fwd, norm)
        out[name] = (by_placeholder[chain[0].name], _count_program(chain, int(fwd.args[4])))
    if out:
        graph.eliminate_dead_code()  # the counts the sum-reduced losses no longer read
        graph.lint()
        gm.recompile()
    return out


def _rewrite_one(graph: fx.Graph, fwd: fx.Node, norm: fx.Node) -> None:
    """``fwd`` (mean-reduced) as a sum divided by ``norm``; its backward nodes take ``grad / norm``."""
    x, t, w, _, ignore = fwd.args
    backward = _NLL[fwd.target]
    with graph.inserting_after(fwd):
        summed = graph.call_function(fwd.target, (x, t, w, _SUM, ignore))
        summed.meta = dict(fwd.meta)
    with graph.inserting_after(summed):
        total = graph.call_function(operator.getitem, (summed, 0))
        total.meta["val"] = fwd.meta["val"][0]
    with graph.inserting_after(total):
        scale = graph.call_function(aten._to_copy.default, (norm,), {"dtype": total.meta["val"].dtype})
        scale.meta["val"] = total.meta["val"].new_empty(())
    with graph.inserting_after(scale):
        mean = graph.call_function(aten.div.Tensor, (total, scale))
        mean.meta["val"] = total.meta["val"]
    for user in list(fwd.users):  # getitem(fwd, 0): the loss; getitem(fwd, 1): the count
        if user.args[1] == 0:
            user.replace_all_uses_with(mean)
            graph.erase_node(user)
        else:
            user.args = (summed, 1)
    graph.erase_node(fwd)
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is backward and node.args[1] is x and node.args[2] is t
                and node.args[4] == _MEAN):
            grad = node.args[0]
            with graph.inserting_before(node):
                scaled = graph.call_function(aten.div.Tensor, (grad, scale))
                scaled.meta["val"] = grad.meta["val"]
            args = list(node.args)
            # a sum's backward ignores total_weight: hand it the replicated count, so the partial
            # count of a sharded batch is never reduced for nothing
            args[0], args[4], args[6] = scaled, _SUM, scale
            node.args = tuple(args)
