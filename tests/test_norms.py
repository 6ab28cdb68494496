"""The hybrid family's norms (longstraw.kernels.rms_norm, longstraw.kernels.gated_rms_norm) against HF's own modules:
off CUDA they are the modules; on CUDA fla's fused kernels, held to the modules in float64."""

from __future__ import annotations

import pytest
import torch
import transformers
from tolerances import EPS_BF16, SAFETY, float32_tolerance, relative

from longstraw.kernels import rms_norm as rms_norm_module
from longstraw.kernels import swiglu as swiglu_module
from longstraw.kernels.gated_rms_norm import _fla_norm_usable, _load_fla_norm, gated_rms_norm
from longstraw.kernels.rms_norm import ONE_PLUS_WEIGHT, add_rms_norm, fused_norms_selected, one_plus_weight, rms_norm

pytestmark = pytest.mark.numerics

# fla computes each product in float32 and rounds each output once (half of EPS_BF16 norm-wise; its float32 sums
# add sqrt(n) EPS32, far below): twice EPS_BF16 norm-wise covers it. HF's own bf16 gated module rounds three times.
BF16_RTOL = 2 * EPS_BF16

HF_NORM_MODULES = {
    "Qwen3NextRMSNorm": "qwen3_next",
    "Qwen3_5RMSNorm": "qwen3_5",
    "Qwen3_5MoeRMSNorm": "qwen3_5_moe",
}


def _hf_norm(name: str, D: int, dtype, device="cpu") -> torch.nn.Module:
    module = getattr(transformers.models, HF_NORM_MODULES[name])
    norm = getattr(getattr(module, f"modeling_{HF_NORM_MODULES[name]}"), name)(D, eps=1e-6).to(
        dtype=dtype, device=device
    )
    with torch.no_grad():  # away from the zeros init, so a dropped or doubled weight shows
        norm.weight.copy_(torch.linspace(-0.5, 0.5, D, dtype=torch.float64))
    return norm


def _hf_gated_norm(D: int, dtype, device="cpu") -> torch.nn.Module:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    norm = Qwen3_5RMSNormGated(D, eps=1e-6).to(dtype=dtype, device=device)
    with torch.no_grad():  # away from the ones init
        norm.weight.copy_(torch.linspace(0.5, 1.5, D, dtype=torch.float64))
    return norm


def _outputs_and_grads(module, fn, inputs, out_weight):
    """fn's output and the gradients of sum(output * out_weight) in the inputs and the module's weight."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    module.weight.grad = None
    y = fn(*leaves)
    (y.double() * out_weight).sum().backward()
    return [y.detach(), *(leaf.grad for leaf in leaves), module.weight.grad.clone()]


def test_the_one_plus_weight_classes_are_hfs_formula():
    """Each class the fused path takes computes y = (1 + w) x / rms(x) in HF's own code. HF's module runs in float32
    whatever the input (`x.float()`), so the formula in float64 on float32-exact inputs is within the float32
    roundings of HF's: the mean of D squares (sqrt(D) EPS32) and four more (rsqrt, the add, two products)."""
    assert set(HF_NORM_MODULES) == ONE_PLUS_WEIGHT
    gen = torch.Generator().manual_seed(0)
    D = 64
    x = torch.randn(7, D, generator=gen).double()
    for name in ONE_PLUS_WEIGHT:
        norm = _hf_norm(name, D, torch.float32)
        formula = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * one_plus_weight(norm).double()
        assert relative(norm(x.float()), formula) <= float32_tolerance(D, roundings=5), name
        # and not the llama form w x / rms(x), which the test must tell apart
        assert relative(norm(x.float()), formula / one_plus_weight(norm).double() * norm.weight.double()) > 0.1


def test_off_cuda_the_norms_are_hfs_modules_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    x, z = (torch.randn(50, 32, generator=gen) for _ in range(2))
    out_weight = torch.randn(50, 32, generator=gen, dtype=torch.float64)
    norm = _hf_norm("Qwen3_5RMSNorm", 32, torch.float32)
    for a, e in zip(
        _outputs_and_grads(norm, lambda t: rms_norm(norm, t), [x], out_weight),
        _outputs_and_grads(norm, norm, [x], out_weight),
    ):
        assert torch.equal(a, e)
    gated = _hf_gated_norm(32, torch.float32)
    for a, e in zip(
        _outputs_and_grads(gated, lambda a, b: gated_rms_norm(gated, a, b), [x, z], out_weight),
        _outputs_and_grads(gated, gated, [x, z], out_weight),
    ):
        assert torch.equal(a, e)


