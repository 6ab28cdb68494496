"""A decoding step's projections as Triton kernels for a few rows (CUDA): x W^T, the residual's sum, and the folded
SwiGLU, each one launch spread over the output's columns.

    out = rows_linear_triton(x_MK, w_NK)                          # x W^T
    rows_linear_triton(x_MK, w_NK, residual=h_MN)                 # h + x W^T, into h's storage (returned)
    out = rows_swiglu_triton(x_MK, w_gate_up_2NK, eps)            # silu(r x Wg^T) * (r x Wu^T), r = rms scale of x

A decoding step multiplies its G rows (8 in the trainer) by each projection: M = 8 against SmolLM2's 576-wide
weights. cuBLAS's kernels for that shape (nvjet 64x8 tiles on an H100) give each program 64 output columns, so q/k/v
(960 columns) runs on 15 of 132 SMs and o_proj and down_proj (576) on 9, each streaming its 74-197 KB of weights:
3.7-4.0 us a GEMM (recorded: `experiments/recorded/h100-benchmarks/rollout_*_eabc587-two-launches-default.json`),
120 of them the half of a 1.08 ms step. Here a program takes 16 columns (`BLOCKS`), so the same GEMMs spread over
36-96 programs: the rows (padded to 16, the dot's least; the padding is masked, never read) times the weights'
columns in K-blocks, accumulated in float32 (tl.dot) and rounded once, as cuBLAS rounds. With `residual` the sum
is taken in float32 before that rounding (cuBLAS's beta = 1: `swiglu.add_linear_`), in the residual's storage; each
program reads and writes only its own columns. `rows_swiglu_triton` is the gated MLP's stacked gate/up projection
with the post-attention norm folded in (`families.folded_norms`): each program takes its gate columns and the
matching up columns, the rows' rsqrt(mean(x^2) + eps) from the same x it multiplies, and writes
silu(r gate) * (r up), where the cuBLAS path rounds gate and up to the dtype first and scales them in a second
launch (`swiglu_triton.swiglu_stacked_scaled_triton`).

The plain references are `decode_linear`'s "cublas" paths (torch's GEMMs, then `swiglu.swiglu_rms_scaled`). Float32
inputs multiply in IEEE float32 (not TF32), so a float32 model's step is comparable with the reference's. Speed is
measured on the GPU (`benchmarks/decode_linear_rate.py`, against cuBLAS per shape, and `rollout_speed.py
--decode-linear triton`); the configuration is one fixed shape (no first-call tuning inside a graph's recording).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from longstraw.kernels.dependent_launch import launches_dependent


class Blocks(NamedTuple):
    """A launch's shape: output columns and K-block a program, warps, pipeline stages."""

    n: int = 16
    k: int = 256
    warps: int = 4
    stages: int = 3


BLOCKS = Blocks()  # the one the decoding step launches (`benchmarks/decode_linear_rate.py --sweep` tries others)
MAX_ROWS = 64  # a program's rows (padded to a power of two of at least 16); more rows: cuBLAS's tiles do well


@triton.jit
def _rows_linear_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, eps,
    RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Columns [BN program, BN (program + 1)) of x W^T (M x K times N x K), or with SWIGLU of silu(r x Wg^T) *
    (r x Wu^T) where Wg is w's first N rows and Wu its next N."""
    if PDL:  # started while the kernel before it ran: x (and the residual) are its output
        gdc_wait()
    rows = tl.arange(0, BM)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    row_in, col_in = rows < M, cols < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    squares = tl.zeros((BM,), dtype=tl.float32)
    for start in range(0, K, BK):
        ks = start + tl.arange(0, BK)
        k_in = ks < K
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=col_in[:, None] & k_in[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if SWIGLU:
            w_up = tl.load(
                w_ptr + (cols[:, None] + N) * K + ks[None, :], mask=col_in[:, None] & k_in[None, :], other=0.0
            )
            up = tl.dot(x, tl.trans(w_up), up, input_precision=PRECISION)
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, 1)
    at = rows[:, None] * N + cols[None, :]
    inside = row_in[:, None] & col_in[None, :]
    if SWIGLU:
        scale = tl.rsqrt(squares / K + eps)[:, None]
        gate = acc * scale
        acc = gate * tl.sigmoid(gate) * (up * scale)
    elif RESIDUAL:  # the sum before the one rounding, as cuBLAS's beta = 1
        acc += tl.load(out_ptr + at, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=inside)


def rows_linear_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether these kernels take x [..., K] times weight [N, K]: CUDA, a 16-bit or float32 dtype shared by both, a
    contiguous weight, at most MAX_ROWS rows."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and weight.dim() == 2
        and weight.shape[1] == x.shape[-1]
        and 0 < rows <= MAX_ROWS
    )


def _launch(x_MK, weight, out, N, eps, residual, swiglu, dependent, blocks: Blocks):
    M, K = x_MK.shape
    pdl = launches_dependent(x_MK.device, dependent)
    _rows_linear_kernel[(triton.cdiv(N, blocks.n),)](
        x_MK, weight, out, M, N, K, float(eps),
        RESIDUAL=residual, SWIGLU=swiglu, PRECISION="ieee" if x_MK.dtype == torch.float32 else "tf32",
        BM=max(16, triton.next_power_of_2(M)), BN=blocks.n, BK=blocks.k, PDL=pdl,
        num_warps=blocks.warps, num_stages=blocks.stages, launch_pdl=pdl,
    )  # fmt: skip


def rows_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None, dependent=None, blocks=BLOCKS
) -> torch.Tensor:
    """x [..., K] W^T for weight [N, K] (`rows_linear_usable`), in x's dtype; with `residual` [..., N] (contiguous)
    residual + x W^T written into the residual's storage and returned. One launch, dependent (None: as
    `dependent_launch.decode_launches` has it) where the device has it."""
    N = weight.shape[0]
    x_MK = x.reshape(-1, x.shape[-1]).contiguous()
    if residual is not None:
        if not residual.is_contiguous() or residual.shape[-1] != N or residual.numel() != x_MK.shape[0] * N:
            raise ValueError(f"rows_linear: residual {tuple(residual.shape)} is not x's rows by {N}, contiguous")
        out = residual
    else:
        out = x.new_empty(*x.shape[:-1], N)
    _launch(x_MK, weight, out, N, 0.0, residual is not None, False, dependent, blocks)
    return out


def rows_swiglu_triton(
    x: torch.Tensor, gate_up: torch.Tensor, eps: float, dependent=None, blocks=BLOCKS
) -> torch.Tensor:
    """silu(r x Wg^T) * (r x Wu^T) [..., N] for the stacked gate_up [2 N, K] (gate's N rows, then up's) with a Llama
    RMSNorm's weight folded in, r = rsqrt(mean(x^2) + eps) of x's row in float32: one launch, rounded once."""
    N = gate_up.shape[0] // 2
    x_MK = x.reshape(-1, x.shape[-1]).contiguous()
    out = x.new_empty(*x.shape[:-1], N)
    _launch(x_MK, gate_up, out, N, eps, False, True, dependent, blocks)
    return out
