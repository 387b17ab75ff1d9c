"""Where a plan reduces each gradient: the chain rule shared by the runtime and the cost model.

A data-parallel plan leaves each device with a partial sum of a gradient:
``g = sum_r g_r`` over the devices ``r`` of a mesh axis (DTensor ``Partial``),
and the plan reduces it to ``R`` (all-reduce) or ``S(d)`` (reduce-scatter) at
its first consumer, often through a layout operator or two on the way
(``mm -> t -> t -> alpa.grad``). On a 2-D mesh a gradient is partial over both
axes (``PP``), and the plan may reduce it in two steps, one axis at a time at
different operators (``PP -> RP`` at the first transpose, ``RP -> RR`` at the
marker; the ILP prices both orders the same).

``find_reductions`` finds, per gradient marker, the reduction the runtime runs
instead, once a step, in flat buckets of ``BUCKET_CAP_BYTES``
(``runtime/grad_buckets.py`` runs them; ``stage_dp/layer_parts.py`` prices them):

- the layout operators between the partial value and the gradient marker run
  on the partial value (a transpose or view of a sum is the sum of the
  transposes), and so does ``embedding_dense_backward`` with replicated indices
  (linear in the gradient); the reductions of every axis on the way become one
  reduction over all of them, at the marker;
- a gradient the plan keeps partial through its marker (the ILP may price
  reducing it at each of the update's readers) is reduced once, at the marker,
  when every reader wants the same placements (``_at_readers``).

Only gradients whose plan reduces P to R or S on exactly the partial axes,
through layout (or linear) operators read by nothing else, qualify; every
other value runs as the plan says. Specs are DTensor placement tuples; records
are ``(op, name, target, args, kwargs, inputs)`` as ``runtime.program.serialize_graph``
writes them (the cost model passes ``None`` for args and kwargs).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate

LAYOUT_OPS = frozenset({"aten.t.default", "aten.view.default", "aten._unsafe_view.default",
                        "aten.reshape.default", "aten.transpose.int"})
"""Operators that only re-index their input: they commute with a sum over devices."""
LINEAR_OPS = frozenset({"aten.embedding_dense_backward.default"})
"""Operators linear in their first input (the others replicated): they commute with a sum
over devices up to the order of additions (DTensor runs them on ``P`` as ``P``)."""
MAX_CHAIN = 4
BUCKET_CAP_BYTES = 25 * 2**20  # DDP's bucket_cap_mb


@dataclass(frozen=True, slots=True)
class GradReduction:
    """Where the plan reduces one gradient, and to what."""

    marker: str
    axes: tuple[int, ...]
    """Mesh axes the gradient is a partial sum over."""
    target: tuple
    """DTensor placement the plan wants on each of ``axes`` (Replicate or Shard), in ``axes`` order."""
    deferred: tuple[str, ...]
    """Layout records between the partial value and the marker; they run on the partial value."""


def find_reductions(records: list[tuple], value_specs: dict, input_specs: dict,
                    marker_name: str) -> dict[str, GradReduction]:
    """Gradient marker -> its ``GradReduction``, for every gradient the plan reduces from P.

    ``records`` are ``(op, name, target, args, kwargs, inputs)``; specs are DTensor
    placement tuples (``value_specs[name]``, ``input_specs[name][j]`` for tensor input j)."""
    by_name = {r[1]: r for r in records}
    readers: dict[str, int] = {}
    wants: dict[str, list] = {}
    for r in records:
        for j, a in enumerate(r[5]):
            readers[a] = readers.get(a, 0) + 1
            specs = input_specs.get(r[1])
            wants.setdefault(a, []).append(tuple(specs[j]) if specs and j < len(specs) else None)
    out = {}
    for r in records:
        if r[0] == "call_function" and str(r[2]) == marker_name:
            found = (_walk_back(r, by_name, readers, value_specs, input_specs)
                     or _at_readers(r, wants.get(r[1], []), value_specs))
            if found is not None:
                out[r[1]] = found
    return out


def _at_readers(marker, wants: list, value_specs) -> GradReduction | None:
    """A gradient the plan keeps partial through its marker (an optimizer's update reads it; the
    ILP chose to reduce it at each reader, a blocking collective per reader): when every reader
    wants the same placements, reduced once at the marker, in a bucket, instead."""
    have = value_specs.get(marker[1])
    if have is None or not wants or len(set(wants)) != 1 or wants[0] is None or len(wants[0]) != len(have):
        return None
    want = wants[0]
    axes = tuple(a for a, p in enumerate(have) if p != want[a])
    if (not axes or any(not is_sum(have[a]) or want[a].is_partial() for a in axes)
            or any(p.is_partial() for a, p in enumerate(have) if a not in axes)):
        return None
    return GradReduction(marker[1], axes, tuple(want[a] for a in axes), ())


def _walk_back(marker, by_name, readers, value_specs, input_specs) -> GradReduction | None:
    """Walk from the marker towards the gradient's producer through deferrable records.

    Every edge on the way where the plan changes placements must only reduce partial
    sums (``P(sum)`` -> ``R`` / ``S``) on axes no other edge of the chain reduces: a
    2-D plan may reduce a ``PP`` gradient in two steps (``PP -> RP`` at a transpose,
    ``RP -> RR`` at the marker), which becomes one reduction over both axes. The
    reduction edge furthest from the marker whose source value is partial only over
    the chain's reduced axes wins; the records between it and the marker are deferred."""
    node, deferred, axes, best = marker, [], [], None
    for _ in range(MAX_CHAIN + 1):
        if not node[5] or not input_specs.get(node[1]):
            break
        src = node[5][0]
        have, want = value_specs.get(src), input_specs[node[1]][0]
        if have is None or len(have) != len(want):
            break
        changed = [a for a, (h, w) in enumerate(zip(have, want)) if h != w]
        if changed:
            if any(a in axes or not is_sum(have[a]) or want[a].is_partial() for a in changed):
                break
            axes = sorted(axes + changed)
        if axes and any(p.is_partial() for a, p in enumerate(have) if a not in axes):
            break  # partial over an axis the chain does not reduce
        if changed and all(_deferrable_with(by_name[d], axes, input_specs) for d in deferred):
            best = (tuple(axes), tuple(deferred))
        prev = by_name.get(src)
        if (prev is None or prev[0] != "call_function" or readers.get(src, 0) != 1
                or not _deferrable(prev, input_specs)):
            break
        deferred.append(src)
        node = prev
    if best is None:
        return None
    out = value_specs.get(marker[1])
    if out is None or any(out[a].is_partial() for a in best[0]):
        return None
    return GradReduction(marker[1], best[0], tuple(out[a] for a in best[0]), best[1])


def _deferrable(record, input_specs) -> bool:
    """A layout operator of one tensor, or an operator linear in its first input."""
    op, n_in = str(record[2]), len(input_specs.get(record[1], ()))
    return (op in LAYOUT_OPS and n_in == 1) or (op in LINEAR_OPS and n_in >= 1)


def _deferrable_with(record, axes, input_specs) -> bool:
    """Whether ``record`` can run on a value partial over ``axes``: its other inputs are replicated there."""
    return all(isinstance(spec[a], Replicate) for spec in input_specs[record[1]][1:] for a in axes)


def plain_partial(p) -> bool:
    """``p`` is a ``Partial`` whose summands add up as they are. Not DTensor's ``_MaskPartial``
    (the output of an embedding or a gather over a vocabulary-sharded table): the rows whose
    index lies outside a device's shard hold garbage until the mask DTensor saved when it split
    the indices zeroes them, which only DTensor's own reduction does (it also frees the mask;
    an all-reduce of the raw summands is a silently wrong sum)."""
    return type(p) is Partial


def is_sum(p) -> bool:
    """``p`` is a plain ``Partial`` sum (``plain_partial``)."""
    return plain_partial(p) and p.reduce_op == "sum"
