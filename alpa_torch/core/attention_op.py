"""Fused attention as one operator of the captured graph: ``alpa::attention`` and its backward.

``torch.nn.functional.scaled_dot_product_attention`` runs, in eager PyTorch, one fused
kernel that never materialises the ``[B, H, Tq, Tk]`` scores and keeps only the output
and its log-sum-exp for the backward. The capture (``alpa_torch.tracing``) keeps it so:
where eager would take a fused kernel on the cluster's device, the call becomes
``alpa::attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> (out,
lse)``, whose backward is ``alpa::attention_backward``. The graph is the same for every
device; each runs its own kernel:

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (masks,
  causal, grouped-query attention with fewer key/value heads);
- CUDA: flash attention where it applies (fp16 / bf16, no mask), else memory-efficient
  attention (float32, or a mask); key/value heads repeated for grouped-query attention. A
  mask is prepared as eager's dispatcher prepares it for memory-efficient attention
  (``efficient_bias``: rows aligned to 8 elements, expanded to ``[B, H, Tq, Tk]``). Head dims
  are not padded: the capture gives CUDA head dims a multiple of 8 only (``alpa_torch.tracing
  .math_reason``). A boolean mask arrives additive (0 or -inf), as eager makes it. ``lse`` is
  ``[B, H, Tq]`` float32 on every device (memory-efficient attention pads it; the pad is cut
  off and restored).

Dropout inside attention is not fused: where a step has it, eager's CPU kernels take the
math path too, and so does the capture (its random operators are seeded by
``runtime/rng.py``). What this module owns besides the kernels: the operators' fake
(shape) functions, their FLOPs for the cost model (``torch.utils.flop_counter``: 4 B H Tq
Tk D forward, causal half of it, the backward 2.5x) and their DTensor sharding rules
(``register_rules``): replicated, split on the batch dim, or split on the heads dim (query
and key/value heads alike; with grouped-query attention only into as many parts as divide the
key/value heads, so every device's query heads find theirs), on every axis of the mesh.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

OP = "alpa::attention"
BACKWARD_OP = "alpa::attention_backward"
_ALIGN = 8
"""Memory-efficient attention reads mask rows aligned to this many elements (eager's ``preprocess_mask``)."""


def _repeat_kv(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> tuple[Tensor, Tensor]:
    """Key and value with their heads repeated to the query's (grouped-query attention)."""
    if not enable_gqa or k.shape[-3] == q.shape[-3]:
        return k, v
    groups = q.shape[-3] // k.shape[-3]
    return k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)


def _cuda_flash(q: Tensor, attn_mask: Tensor | None, dropout_p: float) -> bool:
    return attn_mask is None and dropout_p == 0.0 and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def efficient_bias(attn_mask: Tensor | None, q: Tensor, k: Tensor) -> Tensor | None:
    """``attn_mask`` as eager's ``scaled_dot_product_attention`` hands it to CUDA's memory-efficient
    kernel: a mask whose rows are not 8-element aligned is copied into padded rows (the view keeps
    the original length), then expanded to ``[B, H, Tq, Tk]`` without a copy."""
    if attn_mask is None:
        return None
    aligned = attn_mask.stride(-1) == 1 and all(s % _ALIGN == 0 for s in attn_mask.stride()[:-1])
    if not aligned:
        n = attn_mask.shape[-1]
        attn_mask = torch.nn.functional.pad(attn_mask, (0, _ALIGN - n % _ALIGN))[..., :n]
    return attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


@torch.library.custom_op(OP, mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool,
              scale: float | None, enable_gqa: bool) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of scaled-dot-product attention by the device's fused kernel (module docstring)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        return out, lse
    k, v = _repeat_kv(q, k, v, enable_gqa)
    if _cuda_flash(q, attn_mask, dropout_p):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)
        return out, lse
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, efficient_bias(attn_mask, q, k), True, dropout_p, is_causal, scale=scale)
    return out, lse[..., :q.shape[-2]].contiguous()


