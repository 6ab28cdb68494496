"""A decoding step's dense layer with its RMSNorms folded into its projections (`families.folded_norms`) against
the unfolded step it replaces: the weight algebra and the step in float64 on the CPU (the kernels' torch
references), HF `generate`'s tokens; on CUDA (skipped without a GPU) the bf16 step against HF's module path and the
recorded graph against the eager step. The two kernels' arithmetic: tests/test_triton_interpreted.py."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from float64_reference import float64_model, hf_float64
from test_rollout import STOP, _sampled_as_hf_generates
from tolerances import EPS32, EPS_BF16, max_abs, within
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

from longstraw import capture
from longstraw.families import adapter_for, folded_norms
from longstraw.kernels.rms_norm import rms_scale
from longstraw.models import build_model
from longstraw.models.lora import apply_lora
from longstraw.models.stacked_projections import stacked_projections_for_decoding, stacked_weight
from longstraw.training.rollout import Decoder, SamplingConfig, decoding, sample

EPS64 = torch.finfo(torch.float64).eps
HIDDEN = 12


def _norm_and_linears(bias: bool = False):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(HIDDEN, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    q = torch.nn.Linear(HIDDEN, 8, bias=bias).double()
    k = torch.nn.Linear(HIDDEN, 4, bias=False).double()
    return norm, (q, k)


def test_folded_weight_times_the_row_scale_is_the_norm_then_the_projection():
    """rsqrt(mean(x^2) + eps) x (W diag(w))^T against (w x rsqrt(mean(x^2) + eps)) W^T in float64: each output a dot
    of HIDDEN terms and a few products, so within (HIDDEN + 4) EPS64 of |x| |w| |W| (times the row scale); without
    the scale it is far off."""
    norm, linears = _norm_and_linears()
    x = 3 * torch.randn(5, 1, HIDDEN, dtype=torch.float64)
    scale = rms_scale(x, norm.variance_epsilon)
    weight = torch.cat([linear.weight for linear in linears]).detach()
    expected = (norm.weight * x * scale) @ weight.T
    with torch.no_grad(), stacked_projections_for_decoding(fold_norms=True):
        folded, bias = stacked_weight(linears, x, norm=norm)
    assert bias is None
    ours = scale * F.linear(x, folded)
    magnitude = float(((x.abs() * scale) @ (weight.abs() * norm.weight.detach().abs()).T).max())
    within(max_abs(ours, expected), (HIDDEN + 4) * EPS64 * magnitude, "folded against normed then projected")
    assert max_abs(F.linear(x, folded), expected) > 1e-3 * magnitude


def test_folding_declines_a_bias_another_norm_form_and_outside_its_context():
    """No folded weight where the row scale would scale a bias, for a norm of another formula ((1 + w) x / rms(x):
    Qwen3.5's), a norm in another dtype, float16 rows (whose range the un-normed projection could pass), or without
    `fold_norms`; the unfolded stacked weight is still there."""
    norm, biased = _norm_and_linears(bias=True)
    _, linears = _norm_and_linears()
    x = torch.randn(2, 1, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        with stacked_projections_for_decoding(fold_norms=True):
            assert stacked_weight(biased, x, norm=norm) is None
            assert stacked_weight(linears, x, norm=Qwen3_5RMSNorm(HIDDEN).double()) is None
            assert stacked_weight(linears, x, norm=LlamaRMSNorm(HIDDEN)) is None  # float32 weight, float64 rows
            assert stacked_weight(linears, x, norm=norm) is not None
            halves = tuple(linear.half() for linear in _norm_and_linears()[1])
            assert stacked_weight(halves, x.half(), norm=LlamaRMSNorm(HIDDEN).half()) is None
        with stacked_projections_for_decoding():
            assert stacked_weight(linears, x, norm=norm) is None
            assert stacked_weight(linears, x) is not None


def _counting(monkeypatch) -> list:
    """Whether each decoding layer call took the folded path (a capture's layers are not decoding steps)."""
    ran, folded = [], folded_norms.folded_layer_forward

    def counting(layer, h_BTH, *rest):
        out = folded(layer, h_BTH, *rest)
        if h_BTH.shape[1] == 1:
            ran.append(out is not None)
        return out

    monkeypatch.setattr("longstraw.families.dense.folded_layer_forward", counting)
    return ran


@pytest.mark.numerics
@pytest.mark.parametrize("preset,folds", [("tiny-llama", True), ("tiny-qwen3", False)])
def test_folded_decoding_matches_hf_generate(preset, folds, monkeypatch):
    """Float64 on the CPU (the kernels' torch references), LoRA layers merged: the same tokens as HF `generate` from
    one seed (both sides sample from float32 probabilities of logits that agree to ~EPS64: test_rollout's
    argument). Llama's layers take the folded path, Qwen3's (q/k norms after the projection) do not."""
    model = apply_lora(float64_model(preset, seed=1), r=4, init_random=True).double()
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(0))
    config = SamplingConfig(4, 8, stop_ids=STOP, seed=3, stacked_projections=True, folded_norms=True)
    ran = _counting(monkeypatch)
    with hf_float64(model):
        _sampled_as_hf_generates(model, prompt, config)
    assert ran and all(ran) == folds and any(ran) == folds


def _second_step_logits(model, state, folded: bool, stacked: bool = True) -> torch.Tensor:
    """The logits of a decoder's second token (over the own pages its first step wrote)."""
    adapter = adapter_for(model)
    with decoding(adapter, stacked_projections=stacked, folded_norms=folded):
        decoder = Decoder(adapter, state, SamplingConfig(4, 4, cuda_graph=False))
        decoder.step()
        return decoder.logits()


@pytest.mark.numerics
def test_folded_step_logits_are_the_unfolded_ones_in_float64(monkeypatch):
    """One decoding step's logits, folded and not, in float64 on the CPU: float64 roundings of the same algebra,
    reordered, handed out rounded to float32 (`Decoder.logits`), so at most one float32 rounding apart (EPS32 of the
    largest logit)."""
    model = apply_lora(float64_model("tiny-llama", seed=1), r=4, init_random=True).double()
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(0))
    ran = _counting(monkeypatch)
    with hf_float64(model):
        state = capture(model, prompt, chunk_size=32)
        unfolded = _second_step_logits(model, state, folded=False)
        assert ran and not any(ran)
        ran.clear()
        folded = _second_step_logits(model, state, folded=True)
    assert ran and all(ran)
    within(max_abs(folded, unfolded), EPS32 * float(unfolded.abs().max()), "folded against unfolded logits")


