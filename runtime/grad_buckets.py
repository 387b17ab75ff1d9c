"""Partial gradients reduced in flat, asynchronous buckets (as DDP does), where the plan reduces them.

A data-parallel plan leaves each device with a partial sum of a gradient:
``g = sum_r g_r`` over the devices ``r`` of a mesh axis (DTensor ``Partial``),
and the plan reduces it to ``R`` (all-reduce) or ``S(d)`` (reduce-scatter) at
its first consumer, often through a layout operator or two on the way
(``mm -> t -> t -> alpa.grad``). Run literally, that is one blocking collective
per gradient (per consumer, even), in the middle of backward. On a 2-D mesh a
gradient is partial over both axes (``PP``), and the plan may reduce it in two
steps, one axis at a time at different operators (``PP -> RP`` at the first
transpose, ``RP -> RR`` at the marker; the ILP prices both orders the same):
two blocking collectives.

This module finds those reductions in the plan (``find_reductions``) and
executes them in buckets (``GradBuckets``):

- the layout operators between the partial value and the gradient marker run
  on the partial value instead (a transpose or view of a sum is the sum of
  the transposes: no arithmetic, so exactly the same numbers), and so does
  ``embedding_dense_backward`` with replicated indices (linear in the gradient:
  the same sum, added in another order); the reductions of every axis on the
  way become one reduction over all of them, at the marker;
- at the marker, the gradient's local summand joins a bucket of gradients
  with the same placements; a bucket of ``cap_bytes`` (25 MiB, DDP's default)
  is concatenated into one flat fp32 buffer and all-reduced with
  ``async_op=True`` on the mesh axis' process group (over both axes of a 2-D
  mesh: the default group when the mesh is the whole world, else one axis
  after the other) as soon as its last gradient is final, the rest when the
  last bucketed gradient arrives;
- the first operator reading a gradient waits for its bucket and gets a
  ``DTensor`` view of the reduced buffer, with ``R`` on the reduced axes, or
  ``S(d)`` there when the plan's value spec of the gradient says so (the local
  chunk of the all-reduced value: on gloo an all-reduce is 3-4x faster per
  byte than a reduce-scatter, docs/design.md).

A gradient the plan keeps partial through its marker (the ILP may price reducing it at each of
the update's readers: an all-reduce per reader, blocking) is reduced once, at the marker, in a
bucket, when every reader wants the same placements (``_at_readers``).

Equivalence: the result is the same sum of partials, in fp32; only the order
in which the collective adds the devices' summands may differ from the
per-tensor collective (a few ulps on more than 2 devices; bit-identical on 2).
Only gradients whose plan reduces P to R or S on exactly the partial axes,
through layout (or linear) operators read by nothing else, are bucketed; every
other value runs as the plan says. Reduce ops other than a sum stay with DTensor.

The end of the module holds the other one-collective paths the interpreter
uses: ``replicate_over_world`` (a value partial or sharded over both axes of a
2-D mesh made replicated in one collective, not one per axis) and
``gather_replicated`` (state updated on shards, stored replicated: one flat
all-gather per placements instead of one per tensor and axis).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

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
    if (not axes or any(not _is_sum(have[a]) or want[a].is_partial() for a in axes)
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
            if any(a in axes or not _is_sum(have[a]) or want[a].is_partial() for a in changed):
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


def _is_sum(p) -> bool:
    return plain_partial(p) and p.reduce_op == "sum"


def deferred_wants(reductions: dict[str, GradReduction], input_specs: dict) -> dict[str, list[tuple]]:
    """Input specs of the deferred layout records: partial on the reduced axes (no reduction there)."""
    out = {}
    for red in reductions.values():
        for name in red.deferred:
            want = list(input_specs[name][0])
            for a in red.axes:
                want[a] = Partial()
            out[name] = [tuple(want), *input_specs[name][1:]]
    return out


class _Bucket:
    __slots__ = ("placements", "names", "locals", "shapes", "numel", "nbytes", "flat", "work", "axes_left", "done")

    def __init__(self, placements: tuple):
        self.placements = placements
        self.names: list[str] = []
        self.locals: list[torch.Tensor] = []
        self.shapes: list[torch.Size] = []
        self.numel = 0
        """Elements so far: where the next member starts in ``flat``."""
        self.nbytes = 0
        self.flat: torch.Tensor | None = None
        self.work = None
        self.axes_left: list = []
        self.done = False


class GradBuckets:
    """The bucketed reductions of one step on one device (see the module docstring)."""

    def __init__(self, mesh, reductions: dict[str, GradReduction], cap_bytes: int = BUCKET_CAP_BYTES):
        self.mesh = mesh
        self.reductions = reductions
        self.cap_bytes = cap_bytes
        # One collective over every device when a gradient is partial over the whole mesh
        # and the mesh is the whole world (no new process group needed: creating one is collective).
        self._world = dist.get_world_size() == mesh.size()
        self._open: dict[tuple, _Bucket] = {}
        self._of: dict[str, tuple[_Bucket, int, torch.Size, int]] = {}
        self._pending = 0
        self.scale = 1
        self.collectives = 0

    def begin(self, scale: int = 1) -> None:
        """Start a step; reduced gradients are divided by ``scale`` (microbatches)."""
        self.scale = scale
        self._pending = len(self.reductions)

    def put(self, name: str, local: torch.Tensor, placements: tuple, shape: torch.Size) -> bool:
        """Hand over this device's summand ``local`` of the final gradient ``name`` (global ``shape``).

        False when ``placements`` are not the partial sum the plan said: the caller keeps
        the value and its consumers redistribute it as planned."""
        red = self.reductions[name]
        placements = tuple(placements)
        if not all(_is_sum(placements[a]) for a in red.axes) or any(
                p.is_partial() for a, p in enumerate(placements) if a not in red.axes):
            self._arrived()
            return False
        key = (placements, red.axes, local.dtype)
        bucket = self._open.get(key)
        if bucket is None:
            bucket = self._open[key] = _Bucket(placements)
        self._of[name] = (bucket, len(bucket.names), shape, bucket.numel)
        bucket.numel += local.numel()
        bucket.names.append(name)
        bucket.locals.append(local)
        bucket.shapes.append(local.shape)
        bucket.nbytes += local.numel() * local.element_size()
        if bucket.nbytes >= self.cap_bytes:
            self._issue(self._open.pop(key), red.axes)
        self._arrived()
        return True

    def _arrived(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            self.flush()

    def flush(self) -> None:
        """Issue every open bucket (the gradients of this step are final)."""
        for key, bucket in list(self._open.items()):
            self._issue(bucket, key[1])
        self._open.clear()

    def _issue(self, bucket: _Bucket, axes: tuple[int, ...]) -> None:
        # [sum of numels] fp32: the bucket's local summands back to back
        bucket.flat = torch.cat([t.reshape(-1) for t in bucket.locals]) if len(bucket.locals) > 1 \
            else bucket.locals[0].reshape(-1).clone()
        bucket.locals = []
        groups = [None] if self._world and len(axes) == self.mesh.ndim else [self.mesh.get_group(a) for a in axes]
        bucket.work = dist.all_reduce(bucket.flat, group=groups[0], async_op=True)
        bucket.axes_left = groups[1:]  # further axes: one after the other, when first read
        self.collectives += len(groups)

    def _complete(self, bucket: _Bucket) -> None:
        if bucket.flat is None:
            self._open = {k: b for k, b in self._open.items() if b is not bucket}
            self._issue(bucket, self.reductions[bucket.names[0]].axes)
        bucket.work.wait()
        for group in bucket.axes_left:
            dist.all_reduce(bucket.flat, group=group)
        if self.scale != 1:
            bucket.flat.div_(self.scale)
        bucket.done = True

    def take(self, name: str, local: bool = False):
        """The reduced gradient ``name`` (waits for its bucket): R, or S(d) where the plan wants it;
        with ``local``, this device's tensor of it (what a replaying runner keeps)."""
        bucket, i, gshape, offset = self._of.pop(name)
        if not bucket.done:
            self._complete(bucket)
        shape = bucket.shapes[i]
        piece = bucket.flat[offset:offset + math.prod(shape)].view(shape)
        red = self.reductions[name]
        reduced = list(bucket.placements)
        for a in red.axes:
            reduced[a] = Replicate()
        target = list(reduced)
        for a, p in zip(red.axes, red.target):
            target[a] = p
        if local and target == reduced:
            return piece
        stride = tuple(math.prod(gshape[k + 1:]) for k in range(len(gshape)))
        out = DTensor.from_local(piece, self.mesh, tuple(reduced), run_check=False, shape=gshape, stride=stride)
        if target != reduced:
            out = out.redistribute(self.mesh, tuple(target))  # R -> S(d): this device's chunk, no communication
        return out.to_local() if local else out

    def has(self, name: str) -> bool:
        return name in self._of

    def finish(self) -> None:
        """End of step: complete buckets nobody read, forget this step's gradients."""
        self.flush()
        for bucket, *_ in list(self._of.values()):
            if not bucket.done:
                self._complete(bucket)
        self._of.clear()


