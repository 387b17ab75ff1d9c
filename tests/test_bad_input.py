"""Bad input gets a named alpa-torch error that says what is wrong and what to do.

One test per case. Each asserts the exception class and that the message names
the problem and the fix. The cases that need workers share the session's Ray.
"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from alpa_torch import (
    BatchSplitError,
    CaptureError,
    Cluster,
    ClusterSpecError,
    DataDependentControlFlowError,
    InfeasibleMemoryError,
    LossError,
    PlanError,
    UnsupportedOperatorError,
    capture,
    parallelize,
)
from alpa_torch.core.errors import IndexRangeError, StepUsageError
from alpa_torch.zoo import GPT, ZOO, GPTConfig, make_batch, make_optimizer, train_step
from tests.test_semantics import CLUSTER, _xy, plain
from tests.test_semantics import _mlp as _net


def _mlp():
    model, batch = ZOO["mlp"]()
    return model, make_optimizer("adam", model), batch


def _step_with(body):
    def step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = model.loss(batch)
        out = body(loss)
        if out is not None:
            return out
        loss.backward()
        optimizer.step()
        return loss

    return step


# ---------------------------------------------------------------- capture
def test_data_dependent_branch():
    def step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = model.loss(batch)
        if loss > 1.0:  # a branch on a tensor value
            loss = loss * 2
        loss.backward()
        optimizer.step()
        return loss

    with pytest.raises(DataDependentControlFlowError, match=r"test_bad_input.py:\d+.*torch.where"):
        capture(step, *_mlp())


def test_item_in_step():
    step = _step_with(lambda loss: None if loss.item() < 1e9 else loss)
    with pytest.raises(DataDependentControlFlowError, match="item"):
        capture(step, *_mlp())


def test_step_returning_nothing():
    def step(model, optimizer, batch):
        optimizer.zero_grad()
        model.loss(batch).backward()
        optimizer.step()

    with pytest.raises(LossError, match="return loss"):
        capture(step, *_mlp())


def test_step_returning_a_non_scalar():
    def step(model, optimizer, batch):
        optimizer.zero_grad()
        x, y = batch
        per_sample = nn.functional.cross_entropy(model(x), y, reduction="none")
        per_sample.mean().backward()
        optimizer.step()
        return per_sample

    with pytest.raises(LossError, match=r"shape \(8,\).*reduce it"):
        capture(step, *_mlp())


def test_step_without_optimizer_step():
    def step(model, optimizer, batch):
        loss = model.loss(batch)
        loss.backward()
        return loss

    with pytest.raises(CaptureError, match=r"optimizer.step\(\)"):
        capture(step, *_mlp())


def test_refused_optimizer():
    model, batch = ZOO["mlp"]()
    with pytest.raises(CaptureError, match="SparseAdam cannot run in a parallel step.*sparse gradients"):
        capture(train_step, model, torch.optim.SparseAdam(model.parameters()), batch)


def test_operator_without_fake_kernel():
    @torch.library.custom_op("alpa_test::opaque", mutates_args=())
    def opaque(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    class Opaque(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def loss(self, batch):
            return opaque(self.lin(batch)).sum()

    model = Opaque()
    with pytest.raises(UnsupportedOperatorError, match="alpa_test::opaque.*register_fake"):
        capture(train_step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(3, 4))


# ---------------------------------------------------------------- cluster
@pytest.mark.parametrize("kwargs,what", [
    ({"hosts": 0, "devices_per_host": 2}, "num_hosts"),
    ({"hosts": 1, "devices_per_host": 0}, "devices_per_host"),
])
def test_cluster_with_zero_devices(kwargs, what):
    with pytest.raises(ClusterSpecError, match=what):
        Cluster.local(kwargs["hosts"], kwargs["devices_per_host"])


def test_cluster_with_negative_bandwidth():
    d = Cluster.local(1, 2).to_dict()
    d["intra_host_link"] = {"name": "bad", "alpha_s": 1e-5, "bandwidth_bytes_per_s": -1.0}
    with pytest.raises(ClusterSpecError, match="bandwidth"):
        Cluster.from_dict(d)


def test_unknown_device_name():
    with pytest.raises(ClusterSpecError, match="a100-80gb"):
        Cluster.simulated(1, 8, device="a100-90gb")


# ---------------------------------------------------------------- planning
def test_batch_that_does_not_split_into_microbatches():
    model, optimizer, batch = _mlp()
    step = parallelize(train_step, cluster=Cluster.local(1, 2), num_microbatches=3)
    with pytest.raises(BatchSplitError, match="num_microbatches=3.*divisor"):
        step.make_plan(model, optimizer, batch)


def test_batchnorm_with_microbatches():
    model, batch = ZOO["cnn"]()
    step = parallelize(train_step, cluster=Cluster.local(1, 2), num_microbatches=2)
    with pytest.raises(PlanError, match="BatchNorm.*num_microbatches=1"):
        step.make_plan(model, make_optimizer("sgd", model), batch)


class _RouterAuxLoss(nn.Module):
    """A classifier with a Switch-Transformer load-balancing loss on a 4-way router:
    4 * sum_e (fraction of the batch routed to e) * (mean router probability of e), a
    product of two batch means (Mixtral's aux loss with output_router_logits=True)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 8)
        self.router = nn.Linear(8, 4)

    def loss(self, batch):
        x, labels = batch
        h = self.body(x)
        probs = self.router(h).softmax(-1)
        routed = nn.functional.one_hot(probs.argmax(-1), 4).float().mean(0)
        aux = 4 * (routed * probs.mean(0)).sum()
        return nn.functional.cross_entropy(h, labels) + 0.01 * aux


def test_pooled_batch_statistic_with_microbatches():
    """Microbatches average per-microbatch losses: a statistic pooled over the batch and used
    nonlinearly (an MoE load-balancing loss) would change, so B is 1 (forced B > 1: an error)."""
    from alpa_torch.capture import capture
    from stage_dp.coupling import batch_coupling

    _, batch = ZOO["mlp"]()
    plain, _ = ZOO["mlp"]()
    assert batch_coupling(capture(train_step, plain, make_optimizer("adam", plain), batch)) is None
    model = _RouterAuxLoss()
    reason = batch_coupling(capture(train_step, model, make_optimizer("adam", model), batch))
    assert reason is not None and "aten.mul.Tensor" in reason and "pooled over the whole batch" in reason
    step = parallelize(train_step, cluster=Cluster.local(1, 2), num_microbatches=2)
    with pytest.raises(PlanError, match="pooled over the whole batch.*num_microbatches=1"):
        step.make_plan(model, make_optimizer("adam", model), batch)


def test_model_too_big_for_the_cluster():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=256))
    batch = (torch.zeros(4, 64, dtype=torch.long), torch.zeros(4, 64, dtype=torch.long))
    step = parallelize(train_step, cluster=Cluster.local(1, 2), memory_budget_bytes=64 * 1024)
    with pytest.raises(InfeasibleMemoryError, match="(?i)memory") as info:
        step.make_plan(model, make_optimizer("adam", model), batch)
    assert info.value.required_bytes is None or info.value.required_bytes > 64 * 1024


