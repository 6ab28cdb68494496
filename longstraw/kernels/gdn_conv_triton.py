"""A Gated DeltaNet layer's conv, SiLU, q/k/v split and q/k l2 norm in one Triton kernel (CUDA, no autograd).

    q_BTHD, k_BTHD, v_BTHV = conv_split_normalized_triton(x_BTC, state_BCK1, weight_CK, bias_C, key_dim, head_dim)

The layer's projection makes q, k and v side by side in one [B, T, C] tensor; fla's rule reads each as a tensor of
its own, so the plain path (`longstraw.kernels.causal_conv.conv_split_heads` off CUDA) runs the conv, copies the
three slices out (strided reads: 8 ms of a 32,768-row hybrid-1b capture) and normalises q and k in two more passes.
Here each program convolves one head's channels over a block of rows in float32 (the state's columns before the
first row), applies SiLU, normalises the row over the head if it is a q or k head, rounds once and writes it to q, k
or v, each a contiguous tensor (one launch each). Only the forward exists: capture runs it without grad.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longstraw.kernels.gdn import L2NORM_EPS


# rows per program and warps, tuned per shape on the first call (as fla tunes its conv): at 4 warps and 64 rows the
# kernel moved 954 GB/s on the H200 (`benchmarks/gdn_conv_split.py`), fla's conv about 2.3 TB/s
@triton.autotune(
    configs=[triton.Config({"BT": bt}, num_warps=w) for bt in (32, 64, 128) for w in (4, 8, 16)],
    key=["C", "WIDTH", "D", "K"],
)
@triton.jit
def _conv_split_normalized_kernel(
    x_ptr,
    state_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    first_channel,
    T,
    C: tl.constexpr,
    WIDTH: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_STATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    EPS: tl.constexpr,
    BT: tl.constexpr,
):
    """One head (D channels from `first_channel` + program 1's index times D) over BT rows of one sequence, into
    `out` [B, T, WIDTH] at the head's columns. Row strides are constexpr, so loads and stores vectorise."""
    i_t, i_h, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = i_t * BT + tl.arange(0, BT)
    columns = i_h * D + tl.arange(0, D)
    channels = first_channel + columns
    in_rows = rows < T
    acc = tl.zeros((BT, D), dtype=tl.float32)
    for j in tl.static_range(K):  # tap j reads the input K - 1 - j rows back
        src = rows - (K - 1) + j
        from_x = in_rows & (src >= 0)
        xv = tl.load(x_ptr + (i_b * T + src[:, None]) * C + channels[None, :], mask=from_x[:, None], other=0.0)
        xv = xv.to(tl.float32)
        if HAS_STATE:  # rows before the first: the state's columns, the oldest first
            if i_t * BT < K - 1:
                from_state = in_rows & (src < 0)
                column = src + (K - 1)
                sv = tl.load(
                    state_ptr + (i_b * C + channels[None, :]) * (K - 1) + column[:, None],
                    mask=from_state[:, None],
                    other=0.0,
                )
                xv += sv.to(tl.float32)
        acc += xv * tl.load(w_ptr + channels * K + j).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + channels).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    if NORMALIZE:  # q and k: each row of the head divided by its l2 norm
        acc = acc * (1 / tl.sqrt(tl.sum(acc * acc, axis=1) + EPS))[:, None]  # as fla's l2 norm
    tl.store(
        out_ptr + (i_b * T + rows[:, None]) * WIDTH + columns[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=in_rows[:, None],
    )


def conv_split_normalized_triton(
    x_BTC: torch.Tensor,
    state_BCK1: torch.Tensor | None,
    weight_CK: torch.Tensor,
    bias_C: torch.Tensor | None,
    key_dim: int,
    head_dim: int,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [B, T, key_dim / head_dim, head_dim] and k, both l2-normalised per head, v [B, T, -, head_dim]) of the
    causal conv of `x_BTC` continuing from `state_BCK1` (SiLU if `silu`), in x's dtype, contiguous: one launch
    each."""
    B, T, C = x_BTC.shape
    K = weight_CK.shape[1]
    if head_dim & (head_dim - 1) or key_dim % head_dim or (C - 2 * key_dim) % head_dim:
        raise ValueError(f"the fused conv needs a power-of-two head dim dividing q/k/v's widths, got {head_dim}")
    x_BTC, weight_CK = x_BTC.contiguous(), weight_CK.contiguous()
    state = None if state_BCK1 is None else state_BCK1.to(x_BTC.dtype).contiguous()
    outputs = []
    for first, width, normalize in (
        (0, key_dim, True),
        (key_dim, key_dim, True),
        (2 * key_dim, C - 2 * key_dim, False),
    ):
        out = torch.empty(B, T, width // head_dim, head_dim, dtype=x_BTC.dtype, device=x_BTC.device)
        if T:
            grid = lambda meta, heads=width // head_dim: (triton.cdiv(T, meta["BT"]), heads, B)  # noqa: E731
            _conv_split_normalized_kernel[grid](
                x_BTC,
                state,
                weight_CK,
                bias_C,
                out,
                first,
                T,
                C=C,
                WIDTH=width,
                K=K,
                D=head_dim,
                NORMALIZE=normalize,
                HAS_STATE=state is not None,
                HAS_BIAS=bias_C is not None,
                SILU=silu,
                EPS=L2NORM_EPS,
            )
        outputs.append(out)
    return tuple(outputs)
