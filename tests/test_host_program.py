"""The operators of hyper-parameters alone leave the captured step (``alpa_torch/core/host_program.py``).

torch.optim computes ``1 - beta1``, ``1 - lr * weight_decay`` and their casts again for every
parameter; the capture hoists them into host-scalar inputs the driver computes on every call,
so the graph keeps none. That a learning rate moved between steps still reaches the update is
tested through ``parallelize`` with every scheduler (``test_semantics``, ``test_optim``).
"""

from __future__ import annotations

import torch

from alpa_torch.capture import capture
from alpa_torch.core.host_program import PREFIX
from tests.test_semantics import _mlp, _xy, plain


def test_no_operator_of_hyper_parameters_alone_stays_in_the_graph():
    model = _mlp()
    graph = capture(plain, model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), _xy(0))
    host = {s.node for s in graph.inputs if s.kind == "host_scalar"}
    hoisted = [s.name for s in graph.inputs if s.name.startswith(PREFIX)]
    assert hoisted, "AdamW's 1 - lr * wd, 1 - beta1, ... are hoisted"
    for name, node in graph.nodes.items():
        assert not (node.inputs and set(node.inputs) <= host), f"{name} reads host scalars alone"
    # four parameters, each value once: the hoisted inputs do not grow with the parameters
    assert len(hoisted) <= 8
    hyper = {s.name: 0.5 for s in graph.inputs if s.kind == "host_scalar" and not s.name.startswith(PREFIX)}
    values = graph.host_inputs(hyper)
    assert set(values) == set(hyper) | set(hoisted) and all(values[k].dim() == 0 for k in hoisted)
