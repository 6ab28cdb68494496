"""A decoder layer's gated MLP, down(silu(gate(x)) * up(x)): on CUDA with fla's fused Triton `swiglu`, else HF's module.

HF's MLP runs silu and the product as two elementwise passes over the [rows, intermediate] activations, each way;
fla's kernel is one launch forward and one backward. The projections stay the module's own calls (they may be peft
LoRA layers). Any other MLP (another activation, an MoE block), CPU, float64 or no fla runs the module itself, the
plain reference.
"""

from __future__ import annotations

import functools

import torch
from transformers.activations import ACT2FN

from longstraw.kernels.fla_import import fla_function

# the classes an HF config's hidden_act "silu" builds (transformers' own SiLUActivation in 5.x), and torch's
SILU_CLASSES = (torch.nn.SiLU, type(ACT2FN["silu"]))

# fla's `swiglu` (gate, up) -> silu(gate) * up, differentiable in both; None when fla does not import
_load_fla_swiglu = functools.partial(fla_function, "fla.modules.activations", "swiglu")


def _fla_usable(mlp, x: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.numel() > 0
        and x.dtype != torch.float64
        and all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))
        and isinstance(getattr(mlp, "act_fn", None), SILU_CLASSES)
        and _load_fla_swiglu() is not None
    )


def mlp_forward(mlp, x: torch.Tensor):
    """`mlp(x)`, differentiable in x and the weights: fla's fused silu-and-multiply between the module's own
    projections on CUDA for a SiLU-gated MLP, the module itself otherwise (what it returns, a tuple too)."""
    if not _fla_usable(mlp, x):
        return mlp(x)
    # fla computes silu(gate) * up in float32 from the bf16 projections and rounds once; HF's F.silu(gate) * up
    # rounds silu's output to bf16 first: the two differ within bf16 rounding
    return mlp.down_proj(_load_fla_swiglu()(mlp.gate_proj(x), mlp.up_proj(x)))
