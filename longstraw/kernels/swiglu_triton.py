"""A gated MLP's silu(gate) * up as Triton kernels over contiguous tensors (CUDA), forward and backward.

    out = SwiGLU.apply(gate, up)    # float32 inside, rounded once to gate's dtype; gradients in gate and up

The plain reference is HF's MLP (`longstraw.kernels.swiglu` runs it off CUDA). fla's `swiglu` computes the same in
one launch each way, but indexes every element as (row, column) through an int64 division by the row's width and
tunes 30 configurations on its first call; on the H200 its forward moved 2.7 TB/s (6.5 ms of a 32,768-row
hybrid-1b capture, 16 layers), where an elementwise pass over contiguous bf16 moves about 4.3 (the same capture's
residual adds). The projections hand over contiguous tensors, and these kernels read and write them as flat ranges
in one fixed configuration (16-byte vector loads and stores in the sm_90 build: `benchmarks/triton_build_report.py`;
the rate on the GPU: `benchmarks/swiglu_rate.py`).

`swiglu_stacked_scaled_triton` takes the stacked [gate | up] of un-normed rows x whose RMSNorm weight is folded into
the projection (`families.folded_norms`): a program per (row, block of columns) scales gate and up by the row's
rsqrt(mean(x^2) + eps) (`rms_norm_triton.row_rms_scale`) before silu(gate) * up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from longstraw.kernels.dependent_launch import launches_dependent
from longstraw.kernels.rms_norm_triton import row_rms_scale

# elements a program: at 8 warps 16 a thread, two 16-byte loads of each bf16 input. One fixed shape: no first-call
# tuning (a bare box's cold step pays every autotuned kernel's), and nothing to tune inside a CUDA graph's recording
BLOCK, WARPS = 4096, 8
# columns a program of the scaled kernel, whose rows are a decoding step's few: each program re-reads its row of x
SCALED_COLUMNS = 1024


@triton.jit
def _swiglu_forward_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: a 1M-row capture passes 2**31
    mask = offsets < n
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(gate_ptr, up_ptr, dout_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    dgate = dout * up * sigmoid * (1 + gate * (1 - sigmoid))  # d silu(g) / dg = s + g s (1 - s)
    tl.store(dgate_ptr + offsets, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offsets, (dout * gate * sigmoid).to(dup_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_stacked_kernel(gate_up_ptr, out_ptr, n, width, BLOCK: tl.constexpr):
    """Rows of [gate | up] (2 width each) in, rows of silu(gate) * up (width) out."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    at = (offsets // width) * 2 * width + offsets % width
    gate = tl.load(gate_up_ptr + at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + at + width, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_stacked_scaled_kernel(
    gate_up_ptr, x_ptr, out_ptr, width, X, eps, BLOCK: tl.constexpr, BX: tl.constexpr, PDL: tl.constexpr
):
    """Row r of [gate | up] (2 width) in, silu(s gate) * (s up) out (width), s the rms scale of row r of x (X)."""
    if PDL:  # started while the projection before it ran: gate_up is its output
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    scale = row_rms_scale(x_ptr + row * X, X, eps, BX)
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32) * scale
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32) * scale
    tl.store(out_ptr + row * width + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def swiglu_forward_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in gate's dtype: one launch over contiguous copies of both (the projections' outputs are)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must match")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    if gate.numel():
        _swiglu_forward_kernel[_grid(gate.numel())](gate, up, out, gate.numel(), BLOCK=BLOCK, num_warps=WARPS)
    return out


def swiglu_stacked_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from one stacked projection's output [..., 2 I] (gate then up on the last axis), graph-free:
    one launch and no copies of the two halves (a decoding step's `models.stacked_projections`)."""
    gate_up = gate_up.contiguous()
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    if out.numel():
        _swiglu_stacked_kernel[_grid(out.numel())](gate_up, out, out.numel(), width, BLOCK=BLOCK, num_warps=WARPS)
    return out


def swiglu_stacked_scaled_triton(gate_up: torch.Tensor, x: torch.Tensor, eps: float, dependent=None) -> torch.Tensor:
    """`swiglu_stacked_triton` of gate_up [..., 2 I] with gate and up first scaled by rsqrt(mean(x^2) + eps) of the
    matching row of x [..., X]: the projection ran on x with an RMSNorm's weight folded in. One launch, dependent
    (None: as `dependent_launch.decode_launches` has it) where the device has it."""
    gate_up, x = gate_up.contiguous(), x.contiguous()
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    rows = out.numel() // width if width else 0
    if rows:
        grid, X = (rows, triton.cdiv(width, SCALED_COLUMNS)), x.shape[-1]
        bx = triton.next_power_of_2(X)
        pdl = launches_dependent(gate_up.device, dependent)
        _swiglu_stacked_scaled_kernel[grid](
            gate_up, x, out, width, X, float(eps), BLOCK=SCALED_COLUMNS, BX=bx, PDL=pdl, launch_pdl=pdl
        )
    return out


def swiglu_backward_triton(gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(d gate, d up) of silu(gate) * up given its gradient `dout`: one launch, each in its input's dtype."""
    gate, up, dout = gate.contiguous(), up.contiguous(), dout.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    if gate.numel():
        _swiglu_backward_kernel[_grid(gate.numel())](
            gate, up, dout, dgate, dup, gate.numel(), BLOCK=BLOCK, num_warps=WARPS
        )
    return dgate, dup


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up, differentiable in both; saves its two inputs (as HF's MLP's autograd does)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_forward_triton(gate, up)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        return swiglu_backward_triton(*ctx.saved_tensors, dout)


swiglu = SwiGLU.apply
