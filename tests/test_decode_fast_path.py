"""A decoding step's stacked projections and plain-attention path (`models.stacked_projections`,
`families.attention_decode`) against what they replace: each layer's own call, HF's attention module, HF `generate`."""

import pytest
import torch
from float64_reference import float64_model, hf_float64
from test_rollout import STOP, _sampled_as_hf_generates
from tolerances import max_abs, within

from longstraw.families import attention_decode
from longstraw.models.lora import apply_lora
from longstraw.models.stacked_projections import stacked_linear, stacked_projections_for_decoding
from longstraw.training.rollout import SamplingConfig

EPS64 = torch.finfo(torch.float64).eps


def _linears():
    torch.manual_seed(0)
    q = torch.nn.Linear(12, 8, bias=True).double()
    k = torch.nn.Linear(12, 4, bias=False).double()
    return q, k


def test_stacked_linear_is_each_layers_output_side_by_side():
    q, k = _linears()
    x = torch.randn(3, 1, 12, dtype=torch.float64)
    with torch.no_grad(), stacked_projections_for_decoding():
        out = stacked_linear((q, k), x)
    expected = torch.cat([x @ q.weight.T + q.bias, x @ k.weight.T], -1)
    # each output is one dot product of 12 terms: float64 rounding of the sum, bounded by 12 eps |x| |w|
    bound = 12 * EPS64 * float((x.abs() @ torch.cat([q.weight, k.weight]).detach().abs().T).max() + 1)
    within(max_abs(out, expected), bound, "stacked against separate projections")


def test_stacked_linear_declines_outside_decoding_and_under_autograd():
    q, k = _linears()
    x = torch.randn(2, 1, 12, dtype=torch.float64)
    with torch.no_grad():
        assert stacked_linear((q, k), x) is None  # no stacking context
    with stacked_projections_for_decoding():
        assert stacked_linear((q, k), x) is None  # grad enabled: the layers' own calls keep autograd
    with torch.no_grad(), stacked_projections_for_decoding(enabled=False):
        assert stacked_linear((q, k), x) is None


def test_stacked_lora_layers_use_the_merged_weight():
    model = float64_model("tiny-llama", seed=2)
    model = apply_lora(model, r=4, init_random=True).double()
    attn = model.get_base_model().model.layers[0].self_attn
    x = torch.randn(4, 1, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        expected = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)  # peft's own forward, unmerged
        with stacked_projections_for_decoding():
            out = stacked_linear((attn.q_proj, attn.k_proj, attn.v_proj), x)
    assert out is not None
    # merged and unmerged differ by the reassociation of W x + s B (A x): float64 rounding of sums of
    # hidden_size + r terms
    scale = float(x.abs().max() * (attn.q_proj.base_layer.weight.abs().max() + 1)) * model.config.hidden_size
    within(max_abs(out, expected), 64 * EPS64 * scale, "stacked LoRA projections against peft's")


@pytest.mark.numerics
@pytest.mark.parametrize("preset,plain", [("tiny-llama", True), ("tiny-qwen3", True), ("tiny-qwen3_5", False)])
def test_stacked_decoding_matches_hf_generate(preset, plain, monkeypatch):
    # float64: both sides sample from float32 probabilities of logits that agree to ~EPS64 (test_rollout's argument)
    model = apply_lora(float64_model(preset, seed=1), r=4, init_random=True).double()
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(0))
    config = SamplingConfig(num_generations=4, max_new_tokens=8, stop_ids=STOP, seed=3, stacked_projections=True)
    ran = []
    mix = attention_decode.decode_attention_mix

    def counting(attn_module, x_BTH, *rest):
        out = mix(attn_module, x_BTH, *rest)
        if x_BTH.shape[1] == 1:  # a decoding step's call (a capture's chunks take HF's module)
            ran.append(out is not None)
        return out

    monkeypatch.setattr("longstraw.families.attention_layer.decode_attention_mix", counting)
    with hf_float64(model):
        _sampled_as_hf_generates(model, prompt, config)
    assert ran and all(ran) == plain and any(ran) == plain  # the plain modules took the path, a gated one did not