def _bf16_inputs(gen, *shapes):
    return [torch.randn(*s, generator=gen, dtype=torch.float64).to(torch.bfloat16).cuda() for s in shapes]


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 3, 4096])
def test_rms_norm_on_cuda_matches_hf_in_float64(rows):
    """fla's fused RMSNorm at hybrid-1b's hidden size in bf16, forward and backward (x and the weight), against
    HF's module in float64 on the same bf16 values: within BF16_RTOL norm-wise."""
    if rms_norm_module._load_fla_rms_norm() is None:
        pytest.skip("fla is not importable")
    gen = torch.Generator().manual_seed(0)
    D = 2048
    norm = _hf_norm("Qwen3_5RMSNorm", D, torch.bfloat16, "cuda")
    (x,) = _bf16_inputs(gen, (2, rows, D))
    out_weight = torch.randn(2, rows, D, generator=gen, dtype=torch.float64).cuda()
    assert rms_norm_module._fla_usable(norm, x)  # the fused path, not the module, is what is compared
    ours = _outputs_and_grads(norm, lambda t: rms_norm(norm, t), [x], out_weight)
    reference_norm = _hf_norm("Qwen3_5RMSNorm", D, torch.float64, "cuda")
    with torch.no_grad():
        reference_norm.weight.copy_(norm.weight.double())
    reference = _outputs_and_grads(reference_norm, reference_norm, [x.double()], out_weight)
    for name, a, e in zip(("y", "dx", "dweight"), ours, reference):
        assert a.dtype == torch.bfloat16, name
        assert relative(a, e) <= BF16_RTOL, (name, relative(a, e))


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 3, 8192 * 32])
def test_gated_norm_on_cuda_matches_hf_in_float64(rows):
    """fla's fused gated RMSNorm (hybrid-1b's head dim 128) in bf16, forward and backward (x, the gate, the weight),
    against HF's module in float64 on the same bf16 values: within BF16_RTOL norm-wise."""
    if _load_fla_norm() is None:
        pytest.skip("fla is not importable")
    gen = torch.Generator().manual_seed(0)
    D = 128
    norm = _hf_gated_norm(D, torch.bfloat16, "cuda")
    x, z = _bf16_inputs(gen, (rows, D), (rows, D))
    out_weight = torch.randn(rows, D, generator=gen, dtype=torch.float64).cuda()
    assert _fla_norm_usable(norm, x)  # the fused path, not the module, is what is compared
    ours = _outputs_and_grads(norm, lambda a, b: gated_rms_norm(norm, a, b), [x, z], out_weight)
    reference_norm = _hf_gated_norm(D, torch.float64, "cuda")
    with torch.no_grad():
        reference_norm.weight.copy_(norm.weight.double())
    reference = _outputs_and_grads(reference_norm, reference_norm, [x.double(), z.double()], out_weight)
    for name, a, e in zip(("y", "dx", "dz", "dweight"), ours, reference):
        assert a.dtype == torch.bfloat16, name
        assert relative(a, e) <= BF16_RTOL, (name, relative(a, e))


# The decoder MLP (longstraw.kernels.swiglu): the fused silu-and-multiply between the module's own projections.
# Every bf16 stage rounds its output once (at most half EPS_BF16 norm-wise, its float32 GEMM sums far below), and
# independent roundings add in quadrature. The most feed x's gradient: along HF's path the incoming gradient, the
# down projection's input gradient, gate, up and silu from the forward, the product's two gradients, silu's, each
# projection's input gradient and their sum (11; the fused path skips silu's two). SAFETY times that.
MLP_BF16_RTOL = SAFETY * 11**0.5 * EPS_BF16 / 2


