"""Tracing a user's function into a functional aten graph on fake tensors: what every capture shares.

``capture.py`` traces a whole training step and ``capture_forward.py`` a forward-only
function (an evaluation); both hand this module a pure function of flat inputs
(``Inputs``: example values and their kinds and names) and get back a cleaned-up
``fx.GraphModule``:

- ``make_fx`` on fake tensors (a model on the ``meta`` device needs no memory), with
  the decompositions every capture needs (``DECOMPOSITIONS``);
- where the graph writes into a tensor, a second ``functionalize`` pass makes the
  writes pure operators whose results are graph outputs;
- identity operators and the copies back into inputs dropped (``cleanup``);
- a failure translated into a named error at the user's line (``translate_trace_error``),
  and the checks fake tensors skip but eager kernels make (``check_kernel_dtypes``).

What this module does not do: decide what the inputs and outputs mean (the captures do).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import traceback

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

import alpa_torch.core.attention_op  # noqa: F401 - the fused attention operator the capture keeps
from alpa_torch.core.errors import (
    CaptureError,
    DataDependentControlFlowError,
    UnsupportedOperatorError,
)
from alpa_torch.core.graph import source_line

from .grouped_mm import grouped_mm_dense

log = logging.getLogger(__name__)
aten = torch.ops.aten


def _batch_norm_as_legit(input, weight, bias, running_mean, running_var, training, momentum, eps):
    # native_batch_norm mutates its running stats without saying so in its
    # schema; _native_batch_norm_legit declares the mutation, so functionalize
    # turns it into outputs. Same kernel, same numbers. In eval mode nothing is
    # written: the variant that declares no mutation keeps the graph pure.
    if running_mean is None:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)
    if not training:
        return aten._native_batch_norm_legit_no_training.default(input, weight, bias, running_mean, running_var,
                                                                 momentum, eps)
    return aten._native_batch_norm_legit.default(
        input, weight, bias, running_mean, running_var, training, momentum, eps
    )


DECOMPOSITIONS = {
    aten.native_batch_norm.default: _batch_norm_as_legit,
    # MoE experts (transformers' default grouped_mm): the fake kernel takes bfloat16 only
    aten._grouped_mm.default: grouped_mm_dense,
}


class Inputs:
    """Flat graph inputs (example values) and their kinds and names, in graph order."""

    def __init__(self):
        self.specs: list[tuple[str, str]] = []
        self.values: list[torch.Tensor] = []

    def add(self, kind: str, name: str, value: torch.Tensor) -> None:
        self.specs.append((kind, name))
        self.values.append(value)

    def slice(self, kind: str) -> range:
        idx = [i for i, (k, _) in enumerate(self.specs) if k == kind]
        return range(idx[0], idx[-1] + 1) if idx else range(0)


def fake_inputs(mode: FakeTensorMode, values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fake tensors of ``values`` (a meta tensor becomes a fake CPU tensor of its shape)."""
    out = []
    for t in values:
        if t.device.type == "meta":  # weights without memory: plan-only capture
            with mode:
                out.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu"))
        else:
            out.append(mode.from_tensor(t))
    return out


def traced(fn, values: list[torch.Tensor], mode: FakeTensorMode, what: str, device_type: str = "cpu"
           ) -> fx.GraphModule:
    """``fn`` traced on the fake tensors of ``values``, functional and cleaned up (module
    docstring); a failure raised as a named ``CaptureError`` (``what``: the user's function, for
    the message). ``device_type``: the devices the graph will run on ('cpu' or 'cuda': which
    attention kernels eager would take there, ``FusedAttention``)."""
    fake = fake_inputs(mode, values)
    # A lazy GraphModule writes its Python code on first call (or .code, or pickling), not on
    # every recompile: capture rewrites the graph three times and planning never runs it
    # (LLaMA-3-8B: 1.5 of 9 s were spent generating code nobody called).
    with _use_lazy_graph_module(True):
        try:
            gm = _trace(fn, fake, mode, device_type)
        except CaptureError:
            raise
        except Exception as exc:  # noqa: BLE001 - translated into a user-facing error
            translated = translate_trace_error(exc)
            if translated is None:
                raise CaptureError(f"tracing {what} failed at {user_frame(exc)}: {type(exc).__name__}: {exc}") from exc
            raise translated from exc
        cleanup(gm)
        check_kernel_dtypes(gm)
    return gm


