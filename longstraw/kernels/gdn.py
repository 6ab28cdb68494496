"""Differentiable Gated DeltaNet (GDN) kernels that start from a captured state.

The GDN layers of HF ``qwen3_next`` / ``qwen3_5`` models run a depthwise causal
conv over the fused q/k/v projection, then the gated delta rule.  LongStraw
captures a long prompt's per-layer state (conv state + recurrent state) without
autograd and replays a response *under* autograd starting from that state.
HF's cached path writes into the saved state in place (``copy_``), which breaks
autograd, so this module provides pure-functional replacements.

Gated delta rule, per value head, with state ``S`` of shape ``[Dk, Dv]``::

    q_t, k_t <- l2norm(q_t), l2norm(k_t)        (float32, eps 1e-6, like HF/fla)
    q_t      <- q_t * Dk**-0.5
    S        <- exp(g_t) * S                    (g_t <= 0 is the log decay)
    u_t       = beta_t * (v_t - S^T k_t)        (delta rule: write only the error)
    S        <- S + k_t u_t^T
    o_t       = S^T q_t

``recurrent_gated_delta_rule`` is exactly that loop (the reference).
``chunk_gated_delta_rule`` is the chunked WY / UT-transform form: within a chunk
of C tokens starting from state S0, with cumulative log decay
``G_i = g_1 + ... + g_i`` and ``D_ij = exp(G_i - G_j)`` for ``j <= i``::

    (I + tril(diag(beta) K K^T * D, -1)) [U0 | W] = [diag(beta) V | diag(beta exp(G)) K]
    U      = U0 - W S0                                  (the chunk's delta writes u_t)
    O      = diag(exp(G)) Q S0 + ((Q K^T) * D) U        (D masked to j <= i)
    S_end  = exp(G_C) S0 + (diag(exp(G_C - G)) K)^T U

The unit-lower-triangular system is solved with ``torch.linalg.solve_triangular``
(differentiable); the scan over chunks is a plain Python loop that carries only
the state (each chunk's start state and delta writes gathered in lists and
stacked), and every chunk's output is then two batched matmuls: nothing autograd
saved is ever written in place, and no input tensor is modified.

Simplifications / conventions (kept identical to HF's ``torch_chunk_gated_delta_rule``
with ``use_qk_l2norm_in_kernel=True, output_final_state=True``):

* q/k may have fewer heads than v; value head ``h`` reads q/k head
  ``h // (Hv // Hk)`` (``repeat_interleave`` over the head dim, as HF and fla).
* All maths runs in float32; if any input is float64 it runs in float64 instead
  (used by the tests for tight gradient checks).  The output is cast to q's
  dtype; the final state stays in the compute dtype (float32 in practice).
* The tail of a sequence that is not a multiple of ``chunk_size`` is zero-padded
  (k = 0, beta = 0, g = 0 leave the state untouched); padded outputs are dropped.
* No variable-length packing (``cu_seqlens``) and no padding masks.

The layer's depthwise causal conv is in ``causal_conv``.

``chunk_gated_delta_rule_forward`` is the no-grad fast path for the capture: on CUDA
when fla is importable, fla's intra-chunk kernels and then one scan that computes
each chunk's output inside it (``gdn_scan_triton``; ``capture_scan("fla")`` runs
fla's whole ``chunk_gated_delta_rule`` instead), the pure-torch chunk kernel
otherwise.

``gated_delta_rule`` is the differentiable rule replay, scoring and exact mode run:
fla's chunk kernels forward and backward on CUDA where this process has checked
fla's backward against ``chunk_gated_delta_rule`` at the layer's head shape
(``fla_backward_trusted``), the torch chunk rule otherwise (CPU, float64,
deterministic mode, a failed check, ``differentiable_rule("torch")``).  fla 0.6.0
refuses its gated backward outright on Hopper with Triton 3.4-3.7.0 (fla #640: a
miscompile of 64-wide key tiles in ``chunk_bwd_dqkwg``; Hopper's tiling takes
128-wide ones for head dim 128); the check lifts that refusal for itself and
keeps fla's backward only if its gradients agree with the torch rule's.
``differentiable_rule("kept")`` composes fla's forward and backward functions as
fla does, where fla's is trusted and q and k come normalised, but keeps the WY
representation's w, the per-chunk states and the corrected values from the
forward for the backward, which fla's recomputes.
"""

from __future__ import annotations

import functools
import re
import types
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from longstraw.kernels.optional_import import optional_function
from longstraw.kernels.process_setting import ProcessSetting

