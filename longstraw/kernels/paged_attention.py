"""Exact attention of live queries over resident prefix K/V pages plus their own causal K/V.

Algorithm (ring-attention style, one ``torch.autograd.Function`` with its own backward):

* forward: the causal live block, then the prefix ``block_size`` keys at a time, each yield a
  partial ``(out_b, lse_b)``; these are merged into a running float32 ``(out, lse)`` with
  ``lse' = logaddexp(lse, lse_b)``, ``out' = out * exp(lse - lse') + out_b * exp(lse_b - lse')``.
  Only q, k_live, v_live, out, lse and *references* to the prefix tensors are kept; no [R, P]
  score matrix and no copy of the prefix is ever made.
* backward: every block is recomputed against the GLOBAL out and lse:
  ``P = exp(S - lse)``, ``delta = rowsum(dO * O)``, ``dS = P * (dP - delta)``; dq sums over all
  blocks, dk/dv come out per block (live: when needed; prefix: only when the prefix tensors
  require grad, otherwise the prefix costs only its dq share; on CUDA, under `prefix_backward_kernel("dq")`,
  `attention_dq_triton`: three products a block where flash's and cuDNN's backward run five).

GQA follows HF's ``repeat_kv``: query head h reads kv head ``h // G`` with ``G = H // Hk``.
Prefix blocks fold the query group into the query length (q viewed as [B, Hk, G*R, D]), so
K/V are never repeated; the small causal live block is folded (math) or repeated (cuda).

Attention sinks (gpt-oss): ``sinks`` gives one learned logit per query head. HF's eager attention appends it
as one more column of the scores, softmaxes and drops it: one more key of score ``sinks[h]`` and value 0, so
it is one more block with ``(out_b, lse_b) = (0, sinks[h])`` merged into the running result
(``merge_sinks_``). The backward is the same one fed the global out and lse (which include it): a value-0
key adds nothing to dq, dk or dv. The sinks' own gradient is ``-sum_rows exp(sinks[h] - lse) * delta``
(``sink_gradient``: the sink column's ``dS = P * (dP - delta)`` with ``dP = dO . 0``).

Backends: ``"math"`` is plain torch (any device, any float dtype, float64 computed in float64).
``"cuda"`` (alias ``"flash"``) runs each block through ``aten._scaled_dot_product_flash_attention``
and its ``_backward`` op fed the global out/lse (CUDA, fp16/bf16, D == Dv, D % 8 == 0, D <= 256;
otherwise math).  ``"cudnn"`` runs forward and backward through ``aten._scaled_dot_product_cudnn_attention``
and its ``_backward``, the causal live block's backward included; that backward rejects s_q = s_kv = 1
and crashed the process on some small shapes, so it is an opt-in only (D <= 128).  ``"auto"`` takes
kernel ``"cudnn_blocks"`` when cuDNN is there, D <= 256 and the queries are at least ``CUDNN_MIN_ROWS``:
cuDNN's forward on every block of at least ``CUDNN_MIN_ROWS`` keys (about twice flash's on the H200, at
head dim 256 too) and cuDNN's backward on such prefix blocks (1.66x flash's on replay's block at head
dim 256), flash's on shorter blocks, on the causal live block's backward and in the deterministic
mode; flash otherwise, math off CUDA.
The choice depends on the shapes only, so capture, scoring (old policy, reference) and replay of the
same response run one forward kernel: at the on-policy point the ratio GRPO clips is exactly 1.
``forward_kernel("flash")`` (a point's ``model.attention_kernel``; ``LONGSTRAW_FORWARD_KERNEL=flash`` in the
environment sets the default) keeps "auto" on flash throughout: no cuDNN plan builds in a cold step.

Checkpointed replay (``ForwardMemo``): a checkpointed layer's forward keeps
each call's (out, lse), a few MB, and its recompute in the backward takes them back instead of
attending over the prefix again: the kernels' forward is deterministic, so it would recompute the
same tensors, at the cost of a second pass over every prefix key.

The prefix tensors are held by plain reference, without autograd's version check, because
they are usually views of a page buffer that keeps being written past ``P``; the caller must
not overwrite the first ``P`` positions between forward and backward.

Shape letters: B batch, H query heads, K kv heads, G = H // K, R live length, P prefix length,
N keys in one block, M = G * R folded query rows, D head dim.
"""

from __future__ import annotations

import functools
import numbers
import os
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from longstraw.kernels.optional_import import optional_function
from longstraw.kernels.process_setting import ProcessSetting

__all__ = [
    "paged_attention",
    "decode_attention",
    "reference_attention",
    "check_sinks",
    "ForwardMemo",
    "forward_kernel",
    "MATH_BLOCK_SIZE",
    "CUDA_BLOCK_SIZE",
]

MATH_BLOCK_SIZE = 4096
ONE_SOFTMAX_SCORES = 1 << 24  # a decoding step's scores held whole (64 MB in float32): `_decode_one_softmax`
CUDA_BLOCK_SIZE = 65536
CUDNN_MIN_ROWS = 128
FORWARD_KERNELS = ("cudnn", "flash")  # what "auto" runs on CUDA: cuDNN blocks where they apply, or flash throughout
_BACKENDS = ("auto", "math", "cuda", "flash", "cudnn")


def _kernel_from_environment() -> str:
    name = os.environ.get("LONGSTRAW_FORWARD_KERNEL", "cudnn")
    if name not in FORWARD_KERNELS:
        raise ValueError(f"LONGSTRAW_FORWARD_KERNEL={name!r}: one of {FORWARD_KERNELS}")
    return name


_forward_kernel = ProcessSetting("forward kernel", FORWARD_KERNELS, _kernel_from_environment())


def forward_kernel(name: str):
    """Within the block, "auto" runs `name` on CUDA: "cudnn" (cuDNN's kernels on blocks of at least
    CUDNN_MIN_ROWS; fastest in steady state, but each new shape builds a plan, 0.5-1.1 s on the H200, in the
    first call that meets it) or "flash" (no plan builds: a process's first step pays none)."""
    return _forward_kernel.within(name)


# a prefix that takes no gradient (replay's pages): "dq" runs `attention_dq_triton` on its blocks, the three
# products dQ needs; "library" the block kernel's own backward (cuDNN's or flash's), dK and dV computed and dropped.
# On the H200 at hybrid-1b's member batch "dq" took 1.42 ms against cuDNN's 2.55 (`benchmarks/attention_dq.py`)
PREFIX_BACKWARD_KERNELS = ("dq", "library")
_prefix_backward_kernel = ProcessSetting("prefix backward kernel", PREFIX_BACKWARD_KERNELS, "dq")


