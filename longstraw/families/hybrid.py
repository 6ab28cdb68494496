"""Hybrid family (qwen3_next, qwen3_5, qwen3_5_moe): Gated DeltaNet layers + full attention.

GDN layers keep a `RecurrentState` (constant size); attention layers keep K/V pages.

HF's GDN forward updates its cache in place (autograd cannot go through it) and restarts the
conv from zeros for multi-token input. Here the layer continues from a `RecurrentState`: the conv
resumes from the last K-1 inputs and the delta rule from the recurrent state. Capture writes the
new state back in place; replay leaves the state untouched. HF's parameters and per-token modules
do everything else. The projection layout differs between model types (qwen3_next packs q/k/v/z
and b/a per key head group; qwen3_5 has separate projections); `project_qwen3_next` and
`project_qwen3_5` return the same four tensors so the rest is shared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longstraw.families.attention_layer import attention_mix
from longstraw.families.base import FamilyAdapter
from longstraw.families.dense import allocate_attention_pages, attention_page_bytes
from longstraw.kernels.causal_conv import conv_split_heads
from longstraw.kernels.gated_rms_norm import gated_rms_norm
from longstraw.kernels.gdn import chunk_gated_delta_rule_forward, gated_delta_rule
from longstraw.state import RecurrentState


def project_qwen3_next(module, x_BTH):
    q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x_BTH), module.in_proj_ba(x_BTH))
    mixed_BTC = torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (q, k, v)], dim=-1)
    return mixed_BTC, z, b, a


def project_qwen3_5(module, x_BTH):
    B, T, _ = x_BTH.shape
    z = module.in_proj_z(x_BTH).reshape(B, T, -1, module.head_v_dim)
    return module.in_proj_qkv(x_BTH), z, module.in_proj_b(x_BTH), module.in_proj_a(x_BTH)


def allocate_recurrent_state(module, dtype, device) -> RecurrentState:
    conv_dim = module.key_dim * 2 + module.value_dim
    conv = torch.zeros(1, conv_dim, module.conv_kernel_size - 1, dtype=dtype, device=device)
    recurrent = torch.zeros(
        1, module.num_v_heads, module.head_k_dim, module.head_v_dim, dtype=torch.float32, device=device
    )
    return RecurrentState(conv, recurrent)


def recurrent_state_bytes(config, dtype) -> int:
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    conv = (2 * key_dim + value_dim) * (config.linear_conv_kernel_dim - 1) * torch.empty((), dtype=dtype).element_size()
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    return conv + recurrent


def gdn_rule_inputs(module, project, x_BTH, conv_in):
    """What the delta rule of a GDN layer reads, from the layer's (normed) input `x_BTH` and the conv
    state `conv_in` (the last K-1 projected inputs before `x`, or None at the sequence's start):
    (q, k, v, g, beta, z, conv_state), `z` the output gate and `conv_state` the conv's new state. q and k come
    l2-normalised per head with the conv (`conv_split_heads`: one fused kernel each way on CUDA), for a rule called
    with `l2norm_qk=False`."""
    mixed_BTC, z, b, a = project(module, x_BTH)
    # q, k and v as tensors of their own, so the conv's output is freed before the rule runs (fla's kernels copy
    # strided inputs anyway, and capture's transient peaks inside the rule)
    q, k, v, conv_state = conv_split_heads(
        mixed_BTC,
        conv_in,
        module.conv1d.weight.squeeze(1),
        module.conv1d.bias,
        module.key_dim,
        module.head_k_dim,
        module.head_v_dim,
        module.activation,
    )
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    return q, k, v, g, beta, z, conv_state


def gdn_mix(module, project, x_BTH, state: RecurrentState, write_state: bool):
    """The GDN token mixer from `state`; differentiable unless capturing (`write_state`).

    A state with `keep_final` (the exact mode's recompute) is read and not written: the mixer runs
    differentiably and leaves the final (conv, recurrent) state, with its graph, in `state.final`."""
    B, T, _ = x_BTH.shape
    conv_in, recurrent_in = state.inputs()
    q, k, v, g, beta, z, conv_state = gdn_rule_inputs(module, project, x_BTH, conv_in)  # q and k normalised
    if write_state and not state.keep_final:  # capture and decoding: no autograd, the state written in place
        core_BTHV, recurrent = chunk_gated_delta_rule_forward(
            q, k, v, g, beta, recurrent_in, l2norm_qk=False, final_state_BHDV=state.recurrent_BHDV
        )
    else:
        core_BTHV, recurrent = gated_delta_rule(q, k, v, g, beta, recurrent_in, l2norm_qk=False)
    if state.keep_final:
        state.final = (conv_state, recurrent)
    elif write_state:
        state.conv_BCK1.copy_(conv_state)
        if recurrent is not state.recurrent_BHDV:
            state.recurrent_BHDV.copy_(recurrent)
    core = gated_rms_norm(module.norm, core_BTHV.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(B, T, -1))


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