def _hf_mlp(hidden_act: str, H: int, I: int, dtype, device="cpu", gen=None) -> torch.nn.Module:
    """HF's llama MLP, its projections drawn from gen at unit gain (each output ~ its input's scale)."""
    config = transformers.LlamaConfig(
        hidden_size=H, intermediate_size=I, hidden_act=hidden_act, num_attention_heads=1, num_key_value_heads=1
    )
    mlp = transformers.models.llama.modeling_llama.LlamaMLP(config).to(dtype=dtype, device=device)
    if gen is not None:
        with torch.no_grad():
            for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                fan_in = proj.weight.shape[1]
                proj.weight.copy_(torch.randn(proj.weight.shape, generator=gen, dtype=torch.float64) / fan_in**0.5)
    return mlp


def _mlp_outputs_and_grads(mlp, fn, inputs, out_weight):
    """fn's output and the gradients of sum(output * out_weight) in the inputs and the gate, up and down weights."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    for proj in projections:
        proj.weight.grad = None
    y = fn(*leaves)
    (y.double() * out_weight).sum().backward()
    return [y.detach(), *(leaf.grad for leaf in leaves), *(proj.weight.grad.clone() for proj in projections)]


def test_off_cuda_the_mlp_is_hfs_module_bit_for_bit():
    """On CPU, with SiLU or another activation, mlp_forward is the module itself; and the SiLU class HF's config
    builds is one the fused path recognises (else it would never run on CUDA)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=gen)
    out_weight = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)
    for act in ("silu", "gelu"):
        mlp = _hf_mlp(act, 16, 48, torch.float32, gen=gen)
        assert isinstance(mlp.act_fn, swiglu_module.SILU_CLASSES) == (act == "silu")
        for a, e in zip(
            _mlp_outputs_and_grads(mlp, lambda t, mlp=mlp: swiglu_module.mlp_forward(mlp, t), [x], out_weight),
            _mlp_outputs_and_grads(mlp, mlp, [x], out_weight),
        ):
            assert torch.equal(a, e), act


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 3, 4096])
def test_mlp_on_cuda_matches_hf_in_float64(rows):
    """The fused swiglu (`swiglu_triton`) in a llama MLP at llama-1b's sizes in bf16, forward and backward (x and the
    three weights), against HF's module in float64 on the same bf16 values: within MLP_BF16_RTOL norm-wise, as HF's
    own bf16 module is (both errors printed: the bound is what bf16 gives, not a vacuous one)."""
    if swiglu_module._load_swiglu() is None:
        pytest.skip("Triton is not importable")
    gen = torch.Generator().manual_seed(0)
    H, I = 2048, 8192
    mlp = _hf_mlp("silu", H, I, torch.bfloat16, "cuda", gen)
    (x,) = _bf16_inputs(gen, (2, rows, H))
    out_weight = torch.randn(2, rows, H, generator=gen, dtype=torch.float64).cuda()
    assert swiglu_module._fused_usable(mlp, x)  # the fused path, not the module, is what is compared
    ours = _mlp_outputs_and_grads(mlp, lambda t: swiglu_module.mlp_forward(mlp, t), [x], out_weight)
    hf = _mlp_outputs_and_grads(mlp, mlp, [x], out_weight)
    reference_mlp = _hf_mlp("silu", H, I, torch.float64, "cuda")
    reference_mlp.load_state_dict(mlp.state_dict())  # the same bf16 values, in float64
    reference = _mlp_outputs_and_grads(reference_mlp, reference_mlp, [x.double()], out_weight)
    for name, a, h, e in zip(("y", "dx", "dgate", "dup", "ddown"), ours, hf, reference):
        assert a.dtype == torch.bfloat16, name
        errors = (name, "fused", relative(a, e), "hf bf16", relative(h, e))
        assert relative(a, e) <= MLP_BF16_RTOL and relative(h, e) <= MLP_BF16_RTOL, errors


# A pre-norm block's sums (`add_rms_norm`, `mlp_forward(..., residual=)`): the sum inside the next norm's kernel and
# inside the down projection's GEMM.


