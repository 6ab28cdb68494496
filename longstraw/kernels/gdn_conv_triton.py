"""A Gated DeltaNet layer's causal conv as Triton kernels (CUDA): capture's fused forward, replay's input gradient.

    q_BTHD, k_BTHD, v_BTHV = conv_split_normalized_triton(x_BTC, state_BCK1, weight_CK, bias_C, key_dim, head_dim)
    dx_BTC = conv_input_grad_triton(x_BTC, state_BCK1, weight_CK, bias_C, dy_BTC, silu)

The layer's projection makes q, k and v side by side in one [B, T, C] tensor; fla's rule reads each as a tensor of
its own, so the plain path (`longstraw.kernels.causal_conv.conv_split_heads` off CUDA) runs the conv, copies the
three slices out (strided reads: 8 ms of a 32,768-row hybrid-1b capture) and normalises q and k in two more passes.
`conv_split_normalized_triton` is one launch: each program convolves one head's channels over a block of rows in
float32 (the state's columns before the first row), applies SiLU, normalises the row over the head if it is a q or
k head, rounds once and writes it to q, k or v, each a contiguous tensor. Only the forward exists: capture runs it
without grad.

`conv_input_grad_triton` is the conv's backward for x alone (replay: the filters are frozen and the captured state
needs no gradient). fla's backward recomputes the conv in a pass of its own and reduces the filters', the bias's
and the state's gradients besides; here each program recomputes the K pre-activations its rows' gradient reads and
writes dx, one pass over x and dy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longstraw.kernels.gdn import L2NORM_EPS


@triton.jit
def _pre_activation(
    x_ptr,
    state_ptr,
    w_ptr,
    b_ptr,
    i_b,
    first,
    rows,
    channels,
    T,
    C: tl.constexpr,
    K: tl.constexpr,
    HAS_STATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BT: tl.constexpr,
    D: tl.constexpr,
):
    """float32 [BT, D]: the conv (and bias) at `rows` (the first of them `first`) and `channels`; rows at or past
    T read as zeros. Before row 0 it reads the state's columns, the oldest first."""
    acc = tl.zeros((BT, D), dtype=tl.float32)
    for j in tl.static_range(K):  # tap j reads the input K - 1 - j rows back
        src = rows - (K - 1) + j
        xv = tl.load(
            x_ptr + (i_b * T + src[:, None]) * C + channels[None, :], mask=((src >= 0) & (src < T))[:, None], other=0.0
        ).to(tl.float32)
        if HAS_STATE:
            if first < K - 1:
                sv = tl.load(
                    state_ptr + (i_b * C + channels[None, :]) * (K - 1) + (src + (K - 1))[:, None],
                    mask=((src < 0) & (rows < T))[:, None],
                    other=0.0,
                )
                xv += sv.to(tl.float32)
        acc += xv * tl.load(w_ptr + channels * K + j).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + channels).to(tl.float32)[None, :]
    return acc


@triton.jit
def _store_rows(out_ptr, values, i_b, rows, columns, T, WIDTH: tl.constexpr):
    tl.store(
        out_ptr + (i_b * T + rows[:, None]) * WIDTH + columns[None, :],
        values.to(out_ptr.dtype.element_ty),
        mask=(rows < T)[:, None],
    )


