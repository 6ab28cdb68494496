"""NF4 quantisation (bitsandbytes Linear4bit) and QLoRA: replay against HF on the same 4-bit model."""

import math

import pytest
import torch

try:
    import bitsandbytes as bnb
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
except Exception as exc:  # not installed, or a broken build (missing native library)
    pytest.skip(f"bitsandbytes is not importable ({exc!r}): NF4/QLoRA tests skipped", allow_module_level=True)

from float64_reference import has_gdn, hf_float64, to_float64  # noqa: E402
from tolerances import close, float32_tolerance, float64_residue_tolerance, logprob_tolerance, max_abs, relative, within  # noqa: E402  # noqa: E402

from longstraw import capture, replay  # noqa: E402
from longstraw.core.hf_reference import grads_of, hf_conditional_logprobs, hf_full_logprobs, max_relative_error  # noqa: E402
from longstraw.models import TINY_PRESETS, build_model  # noqa: E402
from longstraw.models.lora import apply_lora  # noqa: E402
from longstraw.models.quant import quantize_nf4  # noqa: E402


def _quant_state_tensors(qs):
    yield from (qs.absmax, qs.code, qs.offset)
    if qs.state2 is not None:
        yield from _quant_state_tensors(qs.state2)


def quantized_bytes(model) -> int:
    """Bytes of weight storage: every parameter once, 4-bit ones as packed data plus quant state."""
    total = 0
    for param in model.parameters():  # parameters() already yields tied weights once
        total += param.numel() * param.element_size()
        if isinstance(param, bnb.nn.Params4bit) and param.quant_state is not None:
            total += sum(
                t.numel() * t.element_size()
                for t in _quant_state_tensors(param.quant_state)
                if isinstance(t, torch.Tensor)
            )
    return total


PROMPT_LEN = 37
ROUTER_GATES = ("shared_expert_gate",)


