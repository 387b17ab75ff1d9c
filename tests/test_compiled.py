"""Compiled stage programs (``parallelize(..., compile=True)``, ``runtime/regions.py``) equal eager.

Each plan family runs 3 steps with its workers' runs of local kernels compiled by Inductor and
is compared with single-device eager training (fp32, atol 1e-5; ``tests/test_runtime.run_case``):
one device, data parallel (gradient buckets ending regions: ``test_runtime``'s bucket test),
tensor parallel and a sharded update (collectives between regions), and a two-stage pipeline
through ``parallelize``. Each also checks that the workers compiled something and that nothing
fell back. A second run of the mission's call loads every compiled region from the cache beside
its plan. Each but the one-device case compiles for a minute or so on 2 cores: the second run,
data parallelism and the pipeline are slow tests (CI runs them); HF LLaMA on one device, tensor
parallelism and the sharded update are a sweep (``python -m pytest -m sweep tests/test_compiled.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from alpa_torch import Cluster, parallelize
from alpa_torch.zoo import ZOO, make_batch, make_optimizer, train_step
from tests.test_runtime import ATOL, cheap_comm, data_parallel_force, realistic, run_case, zoo_graph

pytestmark = pytest.mark.usefixtures("ray_session")


def _regions(state) -> list[tuple[int, str | None]]:
    """Every region of this worker's programs: (its steps, why it failed to compile or None)."""
    runner, program = state["runner"], state["program"]
    programs = [runner.program, *getattr(program, "programs", {}).values()]
    return [(len(r.steps), r.failed) for p in programs if p.fast is not None for r in p.fast.regions]


PROBE = {"install": lambda state: None, "read": _regions}


def _compiled_everywhere(probe) -> None:
    for rank, regions in enumerate(probe["result"]):
        assert regions, f"rank {rank} compiled nothing"
        assert all(failed is None for _, failed in regions), (rank, regions)


def test_one_device_compiled_equals_eager():
    cluster = Cluster.local(1, 1)
    probe = dict(PROBE)
    run_case("gpt", cluster, realistic(cluster, (1, 1)), probe=probe, compile=True)
    _compiled_everywhere(probe)
    (regions,) = probe["result"]
    assert len(regions) == 2, "one device: the step is two regions, split where the loss answers the driver"


def _loaded(state) -> list[bool]:
    """Whether each region of this worker's step came from the compiled-artifact cache."""
    return [r.loaded for r in state["runner"].program.fast.regions]


@pytest.mark.slow
def test_a_second_run_of_a_script_loads_its_compiled_regions(tmp_path):
    """The mission's call with ``compile=True`` run twice, as two runs of one script would: the
    first compiles the worker's regions and keeps them beside its plan, the second loads every
    one of them (nothing compiled) and trains equal to eager too."""
    for run in range(2):
        torch.manual_seed(0)
        eager, _ = ZOO["gpt"]()
        model = copy.deepcopy(eager)
        eager_opt, opt = make_optimizer("adamw", eager), make_optimizer("adamw", model)
        step = parallelize(train_step, Cluster.local(1, 1), compile=True, plan_cache=str(tmp_path), tune=False)
        try:
            for i in range(3):
                batch = make_batch("gpt", 4, seed=i)
                want = float(train_step(eager, eager_opt, batch).detach())
                assert float(step(model, opt, batch)) == pytest.approx(want, abs=ATOL), (run, i)
            (loaded,) = step.group.call_all(_loaded)
        finally:
            step.shutdown()
        assert len(loaded) == 2 and loaded == [run == 1] * 2, (run, loaded)
        assert len(list((tmp_path / "compiled").glob("*.bin"))) == 2


@pytest.mark.sweep
def test_hugging_face_llama_compiled_on_one_device_equals_eager():
    """HF LLaMA with grouped-query attention: its backward region reads activations the forward
    region lays out as compiled code does, not as the kernels run one by one would."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.test_hf import run_hf_labels

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    run_hf_labels(LlamaForCausalLM(cfg), cluster=(1, 1), compile=True)


@pytest.mark.slow
def test_data_parallel_compiled_equals_eager():
    cluster = Cluster.local(1, 2)
    probe = dict(PROBE)
    run_case("gpt", cluster, realistic(cluster, (1, 2)), force=data_parallel_force(zoo_graph()), probe=probe,
             compile=True)
    _compiled_everywhere(probe)


@pytest.mark.sweep
def test_sharded_optimizer_state_compiled_equals_eager():
    """ZeRO's plan: the batch split, weights replicated, the optimizer state split on dim 0 (each
    device updates its part, then the weights are gathered)."""
    cluster = Cluster.local(1, 2)
    graph = zoo_graph()
    force = {s.name: {"batch": "RS(0)", "param": "RR"}.get(s.kind, "RS(0)" if s.shape[0] % 2 == 0 else "RR")
             for s in graph.inputs if s.kind in ("batch", "param", "opt_state") and s.shape}
    probe = dict(PROBE)
    sharding = run_case("gpt", cluster, realistic(cluster, (1, 2)), force=force, probe=probe, compile=True)
    assert any(str(sharding.value_specs[s.node]) == "RS(0)" for s in graph.inputs if s.kind == "opt_state")
    _compiled_everywhere(probe)


@pytest.mark.sweep
def test_tensor_parallel_compiled_equals_eager():
    probe = dict(PROBE)
    run_case("mlp", Cluster.local(1, 2), cheap_comm((1, 2)), probe=probe, compile=True)
    _compiled_everywhere(probe)


@pytest.mark.slow
def test_pipeline_compiled_through_parallelize_equals_eager():
    """The mission's call with ``compile=True``: a two-stage pipeline of two microbatches."""
    torch.manual_seed(0)
    eager, _ = ZOO["gpt"]()
    model = copy.deepcopy(eager)
    eager_opt, opt = make_optimizer("adamw", eager), make_optimizer("adamw", model)
    step = parallelize(train_step, Cluster.local(1, 2), compile=True, num_stages=2, num_microbatches=2, tune=False)
    try:
        for i in range(3):
            batch = make_batch("gpt", 8, seed=i)
            want = float(train_step(eager, eager_opt, batch).detach())
            assert float(step(model, opt, batch)) == pytest.approx(want, abs=ATOL), f"step {i}"
        assert len(step.plan.stages) == 2
        _compiled_everywhere({"result": step.group.call_all(_regions)})
    finally:
        step.shutdown()
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), atol=ATOL, rtol=0, msg=name)
