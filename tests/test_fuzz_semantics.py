"""A differential fuzzer: random small models and steps, eager against ``parallelize``.

Hypothesis composes a model (depth, width, tied weights, frozen layers), an optimizer
(any of ``torch.optim``'s but LBFGS and SparseAdam, or Muon with AdamW; one or two
parameter groups), a step (loss
reduction, labels padded with ignored -100s, a Python float weight in the batch, gradient
clipping, gradient accumulation inside the step over two halves of the batch, zero_grad
before or after the update), a
batch container (tuple, dict, dataclass, named tuple), an LR scheduler, a plan (1x2 or
2x2 devices; automatic, one stage, or a forced 2-stage pipeline) and what the loop does
with the model between steps (nothing, read it, write it, evaluate it). Each runs 3 steps
eagerly and through ``parallelize``. The only allowed outcomes: equal to eager within 1e-5
(every loss and every parameter), or an ``AlpaTorchError`` raised at the first call before
any worker started.

CI runs a fixed budget of examples (derandomized: the same examples every run). A nightly
run sets a bigger one: ``ALPA_TORCH_FUZZ_EXAMPLES=200 python -m pytest tests/test_fuzz_semantics.py``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alpa_torch import Cluster

from .test_semantics import compare

pytestmark = pytest.mark.usefixtures("ray_session")
EXAMPLES = int(os.environ.get("ALPA_TORCH_FUZZ_EXAMPLES", "8"))
IN, CLASSES, BATCH = 12, 6, 8


@dataclasses.dataclass
class DataBatch:
    x: torch.Tensor
    y: torch.Tensor
    weight: float = 1.0


class PairBatch(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor
    weight: float


class Net(torch.nn.Module):
    def __init__(self, depth: int, width: int, tied: bool, frozen: bool):
        super().__init__()
        self.inp = torch.nn.Linear(IN, width)
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        if tied and depth >= 2:
            self.hidden[-1].weight = self.hidden[0].weight
        self.out = torch.nn.Linear(width, CLASSES)
        if frozen:
            self.inp.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for layer in self.hidden:
            h = h + torch.tanh(layer(h))
        return self.out(h)


@st.composite
def cases(draw):
    return {
        "depth": draw(st.integers(1, 3)), "width": draw(st.sampled_from([8, 16])),
        "tied": draw(st.booleans()), "frozen": draw(st.booleans()),
        "optimizer": draw(st.sampled_from(list(OPTIMIZERS))),
        "two_groups": draw(st.booleans()),
        "reduction": draw(st.sampled_from(["mean", "sum"])),
        "padded": draw(st.booleans()),
        "weights": draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=3, max_size=3)),
        "clip": draw(st.sampled_from([None, 0.5])),
        "accumulate": draw(st.booleans()),
        "zero_grad_at_end": draw(st.booleans()),
        "container": draw(st.sampled_from(["tuple", "dict", "dataclass", "namedtuple"])),
        "scheduler": draw(st.sampled_from([None, "step", "onecycle"])),
        "cluster": draw(st.sampled_from([(1, 2), (2, 2)])),
        "plan": draw(st.sampled_from(["auto", "one_stage", "two_stages"])),
        "between": draw(st.sampled_from([None, "read", "write", "evaluate"])),
    }


def _loss_of(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def make_between(case):
    """What the loop does with the model and optimizer between steps: read them (the model's and the
    optimizer's state), write them (a weight halved), or evaluate (eagerly, or on the cluster)."""
    held_out = (torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(9)), torch.arange(BATCH) % CLASSES)
    evaluations = {}

    def between(model, optimizer, step):
        if case["between"] == "read":
            return [model.state_dict(), [list(o.state_dict()["state"].values()) for o in _all(optimizer)]]
        if case["between"] == "write":
            with torch.no_grad():
                model.out.weight.mul_(0.5)
            return None
        if step is None:
            with torch.no_grad():
                return _loss_of(model, held_out)
        return evaluations.setdefault(id(step), step.evaluate(_loss_of))(model, held_out)

    return between if case["between"] else None


def _unpack(batch, container):
    if container == "dict":
        return batch["x"], batch["y"], batch["w"]
    if container == "tuple":
        return batch
    return batch.x, batch.y, batch.weight


def _pack(x, y, w, container):
    return {"tuple": (x, y, w), "dict": {"x": x, "y": y, "w": w}, "dataclass": DataBatch(x, y, w),
            "namedtuple": PairBatch(x, y, w)}[container]


