"""A decoder layer's RMSNorm: HF's own module, or on CUDA fla's fused Triton kernel where the module's formula is known.

HF's RMSNorms upcast to float32 and run half a dozen elementwise launches each way over float32 copies of the whole
hidden state (a capture's chunk, a member batch's rows); fla's kernel is one launch forward and one backward. The
classes of `ONE_PLUS_WEIGHT` (Qwen3.5, Qwen3-Next: the hybrid family) compute y = (1 + w) x / rms(x) in float32
and round once, as fla's kernel does given the weight 1 + w in float32. Every other class (llama's rounds
x / rms(x) to the input's dtype before the weight: not measured here yet), and CPU, float64 or no fla, runs the
module itself, the plain reference. `fused_norms_selected` gives the same kernel to norms HF's own modules call
(the attention layers' q and k norms) for the duration of a block. Within `decoding_norms()` (sampling), graph-free
calls of the Llama-form classes run `rms_norm_triton` (one launch, the residual sum inside): a decoding step is
launch-bound. Capture, scoring and replay keep the module, so scoring and replay stay one computation.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from longstraw.kernels.optional_import import optional_function

ONE_PLUS_WEIGHT = frozenset({"Qwen3NextRMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm"})


# fla's `rms_norm` (x, weight, bias, residual, eps), or None when fla does not import
_load_fla_rms_norm = functools.partial(optional_function, "fla.modules.norm.layernorm", "rms_norm")
# the Llama-form norm in one launch (`rms_norm_triton`) and its applicability test, or None without Triton
_load_rows_norm = functools.partial(optional_function, "longstraw.kernels.rms_norm_triton", "rms_norm_rows")
# the HF RMSNorm classes that compute weight * (x / rms(x)).to(x.dtype)
ROUNDED_THEN_WEIGHTED = frozenset({"LlamaRMSNorm", "Qwen3RMSNorm", "Glm4MoeRMSNorm"})
_DECODING: ContextVar[bool] = ContextVar("decoding_norms", default=False)


@contextmanager
def decoding_norms():
    """Within the block, graph-free norms of the Llama-form classes run in one launch where they apply."""
    token = _DECODING.set(True)
    try:
        yield
    finally:
        _DECODING.reset(token)


def _rows_usable(module, x: torch.Tensor) -> bool:
    """Inside `decoding_norms`, graph-free, a `ROUNDED_THEN_WEIGHTED` module, x and its weight of one 16- or 32-bit
    dtype, rows contiguous (and on CUDA, Triton)."""
    return (
        _DECODING.get()
        and not torch.is_grad_enabled()
        and type(module).__name__ in ROUNDED_THEN_WEIGHTED
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and module.weight.dtype == x.dtype
        and x.is_contiguous()
        and (not x.is_cuda or _load_rows_norm() is not None)
    )


def _decoding_rows_norm(module, x: torch.Tensor, residual: torch.Tensor | None = None):
    """`rms_norm_triton` on CUDA; off it, HF's formula with torch's own rms_norm for its float32 middle (one op where
    the module dispatches six: a CPU decoding step is dispatch-bound). The same roundings as the module."""
    if x.is_cuda:
        return _load_rows_norm()(x, module.weight, module.variance_epsilon, residual=residual)
    total = x if residual is None else residual + x
    rows = total if total.dtype == torch.float32 else total.float()
    normed = F.rms_norm(rows, rows.shape[-1:], eps=module.variance_epsilon)
    normed = module.weight * (normed if normed.dtype == x.dtype else normed.to(x.dtype))
    return normed if residual is None else (normed, total)


def foldable_norm(module, x: torch.Tensor) -> bool:
    """Whether `module(x)` is w * x * rsqrt(mean(x^2) + eps) up to roundings (a `ROUNDED_THEN_WEIGHTED` class) with w
    in x's dtype, not float16 (the projection of the un-normed rows could pass its range where the normed rows' does
    not): its weight can fold into the projection that reads it (`families.folded_norms`)."""
    return (
        type(module).__name__ in ROUNDED_THEN_WEIGHTED and module.weight.dtype == x.dtype and x.dtype != torch.float16
    )


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) of x's rows ([..., 1]), in float32 or x's wider dtype: a Llama-form norm's row scale as
    HF computes it (the torch reference of `rms_norm_triton.row_rms_scale`)."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)


def one_plus_weight(module) -> torch.Tensor:
    """The w of y = w x / rms(x) for a module of `ONE_PLUS_WEIGHT`: 1 + its weight, in float32 (differentiable)."""
    return 1.0 + module.weight.float()


def _fla_usable(module, x: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.numel() > 0
        and type(module).__name__ in ONE_PLUS_WEIGHT
        and torch.float64 not in (x.dtype, module.weight.dtype)
        and _load_fla_rms_norm() is not None
    )


def rms_norm(module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for an HF RMSNorm `module` over x's last dimension, in x's dtype, differentiable in x and the
    weight: fla's fused kernel on CUDA for a class of `ONE_PLUS_WEIGHT`, the module itself otherwise."""
    if _rows_usable(module, x):
        return _decoding_rows_norm(module, x)
    return _fla_rms_norm(module, x) if _fla_usable(module, x) else module(x)


def _fla_rms_norm(module, x: torch.Tensor) -> torch.Tensor:
    return _load_fla_rms_norm()(x, one_plus_weight(module), None, eps=module.eps)


def add_rms_norm(module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`rms_norm(module, residual + x)`, residual + x), differentiable in both: a pre-norm block's residual sum and
    the next norm. Where `rms_norm` runs fla's kernel, the sum runs inside it (fla's `prenorm`: one pass reads x and
    the residual and writes the norm and the sum, rounded to the residual's dtype; backward, the norm's input
    gradient and the sum's arrive in one kernel), and the norm reads the float32 sum, HF's module the rounded one:
    the two differ within the dtype's rounding. Otherwise the sum, then `rms_norm`."""
    if _rows_usable(module, x) and residual.dtype == x.dtype:
        return _decoding_rows_norm(module, x, residual)
    if not _fla_usable(module, x) or x.dtype != residual.dtype:
        total = residual + x
        return rms_norm(module, total), total
    return _load_fla_rms_norm()(x, one_plus_weight(module), None, residual=residual, eps=module.eps, prenorm=True)


def _fused_forward(module, x: torch.Tensor) -> torch.Tensor:
    """`rms_norm` as a module's own forward: the class's forward (not `module(x)`, the swapped one) otherwise."""
    return _fla_rms_norm(module, x) if _fla_usable(module, x) else type(module).forward(module, x)


@contextmanager
def fused_norms_selected(modules):
    """Within the block, each of `modules` of a `ONE_PLUS_WEIGHT` class computes as `rms_norm` does when called (an
    instance forward, removed on exit): HF's attention modules call their q and k norms themselves, each a float32
    chain of six launches each way (hybrid-1b on the H200: the members 0.072 -> 0.069-0.071 s, the graph's peak 8.60
    -> 8.56 GB). Other classes are left as they are."""
    swapped = [m for m in modules if type(m).__name__ in ONE_PLUS_WEIGHT and "forward" not in vars(m)]
    try:
        for m in swapped:
            m.forward = functools.partial(_fused_forward, m)
        yield
    finally:
        for m in swapped:
            del m.forward
