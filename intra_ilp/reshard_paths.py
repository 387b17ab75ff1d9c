"""Resharding: the cheapest way to move a tensor from one ``ShardingSpec`` to another.

Resharding (Alpa §4.1 "resharding cost"): a tensor moves from spec ``src`` to
spec ``dst`` by single-axis steps, each changing the placement on one mesh
axis ``a`` while the other axes stay put:

    P → R     all-reduce          S(d) → R     all-gather
    P → S(d)  reduce-scatter      S(d) → S(e)  all-to-all
    R → S(d)  local slice, free   R → P        keep one summand, zero the rest: free

(S→P is S→R→P.) The message size of a step is the local shard size at that
point with axis ``a`` taken as unsharded, so shards on the other axis make
messages smaller. A step that adds or removes ``S(d)`` on axis ``a`` is only
correct when no later axis shards dim ``d`` too: placements nest left to
right (``spec.py``), so with ``S(0)S(0)`` axis 1 must be gathered before
axis 0. ``reshard_s`` is the cheapest sequence of such steps: a shortest path
(Dijkstra) over the specs of the tensor. That covers both axis orders, the
forced order of nested shards and hierarchical sequences (reduce-scatter on
one axis, all-reduce the smaller shard on the other, all-gather back) where
they win.

A mesh that spans every device of the cluster (``MeshCost.world``: a one-stage
plan) is the runtime's default process group, and on a 2-D one the runtime
takes one collective over all ``N = n0·n1`` devices where DTensor would take one
per axis (``runtime/grad_buckets.py``, ``replicate_over_world``): ``P P`` to any
spec without P is one all-reduce then local slices, ``S(d) S(d) → R R`` (``d``
split evenly) one all-gather. The model prices those paths so, in place of the
per-axis ones, with the slower axis' link (a ring over every device crosses it)
and ``b`` the whole tensor:

    world all-reduce  max α + 2 max β b (N-1)/N
    world all-gather  max α +   max β b (N-1)/N

Priced per axis, a 2-D data-parallel gradient's reduce-scatter on one axis and
all-gather on the other looked cheaper than two all-reduces, where the runtime
runs one bucketed all-reduce.

Caches: Dijkstra results and reshard matrices are memoised with
``functools.lru_cache`` on pure, hashable keys (mesh, specs, shape, itemsize);
there is no other module state. Each collective's price is ``cost_model``'s.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from alpa_torch.core.spec import P, R, S, ShardingSpec

from .cost_model import (
    WORLD_AXIS,
    MeshCost,
    State,
    allgather_s,
    allreduce_s,
    alltoall_s,
    local_numel,
    mesh_placements,
    reducescatter_s,
    world_allgather_s,
    world_allreduce_s,
)


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """One single-axis step of a resharding sequence (for inspection and tests)."""

    axis: int
    """Mesh axis, or ``WORLD_AXIS``: every axis in one collective."""
    src: ShardingSpec
    dst: ShardingSpec
    collective: str  # all_reduce | all_gather | reduce_scatter | all_to_all | slice | zero | relabel
    nbytes: int
    cost_s: float


def _innermost(state: State, axis: int, dim: int) -> bool:
    """True if no axis after ``axis`` shards ``dim`` (placements nest left to right)."""
    return not any(p.kind == "S" and p.dim == dim for p in state[axis + 1 :])


def _steps_from(mesh: MeshCost, state: State, shape: tuple[int, ...], itemsize: int):
    """Yield ``(next_state, cost_s, collective, axis, nbytes)`` for every legal single-axis step."""
    targets = (R, P) + tuple(S(d) for d in range(len(shape)))
    for axis, n in enumerate(mesh.mesh_shape):
        cur = state[axis]
        # Size of the tensor as the n devices of this axis group see it together.
        group_bytes = local_numel(state[:axis] + (R,) + state[axis + 1 :], shape, mesh.mesh_shape) * itemsize
        for new in targets:
            if new == cur:
                continue
            nxt = state[:axis] + (new,) + state[axis + 1 :]
            if n == 1:  # every placement is the same layout on a size-1 axis
                yield nxt, 0.0, "relabel", axis, 0
                continue
            if cur.kind == "S" and not _innermost(state, axis, cur.dim):
                continue
            if new.kind == "S" and not _innermost(state, axis, new.dim):
                continue
            if cur.kind == "R":
                yield nxt, 0.0, ("zero" if new.kind == "P" else "slice"), axis, 0
            elif cur.kind == "P" and new.kind == "R":
                yield nxt, allreduce_s(mesh, axis, group_bytes), "all_reduce", axis, group_bytes
            elif cur.kind == "P":
                yield nxt, reducescatter_s(mesh, axis, group_bytes), "reduce_scatter", axis, group_bytes
            elif new.kind == "R":
                yield nxt, allgather_s(mesh, axis, group_bytes), "all_gather", axis, group_bytes
            elif new.kind == "S":
                yield nxt, alltoall_s(mesh, axis, group_bytes), "all_to_all", axis, group_bytes
            # S -> P has no single step: it goes S -> R -> P.


@lru_cache(maxsize=8192)
def _shortest_from(mesh: MeshCost, src: State, shape: tuple[int, ...], itemsize: int):
    """Dijkstra from ``src`` over all specs of the tensor: (cost_s, back-pointers) per state.

    Internal and cached: callers must not mutate the returned dicts.
    """
    dist: dict[State, float] = {src: 0.0}
    back: dict[State, tuple[State, str, int, int, float]] = {}
    tie = itertools.count()
    heap = [(0.0, next(tie), src)]
    done: set[State] = set()
    while heap:
        cost, _, state = heapq.heappop(heap)
        if state in done:
            continue
        done.add(state)
        for nxt, step_s, collective, axis, nbytes in _steps_from(mesh, state, shape, itemsize):
            total = cost + step_s
            if total < dist.get(nxt, math.inf):
                dist[nxt] = total
                back[nxt] = (state, collective, axis, nbytes, step_s)
                heapq.heappush(heap, (total, next(tie), nxt))
    return dist, back


def _world_path(mesh: MeshCost, src: State, dst: State, shape: tuple[int, ...], itemsize: int) -> list | None:
    """The runtime's one-collective path from ``src`` to ``dst`` on a whole-cluster 2-D mesh
    (module docstring) as ``(prev, next, collective, axis, nbytes, cost_s)`` steps, or None where
    the runtime goes per axis: from ``P P`` to a spec without P, one all-reduce then local slices
    (on axis 0, then axis 1: placements nest left to right); from ``S(d) S(d)`` (``d`` split
    evenly) to ``R R``, one all-gather. The runtime takes these whenever they apply, so the
    model does too, cheaper or not than the per-axis path."""
    if not mesh.world or min(mesh.mesh_shape) == 1:
        return None
    nbytes = math.prod(shape) * itemsize
    rep = (R,) * len(src)
    if all(p.kind == "P" for p in src) and not any(p.kind == "P" for p in dst):
        steps = [(src, rep, "all_reduce", WORLD_AXIS, nbytes, world_allreduce_s(mesh, nbytes))]
        if dst[0] != R:
            steps.append((rep, (dst[0], R), "slice", 0, 0, 0.0))
        if dst[1] != R:
            steps.append(((dst[0], R), dst, "slice", 1, 0, 0.0))
        return steps
    if (dst == rep and all(p.kind == "S" for p in src) and len({p.dim for p in src}) == 1
            and shape[src[0].dim] % mesh.num_devices == 0):
        return [(src, rep, "all_gather", WORLD_AXIS, nbytes, world_allgather_s(mesh, nbytes))]
    return None


@lru_cache(maxsize=4096)
def _all_pairs(mesh: MeshCost, shape: tuple[int, ...], itemsize: int) -> tuple[dict[State, int], np.ndarray]:
    """``(index of each state, dist[from, to])``: the cheapest ``_steps_from`` sequence between
    every two states, Floyd-Warshall; one table for every source, not a Dijkstra per source
    (-8 % planning CPU on LLaMA-3-8B at 8x8). Internal and cached: the table is read-only."""
    kinds = (R, P) + tuple(S(d) for d in range(len(shape)))
    states = list(itertools.product(kinds, repeat=len(mesh.mesh_shape)))
    index = {state: i for i, state in enumerate(states)}
    dist = np.where(np.eye(len(states), dtype=bool), 0.0, np.inf)
    for i, state in enumerate(states):
        for nxt, step_s, *_ in _steps_from(mesh, state, shape, itemsize):
            dist[i, index[nxt]] = min(dist[i, index[nxt]], step_s)
    for k in range(len(states)):
        np.minimum(dist, dist[:, k, None] + dist[None, k, :], out=dist)
    dist.flags.writeable = False
    return index, dist


def _cost(mesh: MeshCost, src: State, dst: State, canonical: tuple) -> float:
    """``reshard_s`` between two states, ``canonical`` = ``_canonical(shape, itemsize, ...)``."""
    world = _world_path(mesh, src, dst, *canonical)
    if world is not None:
        return math.fsum(step[-1] for step in world)
    index, dist = _all_pairs(mesh, *canonical)
    return float(dist[index[src], index[dst]])


def _key(mesh: MeshCost, spec: ShardingSpec, shape: Sequence[int]) -> State:
    return mesh_placements(spec, mesh.mesh_shape, len(shape))


def _canonical(shape: tuple[int, ...], itemsize: int, mesh_shape: tuple[int, int]) -> tuple[tuple[int, ...], int]:
    """A (shape, itemsize) with the same local shard bytes under every spec, shared by many tensors.

    A dim divisible by N = n0·n1 is cut exactly by every spec (each shard count
    divides N), so only the product of such dims (and the itemsize) matters:
    they become (N, ..., N, rest) with itemsize 1. Tensors of equal size then
    share one Dijkstra run: the "(spec, local size)" cache key.
    """
    full = mesh_shape[0] * mesh_shape[1]
    exact = [i for i, d in enumerate(shape) if d > 0 and d % full == 0]
    if not exact:
        return shape, itemsize
    out = list(shape)
    for i in exact[:-1]:
        out[i] = full
    out[exact[-1]] = math.prod(shape[i] for i in exact) * itemsize // full ** (len(exact) - 1)
    return tuple(out), 1


def reshard_s(
    mesh: MeshCost, src: ShardingSpec, dst: ShardingSpec, global_shape: Sequence[int], itemsize: int
) -> float:
    """Seconds to convert a tensor from ``src`` to ``dst`` on ``mesh`` (module docstring).

    The cheapest sequence of single-axis collectives / local slices (Alpa,
    OSDI'22, §4.1 resharding cost, with its alpha-beta collective model).
    """
    shape = tuple(int(x) for x in global_shape)
    return _cost(mesh, _key(mesh, src, shape), _key(mesh, dst, shape),
                 _canonical(shape, int(itemsize), mesh.mesh_shape))


def reshard_path(
    mesh: MeshCost, src: ShardingSpec, dst: ShardingSpec, global_shape: Sequence[int], itemsize: int
) -> tuple[ReshardStep, ...]:
    """The step sequence ``reshard_s`` prices, first step first (zero-cost relabels dropped)."""
    shape = tuple(int(x) for x in global_shape)
    src_state, state = _key(mesh, src, shape), _key(mesh, dst, shape)
    canonical = _canonical(shape, int(itemsize), mesh.mesh_shape)
    world = _world_path(mesh, src_state, state, *canonical)
    if world is not None:
        return tuple(ReshardStep(axis, ShardingSpec(a), ShardingSpec(b), collective, nbytes, cost)
                     for a, b, collective, axis, nbytes, cost in world)
    _, back = _shortest_from(mesh, src_state, *canonical)
    steps = []
    while state != src_state:
        prev, collective, axis, nbytes, step_s = back[state]
        if collective != "relabel":
            steps.append(ReshardStep(axis, ShardingSpec(prev), ShardingSpec(state), collective, nbytes, step_s))
        state = prev
    return tuple(reversed(steps))


@lru_cache(maxsize=4096)
def _matrix(mesh: MeshCost, srcs: tuple, dsts: tuple, shape: tuple[int, ...], itemsize: int) -> np.ndarray:
    src_states, dst_states = [_key(mesh, d, shape) for d in srcs], [_key(mesh, d, shape) for d in dsts]
    canonical = _canonical(shape, itemsize, mesh.mesh_shape)
    index, dist = _all_pairs(mesh, *canonical)
    out = dist[np.ix_([index[s] for s in src_states], [index[d] for d in dst_states])]
    if mesh.world and min(mesh.mesh_shape) > 1:  # the runtime's one-collective paths, where they apply
        for i, src in enumerate(src_states):
            if all(p.kind in ("P", "S") for p in src):
                for j, dst in enumerate(dst_states):
                    out[i, j] = _cost(mesh, src, dst, canonical)
    out.flags.writeable = False
    return out


def reshard_matrix_s(
    mesh: MeshCost,
    src_specs: Sequence[ShardingSpec],
    dst_specs: Sequence[ShardingSpec],
    shape: Sequence[int],
    itemsize: int,
) -> np.ndarray:
    """``out[i, j] = reshard_s(mesh, src_specs[i], dst_specs[j], shape, itemsize)``, float64.

    One shortest-path table per (mesh, canonical shape and itemsize, see
    ``_canonical``) for every source (``_all_pairs``); whole matrices are memoised too,
    so repeated edges (every layer of a transformer) cost a dict lookup.
    Returns a fresh writable array.
    """
    return _matrix(mesh, tuple(src_specs), tuple(dst_specs), tuple(int(x) for x in shape), int(itemsize)).copy()
