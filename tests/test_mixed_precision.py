"""Mixed precision: ``parallelize(..., precision='bf16' | 'fp16')`` against eager autocast.

bf16 / fp16 compute with fp32 master weights: the step's forward and loss are traced
under ``torch.autocast``, backward and the optimizer are not, so parameters, gradients
and optimizer state stay fp32. fp16 adds ``torch.amp.GradScaler``'s dynamic loss
scaling inside the graph.

Tolerances. A planned step runs the same operators as eager autocast; only the order
of floating-point sums differs where an operator is sharded (partial sums reduced
across devices, possibly in the low precision). Each such difference is one rounding
of the low precision: relative 2^-8 for bf16 (8 significant bits) and 2^-11 for fp16
(11). The loss, a mean, is therefore compared with ``rtol = 2^-8`` (bf16) or
``2^-11`` (fp16); measured differences are far smaller (bf16, tensor-parallel GPT:
<= 1.5e-5 relative; fp16, data parallel: <= 2.5e-6 relative). Eager autocast itself
differs from fp32 by less than the same bound (bf16: <= 1.1e-5 relative on these
steps), so the planned step is checked against fp32 with the same tolerance.

Parameters are compared with AdamW, which normalises each element's step to about
``lr``: rounding noise flips the sign of near-zero gradients, so single elements may
differ by up to ``2 lr`` per step, whatever the precision of the difference. The bound
is ``2 lr × steps`` (1e-2 here); eager bf16 autocast itself moves parameters 3.8e-3
away from fp32 in 5 steps, planned bf16 on a tensor-parallel mesh 5.6e-3 from eager
bf16 (the automatic 1x2 plan, two pipeline stages, is bitwise equal: 0), planned fp16
(data parallel) <= 1.2e-3 from eager fp16.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from alpa_torch.capture import capture
from alpa_torch.core.cluster import Cluster
from alpa_torch.core.errors import PlanError
from alpa_torch.core.options import PlanOptions
from alpa_torch.core.plan import graph_fingerprint
from alpa_torch.optim import LossScaler, OptimizerSet
from alpa_torch.plan_cache import cache_key, key_fields
from alpa_torch.zoo import ZOO, make_batch, make_optimizer, model_loss, train_step
from intra_ilp import cost_model as cm
from intra_ilp.reshard_paths import reshard_s

BF16_RTOL = 2.0**-8
FP16_RTOL = 2.0**-11
LR = 1e-3
STEPS = 5
PARAM_ATOL = 2 * LR * STEPS
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")


def _eager_step(precision: str, scaler=None, loss_fn=model_loss):
    """One eager step the recommended way: autocast the forward and loss only."""
    def step(model, optimizer, batch):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=DTYPES[precision]):
            loss = loss_fn(model, batch)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return loss.detach()

    return step


def _max_diff(a, b) -> float:
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b))


# ---------------------------------------------------------------- (a) capture


@pytest.fixture(scope="module")
def bf16_gpt():
    """The zoo GPT's AdamW step captured with bf16 (a graph depends on shapes and the
    optimizer's configuration, not on values: any copy of the model can run it)."""
    model, batch = ZOO["gpt"]()
    return capture(train_step, model, make_optimizer("adamw", model, lr=LR), batch, precision="bf16")


def test_bf16_capture_casts_weights_and_keeps_fp32_master_state(bf16_gpt):
    g = bf16_gpt
    assert g.meta["precision"] == "bf16"
    mm = [n for n in g.nodes.values() if n.target in MATMULS]
    assert mm and all(n.dtype == "bfloat16" for n in mm), "every matmul runs in bf16"
    assert all(n.phase != "update" for n in mm), "the optimizer has no matmul"
    params = {s.node for s in g.inputs if s.kind == "param"}
    casts = [n for n in g.nodes.values() if n.target == "aten._to_copy.default" and n.dtype == "bfloat16"
             and set(n.inputs) & params]
    assert len(casts) >= 8, "the Linear weights are cast to bf16 before their matmuls"
    state = [s for s in g.inputs + g.outputs if s.kind in ("param", "opt_state")]
    assert state and all(s.dtype == "float32" for s in state), "fp32 master weights and optimizer state"
    assert all(g.nodes[n].dtype == "float32" for n in g.grad_of.values()), "fp32 gradients of fp32 parameters"
    assert all(n.dtype != "bfloat16" for n in g.nodes.values() if n.phase == "update")
    assert g.phase_counts()["backward"] > 0
    # Plans (and cached plans) of different precisions never mix, even for equal operators.
    other = dataclasses.replace(g, meta={**g.meta, "precision": "fp32"})
    assert graph_fingerprint(g) != graph_fingerprint(other)
    cluster = Cluster.local(1, 2)
    assert cache_key(key_fields(g, cluster, PlanOptions())) != cache_key(key_fields(other, cluster, PlanOptions()))


