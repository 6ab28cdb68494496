"""Sliding-window family: sliding-window attention layers and full-attention (global) layers, Gemma 3
(gemma3_text) and gpt-oss (gpt_oss).

Sliding layers keep a `WindowKV` (the K/V of the last `sliding_window - 1` positions, whatever the prompt's
length: all a later query sees), global layers full `AttentionPages` (`SlidingWindowAdapter`, shared).

Gemma 3 (`Gemma3Adapter`): its decoder layer is not the pre-norm block of `base`: its norms sandwich the attention
and the MLP (each output is normed before it joins the residual), and each layer type has its own rotary
(`Gemma3RotaryEmbedding(x, positions, layer_type)`: local and global theta and scaling), so `position_embeddings`
gives one (cos, sin) per layer type and each layer takes its own. HF's modules do the rest: the embedding's
sqrt(hidden) scale (inside its module), the q/k norms, the `query_pre_attn_scalar ** -0.5` scaling (passed to the
attention as `scaling`), the MLP, and the final norm.

gpt-oss (`GptOssAdapter`): the pre-norm block of `base` and one rotary (yarn) for every layer, both as HF's. Its
attention (q/k/v/o with bias) has a learned sink logit per head, which HF's module hands to the attention as
`s_aux` and the entries merge as one more key of value 0 (`kernels.paged_attention`, module doc). Its MLP is HF's
routed MoE (router + experts, `GptOssMLP`), run as is: it routes each token on its own hidden state, so the
capture's chunks route as HF's one pass does.
"""

from __future__ import annotations

import dataclasses

import torch

from longstraw.families.attention_layer import attention_mix
from longstraw.families.base import FamilyAdapter
from longstraw.families.dense import allocate_attention_pages, attention_page_bytes
from longstraw.families.support import SLIDING
from longstraw.state.pages import WindowKV


class SoftcappedHead(torch.nn.Module):
    """The lm_head with the final logit softcapping of Gemma3ForCausalLM.forward: cap * tanh(logits / cap)."""

    def __init__(self, head: torch.nn.Module, cap: float):
        super().__init__()
        self.head, self.cap, self.out_features = head, cap, head.out_features

    def forward(self, h):
        return torch.tanh(self.head(h) / self.cap) * self.cap


class SlidingWindowAdapter(FamilyAdapter):
    """What the family's members share: window entries on sliding layers, pages on global ones."""

    def __init__(self, model):
        super().__init__(model)
        self.layer_types = list(self.config.layer_types)
        self.window = self.config.sliding_window

    def _slides(self, layer_idx) -> bool:
        return self.layer_types[layer_idx] == SLIDING

    def allocate_entry(self, layer_idx, positions, dtype, device):
        attn = self.layers[layer_idx].self_attn
        if self._slides(layer_idx):
            return WindowKV.allocate(self.config.num_key_value_heads, self.window, attn.head_dim, dtype, device)
        return allocate_attention_pages(attn, self.config, positions, dtype, device)

    def mix(self, layer_idx, x_BTH, position_embeddings, entry, capturing):
        return attention_mix(self.layers[layer_idx].self_attn, x_BTH, position_embeddings, entry, capturing)

    def predicted_bytes(self, dtype):
        sliding = sum(map(self._slides, range(self.num_layers)))
        kv = attention_page_bytes(self.config, dtype)  # K + V of one position in one layer
        return (self.num_layers - sliding) * kv, sliding * (self.window - 1) * kv

    def binding(self):
        # which layers slide, and how far, is the config's (gpt-oss's layers are one attention class, Gemma's too)
        bound = super().binding()
        model_type, layers, mixers, shapes, dtype = bound.structure
        windows = (("layer_types", tuple(self.layer_types)), ("sliding_window", self.window))
        return dataclasses.replace(bound, structure=(model_type, layers, mixers, shapes + windows, dtype))


class Gemma3Adapter(SlidingWindowAdapter):
    model_types = ("gemma3_text",)

    def position_embeddings_at(self, h_BTH, positions_1T):
        """{layer type: (cos, sin)}: the local and global rotaries differ (Gemma3TextModel.forward)."""
        return {t: self.decoder.rotary_emb(h_BTH, positions_1T, t) for t in dict.fromkeys(self.layer_types)}

    def mix(self, layer_idx, x_BTH, position_embeddings, entry, capturing):
        return super().mix(layer_idx, x_BTH, position_embeddings[self.layer_types[layer_idx]], entry, capturing)

    def mixer_input(self, layer_idx, h_BTH):
        return self.layers[layer_idx].input_layernorm(h_BTH)

    def layer_forward(self, layer_idx, h_BTH, position_embeddings, entry, capturing):
        """Gemma3DecoderLayer's block: sandwich norms around the attention and the MLP."""
        layer = self.layers[layer_idx]
        mixed = self.mix(layer_idx, self.mixer_input(layer_idx, h_BTH), position_embeddings, entry, capturing)
        h_BTH = h_BTH + layer.post_attention_layernorm(mixed)
        return h_BTH + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h_BTH)))

    @property
    def lm_head(self):
        head, cap = super().lm_head, self.config.final_logit_softcapping
        return head if cap is None else SoftcappedHead(head, cap)


class GptOssAdapter(SlidingWindowAdapter):
    """gpt-oss: `base`'s pre-norm block, rotary and lm_head; the sinks reach the entries from HF's module."""

    model_types = ("gpt_oss",)
