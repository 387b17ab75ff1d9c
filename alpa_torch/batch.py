"""The batch a step receives, as the captured graph sees it.

Owns three things about the ``batch`` argument of ``train_step``:

- **Its layout** (``BatchLayout``): the pytree structure (dicts, lists, tuples, named
  tuples and dataclasses, which are registered as pytree nodes on first sight), and per
  leaf what it is to the graph. A tensor is data (a graph input). A Python ``float`` is
  data too: it becomes a 0-dim float32 tensor, so a loss weight or a temperature that
  changes between calls reaches the workers on every call. Anything else (an ``int``, a
  ``bool``, a string, ``None``, a float the step cannot take as a tensor) is a constant
  the graph was captured with. ``BatchLayout.change`` names what differs between two
  calls (structure, a constant's value, a tensor's dtype): the caller captures again.
- How it splits into microbatches is ``alpa_torch.core.microbatches`` (the runtime cuts
  batches by the same rule).
- **Range checks of index tensors** (``index_rules`` / ``check_indices``): an integer
  leaf read (through views) by an embedding, a cross-entropy / NLL loss, a gather or an
  index_select must hold valid indices; the driver checks each batch before any worker
  runs, so a bad label names itself instead of failing inside a worker.

What it does not own: tracing (``capture``) or sending the batch (``api``, ``runtime``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from alpa_torch.core.errors import BatchSplitError, IndexRangeError

log = logging.getLogger(__name__)
aten = torch.ops.aten

TENSOR, SCALAR, CONSTANT = "tensor", "scalar", "constant"
SCALAR_DTYPE = torch.float32
"""A Python float of the batch travels as a 0-dim tensor of this dtype: with it, ``int_tensor *
w`` and ``half_tensor * w`` keep the dtype eager gives them (a 0-dim tensor does not promote a
dimensioned one of the same category), and float32 arithmetic rounds ``w`` as eager's kernels
do."""


def register_dataclasses(batch: Any) -> None:
    """Register the type of every dataclass instance in ``batch`` as a pytree node (its
    ``init`` fields are the children), so its tensors are leaves like a tuple's."""
    while True:
        leaves = pytree.tree_leaves(batch)
        found = {type(x) for x in leaves if dataclasses.is_dataclass(x) and not isinstance(x, type)}
        if not found:
            return
        for cls in found:
            fields = [f.name for f in dataclasses.fields(cls) if f.init]
            hidden = [f.name for f in dataclasses.fields(cls) if not f.init]
            if hidden:
                raise BatchSplitError(
                    f"the batch holds a {cls.__name__} dataclass with fields outside __init__ ({hidden}); alpa-torch "
                    "rebuilds a dataclass from its __init__ fields. Fix: make every field an init field, or pass a "
                    "dict or a tuple")
            pytree.register_dataclass(cls, field_names=fields)
            log.debug("registered dataclass %s (%s) as a pytree node", cls.__name__, fields)


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """What each leaf of a batch is to the captured graph (module docstring)."""

    spec: pytree.TreeSpec
    paths: tuple[str, ...]
    """Each leaf's place in the batch, as Python writes it: ``[1]``, ``['labels']``, ``.x``."""
    kinds: tuple[str, ...]
    """``TENSOR``, ``SCALAR`` (a Python float sent as a 0-dim tensor) or ``CONSTANT``."""
    dtypes: tuple[str | None, ...]
    constants: tuple[Any, ...]
    """A constant leaf's value (None for data leaves)."""

    @staticmethod
    def of(batch: Any, scalars_as_data: bool = True) -> BatchLayout:
        """The layout of ``batch``; with ``scalars_as_data`` False every float is a constant."""
        register_dataclasses(batch)
        with_paths, spec = pytree.tree_flatten_with_path(batch)
        kinds, dtypes, constants = [], [], []
        for _, leaf in with_paths:
            if isinstance(leaf, torch.Tensor):
                kinds.append(TENSOR), dtypes.append(str(leaf.dtype).removeprefix("torch.")), constants.append(None)
            elif scalars_as_data and type(leaf) is float:
                kinds.append(SCALAR), dtypes.append("float32"), constants.append(None)
            else:
                kinds.append(CONSTANT), dtypes.append(None), constants.append(leaf)
        paths = tuple(pytree.keystr(p) for p, _ in with_paths)
        return BatchLayout(spec, paths, tuple(kinds), tuple(dtypes), tuple(constants))

    @property
    def scalars_as_data(self) -> bool:
        return SCALAR in self.kinds

    def name(self, i: int) -> str:
        """How a message names leaf ``i``: ``batch['labels']``."""
        return f"batch{self.paths[i]}"

    def change(self, batch: Any) -> str | None:
        """What differs between ``batch`` and the batch this layout was taken from, in words
        (None: nothing the graph depends on). Shapes are not compared here."""
        now = BatchLayout.of(batch, self.scalars_as_data)
        if now.spec != self.spec:
            return f"the batch's structure changed (was {_short(self.spec)}, now {_short(now.spec)})"
        for i, (k0, k1) in enumerate(zip(self.kinds, now.kinds)):
            if k0 != k1:
                return f"{self.name(i)} was a {k0}, now a {k1}"
            if self.dtypes[i] != now.dtypes[i]:
                return f"{self.name(i)} changed dtype from {self.dtypes[i]} to {now.dtypes[i]}"
            if k0 == CONSTANT and not _same(self.constants[i], now.constants[i]):
                return f"{self.name(i)} changed from {self.constants[i]!r} to {now.constants[i]!r}"
        return None

    def graph_batch(self, batch: Any) -> Any:
        """``batch`` as the graph takes it: each float that is data made a 0-dim tensor."""
        leaves = pytree.tree_leaves(batch)
        return pytree.tree_unflatten([torch.tensor(v, dtype=SCALAR_DTYPE) if k == SCALAR else v
                                      for v, k in zip(leaves, self.kinds)], self.spec)

    def data_leaves(self, batch: Any) -> dict[int, torch.Tensor]:
        """Leaf index -> tensor, for every data leaf of ``batch`` (floats as 0-dim tensors)."""
        out = {}
        for i, (leaf, kind) in enumerate(zip(pytree.tree_leaves(batch), self.kinds)):
            if kind == TENSOR:
                out[i] = leaf
            elif kind == SCALAR:
                out[i] = torch.tensor(leaf, dtype=SCALAR_DTYPE)
        return out