def test_fp16_capture_has_loss_scaler_state_and_keeps_phases(bf16_gpt):
    model, batch = ZOO["gpt"]()
    g = capture(train_step, model, make_optimizer("adamw", model), batch, precision="fp16")
    g16 = bf16_gpt
    amp_in = {s.name: s.dtype for s in g.inputs if s.name.startswith("amp.")}
    amp_out = {s.name: s.dtype for s in g.outputs if s.name.startswith("amp.")}
    assert amp_in == amp_out == {"amp.loss_scale": "float32", "amp.growth_tracker": "int32"}
    assert all(s.kind == "opt_state" for s in g.inputs if s.name.startswith("amp."))
    assert {s.dtype for s in g.inputs if s.name.endswith(".step")} == {"float32"}, "AdamW's own step counts"
    # The scaled loss feeds the backward, yet the backward stays backward (not update).
    c, c16 = g.phase_counts(), g16.phase_counts()
    assert c["forward"] == c16["forward"] and c["backward"] >= c16["backward"]
    assert all(n.phase != "update" for n in g.nodes.values() if n.target in MATMULS)


def test_cost_model_prices_low_precision_at_its_peak():
    cluster = Cluster.simulated(1, 8, "a100-80gb")
    mesh = cm.MeshCost.from_cluster(cluster, (1, 8), (1, 8), "float32")
    flops = 1e12
    assert cm.compute_s(mesh, flops, 0.0) == pytest.approx(flops / (19.5e12 * 0.6))
    assert cm.compute_s(mesh, flops, 0.0, "bfloat16") == pytest.approx(flops / (312e12 * 0.6))
    assert cm.compute_s(mesh, flops, 0.0, "torch.float16") == pytest.approx(flops / (312e12 * 0.6))
    assert cm.compute_s(mesh, flops, 0.0, "int64") == cm.compute_s(mesh, flops, 0.0)  # unlisted: default
    v100 = cm.MeshCost.from_cluster(Cluster.simulated(1, 8, "v100-16gb", "nvlink2"), (1, 8), (1, 8))
    assert v100.flops_per_s("bfloat16") == v100.flops_per_s("float32"), "no bf16 tensor cores on a V100"
    # Messages are priced by their element size: a bf16 tensor moves half the bytes of fp32.
    spec_p, spec_r = cm.ShardingSpec.parse("RP"), cm.ShardingSpec.parse("RR")
    full = reshard_s(mesh, spec_p, spec_r, (1024, 1024), 4) - mesh.alpha_s[1]
    half = reshard_s(mesh, spec_p, spec_r, (1024, 1024), 2) - mesh.alpha_s[1]
    assert half == pytest.approx(full / 2)


_INTERVAL = LossScaler.growth_interval


@pytest.mark.parametrize("found_inf,tracker", [(0, 0), (1, 5), (0, _INTERVAL - 2), (0, _INTERVAL - 1),
                                               (1, _INTERVAL - 1)])
def test_loss_scaler_update_is_torchs(found_inf, tracker):
    """``LossScaler.update`` against ``torch._amp_update_scale_`` (what ``GradScaler.update`` runs)."""
    state = LossScaler.initial_state()
    state["amp.growth_tracker"] = torch.tensor(tracker, dtype=torch.int32)
    new = LossScaler.update(state, torch.tensor(bool(found_inf)))
    scale, growth = state["amp.loss_scale"].clone(), state["amp.growth_tracker"].clone()
    torch._amp_update_scale_(scale, growth, torch.tensor(float(found_inf)), LossScaler.growth_factor,
                             LossScaler.backoff_factor, LossScaler.growth_interval)
    assert float(new["amp.loss_scale"]) == float(scale) and int(new["amp.growth_tracker"]) == int(growth)
    grads = [torch.ones(3), torch.tensor([1.0, float("inf")]) if found_inf else torch.zeros(2)]
    assert bool(LossScaler.found_inf(grads)) == bool(found_inf)
    assert bool(LossScaler.found_inf([torch.tensor([float("nan")])]))
    assert not bool(LossScaler.found_inf([torch.full((4,), 3e38)])), "large but finite is not an overflow"


# ---------------------------------------------------------------- (d) bad values


@pytest.mark.parametrize("bad", ["fp8", "float16", None, torch.bfloat16])
def test_bad_precision_is_refused_naming_the_choices(bad):
    from alpa_torch.api import parallelize

    with pytest.raises(PlanError, match=r"precision=.*'fp32'.*'bf16'.*'fp16'"):
        parallelize(train_step, cluster=Cluster.local(1, 2), precision=bad)
    model, batch = ZOO["mlp"]()
    with pytest.raises(PlanError, match="precision="):
        capture(train_step, model, make_optimizer("sgd", model), batch, precision=bad)


