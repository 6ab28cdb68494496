"""One MLA (+ DSA) layer's token mixing through HF's own modules, with absorbed latent attention.

Per token, everything runs through the HF attention module's submodules (q_a_proj / q_a_layernorm /
q_b_proj or q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, the indexer's wq_b / wk /
k_norm / weights_proj) and HF's own rotary functions, so LoRA and NF4 apply unchanged. The sequence
mixing is ours: the live latents attend the layer's `LatentPages` in absorbed form
(`longstraw.mla`), over the indexer's top-k (`longstraw.dsa`) when it drops positions.

Rotary layouts (the same in transformers 5.17 and 5.23): the MLA rope part is interleaved (deepseek_v3:
unless `config.rope_interleave` is False); the indexer's rope part is interleaved in glm_moe_dsa
and half-split in deepseek_v32. The functions are taken from the model's own modeling module.

    out_BTH, selection = mla_mix(attn, x_BTH, (cos, sin), pages, capturing=True, selection=None)
"""

from __future__ import annotations

import sys

import torch

from longstraw.dsa import select_topk
from longstraw.mla import absorb_query, expand_output, latent_attention, split_kv_b
from longstraw.state import LatentPages

_INDEXER_ROTARY = {"glm_moe_dsa": "apply_rotary_pos_emb_interleave", "deepseek_v32": "apply_rotary_pos_emb"}


def _rotary(attn, name=None):
    modeling = sys.modules[type(attn).__module__]
    if name is None:
        interleave = getattr(attn.config, "rope_interleave", True)
        name = "apply_rotary_pos_emb_interleave" if interleave else "apply_rotary_pos_emb"
    return getattr(modeling, name)


def indexer_of(attn):
    """The layer's own DSA indexer, or None (no indexer, or an IndexShare layer)."""
    indexer = getattr(attn, "indexer", None)
    return None if indexer is None or getattr(attn, "skip_topk", False) else indexer


def latent_page_bytes(config, index_layer: bool, dtype) -> int:
    """Resident bytes per position of one MLA layer: latent + rope key (+ the index key)."""
    width = config.kv_lora_rank + config.qk_rope_head_dim + (config.index_head_dim if index_layer else 0)
    return width * torch.empty((), dtype=dtype).element_size()


def allocate_latent_pages(attn, positions, dtype, device, host=False) -> LatentPages:
    indexer = indexer_of(attn)
    return LatentPages.allocate(positions, attn.kv_lora_rank, attn.qk_rope_head_dim,
                                indexer.head_dim if indexer is not None else 0, dtype, device, host)


def _index_query_key(attn, indexer, x_BTH, q_resid_BTQ, cos, sin):
    """The indexer's rotated queries [T, Hi, I], head weights [T, Hi] and keys [T, I] (HF's math)."""
    B, T, _ = x_BTH.shape
    rope = indexer.qk_rope_head_dim
    q_BTHI = indexer.wq_b(q_resid_BTQ).view(B, T, indexer.n_heads, indexer.head_dim)
    k_BT1I = indexer.k_norm(indexer.wk(x_BTH)).unsqueeze(2)
    q_rot, q_pass = q_BTHI.split([rope, indexer.head_dim - rope], dim=-1)
    k_rot, k_pass = k_BT1I.split([rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = _rotary(attn, _INDEXER_ROTARY[attn.config.model_type])(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q_BTHI = torch.cat([q_rot, q_pass], dim=-1)
    k_BTI = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    w_BTH = indexer.weights_proj(x_BTH.to(indexer.weights_proj.weight.dtype)).float() * indexer.n_heads ** -0.5
    return q_BTHI[0], w_BTH[0], k_BTI


def mla_mix(attn, x_BTH, position_embeddings, pages: LatentPages, capturing: bool, selection=None):
    """(attention output [B, T, hidden], the top-k selection this layer used or None when dense).

    `selection` is the previous index layer's selection (IndexShare layers reuse it). Capturing
    appends the live latents and index keys to `pages`."""
    B, T, _ = x_BTH.shape
    H, N, R, C = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.kv_lora_rank
    cos, sin = position_embeddings
    if getattr(attn, "q_proj", None) is not None:
        q_resid_BTQ, q_BTX = None, attn.q_proj(x_BTH)
    else:
        q_resid_BTQ = attn.q_a_layernorm(attn.q_a_proj(x_BTH))
        q_BTX = attn.q_b_proj(q_resid_BTQ)
    q_nope_BHTN, q_rot_BHTR = q_BTX.view(B, T, H, N + R).transpose(1, 2).split([N, R], dim=-1)
    kv_pass_BTC, k_rot_BTR = attn.kv_a_proj_with_mqa(x_BTH).split([C, R], dim=-1)
    latent_BTC = attn.kv_a_layernorm(kv_pass_BTC)
    q_rot_BHTR, k_rot_B1TR = _rotary(attn)(q_rot_BHTR, k_rot_BTR.view(B, 1, T, R), cos, sin)
    live_11TE = torch.cat([latent_BTC.view(B, 1, T, C), k_rot_B1TR], dim=-1)
    pages_11PE, index_pages_1PI = pages.filled()

    indexer, index_key_1TI = indexer_of(attn), None
    if indexer is not None:
        with torch.no_grad():  # HF's indexer is @torch.no_grad(): the selection carries no gradient
            q_THI, w_TH, index_key_1TI = _index_query_key(attn, indexer, x_BTH, q_resid_BTQ, cos, sin)
            selection = None
            if indexer.index_topk < pages_11PE.shape[2] + T:  # else every visible position is kept
                selection = select_topk(q_THI, w_TH, index_pages_1PI[0], index_key_1TI[0],
                                        topk=indexer.index_topk, scale=indexer.softmax_scale)

    w_uk_HNC, w_uv_HVC = split_kv_b(attn.kv_b_proj, H, N, attn.v_head_dim, latent_BTC)
    q_1HTE = torch.cat([absorb_query(q_nope_BHTN, w_uk_HNC), q_rot_BHTR], dim=-1)
    out_1HTC = latent_attention(q_1HTE, pages_11PE, live_11TE, rank=C, scale=attn.scaling, selection_TK=selection)
    out_BTX = expand_output(out_1HTC, w_uv_HVC).transpose(1, 2).reshape(B, T, H * attn.v_head_dim)
    if capturing:
        pages.append(live_11TE, index_key_1TI)
    return attn.o_proj(out_BTX), selection
