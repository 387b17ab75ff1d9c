"""Buffer donation (``runtime/donation.py``): which operators may run in place, that the
in-place twin gives the functional operator's bits, and that a donating runtime trains
bit for bit as one that does not."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from runtime.donation import INPLACE, Donation, donating, find_donations
from runtime.interpreter import GRAD_MARKER_NAME
from runtime.program import Ref, compile_program

aten = torch.ops.aten


def _args_for(op, x: torch.Tensor, gen: torch.Generator) -> list[tuple]:
    """Argument tuples (after ``x``) exercising ``op``: a same-shape tensor, a broadcast row, a
    0-dim float64 tensor (the host scalars of the optimizer) and Python numbers."""
    same, row = torch.randn(x.shape, generator=gen), torch.randn(x.shape[-1:], generator=gen)
    scalar = torch.tensor(0.37, dtype=torch.float64)
    name = op._schema.name.split("::")[1] + "." + op._overloadname
    if name in ("add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor"):
        return [(same,), (row,), (scalar,)]
    if name in ("add.Scalar", "sub.Scalar", "mul.Scalar", "div.Scalar"):
        return [(0.37,), (3,)]
    if name == "lerp.Scalar":
        return [(same, 0.1), (row, 0.9)]
    if name == "lerp.Tensor":
        return [(same, torch.rand(x.shape, generator=gen)), (row, scalar.float())]
    if name in ("addcmul.default", "addcdiv.default"):
        return [(same, row), (row, same.abs() + 1)]
    return [()]  # unary


@pytest.mark.parametrize("op", sorted(INPLACE, key=str), ids=str)
def test_inplace_twin_gives_the_functional_bits(op):
    gen = torch.Generator().manual_seed(0)
    for shape in [(7, 33), (4, 3, 16)]:
        x = torch.randn(shape, generator=gen).abs() + 0.5  # sqrt / rsqrt / reciprocal stay finite
        for rest in _args_for(op, x, gen):
            want = op(x, *rest)
            got = INPLACE[op](x.clone(), *rest)
            assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
            assert torch.equal(got, want), (op, shape, rest)


def _program(records, keep=()):
    return compile_program([(op, name, t, a, {}, tuple(i)) for op, name, t, a, i in records], GRAD_MARKER_NAME, keep)


def test_find_donations_follows_liveness_and_aliases():
    # p (state), s (host scalar) come from outside; x = p * s; v = t(x); y = x + 1; z = v * 2; out (y, z)
    records = [
        ("placeholder", "p", None, (), ()), ("placeholder", "s", None, (), ()),
        ("call_function", "x", aten.mul.Tensor, (Ref("p"), Ref("s")), ("p", "s")),
        ("call_function", "v", aten.t.default, (Ref("x"),), ("x",)),
        ("call_function", "y", aten.add.Tensor, (Ref("x"), 1), ("x",)),
        ("call_function", "z", aten.mul.Tensor, (Ref("v"), 2), ("v",)),
        ("call_function", "w", aten.mul.Tensor, (Ref("z"), Ref("z")), ("z",)),
        ("output", "output", None, ([Ref("y"), Ref("w")],), ("y", "w")),
    ]
    program = _program(records)
    # y may not overwrite x: its view v is read later; z may overwrite v (x dies with it);
    # w reads z twice; x's input p is state only where the caller says so.
    assert find_donations(program) == {"z": Donation(0, None)}
    assert find_donations(program, {"p"}) == {"x": Donation(0, "p"), "z": Donation(0, None)}
    # Kept past the program (a pipeline stage's activation, the step's outputs): never.
    assert find_donations(_program(records, keep={"v"}), {"p"}) == {"x": Donation(0, "p")}


def test_gradient_markers_and_constants_are_never_donated():
    records = [
        ("placeholder", "g0", None, (), ()),
        ("call_function", "g", aten.mul.Tensor, (Ref("g0"), 2.0), ("g0",)),
        ("call_function", "grad", GRAD_MARKER_NAME, (Ref("g"), 0), ("g",)),
        ("call_function", "u", aten.mul.Tensor, (Ref("grad"), 0.5), ("grad",)),
        ("get_attr", "c", "c", (torch.ones(3),), ()),
        ("call_function", "k", aten.add.Tensor, (Ref("c"), Ref("u")), ("c", "u")),
        ("output", "output", None, ([Ref("k")],), ("k",)),
    ]
    # g0 is not state; the marker's gradient goes to buckets; c is a graph constant.
    assert find_donations(_program(records), {"p"}) == {}


def test_donating_runs_in_place_only_where_it_gives_the_functional_result():
    owned: set[str] = set()
    mul, mul_ = aten.mul.Tensor, aten.mul_.Tensor
    call = donating(mul, mul_, None, owned)
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    first = call((x, y), {})  # functional, and the verdict
    assert first.data_ptr() != x.data_ptr() and torch.equal(first, x * y)
    x2 = torch.randn(4, 5)
    again = call((x2, y), {})
    assert again.data_ptr() == x2.data_ptr()  # in place from now on
    t = torch.randn(5, 4).t()  # not contiguous: functional
    assert call((t, y), {}).data_ptr() != t.data_ptr()
    # State memory: only while owned.
    state_call = donating(mul, mul_, "p", owned)
    state_call((torch.randn(4, 5), y), {})
    p = torch.randn(4, 5)
    assert state_call((p, y), {}).data_ptr() != p.data_ptr()
    owned.add("p")
    assert state_call((p, y), {}).data_ptr() == p.data_ptr()
    # A result that broadcasts past the input, or promotes its dtype: never in place.
    wide = donating(mul, mul_, None, owned)
    row = torch.randn(1, 5)
    wide((row, y), {})
    assert wide((row, y), {}).shape == (4, 5)
    ints = donating(mul, mul_, None, owned)
    n = torch.arange(6)
    ints((n, torch.tensor(0.5)), {})
    assert ints((n, torch.tensor(0.5)), {}).dtype == torch.float32 and n.tolist() == list(range(6))


def _run_steps(donate: bool, steps: int = 4):
    from alpa_torch.capture import capture
    from alpa_torch.core.cluster import Cluster
    from alpa_torch.optim import OptimizerSet
    from alpa_torch.zoo import ZOO, make_batch, make_optimizer, train_step
    from intra_ilp.cost_model import MeshCost
    from intra_ilp.stage import solve_stage
    from runtime.engine import Engine
    from runtime.group import WorkerGroup
    from tests.test_runtime import _force, _state

    model = copy.deepcopy(ZOO["gpt"]()[0])
    opt = make_optimizer("adamw", model)
    graph = capture(train_step, model, opt, make_batch("gpt", 8, seed=0))
    cluster = Cluster.local(1, 2)
    sharding = solve_stage(graph, MeshCost.from_cluster(cluster, (1, 2), (1, 2)), force=_force(graph, "RS(0)"))
    functional = OptimizerSet((opt,), {id(p): n for n, p in model.named_parameters()})
    with WorkerGroup.start(cluster) as group:
        engine = Engine(group, graph, sharding)
        engine.load_state(_state(model, functional))
        group.call_all(_set_donation, donate)
        losses, ptrs = [], []
        for i in range(steps):
            batch = make_batch("gpt", 8, seed=i)
            losses.append(engine.step({f"batch.{j}": t.numpy() for j, t in enumerate(batch)},
                                      functional.host_scalars()))
            ptrs.append(group.call_all(_state_pointers))
        return losses, engine.gather_state(), ptrs


def _set_donation(state, on: bool):
    state["runner"].donate_enabled = on
    return sum(st.donate is not None for st in state["runner"].program.steps)


def _state_pointers(state):
    return {name: t.data_ptr() for name, t in state["runner"]._state.items() if isinstance(t, torch.Tensor)}


@pytest.mark.usefixtures("ray_session")
@pytest.mark.sweep
def test_donating_runtime_trains_bit_for_bit_as_without():
    """A 1x2 data-parallel GPT, AdamW, 4 steps: the same losses and state, bit for bit, with
    and without donation; with it, the update runs in the memory of the old state."""
    losses, state, ptrs = _run_steps(donate=True)
    losses_off, state_off, _ = _run_steps(donate=False)
    assert losses == losses_off
    assert state.keys() == state_off.keys()
    for name in state:
        assert np.array_equal(state[name], state_off[name]), name
    # Step 1 runs through DTensor, step 2 replays and checks each donating operator once,
    # steps 3 and 4 run them in place: every parameter and moment keeps its memory.
    kept = [n for n in ptrs[3][0] if ptrs[3][0][n] == ptrs[2][0][n]]
    assert len(kept) >= 0.9 * len(ptrs[3][0]), (len(kept), len(ptrs[3][0]))