def test_fp16_refuses_pipelines_before_capture_work_is_wasted():
    from alpa_torch.api import parallelize

    model, batch = ZOO["mlp"]()
    step = parallelize(train_step, cluster=Cluster.local(1, 2), precision="fp16", num_microbatches=2)
    with pytest.raises(PlanError, match="one stage without microbatches"):
        step.make_plan(model, make_optimizer("adamw", model), batch)


# ---------------------------------------------------------------- (b) bf16 training


@pytest.mark.usefixtures("ray_session")
def test_bf16_gpt_trains_like_eager_autocast():
    """5 AdamW steps of the zoo GPT planned on 2 devices equal eager ``torch.autocast(bf16)``
    (loss rtol 2^-8, parameters within 2 lr x steps: module docstring), and stay as
    close to fp32 training as eager bf16 autocast is."""
    from alpa_torch.api import parallelize

    eager, _ = ZOO["gpt"]()
    model, fp32 = copy.deepcopy(eager), copy.deepcopy(eager)
    eager_opt, opt, fp32_opt = (make_optimizer("adamw", m, lr=LR) for m in (eager, model, fp32))
    eager_step = _eager_step("bf16")
    step = parallelize(train_step, cluster=Cluster.local(1, 2), precision="bf16")
    try:
        for i in range(STEPS):
            batch = make_batch("gpt", 8, seed=i)
            got = float(step(model, opt, batch))
            want = float(eager_step(eager, eager_opt, batch))
            ref = float(train_step(fp32, fp32_opt, batch).detach())
            assert got == pytest.approx(want, rel=BF16_RTOL), f"step {i}: {got} vs eager bf16 {want}"
            assert want == pytest.approx(ref, rel=BF16_RTOL), f"step {i}: eager bf16 {want} vs fp32 {ref}"
            assert got == pytest.approx(ref, rel=BF16_RTOL), f"step {i}: {got} vs fp32 {ref}"
        step.sync(model, opt)
    finally:
        step.shutdown()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert _max_diff(model.parameters(), eager.parameters()) <= PARAM_ATOL
    assert _max_diff(model.parameters(), fp32.parameters()) <= PARAM_ATOL
    assert _max_diff(eager.parameters(), fp32.parameters()) <= PARAM_ATOL
    for p, q in zip(model.parameters(), eager.parameters()):
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(opt.state[p]["step"], eager_opt.state[q]["step"])


@pytest.mark.usefixtures("ray_session")
def test_bf16_tensor_parallel_collectives_match_eager(bf16_gpt):
    """A plan that shards (cheap communication makes the ILP split the matmuls): bf16
    partial sums cross gloo; same tolerances as above."""
    from intra_ilp.stage import solve_stage
    from runtime.engine import Engine
    from runtime.group import WorkerGroup

    eager, _ = ZOO["gpt"]()
    model = copy.deepcopy(eager)
    eager_opt, opt = make_optimizer("adamw", eager, lr=LR), make_optimizer("adamw", model, lr=LR)
    graph = bf16_gpt
    mesh = cm.MeshCost(mesh_shape=(1, 2), alpha_s=(1e-9, 1e-9), beta_s_per_byte=(1e-15, 1e-15),
                       peak_flops_per_s=1e6, memory_bandwidth_bytes_per_s=1e12)
    sharding = solve_stage(graph, mesh)
    assert sum(1 for s in sharding.value_specs.values() if not s.is_replicated) > 0
    functional = OptimizerSet((opt,), {id(p): n for n, p in model.named_parameters()})
    values = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name in functional.names:
        values.update({f"{name}.{k}": v for k, v in functional.initial_state(name, values[name]).items()})
    eager_step = _eager_step("bf16")
    with WorkerGroup.start(Cluster.local(1, 2)) as group:
        engine = Engine(group, graph, sharding)
        engine.load_state({k: v.detach().numpy() for k, v in values.items()})
        for i in range(STEPS):
            batch = make_batch("gpt", 8, seed=i)
            got = engine.step({f"batch.{j}": t.numpy() for j, t in enumerate(batch)}, functional.host_scalars())
            want = float(eager_step(eager, eager_opt, batch))
            assert got == pytest.approx(want, rel=BF16_RTOL), f"step {i}: {got} vs eager bf16 {want}"
        final = engine.gather_state()
    got = [torch.from_numpy(final[n].copy()) for n, _ in eager.named_parameters()]
    assert _max_diff(got, eager.parameters()) <= PARAM_ATOL


# ---------------------------------------------------------------- (c) fp16 with loss scaling


