"""Sharding strategies of one aten operator on a 1D/2D logical mesh.

A strategy fixes the spec of every tensor input and of the output(s). We take
them from PyTorch's own DTensor sharding rules (its per-mesh-dim
"single-dim" strategies expanded to the whole mesh, or its full-mesh strategy
functions), the same rules the runtime's DTensor execution follows, so a plan
is executed exactly as priced. Lookup order (as in Meta's AutoParallel):
DTensor rule -> all-Replicate fallback with one warning per operator.

Those rules need a ``DeviceMesh``, and a ``DeviceMesh`` needs a process group:
planning uses PyTorch's in-process *fake* process group (``FakeStore``), so a
mesh of 64 devices costs nothing and nothing is communicated. This is the one
place ``intra_ilp`` touches ``torch.distributed``, and only for its rule table.
"""

from __future__ import annotations

import itertools
import logging
import operator
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree

import alpa_torch.core.op_rules  # noqa: F401 - DTensor rules the graphs need (aten.copy)
from alpa_torch.core.spec import P, Placement, R, S, ShardingSpec, from_dtensor_placements, to_dtensor_placements

log = logging.getLogger(__name__)
aten = torch.ops.aten

_FAKE_WORLD = 1 << 16
_WARNED: set[str] = set()


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run an operator: specs of its tensor inputs and outputs."""

    inputs: tuple[ShardingSpec, ...]
    """One spec per tensor input, in ``node.all_input_nodes`` order."""
    outputs: tuple[ShardingSpec | None, ...]
    """One spec per tensor output (None for a non-tensor output)."""

    @property
    def name(self) -> str:
        outs = ",".join(str(o) for o in self.outputs)
        return f"{outs}<-{','.join(str(i) for i in self.inputs)}"


def _ensure_fake_pg() -> None:
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=_FAKE_WORLD)


@cache
def fake_mesh(mesh_shape: tuple[int, int]):
    """A DeviceMesh of ``mesh_shape`` on the fake process group (planning only)."""
    from torch.distributed.device_mesh import DeviceMesh

    _ensure_fake_pg()
    n = mesh_shape[0] * mesh_shape[1]
    return DeviceMesh("cpu", torch.arange(n).view(*mesh_shape))


def _tensor_meta(val: torch.Tensor):
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    return TensorMeta(val.shape, val.stride(), val.dtype)


def _input_options(val: torch.Tensor, mesh_ndim: int) -> list[tuple[Placement, ...]]:
    """Candidate placements of an input: R, S(d) per dim, and P for floats."""
    opts: list[Placement] = [R] + [S(d) for d in range(val.dim()) if val.shape[d] > 1]
    if val.dtype.is_floating_point:
        opts.append(P)
    return list(itertools.product(opts, repeat=mesh_ndim))


def _op_strategy_at(mesh, val: torch.Tensor, i: int):
    """Candidate ``i`` (cycled) of an input's placements, as a one-entry OpStrategy."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

    options = _input_options(val, mesh.ndim)
    spec = ShardingSpec(options[i % len(options)])
    return OpStrategy([OpSpec(DTensorSpec(mesh, to_dtensor_placements(spec), _tensor_meta(val)))])


def _schema(node: fx.Node, mesh, i: int = 0):
    """The node's OpSchema with every tensor input fixed to its candidate ``i``.

    DTensor's full-mesh rules pair the j-th strategy of each input (they zip
    them), so asking with one candidate at a time gives the same rows as one
    call with all candidates, lets a rule reject one candidate (an uneven view)
    without losing the others, and skips its O(k²) redistribute-cost tables.
    A list of tensors (``cat``) becomes a ``TupleStrategy``, as DTensor expects.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import OpSchema, TupleStrategy

    prop = DTensor._op_dispatcher.sharding_propagator

    def wrap(a):
        if isinstance(a, fx.Node):
            v = a.meta["val"]
            return _op_strategy_at(mesh, v, i) if isinstance(v, torch.Tensor) else v
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, fx.Node) for x in a):
            return TupleStrategy([wrap(x) for x in a])
        if isinstance(a, (list, tuple)):
            return type(a)(wrap(x) for x in a)
        return a

    args = tuple(wrap(a) for a in node.args)
    kwargs = {k: wrap(v) for k, v in node.kwargs.items()}
    return OpSchema(node.target, args, kwargs, schema_info=prop.op_to_schema_info.get(node.target))


def _out_meta(node: fx.Node):
    out = node.meta["val"]
    if isinstance(out, torch.Tensor):
        return _tensor_meta(out)
    return tuple(_tensor_meta(v) if isinstance(v, torch.Tensor) else None for v in out)


def _single_dim_rows(node: fx.Node, info, mesh) -> list[list]:
    """Per-mesh-dim rules of a DTensor single-dim strategy: [outputs..., inputs...] rows."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops import single_dim_strategy as sds

    schema = _schema(node, mesh)
    rows = info.func(node.target, schema.args_meta, schema.kwargs_meta)
    num_inputs = sds._get_num_tensor_inputs(schema)
    num_outputs = len(rows[0]) - num_inputs if rows else _tensor_outputs(node)
    rows = sds._insert_single_dim_replication_strategy(list(rows), num_outputs, num_inputs, _out_meta(node))
    rows = sds._fill_single_dim_strategy_placeholders({Shard(0)}, rows)
    return rows, num_outputs


