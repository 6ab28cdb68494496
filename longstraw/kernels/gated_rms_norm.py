"""The output norm of a Gated DeltaNet layer: each head's output RMS-normalised, weighted and gated by silu(z).

The plain reference is HF's own module (`Qwen3_5RMSNormGated`, `Qwen3NextRMSNormGated`): the norm in float32,
rounded to the input's dtype, times the weight, times silu of the gate in float32, rounded again; forward and
backward that is a dozen elementwise launches each way over float32 copies of the layer's whole output. On CUDA
`gated_rms_norm` runs fla's fused Triton kernel instead: one pass forward and one backward, the same product in
float32 rounded once. Elsewhere (CPU, float64, no fla) it calls the module.
"""

from __future__ import annotations

import functools

import torch

from longstraw.kernels.optional_import import optional_function

# fla's `rms_norm_gated` (x, g, weight, bias, activation, ..., eps), or None when fla does not import
_load_fla_norm = functools.partial(optional_function, "fla.modules.norm.fused_norm_gate", "rms_norm_gated")


def _fla_norm_usable(module, x_ND: torch.Tensor) -> bool:
    return (
        x_ND.is_cuda
        and x_ND.shape[0] > 0
        and torch.float64 not in (x_ND.dtype, module.weight.dtype)
        and module.activation in ("silu", "swish")
        and _load_fla_norm() is not None
    )


def gated_rms_norm(module, x_ND: torch.Tensor, gate_ND: torch.Tensor) -> torch.Tensor:
    """`module(x_ND, gate_ND)` for HF's gated RMSNorm `module` (its `weight`, `variance_epsilon`, `activation`):
    rows of one head's output `[N, D]` and their gate, the result in `x`'s dtype, differentiable in `x`, the gate
    and the weight. fla's fused kernel on CUDA, the module itself elsewhere."""
    if not _fla_norm_usable(module, x_ND):
        return module(x_ND, gate_ND)
    if gate_ND.shape != x_ND.shape:
        raise ValueError(f"the gate must have x's shape {tuple(x_ND.shape)}, got {tuple(gate_ND.shape)}")
    return _load_fla_norm()(x_ND, gate_ND, module.weight, None, activation="silu", eps=module.variance_epsilon)
