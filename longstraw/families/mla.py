"""MLA family (glm_moe_dsa, deepseek_v32, deepseek_v3): latent pages, DSA top-k, routed MoE.

Every layer keeps `LatentPages` (latent + rope key per position; the index key too on layers with
their own indexer). IndexShare layers (glm_moe_dsa `indexer_types[i] == "shared"`) reuse the top-k
selection of the index layer before them, as HF passes `prev_topk_indices` up the stack: the
selection is kept per chunk (keyed by its first position) from the index layer until the last
layer that shares it, so both capture orders, replay and sampling (keyed by the decoding step; one
selection [G, k] for all G sequences) see the right one. The FFN (dense for the first
`first_k_dense_replace` layers, then routed experts + shared expert) runs through HF's modules in
`FamilyAdapter.layer_forward`.
"""

from __future__ import annotations

from longstraw.families.base import FamilyAdapter
from longstraw.families.mla_layer import allocate_latent_pages, indexer_of, latent_page_bytes, mla_mix


class MlaAdapter(FamilyAdapter):
    model_types = ("glm_moe_dsa", "deepseek_v32", "deepseek_v3")

    def __init__(self, model):
        super().__init__(model)
        self.attns = [layer.self_attn for layer in self.layers]
        self.index_layer = [indexer_of(a) is not None for a in self.attns]
        kinds = getattr(self.config, "indexer_types", None) or ["full"] * self.num_layers
        self.shares = [kind == "shared" for kind in kinds]
        if self.shares and self.shares[0]:
            raise ValueError(f"{self.config.model_type}: layer 0 shares a top-k selection but no index layer precedes it")
        self._selections: dict[int, object] = {}  # chunk start -> selection awaited by IndexShare layers
        # layer-major capture would hold every chunk's top-k between an index layer and its sharers
        self.layer_major_capture = not any(self.shares)

    supports_host_pages = True

    def allocate_entry(self, layer_idx, positions, dtype, device, host=False):
        return allocate_latent_pages(self.attns[layer_idx], positions, dtype, device, host)

    def mix(self, layer_idx, x_BTH, position_embeddings, entry, capturing):
        start = entry.length  # the chunk's first position: pages hold everything before it
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