def _trace(fn, fake_values, mode, device_type: str):
    with mode, FusedAttention(device_type):
        gm = make_fx(fn, decomposition_table=DECOMPOSITIONS)(*fake_values)
        # An ``item()`` an operator's argument parser tried before the traced optimizer gave it a
        # number instead (``lazy_scalars._numbers``) is left in the graph, read by nothing.
        gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.target is not aten._local_scalar_dense.default
                                     and n.is_impure())
        if mutates(gm):  # re-tracing to functionalize costs ~40 % of capturing: only where something is written
            gm = make_fx(torch.func.functionalize(gm, remove="mutations"))(*fake_values)
    return gm


def mutates(gm: fx.GraphModule) -> bool:
    """Whether an operator of ``gm`` writes into a tensor (an in-place or ``out=`` op: BatchNorm's
    running statistics, ``x.add_(...)`` in a step). Not counted: a copy into an input that
    nothing reads (``_written_back``): the traced optimizer's update is already functional
    (``optim.OptimizerSet.update``) and returns its results, so most graphs have none."""
    return any(node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
               and node.target._schema.is_mutable and not _written_back(node) for node in gm.graph.nodes)


def _written_back(node: fx.Node) -> bool:
    """A copy into a graph input whose result nothing reads: ``functionalize``'s write-back of an
    input it updated, where the graph returns the updated value itself (``cleanup`` drops it)."""
    return node.target is aten.copy_.default and node.args[0].op == "placeholder" and not node.users


def cleanup(gm: fx.GraphModule) -> None:
    """Drop identity ops and the copies functionalize adds back into inputs."""
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if node.target in (aten.detach.default, aten.alias.default):
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
        elif _written_back(node):
            g.erase_node(node)
    g.eliminate_dead_code()
    gm.recompile()


class FusedAttention(TorchFunctionMode):
    """While tracing: ``scaled_dot_product_attention`` as the fused ``alpa::attention`` wherever eager
    takes a fused kernel on ``device_type`` (``core/attention_op.py``), else decomposed into matmul and
    softmax, as eager's math path, with one log line saying why."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self._said: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = _SDPA.bind(*args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        why = math_reason(self.device_type, a["query"], a["key"], a["value"], a["attn_mask"], a["dropout_p"],
                          a["is_causal"], a["scale"], a["enable_gqa"])
        if why is None:
            mask = a["attn_mask"]
            if mask is not None and mask.dtype == torch.bool:  # as eager does before its fused kernels
                mask = torch.zeros(mask.shape, dtype=a["query"].dtype, device=mask.device).masked_fill(
                    mask.logical_not(), float("-inf"))
            return torch.ops.alpa.attention(a["query"], a["key"], a["value"], mask, a["dropout_p"],
                                            a["is_causal"], a["scale"], a["enable_gqa"])[0]
        if why not in self._said:
            self._said.add(why)
            log.info("attention runs as math (matmul and softmax, a T x T score matrix): %s", why)
        with sdpa_kernel(SDPBackend.MATH):
            return func(*args, **kwargs)


def _sdpa_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention``'s parameters (its builtin has no signature)."""


_SDPA = inspect.signature(_sdpa_signature)


