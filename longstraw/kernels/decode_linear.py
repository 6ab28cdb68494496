"""A folded decoding step's four projections (`families.folded_norms`): cuBLAS's GEMMs, or Triton kernels spread
over the output's columns (`decode_linear_triton`).

    rows_linear(x, w)                 # x W^T
    add_rows_linear_(h, x, w)         # h + x W^T into h's storage (the residual sums of o_proj and down_proj)
    rows_swiglu(x, gate_up, eps)      # the folded gated MLP's product: silu(r gate) * (r up)

"cublas" (the default, and the reference) is torch's GEMMs and `swiglu.swiglu_rms_scaled`, as the step ran before;
"triton" launches `decode_linear_triton`'s kernels where they apply (`rows_linear_usable`: CUDA, at most 64 rows)
and falls back to the reference elsewhere. "cublas" stays the default until a GPU has measured "triton"
(`benchmarks/decode_linear_rate.py` per shape and `benchmarks/rollout_speed.py --decode-linear triton` for the
step, against cuBLAS on one card) and run its CUDA tests (tests/test_decode_cuda.py): written in a session whose
device starts were all refused, its arithmetic is checked by Triton's interpreter (tests/test_triton_interpreted.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from longstraw.kernels.optional_import import optional_function
from longstraw.kernels.process_setting import ProcessSetting
from longstraw.kernels.swiglu import add_linear_, swiglu_rms_scaled

_setting = ProcessSetting("decode linear", ("cublas", "triton"), "cublas")
_load = functools.partial(optional_function, "longstraw.kernels.decode_linear_triton")


def decode_linear(name: str):
    """Within the block a folded decoding step's projections run as `name`: "cublas" or "triton"."""
    return _setting.within(name)


def _triton(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if _setting.value != "triton" or not x.is_cuda:
        return False
    usable = _load("rows_linear_usable")
    return usable is not None and usable(x, weight)


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T (no bias), in x's dtype."""
    return _load("rows_linear_triton")(x, weight) if _triton(x, weight) else F.linear(x, weight)


def add_rows_linear_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """residual + x W^T into the residual's storage (returned), the sum rounded once. No autograd."""
    if _triton(x, weight) and residual.is_contiguous():
        return _load("rows_linear_triton")(x, weight, residual=residual)
    return add_linear_(residual, x, weight)


def rows_swiglu(x: torch.Tensor, gate_up: torch.Tensor, eps: float) -> torch.Tensor:
    """silu(r x Wg^T) * (r x Wu^T) for the stacked [gate; up] weight (an RMSNorm's weight folded in), r =
    rsqrt(mean(x^2) + eps) of x's row: the reference rounds the stacked projection to x's dtype, then scales."""
    if _triton(x, gate_up):
        return _load("rows_swiglu_triton")(x, gate_up, eps)
    return swiglu_rms_scaled(F.linear(x, gate_up), x, eps)
