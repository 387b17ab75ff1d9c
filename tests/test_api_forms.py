"""``parallelize`` called every way the README writes it.

``parallelize(train_step, cluster)``, ``parallelize(train_step, cluster=...)``,
``@parallelize(cluster)``, ``@parallelize(cluster=...)`` and bare ``@parallelize``
(the default cluster) each give a step bound to that cluster that trains like eager;
wrong calls name the fix.
"""

from __future__ import annotations

import copy

import pytest

from alpa_torch import Cluster, ParallelStep, parallelize
from alpa_torch.zoo import build, make_optimizer, train_step

pytestmark = pytest.mark.usefixtures("ray_session")

CLUSTER = Cluster.local(1, 2)


def _forms():
    """Each README form, applied to a fresh function with ``train_step``'s body."""
    def fresh():
        def step_fn(model, optimizer, batch):
            return train_step(model, optimizer, batch)
        return step_fn

    def decorated_positional():
        @parallelize(CLUSTER)
        def step_fn(model, optimizer, batch):
            return train_step(model, optimizer, batch)
        return step_fn

    def decorated_keyword():
        @parallelize(cluster=CLUSTER)
        def step_fn(model, optimizer, batch):
            return train_step(model, optimizer, batch)
        return step_fn

    def decorated_bare():
        @parallelize
        def step_fn(model, optimizer, batch):
            return train_step(model, optimizer, batch)
        return step_fn

    return {
        "positional": lambda: parallelize(fresh(), CLUSTER),
        "keyword": lambda: parallelize(fresh(), cluster=CLUSTER),
        "@positional": decorated_positional,
        "@keyword": decorated_keyword,
        "@bare": decorated_bare,
    }


@pytest.mark.parametrize("form", list(_forms()))
def test_every_form_gives_a_step_on_its_cluster(form):
    step = _forms()[form]()
    assert isinstance(step, ParallelStep) and step.__name__ == "step_fn"
    assert step.cluster == (Cluster.local(1, 2) if form == "@bare" else CLUSTER)


@pytest.mark.parametrize("form", ["positional", "@bare"])
def test_forms_train_like_eager(form):
    model, batch = build("mlp")
    reference = copy.deepcopy(model)
    step = _forms()[form]()
    try:
        opt, ref_opt = make_optimizer("adamw", model), make_optimizer("adamw", reference)
        for _ in range(2):
            got = float(step(model, opt, batch))
            want = float(train_step(reference, ref_opt, batch).detach())
            assert abs(got - want) < 1e-5
    finally:
        step.shutdown()


def test_wrong_calls_name_the_fix():
    with pytest.raises(TypeError, match="two clusters"):
        parallelize(CLUSTER, CLUSTER)
    with pytest.raises(TypeError, match="not an alpa_torch.Cluster"):
        parallelize(train_step, "1x2")
    with pytest.raises(TypeError, match="training step function"):
        parallelize(42, CLUSTER)
    step = parallelize(train_step, CLUSTER)
    model, (x, y) = build("mlp")
    opt = make_optimizer("adamw", model)
    with pytest.raises(TypeError, match=r"takes \(model, optimizer, batch\).*one batch"):
        step(model, opt, x, y)
    with pytest.raises(TypeError, match=r"torch.nn.Module and a torch.optim.Optimizer"):
        step(opt, model, (x, y))
    assert step.engine is None  # nothing started
