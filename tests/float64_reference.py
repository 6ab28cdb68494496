"""Float64 references, for comparisons whose float32 answer is set by rounding, not by the code under test.

HF's modeling code runs some steps in float32 whatever the model's dtype: Gated DeltaNet's torch
kernels (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`), the RMS norms, the
gated norm and the eager attention softmax cast to `torch.float32` and back, so HF's forward of a
float64 model is still only float32-accurate there, and so is ours, which runs HF's norms and MLPs.
Inside `hf_float64(model)`, the `torch` that the model's `transformers` modeling modules see answers
float64 for `float32` (and `float`), and the few modules that cast with the `.float()` method instead
(Gemma 3's RMS norm and rotary: `_METHOD_CASTS`) compute in their input's precision when it is wider; nothing else
changes, and everything is restored on exit:

    net = float64_model("tiny-qwen3_5", seed=1)
    with hf_float64(net):
        ours = grads_of(net, replay(net, capture(net, prompt), response).sum())
        expected = grads_of(net, hf_conditional_logprobs(net, prompt, response).sum())

Why the tests need it: on the GDN presets, float32 gradients of the decay path (A_log, dt_bias,
in_proj_a and its LoRA factors) are ill-conditioned. Measured on tiny-qwen3_5 (LoRA, 37-token
prompt), the float32 conditional reference is off the float64 one by 2.3e-4..4.0e-4 (max relative
error per parameter) and our float32 replay by 2.3e-4..4.2e-4, depending on the ATen CPU
capability (default / avx2 / avx512); the full-parameter gradients of tiny-qwen3_5_moe by 1.7e-3.
Ours and HF agreed to 1e-4 in float32 only where their roundings happened to coincide; in float64
with both sides inside `hf_float64` they agree to <= 9.6e-7 on every preset, with ATen, MKL and oneDNN
on their AVX-512, AVX2 or SSE4.2 paths, MKL_CBWR=COMPATIBLE, at 1 and 2 threads (what stays float32 on both
sides: the log-softmax of the logits and exp(A_log); tests/tolerances.py, float64_residue_tolerance).
"""

from __future__ import annotations

import importlib
import types
from contextlib import contextmanager

import torch

from longstraw.models import build_model


class _Float64Torch(types.ModuleType):
    """`torch`, except that its float32 dtype reads as float64."""

    def __getattr__(self, name):
        value = getattr(torch, name)
        return torch.float64 if value is torch.float32 else value


def _gemma_norm_in_input_precision(self, x):
    """Gemma3RMSNorm.forward with `.float()` made float32-or-wider: a float64 input is normed in float64."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    return (self._norm(x.to(dtype)) * (1.0 + self.weight.to(dtype))).type_as(x)


def _gemma_rotary_in_float64(self, x, position_ids, layer_type):
    """Gemma3RotaryEmbedding.forward (default and linear rope: the inverse frequencies set at init) in float64.
    transformers 5.17 casts one operand with `.float()` and the other with `torch.float`, which the proxy turns
    into float64, so its matmul meets two dtypes; later versions multiply elementwise, which promotes."""
    inv_freq = getattr(self, f"{layer_type}_inv_freq").to(device=x.device, dtype=torch.float64)
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    scaling = getattr(self, f"{layer_type}_attention_scaling")
    return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


def _rotary_in_float64(self, x, position_ids):
    """The default rotary forward (inverse frequencies set at init: default and YaRN rope) in float64. transformers
    5.17's Llama form (shared by Glm4Moe, GlmMoeDsa, DeepseekV3, DeepseekV32) casts the frequencies with
    `torch.float`, float64 under the proxy, and the positions with `.float()`, so its matmul meets two dtypes and
    raises; later versions multiply elementwise, which promotes to float64, the values computed here."""
    inv_freq = self.inv_freq.to(device=x.device, dtype=torch.float64)
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


# classes whose forward casts with `.float()`, which the torch proxy cannot see (measured on tiny-gemma3, LoRA
# conditional gradient: 5.0e-7 from HF with Gemma's float32 norms, 2.6e-8 with them lifted), or mixes the two
_METHOD_CASTS = {
    "Gemma3RMSNorm": _gemma_norm_in_input_precision,
    "Gemma3RotaryEmbedding": _gemma_rotary_in_float64,
    **dict.fromkeys(
        (
            "LlamaRotaryEmbedding",
            "Glm4MoeRotaryEmbedding",
            "GlmMoeDsaRotaryEmbedding",
            "DeepseekV3RotaryEmbedding",
            "DeepseekV32RotaryEmbedding",
        ),
        _rotary_in_float64,
    ),
}


@contextmanager
def hf_float64(model):
    """Inside the block, `model`'s transformers modeling modules compute their float32 casts in float64."""
    with hf_float64_modules(*{type(m).__module__ for m in model.modules()}):
        yield


