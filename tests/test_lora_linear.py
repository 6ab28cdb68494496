"""LoRA's update added in place (`longstraw.models.lora_linear`), against peft's own `Linear.forward` on the same
module: bit-identical output and gradients for a power-of-two scaling (peft's default alpha = 2r), within the
scaling's rounding otherwise (float64), peft's own path wherever peft does more, and one [rows, out] temporary
instead of peft's four."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from tolerances import TOL64
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from longstraw.models import build_model
from longstraw.models.lora import apply_lora
from longstraw.models.lora_linear import adopt_in_place_lora, in_place_lora_class

ROWS, IN, OUT, R = 48, 64, 96, 4


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(IN, OUT, bias=True)


def _layer(alpha=2 * R, dropout=0.0, base_dtype=torch.bfloat16, adapter_dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    model = get_peft_model(
        _Net().to(device),
        LoraConfig(r=R, lora_alpha=alpha, lora_dropout=dropout, target_modules=["proj"], init_lora_weights=False),
    )
    for name, param in model.named_parameters():
        param.data = param.data.to(adapter_dtype if "lora_" in name else base_dtype)
    adopt_in_place_lora(model)
    return model, model.base_model.model.proj


def _run(forward, layer, x, grad_out):
    """Output and the gradients of x, lora_A and lora_B (fresh ones) of `forward(layer, x)`."""
    x = x.detach().clone().requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    out = forward(layer, x)
    out.backward(grad_out)
    grads = [x.grad] + [p.grad for n, p in layer.named_parameters() if "lora_" in n]
    return out.detach(), grads


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize(
    "base_dtype, adapter_dtype",
    [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)],
)
def test_in_place_update_is_peft_bit_for_bit_at_a_power_of_two_scaling(base_dtype, adapter_dtype, device):
    _, layer = _layer(base_dtype=base_dtype, adapter_dtype=adapter_dtype, device=device)
    assert type(layer) is in_place_lora_class() and layer.scaling["default"] == 2.0
    x = torch.randn(2, ROWS // 2, IN, dtype=base_dtype, device=device)
    grad_out = torch.randn(2, ROWS // 2, OUT, dtype=base_dtype, device=device)
    ours, ours_grads = _run(lambda m, t: m(t), layer, x, grad_out)
    peft, peft_grads = _run(LoraLinear.forward, layer, x, grad_out)
    assert ours.dtype == peft.dtype == base_dtype
    assert torch.equal(ours, peft)
    assert len(ours_grads) == 3 and all(torch.equal(a, b) for a, b in zip(ours_grads, peft_grads))
    with torch.no_grad():
        assert torch.equal(layer(x), LoraLinear.forward(layer, x))


def test_in_place_update_at_another_scaling_differs_by_rounding_only():
    _, layer = _layer(alpha=3, base_dtype=torch.float64, adapter_dtype=torch.float64)  # scaling 0.75
    x = torch.randn(ROWS, IN, dtype=torch.float64)
    grad_out = torch.randn(ROWS, OUT, dtype=torch.float64)
    ours, ours_grads = _run(lambda m, t: m(t), layer, x, grad_out)
    peft, peft_grads = _run(LoraLinear.forward, layer, x, grad_out)
    for a, b in zip([ours] + ours_grads, [peft] + peft_grads):
        assert ((a - b).norm() / b.norm()).item() < TOL64


def test_what_peft_does_more_runs_peft():
    model, layer = _layer(dropout=0.5, base_dtype=torch.float32)
    x = torch.randn(ROWS, IN)
    model.train()
    torch.manual_seed(1)
    ours = layer(x)
    torch.manual_seed(1)
    assert torch.equal(ours, LoraLinear.forward(layer, x))  # active dropout: peft's forward, same mask
    model.eval()
    with model.disable_adapter():
        assert torch.equal(layer(x), layer.base_layer(x))


class _Allocations(TorchDispatchMode):
    """Counts the dispatched ops' results of `numel` elements that are new tensors (not one of their inputs)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() == self.numel:
                self.count += t.untyped_storage().data_ptr() not in inputs
        return out


def test_update_makes_one_rows_by_out_temporary_where_peft_makes_four():
    _, layer = _layer()
    x = torch.randn(ROWS, IN, dtype=torch.bfloat16)
    with torch.no_grad():
        with _Allocations(ROWS * OUT) as ours:
            layer(x)
        with _Allocations(ROWS * OUT) as peft:
            LoraLinear.forward(layer, x)
    assert ours.count == 2  # the base's result and lora_B's output
    assert peft.count == 5  # and the scaled copy, the float32 sum, its bf16 cast


def test_apply_lora_adopts_every_plain_lora_linear():
    model = apply_lora(build_model("tiny-qwen3_5", seed=0), r=4)
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert layers and all(type(m) is in_place_lora_class() for m in layers)
