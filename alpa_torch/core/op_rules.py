"""DTensor sharding rules for operators the captured graphs hold and DTensor (torch 2.13) has none for.

The planner reads DTensor's rules (``intra_ilp/strategies.py``) and the workers run the plan
through DTensor (``runtime/interpreter.py``), so a rule registered here serves both; import
this module before either (as ``grad_op``'s operator is registered).

- ``aten.copy.default``: what ``functionalize`` makes of an in-place ``copy_`` (the traced
  optimizer writing a parameter: ``alpa_torch/optim.py``; an EMA written back in a step). It
  is the in-place ``copy_``'s maths: the same pointwise rule as DTensor's own ``copy_``
  (every placement, partial sums kept). Without it every such value ran replicated.
- ``alpa::attention`` and its backward (``attention_op.py``): replicated, batch or heads.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor._ops import _pointwise_ops

from . import attention_op

aten = torch.ops.aten

if not hasattr(_pointwise_ops, "_register_single_dim_pointwise"):  # e.g. a GPU image's older torch on PYTHONPATH
    raise ImportError(f"alpa-torch needs torch >= 2.13 (its DTensor sharding-rule registration); this Python has "
                      f"torch {torch.__version__}. Fix: pip install 'torch>=2.13'.")
_pointwise_ops._register_single_dim_pointwise(aten.copy.default, _pointwise_ops._ALL_PARTIAL_BINARY_PRESERVING_RULES)
attention_op.register_rules()
