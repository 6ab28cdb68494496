"""The DSA indexer's scores in one Triton kernel (CUDA, bfloat16 queries and keys).

    scores_TN = fused_index_scores(q_THI, w_TH, k_NI)    # sum_h w[t, h] * relu(q[t, h] . k[n]), float32

Each program scores a [BLOCK_T, BLOCK_N] tile: the tile's keys are loaded once, then for every head
one bf16 dot with float32 accumulation (bfloat16 products are exact in float32), a ReLU and the
head's weight are folded into a float32 accumulator. So the [T, H, N] per-head scores never reach
memory: the plain per-head loop (`longstraw.kernels.dsa_topk.block_scores` off CUDA) moves them 6 times. `w`
carries the softmax scale (it is positive, so it commutes with the ReLU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, k_ptr, out_ptr, T, N, H: tl.constexpr, I: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr
):
    pid_t, pid_n = tl.program_id(0), tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_i = tl.arange(0, I)
    keys_IN = tl.load(k_ptr + offs_n[None, :] * I + offs_i[:, None], mask=offs_n[None, :] < N, other=0.0)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for h in range(H):
        q_TI = tl.load(q_ptr + (offs_t[:, None] * H + h) * I + offs_i[None, :], mask=offs_t[:, None] < T, other=0.0)
        w_T = tl.load(w_ptr + offs_t * H + h, mask=offs_t < T, other=0.0)
        s = tl.dot(q_TI, keys_IN)
        acc += tl.maximum(s, 0.0) * w_T[:, None]
    tl.store(out_ptr + offs_t[:, None] * N + offs_n[None, :], acc, mask=(offs_t[:, None] < T) & (offs_n[None, :] < N))


def fused_index_scores(q_THI: torch.Tensor, w_TH: torch.Tensor, k_NI: torch.Tensor) -> torch.Tensor:
    """float32 [T, N]: sum_h w[t, h] * relu(q[t, h] . k[n]) (q, k bfloat16 on CUDA; w float32)."""
    T, H, I = q_THI.shape
    N = k_NI.shape[0]
    if I & (I - 1) or I < 16:
        raise ValueError(f"the fused indexer kernel needs a power-of-two index_head_dim >= 16, got {I}")
    q_THI, k_NI, w_TH = q_THI.contiguous(), k_NI.contiguous(), w_TH.float().contiguous()
    out_TN = torch.empty(T, N, dtype=torch.float32, device=q_THI.device)
    if T == 0 or N == 0:
        return out_TN
    BLOCK_T, BLOCK_N = 64, 128
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(N, BLOCK_N))
    _index_scores_kernel[grid](
        q_THI, w_TH, k_NI, out_TN, T, N, H=H, I=I, BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, num_warps=4, num_stages=2
    )
    return out_TN
