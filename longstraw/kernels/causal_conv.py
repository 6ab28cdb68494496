"""The depthwise causal conv of a Gated DeltaNet layer, continuing from the previous call's last ``K-1`` inputs.

``causal_conv1d`` is the plain reference, channels first (``[B, C, T]``), as HF's conv runs; HF's cache keeps
``K`` columns, so ``[..., 1:]`` of such a cache is the state here. ``causal_conv1d_channels_last`` takes and
returns ``[B, T, C]``, the layout the layer's projections make, and on CUDA runs fla's Triton conv (one pass
that reads the state and writes the output, forward and backward; no transposes, no concatenation). Elsewhere
(CPU, float64, no fla) it is the reference on transposed views.

``conv_split_heads`` is what a Gated DeltaNet layer's rule reads from the conv: q, k and v as tensors of their own,
q and k l2-normalised per head. On CUDA, with nothing but x needing a gradient (capture, scoring, replay), it is one
Triton launch each way (``gdn_conv_triton``); the plain composition (the conv, the split, the norm) is its reference
and runs everywhere else.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from longstraw.kernels.gdn import L2NORM_EPS
from longstraw.kernels.optional_import import optional_function

_ACTIVATIONS: dict[str | None, Callable[[torch.Tensor], torch.Tensor]] = {
    None: lambda y: y,
    "silu": F.silu,
    "swish": F.silu,
}


def _kernel_size(activation, B: int, C: int, weight_CK: torch.Tensor, conv_state_BCK1: torch.Tensor | None) -> int:
    """The filters' length K, once the activation, the filters' channels and the state's shape are checked."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}")
    C_w, K = weight_CK.shape
    if C_w != C:
        raise ValueError(f"weight has {C_w} channels, x has {C}")
    if conv_state_BCK1 is not None and tuple(conv_state_BCK1.shape) != (B, C, K - 1):
        raise ValueError(f"conv_state must be {(B, C, K - 1)}, got {tuple(conv_state_BCK1.shape)}")
    return K


def causal_conv1d(
    x_BCT: torch.Tensor,
    conv_state_BCK1: torch.Tensor | None,
    weight_CK: torch.Tensor,
    bias_C: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv that continues from the previous ``K-1`` inputs.

    Args:
        x_BCT: new inputs ``[B, C, T]``.
        conv_state_BCK1: the last ``K-1`` inputs seen before ``x`` (``[B, C, K-1]``);
            zeros (or ``None``) means the start of the sequence.
        weight_CK: per-channel filters ``[C, K]`` (``conv1d.weight.squeeze(1)``).
        bias_C: optional per-channel bias.
        activation: ``"silu"`` / ``"swish"`` / ``None``.

    Returns:
        ``(y_BCT, new_state_BCK1)``: ``y`` in ``x``'s dtype (conv in the weight's
        dtype, as HF), and the last ``K-1`` inputs of ``cat(state, x)`` in ``x``'s
        dtype (valid also for ``T < K-1``).  Differentiable w.r.t. ``x``, the
        weight, the bias and the state; no input is modified.
    """
    B, C, T = x_BCT.shape
    K = _kernel_size(activation, B, C, weight_CK, conv_state_BCK1)
    if conv_state_BCK1 is None:
        conv_state_BCK1 = x_BCT.new_zeros(B, C, K - 1)
    xs_BCL = torch.cat([conv_state_BCK1.to(x_BCT.dtype), x_BCT], dim=-1)  # L = K-1+T
    if T == 0:
        y_BCT = x_BCT.new_zeros(B, C, 0)
    else:
        y_BCT = F.conv1d(xs_BCL.to(weight_CK.dtype), weight_CK.unsqueeze(1), bias_C, groups=C)
        y_BCT = _ACTIVATIONS[activation](y_BCT).to(x_BCT.dtype)
    new_state_BCK1 = xs_BCL[..., xs_BCL.shape[-1] - (K - 1) :]
    return y_BCT, new_state_BCK1


# fla's Triton `causal_conv1d` ([B, T, C] in and out, a [B, C, K] state), or None when fla does not import
_load_fla_conv = functools.partial(optional_function, "fla.modules.causal_conv1d.ops", "causal_conv1d")


def _fla_conv_usable(x_BTC: torch.Tensor, weight_CK: torch.Tensor) -> bool:
    return (
        x_BTC.is_cuda
        and x_BTC.shape[1] > 0
        and torch.float64 not in (x_BTC.dtype, weight_CK.dtype)
        and _load_fla_conv() is not None
    )


def causal_conv1d_channels_last(
    x_BTC: torch.Tensor,
    conv_state_BCK1: torch.Tensor | None,
    weight_CK: torch.Tensor,
    bias_C: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d` for ``x_BTC`` ``[B, T, C]``: ``(y_BTC, new_state_BCK1)``, the same arguments and results
    otherwise (the state stays ``[B, C, K-1]``). fla's Triton conv on CUDA (float32 sums, the output rounded once
    to ``x``'s dtype), the reference elsewhere."""
    if not _fla_conv_usable(x_BTC, weight_CK):
        y_BCT, state_BCK1 = causal_conv1d(x_BTC.transpose(1, 2), conv_state_BCK1, weight_CK, bias_C, activation)
        return y_BCT.transpose(1, 2), state_BCK1
    B, T, C = x_BTC.shape
    _kernel_size(activation, B, C, weight_CK, conv_state_BCK1)
    # fla's state holds the last K inputs, of which the conv reads the newest K-1: ours with an unread oldest column
    initial_BCK = None if conv_state_BCK1 is None else F.pad(conv_state_BCK1.to(x_BTC.dtype), (1, 0))
    y_BTC, final_BCK = _load_fla_conv()(
        x_BTC, weight_CK, bias_C, initial_state=initial_BCK, output_final_state=True, activation=activation
    )
    return y_BTC, final_BCK[..., 1:]


