"""A Gated DeltaNet layer's causal conv, SiLU, q/k/v split and q/k l2 norm as Triton kernels (CUDA), forward and
backward in x.

    q_BTHD, k_BTHD, v_BTHV = ConvSplitNormalized.apply(x_BTC, state_BCK1, weight_CK, bias_C, key_dim, head_dim, silu)

The layer's projection makes q, k and v side by side in one [B, T, C] tensor; fla's rule reads each as a tensor of
its own, so the plain path (`longstraw.kernels.causal_conv.conv_split_heads` off CUDA) runs the conv, copies the
three slices out (strided reads: 8 ms of a 32,768-row hybrid-1b capture) and normalises q and k in two more passes,
each with a backward of its own under autograd. `conv_split_normalized_triton` is one launch: each program
convolves one head's channels over a block of rows in float32 (the state's columns before the first row), applies
SiLU, normalises the row over the head if it is a q or k head, rounds once and writes it to q, k or v, each a
contiguous tensor. `conv_split_normalized_backward_triton` is the gradient in x alone (the filters frozen, the state
a captured one: replay), two launches: one recomputes the pre-activations and norms as the forward does and takes
q's, k's and v's gradients back through the norm and SiLU into a float32 tensor, the other runs the taps' transpose
over it; fla's conv backward would also recompute the conv in a pass of its own and reduce the filters', the bias's
and the state's gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longstraw.kernels.gdn import L2NORM_EPS
from longstraw.kernels.tuning import log2_bucket


@triton.jit
def _row_block(ptr, i_b, first, column0, T, WIDTH: tl.constexpr, BT: tl.constexpr, D: tl.constexpr):
    """Pointers [BT, D] to rows `first` .. of a [B, T, WIDTH] tensor from column `column0`: one 64-bit address a
    program, the tile's offsets in 32 bits."""
    rows, columns = tl.arange(0, BT), tl.arange(0, D)
    return ptr + (i_b * T + first) * WIDTH + column0 + (rows[:, None] * WIDTH + columns[None, :])


@triton.jit
def _pre_activation(
    x_ptr,
    state_ptr,
    w_ptr,
    b_ptr,
    i_b,
    first,
    channel0,
    T,
    C: tl.constexpr,
    K: tl.constexpr,
    HAS_STATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BT: tl.constexpr,
    D: tl.constexpr,
):
    """float32 [BT, D]: the conv (and bias) at rows `first` .. `first + BT - 1` and channels `channel0` .. `channel0 +
    D - 1`; rows at or past T read as zeros. Before row 0 it reads the state's columns, the oldest first.

    Its bytes do not bind the conv (as fast on an H100 as on the H200); its instructions did, most of them 64-bit
    addresses and masks for every tap (`benchmarks/triton_build_report.py` lists them): one 64-bit address a program,
    the tile's offsets in 32 bits, and no masks where every tap's rows lie inside x, which is every block but the
    first and a partial last one (`benchmarks/gdn_conv_split.py` on an H100: the capture's call 0.91x the time, a
    replay's forward and backward 0.77x)."""
    rows = tl.arange(0, BT)
    columns = tl.arange(0, D)
    block = _row_block(x_ptr, i_b, first, channel0, T, C, BT, D)
    acc = tl.zeros((BT, D), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + channel0 + columns).to(tl.float32)[None, :]
    if (first >= K - 1) & (first + BT <= T):
        for j in tl.static_range(K):  # tap j reads the input K - 1 - j rows back
            xv = tl.load(block - (K - 1 - j) * C).to(tl.float32)
            acc += xv * tl.load(w_ptr + j * C + channel0 + columns).to(tl.float32)[None, :]
    else:
        for j in tl.static_range(K):
            src = first + rows - (K - 1) + j
            xv = tl.load(block - (K - 1 - j) * C, mask=((src >= 0) & (src < T))[:, None], other=0.0).to(tl.float32)
            if HAS_STATE:
                sv = tl.load(
                    state_ptr + (i_b * C + channel0 + columns[None, :]) * (K - 1) + (src + (K - 1))[:, None],
                    mask=((src < 0) & (src + (K - 1 - j) < T))[:, None],
                    other=0.0,
                )
                xv += sv.to(tl.float32)
            acc += xv * tl.load(w_ptr + j * C + channel0 + columns).to(tl.float32)[None, :]
    return acc


@triton.jit
def _exp_neg(y):
    """e^-y in float32 through `exp2`, which builds to the flush-to-zero ex2: `exp`'s build guards denormal results
    with a compare and two multiplies an element, about a fifth of the conv's when it took SiLU through it."""
    return tl.exp2(y * -1.4426950408889634)  # log2(e)