__all__ = [
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "capture_scan",
    "chunk_gated_delta_rule_forward",
    "differentiable_rule",
    "fla_available",
    "fla_backward_trusted",
    "gated_delta_rule",
]

L2NORM_EPS = 1e-6
# a decoding step's rule in one launch (`gdn_decode_triton`) and its applicability test, or None without Triton
_load_decode_step = functools.partial(optional_function, "longstraw.kernels.gdn_decode_triton", "gdn_decode_step")
_load_decode_step_usable = functools.partial(
    optional_function, "longstraw.kernels.gdn_decode_triton", "decode_step_usable"
)

# --------------------------------------------------------------------------------------
# Shared input preparation
# --------------------------------------------------------------------------------------


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float32, or float64 when any given tensor is float64."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _check_shapes(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV) -> None:
    if q_BTHD.shape != k_BTHD.shape:
        raise ValueError(f"q {tuple(q_BTHD.shape)} and k {tuple(k_BTHD.shape)} must match")
    B, T, Hk, Dk = q_BTHD.shape
    if v_BTHV.dim() != 4 or v_BTHV.shape[:2] != (B, T):
        raise ValueError(f"v must be [B={B}, T={T}, Hv, Dv], got {tuple(v_BTHV.shape)}")
    Hv, Dv = v_BTHV.shape[2:]
    if Hv % Hk != 0:
        raise ValueError(f"value heads ({Hv}) must be a multiple of q/k heads ({Hk})")
    for name, t in (("g", g_BTH), ("beta", beta_BTH)):
        if tuple(t.shape) != (B, T, Hv):
            raise ValueError(f"{name} must be {(B, T, Hv)}, got {tuple(t.shape)}")
    if initial_state_BHDV is not None and tuple(initial_state_BHDV.shape) != (B, Hv, Dk, Dv):
        raise ValueError(f"initial_state must be {(B, Hv, Dk, Dv)}, got {tuple(initial_state_BHDV.shape)}")


def _prepare_inputs(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, l2norm_qk: bool, dtype: torch.dtype):
    """Expand q/k heads to the value heads, move heads before time, cast, normalise, scale.

    Returns ``q_BHTD`` (already scaled by ``Dk**-0.5``), ``k_BHTD``, ``v_BHTV``,
    ``g_BHT``, ``beta_BHT`` in ``dtype``.
    """
    group = v_BTHV.shape[2] // k_BTHD.shape[2]
    if group > 1:
        q_BTHD = q_BTHD.repeat_interleave(group, dim=2)
        k_BTHD = k_BTHD.repeat_interleave(group, dim=2)
    q_BHTD, k_BHTD, v_BHTV, g_BHT, beta_BHT = (
        t.transpose(1, 2).to(dtype) for t in (q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH)
    )
    if l2norm_qk:
        q_BHTD, k_BHTD = _l2norm(q_BHTD), _l2norm(k_BHTD)
    q_BHTD = q_BHTD * (q_BHTD.shape[-1] ** -0.5)
    return q_BHTD, k_BHTD, v_BHTV, g_BHT, beta_BHT


def _initial_state(initial_state_BHDV, v_BHTV: torch.Tensor, Dk: int) -> torch.Tensor:
    if initial_state_BHDV is not None:
        return initial_state_BHDV.to(v_BHTV.dtype)
    B, H, _, Dv = v_BHTV.shape
    return v_BHTV.new_zeros(B, H, Dk, Dv)


# --------------------------------------------------------------------------------------
# Reference: token-by-token recurrence
# --------------------------------------------------------------------------------------


