"""Measured cost corrections (``alpa_torch.calibration``, ``Cluster.cost_correction``): how the
planner applies them, how recorded steps give them, and how the plan cache keeps them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from alpa_torch import Cluster, calibration
from alpa_torch.capture import capture
from alpa_torch.core.errors import ClusterSpecError
from alpa_torch.core.options import PlanOptions
from alpa_torch.explain import explain
from alpa_torch.plan_cache import PlanCache, cache_key
from alpa_torch.zoo import ZOO, make_optimizer, train_step
from stage_dp.planner import make_plan


@pytest.fixture(scope="module")
def graph():
    model, batch = ZOO["gpt"]()
    return capture(train_step, model, make_optimizer("adamw", model), batch)


def _corrected(cluster: Cluster, **tables) -> Cluster:
    return dataclasses.replace(cluster, cost_correction=tables)


def test_a_correction_is_its_submeshs_else_the_nearest_measured_else_one():
    c = _corrected(Cluster.local(2, 2), compute={"1x1": 0.5, "2x2": 2.0}, transfer={"1x2": 3.0})
    assert c.correction("compute", (1, 1)) == 0.5 and c.correction("compute", (2, 2)) == 2.0
    assert c.correction("compute", (1, 2)) == 2.0  # halfway on a log scale: the larger
    assert c.correction("transfer", (2, 2)) == 3.0 and c.correction("update", (1, 1)) == 1.0
    assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize("bad, match", [({"speed": {"1x1": 2.0}}, "keys must be one of"),
                                        ({"compute": {"one": 2.0}}, "name a submesh"),
                                        ({"compute": {"1x1": 0.0}}, "finite number > 0"),
                                        ({"compute": [2.0]}, "keys must be one of")])
def test_bad_corrections_are_refused_with_the_fix(bad, match):
    with pytest.raises(ClusterSpecError, match=match):
        _corrected(Cluster.local(1, 2), **bad)


def test_the_stage_dp_scales_each_kind_of_cost_by_its_correction(graph):
    cluster = Cluster.local(1, 2)
    plain = make_plan(graph, cluster, PlanOptions(pipeline=False, num_microbatches=2))
    corrected = make_plan(graph, _corrected(cluster, compute={"1x2": 2.0}, update={"1x2": 3.0}),
                          PlanOptions(pipeline=False, num_microbatches=2))
    assert [s.sharding.value_specs for s in corrected.stages] == [s.sharding.value_specs for s in plain.stages]
    (a,), (b,) = calibration.stage_figures(plain), calibration.stage_figures(corrected)
    assert b["compute"] == pytest.approx(2.0 * a["compute"]) and b["update"] == pytest.approx(3.0 * a["update"])
    assert corrected.predicted_step_s == pytest.approx(b["compute"] + b["update"])
    assert corrected.cluster["cost_correction"] == {"compute": {"1x2": 2.0}, "update": {"1x2": 3.0}}
    assert "measured cost corrections" in explain(corrected) and "measured cost" not in explain(plain)
    # a uniform correction scales a whole pipeline: the same stages, every time doubled
    piped = make_plan(graph, cluster, PlanOptions(num_stages=2, num_microbatches=2))
    doubled = make_plan(graph, _corrected(cluster, **{k: {"1x1": 2.0} for k in ("compute", "update", "transfer")}),
                        PlanOptions(num_stages=2, num_microbatches=2))
    assert [s.layer_end for s in doubled.stages] == [s.layer_end for s in piped.stages]
    assert doubled.predicted_step_s == pytest.approx(2.0 * piped.predicted_step_s)


def _events(plan, scale: dict[str, float]) -> list:
    """A recorded step whose every kind of cost took ``scale[kind]`` x the plan's figure, on each device."""
    out, rank = [], 0
    for k, (stage, figs) in enumerate(zip(plan.stages, calibration.stage_figures(plan))):
        for _ in stage.device_ids:
            t, evs = 0, []
            for cat, kind in (("forward", "compute"), ("update", "update"), ("transfer", "transfer")):
                dur = int(round(scale[kind] * figs[kind] * 1e9))
                if dur:
                    evs.append(("x", cat, t, t + dur, {}))
                t += dur
            out.append((k, rank, evs))
            rank += 1
    return out