@contextmanager
def hf_float64_modules(*names):
    """hf_float64 for the named modules (those of transformers among them), for models built inside the
    block (`run_point`, the trainer; forked ranks inherit it): `"transformers.models.llama.modeling_llama"`."""
    modules = {importlib.import_module(name) for name in names}
    patched = [m for m in modules if m.__name__.startswith("transformers.") and vars(m).get("torch") is torch]
    proxy = _Float64Torch("torch")
    casting = {cls: cls.forward for m in patched for name, cls in vars(m).items() if name in _METHOD_CASTS}
    for module in patched:
        module.torch = proxy
    for cls in casting:
        cls.forward = _METHOD_CASTS[cls.__name__]
    try:
        yield
    finally:
        for module in patched:
            module.torch = torch
        for cls, forward in casting.items():
            cls.forward = forward


def hf_float64_for(preset):
    """hf_float64 for every model of `preset` built inside the block (by `run_point`, the trainer)."""
    return hf_float64_modules(*{type(m).__module__ for m in build_model(preset).modules()})


def has_gdn(model) -> bool:
    """Whether the model has Gated DeltaNet layers (whose exp(A_log) stays float32 in float64: see
    tests/tolerances.py, float64_residue_tolerance)."""
    return any(type(m).__name__.endswith("GatedDeltaNet") for m in model.modules())


def to_float64(model):
    """The model in float64, MoE experts on HF's eager loop (torch's grouped_mm has no float64)."""
    model = model.to(torch.float64)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "set_experts_implementation"):
        base.set_experts_implementation("eager")
    return model


def float64_model(preset, **kwargs):
    """`build_model(preset, **kwargs)` in float64 (the same weights: presets initialise in float32)."""
    return to_float64(build_model(preset, **kwargs))


@contextmanager
def float64_gdn_states():
    """Inside the block, a float64 model's Gated DeltaNet recurrent states are float64 too (longstraw keeps
    them in float32 whatever the model's dtype, `families.hybrid.allocate_recurrent_state`), and so is their
    predicted size. For comparisons that split the recurrence differently: a context-parallel capture
    composes the state entering each shard (`longstraw.cp.gdn_shards`) where a single process rounds it to
    float32 after every capture chunk; with float32 states the two differ by that rounding (tiny-qwen3_5,
    23 positions, chunk 4: replay gradients up to 2.1e-7 relative, a GRPO step's update 7.2e-9 overall),
    with float64 states by float64 rounding (<= 4e-16)."""
    import longstraw.families.hybrid as hybrid

    allocate, nbytes = hybrid.allocate_recurrent_state, hybrid.recurrent_state_bytes

    def allocate_float64(module, dtype, device):
        state = allocate(module, dtype, device)
        if dtype == torch.float64:
            state.recurrent_BHDV = state.recurrent_BHDV.double()
        return state

    def nbytes_float64(config, dtype):
        extra = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
        return nbytes(config, dtype) + (extra if dtype == torch.float64 else 0)

    hybrid.allocate_recurrent_state, hybrid.recurrent_state_bytes = allocate_float64, nbytes_float64
    try:
        yield
    finally:
        hybrid.allocate_recurrent_state, hybrid.recurrent_state_bytes = allocate, nbytes