def _ids(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _nf4_dequantized(weight):
    """The NF4 format read in plain torch: element i of the row-major weight is code[nibble i] (high
    nibble of each byte first) times the absmax of its flat block i // blocksize (double-quantised:
    8-bit blockwise absmax + offset). It equals bitsandbytes' pure-torch dequantisation and CUDA's."""
    qs = weight.quant_state
    absmax = bnb.functional.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset if qs.nested else qs.absmax
    packed, n = weight.data.reshape(-1), math.prod(qs.shape)
    nibbles = torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(-1)[:n]
    return (qs.code[nibbles.long()] * absmax.float().repeat_interleave(qs.blocksize)[:n]).reshape(qs.shape)


@pytest.mark.numerics
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_linears_become_nf4_with_close_weights_and_routing_kept(preset):
    model = build_model(preset, seed=1)
    originals = {n: m.weight.detach().clone() for n, m in _linears(model).items()}
    routers = {n: m.weight.detach().clone() for n, m in model.named_modules() if type(m).__name__.endswith("Router")}
    float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert quantize_nf4(model, compute_dtype=torch.float32) is model

    nf4 = bnb.functional.get_4bit_type("nf4", device="cpu")
    half_gap = float(nf4.sort().values.diff().max()) / 2  # worst rounding error of NF4, in units of block absmax
    quantised, packed, overhead = 0, 0, 0
    for name, module in _linears(model).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "lm_head" or leaf in ROUTER_GATES:  # skipped / routing (output width 1): full precision
            assert type(module) is torch.nn.Linear and torch.equal(module.weight, originals[name])
            assert leaf == "lm_head" or module.out_features == 1
            continue
        assert isinstance(module, bnb.nn.Linear4bit), name
        w = module.weight
        assert isinstance(w, bnb.nn.Params4bit) and w.quant_type == "nf4" and w.blocksize == 64
        assert w.dtype == torch.uint8 and w.bnb_quantized and not w.requires_grad
        assert module.support_avx512bf16_for_cpu is False and module.compute_dtype == torch.float32
        # The quantisation is checked on the format itself: bitsandbytes 0.50.2's native CPU
        # dequantize_4bit takes an AVX512F branch on AVX512F CPUs (its own CPUID check, whatever
        # ATEN_CPU_CAPABILITY says) that indexes absmax per row (row * (in // 64) + col // 64), right
        # only when in_features % 64 == 0: the MoE presets' shared-expert down_proj (in_features 32)
        # dequantises with the wrong block scales there (error up to 0.46 of the block absmax, scalar
        # branch and pure-torch path: 0.15). Where that branch is right, bnb's result is this one exactly.
        deq = _nf4_dequantized(w)
        if w.quant_state.shape[1] % w.blocksize == 0:
            assert torch.equal(bnb.functional.dequantize_4bit(w.data, w.quant_state), deq), name
        orig = originals[name]
        assert deq.shape == orig.shape and deq.dtype == orig.dtype
        block_absmax = orig.reshape(-1, 64).abs().amax(1, keepdim=True)
        err = (deq - orig).reshape(-1, 64).abs()
        assert (err <= (half_gap + 0.02) * block_absmax + 1e-7).all(), name  # + 8-bit double-quantised absmax
        assert float((deq - orig).norm() / orig.norm()) < 0.15, name
        quantised += 1
        packed += orig.numel()
        overhead += 16 * 4 + 4 + math.ceil(orig.numel() / 64 / 256) * 4 + 256 * 4  # code, offset, state2
    assert quantised > 0
    for name, module in model.named_modules():  # MoE routers (transformers 5: *TopKRouter modules) untouched
        if name in routers:
            assert torch.equal(module.weight, routers[name])
    # storage: 4 bits per weight + one 8-bit absmax per 64-weight block + small per-module constants
    fp_rest = float_bytes - 4 * packed
    assert quantized_bytes(model) == fp_rest + packed // 2 + packed // 64 + overhead
    assert quantized_bytes(model) < float_bytes


def test_routing_rule_is_structural_not_width_alone():
    """tiny-qwen3_5_moe: GDN in_proj_b/in_proj_a have width 4 == num_experts but are not routing."""
    model = quantize_nf4(build_model("tiny-qwen3_5_moe", seed=1))
    assert model.config.num_experts == 4
    layer = model.model.layers[0]
    assert layer.linear_attn.in_proj_b.out_features == 4 and isinstance(layer.linear_attn.in_proj_b, bnb.nn.Linear4bit)
    assert type(layer.mlp.shared_expert_gate) is torch.nn.Linear
    assert isinstance(layer.mlp.shared_expert.up_proj, bnb.nn.Linear4bit)


def test_quantise_after_lora_is_refused():
    with pytest.raises(ValueError, match="before apply_lora"):
        quantize_nf4(apply_lora(build_model("tiny-llama", seed=1), r=4))


@pytest.mark.numerics
@pytest.mark.parametrize("preset", TINY_PRESETS)
@pytest.mark.parametrize("response_len", [1, 9])
def test_replay_logprobs_equal_hf_one_pass_of_same_nf4_model(preset, response_len):
    model = quantize_nf4(build_model(preset, seed=1), compute_dtype=torch.float32)
    prompt, response = _ids(PROMPT_LEN, 0), _ids(response_len, 1)
    with torch.no_grad():  # eval + no grad: bnb's inference path (and its AVX512-BF16 repack, disabled)
        ours = replay(model, capture(model, prompt, chunk_size=8), response)
        expected = hf_full_logprobs(model, prompt, response)
    assert ours.dtype == torch.float32 and ours.shape == (response_len,)
    # float32 throughout (the 4-bit base computes in float32 either way): the log-softmax's rounding, and the
    # forwards' (ours chunked over pages, HF's one pass) moving the logits by float32 rounding of each layer's
    # hidden-size reductions, relative to the log-probs' scale
    scale, config = float(expected.abs().max()), model.config
    tol = logprob_tolerance(config.vocab_size, scale)
    tol += float32_tolerance(config.hidden_size, roundings=config.num_hidden_layers) * scale
    within(max_abs(ours, expected), tol, "log-probs")


@pytest.mark.numerics
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_qlora_replay_gradients_equal_conditional_reference(preset):
    # Activations, LoRA and HF's own float32 casts in float64 on both sides (float64_reference), the 4-bit
    # base computing in float32 as built: with float32 activations the GDN decay gradients round differently
    # on each side (tiny-qwen3_5: HF's own float32 reference is 3.8e-4..4.6e-4 off the float64 one; ours vs
    # HF 7e-5 on ATen avx512, 1.3e-4 on avx2). In float64: <= 5.4e-6 on every preset, kernel path and thread
    # count tried (SSE4.2 the most), while dt_bias off by 0.1% in our GDN mixer gives >= 7.8e-4.
    net = apply_lora(quantize_nf4(build_model(preset, seed=1), compute_dtype=torch.float32), r=4, init_random=True)
    net = to_float64(net)
    net.train()
    wrapped = [m for m in net.modules() if isinstance(m, LoraLinear4bit)]
    assert wrapped and all(isinstance(m.base_layer, bnb.nn.Linear4bit) for m in wrapped)
    assert all(
        m.base_layer.compute_dtype == torch.float32 and m.base_layer.weight.dtype == torch.uint8 for m in wrapped
    )
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)

    prompt, response = _ids(PROMPT_LEN, 4), _ids(6, 5)
    weights = torch.linspace(-1.0, 2.0, 6, dtype=torch.float64)
    with hf_float64(net):  # both sides: our replay runs HF's norms and MLPs too
        state = capture(net, prompt, chunk_size=8)
        ours = grads_of(net, (replay(net, state, response) * weights).sum())
        expected = grads_of(net, (hf_conditional_logprobs(net, prompt, response) * weights).sum())
    assert set(ours) == set(expected) == trainable
    assert all(g.abs().sum() > 0 and g.dtype == torch.float64 for g in ours.values())
    # what stays float32 in a float64 model, and the 4-bit base's float32 GEMMs, blocked by other row counts on
    # each side (ours chunk by chunk, HF's one pass): their hidden-size reductions rounded otherwise, per layer
    config = net.get_base_model().config
    tol = float64_residue_tolerance(has_gdn(net))
    tol += float32_tolerance(config.hidden_size, roundings=config.num_hidden_layers)
    within(max_relative_error(ours, expected), tol, "max relative gradient error")