def recurrent_gated_delta_rule(
    q_BTHD: torch.Tensor,
    k_BTHD: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
    initial_state_BHDV: torch.Tensor | None = None,
    *,
    l2norm_qk: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive per-token gated delta rule (the reference for ``chunk_gated_delta_rule``).

    Same arguments and results as ``chunk_gated_delta_rule`` minus ``chunk_size``;
    differentiable, O(T) Python steps.
    """
    _check_shapes(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV)
    dtype = _compute_dtype(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV)
    q_BHTD, k_BHTD, v_BHTV, g_BHT, beta_BHT = _prepare_inputs(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, l2norm_qk, dtype)
    state_BHDV = _initial_state(initial_state_BHDV, v_BHTV, q_BHTD.shape[-1])
    outs_BHV = []
    for t in range(q_BHTD.shape[2]):
        q_BHD, k_BHD, v_BHV = q_BHTD[:, :, t], k_BHTD[:, :, t], v_BHTV[:, :, t]
        state_BHDV = state_BHDV * g_BHT[:, :, t].exp()[..., None, None]
        predicted_BHV = torch.einsum("bhd,bhdv->bhv", k_BHD, state_BHDV)
        delta_BHV = (v_BHV - predicted_BHV) * beta_BHT[:, :, t, None]
        state_BHDV = state_BHDV + k_BHD[..., :, None] * delta_BHV[..., None, :]
        outs_BHV.append(torch.einsum("bhd,bhdv->bhv", q_BHD, state_BHDV))
    out_BTHV = _stack_time(outs_BHV, v_BHTV)
    return out_BTHV.to(q_BTHD.dtype), state_BHDV


def _stack_time(outs_BHV: list[torch.Tensor], v_BHTV: torch.Tensor) -> torch.Tensor:
    if not outs_BHV:
        return v_BHTV.transpose(1, 2).clone()
    return torch.stack(outs_BHV, dim=1)


# --------------------------------------------------------------------------------------
# Chunked (WY / UT-transform) form
# --------------------------------------------------------------------------------------


def _pad_time(x_BHT_: torch.Tensor, pad: int) -> torch.Tensor:
    """Zero-pad dim 2 (time) of a [B, H, T, ...] tensor at the end."""
    if pad == 0:
        return x_BHT_
    trailing = x_BHT_.dim() - 3
    return F.pad(x_BHT_, (0, 0) * trailing + (0, pad))


def _to_chunks(x_BHT_: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, H, N*C, ...] -> [B, H, N, C, ...]."""
    B, H, T = x_BHT_.shape[:3]
    return x_BHT_.reshape(B, H, T // chunk_size, chunk_size, *x_BHT_.shape[3:])


def _intra_chunk(q_BHNCD, k_BHNCD, v_BHNCV, g_BHNC, beta_BHNC):
    """Everything that depends on one chunk only (all chunks at once).

    Returns ``u0`` and ``w`` (UT-transformed values and decayed keys), the masked
    intra-chunk attention, q decayed from the chunk start, k decayed to the chunk
    end, and the whole-chunk decay.
    """
    C = g_BHNC.shape[-1]
    Dv = v_BHNCV.shape[-1]
    cum_BHNC = g_BHNC.cumsum(dim=-1)
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=g_BHNC.device).tril()
    log_decay_BHNCC = cum_BHNC[..., :, None] - cum_BHNC[..., None, :]
    decay_BHNCC = log_decay_BHNCC.masked_fill(~causal_CC, float("-inf")).exp()

    kbeta_BHNCD = k_BHNCD * beta_BHNC[..., None]
    system_BHNCC = (kbeta_BHNCD @ k_BHNCD.transpose(-1, -2)) * decay_BHNCC
    rhs_BHNCX = torch.cat([v_BHNCV * beta_BHNC[..., None], kbeta_BHNCD * cum_BHNC.exp()[..., None]], dim=-1)
    # Unit lower-triangular solve: the diagonal of `system` is ignored (implicit 1).
    solved_BHNCX = torch.linalg.solve_triangular(system_BHNCC, rhs_BHNCX, upper=False, unitriangular=True)
    u0_BHNCV, w_BHNCD = solved_BHNCX.split([Dv, solved_BHNCX.shape[-1] - Dv], dim=-1)

    attn_BHNCC = (q_BHNCD @ k_BHNCD.transpose(-1, -2)) * decay_BHNCC
    q_from_start_BHNCD = q_BHNCD * cum_BHNC.exp()[..., None]
    k_to_end_BHNCD = k_BHNCD * (cum_BHNC[..., -1:] - cum_BHNC).exp()[..., None]
    chunk_decay_BHN = cum_BHNC[..., -1].exp()
    return u0_BHNCV, w_BHNCD, attn_BHNCC, q_from_start_BHNCD, k_to_end_BHNCD, chunk_decay_BHN


def _scan_chunks(state_BHDV, u0_BHNCV, w_BHNCD, attn_BHNCC, q_from_start_BHNCD, k_to_end_BHNCD, chunk_decay_BHN):
    """The state's pass over the chunks, the only sequential part: each chunk's start state and delta writes
    ``u``; then every chunk's output in two batched matmuls. Returns ``(out_BHNCV, final_state_BHDV)``.
    The chunks are taken with ``unbind`` (its backward is one ``stack``): indexing chunk ``n`` would give
    every chunk a backward that writes a zero gradient the size of the whole input."""
    starts_BHDV, writes_BHCV = [], []
    for u0_BHCV, w_BHCD, k_to_end_BHCD, decay_BH in zip(
        u0_BHNCV.unbind(2), w_BHNCD.unbind(2), k_to_end_BHNCD.unbind(2), chunk_decay_BHN.unbind(2)
    ):
        starts_BHDV.append(state_BHDV)
        u_BHCV = u0_BHCV - w_BHCD @ state_BHDV
        writes_BHCV.append(u_BHCV)
        state_BHDV = state_BHDV * decay_BH[..., None, None] + k_to_end_BHCD.transpose(-1, -2) @ u_BHCV
    starts_BHNDV, writes_BHNCV = torch.stack(starts_BHDV, dim=2), torch.stack(writes_BHCV, dim=2)
    return q_from_start_BHNCD @ starts_BHNDV + attn_BHNCC @ writes_BHNCV, state_BHDV


# The differentiable rule's chunk: on hybrid-1b's GDN shape (2 x 2,048 tokens, 32 value heads, dims 128) on the
# H200, forward + backward took 16.1 ms at 64, 13.1 at 128, 13.7 at 256 (`benchmarks/gdn_chunk_size.py`): fewer
# sequential steps until the intra-chunk work outgrows them. A call of fewer tokens takes one chunk of its length.
REPLAY_CHUNK_SIZE = 128


def chunk_gated_delta_rule(
    q_BTHD,
    k_BTHD,
    v_BTHV,
    g_BTH,
    beta_BTH,
    initial_state_BHDV=None,
    *,
    chunk_size: int = REPLAY_CHUNK_SIZE,
    l2norm_qk: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked, fully differentiable gated delta rule.

    Args:
        q_BTHD, k_BTHD: queries / keys ``[B, T, Hk, Dk]`` (not yet normalised).
        v_BTHV: values ``[B, T, Hv, Dv]`` with ``Hv % Hk == 0``.
        g_BTH: log decay ``[B, T, Hv]`` (``<= 0``).
        beta_BTH: write strength ``[B, T, Hv]`` (post-sigmoid).
        initial_state_BHDV: ``[B, Hv, Dk, Dv]`` state to continue from, or ``None`` (zeros).
        chunk_size: tokens per chunk (any positive int; T need not be a multiple; at most T are used).
        l2norm_qk: L2-normalise q and k (HF's ``use_qk_l2norm_in_kernel``).

    Returns:
        ``(out_BTHV, final_state_BHDV)``: output in q's dtype, final state in
        float32 (float64 if any input is float64).  Gradients flow to every input,
        ``initial_state`` included.
    """
    if chunk_size < 1:
        raise ValueError("chunk_size must be positive")
    _check_shapes(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV)
    dtype = _compute_dtype(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV)
    q_BHTD, k_BHTD, v_BHTV, g_BHT, beta_BHT = _prepare_inputs(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, l2norm_qk, dtype)
    B, H, T, Dk = q_BHTD.shape
    Dv = v_BHTV.shape[-1]
    state_BHDV = _initial_state(initial_state_BHDV, v_BHTV, Dk)
    if T == 0:
        return v_BTHV.new_zeros(B, 0, H, Dv).to(q_BTHD.dtype), state_BHDV

    chunk_size = min(chunk_size, T)
    pad = (-T) % chunk_size
    chunks = [_to_chunks(_pad_time(t, pad), chunk_size) for t in (q_BHTD, k_BHTD, v_BHTV, g_BHT, beta_BHT)]
    out_BHNCV, state_BHDV = _scan_chunks(state_BHDV, *_intra_chunk(*chunks))
    out_BHTV = out_BHNCV.reshape(B, H, -1, Dv)[:, :, :T]
    return out_BHTV.transpose(1, 2).to(q_BTHD.dtype), state_BHDV


# --------------------------------------------------------------------------------------
# No-grad fast forward (capture)
# --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _load_fla() -> tuple[Callable | None, tuple[int, ...]]:
    """fla's chunk_gated_delta_rule and fla's version, or (None, ()) when not importable."""
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except Exception:  # ImportError, or triton / driver trouble at import time
        return None, ()
    return fla_chunk, _parse_version(getattr(fla, "__version__", "0"))


def _parse_version(version: str) -> tuple[int, ...]:
    """'0.6.0' -> (0, 6, 0); leading numeric components only ('0.6.0rc1' -> (0, 6, 0))."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in match.group(0).split(".")) if match else (0,)


# fla 0.6.0 maps value head h to q/k head h // (Hv // Hk) natively (checked in its
# kernels); older versions are fed q/k already repeated to the value heads.
_FLA_NATIVE_GVA_VERSION = (0, 6, 0)


def fla_available() -> bool:
    """True when fla's chunk_gated_delta_rule can be imported."""
    return _load_fla()[0] is not None


# the capture's scan: "fused" computes each chunk's output inside fla's state scan (`gdn_scan_triton`: fla's
# intra-chunk kernels, then one scan that writes only the output and the final state), "fla" runs fla's whole
# forward (its scan writes every chunk's state for its output kernel to read back)
CAPTURE_SCANS = ("fused", "fla")
_capture_scan = ProcessSetting("capture GDN scan", CAPTURE_SCANS, "fused")


def capture_scan(name: str):
    """Within the block, `chunk_gated_delta_rule_forward`'s fla path runs `name`: "fused" or "fla"."""
    return _capture_scan.within(name)


def _fused_scan_fits(q_BTHD, v_BTHV, l2norm_qk: bool) -> bool:
    """Whether the fused scan computes this rule: q and k come normalised, power-of-two head dims (V >= 32, K <=
    128), an fla with value heads of their own (fla's intra-chunk functions read k unrepeated) and Triton."""
    K, V = q_BTHD.shape[-1], v_BTHV.shape[-1]
    pow2 = not K & (K - 1) and not V & (V - 1)
    shaped = not l2norm_qk and pow2 and 32 <= V and K <= 128
    return shaped and _load_fla()[1] >= _FLA_NATIVE_GVA_VERSION and _load_fused_scan() is not None


def _fused_scan_usable(q_BTHD, v_BTHV, l2norm_qk: bool) -> bool:
    return _capture_scan.value == "fused" and _fused_scan_fits(q_BTHD, v_BTHV, l2norm_qk)


@functools.cache
def _load_fused_scan() -> Callable | None:
    """fla's chunk forward with its scan and output kernels as one (`gdn_scan_triton`), or None when fla's
    intra-chunk functions or Triton do not import. It returns the output and the final state."""
    try:
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2

        from longstraw.kernels.gdn_scan_triton import chunk_scan_output_triton
    except Exception:  # no fla, another fla layout, or Triton / driver trouble at import time
        return None

    def forward(q, k, v, g, beta, initial_state, scale):
        q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
        g = chunk_local_cumsum(g.float().contiguous(), chunk_size=64, scale=RCP_LN2)  # log2 decay within chunks
        w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=64)
        return chunk_scan_output_triton(q, k, w, u, g, initial_state, scale, chunk_size=64)

    return forward


def _kept_states_autograd(fla) -> Callable:
    """The `apply` of an autograd function: fla's chunk forward and backward (`fla`: a namespace of its functions by
    their names) composed as fla's `ChunkGatedDeltaRuleFunction` composes them, with what its backward recomputes
    kept from the forward instead: the WY representation's w, every chunk's start state h and the corrected values
    v_new (fla's backward runs `recompute_w_u_fwd` and `chunk_gated_delta_rule_fwd_h` again for them)."""

    class KeptStatesRule(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, g, beta, initial_state, scale):
            q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))  # fla's kernels read them contiguous
            initial_state = None if initial_state is None else initial_state.contiguous()  # a member batch's repeat
            g_log2 = fla.chunk_local_cumsum(g.float().contiguous(), chunk_size=64, scale=fla.RCP_LN2)
            w, u, A = fla.chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_log2, beta=beta, chunk_size=64)
            h, v_new, final = fla.chunk_gated_delta_rule_fwd_h(
                k=k, w=w, u=u, g=g_log2, initial_state=initial_state, output_final_state=True, chunk_size=64
            )
            out = fla.chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g_log2, scale=scale, chunk_size=64)
            ctx.save_for_backward(q, k, v, g_log2, beta, A, initial_state, w, h, v_new)
            ctx.scale, ctx.g_dtype = scale, g.dtype
            return out.to(q.dtype), final

        @staticmethod
        def backward(ctx, d_out, d_final):
            q, k, v, g_log2, beta, A, initial_state, w, h, v_new = ctx.saved_tensors
            scale, d_out, d_final = ctx.scale, d_out.contiguous(), d_final.contiguous()
            dv = fla.chunk_bwd_dv_local(q=q, k=k, g=g_log2, do=d_out, scale=scale, chunk_size=64)
            dh, d_initial, dv = fla.chunk_gated_delta_rule_bwd_dhu(
                q=q, k=k, w=w, g=g_log2, h0=initial_state, dht=d_final, do=d_out, dv=dv, scale=scale, chunk_size=64
            )
            dq, dk, dw, dg = fla.chunk_bwd_dqkwg(
                q=q, k=k, v=v_new, w=w, g=g_log2, h=h, dv=dv, do=d_out, dh=dh, scale=scale, chunk_size=64
            )
            dk_wy, dv, dbeta, dg_wy = fla.prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g_log2, A=A, dw=dw, du=dv)
            dk.add_(dk_wy)
            dg = fla.chunk_local_cumsum(dg.add_(dg_wy), chunk_size=64, reverse=True)
            d_initial = None if initial_state is None else d_initial.to(initial_state.dtype)
            grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(ctx.g_dtype), dbeta.to(beta.dtype))
            return *grads, d_initial, None

    return KeptStatesRule.apply