def _cuda_policy(dtype):
    model = build_model("tiny-llama", seed=1, dtype=dtype, device="cuda", head_dim=64)
    return apply_lora(model, r=8, init_random=True).to("cuda")


@pytest.mark.cuda
def test_folded_bf16_step_is_as_close_to_float32_as_hfs_module_path_on_cuda(monkeypatch):
    """One bf16 step's logits, folded (stacked q/k/v and gate/up, the kernels) and through HF's modules (nothing
    stacked or folded), each against the float32 module path on the same (bf16) weights and prompt: folding rounds
    elsewhere than HF but as often, so its error is within twice HF's own bf16 error plus one bf16 rounding of the
    largest logit. The folded path ran on every layer."""
    model = _cuda_policy(torch.bfloat16)
    prompt = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(0)).cuda()
    wide = copy.deepcopy(model).float()
    reference = _second_step_logits(wide, capture(wide, prompt, chunk_size=256), folded=False, stacked=False)
    state = capture(model, prompt, chunk_size=256)
    hf = _second_step_logits(model, state, folded=False, stacked=False)
    ran = _counting(monkeypatch)
    ours = _second_step_logits(model, state, folded=True)
    assert ran and all(ran)
    largest = float(reference.abs().max())
    assert max_abs(ours, reference) <= 2 * max_abs(hf, reference) + EPS_BF16 * largest


@pytest.mark.cuda
def test_folded_graph_is_the_eager_step_bit_for_bit_on_cuda(monkeypatch):
    """In bf16 with the folded layers (the default on CUDA), the recorded graph's tokens and log-probs are the eager
    step's, bit for bit: the graph records that same step."""
    model = _cuda_policy(torch.bfloat16)
    prompt = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(0)).cuda()
    state = capture(model, prompt, chunk_size=256)
    ran = _counting(monkeypatch)
    config = SamplingConfig(8, 24, stop_ids=tuple(range(3, 256, 11)), seed=5)
    eager = sample(model, state, dataclasses.replace(config, cuda_graph=False))
    graphed = sample(model, state, config)
    assert ran and all(ran) and graphed.graphed and not eager.graphed
    for a, b, lp_a, lp_b in zip(eager.responses, graphed.responses, eager.logprobs, graphed.logprobs, strict=True):
        assert torch.equal(a, b) and torch.equal(lp_a, lp_b)
