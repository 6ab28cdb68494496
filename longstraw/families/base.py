"""The family-adapter interface and the pre-norm decoder layer every supported family shares.

An adapter wraps one HF causal LM (peft-wrapped or not). The core (`longstraw.core.transaction`) only
calls: `embed`, `position_embeddings`, `layer_forward`, `final_hidden`, `lm_head`,
`allocate_entry`, `predicted_bytes`, `binding`. A family implements `allocate_entry(i, ...)` (which
resident entry layer i keeps), `mix(i, x, pe, entry, capturing)` (its token mixing) and
`predicted_bytes`; everything per-token (norms, MLP / MoE) runs through the HF modules. The entries it
allocates implement `longstraw.state.pages.ResidentEntry` (decoding, exact mode's leaves and recompute, the
context-parallel form; `tests/test_entry_contract.py`), so core, cp and training never branch on their type.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext

import torch

from longstraw.families.attention_layer import IMPLEMENTATION, longstraw_attention_selected
from longstraw.families.support import support_of
from longstraw.kernels.rms_norm import add_rms_norm, fused_norms_selected, rms_norm
from longstraw.kernels.rotary import fused_rotary_selected
from longstraw.kernels.swiglu import mlp_forward
from longstraw.models.stacked_projections import stacked_linear
from longstraw.state import ModelBinding, attention_output_unused

# config fields that size a resident entry (absent ones read None)
_SHAPE_KEYS = (
    "hidden_size",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "index_head_dim",
)
_SAMPLES = 16  # elements read from each frozen weight for the binding's checksum


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
        support = support_of(self.config.model_type)
        if support is not None:  # config values its family does not compute as HF does, refused before any work
            support.check_config(self.config)
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

    def checkpoint_segments(self) -> list[range]:
        """The layer runs a checkpointed replay recomputes together: each layer alone, unless a family's
        layers pass something forward outside the hidden state (MLA's IndexShare selection)."""
        return [range(i, i + 1) for i in range(self.num_layers)]

    @property
    def vocab_size(self) -> int:
        return self.lm.get_input_embeddings().weight.shape[0]

    @property
    def compute_dtype(self):
        return self.lm.get_input_embeddings().weight.dtype

    @property
    def device(self):
        return self.lm.get_input_embeddings().weight.device

    @contextmanager
    def selected(self, implementation: str = IMPLEMENTATION):
        """Context in which the HF attention modules dispatch to the paged implementation (or another
        registered attention `implementation`); with the paged one, their q and k norms compute as the decoder's
        do and their rotary embedding in one launch each for q and k (`fused_norms_selected`,
        `fused_rotary_selected`: a peer's implementation keeps HF's)."""
        configs = self._attention_configs
        paged = implementation == IMPLEMENTATION
        with longstraw_attention_selected(configs, implementation) if configs else nullcontext():
            with fused_norms_selected(self._attention_norms if paged else []):
                with fused_rotary_selected(self._attention_modules if paged else []):
                    yield

    @functools.cached_property
    def _attention_modules(self) -> list:
        """Each attention layer's HF module (`self_attn`, every family's name for it)."""
        return [layer.self_attn for layer in self.layers if hasattr(layer, "self_attn")]

    @functools.cached_property
    def _attention_norms(self) -> list:
        """The norms HF's attention modules call themselves (q_norm, k_norm)."""
        return [getattr(a, name) for a in self._attention_modules for name in ("q_norm", "k_norm") if hasattr(a, name)]

    @functools.cached_property
    def _attention_configs(self) -> list:
        # the configs HF's attention dispatch reads: the model's, the decoder's and each attention module's. Not a
        # walk over every module: every capture and replay call makes an adapter and enters `selected()`, and
        # hasattr's miss on the thousand modules of hybrid-1b with LoRA took 1.5 ms on a CI-class CPU (the H200
        # capture profile's host gap where it ran: 3.5 ms with the walk, 0.9 ms without)
        owners = [self.lm, self.decoder, *self._attention_modules]
        configs = {
            id(m.config): m.config
            for m in owners
            if hasattr(m, "config") and hasattr(m.config, "_attn_implementation_internal")
        }
        return list(configs.values())

    def binding(self) -> ModelBinding:
        """What a state captured now depends on (`ResidentState.check_model` compares it)."""
        mixers = tuple(type(getattr(layer, "linear_attn", None) or layer.self_attn).__name__ for layer in self.layers)
        shapes = tuple((k, getattr(self.config, k, None)) for k in _SHAPE_KEYS)
        structure = (self.config.model_type, self.num_layers, mixers, shapes, str(self.compute_dtype))
        named = list(self.lm.named_parameters())
        # peft's adapter weights are the trainable ones (disabling the adapter turns their grad off for a while)
        is_frozen = [not p.requires_grad and "lora_" not in n for n, p in named]
        frozen = [p for (_, p), f in zip(named, is_frozen) if f]
        # every in-place write bumps a tensor's version (writes through `.data` bypass it, as they bypass autograd)
        trainable = hash(tuple(p._version for (_, p), f in zip(named, is_frozen) if not f))
        return ModelBinding(
            structure, hash(tuple(p.data_ptr() for _, p in named)), _frozen_checksum(self.lm, frozen), trainable
        )

    def embed(self, ids_BT):
        return self.lm.get_input_embeddings()(ids_BT)

    def position_embeddings(self, h_BTH, start: int):
        positions_1T = torch.arange(start, start + h_BTH.shape[1], device=h_BTH.device)[None]
        return self.position_embeddings_at(h_BTH, positions_1T)

    def position_embeddings_at(self, h_BTH, positions_1T):
        """The rotary's (cos, sin) at the positions of a device tensor (decoding: the clock's, one shape a step)."""
        rotary = self.decoder.rotary_emb
        if hasattr(rotary, "mrope_section"):  # multimodal rotary: text positions on all three axes
            positions_1T = positions_1T[None].expand(3, -1, -1)
        return rotary(h_BTH, positions_1T)

    @property
    def rotary_fixed(self) -> bool:
        """Whether the rotary gives a position the same (cos, sin) whatever other positions one call asks, so that a
        table of a decode's positions holds each step's (`training.rollout.RotaryTable`): HF's rotary modules with
        their frequencies set at init. Not the dynamic and longrope types, whose frequencies follow the call's
        largest position (`modeling_rope_utils.dynamic_rope_update`), nor a rotary that names no type."""
        kinds = getattr(getattr(self.decoder, "rotary_emb", None), "rope_type", None)
        kinds = kinds.values() if isinstance(kinds, dict) else [kinds]  # Gemma 3: a type a layer type
        return all(isinstance(kind, str) and "dynamic" not in kind and kind != "longrope" for kind in kinds)

    def mixer_input(self, layer_idx: int, h_BTH):
        """What a layer's mixer reads: its input norm of the residual stream."""
        return rms_norm(self.layers[layer_idx].input_layernorm, h_BTH)

    def layer_forward(self, layer_idx: int, h_BTH, position_embeddings, entry, capturing: bool):
        """Pre-norm residual block, as every supported HF decoder layer computes it: h + mix(norm(h)), and that plus
        mlp(norm(that)). On CUDA the first sum runs inside the second norm's kernel and the last inside the MLP's
        down projection where they apply (`add_rms_norm`, `mlp_forward`): no pass of its own over the rows; a decoding
        step's gate and up are one stacked GEMM (`models.stacked_projections`)."""
        layer = self.layers[layer_idx]
        mixed = self.mix(layer_idx, self.mixer_input(layer_idx, h_BTH), position_embeddings, entry, capturing)
        normed, h_BTH = add_rms_norm(layer.post_attention_layernorm, mixed, h_BTH)
        return mlp_forward(
            layer.mlp, normed, residual=h_BTH, stacked_gate_up=lambda: _stacked_gate_up(layer.mlp, normed)
        )

    def layer_state_forward(self, layer_idx: int, h_BTH, position_embeddings, entry) -> None:
        """A capture's last layer: only what its entry keeps. Its output feeds no later layer and capture computes
        no logits (the last prompt token is replayed), so the MLP and whatever follows the mixer do not run, and
        attention pages take the chunk's K/V without attending (`attention_output_unused`). A recurrent layer's
        mixer still runs whole: its state comes out of the same scan as its output."""
        with attention_output_unused():
            self.mix(layer_idx, self.mixer_input(layer_idx, h_BTH), position_embeddings, entry, capturing=True)

    def final_hidden(self, h_BTH):
        return rms_norm(self.decoder.norm, h_BTH)

    @property
    def lm_head(self):
        return self.lm.get_output_embeddings()


def _stacked_gate_up(mlp, x_BTH):
    """A gated MLP's gate and up outputs from one stacked GEMM while decoding (`stacked_projections`), else None."""
    if not (hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj")):
        return None
    return stacked_linear((mlp.gate_proj, mlp.up_proj), x_BTH)


def sample_positions(numel: int, samples: int, device) -> torch.Tensor:
    """`samples` evenly spaced element indices of a flat tensor of `numel`, 0 and numel - 1 included, in
    exact integer arithmetic: a float32 linspace rounds numel - 1 up to numel once numel passes 2**24
    (311,164,927 becomes 311,164,928), an out-of-range read that CUDA reports as a device-side assert."""
    n = min(samples, numel)
    return torch.arange(n, device=device, dtype=torch.long) * (numel - 1) // max(n - 1, 1)


def _frozen_checksum(lm, frozen) -> float:
    """A sampled checksum of the frozen weights, kept on the model while they are unchanged (their
    storages and version counters say so), so checking a state costs one device sync per change."""
    frozen = [p for p in frozen if p.numel()]
    key = tuple((p.data_ptr(), p._version) for p in frozen)
    cached = getattr(lm, "_longstraw_frozen_checksum", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    by_device: dict = {}
    with torch.no_grad():
        for p in frozen:
            flat = p.detach().reshape(-1)
            at = sample_positions(flat.numel(), _SAMPLES, flat.device)
            by_device.setdefault(flat.device, []).append((flat[at].double() * (at + 1)).sum())
        value = sum(float(torch.stack(sums).sum()) for sums in by_device.values())
    lm._longstraw_frozen_checksum = (key, value)
    return value
