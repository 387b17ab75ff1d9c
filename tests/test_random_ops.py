"""Random operators on the devices (``runtime/rng.py``): what the README promises of dropout.

Promised: the distribution of eager training (not its masks); the user's seed reaches the
workers, so a run is reproducible with the same seed and plan; replicas of a value draw
the same numbers; no two shards of a sharded random output draw the same numbers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from alpa_torch import Cluster
from alpa_torch.capture import capture
from alpa_torch.optim import OptimizerSet
from intra_ilp.cost_model import MeshCost
from intra_ilp.stage import solve_stage
from runtime.rng import is_random, op_seed

pytestmark = pytest.mark.usefixtures("ray_session")


class Dropper(torch.nn.Module):
    """A linear layer, dropout with p = 0.5, and a buffer that keeps the last mask it drew."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("mask", torch.zeros(8, 16))

    def forward(self, x):
        h = F.dropout(self.lin(x), p=0.5, training=True)
        with torch.no_grad():
            self.mask.copy_((h != 0).float())
        return h


def step_fn(model, optimizer, batch):
    optimizer.zero_grad()
    loss = model(batch).square().mean()
    loss.backward()
    optimizer.step()
    return loss


def _masks(batch_spec: str, seed: int, steps: int = 2, restart: bool = False
           ) -> tuple[list[float], list[torch.Tensor]]:
    """Train ``Dropper`` on 1x2 devices with the batch placed as ``batch_spec``; the losses and every
    device's local mask buffer after the last step. ``restart``: then load the initial state again
    with ``Engine.restart`` (what measured plan selection does to the plan it keeps) and train
    ``steps`` more, their losses appended."""
    from runtime.engine import Engine
    from runtime.group import WorkerGroup
    from runtime.wire import from_wire, to_wire_dict

    torch.manual_seed(0)
    model = Dropper()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.ones(8, 16)
    graph = capture(step_fn, model, opt, batch)
    force = {s.name: (batch_spec if s.kind == "batch" else "RR") for s in graph.inputs
             if s.kind in ("batch", "param", "opt_state", "buffer")}
    force["mask"] = batch_spec
    cluster = Cluster.local(1, 2)
    sharding = solve_stage(graph, MeshCost.from_cluster(cluster, (1, 2), (1, 2)), force=force)
    functional = OptimizerSet((opt,), {id(p): n for n, p in model.named_parameters()})
    values = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with WorkerGroup.start(cluster) as group:
        engine = Engine(group, graph, sharding, seed=seed)
        engine.load_state(to_wire_dict(values))
        losses = [engine.step({"batch.0": batch.numpy()}, functional.host_scalars()) for i in range(steps)]
        if restart:
            from runtime.state_sources import Values

            engine.restart([Values(to_wire_dict(values))])
            losses += [engine.step({"batch.0": batch.numpy()}, functional.host_scalars()) for i in range(steps)]
        local = group.call_all(lambda state: _local(state["runner"].state["mask"]))
    return losses, [from_wire(m) for m in local]


def _local(value):
    return value.to_local() if hasattr(value, "to_local") else value


def test_sharded_dropout_draws_a_different_mask_on_each_device():
    losses, (m0, m1) = _masks("RS(0)", seed=1234)
    assert m0.shape == (4, 16) and m1.shape == (4, 16)  # each device drew the mask of its own rows
    assert not torch.equal(m0, m1), "two devices drew the same mask"
    kept = torch.cat([m0, m1]).mean().item()
    assert 0.3 < kept < 0.7, f"dropout p=0.5 kept {kept:.2f} of the values"
    again, (r0, r1) = _masks("RS(0)", seed=1234)
    assert again == losses and torch.equal(r0, m0) and torch.equal(r1, m1), "not reproducible with the same seed"
    other, (o0, _) = _masks("RS(0)", seed=99)
    assert not torch.equal(o0, m0), "the seed does not reach the workers"


def test_replicated_dropout_draws_the_same_mask_on_every_device():
    _, (m0, m1) = _masks("RR", seed=7)
    assert m0.shape == (8, 16) and torch.equal(m0, m1), "replicas of one value drew different masks"


def test_a_restarted_deployment_draws_the_masks_of_a_new_one():
    """``Engine.restart`` (the kept plan of measured selection, its trial steps behind it) counts steps
    from the start: the same state trained again draws the same masks, step for step."""
    losses, _ = _masks("RS(0)", seed=3, restart=True)
    assert losses[:2] == losses[2:] and losses[0] != losses[1]


def test_op_seed_separates_what_must_differ():
    base = op_seed(1, 1, 0, "native_dropout", (0,))
    assert base == op_seed(1, 1, 0, "native_dropout", (0,))
    assert base == op_seed(1, 1, 0, "native_dropout_recompute", (0,))  # a recomputed copy redraws the same
    others = [op_seed(2, 1, 0, "native_dropout", (0,)), op_seed(1, 2, 0, "native_dropout", (0,)),
              op_seed(1, 1, 1, "native_dropout", (0,)), op_seed(1, 1, 0, "native_dropout_1", (0,)),
              op_seed(1, 1, 0, "native_dropout", (1,))]
    assert len({base, *others}) == 6 and all(0 <= s < 2**63 for s in others)
    assert is_random(torch.ops.aten.native_dropout.default) and not is_random(torch.ops.aten.mm.default)