def _sum_and_norm_outputs_and_grads(norm, fn, x, residual, out_weights):
    """fn's normed output and sum, and the gradients of sum(normed w0) + sum(sum w1) in x, the residual and the
    norm's weight."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, residual)]
    norm.weight.grad = None
    normed, total = fn(*leaves)
    ((normed.double() * out_weights[0]).sum() + (total.double() * out_weights[1]).sum()).backward()
    return [normed.detach(), total.detach(), *(leaf.grad for leaf in leaves), norm.weight.grad.clone()]


def _reference_sum_and_norm(norm):
    """HF's block: the residual plus the mixer's output, then the module on the sum."""

    def block(x, residual):
        total = residual + x
        return norm(total), total

    return block


def test_add_rms_norm_off_cuda_is_hfs_sum_then_module_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(50, 32, generator=gen) for _ in range(2))
    out_weights = [torch.randn(50, 32, generator=gen, dtype=torch.float64) for _ in range(2)]
    norm = _hf_norm("Qwen3_5RMSNorm", 32, torch.float32)
    ours = _sum_and_norm_outputs_and_grads(norm, lambda a, r: add_rms_norm(norm, a, r), x, residual, out_weights)
    hf = _sum_and_norm_outputs_and_grads(norm, _reference_sum_and_norm(norm), x, residual, out_weights)
    for a, e in zip(ours, hf):
        assert torch.equal(a, e)


def test_add_rms_norm_hands_the_residual_to_the_kernel_where_usable(monkeypatch):
    """Where the fused norm applies, one call of it takes x, 1 + w, the residual, the module's eps and prenorm, and
    its (norm, sum) is the result (a stand-in kernel with fla's signature and semantics, in float64: the sum of x
    and the residual, its norm times the weight), equal to HF's block: the sum exactly, the rest within the float32
    roundings of HF's module (it computes in float32 whatever the input: as in the formula test above)."""
    calls = []

    def stand_in(x, weight, bias, residual=None, eps=1e-5, prenorm=False):
        calls.append({"weight": weight, "residual": residual is not None, "eps": eps, "prenorm": prenorm})
        total = x + residual
        return total * torch.rsqrt(total.square().mean(-1, keepdim=True) + eps) * weight, total

    monkeypatch.setattr(rms_norm_module, "_load_fla_rms_norm", lambda: stand_in)
    monkeypatch.setattr(rms_norm_module, "_fla_usable", lambda module, t: True)
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    out_weights = [torch.randn(5, 32, generator=gen, dtype=torch.float64) for _ in range(2)]
    norm = _hf_norm("Qwen3_5RMSNorm", 32, torch.float64)
    norm.eps = 1e-3  # not fla's default: the module's must be the one passed
    ours = _sum_and_norm_outputs_and_grads(norm, lambda a, r: add_rms_norm(norm, a, r), x, residual, out_weights)
    assert len(calls) == 1 and calls[0]["residual"] and calls[0]["prenorm"] and calls[0]["eps"] == 1e-3
    assert torch.equal(calls[0]["weight"], one_plus_weight(norm))
    hf = _sum_and_norm_outputs_and_grads(norm, _reference_sum_and_norm(norm), x, residual, out_weights)
    assert torch.equal(ours[1], hf[1])
    for name, a, e in zip(("normed", "dx", "dresidual", "dweight"), ours[:1] + ours[2:], hf[:1] + hf[2:]):
        assert relative(a, e) <= float32_tolerance(32, roundings=5), name


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 3, 4096])
def test_add_rms_norm_on_cuda_matches_hf_in_float64(rows):
    """fla's RMSNorm with the residual sum inside (prenorm) at hybrid-1b's hidden size in bf16, forward and backward
    (x, the residual, the weight), against HF's sum and module in float64 on the same bf16 values: the sum rounds
    once and the norm reads it unrounded, within BF16_RTOL norm-wise."""
    if rms_norm_module._load_fla_rms_norm() is None:
        pytest.skip("fla is not importable")
    gen = torch.Generator().manual_seed(0)
    D = 2048
    norm = _hf_norm("Qwen3_5RMSNorm", D, torch.bfloat16, "cuda")
    x, residual = _bf16_inputs(gen, (2, rows, D), (2, rows, D))
    out_weights = [torch.randn(2, rows, D, generator=gen, dtype=torch.float64).cuda() for _ in range(2)]
    assert rms_norm_module._fla_usable(norm, x)  # the fused path, not the module, is what is compared
    ours = _sum_and_norm_outputs_and_grads(norm, lambda a, r: add_rms_norm(norm, a, r), x, residual, out_weights)
    reference_norm = _hf_norm("Qwen3_5RMSNorm", D, torch.float64, "cuda")
    with torch.no_grad():
        reference_norm.weight.copy_(norm.weight.double())
    reference = _sum_and_norm_outputs_and_grads(
        reference_norm, _reference_sum_and_norm(reference_norm), x.double(), residual.double(), out_weights
    )
    for name, a, e in zip(("normed", "sum", "dx", "dresidual", "dweight"), ours, reference):
        assert a.dtype == torch.bfloat16, name
        assert relative(a, e) <= BF16_RTOL, (name, relative(a, e))