def _all(optimizer) -> tuple:
    return tuple(optimizer) if isinstance(optimizer, tuple) else (optimizer,)


def make_step(case):
    def train_step(model, optimizer, batch):
        x, y, w = _unpack(batch, case["container"])
        if not case["zero_grad_at_end"]:
            for o in _all(optimizer):
                o.zero_grad()
        half = BATCH // 2
        parts = [(x[:half], y[:half]), (x[half:], y[half:])] if case["accumulate"] else [(x, y)]
        total = 0.0
        for xs, ys in parts:
            loss = F.cross_entropy(model(xs), ys, reduction=case["reduction"]) * w / len(parts)
            loss.backward()
            total = total + loss.detach()
        if case["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        for o in _all(optimizer):
            o.step()
        if case["zero_grad_at_end"]:
            for o in _all(optimizer):
                o.zero_grad()
        return total

    return train_step


OPTIMIZERS = {
    "sgd": lambda g: torch.optim.SGD(g, lr=0.05, weight_decay=1e-3),
    "sgd_momentum": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda g: torch.optim.Adam(g, lr=0.01, weight_decay=0.01),
    "adamw": lambda g: torch.optim.AdamW(g, lr=0.01, weight_decay=0.01),
    "adadelta": lambda g: torch.optim.Adadelta(g, lr=0.5),
    "adagrad": lambda g: torch.optim.Adagrad(g, lr=0.05),
    "adamax": lambda g: torch.optim.Adamax(g, lr=0.01),
    "asgd": lambda g: torch.optim.ASGD(g, lr=0.01),
    "nadam": lambda g: torch.optim.NAdam(g, lr=0.01),
    "radam": lambda g: torch.optim.RAdam(g, lr=0.01, decoupled_weight_decay=True, weight_decay=0.01),
    "rmsprop": lambda g: torch.optim.RMSprop(g, lr=0.01, momentum=0.5),
    "rprop": lambda g: torch.optim.Rprop(g, lr=0.01),
    "adafactor": lambda g: torch.optim.Adafactor(g, lr=0.01),
    "muon": None,  # Muon on the matrices, AdamW on the rest: a tuple of two optimizers
}


def make_optimizer(case, model):
    params = [p for p in model.parameters() if p.requires_grad]
    if case["optimizer"] == "muon":
        return (torch.optim.Muon([p for p in params if p.dim() == 2], lr=0.02),
                torch.optim.AdamW([p for p in params if p.dim() != 2], lr=0.01))
    groups = [{"params": params[: len(params) // 2]}, {"params": params[len(params) // 2:], "lr": 0.02}] \
        if case["two_groups"] and len(params) >= 2 else [{"params": params}]
    return OPTIMIZERS[case["optimizer"]](groups)


class _Schedulers:
    def __init__(self, schedulers):
        self.schedulers = schedulers

    def step(self) -> None:
        for s in self.schedulers:
            s.step()


def make_scheduler(case, optimizer):
    if case["scheduler"] == "step":
        return _Schedulers([torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in _all(optimizer)])
    if case["scheduler"] == "onecycle":
        return _Schedulers([torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=0.05, total_steps=10, cycle_momentum="betas" in o.defaults or o.defaults.get("momentum", 0) > 0)
            for o in _all(optimizer)])
    return None


def plan_options(case) -> dict:
    return {"auto": {}, "one_stage": {"pipeline": False},
            "two_stages": {"num_stages": 2, "num_microbatches": 2}}[case["plan"]]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
@pytest.mark.slow
def test_parallel_step_equals_eager_or_refuses_by_name(case):
    gen = torch.Generator().manual_seed(1)
    labels = [torch.randint(0, CLASSES, (BATCH,), generator=gen) for _ in case["weights"]]
    if case["padded"]:  # ignored labels (-100), a different number in each half of each batch
        for i, y in enumerate(labels):
            y[: i + 1] = -100
    batches = [_pack(torch.randn(BATCH, IN, generator=gen), y, w, case["container"])
               for y, w in zip(labels, case["weights"])]

    def net():
        torch.manual_seed(0)
        return Net(case["depth"], case["width"], case["tied"], case["frozen"])
    compare(make_step(case), batches, make_model=net, make_opt=lambda m: make_optimizer(case, m),
            schedule=lambda o: make_scheduler(case, o), cluster=Cluster.local(*case["cluster"]), refusal_ok=True,
            context=f"({case})", between=make_between(case), **plan_options(case))
