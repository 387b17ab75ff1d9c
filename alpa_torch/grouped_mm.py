"""``aten._grouped_mm`` as dense, traceable matmuls, for ``capture``'s decomposition table.

Why. Mixture-of-experts layers multiply each token by its expert's weight with
one grouped GEMM (``torch.nn.functional.grouped_mm``; transformers' default
``grouped_mm`` experts implementation, ``transformers/integrations/moe.py``).
Its CPU kernel takes float32, so eager training runs, but its fake/meta kernel
(``torch._meta_registrations._meta_grouped_mm_common``) copies the CUDA
kernel's checks and refuses anything but bfloat16: ``make_fx`` on fake tensors
stops at the first expert (``Expected inputs of BF16 type``). The autograd
formula of ``_grouped_mm`` is ``_grouped_mm`` again (on other layouts), so the
backward hits the same check.

What. ``grouped_mm_dense`` computes the same product without the kernel: every
group's matmul on every row (a batched matmul over the groups), then the rows
(or columns, or contracted entries) of other groups masked to exact zeros and
summed away. The shapes are static (the offsets only move the masks), every op
is a standard aten op with a DTensor rule (the group dim is a bmm batch dim the
planner may shard: expert parallelism), and the result is the grouped product
(summing exact zeros is exact; the matmuls themselves round as ``mm`` does).
The price is the groups' FLOPs on every row (G times the grouped kernel's) and
a [G, rows, cols] intermediate, which the planner sees and prices.

When. Only where torch cannot trace the op itself: inputs that are not both
bfloat16 (the meta kernel's condition). bfloat16 inputs keep the native op
(fake kernel, DTensor rule, the fast kernel); a ``bias`` (which no kernel
supports yet) is left to the native op to refuse.
"""

from __future__ import annotations

import torch


def _native_traceable(mat_a: torch.Tensor, mat_b: torch.Tensor) -> bool:
    """Whether torch's own fake kernel accepts these operands (bfloat16 only)."""
    return mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16


def _group_mask(offs: torch.Tensor, length: int) -> torch.Tensor:
    """[G, length] bool: entry (g, i) is True when index i lies in group g.

    Group g spans [offs[g-1], offs[g]) (``offs`` holds the cumulative ends, as
    ``grouped_mm`` expects); indices at or past ``offs[-1]`` belong to no group
    and come out zero, as from the CPU kernel.
    """
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    idx = torch.arange(length, device=offs.device)
    return (idx >= starts.unsqueeze(1)) & (idx < ends.unsqueeze(1))


def grouped_mm_dense(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """``aten._grouped_mm`` in dense matmuls (module docstring); NotImplemented keeps the native op.

    Layouts (``torch.nn.functional.grouped_mm``): 2D x 3D groups the rows of
    ``mat_a`` (the forward, and the input gradient); 2D x 2D groups the
    contracted dim and returns one product per group (the weight gradient);
    3D x 2D groups the columns of ``mat_b``; 3D x 3D (no ``offs``) is a bmm.
    """
    if bias is not None or _native_traceable(mat_a, mat_b):
        return NotImplemented
    if offs is None:
        out = torch.bmm(mat_a, mat_b)
    elif mat_a.dim() == 2 and mat_b.dim() == 3:  # [M, K] x [G, K, N] -> [M, N]
        keep = _group_mask(offs, mat_a.shape[0]).unsqueeze(-1)  # [G, M, 1]
        out = torch.where(keep, torch.matmul(mat_a, mat_b), 0).sum(0)
    elif mat_a.dim() == 3 and mat_b.dim() == 2:  # [G, M, K] x [K, N] -> [M, N]
        keep = _group_mask(offs, mat_b.shape[1]).unsqueeze(1)  # [G, 1, N]
        out = torch.where(keep, torch.matmul(mat_a, mat_b), 0).sum(0)
    else:  # [M, K] x [K, N] -> [G, M, N]
        keep = _group_mask(offs, mat_a.shape[1]).unsqueeze(1)  # [G, 1, K]
        out = torch.matmul(torch.where(keep, mat_a, 0), mat_b)
    return out if out_dtype is None else out.to(out_dtype)