# rows per program and warps, tuned per shape on the first call (as fla tunes its conv)
@triton.autotune(
    configs=[triton.Config({"BT": bt}, num_warps=w) for bt in (32, 64, 128) for w in (4, 8)],
    key=["C", "KEY_DIM", "D", "K"],
)
@triton.jit
def _conv_split_normalized_kernel(
    x_ptr,
    state_ptr,
    w_ptr,
    b_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    T,
    C: tl.constexpr,
    KEY_DIM: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    HAS_STATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    EPS: tl.constexpr,
    BT: tl.constexpr,
):
    """Head `program_id(0)` (q's heads, then k's, then v's) over BT rows of one sequence, into q, k or v. The head
    is the fastest index, so the programs running together read whole rows of x (with the row block first they
    read 256 bytes of each of thousands of rows at once, and the kernel moved half of fla's conv's bytes per
    second). Row strides are constexpr, so loads and stores vectorise."""
    i_h, i_t, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    rows = i_t * BT + tl.arange(0, BT)
    channels = i_h * D + tl.arange(0, D)
    acc = _pre_activation(
        x_ptr, state_ptr, w_ptr, b_ptr, i_b, i_t * BT, rows, channels, T, C, K, HAS_STATE, HAS_BIAS, BT, D
    )
    if SILU:
        acc = acc * tl.sigmoid(acc)
    columns = tl.arange(0, D)
    if i_h * D < 2 * KEY_DIM:  # q and k: each row of the head divided by its l2 norm, as fla's l2 norm
        acc = acc * (1 / tl.sqrt(tl.sum(acc * acc, axis=1) + EPS))[:, None]
        if i_h * D < KEY_DIM:
            _store_rows(q_ptr, acc, i_b, rows, i_h * D + columns, T, KEY_DIM)
        else:
            _store_rows(k_ptr, acc, i_b, rows, i_h * D - KEY_DIM + columns, T, KEY_DIM)
    else:
        _store_rows(v_ptr, acc, i_b, rows, i_h * D - 2 * KEY_DIM + columns, T, C - 2 * KEY_DIM)


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
    causal conv of `x_BTC` continuing from `state_BCK1` (SiLU if `silu`), in x's dtype, contiguous: one launch."""
    B, T, C = x_BTC.shape
    K = weight_CK.shape[1]
    if head_dim & (head_dim - 1) or key_dim % head_dim or (C - 2 * key_dim) % head_dim:
        raise ValueError(f"the fused conv needs a power-of-two head dim dividing q/k/v's widths, got {head_dim}")
    x_BTC, weight_CK = x_BTC.contiguous(), weight_CK.contiguous()
    state = None if state_BCK1 is None else state_BCK1.to(x_BTC.dtype).contiguous()
    q, k, v = (
        torch.empty(B, T, width // head_dim, head_dim, dtype=x_BTC.dtype, device=x_BTC.device)
        for width in (key_dim, key_dim, C - 2 * key_dim)
    )
    if T:
        grid = lambda meta: (C // head_dim, triton.cdiv(T, meta["BT"]), B)  # noqa: E731
        _conv_split_normalized_kernel[grid](
            x_BTC,
            state,
            weight_CK,
            bias_C,
            q,
            k,
            v,
            T,
            C=C,
            KEY_DIM=key_dim,
            K=K,
            D=head_dim,
            HAS_STATE=state is not None,
            HAS_BIAS=bias_C is not None,
            SILU=silu,
            EPS=L2NORM_EPS,
        )
    return q, k, v


@triton.autotune(
    configs=[triton.Config({"BT": bt, "BD": bd}, num_warps=w) for bt in (32, 64) for bd in (64, 128) for w in (4, 8)],
    key=["C", "K"],
)
@triton.jit
def _conv_input_grad_kernel(
    x_ptr,
    state_ptr,
    w_ptr,
    b_ptr,
    dy_ptr,
    dx_ptr,
    T,
    C: tl.constexpr,
    K: tl.constexpr,
    HAS_STATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    """dx over BD channels and BT rows: row t feeds outputs t .. t + K - 1 (tap K - 1 - m for output t + m), so
    dx[t] = sum_m w[K - 1 - m] * dpre[t + m], dpre = dy times SiLU's derivative at the recomputed pre-activation."""
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    rows = i_t * BT + tl.arange(0, BT)
    channels = i_d * BD + tl.arange(0, BD)
    dx = tl.zeros((BT, BD), dtype=tl.float32)
    for m in tl.static_range(K):
        out_rows = rows + m
        dpre = tl.load(
            dy_ptr + (i_b * T + out_rows[:, None]) * C + channels[None, :], mask=(out_rows < T)[:, None], other=0.0
        ).to(tl.float32)
        if SILU:
            pre = _pre_activation(
                x_ptr,
                state_ptr,
                w_ptr,
                b_ptr,
                i_b,
                i_t * BT + m,
                out_rows,
                channels,
                T,
                C,
                K,
                HAS_STATE,
                HAS_BIAS,
                BT,
                BD,
            )
            gate = tl.sigmoid(pre)
            dpre = dpre * gate * (1 + pre * (1 - gate))
        dx += dpre * tl.load(w_ptr + channels * K + (K - 1 - m)).to(tl.float32)[None, :]
    _store_rows(dx_ptr, dx, i_b, rows, channels, T, C)


def conv_input_grad_triton(
    x_BTC: torch.Tensor,
    state_BCK1: torch.Tensor | None,
    weight_CK: torch.Tensor,
    bias_C: torch.Tensor | None,
    dy_BTC: torch.Tensor,
    silu: bool,
) -> torch.Tensor:
    """The gradient of the causal conv's output (SiLU'd if `silu`) with respect to its input `x_BTC`, for the
    output's gradient `dy_BTC`: float32 sums, rounded once to x's dtype."""
    B, T, C = x_BTC.shape
    K = weight_CK.shape[1]
    if C % 64:
        raise ValueError(f"the conv's input-gradient kernel needs channels in multiples of 64, got {C}")
    x_BTC, dy_BTC, weight_CK = x_BTC.contiguous(), dy_BTC.contiguous(), weight_CK.contiguous()
    state = None if state_BCK1 is None else state_BCK1.to(x_BTC.dtype).contiguous()
    dx = torch.empty_like(x_BTC)
    if T:
        grid = lambda meta: (triton.cdiv(C, meta["BD"]), triton.cdiv(T, meta["BT"]), B)  # noqa: E731
        _conv_input_grad_kernel[grid](
            x_BTC,
            state,
            weight_CK,
            bias_C,
            dy_BTC,
            dx,
            T,
            C=C,
            K=K,
            HAS_STATE=state is not None,
            HAS_BIAS=bias_C is not None,
            SILU=silu,
        )
    return dx