def _shardable(spec: ShardingSpec, shape, mesh_shape) -> bool:
    """Whether ``spec`` lays out a tensor of ``shape``: it shards only dims the tensor has, and
    no dim into more shards than it has elements (empty shards).

    A rule's row is matched to the node's tensors by position; a ``Shard(d)`` beyond a
    tensor's rank (on a 0-d loss, or a row read against another tensor) would reach
    ``ShardingSpec.local_shape`` in the cost model and fail there with an IndexError.
    """
    if any(p.is_shard and not 0 <= p.dim < len(shape) for p in spec.placements):
        return False
    return all(spec.shard_count(mesh_shape, d) <= max(shape[d], 1) for d in range(len(shape)))


def _from_rows(node: fx.Node, info, mesh, mesh_shape) -> list[Strategy]:
    rows, num_outputs = _single_dim_rows(node, info, mesh)
    metas = [v.meta["val"] for v in _tensor_arg_nodes(node)]
    out_vals = node.meta["val"] if isinstance(node.meta["val"], (list, tuple)) else [node.meta["val"]]
    shapes = [getattr(v, "shape", None) for v in out_vals] + [m.shape for m in metas]
    if rows and (len(rows[0]) != len(shapes) or num_outputs != len(out_vals)):
        log.debug("DTensor rule for %s lists %d tensors, the node has %d: not used", node.target,
                  len(rows[0]), len(shapes))
        return []
    result = []
    for combo in itertools.product(rows, repeat=len(mesh_shape)):
        specs = []
        for i in range(len(combo[0])):
            per_axis = [row[i] for row in combo]
            if any(p is None for p in per_axis):
                specs.append(None)
                continue
            spec = from_dtensor_placements(per_axis)
            if spec is None or shapes[i] is not None and not _shardable(spec, shapes[i], mesh_shape):
                break
            specs.append(spec)
        else:
            result.append(Strategy(tuple(specs[num_outputs:]), tuple(specs[:num_outputs])))
    return result


