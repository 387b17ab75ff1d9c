"""Partial gradients reduced in flat, asynchronous buckets (as DDP does), where the plan reduces them.

Run literally, a data-parallel plan reduces each partial gradient where it first meets a
consumer: one blocking collective per gradient (per consumer, even), in the middle of
backward. ``alpa_torch.core.grad_reductions.find_reductions`` finds those reductions (the
layout operators between the partial value and the marker run on the partial value; the
reductions of every axis on the way become one, at the marker), and this module executes
them in buckets (``GradBuckets``):

- at the marker, the gradient's local summand joins a bucket of gradients
  with the same placements; a bucket of ``cap_bytes`` (25 MiB, DDP's default)
  is concatenated into one flat fp32 buffer and all-reduced with
  ``async_op=True`` on the mesh axis' process group (over both axes of a 2-D
  mesh: the default group when the mesh is the whole world, else one axis
  after the other) as soon as its last gradient is final, the rest when the
  last bucketed gradient arrives;
- from the second step on (the replay, ``interpreter.StageRunner.end_step``), a bucket's
  markers sit right after its last gradient is computed (``bucketed_order``): the capture puts
  every marker after the whole backward, where no reduction could overlap it. A gradient of
  more than 25 MiB fills a bucket by itself; a model whose gradients fit one bucket (the deep
  GPT of ``bench/vs_pytorch.py``, 7.6 MB) reduces after its backward, as DDP's second bucket
  does. Smaller buckets would overlap more, and on one core per device cost more: the
  reductions' thread takes the core from the backward
  (``docs/results/bucket_cap_overlap_2026-11-29.log``);
- the first operator reading a gradient (from the second step on, reading any gradient of
  its bucket: ``bucket_groups``, ``StageRunner._collect_before``) waits for its bucket and gets a
  ``DTensor`` view of the reduced buffer, with ``R`` on the reduced axes, or
  ``S(d)`` there when the plan's value spec of the gradient says so (the local
  chunk of the all-reduced value: on gloo an all-reduce is 3-4x faster per
  byte than a reduce-scatter, docs/design.md).

Equivalence: the result is the same sum of partials, in fp32; only the order
in which the collective adds the devices' summands may differ from the
per-tensor collective (a few ulps on more than 2 devices; bit-identical on 2).
Reduce ops other than a sum stay with DTensor.

The end of the module holds the other one-collective paths the interpreter
uses: ``replicate_over_world`` (a value partial or sharded over both axes of a
2-D mesh made replicated in one collective, not one per axis) and
``gather_replicated`` (state updated on shards, stored replicated: one flat
all-gather per placements instead of one per tensor and axis).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from alpa_torch.core.grad_reductions import (
    BUCKET_CAP_BYTES,
    GradReduction,
    find_reductions,
    is_sum,
    plain_partial,
)

from .timeline import StepRecorder

__all__ = ["BUCKET_CAP_BYTES", "GradBuckets", "bucket_groups", "bucketed_order", "deferred_wants", "find_reductions",
           "plain_partial"]


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
    __slots__ = ("placements", "names", "locals", "shapes", "numel", "nbytes", "flat", "work", "axes_left", "done",
                 "issued_ns")

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
        self.issued_ns = 0


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
        self.seen: dict[str, tuple[tuple, int]] = {}
        """Each bucketed gradient's bucket key and bytes, as last put (``bucket_groups`` reads them)."""
        self.recorder: StepRecorder | None = None
        """Where each bucket's all-reduce is recorded, from its start to its end as the step saw it
        (``timeline.py``'s 'reduction' events), if anywhere."""

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
        if not all(is_sum(placements[a]) for a in red.axes) or any(
                p.is_partial() for a, p in enumerate(placements) if a not in red.axes):
            self._arrived()
            return False
        key = (placements, red.axes, local.dtype)
        self.seen[name] = (key, local.numel() * local.element_size())
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
        bucket.issued_ns = time.time_ns()
        groups = [None] if self._world and len(axes) == self.mesh.ndim else [self.mesh.get_group(a) for a in axes]
        bucket.work = dist.all_reduce(bucket.flat, group=groups[0], async_op=True)
        bucket.axes_left = groups[1:]  # further axes: one after the other, when first read
        self.collectives += len(groups)

    def _complete(self, bucket: _Bucket) -> None:
        if bucket.flat is None:
            self._open = {k: b for k, b in self._open.items() if b is not bucket}
            self._issue(bucket, self.reductions[bucket.names[0]].axes)
        waited = time.time_ns()
        bucket.work.wait()
        for group in bucket.axes_left:
            dist.all_reduce(bucket.flat, group=group)
        if self.scale != 1:
            bucket.flat.div_(self.scale)
        bucket.done = True
        if self.recorder is not None:
            now = time.time_ns()
            self.recorder.add("all-reduce", "reduction", bucket.issued_ns, now, row="reductions",
                              gradients=len(bucket.names), bytes=bucket.nbytes, waited_ms=(now - waited) / 1e6)

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


def bucket_groups(records: list[tuple], seen: dict[str, tuple[tuple, int]],
                  cap_bytes: int) -> list[tuple[int, list[str]]]:
    """``GradBuckets.put``'s buckets, simulated on the step's ``records``: per bucket, the index of the
    record computing its last gradient and its markers' names, in the order they fill it.

    ``seen``: each bucketed marker's key and bytes (``GradBuckets.seen``). The gradients are taken in
    the order they are computed: a bucket of one key is full at ``cap_bytes``; the ones left open are
    issued when the last bucketed gradient is final (their index: the last gradient's)."""
    at = {r[1]: i for i, r in enumerate(records)}
    made = {r[1]: at[r[5][0]] for r in records if r[1] in seen}  # where each gradient is computed
    groups, open_ = [], {}
    for name in sorted(made, key=made.__getitem__):
        key, nbytes = seen[name]
        names, size = open_.get(key, ([], 0))
        names.append(name)
        open_[key] = (names, size + nbytes)
        if size + nbytes >= cap_bytes:
            groups.append((made[name], names))
            del open_[key]
    last = max(made.values(), default=-1)
    return groups + [(last, names) for names, _ in open_.values()]


def bucketed_order(records: list[tuple], groups: list[tuple[int, list[str]]]) -> list[tuple]:
    """``records`` with each bucket's gradient markers moved up to just after the record computing
    the last gradient of that bucket (``groups``: ``bucket_groups``), so that its reduction starts there and runs
    while the backward goes on (DDP's overlap), instead of after the whole backward, where the capture
    places every marker (when ``loss.backward()`` returned).

    A bucket's markers stay together in the order they fill it, so a compiled region ends once per
    bucket, not once per gradient. Only markers move, and only earlier: every reader of a marker comes
    after its old place, and the marker after its gradient's computation."""
    at = {r[1]: i for i, r in enumerate(records)}
    after: dict[int, list[str]] = {}
    for i, names in groups:
        if i < min(at[n] for n in names):  # a marker already above its bucket's last gradient stays
            after.setdefault(i, []).extend(names)
    moved = {n for names in after.values() for n in names}
    by_name = {r[1]: r for r in records}
    out = []
    for i, r in enumerate(records):
        if r[1] not in moved:
            out.append(r)
        out.extend(by_name[n] for n in after.get(i, ()))
    return out


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