@attention.register_fake
def _(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    # The operator itself on fake tensors: each kernel's own meta function gives the shapes and the
    # strides that kernel gives (its output follows the query's layout), as compiled code checks.
    return attention._init_fn(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@torch.library.custom_op(BACKWARD_OP, mutates_args=())
def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       attn_mask: Tensor | None, dropout_p: float, is_causal: bool, scale: float | None,
                       enable_gqa: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad q, grad k, grad v)`` by the device's fused backward kernel."""
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        return dq, dk, dv
    kr, vr = _repeat_kv(q, k, v, enable_gqa)
    t = q.shape[-2]
    if _cuda_flash(q, attn_mask, dropout_p):
        # A dense batch has no cumulative sequence lengths (the forward returns None for them; a
        # tensor there asks for the variable-length kernel); the Philox seed and offset are read
        # only with dropout.
        unused = q.new_empty((), dtype=torch.int64)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, kr, vr, out, lse, None, None, t, kr.shape[-2], dropout_p, is_causal, unused, unused,
            scale=scale)
    else:
        padded = lse.new_zeros((*lse.shape[:-1], 32 * math.ceil(t / 32)))
        padded[..., :t] = lse
        empty = q.new_zeros((), dtype=torch.int64)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, kr, vr, efficient_bias(attn_mask, q, kr), out, padded, empty, empty, dropout_p,
            [True, True, True, False],
            is_causal, scale=scale)
    if kr is not k:  # grouped heads: each key/value head's gradient is the sum over its query heads
        groups = q.shape[-3] // k.shape[-3]
        dk = dk.unflatten(-3, (k.shape[-3], groups)).sum(-3)
        dv = dv.unflatten(-3, (v.shape[-3], groups)).sum(-3)
    return dq, dk, dv


@attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return attention_backward._init_fn(grad_out, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.attn_mask, ctx.args = attn_mask, (dropout_p, is_causal, scale, enable_gqa)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.alpa.attention_backward(grad_out.contiguous(), q, k, v, out, lse, ctx.attn_mask,
                                                   *ctx.args)
    return dq, dk, dv, None, None, None, None, None


attention.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- cost: FLOPs


def _forward_flops(q_shape, k_shape, v_shape, is_causal: bool) -> float:
    b, h, tq, d = q_shape[0], q_shape[-3], q_shape[-2], q_shape[-1]
    tk, dv = k_shape[-2], v_shape[-1]
    flops = 2.0 * b * h * tq * tk * d + 2.0 * b * h * tq * tk * dv  # q k^T, then p v
    return flops / 2 if is_causal else flops


def register_flops() -> None:
    """The operators' FLOP formulas in ``torch.utils.flop_counter`` (what ``graph_facts`` reads)."""
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.alpa.attention)
    def _(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> float:
        return _forward_flops(q_shape, k_shape, v_shape, bool(args[2]) if len(args) > 2 else False)

    @register_flop_formula(torch.ops.alpa.attention_backward)
    def _(grad_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> float:
        is_causal = bool(args[4]) if len(args) > 4 else False
        return 2.5 * _forward_flops(q_shape, k_shape, v_shape, is_causal)  # five matmuls against two


# ---------------------------------------------------------------- sharding rules


def register_rules() -> None:
    """DTensor sharding rules of both operators (module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._op_schema import OpStrategy, RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy

    def mask_placement(mask, dim: int):
        if not isinstance(mask, OpStrategy):
            return []
        shape = mask.shape
        size = shape[dim - 4 + len(shape)] if len(shape) >= 4 - dim else 1
        return [Shard(dim - 4 + len(shape)) if size > 1 else Replicate()]

    def rules(op_schema, outputs: int, tensors: int, mask_index: int, q_index: int):
        mask = op_schema.args_schema[mask_index]
        strategies = [[Replicate()] * outputs + [Replicate()] * tensors + ([Replicate()] if isinstance(
            mask, OpStrategy) else [])]
        for dim in (0, 1):  # the batch dim, the heads dim
            strategies.append([Shard(dim)] * (outputs + tensors) + mask_placement(mask, dim))
        mesh = op_schema.get_mesh_from_args()
        found = expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=outputs)
        q_heads, kv_heads = (op_schema.args_schema[i].shape[1] for i in (q_index, q_index + 1))
        if q_heads != kv_heads:  # grouped-query: each device's query heads must find their key/value heads
            found.strategies = [s for s in found.strategies if kv_heads % _heads_split(s.input_specs[q_index + 1],
                                                                                        mesh) == 0]
        return found

    @register_op_strategy(torch.ops.alpa.attention.default, schema_info=RuntimeSchemaInfo(4))
    def _(op_schema):
        return rules(op_schema, outputs=2, tensors=3, mask_index=3, q_index=0)

    @register_op_strategy(torch.ops.alpa.attention_backward.default, schema_info=RuntimeSchemaInfo(7))
    def _(op_schema):
        return rules(op_schema, outputs=3, tensors=6, mask_index=6, q_index=1)


def _heads_split(spec, mesh) -> int:
    """Into how many parts ``spec`` (a key's DTensor spec) splits the heads dim (dim 1)."""
    return math.prod(mesh.size(i) for i, p in enumerate(spec.placements) if p.is_shard() and p.dim == 1)


register_flops()