def _short(spec: pytree.TreeSpec) -> str:
    text = " ".join(str(spec).split())
    return text if len(text) < 120 else text[:117] + "..."


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an == that raises or gives an array: not provably the same
        return False


# ---------------------------------------------------------------- index range checks

# Operators that move or reshape values without changing them: an index read through them
# is still the batch's index.
_PASS_THROUGH = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.slice.Tensor, aten.select.int,
    aten.clone.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default,
    aten.permute.default, aten.transpose.int, aten.t.default, aten.expand.default, aten.alias.default,
    aten.constant_pad_nd.default, aten.flatten.using_ints, aten.contiguous.default,
}


@dataclass(frozen=True, slots=True)
class IndexRule:
    """An integer batch leaf is read as indices in ``[0, bound)`` (``ignore``: a value allowed
    besides) by ``operator``."""

    operator: str
    bound: int
    ignore: int | None = None
    what: str = "index"


def _rule(node, arg) -> IndexRule | None:
    """The rule ``node`` imposes on its argument ``arg`` (an fx node), or None."""
    t, args = node.target, node.args

    def size(x, dim):
        return int(x.meta["val"].shape[dim])

    if t is aten.embedding.default and args[1] is arg:
        return IndexRule("embedding", size(args[0], 0), what="token id")
    if t in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default) and args[1] is arg:
        logits = args[0].meta["val"]
        classes = int(logits.shape[1] if logits.dim() >= 2 else logits.shape[0])
        ignore = int(args[4]) if len(args) > 4 else -100
        return IndexRule("cross-entropy / NLL loss", classes, ignore, what="class label")
    if t is aten.gather.default and args[2] is arg:
        return IndexRule("gather", size(args[0], int(args[1])))
    if t is aten.index_select.default and args[2] is arg:
        return IndexRule("index_select", size(args[0], int(args[1])))
    return None


def index_rules(gm: torch.fx.GraphModule, batch_nodes: dict[str, str]) -> dict[str, list[IndexRule]]:
    """Batch input name -> the index rules its integer values must obey.

    ``batch_nodes``: batch input name -> placeholder node name. A leaf is followed through
    ``_PASS_THROUGH`` operators only; any arithmetic ends the search (its values are no
    longer the batch's)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    out: dict[str, list[IndexRule]] = {}
    for input_name, node_name in batch_nodes.items():
        start = by_name[node_name]
        val = start.meta.get("val")
        if val is None or val.dtype.is_floating_point or val.dtype == torch.bool:
            continue
        rules, todo, seen = [], [start], set()
        while todo:
            node = todo.pop()
            for user in node.users:
                if user.name in seen:
                    continue
                seen.add(user.name)
                if user.op == "call_function" and user.target in _PASS_THROUGH and user.args[0] is node:
                    todo.append(user)
                elif user.op == "call_function" and (rule := _rule(user, node)) is not None:
                    rules.append(rule)
        if rules:
            out[input_name] = sorted(set(rules), key=lambda r: (r.bound, r.operator))
    return out


def check_indices(rules: dict[str, list[IndexRule]], leaves: dict[str, torch.Tensor], names: dict[str, str]) -> None:
    """Raise ``IndexRangeError`` for the first value of a leaf outside its rules' range.

    ``leaves``: batch input name -> the tensor sent; ``names``: batch input name -> how a
    message names it (``batch['labels']``)."""
    for input_name, leaf_rules in rules.items():
        t = leaves.get(input_name)
        if t is None or t.numel() == 0:
            continue
        for rule in leaf_rules:
            bad = (t < 0) | (t >= rule.bound)
            if rule.ignore is not None:
                bad &= t != rule.ignore
            if bool(bad.any()):
                position = tuple(int(i) for i in bad.nonzero()[0])
                value = int(t[position])
                allowed = f"0..{rule.bound - 1}" + (f" (or {rule.ignore}, ignored)" if rule.ignore is not None else "")
                raise IndexRangeError(
                    f"{names[input_name]} holds the {rule.what} {value} at position {position}, but the "
                    f"{rule.operator} that reads it accepts {allowed}: the output it indexes has {rule.bound} "
                    f"entries there. Fix the data (or the model's size: e.g. its vocabulary or number of classes)",
                    name=names[input_name], value=value, position=position, valid=(0, rule.bound - 1))
