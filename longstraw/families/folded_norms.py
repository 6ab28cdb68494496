"""A decoding step's dense layer with its two RMSNorms folded into the projections that read them: eight launches.

A Llama-form RMSNorm is y = w * x * r with r = rsqrt(mean(x^2) + eps) a row, so a projection W of y is
r * (x (W diag(w))^T): the norm's weight folds into the projection's weight once (`stacked_weight(..., norm=)`, kept
and refreshed with the stacked weights), the GEMM reads the residual stream x itself, and the launch that already
reads the GEMM's output scales it by r first, computing r from x's row in float32: the rotary-and-append launch for
q, k and v (`rope_append_triton`'s `rms_of`), the stacked SwiGLU for gate and up (`swiglu_stacked_scaled_triton`).
The two residual sums go into o_proj's and down_proj's GEMMs (`swiglu.add_linear_`: cuBLAS's beta = 1, in the
residual's storage). A layer's step is then: the q/k/v GEMM, rotary and append, the attention's two launches,
o_proj into the residual, the gate/up GEMM, SwiGLU, down_proj into the residual; the unfolded path adds the input
norm and the post-attention norm (with the first sum inside).

Roundings: HF rounds x * r to the model's dtype and the product with w again before the GEMM; folded, W diag(w) is
rounded once (multiplied in float32), the GEMM reads x as it is and rounds its output, and r multiplies that in
float32, rounded once more with the rotation or the SwiGLU. The two agree within the dtype's rounding, not bit for
bit. The recorded graph is this same eager step, so graph and eager stay one computation.

It applies where all of it does (`_folded_weights`, checked before any work): a decoding step of a plain attention
module without q/k norms (`attention_decode.plain_decoding`; Qwen3's per-head norms would have to follow the
scale), Llama-form input and post-attention norms with weights in x's dtype (`rms_norm.foldable_norm`), a SiLU-gated
MLP, every projection a plain linear or single-adapter LoRA layer (its merged weight) without bias, and folding on
(`SamplingConfig.folded_norms`: by default on CUDA where projections stack). Anywhere else the layer runs
`FamilyAdapter.layer_forward`'s pre-norm block, the reference (tests/test_folded_norms.py). Off CUDA or in float64
the two kernels' torch references run (`attention_decode._rope_append`, `swiglu.swiglu_rms_scaled`).
"""

from __future__ import annotations

import torch.nn.functional as F

from longstraw.families.attention_decode import attend_stacked, plain_decoding
from longstraw.kernels.swiglu import add_linear_, silu_gated, swiglu_rms_scaled
from longstraw.models.stacked_projections import stacked_weight


def _folded_weights(layer, h_B1H, pages) -> tuple | None:
    """The weights of q/k/v (input norm folded), o_proj, gate/up (post-attention norm folded) and down_proj that
    the folded step multiplies by, each without bias; None where folding does not apply."""
    attn, mlp = layer.self_attn, layer.mlp
    if hasattr(attn, "q_norm") or not plain_decoding(attn, h_B1H, pages) or not silu_gated(mlp):
        return None
    built = (
        stacked_weight((attn.q_proj, attn.k_proj, attn.v_proj), h_B1H, norm=layer.input_layernorm),
        stacked_weight((attn.o_proj,), h_B1H),
        stacked_weight((mlp.gate_proj, mlp.up_proj), h_B1H, norm=layer.post_attention_layernorm),
        stacked_weight((mlp.down_proj,), h_B1H),
    )
    if any(b is None or b[1] is not None for b in built):
        return None
    return tuple(weight for weight, _ in built)


def folded_layer_forward(layer, h_B1H, position_embeddings, pages):
    """The decoder layer's output for one decoding step of the rows h_B1H on `pages` (k and v appended there), the
    norms folded (see the module doc), written into h's storage (the caller gives it away); None where folding does
    not apply, before any work."""
    weights = _folded_weights(layer, h_B1H, pages)
    if weights is None:
        return None
    qkv, o, gate_up, down = weights
    rms_of = (h_B1H, layer.input_layernorm.variance_epsilon)
    heads = attend_stacked(layer.self_attn, F.linear(h_B1H, qkv), position_embeddings, pages, rms_of=rms_of)
    h_B1H = add_linear_(h_B1H, heads, o)
    product = swiglu_rms_scaled(F.linear(h_B1H, gate_up), h_B1H, layer.post_attention_layernorm.variance_epsilon)
    return add_linear_(h_B1H, product, down)