def _dtensor_strategies(node: fx.Node, mesh, mesh_shape) -> list[Strategy] | None:
    """Strategies from DTensor's rule for ``node``; None when it has no rule."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    single = prop.op_single_dim_strategy_funcs.get(node.target)
    if single is not None:
        return _from_rows(node, single, mesh, mesh_shape)
    full = prop.op_strategy_funcs.get(node.target)
    if full is None:
        return None
    tensor_args = _tensor_arg_nodes(node)
    count = max((len(_input_options(a.meta["val"], mesh.ndim)) for a in tensor_args), default=1)
    out: list[Strategy] = []
    for i in range(count):
        try:
            op_strategy = full(_schema(node, mesh, i))
        except Exception as exc:  # noqa: BLE001 - the rule rejects this candidate: skip it
            log.debug("DTensor rule for %s rejects candidate %d: %s", node.target, i, exc)
            continue
        if not hasattr(op_strategy, "strategies"):  # a TupleStrategy (foreach ops): not modelled
            return None
        out += [s for s in _convert(op_strategy, len(tensor_args), _tensor_outputs(node)) if s not in out]
    # as ``_from_rows``: no strategy splits a dim into more shards than it has elements (a
    # full-mesh rule, e.g. a view's, may nest S(2)S(2) on a dim of 2 over 4 devices: empty shards)
    out_vals = node.meta["val"] if isinstance(node.meta["val"], (list, tuple)) else [node.meta["val"]]
    in_shapes = [a.meta["val"].shape for a in tensor_args]
    out_shapes = [getattr(v, "shape", None) for v in out_vals]
    return [st for st in out
            if all(_shardable(sp, sh, mesh_shape) for sp, sh in zip(st.inputs, in_shapes))
            and all(sp is None or sh is None or _shardable(sp, sh, mesh_shape)
                    for sp, sh in zip(st.outputs, out_shapes))]


def _convert(op_strategy, n_inputs: int, n_outputs: int) -> list[Strategy]:
    out: list[Strategy] = []
    seen = set()
    for spec in op_strategy.strategies:
        outs = spec.output_specs
        outs = outs if isinstance(outs, (list, tuple)) else (outs,)
        outputs = tuple(from_dtensor_placements(o.placements) if o is not None else None for o in outs)
        inputs = tuple(from_dtensor_placements(i.placements) for i in (spec.input_specs or ()))
        if len(inputs) != n_inputs or len(outputs) != n_outputs:
            continue
        if any(x is None for x in inputs) or any(x is None for x, o in zip(outputs, outs) if o is not None):
            continue  # a placement ShardingSpec cannot express
        key = (inputs, outputs)
        if key not in seen:
            seen.add(key)
            out.append(Strategy(inputs, outputs))
    return out


def _tensor_outputs(node: fx.Node) -> int:
    val = node.meta.get("val")
    return 1 if isinstance(val, torch.Tensor) else len(val) if isinstance(val, (list, tuple)) else 0


def replicated_strategy(node: fx.Node, mesh_ndim: int) -> Strategy:
    rep = ShardingSpec.replicated(mesh_ndim)
    val = node.meta.get("val")
    outs = (rep,) if isinstance(val, torch.Tensor) else tuple(
        rep if isinstance(v, torch.Tensor) else None for v in (val or ())
    )
    n_in = sum(1 for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor))
    return Strategy((rep,) * n_in, outs)


def _tensor_arg_nodes(node: fx.Node) -> list[fx.Node]:
    """Tensor-valued argument nodes in the order DTensor lists ``input_specs``."""
    leaves = torch.utils._pytree.tree_leaves((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _per_unique_input(strategies: list[Strategy], arg_nodes, unique) -> list[Strategy]:
    """Map per-argument specs onto unique input nodes (x * x reads x once)."""
    out, seen = [], set()
    for st in strategies:
        chosen: dict[str, ShardingSpec] = {}
        if any(chosen.setdefault(a.name, spec) != spec for a, spec in zip(arg_nodes, st.inputs)):
            continue
        merged = Strategy(tuple(chosen[u.name] for u in unique), st.outputs)
        if merged not in seen:
            seen.add(merged)
            out.append(merged)
    return out


def _signature(node: fx.Node, mesh_shape) -> tuple:
    """What the strategies of ``node`` depend on: op, argument structure, shapes.

    Argument identity matters only as a pattern (``x * x`` differs from
    ``x * y``), so the same operator in every layer of a model shares one key.
    """
    names: list[str] = []

    def key(a: fx.Node):
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            names.append(a.name)
            return ("T", tuple(v.shape), tuple(v.stride()), str(v.dtype))
        return ("N", repr(v))

    args = fx.node.map_arg((node.args, node.kwargs), key)
    pattern = tuple(names.index(n) for n in names)
    out = node.meta.get("val")
    out_key = tuple(getattr(v, "shape", None) for v in (out if isinstance(out, (list, tuple)) else [out]))
    return (str(node.target), repr(args), pattern, repr(out_key), tuple(mesh_shape))


_CACHE: dict[tuple, list[Strategy]] = {}


def node_strategies(node: fx.Node, mesh_shape: tuple[int, int]) -> list[Strategy]:
    """Every strategy of ``node`` on a logical mesh; the replicated one first.

    Memoised on the node's signature: repeated layers cost one lookup each."""
    key = _signature(node, mesh_shape)
    if key not in _CACHE:
        _CACHE[key] = _node_strategies(node, mesh_shape)
    return _CACHE[key]


def _node_strategies(node: fx.Node, mesh_shape: tuple[int, int]) -> list[Strategy]:
    arg_nodes = _tensor_arg_nodes(node)
    unique = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    rep = replicated_strategy(node, 2)
    try:
        found = _dtensor_strategies(node, fake_mesh(mesh_shape), mesh_shape) or []
    except Exception as exc:  # noqa: BLE001 - a rule that rejects these args: fall back
        log.debug("DTensor rule for %s failed: %s", node.target, exc)
        found = []
    strategies = _per_unique_input(found, arg_nodes, unique)
    if node.target in _ONE_AXIS_PER_DIM:
        strategies = [s for s in strategies if not any(map(_dim_on_two_axes, (*s.inputs, *s.outputs)))]
    if not strategies:
        if node.target is not operator.getitem:
            _warn_fallback(node)
        return [rep]
    return [rep] + [s for s in strategies if s != rep]


_ONE_AXIS_PER_DIM = frozenset({aten.convolution.default, aten.convolution_backward.default})
"""Operators DTensor runs through its own handlers (``torch.distributed.tensor._tp_conv``), which
read each tensor's ``dim_map`` and reject a dim sharded on two mesh axes that its sharding rule
offers (``[Shard(0), Shard(0)]``: the batch split over a whole 2-D mesh)."""


def _dim_on_two_axes(spec: ShardingSpec | None) -> bool:
    dims = [p.dim for p in spec.placements if p.kind == "S"] if spec is not None else []
    return len(dims) != len(set(dims))


def _warn_fallback(node: fx.Node) -> None:
    key = str(node.target)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("no sharding rule for %s: it runs replicated", key)


def source_specs(val, mesh_ndim: int, allow_partial: bool = False) -> list[ShardingSpec]:
    """Specs a value the stage does not compute may be held in (R first)."""
    if not isinstance(val, torch.Tensor):
        return [ShardingSpec.replicated(mesh_ndim)]
    opts = _input_options(val, mesh_ndim)
    specs = [ShardingSpec(p) for p in opts]
    return [s for s in specs if allow_partial or not s.has_partial]
