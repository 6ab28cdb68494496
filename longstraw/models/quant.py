"""NF4 weight quantisation (QLoRA base) by swapping modules for `bitsandbytes.nn.Linear4bit`.

    model = quantize_nf4(build_model("tiny-qwen3_5"))      # or a bf16 checkpoint on CUDA
    model = apply_lora(model, r=16)                          # LoRA wraps the 4-bit layers

We quantise modules directly because HF's `from_config` ignores `quantization_config`; no
save/reload is needed. The rule:

* every `nn.Linear` of the model becomes an NF4 `Linear4bit` (blockwise absmax, `blocksize`
  values per block, double-quantised absmax by default), holding the same weights quantised;
* except names in `skip` (`lm_head` by default), and MoE routing: a Linear whose parent also
  holds an `experts` module and whose output width is the number of experts (router logits) or 1
  (shared-expert gate) stays in full precision, so top-k routing is not perturbed by 4-bit noise.
  (In transformers 5 the routers are `*TopKRouter` modules and the routed experts are fused 3-D
  parameters, not `nn.Linear`: both are left untouched, so MoE expert weights stay unquantised.)

Many-row inputs (capture chunks, replayed responses: at least `DEQUANTIZE_MIN_ROWS` rows) do not
go through bitsandbytes' fused 4-bit GEMM: the weight is dequantised once per call into the compute
dtype and a plain GEMM runs (`DequantizedMatmul`; rates against the fused kernel in
`longstraw.kernels.nf4_linear`). The dequantised weight is a per-call transient: the backward
dequantises again instead of keeping it.
Few-row inputs (decoding) keep bitsandbytes' own path, the reference beside this one.

Capture (`models.lora_linear.merged_lora_for_capture()`, which `longstraw.capture` enters) goes one step
further: a peft LoRA layer over a 4-bit base runs as one GEMM on dequantise(W) + scaling * B @ A, instead of
the base GEMM, peft's defensive clone of its output and LoRA's float32 side path (a float32 copy of the input
and of the output per layer): on the 27B shape that side path was 40% of a capture chunk's GPU time.
A layer-major capture keeps each layer's merged weights while that layer runs its chunks
(`merged_weights_kept`), so they are built once per layer, not once per chunk. Only graph-free many-row
calls inside a capture take it; scoring and replay keep peft's forward, so the
log-probs GRPO compares come from one computation. In bf16 the merged weight's rounding differs from
the unmerged sum's by bf16 rounding; in float32 they agree to float32 rounding.

Compute dtype defaults to the dtype the weight had (bf16 on GPU, float32 in CPU tests), fixed
at construction, instead of bnb's "dtype of the first input seen".

bitsandbytes 0.50.2 quirks handled here:
* `Params4bit.to(device)` quantises on the first move (CPU and CUDA alike; on CPU the default
  backend's pure-torch `quantize_4bit` runs), so we wrap the weight and move it to its own device.
* on CPUs with AVX512-BF16, `Linear4bit.forward` in eval mode without grad repacks the weight
  into a CPU-only layout and crashes; `support_avx512bf16_for_cpu = False` is set on each module.
* `Linear4bit.forward` writes a bias of another dtype than the compute dtype back into the parameter in the
  compute dtype (`bias.data = ...`: gpt-oss's projections have biases), which moves its storage (a resident
  state's binding then refuses the model) and its precision; the few-row path calls bnb's `matmul_4bit` on a
  cast copy instead, what that forward computes without the write (its CPU repack is off, its compute dtype
  fixed, as above).
* peft wraps a `Linear4bit` with its 4-bit LoRA layer (`peft.tuners.lora.bnb.Linear4bit`) only
  if `model.is_loaded_in_4bit` is true (otherwise it falls back to its plain `lora.Linear`); we set it.

No `prepare_model_for_kbit_training` is needed (or wanted): it casts every non-4-bit parameter to
float32 and enables HF gradient checkpointing, whereas we keep bf16 compute and replay manages
its own memory. LoRA parameters get gradients through the frozen 4-bit base as they are.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from longstraw.kernels.nf4_linear import DEQUANTIZE_MIN_ROWS, DequantizedMatmul, dequantize
from longstraw.models.lora_linear import kept_or_built, merged_lora_weight, merging, single_plain_adapter


@functools.cache
def dequantizing_linear4bit_class():
    """`bnb.nn.Linear4bit` whose many-row calls dequantise and GEMM (peft still sees a Linear4bit)."""
    import bitsandbytes as bnb
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    class DequantizingLinear4bit(bnb.nn.Linear4bit):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            fix_4bit_weight_quant_state_from_module(self)
            bias = None if self.bias is None else self.bias.to(self.compute_dtype)  # a copy: see the module doc
            x_c = x.to(self.compute_dtype)
            if x.numel() < DEQUANTIZE_MIN_ROWS * x.shape[-1]:
                out = bnb.matmul_4bit(x_c, self.weight, bias=bias, quant_state=self.weight.quant_state)
            else:
                out = DequantizedMatmul.apply(x_c, self.weight, bias)
            return out.to(x.dtype)

    return DequantizingLinear4bit


@functools.cache
def merging_lora_class():
    """peft's LoRA layer over a 4-bit base whose capture calls run on the merged weight."""
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    class MergingLoraLinear4bit(LoraLinear4bit):
        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            adapter = single_plain_adapter(self)
            if not merging() or args or kwargs or adapter is None or x.numel() < DEQUANTIZE_MIN_ROWS * x.shape[-1]:
                return super().forward(x, *args, **kwargs)
            base = self.base_layer

            def build():
                fix_4bit_weight_quant_state_from_module(base)
                return merged_lora_weight(
                    dequantize(base.weight, torch.float32),
                    self.lora_A[adapter].weight,
                    self.lora_B[adapter].weight,
                    self.scaling[adapter],
                    base.compute_dtype,
                )

            weight = kept_or_built(self, build)
            bias = None if base.bias is None else base.bias.to(base.compute_dtype)
            return F.linear(x.to(base.compute_dtype), weight, bias).to(x.dtype)

    return MergingLoraLinear4bit


