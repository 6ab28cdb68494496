"""MLA family (glm_moe_dsa, deepseek_v32, deepseek_v3): latent pages, DSA top-k, routed MoE.

Every layer keeps `LatentPages` (latent + rope key per position; the index key too on layers with
their own indexer). IndexShare layers (glm_moe_dsa `indexer_types[i] == "shared"`) reuse the top-k
selection of the index layer before them, as HF passes `prev_topk_indices` up the stack: the
selection is kept per chunk (keyed by its first position) from the index layer until the last
layer that shares it, so both capture orders, replay and sampling (keyed by the decoding step; one
selection [G, k] for all G sequences) see the right one. The FFN (dense for the first
`first_k_dense_replace` layers, then routed experts + shared expert) runs through HF's modules in
`FamilyAdapter.layer_forward`.

Each layer's token mixing (`mla_mix`) goes through HF's own modules, with absorbed latent attention.

Per token, everything runs through the HF attention module's submodules (q_a_proj / q_a_layernorm /
q_b_proj or q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, the indexer's wq_b / wk /
k_norm / weights_proj) and HF's own rotary functions, so LoRA and NF4 apply unchanged. The sequence
mixing is ours: the live latents attend the layer's `LatentPages` in absorbed form
(`longstraw.kernels.latent_attention`), over the indexer's top-k (`longstraw.kernels.dsa_topk`) when it drops positions.

Rotary layouts (the same in transformers 5.17 and 5.23): the MLA rope part is interleaved (deepseek_v3:
unless `config.rope_interleave` is False); the indexer's rope part is interleaved in glm_moe_dsa
and half-split in deepseek_v32. The functions are taken from the model's own modeling module.

    out_BTH, selection = mla_mix(attn, x_BTH, (cos, sin), pages, capturing=True, selection=None)
    out_B1H, selection_BK = mla_mix(attn, x_B1H, (cos, sin), decode_pages, capturing=True)  # sampling G rows
"""

from __future__ import annotations

import sys

import torch

from longstraw.families.base import FamilyAdapter
from longstraw.kernels.latent_attention import absorb_query, expand_output, split_kv_b
from longstraw.state import IndexQueries, LatentDecodePages, LatentPages

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
    return LatentPages.allocate(
        positions,
        attn.kv_lora_rank,
        attn.qk_rope_head_dim,
        indexer.head_dim if indexer is not None else 0,
        dtype,
        device,
        host,
    )


