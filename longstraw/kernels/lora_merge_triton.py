"""A LoRA layer's merged weight W + scaling B A in one pass (Triton, CUDA): what a capture multiplies its rows by.

    merged = merge_lora_triton(weight, lora_A, lora_B, scaling)    # [out, in], weight's dtype

`torch.addmm(W, B, A, alpha=scaling)` copies W into a new output and then runs the GEMM with beta = 1, which reads
the copy back and writes it again: four passes over the [out, in] weight where one read and one write would do
(hybrid-1b's capture merges 76 weights; with the MLP's residual copies, since gone too, an H100's capture ran 107
device-to-device copies, 2.07 ms, and after both changes 16, 0.07 ms: `hybrid_step_profile_*.json`; this kernel
0.71 ms there). Here each program reads a tile of W, the tile's rows of B and columns of A, and writes the tile of the
sum once: B A accumulated in float32 over the rank, the scaled sum with W in float32 and rounded once, as the GEMM
computes it. The reference is `lora_linear.merged_lora_weight`'s addmm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# a [64, 64] tile a program, 4 warps: the pass is bytes, and the rank's product (at most 64 wide here) is small
BLOCK, WARPS = 64, 4
MAX_RANK = 64  # wider adapters keep the addmm: one program's B and A tiles stay in registers up to here


@triton.jit
def _merge_kernel(w_ptr, b_ptr, a_ptr, out_ptr, OUT, IN, RANK, scaling, BLOCK: tl.constexpr, RANK_BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ranks = tl.arange(0, RANK_BLOCK)  # the rank padded to a dot's width with zeros
    in_rows, in_cols, in_ranks = rows < OUT, cols < IN, ranks < RANK
    b = tl.load(b_ptr + rows[:, None] * RANK + ranks[None, :], mask=in_rows[:, None] & in_ranks[None, :], other=0.0)
    a = tl.load(a_ptr + ranks[:, None] * IN + cols[None, :], mask=in_ranks[:, None] & in_cols[None, :], other=0.0)
    at = rows[:, None].to(tl.int64) * IN + cols[None, :]  # int64: a weight may pass 2**31 elements
    inside = in_rows[:, None] & in_cols[None, :]
    w = tl.load(w_ptr + at, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, (w + scaling * tl.dot(b, a)).to(out_ptr.dtype.element_ty), mask=inside)


def merge_usable(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> bool:
    """Whether `merge_lora_triton` computes this merge: CUDA, one 16-bit dtype (a dot of exact products), a rank up
    to MAX_RANK."""
    return (
        weight.is_cuda
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == lora_A.dtype == lora_B.dtype
        and lora_A.shape[0] <= MAX_RANK
    )


def merge_lora_triton(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """weight [out, in] + scaling * lora_B [out, r] @ lora_A [r, in], in weight's dtype (one rounding)."""
    (out_features, in_features), rank = weight.shape, lora_A.shape[0]
    if lora_A.shape != (rank, in_features) or lora_B.shape != (out_features, rank):
        raise ValueError(
            f"lora_A {tuple(lora_A.shape)} and lora_B {tuple(lora_B.shape)} do not fit a weight {tuple(weight.shape)}"
        )
    weight, lora_A, lora_B = weight.contiguous(), lora_A.contiguous(), lora_B.contiguous()
    merged = torch.empty_like(weight)
    grid = (triton.cdiv(out_features, BLOCK), triton.cdiv(in_features, BLOCK))
    rank_block = max(16, triton.next_power_of_2(rank))
    _merge_kernel[grid](
        weight, lora_B, lora_A, merged, out_features, in_features, rank, float(scaling),
        BLOCK=BLOCK, RANK_BLOCK=rank_block, num_warps=WARPS,
    )  # fmt: skip
    return merged