# ---------------------------------------------------------------- one flat collective instead of many


def mesh_is_world(mesh) -> bool:
    """Whether ``mesh`` holds every rank of the default group, in rank order (row-major): one
    collective over the default group then spans every mesh axis, in the shards' order."""
    return (dist.is_initialized() and dist.get_world_size() == mesh.size()
            and mesh.mesh.flatten().tolist() == list(range(mesh.size())))


def replicate_over_world(value: DTensor, mesh) -> DTensor | None:
    """``value`` made all-``Replicate`` with one collective over the default group, or None.

    DTensor reduces a value partial over both axes of a 2-D mesh (the loss, the
    token count), or gathers one sharded over both, one axis at a time: two
    blocking collectives. When ``mesh_is_world(mesh)``, one all-reduce (sum; avg
    = sum / n: every axis averages equal groups) or one all-gather (the same
    tensor dim sharded on every axis, evenly: the world's rank order is then the
    shards' order) does it. An axis of size 1 changes nothing and is left out (a 4x1 mesh of
    the world gathers a ``Shard(0)Replicate`` value with this one all-gather, not through
    DTensor's Python). Other placements: None (the caller asks DTensor)."""
    local, n = value.to_local(), mesh.size()
    placements = tuple(p for axis, p in enumerate(value.placements) if mesh.size(axis) > 1)
    if not placements:
        return None
    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    if len(ops) == 1 and all(map(plain_partial, placements)) and ops <= {"sum", "avg"}:
        out = local.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out)
        if ops == {"avg"}:
            out.div_(n)
    elif all(type(p) is Shard for p in placements) and len({p.dim for p in placements}) == 1:
        d = placements[0].dim
        if local.shape[d] * n != value.shape[d]:
            return None  # uneven shards
        src = local.movedim(d, 0).contiguous()
        out = torch.empty((n * src.shape[0], *src.shape[1:]), dtype=src.dtype, device=src.device)
        dist.all_gather_single(out, src)
        out = out.movedim(0, d).contiguous() if d else out
    else:
        return None
    return DTensor.from_local(out, mesh, (Replicate(),) * mesh.ndim, run_check=False)