def test_mlp_residual_goes_into_a_plain_down_projections_gemm(monkeypatch):
    """On the fused path (taken here with torch's silu-and-multiply standing in for the kernel, in float64), a plain
    bias-free down projection adds the residual in one addmm; one with a bias adds it after. Both equal HF's residual
    plus module within float64 reordering, forward and backward; off the fused path it is that sum bit for bit."""
    gen = torch.Generator().manual_seed(0)
    mlp = _hf_mlp("silu", 16, 48, torch.float64, gen=gen)
    x, residual = (torch.randn(2, 5, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    out_weight = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)

    def hf(t, r):
        return r + mlp(t)

    def ours(t, r):
        return swiglu_module.mlp_forward(mlp, t, residual=r)

    for a, e in zip(*(_mlp_outputs_and_grads(mlp, fn, [x, residual], out_weight) for fn in (ours, hf))):
        assert torch.equal(a, e)  # CPU: the module, then the sum
    addmm_calls = []
    monkeypatch.setattr(swiglu_module, "_fused_usable", lambda mlp, t: True)
    monkeypatch.setattr(swiglu_module, "_load_swiglu", lambda: lambda gate, up: torch.nn.functional.silu(gate) * up)
    monkeypatch.setattr(torch, "addmm", lambda *a, _addmm=torch.addmm: addmm_calls.append(a) or _addmm(*a))
    for bias in (False, True):
        if bias:
            mlp.down_proj.bias = torch.nn.Parameter(torch.randn(16, generator=gen, dtype=torch.float64))
        expected = _mlp_outputs_and_grads(mlp, hf, [x, residual], out_weight)
        fused = _mlp_outputs_and_grads(mlp, ours, [x, residual], out_weight)
        assert len(addmm_calls) == 1  # the bias-free projection's, and none for the one with a bias
        for name, a, e in zip(("y", "dx", "dresidual", "dgate", "dup", "ddown"), fused, expected):
            assert relative(a, e) <= 1e-12, (bias, name)


def test_mlp_residual_without_grad_is_summed_into_the_residual(monkeypatch):
    """Without grad (a capture), the fused path's bias-free down projection accumulates into the residual's storage:
    the result is the residual tensor, holding HF's residual plus module within float64 reordering; with grad the
    residual is left as it was."""
    gen = torch.Generator().manual_seed(0)
    mlp = _hf_mlp("silu", 16, 48, torch.float64, gen=gen)
    x, residual = (torch.randn(2, 5, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    monkeypatch.setattr(swiglu_module, "_fused_usable", lambda mlp, t: True)
    monkeypatch.setattr(swiglu_module, "_load_swiglu", lambda: lambda gate, up: torch.nn.functional.silu(gate) * up)
    with torch.no_grad():
        expected = residual + mlp(x)
        given = residual.clone()
        out = swiglu_module.mlp_forward(mlp, x, residual=given)
    assert out.data_ptr() == given.data_ptr() and out.shape == given.shape
    assert relative(out, expected) <= 1e-12
    kept = residual.clone()
    swiglu_module.mlp_forward(mlp, x.requires_grad_(True), residual=kept)
    assert torch.equal(kept, residual)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 4096])
def test_mlp_with_residual_on_cuda_matches_hf_in_float64(rows):
    """The fused MLP with the residual added in the down projection's GEMM (bf16, llama-1b's sizes), forward and
    backward (x, the residual, the three weights), against HF's residual plus module in float64 on the same bf16
    values: within MLP_BF16_RTOL norm-wise, as HF's own bf16 sum is."""
    if swiglu_module._load_swiglu() is None:
        pytest.skip("Triton is not importable")
    gen = torch.Generator().manual_seed(0)
    H, I = 2048, 8192
    mlp = _hf_mlp("silu", H, I, torch.bfloat16, "cuda", gen)
    x, residual = _bf16_inputs(gen, (2, rows, H), (2, rows, H))
    out_weight = torch.randn(2, rows, H, generator=gen, dtype=torch.float64).cuda()
    assert swiglu_module._fused_usable(mlp, x) and type(mlp.down_proj) is torch.nn.Linear

    def ours(t, r):
        return swiglu_module.mlp_forward(mlp, t, residual=r)

    reference_mlp = _hf_mlp("silu", H, I, torch.float64, "cuda")
    reference_mlp.load_state_dict(mlp.state_dict())  # the same bf16 values, in float64
    fused = _mlp_outputs_and_grads(mlp, ours, [x, residual], out_weight)
    hf = _mlp_outputs_and_grads(mlp, lambda t, r: r + mlp(t), [x, residual], out_weight)
    reference = _mlp_outputs_and_grads(
        reference_mlp, lambda t, r: r + reference_mlp(t), [x.double(), residual.double()], out_weight
    )
    for name, a, h, e in zip(("y", "dx", "dresidual", "dgate", "dup", "ddown"), fused, hf, reference):
        assert a.dtype == torch.bfloat16, name
        errors = (name, "fused", relative(a, e), "hf bf16", relative(h, e))
        assert relative(a, e) <= MLP_BF16_RTOL and relative(h, e) <= MLP_BF16_RTOL, errors
    with torch.no_grad():  # the capture's path: the sum into the residual's storage
        given = residual.clone()
        summed = ours(x, given)
    assert summed.data_ptr() == given.data_ptr() and relative(summed, reference[0]) <= MLP_BF16_RTOL


def test_fused_norms_selected_routes_a_one_plus_weight_norm_and_restores_it(monkeypatch):
    """Inside the block a swapped norm takes `rms_norm`'s fused path where it is usable (a stand-in kernel here), its
    class's own forward where not (no recursion into the swapped one), and nested blocks swap once; on exit the
    module is its class again. Other classes are not touched."""
    norm = _hf_norm("Qwen3_5RMSNorm", 16, torch.float32)
    llama = transformers.models.llama.modeling_llama.LlamaRMSNorm(16)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    calls = []
    monkeypatch.setattr(rms_norm_module, "_load_fla_rms_norm", lambda: lambda *a, **kw: calls.append(a) or a[0] * 2)
    with fused_norms_selected([norm, llama]):
        assert torch.equal(norm(x), norm.__class__.forward(norm, x)) and not calls  # CPU: the class's forward
        monkeypatch.setattr(rms_norm_module, "_fla_usable", lambda module, t: True)
        with fused_norms_selected([norm]):
            assert torch.equal(norm(x), x * 2) and torch.equal(calls[-1][1], one_plus_weight(norm))
        assert torch.equal(norm(x), x * 2)  # the inner block left the outer swap in place
        assert "forward" not in vars(llama)
    assert "forward" not in vars(norm) and torch.equal(norm(x), norm.__class__.forward(norm, x))


def test_the_paged_attention_selection_swaps_the_attention_norms_and_a_peers_does_not():
    from longstraw.families import adapter_for
    from longstraw.models import build_model

    adapter = adapter_for(build_model("tiny-qwen3_5", seed=0))
    attention = [layer.self_attn for layer in adapter.layers if hasattr(layer, "self_attn")]
    norms = [m for a in attention for m in (a.q_norm, a.k_norm)]
    assert norms and adapter._attention_norms == norms
    with adapter.selected():
        assert all("forward" in vars(m) for m in norms)
    with adapter.selected("sdpa"):
        assert not any("forward" in vars(m) for m in norms)
    assert not any("forward" in vars(m) for m in norms)