@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_5"])
def test_cuda_bf16_qlora_smoke(preset):
    """CUDA path: Params4bit quantises on the device, bf16 compute, LoRA grads through the 4-bit base."""
    model = build_model(preset, seed=1, dtype=torch.bfloat16, device="cuda")
    q_proj = model.model.layers[-1].self_attn.q_proj.weight.detach().clone()
    net = apply_lora(quantize_nf4(model), r=4, init_random=True)
    base = net.get_base_model().model.layers[-1].self_attn.q_proj.base_layer
    assert isinstance(base, bnb.nn.Linear4bit) and base.compute_dtype == torch.bfloat16
    assert base.weight.device.type == "cuda" and base.weight.quant_state.absmax.device.type == "cuda"
    deq = bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state)
    assert float((deq.float() - q_proj.float()).norm() / q_proj.float().norm()) < 0.15
    prompt, response = _ids(PROMPT_LEN, 4).cuda(), _ids(6, 5).cuda()
    with torch.no_grad():
        ours = replay(net, capture(net, prompt, chunk_size=8), response)
        expected = hf_full_logprobs(net, prompt, response)
    assert (ours - expected).abs().max() < 0.1  # bf16: different kernels/shapes on each side
    net.train()
    grads = grads_of(net, replay(net, capture(net, prompt, chunk_size=8), response).sum())
    assert grads and all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())


@pytest.mark.numerics
@pytest.mark.parametrize("rows", [3, 256])  # 3: bitsandbytes' own fused path; 256: dequantise + GEMM
def test_nf4_linear_forward_and_input_gradient_equal_float64_of_bitsandbytes_weights(rows):
    from longstraw.models.quant import DEQUANTIZE_MIN_ROWS

    assert (rows >= DEQUANTIZE_MIN_ROWS) == (rows == 256)
    torch.manual_seed(0)
    parent = torch.nn.Module()
    parent.proj = torch.nn.Linear(96, 80, bias=True)
    quantize_nf4(parent, skip=())
    layer = parent.proj
    x = torch.randn(2, rows // 2 if rows > 3 else rows, 96, requires_grad=True)
    out = layer(x)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (grad_x,) = torch.autograd.grad(out, x, grad_out)

    x64 = x.detach().double().requires_grad_(True)
    weight = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)  # bitsandbytes' reading
    expected = torch.nn.functional.linear(x64, weight.double(), layer.bias.detach().double())
    (expected_grad_x,) = torch.autograd.grad(expected, x64, grad_out.double())
    # a float32 GEMM against float64: one reduction over the 96 inputs (the 80 outputs for the input gradient)
    for ours, want, n in ((out, expected, 96), (grad_x, expected_grad_x, 80)):
        tol = float32_tolerance(n)
        close(ours, want, rtol=tol, atol=tol * float(want.abs().max()), what=f"{n}-term float32 GEMM")


