"""The ``alpa::grad`` operator: an identity that marks where a parameter's gradient is final.

Capture passes every gradient through it when ``loss.backward()`` returns, so the graph
shows the boundary between backward and update (``graph_facts`` phases, the ILP's
gradient reductions, a pipeline's gradient accumulation). Importing this module
registers the operator: a process that runs captured graphs (a worker) imports it
before unpickling one.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("alpa::grad", mutates_args=())
def grad_marker(grad: torch.Tensor, index: int) -> torch.Tensor:
    """Identity marking the gradient of parameter number ``index``."""
    return grad.clone()


@grad_marker.register_fake
def _(grad, index):
    return torch.empty_like(grad)


GRAD_MARKER = torch.ops.alpa.grad.default
GRAD_MARKER_NAME = str(GRAD_MARKER)
"""How graph facts and serialized records name the marker: ``'alpa.grad.default'``."""