def _planned(tmp_path):
    model, optimizer, batch = _mlp()
    step = parallelize(train_step, cluster=Cluster.local(1, 2), pipeline=False)
    plan = step.make_plan(model, optimizer, batch)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    return plan, path, step


def test_corrupt_plan_file(tmp_path):
    _, path, _ = _planned(tmp_path)
    path.write_text(path.read_text()[:100])
    with pytest.raises(PlanError, match="not a plan file"):
        parallelize(train_step, cluster=Cluster.local(1, 2), plan=str(path)).make_plan(*_mlp())


def test_plan_from_another_model(tmp_path):
    _, path, _ = _planned(tmp_path)
    model, batch = ZOO["gpt"]()
    step = parallelize(train_step, cluster=Cluster.local(1, 2), plan=str(path))
    with pytest.raises(PlanError, match="(?i)fingerprint|another model|different"):
        step.make_plan(model, make_optimizer("adam", model), batch)


def test_plan_of_an_older_format(tmp_path):
    _, path, _ = _planned(tmp_path)
    data = json.loads(path.read_text())
    data["format_version"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="format version 0.*re-plan"):
        parallelize(train_step, cluster=Cluster.local(1, 2), plan=str(path)).make_plan(*_mlp())


def test_forced_plan_that_does_not_tile_the_cluster(tmp_path):
    plan, path, _ = _planned(tmp_path)
    with pytest.raises(PlanError, match="(?i)tile|devices|cluster"):
        parallelize(train_step, cluster=Cluster.local(1, 4), plan=str(path)).make_plan(*_mlp())


def test_optimizer_setting_changed_after_capture():
    """Float hyper-parameters are sent every step (schedulers move them); a flag is baked: its change is
    named, and the step captures again (``test_semantics``)."""
    from alpa_torch.optim import OptimizerSet

    model, optimizer, batch = _mlp()
    functional = OptimizerSet((optimizer,), {id(p): n for n, p in model.named_parameters()})
    capture(train_step, model, optimizer, batch, optimizers=functional)
    optimizer.param_groups[0]["betas"] = (0.5, 0.9)
    optimizer.param_groups[0]["eps"] = 1e-6
    assert functional.constants_changed(1) is None
    optimizer.param_groups[0]["amsgrad"] = True
    assert "amsgrad False -> True" in functional.constants_changed(1)


# ---------------------------------------------------------------- running
@pytest.mark.usefixtures("ray_session")
def test_batch_shape_changes_between_calls_and_nan_loss():
    model, optimizer, batch = _mlp()
    step = parallelize(train_step, cluster=Cluster.local(1, 2), pipeline=False)
    try:
        step(model, optimizer, batch)
        with pytest.raises(BatchSplitError, match=r"planned for \(8, 16\).*keep batch shapes fixed"):
            step(model, optimizer, make_batch("mlp", 4, seed=1))
        bad = (torch.full_like(batch[0], float("nan")), batch[1])
        with pytest.warns(RuntimeWarning, match="step 2: the loss is nan"):
            step(model, optimizer, bad)
    finally:
        step.shutdown()


