"""FLOP counts of the transaction's work, from a model config (2 FLOPs per multiply-add).

Attention counts what the kernels execute: a forward block does two matmuls (QK^T, PV), a
flash backward block five (QK^T recomputed, dP, dV, dQ, dK), i.e. 2.5 times the forward.
Linear work counts the decoder's projections and MLPs plus the LM head; the replay backward
counts the input gradients through the frozen base (2 x forward) and the LoRA weight
gradients. Gated DeltaNet's recurrence, norms and elementwise work are left out: the floor
is a lower bound, and the measured time over it shows what they cost.
"""

from __future__ import annotations

import re

BACKWARD_OVER_FORWARD = 2.5


def attention_layers(config) -> int:
    types = getattr(config, "layer_types", None)
    return sum(t == "full_attention" for t in types) if types else config.num_hidden_layers


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_forward_flops(heads: int, head_dim: int, queries: int, prefix: int) -> int:
    """One attention layer: `queries` live queries over `prefix` resident keys plus their own causal keys."""
    pairs = queries * prefix + queries * (queries + 1) // 2
    return 4 * heads * head_dim * pairs


def replay_attention_flops(config, response_length: int, prefix: int) -> tuple[int, int]:
    """(forward, backward) attention FLOPs of one replayed member over `prefix` resident positions."""
    forward = attention_layers(config) * attention_forward_flops(
        config.num_attention_heads, head_dim(config), response_length, prefix
    )
    return forward, int(BACKWARD_OVER_FORWARD * forward)


def _weights_by_module(model) -> dict[str, int]:
    """{name: in x out} of every nn.Linear (NF4 ones included) except LoRA's own."""
    import torch

    return {
        name: m.in_features * m.out_features
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lora_" not in name
    }


def linear_parameters(model) -> int:
    """Weights that multiply every token: every nn.Linear (NF4 ones included) except LoRA's own."""
    return sum(_weights_by_module(model).values())


def replay_linear_flops(linear_params: int, response_length: int, lora_parameters: int) -> tuple[int, int]:
    """(forward, backward) projection + MLP + LM-head FLOPs of one replayed member."""
    forward = 2 * linear_params * response_length + 2 * lora_parameters * response_length
    backward = 2 * linear_params * response_length + 4 * lora_parameters * response_length
    return forward, backward


def replay_floor_seconds(
    config, linear_params: int, lora_params: int, response_length: int, prefix: int, rates: dict
) -> dict:
    """One replayed member's FLOP floor at measured rates (TFLOP/s dicts as kernel_rates records them):
    attention forward and backward at the rates of the kernels replay takes (cuDNN's where measured,
    else flash's), the linear work at the GEMM rate."""
    attn_fwd, attn_bwd = replay_attention_flops(config, response_length, prefix)
    lin = sum(replay_linear_flops(linear_params, response_length, lora_params))

    def tflops(name, fallback=None):
        return rates[name if name in rates else fallback]["tflops_per_second"] * 1e12

    parts = {
        "attention_forward": attn_fwd / tflops("cudnn_forward", "flash_forward"),
        "attention_backward": attn_bwd / tflops("cudnn_backward", "flash_backward"),
        "linear": lin / tflops("gemm"),
    }
    return {
        "seconds": sum(parts.values()),
        "parts_seconds": parts,
        "flops": {"attention_forward": attn_fwd, "attention_backward": attn_bwd, "linear": lin},
    }


def _layer_index(module_name: str) -> int | None:
    found = re.search(r"(?:^|\.)layers\.(\d+)\.", module_name)
    return int(found.group(1)) if found else None


def capture_linear_parameters(model, config) -> int:
    """The weights a capture multiplies every position by: `linear_parameters` less the LM head (capture computes
    no logits) and the last decoder layer's MLP (nothing reads that layer's output, so capture runs only what its
    entry keeps: `FamilyAdapter.layer_state_forward`)."""
    weights = _weights_by_module(model)
    last = max(i for name in weights if (i := _layer_index(name)) is not None)
    last_mlp = sum(w for name, w in weights.items() if _layer_index(name) == last and ".mlp." in name)
    return sum(weights.values()) - config.hidden_size * config.vocab_size - last_mlp


def capture_flops(config, capture_linear_params: int, positions: int) -> dict:
    """A capture's FLOPs: each attention layer's causal forward over the whole prompt but the last layer's (its
    pages take the K/V, nothing reads its output), and `capture_linear_parameters`' work on `positions` tokens."""
    types = getattr(config, "layer_types", None)
    last_attends = types[-1] == "full_attention" if types else True
    attention = (attention_layers(config) - last_attends) * attention_forward_flops(
        config.num_attention_heads, head_dim(config), positions, 0
    )
    return {"attention": attention, "linear": 2 * capture_linear_params * positions}


def capture_floor_seconds(config, capture_linear_params: int, positions: int, rates: dict) -> dict:
    """A capture's FLOP floor at measured rates: attention at the forward kernel capture takes (cuDNN's
    when measured, else flash's), the linear work at the GEMM rate."""
    flops = capture_flops(config, capture_linear_params, positions)
    kernel = "cudnn_forward" if "cudnn_forward" in rates else "flash_forward"
    parts = {
        "attention": flops["attention"] / (rates[kernel]["tflops_per_second"] * 1e12),
        "linear": flops["linear"] / (rates["gemm"]["tflops_per_second"] * 1e12),
    }
    return {"seconds": sum(parts.values()), "parts_seconds": parts, "flops": flops, "attention_kernel": kernel}