@functools.cache
def _load_kept_states() -> Callable | None:
    """`differentiable_rule("kept")`'s function (`_kept_states_autograd` over fla's functions), or None where they do
    not import."""
    try:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local, chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except Exception:  # no fla, another fla layout
        return None
    return _kept_states_autograd(
        types.SimpleNamespace(
            chunk_local_cumsum=chunk_local_cumsum,
            RCP_LN2=RCP_LN2,
            chunk_gated_delta_rule_fwd_intra=chunk_gated_delta_rule_fwd_intra,
            chunk_gated_delta_rule_fwd_h=chunk_gated_delta_rule_fwd_h,
            chunk_fwd_o=chunk_fwd_o,
            chunk_bwd_dv_local=chunk_bwd_dv_local,
            chunk_gated_delta_rule_bwd_dhu=chunk_gated_delta_rule_bwd_dhu,
            chunk_bwd_dqkwg=chunk_bwd_dqkwg,
            prepare_wy_repr_bwd=prepare_wy_repr_bwd,
        )
    )


def _kept_states(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV):
    """The rule (q and k normalised) by `_load_kept_states`'s function, in `_fla_forward`'s dtypes."""
    initial = None if initial_state_BHDV is None else initial_state_BHDV.float()
    scale = q_BTHD.shape[-1] ** -0.5
    return _load_kept_states()(q_BTHD, k_BTHD, v_BTHV, g_BTH.float(), beta_BTH, initial, scale)


