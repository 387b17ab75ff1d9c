"""Where a plan reduces each gradient (``alpa_torch.core.grad_reductions.find_reductions``): the
rule the runtime buckets by and the cost model prices by, on hand-written records."""

from __future__ import annotations

from alpa_torch.core.grad_reductions import find_reductions
from alpa_torch.core.spec import ShardingSpec, to_dtensor_placements


def _specs(*specs):
    return [to_dtensor_placements(ShardingSpec.parse(s)) for s in specs]


def test_two_step_2d_reduction_is_one_bucketed_reduction():
    """A plan reducing a PP gradient in two steps (PP -> RP at a transpose, RP -> RR at the
    marker) becomes one reduction over both axes, the transposes running on the partial value."""
    from runtime.grad_buckets import deferred_wants

    records = [("placeholder", "x", "x", (), {}, ()),
               ("call_function", "mm", "aten.mm.default", (), {}, ("x", "x")),
               ("call_function", "t1", "aten.t.default", (), {}, ("mm",)),
               ("call_function", "t2", "aten.t.default", (), {}, ("t1",)),
               ("call_function", "grad", "alpa.grad.default", (), {}, ("t2",))]
    pp, rp, rr = _specs("PP", "RP", "RR")
    value_specs = {"x": rr, "mm": pp, "t1": rp, "t2": rp, "grad": rr}
    input_specs = {"mm": [rr, rr], "t1": [rp], "t2": [rp], "grad": [rr]}
    red = find_reductions(records, value_specs, input_specs, "alpa.grad.default")["grad"]
    assert red.axes == (0, 1) and red.deferred == ("t2", "t1") and red.target == rr
    assert deferred_wants({"grad": red}, input_specs) == {"t1": [pp], "t2": [pp]}
    # An all-gather on the way (S(1) -> R at the marker) is no reduction: it runs as planned.
    input_specs["t1"] = _specs("S(0)P")
    value_specs["t1"] = value_specs["t2"] = _specs("S(1)P")[0]
    input_specs["t2"] = [value_specs["t2"]]
    assert "grad" not in find_reductions(records, value_specs, input_specs, "alpa.grad.default")


def test_embedding_backward_runs_on_the_partial_gradient():
    """embedding_dense_backward is linear in its gradient input: with replicated indices it is
    deferred onto the partial sum; with sharded indices it runs as the plan says."""
    from runtime.grad_buckets import deferred_wants

    records = [("placeholder", "idx", "idx", (), {}, ()),
               ("placeholder", "g", "g", (), {}, ()),
               ("call_function", "edb", "aten.embedding_dense_backward.default", (), {}, ("g", "idx")),
               ("call_function", "grad", "alpa.grad.default", (), {}, ("edb",))]
    pp, rr, ss = _specs("PP", "RR", "S(0)S(0)")
    value_specs = {"idx": rr, "g": pp, "edb": rr, "grad": rr}
    input_specs = {"edb": [rr, rr], "grad": [rr]}
    red = find_reductions(records, value_specs, input_specs, "alpa.grad.default")["grad"]
    assert red.axes == (0, 1) and red.deferred == ("edb",)
    assert deferred_wants({"grad": red}, input_specs) == {"edb": [pp, rr]}
    input_specs["edb"] = [rr, ss]
    assert find_reductions(records, value_specs, input_specs, "alpa.grad.default") == {}


def test_gradient_kept_partial_through_its_marker_is_reduced_there_once():
    """A gradient the plan leaves partial at its marker, reduced at each of the update's readers
    (two blocking all-reduces), is reduced once at the marker in a bucket when every reader wants
    the same placements; readers that want different placements keep the plan's collectives."""
    records = [("placeholder", "g", "g", (), {}, ()),
               ("call_function", "grad", "alpa.grad.default", (), {}, ("g",)),
               ("call_function", "lerp", "aten.lerp.Tensor", (), {}, ("m", "grad")),
               ("call_function", "addcmul", "aten.addcmul.default", (), {}, ("v", "grad", "grad"))]
    pr, rr, sr = _specs("PR", "RR", "S(0)R")
    value_specs = {"g": pr, "grad": pr}
    input_specs = {"grad": [pr], "lerp": [rr, rr], "addcmul": [rr, rr, rr]}
    red = find_reductions(records, value_specs, input_specs, "alpa.grad.default")["grad"]
    assert red.axes == (0,) and red.target == (rr[0],) and red.deferred == ()
    input_specs["lerp"] = [sr, sr]
    assert find_reductions(records, value_specs, input_specs, "alpa.grad.default") == {}


def test_bucketed_order_moves_each_bucket_to_its_last_gradient():
    """Markers (all after the backward, as captured) move up, a bucket's together in the order the
    gradients are computed, to just after its last gradient; a bucket left open (another key) goes
    where the last bucketed gradient is computed; every other record keeps its place."""
    from runtime.grad_buckets import bucket_groups, bucketed_order

    def rec(name, *inputs):
        return ("call_function", name, "op", (), {}, inputs)

    records = [("placeholder", "x", "x", (), {}, ()), rec("g1", "x"), rec("h", "g1"), rec("g2", "h"),
               rec("g3", "h"), rec("m1", "g1"), rec("m2", "g2"), rec("m3", "g3"), rec("u", "m1", "m2", "m3")]
    seen = {"m1": ("k", 60), "m2": ("k", 60), "m3": ("other", 10)}  # m1 + m2 fill a 100-byte bucket
    order = [r[1] for r in bucketed_order(records, bucket_groups(records, seen, 100))]
    assert order == ["x", "g1", "h", "g2", "m1", "m2", "g3", "m3", "u"]
    # a marker placed before the last gradient of its bucket (not the capture's order) never moves down
    early = [records[0], records[1], records[5], *records[2:5], *records[6:]]  # m1 right after g1
    order = [r[1] for r in bucketed_order(early, bucket_groups(early, seen, 100))]
    assert order == ["x", "g1", "m1", "h", "g2", "g3", "m3", "m2", "u"]