@pytest.mark.numerics
def test_capture_runs_lora_over_nf4_merged_and_its_state_matches_the_unmerged_forward(monkeypatch):
    """A capture chunk of >= DEQUANTIZE_MIN_ROWS rows takes the merged weight (one GEMM per layer); the
    pages and states it leaves equal those of peft's unmerged forward (the merging off) within float32
    rounding accumulated over the layers, and scoring afterwards runs peft's forward."""
    import contextlib

    import longstraw.core.transaction as transaction
    import longstraw.models.quant as quant

    model = apply_lora(quantize_nf4(build_model("tiny-qwen3_5", seed=0)), r=4, init_random=True)
    layers = [m for m in model.modules() if isinstance(m, LoraLinear4bit)]
    assert layers and all(type(m) is quant.merging_lora_class() for m in layers)
    calls = []
    merged = quant.merged_lora_weight
    monkeypatch.setattr(quant, "merged_lora_weight", lambda *a: calls.append(a) or merged(*a))
    prompt = _ids(300, 0)
    merged = capture(model, prompt, chunk_size=128, order="chunk")
    assert len(calls) == 2 * len(layers)  # every LoRA layer in the two 128-row chunks; the 43-row tail: peft
    calls.clear()
    with torch.no_grad():
        replay(model, merged, _ids(70, 1))
    assert not calls, "scoring must keep peft's forward"
    monkeypatch.setattr(transaction, "merged_lora_for_capture", contextlib.nullcontext)
    unmerged = capture(model, prompt, chunk_size=128, order="chunk")
    assert not calls
    # merged (dequantise(W) + s B A, one GEMM) against peft's W x + s B (A x): each layer's projections round
    # their hidden-size reductions otherwise, and carry the earlier layers' difference (measured <= 2.2e-6)
    config = model.get_base_model().config
    tol = float32_tolerance(config.hidden_size, roundings=config.num_hidden_layers)
    for a, b in zip(merged.layers, unmerged.layers):
        for ta, tb in zip(a.tensors(), b.tensors()):
            within(relative(ta, tb), tol, "state")


@pytest.mark.numerics
def test_layer_major_capture_builds_each_merged_weight_once_and_leaves_the_chunk_major_state(monkeypatch):
    """Layer-major capture keeps a layer's merged NF4 + LoRA weights while the layer runs its chunks: one
    `merged_lora_weight` per LoRA layer for two full chunks (chunk-major builds it per chunk), and the same state."""
    import longstraw.models.lora_linear as lora_linear
    import longstraw.models.quant as quant

    model = apply_lora(quantize_nf4(build_model("tiny-qwen3_5", seed=0)), r=4, init_random=True)
    layers = [m for m in model.modules() if isinstance(m, LoraLinear4bit)]
    calls = []
    merged = quant.merged_lora_weight
    monkeypatch.setattr(quant, "merged_lora_weight", lambda *a: calls.append(a) or merged(*a))
    prompt = _ids(300, 0)
    by_chunk = capture(model, prompt, chunk_size=128, order="chunk")
    assert len(calls) == 2 * len(layers)
    calls.clear()
    by_layer = capture(model, prompt, chunk_size=128, order="layer")
    assert len(calls) == len(layers)  # once per layer; the 43-row tail takes peft's forward in both orders
    assert lora_linear._kept is None  # nothing kept once the capture ends
    # the same weights and the same per-chunk arithmetic in another loop order: float32 rounding at most
    config = model.get_base_model().config
    tol = float32_tolerance(config.hidden_size, roundings=config.num_hidden_layers)
    for a, b in zip(by_chunk.layers, by_layer.layers):
        for ta, tb in zip(a.tensors(), b.tensors()):
            within(relative(ta, tb), tol, "state")