def _fla_forward(fla_chunk, fla_version, q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV, l2norm_qk=True):
    group = v_BTHV.shape[2] // k_BTHD.shape[2]
    if group > 1 and fla_version < _FLA_NATIVE_GVA_VERSION:
        q_BTHD = q_BTHD.repeat_interleave(group, dim=2)
        k_BTHD = k_BTHD.repeat_interleave(group, dim=2)
    if initial_state_BHDV is not None:
        initial_state_BHDV = initial_state_BHDV.float()
    out_BTHV, final_state_BHDV = fla_chunk(
        q_BTHD,
        k_BTHD,
        v_BTHV,
        g=g_BTH.float(),
        beta=beta_BTH,
        scale=q_BTHD.shape[-1] ** -0.5,
        initial_state=initial_state_BHDV,
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2norm_qk,
    )
    return out_BTHV.to(q_BTHD.dtype), final_state_BHDV.float()


@torch.no_grad()
def chunk_gated_delta_rule_forward(
    q_BTHD,
    k_BTHD,
    v_BTHV,
    g_BTH,
    beta_BTH,
    initial_state_BHDV=None,
    *,
    chunk_size: int = 64,
    l2norm_qk: bool = True,
    use_fla: bool | None = None,
    final_state_BHDV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad forward for capturing a prompt's state; same results as ``chunk_gated_delta_rule``.

    Uses fla's Triton kernel when ``use_fla`` is not False, fla imports, the
    tensors are on CUDA and inputs are not float64 (``l2norm_qk=False``: q and k come normalised);
    otherwise runs ``chunk_gated_delta_rule``; a single token (a decoding step)
    takes ``recurrent_gated_delta_rule`` unless ``use_fla`` is set, on CUDA (q and k normalised, a float32
    state) in one launch (``gdn_decode_triton``) that writes the state into ``final_state_BHDV`` when given (it may
    be the initial state itself: decoding updates its rows' states in place).
    ``use_fla=True`` raises if fla cannot be used.  The returned tensors carry no
    autograd history (fla's backward is never used).
    """
    _check_shapes(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV)
    if q_BTHD.shape[1] == 1 and not use_fla:  # one decoding step: the recurrence itself, as HF decodes
        return _decode_step_forward(
            q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV, l2norm_qk, final_state_BHDV
        )
    fla_chunk, fla_version = _usable_fla(use_fla, q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV)
    if fla_chunk is not None and _fused_scan_usable(q_BTHD, v_BTHV, l2norm_qk):
        # no autograd here (torch.no_grad): the scan alone, no backward
        out_BTHV, final_state_BHDV = _load_fused_scan()(
            q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV, q_BTHD.shape[-1] ** -0.5
        )
        return out_BTHV.to(q_BTHD.dtype), final_state_BHDV
    if fla_chunk is not None:
        return _fla_forward(
            fla_chunk, fla_version, q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV, l2norm_qk
        )
    return chunk_gated_delta_rule(
        q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV, chunk_size=chunk_size, l2norm_qk=l2norm_qk
    )


def _decode_step_forward(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV, l2norm_qk, final_state_BHDV):
    """One decoding step: the fused launch where it runs (q and k normalised), else the recurrence."""
    usable = _load_decode_step_usable()
    if not l2norm_qk and usable is not None and usable(q_BTHD, v_BTHV, initial_state_BHDV):
        return _load_decode_step()(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV, final_state_BHDV)
    return recurrent_gated_delta_rule(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV, l2norm_qk=l2norm_qk)


def _usable_fla(use_fla, q_BTHD, *tensors) -> tuple:
    """(fla's chunk kernel, its version) where the no-grad forward may use it (not refused by `use_fla`, CUDA
    tensors, a float32 compute dtype, a sequence), else (None, ()); `use_fla=True` without it raises."""
    fla_chunk, fla_version = _load_fla() if use_fla is not False else (None, ())
    usable = (
        fla_chunk is not None
        and q_BTHD.is_cuda
        and _compute_dtype(q_BTHD, *tensors) == torch.float32
        and q_BTHD.shape[1] > 0
    )
    if use_fla and not usable:
        raise RuntimeError("fla path requested but unavailable (fla import, CUDA tensors, non-float64)")
    return (fla_chunk, fla_version) if usable else (None, ())


# --------------------------------------------------------------------------------------
# Differentiable fast path (replay): fla forward and backward, where checked
# --------------------------------------------------------------------------------------

# "auto": fla's kernels where `fla_backward_trusted`, else the torch chunk rule; "kept": where fla's are trusted and q
# and k come normalised, fla's kernels with what its backward recomputes kept from the forward (`_load_kept_states`;
# a member batch's w, chunk states and corrected values, in the inputs' 16-bit dtype); "torch": the torch chunk rule
# everywhere. "kept" is the default: on the H200's floor point (hybrid-1b, 4,096 member rows) it took 2 ms off the
# members for 1.6 GB more peak, which grows with a member batch's rows, not with G or the prompt; "auto" is the lean one
RULES = ("auto", "kept", "torch")
_rule = ProcessSetting("differentiable GDN rule", RULES, "kept")


def differentiable_rule(name: str):
    """Within the block, `gated_delta_rule` runs `name`: "auto", "kept" or "torch" (`RULES`)."""
    return _rule.within(name)


# fla keeps its chunk kernels' intermediates in the inputs' 16-bit dtype, so its gradients differ from the float32
# rule's by bf16 rounding (about 1e-2 relative); the miscompile fla #640 describes is off by about 0.5 to 15
FLA_BACKWARD_TOLERANCE = 5e-2


def _check_tokens(tokens: int) -> int:
    """The check's sequence length for a first caller of `tokens`: its whole 64-token chunks (at least three, at most
    8,192 tokens) and a ragged tail of 29. fla's autotuner keys its choices on the heads and dims, not the length,
    and keeps the first call's choice for the process (and, with TRITON_CACHE_AUTOTUNING, for every later one): a
    check far shorter than the caller would tune the backward kernels for the wrong size."""
    return min(max(tokens // 64, 3), 128) * 64 + 29


def _lift_hopper_refusal() -> None:
    """fla 0.6.0's `chunk_bwd_dqkwg` raises for gated input on Hopper with Triton in [3.4, 3.7.1); the flag it
    reads is the only thing changed. Whether its result is right here is what `fla_backward_trusted` checks."""
    try:
        import fla.ops.common.chunk_o as chunk_o
    except Exception:
        return
    if hasattr(chunk_o, "TRITON_ABOVE_3_7_1"):
        chunk_o.TRITON_ABOVE_3_7_1 = True


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


_trusted: dict[tuple, bool] = {}


def fla_backward_trusted(
    hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, device: str, batch: int = 2, tokens: int = 0
) -> bool:
    """Whether fla's chunk rule, forward and backward, gives the torch chunk rule's output and gradients (q, k, v,
    g, beta, the initial state; a loss on the output and on the final state) within FLA_BACKWARD_TOLERANCE, at
    this head shape and input dtype on this device: random inputs, `batch` sequences of `_check_tokens(tokens)`,
    the first caller's batch and length. Once per process and shape; a disagreement or an error is warned of once
    and the torch rule kept."""
    key = (hk, hv, dk, dv, dtype, device)
    if key not in _trusted:
        _trusted[key] = _check_fla_backward(*key, batch, _check_tokens(tokens))
    return _trusted[key]


def _check_fla_backward(hk, hv, dk, dv, dtype, device, B: int, T: int) -> bool:
    fla_chunk, fla_version = _load_fla()
    if fla_chunk is None:
        return False
    _lift_hopper_refusal()
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    inputs = [
        rand(B, T, hk, dk),
        rand(B, T, hk, dk),
        rand(B, T, hv, dv),
        -torch.rand(B, T, hv, generator=gen, device=device) * 0.5,  # log decays in (-0.5, 0]
        torch.rand(B, T, hv, generator=gen, device=device).to(dtype),
        rand(B, hv, dk, dv, dt=torch.float32) * 0.1,
    ]
    out_weight, state_weight = rand(B, T, hv, dv, dt=torch.float32), rand(B, hv, dk, dv, dt=torch.float32)

    def run(rule):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        out, final = rule(*leaves)
        ((out.float() * out_weight).sum() + (final.float() * state_weight).sum()).backward()
        return [out.detach()] + [leaf.grad for leaf in leaves]

    # the first call may come from inside a no-grad pass (scoring) or a checkpointed layer, whose saved-tensor hooks
    # would take the check's tensors and recompute the layer in its backward: grad on, hooks that keep them as they are
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            ours = run(lambda *a: _fla_forward(fla_chunk, fla_version, *a))
            reference = run(chunk_gated_delta_rule)
        errors = [_relative_error(a, b) for a, b in zip(ours, reference)]
    except Exception as exc:  # fla's backward refused or failed to compile here
        warnings.warn(
            f"fla's GDN backward unusable here ({type(exc).__name__}: {exc}); replay runs the torch rule", stacklevel=2
        )
        return False
    if max(errors) > FLA_BACKWARD_TOLERANCE:
        names = ("out", "dq", "dk", "dv", "dg", "dbeta", "dstate")
        worst = ", ".join(f"{n} {e:.2g}" for n, e in zip(names, errors) if e > FLA_BACKWARD_TOLERANCE)
        warnings.warn(
            f"fla's GDN backward disagrees with the torch rule here (relative errors {worst}); "
            "replay runs the torch rule",
            stacklevel=2,
        )
        return False
    return True


def _kept_states_apply(l2norm_qk: bool) -> bool:
    """Under "kept", with q and k normalised (fla's l2 norm is not composed here) and an fla whose functions read
    value heads of their own (the q/k heads unrepeated)."""
    return (
        _rule.value == "kept"
        and not l2norm_qk
        and _load_fla()[1] >= _FLA_NATIVE_GVA_VERSION
        and _load_kept_states() is not None
    )


def _fla_differentiable(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV) -> bool:
    if _rule.value == "torch" or not q_BTHD.is_cuda or q_BTHD.shape[1] == 0:
        return False
    if _compute_dtype(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV) != torch.float32:
        return False
    if torch.are_deterministic_algorithms_enabled() or _load_fla()[0] is None:
        return False
    Hk, Dk = q_BTHD.shape[2:]
    Hv, Dv = v_BTHV.shape[2:]
    B, T = q_BTHD.shape[:2]
    return fla_backward_trusted(Hk, Hv, Dk, Dv, q_BTHD.dtype, str(q_BTHD.device), B, T)


def gated_delta_rule(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV=None, *, l2norm_qk: bool = True):
    """The differentiable gated delta rule: `chunk_gated_delta_rule`'s arguments and results (`l2norm_qk=False`: q
    and k come normalised). fla's chunk kernels forward and backward on CUDA where `fla_backward_trusted` at this
    shape (and not in deterministic mode, nor under `differentiable_rule("torch")`), composed here keeping what fla's
    backward recomputes under `differentiable_rule("kept")`; the torch chunk rule otherwise."""
    _check_shapes(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV)
    inputs = (q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV)
    if _fla_differentiable(*inputs):
        fla_chunk, fla_version = _load_fla()
        if _kept_states_apply(l2norm_qk):
            return _kept_states(*inputs)
        return _fla_forward(fla_chunk, fla_version, *inputs, l2norm_qk=l2norm_qk)
    return chunk_gated_delta_rule(*inputs, l2norm_qk=l2norm_qk)