def prefix_backward_kernel(name: str):
    """Within the block, a CUDA backward over prefix blocks that take no gradient runs `name`: "dq" or "library"
    (`PREFIX_BACKWARD_KERNELS`)."""
    return _prefix_backward_kernel.within(name)


_load_dq = functools.partial(optional_function, "longstraw.kernels.attention_dq_triton", "attention_dq_triton")
_load_dq_usable = functools.partial(optional_function, "longstraw.kernels.attention_dq_triton", "dq_usable")
# a decoding step's attention in two launches (`decode_attention_triton`) and its applicability test
_load_decode_triton = functools.partial(
    optional_function, "longstraw.kernels.decode_attention_triton", "decode_attention_triton"
)
_load_decode_usable = functools.partial(optional_function, "longstraw.kernels.decode_attention_triton", "decode_usable")


def _dq_only(q_BHRD, k_BKPD) -> bool:
    """Whether the prefix's blocks run the dq-only kernel: chosen, and it imports and computes these tensors."""
    if _prefix_backward_kernel.value != "dq" or _load_dq() is None:
        return False
    return _load_dq_usable()(q_BHRD, k_BKPD)


def paged_attention(
    q_BHRD: torch.Tensor,
    k_prefix_BKPD: torch.Tensor,
    v_prefix_BKPD: torch.Tensor,
    k_live_BKRD: torch.Tensor,
    v_live_BKRD: torch.Tensor,
    *,
    scale: float,
    block_size: int | None = None,
    backend: str = "auto",
    prefix_again=None,
    capture: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` over all prefix keys and the causal live keys; returns [B, H, R, Dv].

    ``capture=True`` marks a capture chunk: graph-free, which is checked. ``sinks`` ([H], optional): one
    attention-sink logit per query head (module doc); its gradient is computed when it requires grad.

    ``prefix_again``, when given, returns the prefix (k, v) anew for the backward, and the graph
    keeps no reference to the prefix given here: pages streamed from host memory then live on the
    device for the forward only (the prefix must not require grad)."""
    _validate(q_BHRD, k_prefix_BKPD, v_prefix_BKPD, k_live_BKRD, v_live_BKRD, scale, block_size, backend)
    check_sinks(sinks, q_BHRD, "paged_attention")
    if prefix_again is not None and (k_prefix_BKPD.requires_grad or v_prefix_BKPD.requires_grad):
        raise ValueError(
            "prefix_again brings the prefix back for the backward: a prefix that requires grad "
            "(exact mode) must stay referenced"
        )
    inputs = (q_BHRD, k_prefix_BKPD, v_prefix_BKPD, k_live_BKRD, v_live_BKRD) + (() if sinks is None else (sinks,))
    if capture and torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        raise ValueError("paged_attention: capture=True is graph-free, but an input requires grad")
    kernel, block_size = kernel_and_block(backend, q_BHRD, v_live_BKRD.shape[-1], block_size)
    if capture and k_prefix_BKPD.shape[2] == 0 and sinks is None and kernel != "math":
        return _causal_capture(q_BHRD, k_live_BKRD, v_live_BKRD, float(scale), kernel)
    return _PagedAttention.apply(
        q_BHRD,
        k_prefix_BKPD,
        v_prefix_BKPD,
        k_live_BKRD,
        v_live_BKRD,
        float(scale),
        int(block_size),
        kernel,
        prefix_again,
        sinks,
    )


def _causal_capture(q_BHRD, k_live_BKRD, v_live_BKRD, scale: float, kernel: str) -> torch.Tensor:
    """A capture chunk with nothing before it (the whole prompt, when it fits one chunk): one causal call of the
    block kernel on q as HF hands it over ([B, H, T, D] over [B, T, H, D] memory), its output as the kernel gives it,
    in q's dtype. The general path's float32 partial, which has nothing to merge here, and its contiguous q, kept for
    a backward a capture never runs, were 0.5 ms of copies in hybrid-1b's 32,768-token capture on an H100 (the
    sources of `hybrid_step_profile_3574e82.json`; none in `..._5c581c2.json`). cuDNN writes its output contiguous as
    [B, H, T, D] whatever q's layout, so the caller's transpose back is still a copy."""
    G = q_BHRD.shape[1] // k_live_BKRD.shape[1]
    block_fwd = _CUDA_KERNELS[kernel][0]
    return block_fwd(q_BHRD, _repeat_kv(k_live_BKRD, G), _repeat_kv(v_live_BKRD, G), scale, causal=True)[0]


@torch.no_grad()
def decode_attention(
    q_BHTD,
    k_shared_1KPD,
    v_shared_1KPD,
    k_own_BKND,
    v_own_BKND,
    own_step_1=None,
    *,
    scale: float,
    block_size: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decoding step of B sequences that share one prefix: each query (T == 1) attends the
    shared prefix pages (batch 1, never copied per sequence) and its own sequence's keys so far,
    the current token's included (with `own_step_1`, a long [1] on the device: the own slots up to that index, so
    the step's shapes do not change as the sequences grow). Graph-free; returns [B, H, 1, Dv] in q's dtype.

    The shared part folds the B sequences and the query group into one row axis
    ([1, K, B * G, D]), as replay folds the group, so the prefix is read once for all sequences. On CUDA, with
    `own_step_1`, `decode_attention_triton` computes it in two launches where it applies (`decode_usable`).
    """
    if own_step_1 is not None and block_size is None:
        usable = _load_decode_usable()
        if usable is not None and usable(q_BHTD, k_shared_1KPD, v_shared_1KPD, k_own_BKND):
            check_sinks(sinks, q_BHTD, "decode_attention")
            return _load_decode_triton()(
                q_BHTD, k_shared_1KPD, v_shared_1KPD, k_own_BKND, v_own_BKND, own_step_1, scale, sinks
            )
        B, H = q_BHTD.shape[:2]
        if sinks is None and H * B * (k_shared_1KPD.shape[2] + k_own_BKND.shape[2]) <= ONE_SOFTMAX_SCORES:
            return _decode_one_softmax(q_BHTD, k_shared_1KPD, v_shared_1KPD, k_own_BKND, v_own_BKND, own_step_1, scale)
    return decode_partial(
        q_BHTD,
        k_shared_1KPD,
        v_shared_1KPD,
        k_own_BKND,
        v_own_BKND,
        own_step_1,
        scale=scale,
        block_size=block_size,
        sinks=sinks,
    )[0].to(q_BHTD.dtype)


def _decode_one_softmax(q_BHTD, k_shared_1KPD, v_shared_1KPD, k_own_BKND, v_own_BKND, own_step_1, scale: float):
    """`decode_attention` as one softmax a row over the prefix's keys and its sequence's own (the unwritten slots
    masked), the rows of a K/V head folded over the prefix: some thirty ops a layer where `decode_partial`'s block
    merges take about eighty (a CPU decoding step is dispatch-bound, so no op runs that changes nothing, such as a
    cast to the dtype a tensor has). Its scores are held whole (`ONE_SOFTMAX_SCORES` at most)."""
    B, H, _, D = q_BHTD.shape
    K, P, N = k_shared_1KPD.shape[1], k_shared_1KPD.shape[2], k_own_BKND.shape[2]
    G, acc = H // K, _acc_dtype(q_BHTD.dtype)

    def cast(t):
        return t if t.dtype == acc else t.to(acc)

    q_KBGD = cast(q_BHTD.reshape(B, K, G, D).transpose(0, 1) * scale)
    shared_KMP = q_KBGD.reshape(K, B * G, D) @ cast(k_shared_1KPD[0]).transpose(1, 2)
    own_KBGN = torch.einsum("kbgd,bknd->kbgn", q_KBGD, cast(k_own_BKND))
    scores_KBGS = torch.cat([shared_KMP.view(K, B, G, P), own_KBGN], -1)
    scores_KBGS[..., P:].masked_fill_(torch.arange(N, device=q_BHTD.device) > own_step_1, float("-inf"))
    p_KBGS = torch.softmax(scores_KBGS, -1)
    out_KBGD = (p_KBGS[..., :P].reshape(K, B * G, P) @ cast(v_shared_1KPD[0])).view(K, B, G, -1)
    out_KBGD += torch.einsum("kbgn,bknd->kbgd", p_KBGS[..., P:], cast(v_own_BKND))
    out_BHTD = out_KBGD.transpose(0, 1).reshape(B, H, 1, -1)
    return out_BHTD if out_BHTD.dtype == q_BHTD.dtype else out_BHTD.to(q_BHTD.dtype)


@torch.no_grad()
def decode_partial(
    q_BHTD,
    k_shared_1KPD,
    v_shared_1KPD,
    k_own_BKND=None,
    v_own_BKND=None,
    own_step_1=None,
    *,
    scale: float,
    block_size: int | None = None,
    sinks: torch.Tensor | None = None,
):
    """`decode_attention`'s (out, lse) in the accumulation dtype, before the cast; without own keys
    (None) the rows start from (0, -inf): a partial over the shared pages only. `sinks`: as `paged_attention`."""
    B, H, T, D = q_BHTD.shape
    K, Dv = k_shared_1KPD.shape[1], v_shared_1KPD.shape[3]
    if T != 1:
        raise ValueError(f"decode_attention takes one query per sequence, got T={T}")
    G = H // K
    kernel = _pick_kernel("auto", q_BHTD, Dv)
    block_fwd = _flash_block_fwd if kernel == "flash" else _math_block_fwd
    acc = _acc_dtype(q_BHTD.dtype)
    q_in = q_BHTD if kernel == "flash" else q_BHTD.to(acc)
    if k_own_BKND is None:
        out_BHTD = torch.zeros(B, H, T, Dv, dtype=acc, device=q_BHTD.device)
        lse_BHT = torch.full((B, H, T), float("-inf"), dtype=acc, device=q_BHTD.device)
    elif own_step_1 is not None:  # every slot, the unwritten ones masked: folded as the prefix is, no repeat
        written_1N = torch.arange(k_own_BKND.shape[2], device=q_BHTD.device)[None] <= own_step_1
        q_BKGD = q_BHTD.to(acc).reshape(B, K, G, D)
        out_BKGD, lse_BKG = _math_block_fwd(q_BKGD, k_own_BKND, v_own_BKND, scale, written_1N)
        out_BHTD, lse_BHT = out_BKGD.reshape(B, H, T, Dv), lse_BKG.reshape(B, H, T)
    else:
        out_BHTD, lse_BHT = block_fwd(q_in, _repeat_kv(k_own_BKND, G), _repeat_kv(v_own_BKND, G), scale)
        out_BHTD, lse_BHT = out_BHTD.to(acc).contiguous(), lse_BHT.to(acc).contiguous()
    if sinks is not None:
        check_sinks(sinks, q_BHTD, "decode_attention")
        merge_sinks_(out_BHTD, lse_BHT, sinks)
    P = k_shared_1KPD.shape[2]
    if P:
        q_1KMD = _fold(q_in.reshape(B, K, G, D))
        out_1KMD = torch.zeros(1, K, B * G, Dv, dtype=acc, device=q_BHTD.device)
        lse_1KM = torch.full((1, K, B * G), float("-inf"), dtype=acc, device=q_BHTD.device)
        size = block_size or (MATH_BLOCK_SIZE if kernel == "math" else CUDA_BLOCK_SIZE)
        for start in range(0, P, size):
            blk = slice(start, start + size)
            o_b, l_b = block_fwd(q_1KMD, k_shared_1KPD[:, :, blk], v_shared_1KPD[:, :, blk], scale)
            lse_merge_(out_1KMD, lse_1KM, o_b.to(acc), l_b.to(acc))
        lse_merge_(out_BHTD, lse_BHT, _unfold(out_1KMD, B).reshape(B, H, 1, Dv), _unfold(lse_1KM, B).reshape(B, H, 1))
    return out_BHTD, lse_BHT


def reference_attention(q, k_prefix, v_prefix, k_live, v_live, scale, window=None, sinks=None):
    """Dense reference: concatenate K/V, repeat kv heads, full prefix + causal live mask, softmax. With
    `window` (`window_attention`'s reference): query r (position P + r) sees only keys j > P + r - window.
    With `sinks` ([H]), as HF's eager attention: each head's sink logit one more column of the scores,
    dropped after the softmax."""
    G = q.shape[1] // k_live.shape[1]
    R, P = q.shape[2], k_prefix.shape[2]
    k = torch.cat([k_prefix, k_live], dim=2).repeat_interleave(G, dim=1)
    v = torch.cat([v_prefix, v_live], dim=2).repeat_interleave(G, dim=1)
    allowed_RT = torch.ones(R, P + R, dtype=torch.bool, device=q.device)
    allowed_RT[:, P:] = torch.ones(R, R, dtype=torch.bool, device=q.device).tril()
    if window is not None:
        allowed_RT &= torch.ones(R, P + R, dtype=torch.bool, device=q.device).triu(P - window + 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed_RT, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1] @ v


# ----------------------------------------------------------------------------------------------
# validation and backend choice


def _validate(q, k_prefix, v_prefix, k_live, v_live, scale, block_size, backend):
    named = {"q": q, "k_prefix": k_prefix, "v_prefix": v_prefix, "k_live": k_live, "v_live": v_live}
    _check_tensors(named)
    _check_shapes(named)
    _check_settings(scale, block_size, backend, q.device)


def _check_tensors(named: dict) -> None:
    """Every input a 4-D floating-point tensor, all of one dtype and on one device."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"paged_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"paged_attention: {name} must be 4-D [B, heads, seq, dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"paged_attention: {name} must be a floating-point tensor, got {t.dtype}")
    if len({t.dtype for t in named.values()}) > 1:
        got = ", ".join(f"{n}={t.dtype}" for n, t in named.items())
        raise TypeError(f"paged_attention: all inputs must share one dtype, got {got}")
    if len({t.device for t in named.values()}) > 1:
        got = ", ".join(f"{n}={t.device}" for n, t in named.items())
        raise ValueError(f"paged_attention: all inputs must be on one device, got {got}")


def _check_shapes(named: dict) -> None:
    """The inputs' batch sizes, kv heads, lengths and head dims agree (the prefix may be one prompt's, batch 1)."""
    q, k_prefix, v_prefix, k_live, v_live = named.values()
    B, H, R, D = q.shape
    Hk = k_live.shape[1]
    for name, t in named.items():
        shared = name in ("k_prefix", "v_prefix") and t.shape[0] == 1  # one prompt's pages for B sequences
        if t.shape[0] != B and not shared:
            raise ValueError(f"paged_attention: batch size mismatch: q has {B}, {name} has {t.shape[0]}")
    for name in ("k_prefix", "v_prefix", "v_live"):
        if named[name].shape[1] != Hk:
            raise ValueError(
                f"paged_attention: kv head count mismatch: k_live has {Hk}, {name} has {named[name].shape[1]}"
            )
    if Hk == 0 or H % Hk != 0:
        raise ValueError(f"paged_attention: query heads ({H}) must be a multiple of kv heads ({Hk})")
    if R == 0:
        raise ValueError("paged_attention: q has no live queries (R == 0)")
    for name in ("k_live", "v_live"):
        if named[name].shape[2] != R:
            raise ValueError(f"paged_attention: live length mismatch: q has R={R}, {name} has {named[name].shape[2]}")
    if k_prefix.shape[2] != v_prefix.shape[2]:
        raise ValueError(
            f"paged_attention: prefix length mismatch: k_prefix has {k_prefix.shape[2]}, "
            f"v_prefix has {v_prefix.shape[2]}"
        )
    for name in ("k_prefix", "k_live"):
        if named[name].shape[3] != D:
            raise ValueError(f"paged_attention: head dim mismatch: q has D={D}, {name} has {named[name].shape[3]}")
    if v_prefix.shape[3] != v_live.shape[3]:
        raise ValueError(
            f"paged_attention: value head dim mismatch: v_prefix has {v_prefix.shape[3]}, v_live has {v_live.shape[3]}"
        )


def _check_settings(scale, block_size, backend, device) -> None:
    """`scale` a real number, `block_size` a positive int or None, `backend` one that runs on `device`."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"paged_attention: scale must be a real number, got {type(scale).__name__}")
    if block_size is not None and (
        isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1
    ):
        raise ValueError(f"paged_attention: block_size must be a positive int or None, got {block_size!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"paged_attention: backend must be one of {_BACKENDS}, got {backend!r}")
    if backend in ("cuda", "flash", "cudnn") and device.type != "cuda":
        raise ValueError(f"paged_attention: backend={backend!r} needs CUDA tensors, got device {device}")


def check_sinks(sinks, q_BHRD, what: str) -> None:
    """Refuse `sinks` that are not one floating-point logit per query head of `q_BHRD`, on its device."""
    if sinks is None:
        return
    H = q_BHRD.shape[1]
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (H,) or not sinks.is_floating_point():
        got = (
            f"{sinks.dtype} of shape {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        )
        raise ValueError(f"{what}: sinks must be one floating-point logit per query head ({H},), got {got}")
    if sinks.device != q_BHRD.device:
        raise ValueError(f"{what}: sinks are on {sinks.device}, the queries on {q_BHRD.device}")


def kernel_and_block(backend: str, q_BHRD, Dv: int, block_size: int | None) -> tuple[str, int]:
    """The block kernel for these inputs and the block size (the kernel's default unless given)."""
    kernel = _pick_kernel(backend, q_BHRD, Dv)
    return kernel, block_size or (MATH_BLOCK_SIZE if kernel == "math" else CUDA_BLOCK_SIZE)


CUDNN_BLOCKS_MAX_HEAD_DIM = (
    256  # H200, D=256, replay's block: cuDNN forward 563 TFLOP/s (flash 230), backward 420 (259)
)
CUDNN_BACKWARD_MAX_HEAD_DIM = 128  # the opt-in "cudnn" backend: checked against math at D <= 128 only


def _pick_kernel(backend: str, q_BHRD: torch.Tensor, Dv: int) -> str:
    """'math', 'flash', 'cudnn' or 'cudnn_blocks'; a CUDA kernel only where its constraints hold."""
    D, R = q_BHRD.shape[-1], q_BHRD.shape[2]
    if (
        backend == "math"
        or q_BHRD.device.type != "cuda"
        or q_BHRD.dtype not in (torch.float16, torch.bfloat16)
        or D != Dv
        or D % 8 != 0
    ):
        return "math"
    cudnn_ok = R > 1 and (torch.backends.cudnn.version() or 0) >= 90000
    if backend == "cudnn" and cudnn_ok and D <= CUDNN_BACKWARD_MAX_HEAD_DIM:
        return "cudnn"
    flash_ok = D <= 256 and torch.backends.cuda.is_flash_attention_available()
    if (
        backend == "auto"
        and _forward_kernel.value == "cudnn"
        and cudnn_ok
        and flash_ok
        and D <= CUDNN_BLOCKS_MAX_HEAD_DIM
        and R >= CUDNN_MIN_ROWS
    ):
        return "cudnn_blocks"
    return "flash" if flash_ok else "math"


# ----------------------------------------------------------------------------------------------
# per-block kernels: forward gives (out_b, lse_b), backward gives (dq_b, dk_b, dv_b)


def _math_block_fwd(q_BKMD, k_BKND, v_BKND, scale, allowed_MN=None):
    """q_BKMD already in the accumulation dtype; returns (out acc dtype, lse acc dtype). The scores are the one
    [M, N] tensor made: scaled through q, their row max taken out and exponentiated in place (one pass each over
    M x N, which is where plain torch spends its time on CPU). A row with no allowed key gives (0, -inf)."""
    s_BKMN = (q_BKMD * scale) @ k_BKND.to(q_BKMD.dtype).transpose(-1, -2)
    if allowed_MN is not None:
        s_BKMN.masked_fill_(~allowed_MN, float("-inf"))
    max_BKM1 = s_BKMN.amax(dim=-1, keepdim=True)
    max_BKM1.masked_fill_(max_BKM1 == float("-inf"), 0.0)  # a row with no keys: exp(-inf - 0) = 0 throughout
    p_BKMN = s_BKMN.sub_(max_BKM1).exp_()
    sum_BKM1 = p_BKMN.sum(dim=-1, keepdim=True)
    out_BKMD = (p_BKMN @ v_BKND.to(q_BKMD.dtype)).div_(sum_BKM1.clamp_min(torch.finfo(sum_BKM1.dtype).tiny))
    return out_BKMD, (max_BKM1 + sum_BKM1.log()).squeeze(-1)


def _math_block_bwd(do_BKMD, q_BKMD, k_BKND, v_BKND, lse_BKM, delta_BKM, scale, need_kv, allowed_MN=None):
    """Recompute one block against the global lse/delta. q, dO, lse, delta in the acc dtype. As the forward, one
    [M, N] tensor for the probabilities and one for dS, each made and then changed in place."""
    k_BKND, v_BKND = k_BKND.to(q_BKMD.dtype), v_BKND.to(q_BKMD.dtype)
    s_BKMN = (q_BKMD * scale) @ k_BKND.transpose(-1, -2)
    if allowed_MN is not None:
        s_BKMN.masked_fill_(~allowed_MN, float("-inf"))
    p_BKMN = s_BKMN.sub_(lse_BKM.unsqueeze(-1)).exp_()
    ds_BKMN = (do_BKMD @ v_BKND.transpose(-1, -2)).sub_(delta_BKM.unsqueeze(-1)).mul_(p_BKMN)
    dq_BKMD = (ds_BKMN @ k_BKND).mul_(scale)
    if not need_kv:
        return dq_BKMD, None, None
    dk_BKND = (ds_BKMN.transpose(-1, -2) @ q_BKMD).mul_(scale)
    dv_BKND = p_BKMN.transpose(-1, -2) @ do_BKMD
    return dq_BKMD, dk_BKND, dv_BKND


def _flash_block_fwd(q_BKMD, k_BKND, v_BKND, scale, causal=False):
    out_BKMD, lse_BKM = torch.ops.aten._scaled_dot_product_flash_attention(
        q_BKMD, _last_dim_contiguous(k_BKND), _last_dim_contiguous(v_BKND), 0.0, causal, False, scale=scale
    )[:2]
    return out_BKMD, lse_BKM[..., : q_BKMD.shape[2]]  # some builds pad the lse's query length


def _flash_block_bwd(do_BKMD, q_BKMD, k_BKND, v_BKND, out_BKMD, lse_BKM, scale, causal=False):
    """Flash backward of one block fed the GLOBAL out (for delta) and lse (contiguous fp32)."""
    M, N = q_BKMD.shape[2], k_BKND.shape[2]
    # dropout is 0, so the rng tensors are never read; shapes mirror what the forward returns
    seed = torch.empty(2, dtype=torch.uint64, device=q_BKMD.device)
    offset = torch.empty((), dtype=torch.uint64, device=q_BKMD.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do_BKMD, q_BKMD, _last_dim_contiguous(k_BKND), _last_dim_contiguous(v_BKND), out_BKMD, lse_BKM,
        None, None, M, N, 0.0, causal, seed, offset, scale=scale,
    )  # fmt: skip


_cudnn_lse_4d = True  # the cudnn forward's lse layout ([B, H, M, 1] in torch 2.11), fed back alike


def _cudnn_block_fwd(q_BKMD, k_BKND, v_BKND, scale, causal=False):
    global _cudnn_lse_4d
    out_BKMD, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q_BKMD, _last_dim_contiguous(k_BKND), _last_dim_contiguous(v_BKND), None, True, 0.0, causal, False, scale=scale
    )[:2]
    _cudnn_lse_4d = lse.dim() == 4
    return out_BKMD, lse.reshape(q_BKMD.shape[:3])


def _cudnn_block_bwd(do_BKMD, q_BKMD, k_BKND, v_BKND, out_BKMD, lse_BKM, scale, causal=False):
    """cuDNN backward of one block fed the GLOBAL out and lse. q, dO and out must share one
    (contiguous) layout: cuDNN has crashed on mismatched dO/out strides."""
    M, N = q_BKMD.shape[2], k_BKND.shape[2]
    seed = offset = torch.zeros((), dtype=torch.int64, device=q_BKMD.device)  # unread: dropout is 0
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do_BKMD, q_BKMD, _last_dim_contiguous(k_BKND), _last_dim_contiguous(v_BKND), out_BKMD,
        lse_BKM.unsqueeze(-1) if _cudnn_lse_4d else lse_BKM, seed, offset, None, None, None, M, N, 0.0, causal,
        scale=scale,
    )  # fmt: skip


def _cudnn_large_block_fwd(q_BKMD, k_BKND, v_BKND, scale, causal=False):
    """cuDNN's forward on a block of at least CUDNN_MIN_ROWS keys, flash's on a shorter one (cuDNN
    crashed on small ones)."""
    block_fwd = _cudnn_block_fwd if k_BKND.shape[2] >= CUDNN_MIN_ROWS else _flash_block_fwd
    return block_fwd(q_BKMD, k_BKND, v_BKND, scale, causal)


def _cudnn_large_block_bwd(do_BKMD, q_BKMD, k_BKND, v_BKND, out_BKMD, lse_BKM, scale, causal=False):
    """cuDNN's backward on a prefix block of at least CUDNN_MIN_ROWS keys; flash's on the causal live
    block, on a shorter block, and in the deterministic mode (flash's deterministic backward)."""
    if causal or k_BKND.shape[2] < CUDNN_MIN_ROWS or torch.are_deterministic_algorithms_enabled():
        return _flash_block_bwd(do_BKMD, q_BKMD, k_BKND, v_BKND, out_BKMD, lse_BKM, scale, causal)
    return _cudnn_block_bwd(do_BKMD, q_BKMD, k_BKND, v_BKND, out_BKMD, lse_BKM, scale)


# kernel name -> (block forward, block backward); the backward recomputes against the global out/lse,
# so any forward's (out, lse) feeds any backward
_CUDA_KERNELS = {
    "flash": (_flash_block_fwd, _flash_block_bwd),
    "cudnn": (_cudnn_large_block_fwd, _cudnn_block_bwd),
    "cudnn_blocks": (_cudnn_large_block_fwd, _cudnn_large_block_bwd),
}


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def lse_merge_(out_BKMD, lse_BKM, out_b_BKMD, lse_b_BKM):
    """In-place numerically stable LSE merge of a block's partial result into the running one."""
    lse_new_BKM = torch.logaddexp(lse_BKM, lse_b_BKM)
    out_BKMD.mul_(torch.exp(lse_BKM - lse_new_BKM).unsqueeze(-1))
    out_BKMD.addcmul_(out_b_BKMD, torch.exp(lse_b_BKM - lse_new_BKM).unsqueeze(-1))
    lse_BKM.copy_(lse_new_BKM)


def merge_sinks_(out_BHRD, lse_BHR, sinks_H):
    """Merge attention sinks into a running (out, lse) in place: per head one more key of score sinks[h] and
    value 0 (HF's sink column, which its softmax takes and then drops)."""
    zero = torch.zeros((), dtype=out_BHRD.dtype, device=out_BHRD.device)
    lse_merge_(out_BHRD, lse_BHR, zero.expand_as(out_BHRD), sinks_H.to(lse_BHR.dtype)[:, None].expand_as(lse_BHR))


def sink_gradient(dout_BHRD, out_BHRD, lse_BHR, sinks_H):
    """[H]: the gradient of the sinks, given the output's gradient and the GLOBAL out and lse (which include
    them): the sink column's dS = P * (dP - delta) with P = exp(sinks[h] - lse) and dP = dO . 0, summed over
    the rows."""
    acc = lse_BHR.dtype
    delta_BHR = (dout_BHRD.to(acc) * out_BHRD.to(acc)).sum(-1)
    return -(torch.exp(sinks_H.to(acc)[:, None] - lse_BHR) * delta_BHR).sum((0, 2))


def _shares_prefix(B: int, k_BKPD) -> bool:
    """Whether B > 1 sequences attend one prompt's pages (batch 1): their rows are then folded over it."""
    return B > 1 and k_BKPD.shape[0] == 1


def _fold(x_BKM_):
    """[B, K, M, ...] -> [1, K, B * M, ...] (contiguous): B sequences' rows as rows of one batch."""
    B, K, M = x_BKM_.shape[:3]
    return x_BKM_.transpose(0, 1).reshape(1, K, B * M, *x_BKM_.shape[3:]).contiguous()  # B = 1 may be a view


def _unfold(x_1KF_, B: int):
    """The inverse of `_fold`: [1, K, B * M, ...] -> [B, K, M, ...] (a view of a transposed copy)."""
    K, F = x_1KF_.shape[1:3]
    return x_1KF_.reshape(K, B, F // B, *x_1KF_.shape[3:]).transpose(0, 1)


def _causal_allowed_MR(G, R, device):
    """Folded row m is live query m % R; it may see live keys j <= m % R."""
    r_M = torch.arange(G * R, device=device) % R
    return torch.arange(R, device=device).unsqueeze(0) <= r_M.unsqueeze(1)


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------


def attention_partial(q_BHRD, k_BKPD, v_BKPD, k_live_BKRD, v_live_BKRD, scale, block_size, kernel, sinks=None):
    """One partial result ``(out_BHRD, lse_BHR)`` in the accumulation dtype: ``q`` over the prefix
    blocks and, when ``k_live_BKRD`` is given, the causal live block, merged block by block (and the
    ``sinks``, when given).
    Rows with no keys at all come out as (0, -inf), which a later merge ignores. For the
    CUDA kernels ``q_BHRD`` must be contiguous (q, out and dO share one layout)."""
    B, H, R, D = q_BHRD.shape
    K, P, Dv = k_BKPD.shape[1], k_BKPD.shape[2], v_BKPD.shape[3]
    G, M = H // K, H // K * R
    acc = _acc_dtype(q_BHRD.dtype)
    if kernel != "math":
        block_fwd = _CUDA_KERNELS[kernel][0]
        q_BKMD = q_BHRD.view(B, K, M, D)
    else:
        block_fwd = _math_block_fwd
        q_BKMD = q_BHRD.reshape(B, K, M, D).to(acc)

    if k_live_BKRD is None:
        out_BHRD = torch.zeros(B, H, R, Dv, dtype=acc, device=q_BHRD.device)
        lse_BHR = torch.full((B, H, R), float("-inf"), dtype=acc, device=q_BHRD.device)
    elif kernel != "math":
        o_BHRD, l_BHR = block_fwd(q_BHRD, _repeat_kv(k_live_BKRD, G), _repeat_kv(v_live_BKRD, G), scale, causal=True)
        out_BHRD = o_BHRD.to(acc, memory_format=torch.contiguous_format)
        lse_BHR = l_BHR.contiguous()
    else:
        allowed_MR = _causal_allowed_MR(G, R, q_BHRD.device)
        o_BKMD, l_BKM = _math_block_fwd(q_BKMD, k_live_BKRD, v_live_BKRD, scale, allowed_MR)
        out_BHRD, lse_BHR = o_BKMD.view(B, H, R, Dv), l_BKM.view(B, H, R)
    if sinks is not None:
        merge_sinks_(out_BHRD, lse_BHR, sinks)

    out_BKMD, lse_BKM = out_BHRD.view(B, K, M, Dv), lse_BHR.view(B, K, M)
    if _shares_prefix(B, k_BKPD) and P:  # B sequences over one prompt's pages: their rows folded, the pages read once
        out_1KFD = torch.zeros(1, K, B * M, Dv, dtype=acc, device=q_BHRD.device)
        lse_1KF = torch.full((1, K, B * M), float("-inf"), dtype=acc, device=q_BHRD.device)
        q_1KFD = _fold(q_BKMD)
        for start in range(0, P, block_size):
            blk = slice(start, start + block_size)
            lse_merge_(out_1KFD, lse_1KF, *block_fwd(q_1KFD, k_BKPD[:, :, blk], v_BKPD[:, :, blk], scale))
        lse_merge_(out_BKMD, lse_BKM, _unfold(out_1KFD, B), _unfold(lse_1KF, B))
        return out_BHRD, lse_BHR
    for start in range(0, P, block_size):
        blk = slice(start, start + block_size)
        lse_merge_(out_BKMD, lse_BKM, *block_fwd(q_BKMD, k_BKPD[:, :, blk], v_BKPD[:, :, blk], scale))
    return out_BHRD, lse_BHR


def attention_partial_backward(
    dout_BHRD, q_BHRD, k_BKPD, v_BKPD, k_live_BKRD, v_live_BKRD, out_BHRD, lse_BHR, scale, block_size, kernel, needs
):
    """Gradients of one partial (as `attention_partial` computed it) fed the GLOBAL ``out`` (in q's
    dtype) and ``lse``: every block is recomputed against them, so partials computed apart (blocks,
    or ranks) give the exact gradient of their merged result. ``needs`` = (q, k_prefix, v_prefix,
    k_live, v_live) flags; returns (dq in the accumulation dtype, dk_prefix, dv_prefix, dk_live,
    dv_live), None where not needed or (live) not given."""
    need_q, need_kp, need_vp, need_kl, need_vl = needs
    need_prefix = need_kp or need_vp
    need_live = k_live_BKRD is not None and (need_q or need_kl or need_vl)
    live = (k_live_BKRD, v_live_BKRD) if need_live else None
    dq_BHRD = torch.zeros(q_BHRD.shape, dtype=lse_BHR.dtype, device=q_BHRD.device)
    dq_only = False
    if kernel != "math":
        rows, block_bwd, dq_only, (dk_live_BKRD, dv_live_BKRD) = _library_backward(
            kernel, dout_BHRD, q_BHRD, out_BHRD, lse_BHR, k_BKPD, live, scale, need_prefix, dq_BHRD
        )
    else:
        rows, block_bwd, (dk_live_BKRD, dv_live_BKRD) = _math_backward(
            dout_BHRD, q_BHRD, out_BHRD, lse_BHR, v_BKPD, live, scale, need_prefix, need_kl or need_vl, dq_BHRD
        )
    dk_BKPD = dv_BKPD = None
    if need_q or need_prefix:
        dk_BKPD, dv_BKPD = _prefix_backward(k_BKPD, v_BKPD, rows, block_bwd, dq_BHRD, block_size, need_prefix, dq_only)
    return (
        dq_BHRD if need_q else None,
        dk_BKPD if need_kp else None,
        dv_BKPD if need_vp else None,
        dk_live_BKRD if need_kl and dk_live_BKRD is not None else None,
        dv_live_BKRD if need_vl and dv_live_BKRD is not None else None,
    )


def _library_backward(kernel, dout_BHRD, q_BHRD, out_BHRD, lse_BHR, k_BKPD, live, scale, need_prefix, dq_BHRD):
    """The CUDA kernels' half of `attention_partial_backward`: the live block's gradients (causal; its dq added
    into `dq_BHRD`), and the prefix blocks' rows and per-block backward: dQ alone (`_load_dq`) where the prefix
    takes no gradient and `_dq_only` allows it, else the library's. Returns (rows, block_bwd, dq_only,
    (dk_live, dv_live))."""
    B, H, R, D = q_BHRD.shape
    K = k_BKPD.shape[1]
    G, M = H // K, H // K * R
    kernel_bwd = _CUDA_KERNELS[kernel][1]
    dout_BHRD = dout_BHRD.contiguous()  # q and out are contiguous already
    do_BKMD, q_BKMD, out_BKMD = (x.view(B, K, M, D) for x in (dout_BHRD, q_BHRD, out_BHRD))
    rows = (do_BKMD, q_BKMD, out_BKMD, lse_BHR.view(B, K, M))
    dq_only = not need_prefix and _dq_only(q_BHRD, k_BKPD)
    if dq_only:
        dq_kernel = _load_dq()

        def block_bwd(k_BKND, v_BKND, do, q, out, lse, dq_acc):
            dq_kernel(do, q, k_BKND, v_BKND, out, lse, scale, dq_acc)
            return None, None

    else:

        def block_bwd(k_BKND, v_BKND, do, q, out, lse, dq_acc):
            dq_b, dk_b, dv_b = kernel_bwd(do, q, k_BKND, v_BKND, out, lse, scale)
            dq_acc += dq_b
            return dk_b, dv_b

    if live is None:
        return rows, block_bwd, dq_only, (None, None)
    k_live_BKRD, v_live_BKRD = live
    dq_b, dk_b, dv_b = kernel_bwd(
        dout_BHRD, q_BHRD, _repeat_kv(k_live_BKRD, G), _repeat_kv(v_live_BKRD, G), out_BHRD, lse_BHR, scale,
        causal=True,
    )  # fmt: skip
    dq_BHRD += dq_b
    return rows, block_bwd, dq_only, (dk_b.unflatten(1, (K, G)).sum(2), dv_b.unflatten(1, (K, G)).sum(2))


def _math_backward(dout_BHRD, q_BHRD, out_BHRD, lse_BHR, v_BKPD, live, scale, need_prefix, need_live_kv, dq_BHRD):
    """The math half of `attention_partial_backward`, in the accumulation dtype: the live block's gradients
    (causal; its dq added into `dq_BHRD`), and the prefix blocks' rows and per-block backward. Returns (rows,
    block_bwd, (dk_live, dv_live))."""
    B, H, R, D = q_BHRD.shape
    K, Dv = v_BKPD.shape[1], v_BKPD.shape[3]
    G, M = H // K, H // K * R
    acc = lse_BHR.dtype
    lse_BKM = lse_BHR.view(B, K, M)
    do_BKMD = dout_BHRD.reshape(B, K, M, Dv).to(acc)
    q_BKMD = q_BHRD.reshape(B, K, M, D).to(acc)
    delta_BKM = (do_BKMD * out_BHRD.view(B, K, M, Dv).to(acc)).sum(-1)
    rows = (do_BKMD, q_BKMD, delta_BKM, lse_BKM)

    def block_bwd(k_BKND, v_BKND, do, q, delta, lse, dq_acc):
        dq_b, dk_b, dv_b = _math_block_bwd(do, q, k_BKND, v_BKND, lse, delta, scale, need_prefix)
        dq_acc += dq_b
        return dk_b, dv_b

    if live is None:
        return rows, block_bwd, (None, None)
    allowed_MR = _causal_allowed_MR(G, R, q_BHRD.device)
    dq_b, dk_live_BKRD, dv_live_BKRD = _math_block_bwd(
        do_BKMD, q_BKMD, *live, lse_BKM, delta_BKM, scale, need_live_kv, allowed_MR
    )
    dq_BHRD.view(B, K, M, D).add_(dq_b)
    return rows, block_bwd, (dk_live_BKRD, dv_live_BKRD)


def _prefix_backward(k_BKPD, v_BKPD, rows, block_bwd, dq_BHRD, block_size, need_prefix, dq_only):
    """The prefix's blocks of `attention_partial_backward`, `block_size` keys at a time: their dq added into
    `dq_BHRD`; returns (dk_prefix, dv_prefix), None unless `need_prefix`."""
    B, H, R, D = dq_BHRD.shape
    K, P = k_BKPD.shape[1], k_BKPD.shape[2]
    M = H // K * R
    dq_BKMD = dq_BHRD.view(B, K, M, D)
    dk_BKPD = dv_BKPD = None
    if need_prefix:
        dk_BKPD = torch.empty(k_BKPD.shape, dtype=k_BKPD.dtype, device=k_BKPD.device)
        dv_BKPD = torch.empty(v_BKPD.shape, dtype=v_BKPD.dtype, device=v_BKPD.device)
    # as the forward folded the B sequences' rows over one prefix; the dq kernel reads one prompt's pages for each
    # sequence's rows itself (its row blocks read every key either way)
    shared = _shares_prefix(B, k_BKPD) and not dq_only
    dq_acc = dq_BKMD  # float32 and contiguous, as the dq-only kernel adds into it
    if shared:
        rows = tuple(_fold(x) for x in rows)
        dq_acc = torch.zeros(1, K, B * M, D, dtype=dq_BHRD.dtype, device=dq_BHRD.device)
    for start in range(0, P, block_size):
        blk = slice(start, start + block_size)
        dk_b, dv_b = block_bwd(k_BKPD[:, :, blk], v_BKPD[:, :, blk], *rows, dq_acc)
        if need_prefix:
            dk_BKPD[:, :, blk] = dk_b
            dv_BKPD[:, :, blk] = dv_b
    if shared and P:
        dq_BKMD += _unfold(dq_acc, B)
    return dk_BKPD, dv_BKPD


class ForwardMemo:
    """The (out, lse) of each paged-attention forward run while `remembering`, given back in the same
    order on each entry into `reusing`: a checkpointed segment's forward remembers, its recompute in
    the backward reuses, and so skips a second pass over the prefix (see the module doc)."""

    def __init__(self):
        self._outputs = []
        self._next = 0

    def remembering(self):
        return self._active(reuse=False)

    def reusing(self):
        self._next = 0  # each recompute replays the forward's calls from the first
        return self._active(reuse=True)

    @contextmanager
    def _active(self, reuse: bool):
        token = _ACTIVE_MEMO.set((self, reuse))
        try:
            yield
        finally:
            _ACTIVE_MEMO.reset(token)

    def keep(self, q_BHRD, out_BHRD, lse_BHR):
        self._outputs.append((q_BHRD.shape, out_BHRD, lse_BHR))

    def take(self, q_BHRD):
        if self._next == len(self._outputs):
            raise RuntimeError("ForwardMemo: a recompute ran more paged-attention calls than its forward did")
        shape, out_BHRD, lse_BHR = self._outputs[self._next]
        if shape != q_BHRD.shape:
            raise RuntimeError(
                f"ForwardMemo: the recompute's call has queries {tuple(q_BHRD.shape)}, "
                f"its forward's had {tuple(shape)}: the calls came in another order"
            )
        self._next += 1
        return out_BHRD, lse_BHR


_ACTIVE_MEMO: ContextVar[tuple[ForwardMemo, bool] | None] = ContextVar("paged_attention_memo", default=None)


class _PagedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHRD, k_BKPD, v_BKPD, k_BKRD, v_BKRD, scale, block_size, kernel, prefix_again, sinks):
        if kernel != "math":
            q_BHRD = q_BHRD.contiguous()  # one layout for q, out and dO (cudnn needs it; small)
        memo, reuse = _ACTIVE_MEMO.get() or (None, False)
        if reuse:
            out_BHRD, lse_BHR = memo.take(q_BHRD)
        else:
            out_BHRD, lse_BHR = attention_partial(
                q_BHRD, k_BKPD, v_BKPD, k_BKRD, v_BKRD, scale, block_size, kernel, sinks
            )
            out_BHRD = out_BHRD.to(q_BHRD.dtype)
            if memo is not None:
                memo.keep(q_BHRD, out_BHRD, lse_BHR)
        ctx.save_for_backward(q_BHRD, k_BKRD, v_BKRD, out_BHRD, lse_BHR, sinks)
        # references only: no copy, no version check (see module doc); or none, and fetched again
        ctx.prefix = prefix_again or (k_BKPD, v_BKPD)
        ctx.scale, ctx.block_size, ctx.kernel = scale, block_size, kernel
        return out_BHRD

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout_BHRD):
        q_BHRD, k_BKRD, v_BKRD, out_BHRD, lse_BHR, sinks = ctx.saved_tensors
        prefix = ctx.prefix() if callable(ctx.prefix) else ctx.prefix
        dq, dk_p, dv_p, dk_l, dv_l = attention_partial_backward(
            dout_BHRD, q_BHRD, *prefix, k_BKRD, v_BKRD, out_BHRD, lse_BHR, ctx.scale, ctx.block_size, ctx.kernel,
            ctx.needs_input_grad[:5],
        )  # fmt: skip
        # the blocks above were recomputed against the lse that holds the sinks; the sinks' own gradient:
        dsinks = sink_gradient(dout_BHRD, out_BHRD, lse_BHR, sinks).to(sinks.dtype) if ctx.needs_input_grad[9] else None
        return (
            dq.to(q_BHRD.dtype) if dq is not None else None,
            dk_p,
            dv_p,
            dk_l.to(k_BKRD.dtype) if dk_l is not None else None,
            dv_l.to(v_BKRD.dtype) if dv_l is not None else None,
            None,
            None,
            None,
            None,
            dsinks,
        )


def _repeat_kv(x_BKRD, G):
    return x_BKRD if G == 1 else x_BKRD.repeat_interleave(G, dim=1)
