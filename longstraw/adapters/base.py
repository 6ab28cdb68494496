"""The family-adapter interface and the pre-norm decoder layer every supported family shares.

An adapter wraps one HF causal LM (peft-wrapped or not). The core (`longstraw.transaction`) only
calls: `embed`, `position_embeddings`, `layer_forward`, `final_hidden`, `lm_head`,
`allocate_state`, `predicted_bytes`. A family implements `allocate_entry(i, ...)` (which
resident entry layer i keeps) and `mix(i, x, pe, entry, capturing)` (its token mixing);
everything per-token (norms, MLP / MoE) runs through the HF modules.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from longstraw.adapters.attention_mixer import longstraw_attention_selected


def unwrap_causal_lm(model):
    """The HF causal LM inside a peft wrapper (LoRA layers stay injected in its modules)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class FamilyAdapter:
    model_types: tuple[str, ...] = ()
    layer_major_capture = True  # capture(order="auto") may pick layer-major when activations fit
    supports_host_pages = False  # capture(host_pages=True): allocate_entry(..., host=True)

    def __init__(self, model):
        self.model = model
        self.lm = unwrap_causal_lm(model)
        self.config = self.lm.config
        self.decoder = self.lm.model
        self.layers = self.decoder.layers

    # ---- what a family defines ----
    def allocate_entry(self, layer_idx: int, positions: int, dtype, device):
        raise NotImplementedError

    def mix(self, layer_idx: int, x_BTH, position_embeddings, entry, capturing: bool):
        raise NotImplementedError

    def predicted_bytes(self, dtype) -> tuple[int, int]:
        """(bytes per prompt position, constant bytes) of the resident state, from the config."""
        raise NotImplementedError

    # ---- shared machinery ----
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        return self.lm.get_input_embeddings().weight.shape[0]

    @property
    def compute_dtype(self):
        return self.lm.get_input_embeddings().weight.dtype

    @property
    def device(self):
        return self.lm.get_input_embeddings().weight.device

    def selected(self):
        """Context in which the HF attention modules dispatch to the paged implementation."""
        configs = {id(m.config): m.config for m in self.lm.modules() if hasattr(m, "config")
                   and hasattr(m.config, "_attn_implementation_internal")}
        return longstraw_attention_selected(configs.values()) if configs else nullcontext()

    def embed(self, ids_BT):
        return self.lm.get_input_embeddings()(ids_BT)

    def position_embeddings(self, h_BTH, start: int):
        positions = torch.arange(start, start + h_BTH.shape[1], device=h_BTH.device)[None]
        rotary = self.decoder.rotary_emb
        if hasattr(rotary, "mrope_section"):  # multimodal rotary: text positions on all three axes
            positions = positions[None].expand(3, -1, -1)
        return rotary(h_BTH, positions)

    def layer_forward(self, layer_idx: int, h_BTH, position_embeddings, entry, capturing: bool):
        """Pre-norm residual block, as every supported HF decoder layer computes it."""
        layer = self.layers[layer_idx]
        mixed = self.mix(layer_idx, layer.input_layernorm(h_BTH), position_embeddings, entry, capturing)
        h_BTH = h_BTH + mixed
        return h_BTH + self._mlp(layer, h_BTH)

    @staticmethod
    def _mlp(layer, h_BTH):
        out = layer.mlp(layer.post_attention_layernorm(h_BTH))
        return out[0] if isinstance(out, tuple) else out  # some MoE blocks also return router logits

    def final_hidden(self, h_BTH):
        return self.decoder.norm(h_BTH)

    @property
    def lm_head(self):
        return self.lm.get_output_embeddings()
