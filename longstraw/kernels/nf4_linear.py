"""A frozen NF4 (bitsandbytes `Params4bit`) weight times many rows: dequantise once per call, then a plain
GEMM in the compute dtype, instead of bitsandbytes' fused 4-bit GEMM. Measured on the H200 (the 27B's MLP
shape, `experiments/recorded/h200-benchmarks/kernel_ceilings.json`): on 16,384 rows 780 TFLOP/s against
the fused kernel's 703; on 1,024 rows 407 against 447, so the crossover lies between and
`DEQUANTIZE_MIN_ROWS` is not yet set from it. The reference beside it is bitsandbytes' own
`matmul_4bit`, which `models.quant` keeps for few-row calls (decoding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEQUANTIZE_MIN_ROWS = 64  # below this, dequantising the whole weight costs more than the GEMM saves


class DequantizedMatmul(torch.autograd.Function):
    """x @ dequantise(W)^T + b for a frozen 4-bit weight; the backward dequantises W again (nothing
    weight-sized is kept between forward and backward) and returns grads for x and b only."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.weight = weight
        return F.linear(x, dequantize(weight, x.dtype), bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grad_x = grad_out @ dequantize(ctx.weight, grad_out.dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias


def dequantize(weight, dtype) -> torch.Tensor:
    """The [out, in] weight of a bitsandbytes `Params4bit` in `dtype`."""
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(weight.data, weight.quant_state).to(dtype)