def shard_to_shard(value: DTensor, placements: tuple) -> DTensor | None:
    """``value`` moved from ``Shard(i)`` to ``Shard(j)`` on one mesh axis by one all-to-all, or None.

    DTensor's own path on a gloo group (``shard_dim_alltoall``) all-gathers the whole
    tensor and keeps a chunk, with a warning on every worker; gloo has an all-to-all, and
    the cost model prices this move as one (``intra_ilp.cost_model``: all_to_all). Each
    device cuts its local tensor into n chunks along ``j``, sends chunk k to the k-th
    device of the axis and concatenates what it receives along ``i`` in axis order: the
    layout DTensor would produce. Handled: exactly one axis changes, from one ``Shard`` to
    another, no other axis shards dim i or j, both dims divide evenly, and the axis' group
    runs gloo (NCCL: DTensor's own all-to-all). Anything else: None (the caller asks DTensor)."""
    have = tuple(value.placements)
    changed = [a for a, (p, q) in enumerate(zip(have, placements)) if p != q]
    if len(changed) != 1:
        return None
    axis = changed[0]
    src, dst = have[axis], placements[axis]
    if not (type(src) is Shard and type(dst) is Shard):
        return None
    i, j = src.dim, dst.dim
    mesh, n = value.device_mesh, value.device_mesh.size(axis)
    others = [p for a, p in enumerate(have) if a != axis]
    if any(isinstance(p, Shard) and p.dim in (i, j) for p in others):
        return None
    local = value.to_local()
    group = mesh.get_group(axis)
    if value.shape[i] % n or value.shape[j] % n or dist.get_backend(group) != "gloo":
        return None
    send = torch.stack(local.chunk(n, dim=j))  # [n, *chunk]: chunk k goes to the k-th device
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    out = torch.cat(received.unbind(0), dim=i)
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=value.shape, stride=value.stride())


