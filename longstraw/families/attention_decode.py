"""A decoding step's attention layer in five launches, where HF's module would take ten.

HF's attention module runs q, k and v as three GEMMs, rotates q and k (two launches), and a decoding entry writes k
and v into its own pages (two more) before the two attention launches and o_proj. For the modules whose forward is
exactly projections, optional q/k norms on the head dim, HF's rotate-half rotary, attention over the entry and
o_proj (`PLAIN_MODULES`), a decoding step here runs: q, k and v from one stacked GEMM
(`models.stacked_projections`), the q/k norms where the module has them, q and k rotated and k and v written into
the sequence's own pages in one launch (`kernels.rope_append_triton` on CUDA), the entry's attention over the shared
prompt and its own pages, o_proj. Anywhere else (no stacking, a module with an output gate, attention sinks, a
sliding window or another rotary form, an entry that is not `state.pages.DecodePages`) `decode_attention_mix`
returns None and the caller runs HF's module, the reference (tests/test_decode_fast_path.py compares them).
`attend_stacked` is the path from the stacked projection's output to the heads' output before o_proj, which
`families.folded_norms` also takes (its projection read the un-normed rows, which the rotary launch scales).
"""

from __future__ import annotations

import functools
import sys

from longstraw.kernels.optional_import import optional_function
from longstraw.kernels.rms_norm import rms_norm, rms_scale
from longstraw.models.stacked_projections import stacked_linear
from longstraw.state.pages import DecodePages, OwnPages

# HF attention classes whose forward is q/k/v projections, q_norm/k_norm on [B, T, heads, D] where present, the
# rotate-half rotary of their modeling file, the attention call and o_proj, nothing else
PLAIN_MODULES = ("LlamaAttention", "Qwen3Attention")

_load_rope_append = functools.partial(optional_function, "longstraw.kernels.rope_append_triton", "rope_append_triton")
_load_usable = functools.partial(optional_function, "longstraw.kernels.rope_append_triton", "rope_append_usable")


def _plain(attn_module, pages) -> bool:
    config = attn_module.config
    return (
        type(attn_module).__name__ in PLAIN_MODULES
        and isinstance(pages, DecodePages)
        and not getattr(attn_module, "sliding_window", None)
        and attn_module.q_proj.out_features == config.num_attention_heads * attn_module.head_dim
    )


def rope_append_reference(attn_module, q_B1HD, k_B1KD, v_B1KD, cos, sin, own: OwnPages):
    """q rotated [B, H, 1, D]; k rotated and v appended to `own`: the module's modeling file's `apply_rotary_pos_emb`
    (HF's, or the fused one `kernels.rotary` swaps in), then `OwnPages.append`."""
    apply_rotary = sys.modules[type(attn_module).__module__].apply_rotary_pos_emb
    q_BH1D, k_BK1D = apply_rotary(q_B1HD.transpose(1, 2), k_B1KD.transpose(1, 2), cos, sin)
    own.append(k_BK1D, v_B1KD.transpose(1, 2))
    return q_BH1D


def _rope_append(attn_module, q_B1HD, k_B1KD, v_B1KD, cos, sin, own: OwnPages, rms_of=None):
    x_B1X = None if rms_of is None else rms_of[0]
    usable = _load_usable()
    if usable is not None and usable(q_B1HD, k_B1KD, v_B1KD, cos, own.k_BKND, own.v_BKND, x_B1X):
        step_1 = own.clock.step_1
        return _load_rope_append()(q_B1HD, k_B1KD, v_B1KD, cos, sin, own.k_BKND, own.v_BKND, step_1, rms_of)
    if rms_of is not None:  # the kernel's row scale first, in float32 or wider, rounded once
        scale_B111 = rms_scale(*rms_of)[..., None]
        q_B1HD, k_B1KD, v_B1KD = ((t * scale_B111).to(t.dtype) for t in (q_B1HD, k_B1KD, v_B1KD))
    return rope_append_reference(attn_module, q_B1HD, k_B1KD, v_B1KD, cos, sin, own)


def plain_decoding(attn_module, x_BTH, pages) -> bool:
    """Whether `attn_module` on `pages` with input `x_BTH` is a decoding step this module's path applies to (before
    its projections stack)."""
    return x_BTH.shape[1] == 1 and _plain(attn_module, pages)


def attend_stacked(attn_module, qkv_B1X, position_embeddings, pages, rms_of=None):
    """The heads' output [B, 1, H D] (o_proj's input) of one decoding step from the stacked q/k/v projection's output:
    q/k norms where the module has them, rotary and append in one launch, the entry's attention. `rms_of` (x, eps):
    the projection read the un-normed rows x with an RMSNorm folded into its weight, so q, k and v are first scaled by
    each row's rsqrt(mean(x^2) + eps) (a module without q/k norms, which would have to follow the scale)."""
    B, D, config = qkv_B1X.shape[0], attn_module.head_dim, attn_module.config
    H, K = config.num_attention_heads, config.num_key_value_heads
    q, k, v = qkv_B1X.split([H * D, K * D, K * D], -1)
    q, k, v = q.view(B, 1, H, D), k.view(B, 1, K, D), v.view(B, 1, K, D)
    if hasattr(attn_module, "q_norm"):
        q, k = rms_norm(attn_module.q_norm, q), rms_norm(attn_module.k_norm, k)
    cos, sin = position_embeddings
    q_BH1D = _rope_append(attn_module, q, k, v, cos, sin, pages.own, rms_of)
    out_BH1D = pages.shared.attend_decode(q_BH1D, pages.own, attn_module.scaling)
    return out_BH1D.transpose(1, 2).reshape(B, 1, H * D)


def decode_attention_mix(attn_module, x_B1H, position_embeddings, pages):
    """The module's output for one decoding step of B sequences on `pages` (its k and v appended there), or None
    where this path does not apply (see the module doc)."""
    if not plain_decoding(attn_module, x_B1H, pages):
        return None
    qkv = stacked_linear((attn_module.q_proj, attn_module.k_proj, attn_module.v_proj), x_B1H)
    if qkv is None:
        return None
    return attn_module.o_proj(attend_stacked(attn_module, qkv, position_embeddings, pages))
