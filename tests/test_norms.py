"""The hybrid family's norms (longstraw.kernels.rms_norm, longstraw.kernels.gated_rms_norm) against HF's own modules:
off CUDA they are the modules; on CUDA fla's fused kernels, held to the modules in float64."""

from __future__ import annotations

import pytest
import torch
import transformers
from tolerances import EPS_BF16, float32_tolerance, relative

from longstraw.kernels import rms_norm as rms_norm_module
from longstraw.kernels.gated_rms_norm import _fla_norm_usable, _load_fla_norm, gated_rms_norm
from longstraw.kernels.rms_norm import ONE_PLUS_WEIGHT, one_plus_weight, rms_norm

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