@triton.jit
def _sigmoid(y):
    """1 / (1 + e^-y) as the square of rsqrt's flush-to-zero build (a few EPS32 off, as the division's fast build
    is), without the division's range checks."""
    r = tl.math.rsqrt(1 + _exp_neg(y))
    return r * r


@triton.jit
def _silu(y):
    return y * _sigmoid(y)


@triton.jit
def _inverse_norm(y, EPS: tl.constexpr):
    """1 / |row| of each row of `y` (float32), as fla's l2 norm computes it: forward and backward read the same."""
    return 1 / tl.sqrt(tl.sum(y * y, axis=1) + EPS)


@triton.jit
def _store_rows(out_ptr, values, i_b, first, column0, T, WIDTH: tl.constexpr, BT: tl.constexpr, D: tl.constexpr):
    """`values` [BT, D] into rows `first` .. of a [B, T, WIDTH] tensor from column `column0`, rows at or past T
    left out (masked only in a partial last block)."""
    block = _row_block(out_ptr, i_b, first, column0, T, WIDTH, BT, D)
    values = values.to(out_ptr.dtype.element_ty)
    if first + BT <= T:
        tl.store(block, values)
    else:
        tl.store(block, values, mask=(first + tl.arange(0, BT) < T)[:, None])


@triton.jit
def _load_rows(ptr, i_b, first, column0, T, WIDTH: tl.constexpr, BT: tl.constexpr, D: tl.constexpr):
    """float32 [BT, D] of rows `first` .. of a [B, T, WIDTH] tensor from column `column0`, zeros at rows at or past
    T (masked only where the block reaches past T)."""
    block = _row_block(ptr, i_b, first, column0, T, WIDTH, BT, D)
    if first + BT <= T:
        values = tl.load(block)
    else:
        values = tl.load(block, mask=(first + tl.arange(0, BT) < T)[:, None], other=0.0)
    return values.to(tl.float32)


