"""Cross-mesh resharding plans: exact coverage, replica choice, local all-gather, reference executor."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alpa_torch.core.spec import R, S, ShardingSpec
from runtime.resharding import (
    Box,
    MeshPlacement,
    Transfer,
    apply_plan_locally,
    plan_candidates,
    plan_transfer,
    tile_of,
)

MESH_SHAPES = [(1,), (2,), (3,), (4,), (1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 3), (2, 4), (4, 2)]


def spec(text: str) -> ShardingSpec:
    return ShardingSpec.parse(text)


def boxes_cover_exactly(boxes, tile: Box) -> bool:
    """The boxes are disjoint and their union is ``tile`` (checked point by point)."""
    seen = torch.zeros(tile.shape, dtype=torch.int32)
    for b in boxes:
        if b.intersect(tile) != b:
            return False
        seen[b.relative_to(tile)] += 1
    return bool((seen == 1).all())


def check_plan(plan, full):
    """The invariants every plan must satisfy, then run it and compare every tile."""
    gathered = {}
    for g in plan.gathers:
        assert len(g.devices) == len(g.pieces) > 1
        assert boxes_cover_exactly(g.pieces, g.box)
        for d in g.devices:
            gathered.setdefault(d, []).append(g)
    for d in plan.dst_mesh.devices:
        tile = plan.dst_tile(d)
        got = plan.transfers_to(d)
        assert len({t.box for t in got}) == len(got), "a box sent twice to one destination"
        for t in got:
            assert not t.box.is_empty
            src_tile = plan.src_tile(t.src_device)
            assert t.box.intersect(src_tile) == t.box, f"{t} not held by its source"
        final = [t.box for t in got]
        for g in gathered.get(d, []):
            mine = g.pieces[g.devices.index(d)]
            final += [p for p in g.pieces if p != mine and not p.is_empty]
        assert boxes_cover_exactly(final, tile) or tile.is_empty
    result = apply_plan_locally(plan, full)
    assert set(result) == set(plan.dst_mesh.devices)
    for d, local in result.items():
        assert torch.equal(local, full[tile_of(plan.dst_spec, full.shape, plan.dst_mesh, d)])


# --- hypothesis strategies -------------------------------------------------------------

@st.composite
def meshes(draw, pool=16):
    shape = draw(st.sampled_from(MESH_SHAPES))
    devices = draw(st.permutations(range(pool)))[: math.prod(shape)]
    return MeshPlacement(shape, tuple(devices))


def specs(ndim: int, mesh_ndim: int):
    placement = st.sampled_from([R] + [S(d) for d in range(ndim)])
    return st.lists(placement, min_size=mesh_ndim, max_size=mesh_ndim).map(lambda ps: ShardingSpec(tuple(ps)))


@st.composite
def problems(draw):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=0, max_size=4)))
    src_mesh, dst_mesh = draw(meshes()), draw(meshes())
    src = draw(specs(len(shape), src_mesh.ndim))
    dst = draw(specs(len(shape), dst_mesh.ndim))
    return shape, src, src_mesh, dst, dst_mesh


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.booleans())
def test_random_plans_are_exact(problem, gather):
    shape, src, src_mesh, dst, dst_mesh = problem
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    plan = plan_transfer(shape, src, src_mesh, dst, dst_mesh, allow_dst_gather=gather)
    check_plan(plan, full)


@settings(max_examples=150, deadline=None)
@given(problems())
def test_gather_never_sends_more_across(problem):
    shape, src, src_mesh, dst, dst_mesh = problem
    direct, gathered = plan_candidates(shape, src, src_mesh, dst, dst_mesh)
    assert direct.local_gather_bytes == 0
    if not set(src_mesh.devices) & set(dst_mesh.devices):  # disjoint meshes: every byte crosses
        assert gathered.cross_bytes <= direct.cross_bytes
        assert direct.cross_bytes == 4 * sum(direct.dst_tile(d).numel for d in dst_mesh.devices)


# --- exhaustive small cases --------------------------------------------------------------

@pytest.mark.parametrize("src_text,dst_text", list(itertools.product(
    ["RR", "S(0)R", "RS(0)", "S(1)S(0)", "S(0)S(0)", "S(1)R"], ["RR", "S(0)R", "RS(1)", "S(0)S(1)", "S(1)S(1)"])))
@pytest.mark.parametrize("gather", [False, True])
def test_uneven_2x4_to_2x2(src_text, dst_text, gather):
    shape = (7, 5)  # 7 over 4 -> 2,2,2,1; over 8 -> 1,...,1,0
    full = torch.randn(shape)
    src_mesh, dst_mesh = MeshPlacement.contiguous((2, 4)), MeshPlacement((2, 2), (9, 3, 8, 2))
    plan = plan_transfer(shape, spec(src_text), src_mesh, spec(dst_text), dst_mesh, allow_dst_gather=gather)
    check_plan(plan, full)


def test_tile_of_uneven_shards():
    mesh = MeshPlacement((4,), (5, 6, 7, 8))
    assert [tile_of(spec("S(0)"), (7, 3), mesh, d)[0] for d in mesh.devices] == [
        slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 7)]
    # torch.chunk rule: 5 over 4 gives 2,2,1 and an empty last piece.
    assert tile_of(spec("S(0)"), (5,), mesh, 8) == (slice(5, 5),)
    mesh2 = MeshPlacement.contiguous((2, 2))
    assert tile_of(spec("S(0)S(0)"), (8,), mesh2, 3) == (slice(6, 8),)
    assert mesh2.coord(2) == (1, 0)


def test_same_mesh_same_spec_is_all_local():
    mesh = MeshPlacement.contiguous((2, 4))
    plan = plan_transfer((8, 8), spec("S(0)S(1)"), mesh, spec("S(0)S(1)"), mesh)
    assert all(t.is_local for t in plan.transfers) and plan.cross_bytes == 0
    assert len(plan.transfers) == 8


def test_replica_choice_prefers_own_device_then_round_robin():
    src = MeshPlacement((2,), (0, 1))
    # Destination overlaps the source on device 1: it copies locally.
    plan = plan_transfer((4,), spec("R"), src, spec("R"), MeshPlacement((2,), (1, 5)))
    assert set(plan.transfers) == {Transfer(1, 1, Box((0,), (4,))), Transfer(0, 5, Box((0,), (4,)))}
    # Four destinations, two replicas: each replica sends to two of them.
    plan = plan_transfer((4,), spec("R"), src, spec("R"), MeshPlacement((4,), (4, 5, 6, 7)))
    assert [t.src_device for t in plan.transfers] == [0, 1, 0, 1]


def test_single_source_to_replicated_destination_with_gather():
    # Alpa's local all-gather: 1 source -> 4 replicas sends the box across once, in 4 pieces.
    src, dst = MeshPlacement((1,), (0,)), MeshPlacement((2, 2), (4, 5, 6, 7))
    direct, gathered = plan_candidates((8, 6), spec("R"), src, spec("RR"), dst)
    assert direct.cross_bytes == 4 * 48 * 4
    assert gathered.cross_bytes == 48 * 4
    assert gathered.local_gather_bytes == 3 * 48 * 4
    (g,) = gathered.gathers
    assert g.devices == (4, 5, 6, 7) and [p.shape for p in g.pieces] == [(2, 6)] * 4
    # Limited to mesh axis 1: two groups of two, each gathers its own copy.
    axis1 = plan_transfer((8, 6), spec("R"), src, spec("RR"), dst, allow_dst_gather=True, gather_axes=(1,))
    assert [g.devices for g in axis1.gathers] == [(4, 5), (6, 7)]
    assert axis1.cross_bytes == 2 * 48 * 4
    check_plan(axis1, torch.randn(8, 6))


def test_gather_only_along_replicated_axes():
    # S(0) on axis 0, R on axis 1: groups are the rows of the destination mesh.
    src, dst = MeshPlacement.contiguous((1, 2)), MeshPlacement((2, 2), (4, 5, 6, 7))
    plan = plan_transfer((6, 4), spec("RS(1)"), src, spec("S(0)R"), dst, allow_dst_gather=True)
    assert {g.devices for g in plan.gathers} == {(4, 5), (6, 7)}
    check_plan(plan, torch.randn(6, 4))


def test_scalar_and_empty_tensors():
    src, dst = MeshPlacement.contiguous((2,)), MeshPlacement((2, 2), (2, 3, 4, 5))
    for gather in (False, True):
        check_plan(plan_transfer((), spec("R"), src, spec("RR"), dst, allow_dst_gather=gather), torch.tensor(3.0))
        check_plan(plan_transfer((0, 3), spec("S(0)"), src, spec("S(1)R"), dst, allow_dst_gather=gather),
                   torch.zeros(0, 3))


@pytest.mark.parametrize("src_text,dst_text", [("P", "R"), ("R", "P"), ("S(0)P", "RR")])
def test_partial_is_refused(src_text, dst_text):
    mesh = MeshPlacement.contiguous((2,) * len(spec(src_text).placements))
    dmesh = MeshPlacement.contiguous((2,) * len(spec(dst_text).placements), 10)
    with pytest.raises(ValueError, match="reduce before resharding"):
        plan_transfer((4, 4), spec(src_text), mesh, spec(dst_text), dmesh)


def test_bad_inputs():
    with pytest.raises(ValueError):
        MeshPlacement((2, 2), (0, 1, 2))
    with pytest.raises(ValueError):
        MeshPlacement((2,), (1, 1))
    mesh = MeshPlacement.contiguous((2,))
    with pytest.raises(ValueError):
        plan_transfer((4,), spec("S(1)"), mesh, spec("R"), mesh)  # shards a dim the tensor lacks
    with pytest.raises(ValueError):
        plan_transfer((4,), spec("RR"), mesh, spec("R"), mesh)  # two axes on a 1-D mesh
    with pytest.raises(ValueError):
        tile_of(spec("R"), (4,), mesh, 7)
    plan = plan_transfer((4,), spec("R"), mesh, spec("S(0)"), mesh)
    with pytest.raises(ValueError):
        apply_plan_locally(plan, torch.zeros(5))


def test_reprs_are_short():
    mesh = MeshPlacement((2, 2), (4, 5, 6, 7))
    assert repr(mesh) == "Mesh(2x2:4,5,6,7)"
    assert repr(Transfer(0, 4, Box((0, 2), (3, 5)))) == "0->4[0:3,2:5]"
    plan = plan_transfer((4, 4), spec("S(0)"), MeshPlacement.contiguous((2,)), spec("RS(1)"), mesh,
                         allow_dst_gather=True)
    assert repr(plan).startswith("TransferPlan(S(0)@Mesh(2:0,1) -> RS(1)@Mesh(2x2:4,5,6,7)")
    assert "gather{4,6}" in plan.table()
