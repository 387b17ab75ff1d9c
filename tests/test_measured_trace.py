"""``parallelize(..., trace=True)``: what every worker did in a step, when (``runtime/timeline.py``).

A zoo MLP forced into 2 stages x 4 microbatches (1F1B) on a local 1x2 cluster, two steps,
against eager training of the same model: recording changes nothing it computes, and the
trace of the last step holds, per device, each microbatch's forward and backward once,
one update, and the cross-stage transfers, in an order the pipeline allows.
"""

from __future__ import annotations

import copy

import pytest
import torch

from alpa_torch import Cluster, parallelize, viz
from alpa_torch.zoo import ZOO, make_optimizer, train_step

pytestmark = pytest.mark.usefixtures("ray_session")
MICROBATCHES = 4


def _spans(trace: dict) -> dict[tuple[int, int], dict[str, tuple[float, float]]]:
    """(stage, device) -> event name -> (start, end) in microseconds; names are unique per device."""
    out: dict = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] in ("forward", "backward", "update"):
            row = out.setdefault((e["pid"], e["tid"]), {})
            assert e["name"] not in row, f"{e['name']} twice on {(e['pid'], e['tid'])}"
            row[e["name"]] = (e["ts"], e["ts"] + e["dur"])
    return out


def test_a_pipelined_step_records_each_phase_once_in_an_order_the_pipeline_allows():
    eager, batch = ZOO["mlp"]()
    model = copy.deepcopy(eager)
    eager_opt, opt = make_optimizer("adamw", eager), make_optimizer("adamw", model)
    step = parallelize(train_step, Cluster.local(1, 2), num_stages=2, num_microbatches=MICROBATCHES, trace=True,
                       plan_cache=False)
    try:
        for _ in range(2):
            expected = train_step(eager, eager_opt, batch)
            assert torch.allclose(step(model, opt, batch), expected.detach(), atol=1e-6)
        trace = step.measured_trace()
        predicted = viz.predicted_trace(step.plan)
    finally:
        step.shutdown()

    spans = _spans(trace)
    assert sorted(spans) == [(0, 0), (1, 1)]  # one device per stage
    names = {f"{k}{mb}" for k in "FB" for mb in range(MICROBATCHES)} | {"U"}
    assert all(set(row) == names for row in spans.values())
    first, second = spans[(0, 0)], spans[(1, 1)]
    for mb in range(MICROBATCHES):
        f, b = f"F{mb}", f"B{mb}"
        assert first[f][1] <= second[f][0], f"stage 1 ran {f} before stage 0 had sent it"
        assert second[b][1] <= first[b][0], f"stage 0 ran {b} before stage 1 had sent its gradient"
        assert all(row[f][1] <= row[b][0] for row in spans.values())
    assert all(row["U"][0] >= max(row[f"B{mb}"][1] for mb in range(MICROBATCHES)) for row in spans.values())
    transfers = {(e["pid"], e["name"], e["args"]["phase"]) for e in trace["traceEvents"]
                 if e["ph"] == "X" and e["cat"] == "transfer" and "phase" in e["args"]}
    assert {(0, "send", "forward"), (1, "recv", "forward"), (1, "send", "backward"),
            (0, "recv", "backward")} <= transfers
    # the same rows and names as the cost model's trace: the two line up (viz.compare_traces)
    assert set(_spans(predicted)) == set(spans) and all(set(r) == names for r in _spans(predicted).values())
    assert 0 < trace["otherData"]["makespan_s"] < 60


def test_measured_trace_needs_trace_true():
    step = parallelize(train_step, Cluster.local(1, 2))
    with pytest.raises(RuntimeError, match="trace=True"):
        step.measured_trace()
    with pytest.raises(TypeError, match="trace="):
        parallelize(train_step, Cluster.local(1, 2), trace="yes")


def test_a_data_parallel_step_records_its_bucket_reductions_on_a_row_of_their_own():
    """A one-stage step is one 'step' event per device; its gradient buckets' all-reduces are
    recorded apart ('reduction', from the start of each to its end as the step saw it), on a row
    under the device's, inside the step: where they overlap the backward shows."""
    model, batch = ZOO["gpt"]()
    opt = make_optimizer("adamw", model)
    step = parallelize(train_step, Cluster.local(1, 2), tune=False, sharding=False, pipeline=False, trace=True,
                       plan_cache=False)
    try:
        for _ in range(2):
            step(model, opt, batch)
        trace = step.measured_trace()
    finally:
        step.shutdown()
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        (whole,) = [e for e in events if e["cat"] == "step" and e["tid"] == rank]
        reductions = [e for e in events if e["cat"] == "reduction" and names[(e["pid"], e["tid"])] ==
                      f"device {rank} reductions"]
        assert reductions and all(e["args"]["bytes"] > 0 for e in reductions)
        assert all(whole["ts"] <= e["ts"] <= e["ts"] + e["dur"] <= whole["ts"] + whole["dur"] + 1 for e in reductions)
