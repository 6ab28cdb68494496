"""Sliding-window family (gemma3_text): sliding-window attention layers and full-attention (global) layers.

Sliding layers keep a `WindowKV` (the K/V of the last `sliding_window - 1` positions, whatever the prompt's
length: all a later query sees), global layers full `AttentionPages`. Gemma 3's decoder layer is not the pre-norm
block of `base`: its norms sandwich the attention and the MLP (each output is normed before it joins the
residual), and each layer type has its own rotary (`Gemma3RotaryEmbedding(x, positions, layer_type)`: local and
global theta and scaling), so `position_embeddings` gives one (cos, sin) per layer type and each layer takes its
own. HF's modules do the rest: the embedding's sqrt(hidden) scale (inside its module), the q/k norms, the
`query_pre_attn_scalar ** -0.5` scaling (passed to the attention as `scaling`), the MLP, and the final norm.
"""

from __future__ import annotations

import dataclasses

import torch

from longstraw.families.attention_layer import attention_mix
from longstraw.families.base import FamilyAdapter
from longstraw.families.dense import allocate_attention_pages, attention_page_bytes
from longstraw.state.pages import WindowKV

SLIDING, GLOBAL = "sliding_attention", "full_attention"


def check_sliding_config(config) -> None:
    """Refuse, before any work, what this family does not compute as HF's Gemma 3 does (transformers 5.23)."""
    what = f"{config.model_type} config"
    unknown = sorted(set(config.layer_types) - {SLIDING, GLOBAL})
    if unknown:
        raise ValueError(f"{what}: layer_types {unknown} are neither {SLIDING!r} nor {GLOBAL!r}")
    if SLIDING in config.layer_types and not (isinstance(config.sliding_window, int) and config.sliding_window >= 1):
        raise ValueError(f"{what}: sliding layers need sliding_window >= 1, got {config.sliding_window!r}")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"{what}: attn_logit_softcapping={config.attn_logit_softcapping} is set, but HF's Gemma3Attention "
            "never applies it (its attention is not softcapped); set it to None"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{what}: use_bidirectional_attention=True is not causal decoding; longstraw needs False")


class SoftcappedHead(torch.nn.Module):
    """The lm_head with the final logit softcapping of Gemma3ForCausalLM.forward: cap * tanh(logits / cap)."""

    def __init__(self, head: torch.nn.Module, cap: float):
        super().__init__()
        self.head, self.cap, self.out_features = head, cap, head.out_features

    def forward(self, h):
        return torch.tanh(self.head(h) / self.cap) * self.cap


class SlidingWindowAdapter(FamilyAdapter):
    model_types = ("gemma3_text",)

    def __init__(self, model):
        super().__init__(model)
        check_sliding_config(self.config)
        self.layer_types = list(self.config.layer_types)
        self.window = self.config.sliding_window

    def _slides(self, layer_idx) -> bool:
        return self.layer_types[layer_idx] == SLIDING

    def allocate_entry(self, layer_idx, positions, dtype, device):
        attn = self.layers[layer_idx].self_attn
        if self._slides(layer_idx):
            return WindowKV.allocate(self.config.num_key_value_heads, self.window, attn.head_dim, dtype, device)
        return allocate_attention_pages(attn, self.config, positions, dtype, device)

    def position_embeddings(self, h_BTH, start: int):
        """{layer type: (cos, sin)}: the local and global rotaries differ (Gemma3TextModel.forward)."""
        positions = torch.arange(start, start + h_BTH.shape[1], device=h_BTH.device)[None]
        return {t: self.decoder.rotary_emb(h_BTH, positions, t) for t in dict.fromkeys(self.layer_types)}

    def mix(self, layer_idx, x_BTH, position_embeddings, entry, capturing):
        own = position_embeddings[self.layer_types[layer_idx]]
        return attention_mix(self.layers[layer_idx].self_attn, x_BTH, own, entry, capturing)

    def layer_forward(self, layer_idx, h_BTH, position_embeddings, entry, capturing):
        """Gemma3DecoderLayer's block: sandwich norms around the attention and the MLP."""
        layer = self.layers[layer_idx]
        mixed = self.mix(layer_idx, layer.input_layernorm(h_BTH), position_embeddings, entry, capturing)
        h_BTH = h_BTH + layer.post_attention_layernorm(mixed)
        return h_BTH + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h_BTH)))

    @property
    def lm_head(self):
        head, cap = super().lm_head, self.config.final_logit_softcapping
        return head if cap is None else SoftcappedHead(head, cap)

    def predicted_bytes(self, dtype):
        sliding = sum(map(self._slides, range(self.num_layers)))
        kv = attention_page_bytes(self.config, dtype)  # K + V of one position in one layer
        return (self.num_layers - sliding) * kv, sliding * (self.window - 1) * kv

    def binding(self):
        # every layer is one attention class: which of them slide, and how far, is the config's
        bound = super().binding()
        model_type, layers, mixers, shapes, dtype = bound.structure
        windows = (("layer_types", tuple(self.layer_types)), ("sliding_window", self.window))
        return dataclasses.replace(bound, structure=(model_type, layers, mixers, shapes + windows, dtype))