def adopt_lora_layers(model) -> None:
    """Give peft's LoRA layers over our 4-bit bases the capture's merged path (in place)."""
    try:
        from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
    except ImportError:  # no bitsandbytes: no 4-bit layers either
        return
    for module in model.modules():
        if type(module) is LoraLinear4bit and isinstance(module.base_layer, dequantizing_linear4bit_class()):
            module.__class__ = merging_lora_class()


def _expert_count(model) -> int | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return None


def is_routing_linear(parent: nn.Module, linear: nn.Linear, num_experts: int | None) -> bool:
    """MoE router logits or shared-expert gate: kept in full precision."""
    return hasattr(parent, "experts") and linear.out_features in {1, num_experts}


def quantize_nf4(
    model: nn.Module,
    *,
    compute_dtype: torch.dtype | None = None,
    skip=("lm_head",),
    blocksize: int = 64,
    double_quant: bool = True,
) -> nn.Module:
    """Replace the model's `nn.Linear`s (see the module docstring for which) by NF4 `Linear4bit`, in place."""
    import bitsandbytes as bnb

    if any("lora_A" in name for name, _ in model.named_modules()):
        raise ValueError("quantize_nf4 must run before apply_lora (LoRA layers wrap the 4-bit modules)")
    for parent, child_name in _quantized_linears(model, skip):  # one at a time: the old weight is freed as we go
        old = getattr(parent, child_name)
        setattr(parent, child_name, _nf4_linear(bnb, old, compute_dtype, blocksize, double_quant))
        del old
    model.is_loaded_in_4bit = True
    return model


def _quantized_linears(model: nn.Module, skip) -> list[tuple[nn.Module, str]]:
    """(parent, child name) of every plain `nn.Linear` to quantize: not one `skip` names, not a router."""
    num_experts = _expert_count(model)
    targets = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if (
                type(child) is not nn.Linear
                or any(name == s or name.endswith("." + s) for s in skip)
                or is_routing_linear(parent, child, num_experts)
            ):
                continue
            targets.append((parent, child_name))
    return targets


def _nf4_linear(bnb, old: nn.Linear, compute_dtype, blocksize: int, double_quant: bool) -> nn.Module:
    """`old` as an NF4 `Linear4bit` (its weight quantized on its device; its bias and training mode kept)."""
    weight = old.weight.detach()
    new = dequantizing_linear4bit_class()(
        old.in_features,
        old.out_features,
        bias=old.bias is not None,
        compute_dtype=compute_dtype or weight.dtype,
        compress_statistics=double_quant,
        quant_type="nf4",
        quant_storage=torch.uint8,
        device="meta",
    )
    new.weight = bnb.nn.Params4bit(
        weight,
        requires_grad=False,
        blocksize=blocksize,
        compress_statistics=double_quant,
        quant_type="nf4",
        quant_storage=torch.uint8,
        module=new,
    ).to(weight.device)  # quantises
    if old.bias is not None:
        new.bias = old.bias
    new.support_avx512bf16_for_cpu = False
    new.train(old.training)
    return new