def conv_split_heads(
    x_BTC: torch.Tensor,
    conv_state_BCK1: torch.Tensor | None,
    weight_CK: torch.Tensor,
    bias_C: torch.Tensor | None,
    key_dim: int,
    head_k_dim: int,
    head_v_dim: int,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, new_state_BCK1): `causal_conv1d_channels_last` of ``x_BTC`` split along its channels into q and k
    (``key_dim`` each, heads of ``head_k_dim``) and v (the rest, heads of ``head_v_dim``), each contiguous
    ``[B, T, heads, head dim]``, q and k divided by their l2 norm over each head (float32, as fla's norm, rounded
    once to x's dtype). On CUDA with nothing but x needing a gradient (capture, scoring, replay, a sharded capture's
    transition) one fused Triton launch forward and one backward (`gdn_conv_triton.ConvSplitNormalized`); every other
    call (a state or filter needing a gradient, CPU, float64) the plain composition."""
    B, T, C = x_BTC.shape
    K = _kernel_size(activation, B, C, weight_CK, conv_state_BCK1)
    only_x = not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad for t in (conv_state_BCK1, weight_CK, bias_C)
    )
    one_head_dim = head_k_dim == head_v_dim and not head_k_dim & (head_k_dim - 1) and key_dim % head_k_dim == 0
    fused = only_x and one_head_dim and x_BTC.is_cuda and T
    if fused and torch.float64 not in (x_BTC.dtype, weight_CK.dtype):
        from longstraw.kernels.gdn_conv_triton import ConvSplitNormalized

        q, k, v = ConvSplitNormalized.apply(
            x_BTC, conv_state_BCK1, weight_CK, bias_C, key_dim, head_k_dim, activation is not None
        )
        previous = x_BTC.new_zeros(B, C, K - 1) if conv_state_BCK1 is None else conv_state_BCK1.to(x_BTC.dtype)
        state = torch.cat([previous, x_BTC[:, max(T - (K - 1), 0) :].transpose(1, 2)], dim=-1)[..., -(K - 1) :]
        return q, k, v, state
    y_BTC, state = causal_conv1d_channels_last(x_BTC, conv_state_BCK1, weight_CK, bias_C, activation)
    q, k, v = torch.split(y_BTC, [key_dim, key_dim, C - 2 * key_dim], dim=-1)
    del y_BTC  # freed once q, k and v are copied out (a capture's transient peaks inside the rule that follows)
    q, k = (t.reshape(B, T, -1, head_k_dim) for t in (q, k))
    wide = torch.promote_types(x_BTC.dtype, torch.float32)  # float32, or float64 for float64 input
    q, k = (t.to(wide) * torch.rsqrt(t.to(wide).square().sum(-1, keepdim=True) + L2NORM_EPS) for t in (q, k))
    q, k, v = (t.to(x_BTC.dtype).contiguous() for t in (q, k, v.reshape(B, T, -1, head_v_dim)))
    return q, k, v, state