def _launch(x_BTC, state_BCK1, weight_CK, bias_C, key_dim: int, head_dim: int, silu: bool):
    """What the kernels take besides their outputs: x and the state (in x's dtype) contiguous, the filters tap by tap
    ([K, C]: a tap's weights for a program's channels are one contiguous run; from [C, K] rows the taps' transpose
    kernel loaded them as strided scalars: at 16 rows and 8 warps 8 of its 40 loads were 16-byte vectors in the sm_90
    build, 12 of 12 now), the grid (one program per head and block of rows) and the shape's constexprs."""
    B, T, C = x_BTC.shape
    state = None if state_BCK1 is None else state_BCK1.to(x_BTC.dtype).contiguous()
    shape = {
        "C": C,
        "KEY_DIM": key_dim,
        "K": weight_CK.shape[1],
        "D": head_dim,
        "HAS_STATE": state is not None,
        "HAS_BIAS": bias_C is not None,
        "SILU": silu,
        "EPS": L2NORM_EPS,
    }
    grid = lambda meta: (C // head_dim, triton.cdiv(T, meta["BT"]), B)  # noqa: E731
    return x_BTC.contiguous(), state, weight_CK.t().contiguous(), grid, shape


# rows per program and warps, tuned per shape on the first call (as fla tunes its conv); the sm_90 build at
# hybrid-1b's widths (`benchmarks/triton_build_report.py`, Triton 3.6 as on the H200 box) spills nothing but at 64
# rows with 4 warps (776 bytes; kilobytes at 128, dropped). With the unmasked taps' loads all issued at once, 16
# rows hold 98-128 registers and 32 hold 194-216: fewer programs an SM, for the autotuner to weigh
@triton.autotune(
    configs=[triton.Config({"BT": bt}, num_warps=w) for bt in (16, 32, 64) for w in (4, 8)],
    key=["C", "KEY_DIM", "D", "K", "ROWS_LOG2"],
)
@triton.jit(do_not_specialize=["ROWS_LOG2"])
def _conv_split_normalized_kernel(
    x_ptr,
    state_ptr,
    w_ptr,
    b_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    T,
    ROWS_LOG2,  # read by the autotuner only: `log2_bucket` of the rows
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
    is the fastest index, so the programs running together read whole rows of x, as fla's conv's do (with the row
    block fastest, an earlier order, they read 256 bytes of each of thousands of rows at once, and the kernel moved
    1,047 GB/s, under half of fla's conv's rate). Row strides are constexpr, so loads and stores vectorise."""
    i_h, i_b = tl.program_id(0), tl.program_id(2).to(tl.int64)
    first = tl.program_id(1).to(tl.int64) * BT
    acc = _pre_activation(x_ptr, state_ptr, w_ptr, b_ptr, i_b, first, i_h * D, T, C, K, HAS_STATE, HAS_BIAS, BT, D)
    if SILU:
        acc = _silu(acc)
    if i_h * D < 2 * KEY_DIM:  # q and k: each row of the head divided by its l2 norm, as fla's l2 norm
        acc = acc * _inverse_norm(acc, EPS)[:, None]
        if i_h * D < KEY_DIM:
            _store_rows(q_ptr, acc, i_b, first, i_h * D, T, KEY_DIM, BT, D)
        else:
            _store_rows(k_ptr, acc, i_b, first, i_h * D - KEY_DIM, T, KEY_DIM, BT, D)
    else:
        _store_rows(v_ptr, acc, i_b, first, i_h * D - 2 * KEY_DIM, T, C - 2 * KEY_DIM, BT, D)


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
    if head_dim & (head_dim - 1) or key_dim % head_dim or (C - 2 * key_dim) % head_dim:
        raise ValueError(f"the fused conv needs a power-of-two head dim dividing q/k/v's widths, got {head_dim}")
    q, k, v = (
        torch.empty(B, T, width // head_dim, head_dim, dtype=x_BTC.dtype, device=x_BTC.device)
        for width in (key_dim, key_dim, C - 2 * key_dim)
    )
    if T:
        x_BTC, state, weight_KC, grid, shape = _launch(x_BTC, state_BCK1, weight_CK, bias_C, key_dim, head_dim, silu)
        _conv_split_normalized_kernel[grid](x_BTC, state, weight_KC, bias_C, q, k, v, T, log2_bucket(T), **shape)
    return q, k, v


@triton.jit
def _silu_grad(dy, pre, SILU: tl.constexpr):
    """The gradient at the pre-activation `pre` from the gradient `dy` of SiLU(pre) (of pre itself without SiLU)."""
    if SILU:
        gate = _sigmoid(pre)
        dy = dy * gate * (1 + pre * (1 - gate))
    return dy


# the pre-activations' gradient holds one tile and one loaded gradient more than the forward: tuned as the forward is
@triton.autotune(
    configs=[triton.Config({"BT": bt}, num_warps=w) for bt in (16, 32) for w in (4, 8)],
    key=["C", "KEY_DIM", "D", "K", "ROWS_LOG2"],
)
@triton.jit(do_not_specialize=["ROWS_LOG2"])
def _pre_activation_gradient_kernel(
    x_ptr,
    state_ptr,
    w_ptr,
    b_ptr,
    dq_ptr,
    dk_ptr,
    dv_ptr,
    dpre_ptr,
    T,
    ROWS_LOG2,  # read by the autotuner only: `log2_bucket` of the rows
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
    """float32 gradient at the conv's output (before SiLU) of head `program_id(0)` over BT rows: the pre-activation
    and (q and k) the row's norm recomputed as the forward computes them, the output's gradient taken back through
    the norm (dy = (dn - n (n . dn)) / |y|) and SiLU. The forward's grid and row order."""
    i_h, i_b = tl.program_id(0), tl.program_id(2).to(tl.int64)
    first = tl.program_id(1).to(tl.int64) * BT
    pre = _pre_activation(x_ptr, state_ptr, w_ptr, b_ptr, i_b, first, i_h * D, T, C, K, HAS_STATE, HAS_BIAS, BT, D)
    if i_h * D < 2 * KEY_DIM:
        if i_h * D < KEY_DIM:
            dn = _load_rows(dq_ptr, i_b, first, i_h * D, T, KEY_DIM, BT, D)
        else:
            dn = _load_rows(dk_ptr, i_b, first, i_h * D - KEY_DIM, T, KEY_DIM, BT, D)
        y = pre
        if SILU:
            y = _silu(pre)
        inverse = _inverse_norm(y, EPS)
        n = y * inverse[:, None]
        dy = (dn - n * tl.sum(n * dn, axis=1)[:, None]) * inverse[:, None]
    else:
        dy = _load_rows(dv_ptr, i_b, first, i_h * D - 2 * KEY_DIM, T, C - 2 * KEY_DIM, BT, D)
    _store_rows(dpre_ptr, _silu_grad(dy, pre, SILU), i_b, first, i_h * D, T, C, BT, D)


@triton.autotune(
    configs=[triton.Config({"BT": bt}, num_warps=w) for bt, w in ((16, 4), (16, 8), (32, 8), (64, 8))],
    key=["C", "D", "K", "ROWS_LOG2"],
)
@triton.jit(do_not_specialize=["ROWS_LOG2"])
def _conv_input_gradient_kernel(
    dpre_ptr, w_ptr, dx_ptr, T, ROWS_LOG2, C: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BT: tl.constexpr
):
    """dx of D channels over BT rows from the float32 pre-activations' gradient: row t feeds outputs t .. t + K - 1,
    through taps K - 1 .. 0 (the conv's transpose; outputs at or past T read as zeros), summed in float32 and
    rounded once."""
    i_c, i_b = tl.program_id(0), tl.program_id(2).to(tl.int64)
    first = tl.program_id(1).to(tl.int64) * BT
    if first + BT + K - 1 <= T:  # one branch for all taps, so their loads are issued together
        dx = _transposed_taps(dpre_ptr, w_ptr, i_b, first, i_c * D, T, C, K, BT, D, False)
    else:
        dx = _transposed_taps(dpre_ptr, w_ptr, i_b, first, i_c * D, T, C, K, BT, D, True)
    _store_rows(dx_ptr, dx, i_b, first, i_c * D, T, C, BT, D)


@triton.jit
def _transposed_taps(
    dpre_ptr,
    w_ptr,
    i_b,
    first,
    column0,
    T,
    C: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    D: tl.constexpr,
    MASKED: tl.constexpr,
):
    """float32 [BT, D]: rows `first` .. of the taps' transpose over the pre-activations' gradient; MASKED where
    outputs at or past T are read (as zeros)."""
    rows, columns = tl.arange(0, BT), tl.arange(0, D)
    block = _row_block(dpre_ptr, i_b, first, column0, T, C, BT, D)
    dx = tl.zeros((BT, D), dtype=tl.float32)
    for m in tl.static_range(K):
        if MASKED:
            dpre = tl.load(block + m * C, mask=(first + m + rows < T)[:, None], other=0.0)
        else:
            dpre = tl.load(block + m * C)
        dx += dpre * tl.load(w_ptr + (K - 1 - m) * C + column0 + columns).to(tl.float32)[None, :]
    return dx


def conv_split_normalized_backward_triton(
    x_BTC: torch.Tensor,
    state_BCK1: torch.Tensor | None,
    weight_CK: torch.Tensor,
    bias_C: torch.Tensor | None,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    key_dim: int,
    head_dim: int,
    silu: bool,
) -> torch.Tensor:
    """dx of `conv_split_normalized_triton` for the gradients of its q, k and v, in two launches: the float32
    gradient at the conv's output, then the conv's transpose over it, summed in float32 and rounded once to x's
    dtype. (One launch that recomputed, for each row, the K pre-activations and norms it feeds held K tiles at once:
    226 registers a thread, one program an SM, and took 0.67 ms a layer for 4,096 rows at hybrid-1b's widths on the
    H200, as long as the forward takes for 32,768; the two launches take about 0.18 ms.)"""
    dq, dk, dv = (g.contiguous() for g in grads)
    dx = torch.empty_like(x_BTC)
    if x_BTC.shape[1]:
        x_BTC, state, weight_KC, grid, shape = _launch(x_BTC, state_BCK1, weight_CK, bias_C, key_dim, head_dim, silu)
        dpre = torch.empty(x_BTC.shape, dtype=torch.float32, device=x_BTC.device)
        T = x_BTC.shape[1]
        _pre_activation_gradient_kernel[grid](
            x_BTC, state, weight_KC, bias_C, dq, dk, dv, dpre, T, log2_bucket(T), **shape
        )
        _conv_input_gradient_kernel[grid](
            dpre, weight_KC, dx, T, log2_bucket(T), C=shape["C"], K=shape["K"], D=head_dim
        )
    return dx


class ConvSplitNormalized(torch.autograd.Function):
    """`conv_split_normalized_triton` differentiable in x alone (replay: frozen filters, a captured state): the
    backward is `conv_split_normalized_backward_triton`."""

    @staticmethod
    def forward(ctx, x_BTC, state_BCK1, weight_CK, bias_C, key_dim: int, head_dim: int, silu: bool):
        x_BTC, weight_CK = x_BTC.contiguous(), weight_CK.contiguous()
        ctx.save_for_backward(x_BTC, state_BCK1, weight_CK, bias_C)
        ctx.shape = (key_dim, head_dim, silu)
        return conv_split_normalized_triton(x_BTC, state_BCK1, weight_CK, bias_C, key_dim, head_dim, silu)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x_BTC, state_BCK1, weight_CK, bias_C = ctx.saved_tensors
        dx = conv_split_normalized_backward_triton(x_BTC, state_BCK1, weight_CK, bias_C, (dq, dk, dv), *ctx.shape)
        return dx, None, None, None, None, None, None