def test_observing_fitting_and_applying_converge(graph):
    """Corrections fitted from a recorded step make the re-priced plan's figures the measured
    ones; measured again, the same step gives the same corrections (raw ratios divide out the
    corrections a plan was priced with)."""
    cluster = Cluster.local(1, 2)
    plan = make_plan(graph, cluster, PlanOptions(num_stages=2, num_microbatches=2))
    scale = {"compute": 0.75, "update": 1.5, "transfer": 4.0}
    events = _events(plan, scale)
    observed = calibration.observe(plan, events)
    assert {(o["stage"], o["kind"]) for o in observed} == {(k, kind) for k in (0, 1) for kind in scale}
    assert all(o["submesh"] == "1x1" for o in observed)
    fitted = calibration.fit(observed)
    assert fitted["compute"]["1x1"] == pytest.approx(0.75, rel=1e-3)
    assert fitted["update"]["1x1"] == pytest.approx(1.5, rel=1e-3)
    assert "transfer" not in fitted  # a receive's time includes waiting for the other stage
    fitted["transfer"] = {"1x1": 4.0}  # given by hand, it applies

    again = make_plan(graph, calibration.calibrated(cluster, fitted), PlanOptions(num_stages=2, num_microbatches=2))
    assert [(s.layer_start, s.layer_end) for s in again.stages] == [(s.layer_start, s.layer_end) for s in plan.stages]
    observed_again = calibration.observe(again, events)  # the same measured step against the new figures
    assert all(o["ratio"] == pytest.approx(1.0, rel=2e-3) for o in observed_again if o["ratio"] is not None)
    refitted = calibration.fit(observed_again)
    assert all(refitted[k]["1x1"] == pytest.approx(fitted[k]["1x1"], rel=2e-3) for k in ("compute", "update"))


def test_a_one_stage_step_counts_for_compute_and_update(graph):
    cluster = Cluster.local(1, 2)
    plan = make_plan(graph, cluster, PlanOptions(pipeline=False, num_microbatches=1))
    step_ns = int(plan.predicted_step_s * 1.2e9)
    events = [(0, r, [("step", "step", 0, step_ns, {})]) for r in range(2)]
    (ob,) = calibration.observe(plan, events)
    assert ob["kind"] == "step" and ob["ratio"] == pytest.approx(1.2, rel=1e-3)
    fitted = calibration.fit([ob])
    assert fitted == {"compute": {"1x2": ob["raw_ratio"]}, "update": {"1x2": ob["raw_ratio"]}}


def test_the_plan_cache_keeps_a_steps_corrections_on_a_cluster(graph, tmp_path, caplog):
    """Kept per step and cluster: another cluster, or another step on the same cluster (a small
    step's ratios are mostly per-operator cost and would misprice a large one), finds none."""
    cache, cluster = PlanCache(tmp_path), Cluster.local(1, 2)
    assert calibration.load(cache, cluster, graph) is cluster and calibration.load(None, cluster, graph) is cluster
    calibration.store(cache, cluster, graph, {"compute": {"1x1": 0.7}})
    calibration.store(cache, cluster, graph, {"compute": {"1x2": 1.1}, "update": {"1x2": 0.6}})  # added, not replacing
    loaded = calibration.load(cache, cluster, graph)
    assert loaded.cost_correction == {"compute": {"1x1": 0.7, "1x2": 1.1}, "update": {"1x2": 0.6}}
    assert calibration.load(cache, Cluster.local(2, 1), graph).cost_correction == {}  # another cluster: none
    model, batch = ZOO["mlp"]()
    other = capture(train_step, model, make_optimizer("adamw", model), batch)
    assert calibration.load(cache, cluster, other).cost_correction == {}  # another step: none
    own = _corrected(cluster, compute={"1x2": 9.0})
    assert calibration.load(cache, own, graph) is own  # the user's own corrections win
    path = cache.path(cache_key(calibration.cache_fields(cluster, graph)))
    path.write_text(json.dumps({"format": "alpa-torch-cache-data", "fields": calibration.cache_fields(cluster, graph),
                                "data": {"compute": {"1x1": -1}}}))
    assert calibration.load(cache, cluster, graph) is cluster and "ignoring the stored calibration" in caplog.text