def _index_query_key(attn, indexer, x_BTH, q_resid_BTQ, cos, sin):
    """The indexer's rotated queries [B, T, Hi, I], head weights [B, T, Hi] and keys [B, T, I] (HF's math);
    queries None when `q_resid_BTQ` is (the keys alone: `mla_page_entries`)."""
    B, T, _ = x_BTH.shape
    rope = indexer.qk_rope_head_dim
    k_BT1I = indexer.k_norm(indexer.wk(x_BTH)).unsqueeze(2)
    k_rot, k_pass = k_BT1I.split([rope, indexer.head_dim - rope], dim=-1)
    rotary = _rotary(attn, _INDEXER_ROTARY[attn.config.model_type])
    if q_resid_BTQ is None:
        k_rot = rotary(k_rot, k_rot, cos, sin, unsqueeze_dim=2)[1]
        return None, None, torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    q_BTHI = indexer.wq_b(q_resid_BTQ).view(B, T, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = q_BTHI.split([rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = rotary(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q_BTHI = torch.cat([q_rot, q_pass], dim=-1)
    k_BTI = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    w_BTH = indexer.weights_proj(x_BTH.to(indexer.weights_proj.weight.dtype)).float() * indexer.n_heads**-0.5
    return q_BTHI, w_BTH, k_BTI


def _latent_entries(attn, x_BTH, cos, sin, q_rot_BHTR=None):
    """(the normed latent [B, T, C], the page entries [latent ‖ rotated rope key] [B, 1, T, E], the rotated
    `q_rot_BHTR` or None): the per-position part of the MLA projections."""
    B, T, _ = x_BTH.shape
    C, R = attn.kv_lora_rank, attn.qk_rope_head_dim
    kv_pass_BTC, k_rot_BTR = attn.kv_a_proj_with_mqa(x_BTH).split([C, R], dim=-1)
    latent_BTC = attn.kv_a_layernorm(kv_pass_BTC)
    k_rot_B1TR = k_rot_BTR.view(B, 1, T, R)
    q_rot_BHTR, k_rot_B1TR = _rotary(attn)(k_rot_B1TR if q_rot_BHTR is None else q_rot_BHTR, k_rot_B1TR, cos, sin)
    live_B1TE = torch.cat([latent_BTC.view(B, 1, T, C), k_rot_B1TR], dim=-1)
    return latent_BTC, live_B1TE, q_rot_BHTR


def mla_page_entries(attn, x_BTH, position_embeddings):
    """What a capture writes to the layer's pages for the (normed) input `x_BTH`, without the queries:
    (page entries [B, 1, T, E], index keys [B, T, I] or None off index layers)."""
    cos, sin = position_embeddings
    live_B1TE = _latent_entries(attn, x_BTH, cos, sin)[1]
    indexer = indexer_of(attn)
    return live_B1TE, None if indexer is None else _index_query_key(attn, indexer, x_BTH, None, cos, sin)[2]


def _project(attn, x_BTH, cos, sin):
    """Per-token MLA projections: (q_nope [B, H, T, N], rotated q_rot [B, H, T, R], q_resid [B, T, Q] or
    None without q-LoRA, the normed latent [B, T, C], the live page entries [latent ‖ rotated rope key]
    [B, 1, T, E])."""
    B, T, _ = x_BTH.shape
    H, N, R = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
    if getattr(attn, "q_proj", None) is not None:
        q_resid_BTQ, q_BTX = None, attn.q_proj(x_BTH)
    else:
        q_resid_BTQ = attn.q_a_layernorm(attn.q_a_proj(x_BTH))
        q_BTX = attn.q_b_proj(q_resid_BTQ)
    q_nope_BHTN, q_rot_BHTR = q_BTX.view(B, T, H, N + R).transpose(1, 2).split([N, R], dim=-1)
    latent_BTC, live_B1TE, q_rot_BHTR = _latent_entries(attn, x_BTH, cos, sin, q_rot_BHTR)
    return q_nope_BHTN, q_rot_BHTR, q_resid_BTQ, latent_BTC, live_B1TE


def _absorbed(attn, q_nope_BHTN, q_rot_BHTR, latent_BTC):
    """(absorbed queries [B, H, T, E], W_UV [H, V, C]) for attention over latent pages."""
    w_uk_HNC, w_uv_HVC = split_kv_b(attn.kv_b_proj, attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim, latent_BTC)
    return torch.cat([absorb_query(q_nope_BHTN, w_uk_HNC), q_rot_BHTR], dim=-1), w_uv_HVC


def _output(attn, out_BHTC, w_uv_HVC):
    B, H, T, _ = out_BHTC.shape
    return attn.o_proj(expand_output(out_BHTC, w_uv_HVC).transpose(1, 2).reshape(B, T, H * attn.v_head_dim))


def mla_mix(attn, x_BTH, position_embeddings, pages: LatentPages | LatentDecodePages, capturing: bool, selection=None):
    """(attention output [B, T, hidden], the top-k selection this layer used or None when dense).

    `selection` is the previous index layer's selection (IndexShare layers reuse it). Capturing
    appends the live latents and index keys to `pages`; the entry attends (`pages.attend`: latent pages,
    the exact mode's recompute pages, a context-parallel shard). Sampling pages (`LatentDecodePages`)
    take `mla_decode_mix`."""
    if isinstance(pages, LatentDecodePages):
        return mla_decode_mix(attn, x_BTH, position_embeddings, pages, selection)
    cos, sin = position_embeddings
    q_nope_BHTN, q_rot_BHTR, q_resid_BTQ, latent_BTC, live_11TE = _project(attn, x_BTH, cos, sin)
    indexer, index = indexer_of(attn), None
    if indexer is not None:
        with torch.no_grad():  # HF's indexer is @torch.no_grad(): the selection carries no gradient
            q_1THI, w_1TH, index_key_1TI = _index_query_key(attn, indexer, x_BTH, q_resid_BTQ, cos, sin)
        index = IndexQueries(q_1THI[0], w_1TH[0], index_key_1TI[0], indexer.index_topk, indexer.softmax_scale)
    q_1HTE, w_uv_HVC = _absorbed(attn, q_nope_BHTN, q_rot_BHTR, latent_BTC)
    out_1HTC, selection = pages.attend(
        q_1HTE,
        live_11TE,
        rank=attn.kv_lora_rank,
        scale=attn.scaling,
        append=capturing,
        index=index,
        selection=selection,
    )
    return _output(attn, out_1HTC, w_uv_HVC), selection


@torch.no_grad()
def mla_decode_mix(attn, x_B1H, position_embeddings, pages: LatentDecodePages, selection=None):
    """One decoding step of B sequences (one token each) on the shared prompt pages: appends each
    sequence's latent (and index key) to its own entries, selects top-k over [prompt ‖ own keys] on
    index layers as HF's indexer does over its cache (IndexShare layers reuse `selection`), attends.
    Returns (output [B, 1, hidden], the selection [B, k] or None when dense)."""
    cos, sin = position_embeddings
    q_nope_BH1N, q_rot_BH1R, q_resid_B1Q, latent_B1C, live_B11E = _project(attn, x_B1H, cos, sin)
    indexer, index, index_key_B1I = indexer_of(attn), None, None
    if indexer is not None:
        q_B1HI, w_B1H, index_key_B1I = _index_query_key(attn, indexer, x_B1H, q_resid_B1Q, cos, sin)
        index = IndexQueries(q_B1HI[:, 0], w_B1H[:, 0], index_key_B1I[:, 0], indexer.index_topk, indexer.softmax_scale)
    pages.own.append(live_B11E, index_key_B1I)
    q_BH1E, w_uv_HVC = _absorbed(attn, q_nope_BH1N, q_rot_BH1R, latent_B1C)
    out_BH1C, selection = pages.shared.attend_decode(
        q_BH1E, pages.own, rank=attn.kv_lora_rank, scale=attn.scaling, index=index, selection=selection
    )
    return _output(attn, out_BH1C, w_uv_HVC), selection


class MlaAdapter(FamilyAdapter):
    model_types = ("glm_moe_dsa", "deepseek_v32", "deepseek_v3")

    def __init__(self, model):
        super().__init__(model)
        self.attns = [layer.self_attn for layer in self.layers]
        self.index_layer = [indexer_of(a) is not None for a in self.attns]
        kinds = getattr(self.config, "indexer_types", None) or ["full"] * self.num_layers
        self.shares = [kind == "shared" for kind in kinds]
        if self.shares and self.shares[0]:
            raise ValueError(
                f"{self.config.model_type}: layer 0 shares a top-k selection but no index layer precedes it"
            )
        self._selections: dict[int, object] = {}  # chunk start -> selection awaited by IndexShare layers
        # layer-major capture would hold every chunk's top-k between an index layer and its sharers
        self.layer_major_capture = not any(self.shares)

    supports_host_pages = True

    def checkpoint_segments(self) -> list[range]:
        """An index layer with the IndexShare layers after it: they read the top-k selection it leaves in
        `_selections`, so a recompute must run them in their forward order."""
        starts = [i for i in range(self.num_layers) if not self.shares[i]]
        return [range(a, b) for a, b in zip(starts, starts[1:] + [self.num_layers])]

    def allocate_entry(self, layer_idx, positions, dtype, device, host=False):
        return allocate_latent_pages(self.attns[layer_idx], positions, dtype, device, host)

    def mix(self, layer_idx, x_BTH, position_embeddings, entry, capturing):
        start = entry.chunk_start  # the chunk's first position
        shared = self.shares[layer_idx]
        selection = self._selections[start] if shared else None
        out, selection = mla_mix(self.attns[layer_idx], x_BTH, position_embeddings, entry, capturing, selection)
        if layer_idx + 1 < self.num_layers and self.shares[layer_idx + 1]:
            self._selections[start] = selection
        elif shared:
            del self._selections[start]
        return out

    def predicted_bytes(self, dtype):
        return sum(latent_page_bytes(self.config, index, dtype) for index in self.index_layer), 0