def _scaled_loss(model, batch):
    """The zoo loss multiplied by a batch value: 1 normally, 1e30 to make the fp16
    gradients overflow (the fp32 loss itself stays finite)."""
    idx, targets, mult = batch
    return model_loss(model, (idx, targets)) * mult.mean()


def _scaled_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = _scaled_loss(model, batch)
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.usefixtures("ray_session")
def test_fp16_loss_scaling_skips_overflow_and_matches_grad_scaler(tmp_path):
    """fp16 + in-graph loss scaling equals eager ``torch.autocast(fp16)`` + ``GradScaler``
    (loss rtol 2^-11, parameters within 2 lr x steps): the overflowing step 2 changes no
    parameter or optimizer state, halves the scale, and is not counted by Adam's step."""
    from alpa_torch.api import load_checkpoint, load_into, parallelize

    eager, _ = ZOO["gpt"]()
    model = copy.deepcopy(eager)
    eager_opt, opt = make_optimizer("adamw", eager, lr=LR), make_optimizer("adamw", model, lr=LR)
    scaler = torch.amp.GradScaler("cpu")
    eager_step = _eager_step("fp16", scaler, _scaled_loss)
    overflow = 2
    step = parallelize(_scaled_step, cluster=Cluster.local(1, 2), precision="fp16")
    try:
        for i in range(STEPS):
            idx, targets = make_batch("gpt", 8, seed=i)
            batch = (idx, targets, torch.full((8,), 1e30 if i == overflow else 1.0))
            if i == overflow:
                before = step.state_dict()
            got = float(step(model, opt, batch))
            want = float(eager_step(eager, eager_opt, batch))
            assert got == pytest.approx(want, rel=FP16_RTOL), f"step {i}: {got} vs eager fp16 {want}"
            if i == overflow:
                state = step.state_dict()
                assert float(state["optimizer"]["amp.loss_scale"]) == scaler.get_scale() == 2.0**15
                for part in ("model", "optimizer"):
                    for k, v in before[part].items():
                        if not k.startswith("amp."):
                            assert torch.equal(v, state[part][k]), f"{k} changed in a skipped step"
                assert int(state["optimizer"]["amp.growth_tracker"]) == 0
        state = step.state_dict()
        assert float(state["optimizer"]["amp.loss_scale"]) == scaler.get_scale()
        assert {float(v) for k, v in state["optimizer"].items() if k.endswith(".step")} == {STEPS - 1}
        assert int(state["optimizer"]["amp.growth_tracker"]) == STEPS - 1 - overflow
        step.sync(model, opt)
        step.save(str(tmp_path / "ckpt"))
    finally:
        step.shutdown()
    assert _max_diff(model.parameters(), eager.parameters()) <= PARAM_ATOL
    for p, q in zip(model.parameters(), eager.parameters()):
        assert float(opt.state[p]["step"]) == float(eager_opt.state[q]["step"]) == STEPS - 1
    # The checkpoint's optimizer state loads into a plain optimizer (the amp.* state is not a parameter's).
    model_sd, optim_sd = load_checkpoint(str(tmp_path / "ckpt"))
    assert all(float(s["step"]) == STEPS - 1 for s in optim_sd["state"].values()), "skipped steps not counted"
    fresh = copy.deepcopy(eager)
    fresh_opt = make_optimizer("adamw", fresh, lr=LR)
    assert load_into(fresh, fresh_opt, str(tmp_path / "ckpt")) == STEPS
    assert _max_diff(fresh.parameters(), model.parameters()) == 0
    assert float(fresh_opt.state[next(fresh.parameters())]["step"]) == STEPS - 1


def _clipped_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = _scaled_loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # an in-place write: the graph is functionalized again
    optimizer.step()
    return loss


@pytest.mark.usefixtures("ray_session")
def test_fp16_overflow_is_skipped_in_a_step_that_also_clips():
    """With another in-place write in the step (``clip_grad_norm_``), the overflowing step still
    changes no parameter or optimizer state (the values kept for the skip are copies taken before
    the update wrote its results back)."""
    from alpa_torch.api import parallelize

    model, _ = ZOO["gpt"]()
    opt = make_optimizer("adamw", model, lr=LR)
    step = parallelize(_clipped_step, cluster=Cluster.local(1, 1), precision="fp16")
    try:
        for i in range(3):
            idx, targets = make_batch("gpt", 8, seed=i)
            if i == 2:
                before = step.state_dict()
            step(model, opt, (idx, targets, torch.full((8,), 1e30 if i == 2 else 1.0)))
        after = step.state_dict()
    finally:
        step.shutdown()
    assert float(after["optimizer"]["amp.loss_scale"]) == 2.0**15
    changed = [k for part in ("model", "optimizer") for k, v in before[part].items()
               if not k.startswith("amp.") and not torch.equal(v, after[part][k])]
    assert not changed, f"changed in a skipped step: {changed[:5]}"
