"""Measured plan selection (``alpa_torch.tune``): the candidates, the rules, and a tuned step equal to eager."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from alpa_torch import Cluster, calibration, parallelize
from alpa_torch import tune as tuner
from alpa_torch.core.errors import PlanError
from alpa_torch.core.options import PlanOptions
from alpa_torch.plan_cache import PlanCache
from alpa_torch.zoo import ZOO, make_batch, make_optimizer, train_step


def test_variants_stay_within_the_users_options():
    labels = lambda o: [label for label, _ in tuner.variants(o)]  # noqa: E731
    assert labels(PlanOptions()) == ["one stage", "data parallel"]
    assert labels(PlanOptions(pipeline=False)) == ["data parallel"]
    assert labels(PlanOptions(sharding=False)) == ["one stage"]
    assert labels(PlanOptions(num_stages=2)) == labels(PlanOptions(submesh=(1, 1))) == []
    for _, opts in tuner.variants(PlanOptions(num_microbatches=2)):
        assert opts.num_microbatches == 2 and not opts.pipeline


def test_tune_option_and_environment(monkeypatch):
    monkeypatch.delenv(tuner.ENV_VAR, raising=False)
    assert tuner.enabled(None) and not tuner.enabled(False)
    monkeypatch.setenv(tuner.ENV_VAR, "0")
    assert not tuner.enabled(None) and tuner.enabled(True)
    with pytest.raises(PlanError, match="tune='yes'"):
        tuner.enabled("yes")


def _plans():
    """A searched plan and two others of the same graph, planned with no cluster work."""
    from alpa_torch.capture import capture
    from stage_dp.planner import make_plan

    model, batch = ZOO["gpt"]()
    graph = capture(train_step, model, make_optimizer("adamw", model), batch)
    cluster = Cluster.local(1, 2)
    return graph, cluster, make_plan(graph, cluster)


def test_rules_measure_close_predictions_and_keep_the_fastest_measured():
    graph, cluster, plan = _plans()
    slow = dataclasses.replace(plan, predicted_step_s=plan.predicted_step_s * (tuner.MARGIN + 0.5))
    close = dataclasses.replace(plan, predicted_step_s=plan.predicted_step_s * 1.5)
    cands = [tuner.Candidate("search", plan), tuner.Candidate("one stage", close),
             tuner.Candidate("data parallel", slow)]
    trials = tuner.to_measure(cands)
    assert [c.label for c in trials] == ["search", "one stage"] and "not measured" in cands[2].note
    cands[0].measured_s, cands[1].measured_s = 0.2, 0.1  # the prediction was wrong: the measurement decides
    kept = tuner.keep(cands)
    assert kept is cands[1] and "100.0 ms" in kept.note and "search" in kept.note
    text = tuner.report([c.to_dict(c is kept) for c in cands])
    assert "one stage (kept)" in text and "not measured" in text and "search (kept)" not in text


def test_candidates_planned_with_measured_corrections_are_measured_within_a_narrower_margin():
    graph, cluster, plan = _plans()
    calibrated = dataclasses.replace(plan, cluster={**plan.cluster, "cost_correction": {"compute": {"1x2": 1.1}}})
    close = dataclasses.replace(calibrated, predicted_step_s=calibrated.predicted_step_s * 1.5)
    assert tuner.margin([tuner.Candidate("search", plan)]) == tuner.MARGIN
    cands = [tuner.Candidate("search", calibrated), tuner.Candidate("one stage", close)]
    assert tuner.margin(cands) == tuner.CALIBRATED_MARGIN < 1.5
    assert tuner.to_measure(cands) == [cands[0]] and "1.5x" in cands[1].note


def test_select_measures_each_close_candidate_and_leaves_the_kept_one_deployed(monkeypatch):
    graph, cluster, plan = _plans()
    plans = [plan, dataclasses.replace(plan, predicted_step_s=plan.predicted_step_s * 1.2),
             dataclasses.replace(plan, predicted_step_s=plan.predicted_step_s * (tuner.MARGIN + 1))]
    cands = [tuner.Candidate(label, p) for label, p in zip(("search", "one stage", "data parallel"), plans)]
    deployed, speed = [plans[0]], {id(plans[0]): 2.0, id(plans[1]): 1.0}
    clock = iter(range(1000))
    monkeypatch.setattr(tuner.time, "perf_counter", lambda: next(clock) * speed[id(deployed[-1])])
    held = {id(plans[0]): 1.0e6, id(plans[1]): 2.0e6}
    fresh, again = [], []
    kept = tuner.select(cands, lambda p, new, compiled, same: (deployed.append(p), fresh.append(new),
                                                               again.append(same)), lambda: None,
                        lambda p: [{"plan": p}], lambda: [(held[id(deployed[-1])], 0.0)])
    assert kept is cands[1] and cands[2].measured_s is None
    assert cands[0].measured_s == 2.0 and cands[1].measured_s == 1.0
    assert [c.measured_bytes for c in cands] == [1.0e6, 2.0e6, None]
    assert [c.observations for c in cands] == [[{"plan": plans[0]}], [{"plan": plans[1]}], []]
    assert deployed == [plans[0], plans[1], plans[1]]  # measured, then loaded again with the initial state
    assert fresh == [False, False]  # it fits: the workers stay
    assert again == [False, True]  # the kept plan is the one deployed: only its state is loaded again


def test_the_kept_plan_is_measured_compiled_too_and_the_faster_kept(monkeypatch):
    """``try_compiled`` (``compile`` left to measurement): even a plan measured alone is run once
    more compiled, as a candidate of its own without calibration records (the cost model prices
    replayed kernels); the faster is kept and deployed as it ran."""
    graph, cluster, plan = _plans()
    slow = dataclasses.replace(plan, predicted_step_s=plan.predicted_step_s * (tuner.MARGIN + 1))

    def select(compiled_speed: float):
        cands = [tuner.Candidate("search", plan), tuner.Candidate("data parallel", slow)]
        deployed = [(plan, False)]
        clock = iter(range(1000))
        monkeypatch.setattr(tuner.time, "perf_counter",
                            lambda: next(clock) * (compiled_speed if deployed[-1][1] else 2.0))
        again = []
        kept = tuner.select(cands, lambda p, fresh, compiled, same: (deployed.append((p, compiled)),
                                                                     again.append(same)), lambda: None,
                            lambda p: [{"plan": p}], lambda: [(1.0e6, 0.0)], try_compiled=True)
        return cands, kept, deployed, again

    for compiled_speed, want_compiled in ((1.0, True), (3.0, False)):
        cands, kept, deployed, again = select(compiled_speed)
        twin = cands[-1]
        assert [c.label for c in cands] == ["search", "data parallel", "search, compiled"]
        assert twin.compiled and twin.plan is plan and twin.observations == [] and cands[1].measured_s is None
        assert (kept is twin) == want_compiled and kept.compiled == want_compiled
        assert deployed == [(plan, False), (plan, True), (plan, want_compiled)]
        assert again == [False, want_compiled]  # the compiled twin, kept, is the one deployed
        tuning = [c.to_dict(c is kept) for c in cands]
        assert tuner.kept_compiled(tuning) == want_compiled and "search, compiled" in tuner.report(tuning)


def test_the_next_fastest_replayed_plan_is_measured_compiled_too(monkeypatch):
    """Compiling shrinks the kernels, not the communication: a plan slower replayed may be faster
    compiled. The replayed plan within ``COMPILE_MARGIN`` of the fastest is measured compiled as
    well (``COMPILED_TRIALS`` in all), one further off is not, and the fastest compiled is kept."""
    graph, cluster, plan = _plans()
    plans = [dataclasses.replace(plan, predicted_step_s=plan.predicted_step_s * f) for f in (1.0, 1.01, 1.02)]
    cands = [tuner.Candidate(label, p) for label, p in zip(("search", "data parallel", "2 stages"), plans)]
    replayed = {id(plans[0]): 0.100, id(plans[1]): 0.110, id(plans[2]): 0.100 * tuner.COMPILE_MARGIN + 0.01}
    compiled_s = {id(plans[0]): 0.095, id(plans[1]): 0.080, id(plans[2]): 0.010}
    now, length, deployed = [0.0], [replayed[id(plans[0])]], []

    def use(p, fresh, compiled, again):
        deployed.append((p, compiled))
        length[0] = (compiled_s if compiled else replayed)[id(p)]

    def step():
        now[0] += length[0]

    monkeypatch.setattr(tuner.time, "perf_counter", lambda: now[0])
    kept = tuner.select(cands, use, step, lambda p: [], lambda: [(0.0, 0.0)], try_compiled=True)
    assert [c.label for c in cands] == ["search", "data parallel", "2 stages", "search, compiled",
                                        "data parallel, compiled"]
    assert kept is cands[4] and kept.compiled and kept.plan is plans[1]
    assert "not measured compiled" in cands[2].note and cands[0].note == ""
    assert deployed[-1] == (plans[1], True)


def test_a_trial_is_timed_on_the_steps_after_the_replays_code_generation(monkeypatch):
    """On a stage of several devices the first three steps after a deployment are slow (DTensor,
    the replay's recording, its code generation): a trial measures the steps after them."""
    graph, cluster, plan = _plans()
    plans = [plan, dataclasses.replace(plan, predicted_step_s=plan.predicted_step_s * 1.1)]
    cands = [tuner.Candidate("search", plans[0]), tuner.Candidate("one stage", plans[1])]
    steady = {id(plans[0]): 0.3, id(plans[1]): 0.2}
    now, durations = [0.0], []

    def deploy(p):
        durations[:] = [30.0, 8.0, 0.6] + [steady[id(p)]] * 10

    def step():
        now[0] += durations.pop(0)

    deploy(plans[0])
    monkeypatch.setattr(tuner.time, "perf_counter", lambda: now[0])
    kept = tuner.select(cands, lambda p, fresh, compiled, again: deploy(p), step, lambda p: [], lambda: [(0.0, 0.0)])
    assert [c.measured_s for c in cands] == pytest.approx([0.3, 0.2]) and kept is cands[1]


def test_a_short_step_is_timed_more_often_than_a_long_one(monkeypatch):
    """Timed trial steps go on until they took ``TIMED_S``: a long step is timed ``TIMED_STEPS``'
    fewest times, a short one up to their most, enough to tell a few per cent apart."""
    graph, cluster, plan = _plans()
    now, calls, length = [0.0], [], [0.0]

    def step():
        now[0] += length[0]
        calls.append(length[0])

    monkeypatch.setattr(tuner.time, "perf_counter", lambda: now[0])
    for step_s, want in ((1.5, tuner.TIMED_STEPS[0]), (0.03, tuner.TIMED_STEPS[1]), (0.25, 4)):
        length[0], calls[:] = step_s, []
        cand = tuner.Candidate("search", plan)  # measured replayed, then compiled
        tuner.select([cand], lambda p, fresh, compiled, again: None, step, lambda p: [], lambda: [(0.0, 0.0)],
                     try_compiled=True)
        assert len(calls) == 2 * (tuner.SKIP + want) and cand.measured_s == pytest.approx(step_s)


def test_a_candidate_measured_over_the_device_memory_is_not_kept_however_fast(caplog):
    """The simulation lets a plan in; the measurement of its devices' memory can still rule it out."""
    graph, cluster, plan = _plans()
    budget = plan.memory_budget_bytes
    cands = [tuner.Candidate("search", plan), tuner.Candidate("one stage", plan),
             tuner.Candidate("data parallel", plan)]
    for c, s, held in zip(cands, (0.3, 0.1, 0.2), (0.5 * budget, 1.5 * budget, 0.9 * budget)):
        c.measured_s, c.measured_bytes = s, held
    kept = tuner.keep(cands)
    assert kept is cands[2] and "fastest measured that fits: 200.0 ms" in kept.note and "one stage" in kept.note
    assert "over the" in cands[1].note and "not kept" in cands[1].note
    text = tuner.report([c.to_dict(c is kept) for c in cands])
    assert "measured MiB" in text and f"{1.5 * budget / 2**20:.0f}" in text
    for c in cands:  # none fits: the least memory is kept, and the user is told
        c.measured_bytes = 2 * budget
    cands[0].measured_bytes = 1.2 * budget
    with caplog.at_level("WARNING", logger="alpa_torch.tune"):
        assert tuner.keep(cands) is cands[0]
    assert "no measured plan fits the device memory" in caplog.text and "checkpointing" in caplog.text
    assert "the least memory" in cands[0].note and "new workers" in cands[0].note


def test_a_kept_plan_that_did_not_fit_the_trial_workers_runs_on_new_ones():
    graph, cluster, plan = _plans()
    smaller = dataclasses.replace(plan, peak_memory_bytes=plan.peak_memory_bytes / 2)  # so it is measured
    cands = [tuner.Candidate("search", plan), tuner.Candidate("one stage", smaller)]
    uses = []
    kept = tuner.select(cands, lambda p, fresh, compiled, again: uses.append(fresh), lambda: None, lambda p: [],
                        lambda: [(2 * plan.memory_budget_bytes, 0.0)])
    assert not kept.fits() and uses == [False, True]  # the second trial, then the kept plan on new workers


def test_a_trial_over_the_device_only_with_what_earlier_trials_left_is_kept_on_new_workers():
    """Its own part fits: it may fit on new workers, where it then runs (the first trial, on
    unused workers, has no part left by others)."""
    graph, cluster, plan = _plans()
    budget = plan.memory_budget_bytes
    smaller = dataclasses.replace(plan, peak_memory_bytes=plan.peak_memory_bytes / 2)
    cands = [tuner.Candidate("search", plan), tuner.Candidate("one stage", smaller)]
    held = iter([[(1.5 * budget, 0.0)], [(1.2 * budget, 0.6 * budget)]])  # the search's, then the second's
    clock = iter(range(1000))
    uses = []
    kept = tuner.select(cands, lambda p, fresh, compiled, again: uses.append(fresh), lambda: next(clock) and None,
                        lambda p: [], lambda: next(held))
    assert kept is cands[1] and uses == [False, True] and not kept.fits() and kept.may_fit()
    assert "on new workers" in kept.note and "left by earlier trials" in kept.note
    assert not cands[0].may_fit() and "not kept" in cands[0].note
    text = tuner.report([c.to_dict(c is kept) for c in cands])
    assert f"(own {0.6 * budget / 2**20:.0f})" in text

def test_a_candidate_that_cannot_fit_where_the_first_one_did_not_is_not_measured():
    """Same meshes, at least the first candidate's simulated memory, and the first (measured on
    unused workers) measured over the device: the trial is skipped; on other meshes it is not."""
    graph, cluster, plan = _plans()
    bigger = dataclasses.replace(plan, peak_memory_bytes=plan.peak_memory_bytes * 2)
    cands = [tuner.Candidate("search", plan), tuner.Candidate("data parallel", bigger)]
    uses = []
    kept = tuner.select(cands, lambda p, fresh, compiled, again: uses.append(fresh), lambda: None, lambda p: [],
                        lambda: [(2 * plan.memory_budget_bytes, 0.0)])
    assert kept is cands[0] and uses == [True] and cands[1].measured_s is None
    assert "cannot fit, not measured" in cands[1].note
    moved = {d: (d + 1) % cluster.num_devices for d in range(cluster.num_devices)}  # every device id moves
    elsewhere = dataclasses.replace(bigger, stages=tuple(
        dataclasses.replace(st, device_ids=tuple(moved[d] for d in st.device_ids)) for st in bigger.stages))
    cands = [tuner.Candidate("search", plan), tuner.Candidate("data parallel", elsewhere)]
    tuner.select(cands, lambda p, fresh, compiled, again: None, lambda: None, lambda p: [],
                 lambda: [(2 * plan.memory_budget_bytes, 0.0)])
    assert cands[1].measured_s is not None


def test_candidates_differ_and_come_from_the_options(tmp_path):
    graph, cluster, plan = _plans()
    cands = tuner.candidates(plan, graph, cluster, PlanOptions(), cache=None)
    assert cands[0].plan is plan and len({c.label for c in cands}) == len(cands)
    assert len({tuner._decisions(c.plan) for c in cands}) == len(cands)
    one_stage = [c for c in cands if c.label in ("one stage", "data parallel")]
    assert one_stage and all(len(c.plan.stages) == 1 for c in one_stage)


def test_a_searched_one_stage_plan_is_tried_against_the_pipeline_of_one_stage_per_device():
    """The issue's 'best pipeline' among the candidates whatever the search chose; not where the
    user fixed the stages or ruled pipelines out."""
    from stage_dp.planner import make_plan

    graph, cluster, _ = _plans()
    one = make_plan(graph, cluster, PlanOptions(pipeline=False))
    assert tuner.deepest_pipeline(one, cluster, PlanOptions()) == [("2 stages", PlanOptions(num_stages=2))]
    for opts in (PlanOptions(pipeline=False), PlanOptions(num_stages=1), PlanOptions(submesh=(1, 2))):
        assert tuner.deepest_pipeline(one, cluster, opts) == []
    cands = tuner.candidates(one, graph, cluster, PlanOptions(), cache=None)
    piped = [c for c in cands if c.label.startswith("2 stages")]
    assert piped and all(len(c.plan.stages) == 2 for c in piped)
    if piped[0].plan.num_microbatches > 2:  # and it at as few microbatches as stages
        assert [c.label for c in piped] == ["2 stages", "2 stages, 2 microbatches"]
        assert piped[1].plan.num_microbatches == 2


def test_a_searched_pipeline_is_also_tried_at_as_many_microbatches_as_stages():
    from stage_dp.planner import make_plan

    graph, cluster, _ = _plans()
    piped = make_plan(graph, cluster, PlanOptions(num_stages=2, num_microbatches=4))
    assert tuner.fewer_microbatches(piped, PlanOptions(num_microbatches=4)) == []  # the user's count stays
    cands = tuner.candidates(piped, graph, cluster, PlanOptions(), cache=None)
    assert cands[1].label == "2 stages, 2 microbatches"
    assert len(cands[1].plan.stages) == 2 and cands[1].plan.num_microbatches == 2
    assert tuner.fewer_microbatches(cands[1].plan, PlanOptions()) == []  # already as few


@pytest.mark.usefixtures("ray_session")
@pytest.mark.slow
def test_tuned_step_trains_as_eager_and_its_choice_is_cached(tmp_path):
    """The zoo GPT on 1x2 with tune=True: every candidate within the margin measured, the kept
    plan trains equal to eager from the initial state (the trial steps leave no trace); a second
    step on the same cache takes the measured choice with no measuring."""
    torch.manual_seed(0)
    model, _ = ZOO["gpt"]()
    eager = copy.deepcopy(model)
    opt, eager_opt = make_optimizer("adamw", model), make_optimizer("adamw", eager)
    messages = []
    step = parallelize(train_step, Cluster.local(1, 2), tune=True, plan_cache=str(tmp_path), progress=messages.append)
    try:
        for i in range(3):
            batch = make_batch("gpt", 8, seed=i)
            want = float(train_step(eager, eager_opt, batch).detach())
            assert float(step(model, opt, batch)) == pytest.approx(want, abs=1e-5), i
        state = step.state_dict()
        tuning, kept = step.tuning, step.plan
    finally:
        step.shutdown()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(state["model"][name], p.detach(), atol=1e-5, rtol=0, msg=name)
    assert len(tuning) >= 2 and sum(t["measured_s"] is not None for t in tuning) >= 2, tuning
    assert tuning[-1]["compiled"] and tuning[-1]["label"].endswith(", compiled"), tuning  # compile=None: measured
    assert step.compiled == tuner.kept_compiled(tuning)
    assert all(t["measured_bytes"] > 0 for t in tuning if t["measured_s"] is not None), tuning
    assert any("measured plan selection" in m for m in messages)
    assert step.plan_source.startswith("measured")
    stored = calibration.load(PlanCache(tmp_path), Cluster.local(1, 2), step.graph).cost_correction
    assert stored and set(stored) <= {"compute", "update", "transfer"}, stored
    assert any("measured cost corrections" in m for m in messages)

    again = parallelize(train_step, Cluster.local(1, 2), tune=True, plan_cache=str(tmp_path))
    model2, _ = ZOO["gpt"]()
    try:
        again(model2, make_optimizer("adamw", model2), make_batch("gpt", 8, seed=0))
        assert again.plan_source == "measured (cache)" and again.plan.summary() == kept.summary()
        assert again.tuning == tuning and again.compiled == tuner.kept_compiled(tuning)
    finally:
        again.shutdown()

    other = parallelize(train_step, Cluster.local(1, 2), tune=True, plan_cache=str(tmp_path), num_microbatches=2)
    model3, _ = ZOO["gpt"]()
    try:  # the step planned with other options on this cluster: at the measured rates
        other.make_plan(model3, make_optimizer("adamw", model3), make_batch("gpt", 8, seed=0))
        assert other.plan.cluster["cost_correction"] == stored
    finally:
        other.shutdown()


@pytest.mark.usefixtures("ray_session")
@pytest.mark.slow
def test_when_no_trial_fits_as_measured_the_kept_plan_trains_as_eager_on_new_workers(tmp_path, caplog):
    """64 MiB per device: the zoo GPT's plans fit as simulated (a few MiB), but a worker process
    grows by more than that (the runtime's own memory), so every trial measures over the
    device; the kept plan runs on new workers and trains equal to eager."""
    torch.manual_seed(0)
    model, _ = ZOO["gpt"]()
    eager = copy.deepcopy(model)
    opt, eager_opt = make_optimizer("adamw", model), make_optimizer("adamw", eager)
    cluster = Cluster.local(1, 2, memory_bytes=64 * 2**20)
    step = parallelize(train_step, cluster, tune=True, plan_cache=str(tmp_path))
    try:
        with caplog.at_level("WARNING", logger="alpa_torch.tune"):
            for i in range(2):
                batch = make_batch("gpt", 8, seed=i)
                want = float(train_step(eager, eager_opt, batch).detach())
                assert float(step(model, opt, batch)) == pytest.approx(want, abs=1e-5), i
        state = step.state_dict()
        tuning = step.tuning
    finally:
        step.shutdown()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(state["model"][name], p.detach(), atol=1e-5, rtol=0, msg=name)
    measured = [t for t in tuning if t["measured_s"] is not None]
    assert len(measured) >= 2 and all(t["measured_bytes"] > t["budget_bytes"] for t in measured), tuning
    assert all(t["predicted_bytes"] <= t["budget_bytes"] for t in tuning), tuning
    kept = next(t for t in tuning if t["kept"])
    assert "new workers" in kept["note"], tuning  # whether its own part fitted or none did (then a warning)
    assert ("none fits" in kept["note"]) == ("no measured plan fits the device memory" in caplog.text)


def _tensor_bytes_only_collecting_frees(state: dict) -> int:
    """Bytes of tensor storage on this worker that only Python's cyclic collector would free: the
    tensors among what it finds unreachable (``DEBUG_SAVEALL`` keeps them to be counted). Comparing
    the tensors alive before and after a collection instead would also count any a C++ thread lets
    go of meanwhile (gloo's, just after a gradient bucket's reduction completed)."""
    import gc

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        storages = {}
        for obj in gc.garbage:
            if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and obj.device.type != "meta":
                try:
                    st = obj.untyped_storage()
                    storages[st.data_ptr()] = st.nbytes()
                except RuntimeError:  # a wrapper subclass (DTensor): its local tensor is counted itself
                    continue
        return sum(storages.values())
    finally:
        gc.garbage.clear()
        gc.set_debug(0)


def _disable_automatic_collection(state: dict) -> None:
    import gc

    gc.disable()


@pytest.mark.usefixtures("ray_session")
def test_a_new_deployment_frees_the_previous_ones_tensors():
    """Measured plan selection deploys one plan after another on the same workers. The stage
    program a deployment replaces holds its state in reference cycles; with Python's automatic
    collection not run in between (as on the wide GPT's tuning, where each worker kept the
    discarded candidate's 91 MB of state for the whole run), the new deployment still frees it."""
    from alpa_torch.capture import capture
    from alpa_torch.optim import OptimizerSet
    from intra_ilp.cost_model import MeshCost
    from intra_ilp.stage import solve_stage
    from runtime.engine import Engine
    from runtime.group import WorkerGroup
    from tests.test_runtime import _force, _state

    model, _ = ZOO["gpt"]()
    opt = make_optimizer("adamw", model)
    graph = capture(train_step, model, opt, make_batch("gpt", 8, seed=0))
    cluster = Cluster.local(1, 2)
    sharding = solve_stage(graph, MeshCost.from_cluster(cluster, (1, 2), (1, 2)), force=_force(graph, "RS(0)"))
    functional = OptimizerSet((opt,), {id(p): n for n, p in model.named_parameters()})
    batch = {f"batch.{j}": t.numpy() for j, t in enumerate(make_batch("gpt", 8, seed=0))}
    with WorkerGroup.start(cluster) as group:
        group.call_all(_disable_automatic_collection)
        for _ in range(2):
            engine = Engine(group, graph, sharding)
            engine.load_state(_state(model, functional))
            engine.step(batch, functional.host_scalars())
        assert group.call_all(_tensor_bytes_only_collecting_frees) == [0, 0]
        held = engine.memory()  # what the tuner holds each candidate to (device_memory.py)
        assert len(held) == 2 and all(peak > left > 0 for peak, left in held), held
