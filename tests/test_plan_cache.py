"""Plans are deterministic and cached on disk; a stale or damaged entry is never used.

No workers: ``make_plan`` captures and plans only.
"""

from __future__ import annotations

import json
import time

import pytest

from alpa_torch import Cluster, parallelize
from alpa_torch.core.options import PlanOptions
from alpa_torch.core.plan import ParallelPlan
from alpa_torch.plan_cache import PlanCache, cache_key, default_root, key_fields, plan_decisions
from alpa_torch.zoo import ZOO, make_optimizer, train_step


def _inputs():
    model, batch = ZOO["mlp"]()
    return model, make_optimizer("adam", model), batch


def _make_plan(cache, cluster=None, **options):
    step = parallelize(train_step, cluster=cluster or Cluster.local(1, 2), plan_cache=cache, **options)
    t0 = time.perf_counter()
    plan = step.make_plan(*_inputs())
    return plan, step, time.perf_counter() - t0


def test_same_model_batch_and_cluster_give_the_same_plan():
    first, _, _ = _make_plan(False)
    second, _, _ = _make_plan(False)
    assert plan_decisions(first) == plan_decisions(second)


def test_second_make_plan_hits_the_cache(tmp_path):
    searched, step, _ = _make_plan(tmp_path)
    assert step.plan_source == "search" and len(list(tmp_path.glob("*.json"))) == 1
    cached, step, seconds = _make_plan(tmp_path)
    assert step.plan_source == "cache"
    assert cached.to_dict() == searched.to_dict()
    assert seconds < max(1.0, searched.options["plan_s"]), "a hit only captures and reads JSON"


def test_new_cost_model_cluster_or_options_miss(tmp_path, monkeypatch):
    import intra_ilp.cost_model

    _make_plan(tmp_path, Cluster.local(1, 1))
    _, step, _ = _make_plan(tmp_path, Cluster.local(1, 2))
    assert step.plan_source == "search", "another cluster misses"
    _, step, _ = _make_plan(tmp_path, Cluster.local(1, 2), schedule="gpipe")
    assert step.plan_source == "search", "other planner options miss"
    monkeypatch.setattr(intra_ilp.cost_model, "COST_MODEL_VERSION", "test-version-2")
    _, step, _ = _make_plan(tmp_path, Cluster.local(1, 1))
    assert step.plan_source == "search", "a new cost model version misses"
    assert len(list(tmp_path.glob("*.json"))) == 4


@pytest.mark.parametrize("damage", ["truncate", "other_graph", "other_fields", "not_json_object"])
def test_damaged_or_stale_entry_is_replanned_and_overwritten(tmp_path, damage):
    plan, step, _ = _make_plan(tmp_path, Cluster.local(1, 1))
    path = next(tmp_path.glob("*.json"))
    entry = json.loads(path.read_text())
    if damage == "truncate":
        path.write_text(path.read_text()[:200])
    elif damage == "other_graph":
        entry["plan"]["graph_fingerprint"] = "0" * 16
        path.write_text(json.dumps(entry))
    elif damage == "other_fields":
        entry["fields"]["cost_model_version"] = "old"
        path.write_text(json.dumps(entry))
    else:
        path.write_text("[1, 2]")
    _, step, _ = _make_plan(tmp_path, Cluster.local(1, 1))
    assert step.plan_source == "search"
    assert plan_decisions(ParallelPlan.from_dict(json.loads(path.read_text())["plan"])) == plan_decisions(plan)
    _, step, _ = _make_plan(tmp_path, Cluster.local(1, 1))
    assert step.plan_source == "cache", "the overwritten entry is good again"


def test_key_covers_graph_cluster_options_and_versions():
    model, optimizer, batch = _inputs()
    from alpa_torch.capture import capture

    graph = capture(train_step, model, optimizer, batch)
    base = key_fields(graph, Cluster.local(1, 2), PlanOptions(schedule="1f1b"))
    assert set(base) == {"graph_fingerprint", "cluster", "options", "cost_model_version", "plan_format_version",
                         "cache_version"}
    assert "progress" not in base["options"]
    assert cache_key(base) == cache_key(key_fields(graph, Cluster.local(1, 2), PlanOptions()))
    assert cache_key(base) != cache_key(key_fields(graph, Cluster.local(2, 1), PlanOptions()))
    assert cache_key(base) != cache_key(key_fields(graph, Cluster.local(1, 2), PlanOptions(schedule="gpipe")))


def test_cache_location_option_and_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ALPA_TORCH_CACHE", str(tmp_path / "env"))
    assert default_root() == tmp_path / "env"
    assert PlanCache.from_option(None).root == tmp_path / "env"
    assert PlanCache.from_option(str(tmp_path / "x")).root == tmp_path / "x"
    assert PlanCache.from_option(False) is None
    monkeypatch.delenv("ALPA_TORCH_CACHE")
    assert str(default_root()).endswith(".cache/alpa_torch/plans")


def test_cached_plan_repeats_the_planner_warnings(tmp_path, caplog, monkeypatch):
    import logging

    from alpa_torch import plan_cache

    def search(graph, cluster, options, progress=None):
        logging.getLogger("intra_ilp.strategies").warning("no sharding rule for aten.glu: it runs replicated")
        return plan

    plan, _, _ = _make_plan(False, Cluster.local(1, 1))
    monkeypatch.setattr(plan_cache, "make_plan", search)
    model, optimizer, batch = _inputs()
    from alpa_torch.capture import capture

    graph = capture(train_step, model, optimizer, batch)
    cache = PlanCache(tmp_path)
    assert plan_cache.cached_plan(cache, graph, Cluster.local(1, 1), PlanOptions())[1] == "search"
    with caplog.at_level(logging.WARNING, logger="intra_ilp.strategies"):
        assert plan_cache.cached_plan(cache, graph, Cluster.local(1, 1), PlanOptions())[1] == "cache"
    assert "aten.glu: it runs replicated [cached plan]" in caplog.text