def gather_replicated(mesh, values: dict[str, DTensor], local: bool = False) -> dict[str, DTensor | torch.Tensor]:
    """``values`` (sharded) as all-``Replicate`` DTensors (``local``: their full tensors), one flat
    all-gather per placements.

    A plan that updates replicated state on shards (each device computes a slice
    of the new weights) stores the results replicated: run literally, one
    blocking all-gather per tensor (per mesh axis on a 2-D mesh) at the end of
    every step. Here the local shards of all values with the same placements are
    concatenated and all-gathered once, over the one mesh axis they are sharded
    on, or over every rank when they are sharded on every axis and
    ``mesh_is_world``; each device's piece goes where DTensor's own layout
    arithmetic puts it (exact: a gather does no arithmetic). Values partial,
    sharded over some but not all axes, or sharded unevenly are left out (the
    caller redistributes them). Every device must call it with the same values."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    buckets: dict[tuple, list] = {}
    for name, v in values.items():
        placements = tuple(v.placements)
        axes = tuple(a for a, p in enumerate(placements) if isinstance(p, Shard) and mesh.size(a) > 1)
        if (not axes or any(p.is_partial() for p in placements)
                or (len(axes) > 1 and not (len(axes) == mesh.ndim and mesh_is_world(mesh)))):
            continue
        buckets.setdefault((placements, axes, v.dtype), []).append((name, v))
    out = {}
    rep = (Replicate(),) * mesh.ndim
    for (placements, axes, dtype), members in buckets.items():
        group = mesh.get_group(axes[0]) if len(axes) == 1 else None
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        coords = [(mesh.mesh == r).nonzero()[0].tolist() for r in ranks]
        layouts = []  # (name, value, [(local shape, global offset) of each rank in group order])
        for name, v in members:
            lo = [_compute_local_shape_and_global_offset(v.shape, mesh.shape, c, placements) for c in coords]
            if len({s for s, _ in lo}) == 1 and tuple(v.to_local().shape) == tuple(lo[0][0]):
                layouts.append((name, v, lo))
        if not layouts:
            continue
        flat = torch.cat([v.to_local().reshape(-1) for _, v, _ in layouts])
        gathered = torch.empty(len(ranks) * flat.numel(), dtype=dtype, device=flat.device)
        dist.all_gather_single(gathered, flat, group=group)
        full = {name: torch.empty(v.shape, dtype=dtype, device=flat.device) for name, v, _ in layouts}
        for k in range(len(ranks)):
            offset = k * flat.numel()
            for name, _, lo in layouts:
                shape, start = lo[k]
                numel = math.prod(shape)
                index = tuple(slice(o, o + s) for o, s in zip(start, shape))
                full[name][index] = gathered[offset:offset + numel].view(shape)
                offset += numel
        for name, t in full.items():
            out[name] = t if local else DTensor.from_local(t, mesh, rep, run_check=False)
    return out
