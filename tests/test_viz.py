"""Pictures of plans (``alpa_torch.viz``): the predicted timeline, traces and PNGs.

The plan is a real one (the zoo MLP forced into 2 stages x 4 microbatches on a
local 1x2 cluster; planning only, no Ray). Each PNG must be a non-empty image:
the PNG signature and more than 1 KB.
"""

from __future__ import annotations

import json

import pytest

from alpa_torch import viz

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1024, f"{path}: {len(data)} bytes"


@pytest.fixture(scope="module")
def plan():
    from alpa_torch.capture import capture
    from alpa_torch.core.cluster import Cluster
    from alpa_torch.core.options import PlanOptions
    from alpa_torch.zoo import ZOO, make_optimizer, train_step
    from stage_dp.planner import make_plan_with_model

    model, batch = ZOO["mlp"]()
    graph = capture(train_step, model, make_optimizer("adamw", model), batch)
    return make_plan_with_model(graph, Cluster.local(1, 2), PlanOptions(num_stages=2, num_microbatches=4))[0]


def test_stage_times_split_each_stage_time(plan):
    times = viz.stage_times(plan)
    b = plan.num_microbatches
    for k, s in enumerate(plan.stages):
        fb = times["fwd_s"][k] + times["bwd_s"][k]
        assert fb + s.cross_stage_s + s.update_s / b == pytest.approx(s.time_s, rel=1e-9)
        assert times["bwd_s"][k] == pytest.approx(2 * times["fwd_s"][k])
    assert times["comm_s"] == pytest.approx(plan.stages[1].cross_stage_s / 2)


def test_predicted_timeline_has_every_microbatch_and_bubbles(plan):
    from alpa_torch.core.schedule import BACKWARD, FORWARD

    timeline = viz.predicted_timeline(plan)
    b = plan.num_microbatches
    for events in timeline.events:
        assert sum(e.instruction.kind == FORWARD for e in events) == b
        assert sum(e.instruction.kind == BACKWARD for e in events) == b
    assert 0 < timeline.idle_fraction < 1  # two stages: fill and drain leave bubbles
    times = viz.stage_times(plan)
    busiest = max(b * (f + w) + u for f, w, u in zip(times["fwd_s"], times["bwd_s"], times["update_s"]))
    assert timeline.makespan_s >= busiest * (1 - 1e-9)


def test_plan_png(plan, tmp_path):
    fig = viz.plan_figure(plan, tmp_path / "plan.png")
    check_png(tmp_path / "plan.png")
    assert len(fig.axes) >= 2  # the grid and the timeline


def test_trace_round_trip_and_png(plan, tmp_path):
    trace = viz.trace_from_timeline(viz.predicted_timeline(plan), plan)
    viz.write_trace(trace, tmp_path / "t.json")
    loaded = viz.load_trace(tmp_path / "t.json")
    spans = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    b, devices = plan.num_microbatches, sum(s.num_devices for s in plan.stages)
    assert len(spans) == devices * (2 * b + 1)
    assert all(e["dur"] >= 0 and {"pid", "tid", "ts", "name", "cat"} <= set(e) for e in spans)
    names = {e["args"]["name"] for e in loaded["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"stage {s.index} (devices {s.device_ids[0]})" for s in plan.stages}
    viz.timeline_from_trace(tmp_path / "t.json", tmp_path / "t.png")
    check_png(tmp_path / "t.png")


def test_foreign_trace_and_side_by_side(plan, tmp_path):
    """A measured trace as another tool writes it: a bare event list, string pids, no metadata."""
    measured = [{"ph": "X", "name": f"{kind}{mb}", "pid": f"worker-{w}", "tid": 0,
                 "ts": 1000 * (mb + (3 if kind == "B" else 0) + w), "dur": 900 if kind == "F" else 1800}
                for w in range(2) for mb in range(4) for kind in "FB"]
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    viz.timeline_from_trace(tmp_path / "measured.json", tmp_path / "measured.png", title="measured")
    check_png(tmp_path / "measured.png")
    predicted = viz.predicted_trace(plan)
    fig = viz.compare_traces(predicted, tmp_path / "measured.json", tmp_path / "both.png")
    check_png(tmp_path / "both.png")
    assert len(fig.axes) == 2


def test_load_trace_rejects_other_json(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"events": []}))
    with pytest.raises(ValueError, match="traceEvents"):
        viz.load_trace(tmp_path / "x.json")
