"""Hybrid family (qwen3_next, qwen3_5, qwen3_5_moe): Gated DeltaNet layers + full attention.

GDN layers keep a `RecurrentState` (constant size); attention layers keep K/V pages.
"""

from __future__ import annotations

from longstraw.families.attention_layer import attention_mix
from longstraw.families.base import FamilyAdapter
from longstraw.families.dense import allocate_attention_pages, attention_page_bytes
from longstraw.families.gdn_layer import (
    allocate_recurrent_state,
    gdn_mix,
    project_qwen3_5,
    project_qwen3_next,
    recurrent_state_bytes,
)

_PROJECTIONS = {"qwen3_next": project_qwen3_next, "qwen3_5_text": project_qwen3_5, "qwen3_5_moe_text": project_qwen3_5}


class HybridAdapter(FamilyAdapter):
    model_types = tuple(_PROJECTIONS)

    def __init__(self, model):
        super().__init__(model)
        self.project = _PROJECTIONS[self.config.model_type]
        self.layer_types = list(self.config.layer_types)

    def _is_gdn(self, layer_idx):
        return self.layer_types[layer_idx] == "linear_attention"

    def allocate_entry(self, layer_idx, positions, dtype, device):
        layer = self.layers[layer_idx]
        if self._is_gdn(layer_idx):
            return allocate_recurrent_state(layer.linear_attn, dtype, device)
        return allocate_attention_pages(layer.self_attn, self.config, positions, dtype, device)

    def mix(self, layer_idx, x_BTH, position_embeddings, entry, capturing):
        layer = self.layers[layer_idx]
        if self._is_gdn(layer_idx):
            return gdn_mix(layer.linear_attn, self.project, x_BTH, entry, write_state=capturing)
        return attention_mix(layer.self_attn, x_BTH, position_embeddings, entry, capturing)

    def predicted_bytes(self, dtype):
        n_gdn = sum(self._is_gdn(i) for i in range(self.num_layers))
        n_attn = self.num_layers - n_gdn
        return n_attn * attention_page_bytes(self.config, dtype), n_gdn * recurrent_state_bytes(self.config, dtype)
