"""Dense GQA family (llama, qwen3, glm4_moe): every layer is full attention with K/V pages."""

from __future__ import annotations

import torch

from longstraw.families.attention_layer import attention_mix
from longstraw.families.base import FamilyAdapter
from longstraw.families.folded_norms import folded_layer_forward
from longstraw.state import AttentionPages


def attention_page_bytes(config, dtype) -> int:
    """K + V bytes per position of one attention layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_key_value_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def allocate_attention_pages(attn_module, config, positions, dtype, device) -> AttentionPages:
    return AttentionPages.allocate(config.num_key_value_heads, positions, attn_module.head_dim, dtype, device)


class DenseAdapter(FamilyAdapter):
    model_types = ("llama", "qwen3", "glm4_moe")

    def allocate_entry(self, layer_idx, positions, dtype, device):
        return allocate_attention_pages(self.layers[layer_idx].self_attn, self.config, positions, dtype, device)

    def mix(self, layer_idx, x_BTH, position_embeddings, entry, capturing):
        return attention_mix(self.layers[layer_idx].self_attn, x_BTH, position_embeddings, entry, capturing)

    def layer_forward(self, layer_idx, h_BTH, position_embeddings, entry, capturing):
        """A decoding step's layer with its norms folded into its projections where that applies
        (`families.folded_norms`), else the pre-norm block."""
        if capturing:
            out = folded_layer_forward(self.layers[layer_idx], h_BTH, position_embeddings, entry)
            if out is not None:
                return out
        return super().layer_forward(layer_idx, h_BTH, position_embeddings, entry, capturing)

    def predicted_bytes(self, dtype):
        return self.num_layers * attention_page_bytes(self.config, dtype), 0