@pytest.mark.usefixtures("ray_session")
def test_operator_without_sharding_rule_runs_replicated(caplog):
    class GLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(16, 4)

        def loss(self, batch):
            x, y = batch
            return nn.functional.cross_entropy(self.b(nn.functional.glu(self.a(x))), y)

    torch.manual_seed(0)
    eager = GLU()
    model = copy.deepcopy(eager)
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    eager_opt, optimizer = make_optimizer("adam", eager), make_optimizer("adam", model)
    step = parallelize(train_step, cluster=Cluster.local(1, 2))
    with caplog.at_level(logging.WARNING, logger="intra_ilp.strategies"):
        try:
            for _ in range(2):
                expected = float(train_step(eager, eager_opt, batch).detach())
                assert float(step(model, optimizer, batch)) == pytest.approx(expected, abs=1e-5)
        finally:
            step.shutdown()
    assert "aten.glu" in caplog.text and "replicated" in caplog.text


def test_more_devices_than_ray_has(monkeypatch):
    from runtime import ray_env

    with pytest.raises(ClusterSpecError, match="(?i)devices|gpu|resources"):
        ray_env.ensure_ray(Cluster.simulated(2, 8, device="h100-80gb", intra="nvlink4", inter="ib-400g"))

# ---------------------------------------------------------------- what a step reads and how it is called
# (equality cases: tests/test_semantics.py)



@pytest.mark.usefixtures("ray_session")
def test_a_step_without_zero_grad_is_refused_by_name():
    def accumulating(model, optimizer, batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    model = _net()
    step = parallelize(accumulating, CLUSTER)
    with pytest.raises(CaptureError, match="zero_grad.*accumulation across calls"):
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), _xy(0))
    assert step.group is None


@pytest.mark.usefixtures("ray_session")
def test_another_model_or_a_call_after_shutdown_is_refused():
    model, other = _net(0), _net(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = parallelize(plain, CLUSTER)
    try:
        step(model, opt, _xy(0))
        with pytest.raises(StepUsageError, match="another model object"):
            step(other, torch.optim.AdamW(other.parameters(), lr=1e-3), _xy(1))
        with pytest.raises(StepUsageError, match="another optimizer object"):
            step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _xy(1))
    finally:
        step.shutdown()
    with pytest.raises(StepUsageError, match="shut down"):
        step(model, opt, _xy(1))
    with pytest.raises(StepUsageError, match="shut down"):
        step.state_dict()


@pytest.mark.usefixtures("ray_session")
def test_out_of_range_labels_and_token_ids_are_named():
    model = _net()
    step = parallelize(plain, CLUSTER)
    x, y = _xy(0)
    y[3] = 12
    with pytest.raises(IndexRangeError, match=r"batch\[1\] holds the class label 12 at position \(3,\).*0\.\.7"):
        step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), (x, y))
    assert step.group is None  # caught before the workers started

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10)

        def forward(self, ids):
            return self.head(self.emb(ids))

    def lm_step(model, optimizer, batch):
        optimizer.zero_grad()
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten())
        loss.backward()
        optimizer.step()
        return loss

    lm = LM()
    step = parallelize(lm_step, CLUSTER)
    ids = torch.randint(0, 10, (4, 6))
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    try:
        step(lm, opt, {"input_ids": ids})
        ids = ids.clone()
        ids[2, 4] = 10
        named = r"batch\['input_ids'\] holds the (token id|class label) 10 at position \(2, 4\).*0\.\.9"
        with pytest.raises(IndexRangeError, match=named):
            step(lm, opt, {"input_ids": ids})
    finally:
        step.shutdown()


@pytest.mark.usefixtures("ray_session")
def test_a_bad_plan_cache_location_is_named(tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    with pytest.raises(PlanError, match="plan_cache.*not a directory"):
        parallelize(plain, CLUSTER, plan_cache=str(path))


@pytest.mark.usefixtures("ray_session")
def test_a_batch_that_does_not_split_names_the_entry():
    model = _net()
    step = parallelize(plain, CLUSTER, num_microbatches=3, num_stages=2)
    with pytest.raises((BatchSplitError, PlanError), match=r"batch\[0\]|divide"):
        step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _xy(0))


def test_a_failing_lazy_import_names_its_cause(tmp_path, monkeypatch):
    """``from alpa_torch import x`` loads ``x``'s module lazily; an AttributeError raised inside it (an
    older torch without an API the module uses, say) is reported as itself, not as 'cannot import name'."""
    import alpa_torch

    (tmp_path / "needs_newer_torch.py").write_text("import torch\ntorch.no_such_api_of_this_version\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(alpa_torch._EXPORTS, "needs_newer", "needs_newer_torch")
    with pytest.raises(ImportError, match="needs_newer_torch.*no_such_api_of_this_version"):
        from alpa_torch import needs_newer  # noqa: F401