def math_reason(device_type: str, q, k, v, attn_mask, dropout_p: float, is_causal: bool, scale, enable_gqa: bool
                ) -> str | None:
    """Why eager's attention on ``device_type`` would not take a fused kernel for these inputs, or None."""
    if dropout_p > 0:
        return "dropout inside attention (eager's CPU kernels take the math path for it too)" \
            if device_type == "cpu" else "dropout inside fused attention is not supported by alpa-torch yet"
    if attn_mask is not None and attn_mask.requires_grad:
        return "the attention mask needs a gradient (a learned bias)"
    if q.dim() != 4 or k.dim() != 4:
        return f"the query has {q.dim()} dims (the fused operator takes [batch, heads, sequence, head dim])"
    if device_type != "cpu":
        # alpa::attention calls CUDA's kernels directly: it prepares a mask as eager's dispatcher does
        # (attention_op.efficient_bias), not head dims (eager pads them to 8)
        if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"dtype {q.dtype}"
        if q.shape[-1] % 8 or v.shape[-1] % 8:
            return f"head dims {q.shape[-1]} and {v.shape[-1]} (CUDA's fused kernels want multiples of 8)"
        if is_causal and q.shape[-2] != k.shape[-2]:
            return "causal attention of unequal query and key lengths on CUDA"
        return None
    # On the CPU: eager's own choice, asked of small real tensors with the inputs' dtypes, heads, head
    # dims and mask kind (sequence lengths and batch do not decide it).
    with _disable_current_modes():  # real tensors, asked outside the trace
        small = [torch.zeros((1, t.shape[1], 2, t.shape[3]), dtype=t.dtype).requires_grad_(t.requires_grad)
                 for t in (q, k, v)]
        mask = None
        if attn_mask is not None:  # the mask's shape as it broadcasts against the small scores [1, H, 2, 2]
            scores = (1, q.shape[1], 2, 2)[-attn_mask.dim():]
            mask = torch.zeros(tuple(1 if n == 1 else m for n, m in zip(attn_mask.shape, scores)),
                               dtype=attn_mask.dtype)
        choice = torch._fused_sdp_choice(*small, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return None if choice == SDPBackend.FLASH_ATTENTION.value else "eager's CPU kernels take the math path here"


_SAME_DTYPE = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.addbmm, aten.mv, aten.addmv, aten.dot,
               aten.vdot, aten.convolution}
"""Operators whose eager kernels refuse floating-point inputs of different dtypes, where the fake
kernels (shapes only) do not check: a float64 batch into float32 weights traced fine and failed on
every worker."""


def check_kernel_dtypes(gm: fx.GraphModule) -> None:
    """Raise eager's error, as a ``CaptureError`` at the user's line, where an operator of
    ``_SAME_DTYPE`` reads floating-point tensors of different dtypes."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "_overloadpacket", None) not in _SAME_DTYPE:
            continue
        vals = [a.meta.get("val") for a in node.args if isinstance(a, fx.Node)]
        dtypes = [v.dtype for v in vals if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
        if len(set(dtypes)) > 1:
            where = f" at {source_line(node)}" if source_line(node) else ""
            raise CaptureError(
                f"{node.target._overloadpacket.__name__} reads tensors of dtypes {', '.join(map(str, dtypes))}{where}: "
                f"eager PyTorch raises here too (mat1 and mat2 must have the same dtype). Fix: give the batch the "
                f"model's dtype (e.g. x.to({dtypes[-1]})), or cast inside the step")


def user_frame(exc: BaseException) -> str:
    """The deepest traceback frame outside torch and alpa-torch: the user's line."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    torch_dir = os.path.dirname(torch.__file__)
    best = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        path = os.path.abspath(frame.filename)
        if not path.startswith(torch_dir) and not path.startswith(os.path.join(here, "alpa_torch")):
            best = f'{frame.filename}:{frame.lineno}: {(frame.line or "").strip()}'
    return best or "<unknown line>"


def translate_trace_error(exc: BaseException) -> Exception | None:
    """A named ``CaptureError`` for a tracing failure the user can act on, or None."""
    where = user_frame(exc)
    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException)) or "data-dependent" in str(exc):
        return DataDependentControlFlowError(
            f"the step depends on tensor values at {where} (Python control flow, .item(), or a "
            "data-dependent shape), so it has no single static graph; compute on tensors instead "
            "(torch.where, masks) or move the decision outside train_step"
        )
    op = _op_without_fake_kernel(exc)
    if op is not None:
        return UnsupportedOperatorError(
            f"operator {op} at {where} cannot be traced (no meta/fake kernel); replace it with "
            f'standard torch operators or register a fake implementation: torch.library.register_fake("{op}") '
            "(the .register_fake decorator of a torch.library.custom_op)"
        )
    return None


# torch.library.custom_op without register_fake raises a plain RuntimeError
# (torch/_library/custom_ops.py), not UnsupportedOperatorException.
_NO_FAKE_IMPL = re.compile(r"no fake impl registered for <CustomOpDef\((?P<op>[^)]+)\)>")


def _op_without_fake_kernel(exc: BaseException) -> str | None:
    """The operator ``exc`` says has no fake kernel, or None."""
    if isinstance(exc, UnsupportedOperatorException):
        return exc.func._schema.name  # 'ns::op', as torch.library names it
    match = _NO_FAKE_IMPL.search(str(exc))
    return match.group("op") if match else None
