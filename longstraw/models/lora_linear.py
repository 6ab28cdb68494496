"""peft's LoRA linear layer with the adapter's update added into the base's output in place.

peft's `Linear.forward` adds an adapter as `result + lora_B(lora_A(x)) * scaling`, then casts back to the base's
dtype. With its default float32 adapters over bf16 weights that is three float32 [rows, out] tensors beside the
result (lora_B's output, its scaled copy, the sum): at a capture chunk of 8,192 rows through a GDN layer's
in_proj_qkv (8,192 outputs) 0.8 GB, the peak of capture's transient memory. Here the scaling multiplies
lora_A's [rows, r] output and lora_B's output is added into the base's result in place: one temporary, and two
fewer passes over [rows, out], with autograd as well as without.

The products are peft's: with a power-of-two scaling (peft's default alpha = 2r gives 2) the output and every
gradient are bit-identical to peft's, as scaling by a power of two commutes with rounding; otherwise they differ
by the rounding of the scaling's product. Whatever else peft's layer does (adapters disabled or merged, several
active, a variant such as DoRA, dropout that is active, mixed-batch arguments) runs peft's own forward; a layer
whose base is not an `nn.Linear` is not adopted.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def single_plain_adapter(layer) -> str | None:
    """The one active vanilla LoRA adapter of peft's LoRA `layer` with no active dropout, or None."""
    if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in layer.lora_variant:
        return None
    dropout = layer.lora_dropout[name]
    return name if isinstance(dropout, nn.Identity) or not dropout.training or dropout.p == 0 else None


@functools.cache
def in_place_lora_class():
    from peft.tuners.lora.layer import Linear as LoraLinear

    class InPlaceLoraLinear(LoraLinear):
        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            adapter = single_plain_adapter(self)
            if adapter is None or args or kwargs:
                return super().forward(x, *args, **kwargs)
            lora_A, lora_B = self.lora_A[adapter], self.lora_B[adapter]
            result = self.base_layer(x)
            update = lora_B(lora_A(self._cast_input_dtype(x, lora_A.weight.dtype)) * self.scaling[adapter])
            return result.add_(update)  # in the result's dtype, as peft's final cast gives

    return InPlaceLoraLinear


def adopt_in_place_lora(model) -> None:
    """Give peft's LoRA linear layers over an `nn.Linear` (exactly those classes: not subclasses, not 4-bit
    layers) the in-place update of this module, in place."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    for module in model.modules():
        if type(module) is LoraLinear and type(module.base_layer) is nn.Linear:
            module.__class__ = in_place_lora_class()
