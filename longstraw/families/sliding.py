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
from longstraw.state.pages import WindowKV

SLIDING, GLOBAL = "sliding_attention", "full_attention"
# rotaries whose frequencies follow the longest position of each call (HF's `dynamic_rope_update`): a chunked
# capture would rotate its early chunks otherwise than HF's one pass over the sequence
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_sliding_config(config) -> None:
    """Refuse, before any work, layer types and windows this family does not compute as HF does."""
    what = f"{config.model_type} config"
    unknown = sorted(set(config.layer_types) - {SLIDING, GLOBAL})
    if unknown:
        raise ValueError(f"{what}: layer_types {unknown} are neither {SLIDING!r} nor {GLOBAL!r}")
    if SLIDING in config.layer_types and not (isinstance(config.sliding_window, int) and config.sliding_window >= 1):
        raise ValueError(f"{what}: sliding layers need sliding_window >= 1, got {config.sliding_window!r}")


def check_gemma3_config(config) -> None:
    """Refuse, before any work, what this family does not compute as HF's Gemma 3 does (transformers 5.23)."""
    check_sliding_config(config)
    what = f"{config.model_type} config"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"{what}: attn_logit_softcapping={config.attn_logit_softcapping} is set, but HF's Gemma3Attention "
            "never applies it (its attention is not softcapped); set it to None"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{what}: use_bidirectional_attention=True is not causal decoding; longstraw needs False")


def check_gpt_oss_config(config) -> None:
    """Refuse, before any work, what this family does not compute as HF's gpt-oss does (transformers 5.17-5.23)."""
    check_sliding_config(config)
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise ValueError(
            f"{config.model_type} config: rope_type {rope_type!r} sets its frequencies from the longest position of "
            "each forward, which a chunked capture does not see as HF's one pass does; use a static rope (yarn)"
        )


class SoftcappedHead(torch.nn.Module):
    """The lm_head with the final logit softcapping of Gemma3ForCausalLM.forward: cap * tanh(logits / cap)."""

    def __init__(self, head: torch.nn.Module, cap: float):
        super().__init__()
        self.head, self.cap, self.out_features = head, cap, head.out_features

    def forward(self, h):
        return torch.tanh(self.head(h) / self.cap) * self.cap


class SlidingWindowAdapter(FamilyAdapter):
    """What the family's members share: window entries on sliding layers, pages on global ones."""

    check_config = staticmethod(check_sliding_config)

    def __init__(self, model):
        super().__init__(model)
        self.check_config(self.config)
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
    check_config = staticmethod(check_gemma3_config)

    def position_embeddings(self, h_BTH, start: int):
        """{layer type: (cos, sin)}: the local and global rotaries differ (Gemma3TextModel.forward)."""
        positions = torch.arange(start, start + h_BTH.shape[1], device=h_BTH.device)[None]
        return {t: self.decoder.rotary_emb(h_BTH, positions, t) for t in dict.fromkeys(self.layer_types)}

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
    check_config = staticmethod(check_gpt_oss_config)
