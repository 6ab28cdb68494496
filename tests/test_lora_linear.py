"""LoRA's update in `longstraw.models.lora_linear`, against peft's own `Linear.forward` on the same module and
against the layer's definition in float64: the in-place path (adapters of another dtype than the base) bit-identical
to peft at a power-of-two scaling (peft's default alpha = 2r); the fused path (adapters in the base's dtype) within
its roundings of the definition, with peft's products in float64; peft's own path wherever peft does more; three
forward and five backward kernels where peft launches seven and nine; and fewer [rows, out] temporaries."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from tolerances import EPS32, EPS_BF16, SAFETY, TOL64, relative, within
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from longstraw import capture
from longstraw.models import build_model
from longstraw.models.lora import apply_lora
from longstraw.models.lora_linear import adopt_in_place_lora, in_place_lora_class, lora_update

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
def test_in_place_update_is_peft_bit_for_bit_at_a_power_of_two_scaling(device):
    base_dtype = torch.bfloat16
    _, layer = _layer(base_dtype=base_dtype, adapter_dtype=torch.float32, device=device)  # peft's default adapters
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


@pytest.mark.numerics
@pytest.mark.parametrize("alpha", [2 * R, 3])  # scaling 2 and 0.75
def test_both_paths_are_peft_in_float64(alpha):
    for adapter_dtype in (torch.float64, torch.float32):  # fused, in place
        _, layer = _layer(alpha=alpha, base_dtype=torch.float64, adapter_dtype=adapter_dtype)
        x = torch.randn(2, ROWS // 2, IN, dtype=torch.float64)
        grad_out = torch.randn(2, ROWS // 2, OUT, dtype=torch.float64)
        ours, ours_grads = _run(lambda m, t: m(t), layer, x, grad_out)
        peft, peft_grads = _run(LoraLinear.forward, layer, x, grad_out)
        # float32 adapters: x is cast to float32 by both, so the in-place path is held to float32 against peft
        tol = TOL64 if adapter_dtype == torch.float64 else SAFETY * IN * EPS32
        for a, b in zip([ours] + ours_grads, [peft] + peft_grads):
            assert ((a - b).norm() / b.norm()).item() < tol


def _definition_and_bounds(layer, x, grad_out, dtype):
    """The layer's output and the gradients of x, lora_A and lora_B in float64 from the same (rounded) values, and
    elementwise bounds on a computation in `dtype` that accumulates in float32 and rounds each stored product once:
    the base's output, lora_A's output and gy B are rounded before they are used (u = half `dtype`'s epsilon, times
    what each feeds), each result rounds once (u |result|), and a float32 sum of K terms errs by at most K EPS32
    times the sum of their magnitudes. Times SAFETY."""
    f = lambda t: t.detach().double()  # noqa: E731
    W, b = f(layer.base_layer.weight), f(layer.base_layer.bias)
    A, B = f(layer.lora_A["default"].weight), f(layer.lora_B["default"].weight)
    s, X, G = layer.scaling["default"], f(x).reshape(-1, IN), f(grad_out).reshape(-1, OUT)
    u = (EPS_BF16 if dtype == torch.bfloat16 else EPS32) / 2
    acc = lambda k: k * EPS32  # noqa: E731
    a, t = X @ A.T, G @ B
    y = X @ W.T + b + s * a @ B.T
    gx, gA, gB = G @ W + s * t @ A, s * t.T @ X, s * G.T @ a
    aX, aW, aA, aB, aG = X.abs(), W.abs(), A.abs(), B.abs(), G.abs()
    y_bound = (u + acc(IN)) * (aX @ aW.T + b.abs()) + s * (u + acc(IN) + acc(R)) * (aX @ aA.T) @ aB.T + u * y.abs()
    gx_bound = (u + acc(OUT)) * aG @ aW + s * (u + acc(OUT) + acc(R)) * (aG @ aB) @ aA + u * gx.abs()
    gA_bound = s * (u + acc(OUT) + acc(ROWS)) * (aG @ aB).T @ aX + u * gA.abs()
    gB_bound = s * (u + acc(IN) + acc(ROWS)) * aG.T @ (aX @ aA.T) + u * gB.abs()
    bounds = [SAFETY * bound for bound in (y_bound, gx_bound, gA_bound, gB_bound)]
    wrong = [y - s * a @ B.T, gx - s * t @ A, 2 * gA, 2 * gB]  # the update dropped, the scaling applied twice
    return [y, gx, gA, gB], bounds, wrong


@pytest.mark.numerics
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_update_is_the_definition_within_its_roundings(dtype, device):
    _, layer = _layer(base_dtype=dtype, adapter_dtype=dtype, device=device)
    x = torch.randn(2, ROWS // 2, IN, dtype=dtype, device=device)
    grad_out = torch.randn(2, ROWS // 2, OUT, dtype=dtype, device=device)
    ours, ours_grads = _run(lambda m, t: m(t), layer, x, grad_out)
    exact, bounds, wrong = _definition_and_bounds(layer, x, grad_out, dtype)
    names = ("output", "x", "lora_A", "lora_B")
    for name, value, reference, bound, mistake in zip(names, [ours] + ours_grads, exact, bounds, wrong):
        error = (value.double().reshape(reference.shape) - reference).abs()
        assert value.dtype == dtype and (error <= bound).all(), f"{name}: {(error / bound).max().item():.3g} of bound"
        assert ((mistake - reference).abs() > bound).any(), f"{name}: the bound cannot tell a wrong update"
    with torch.no_grad():
        assert torch.equal(layer(x), ours)


def test_a_trainable_base_takes_the_in_place_path_and_gets_its_gradient():
    _, layer = _layer(base_dtype=torch.float64, adapter_dtype=torch.float64)
    layer.base_layer.weight.requires_grad_(True)
    x = torch.randn(ROWS, IN, dtype=torch.float64)
    grads = []
    for forward in (lambda m, t: m(t), LoraLinear.forward):
        layer.base_layer.weight.grad = None
        forward(layer, x).square().sum().backward()
        grads.append(layer.base_layer.weight.grad)
    assert grads[0] is not None and torch.equal(grads[0], grads[1])


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


def test_updates_make_fewer_rows_by_out_temporaries_than_peft():
    x = torch.randn(ROWS, IN, dtype=torch.bfloat16)
    counts = {}
    for adapter_dtype in (torch.float32, torch.bfloat16):
        _, layer = _layer(adapter_dtype=adapter_dtype)
        with torch.no_grad():
            with _Allocations(ROWS * OUT) as ours:
                layer(x)
            with _Allocations(ROWS * OUT) as peft:
                LoraLinear.forward(layer, x)
        counts[adapter_dtype] = ours.count, peft.count
    assert counts[torch.float32] == (2, 5)  # in place: the base's result and lora_B's output; peft: and the scaled
    # copy, the float32 sum, its bf16 cast
    assert counts[torch.bfloat16] == (1, 4)  # fused: the base's result only; peft: lora_B's output, the scaled copy,
    # the sum


class _Ops(TorchDispatchMode):
    """The names of the dispatched ops that are not views (each a kernel, or a tensor's allocation)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_fused_update_is_three_gemms_forward_and_five_backward(x_requires_grad):
    _, layer = _layer(base_dtype=torch.bfloat16, adapter_dtype=torch.bfloat16)
    x = torch.randn(2, ROWS // 2, IN, dtype=torch.bfloat16, requires_grad=x_requires_grad)
    grad_out = torch.randn(2, ROWS // 2, OUT, dtype=torch.bfloat16)
    ops = {}
    for name, forward in (("ours", lambda m, t: m(t)), ("peft", LoraLinear.forward)):
        with _Ops() as forward_ops, lora_update("fused"):
            out = forward(layer, x)
        with _Ops() as backward_ops:
            out.backward(grad_out)
        ops[name] = forward_ops.names, backward_ops.names
        for p in layer.parameters():
            p.grad = None
    forward_ops, backward_ops = ops["ours"]
    assert forward_ops == ["addmm", "mm", "addmm_"]  # the base (bias in it), lora_A, lora_B accumulating
    # gy B, then gy W accumulating its product with A (only when x needs it), and the adapters' two
    assert backward_ops == ["mm", "mm", "addmm_", "addmm", "addmm"] if x_requires_grad else ["mm", "addmm", "addmm"]
    # peft: two views that copy, the scaling and the sum forward; the scaling and the sum of x's two gradients back
    assert len(ops["peft"][0]) == 7 and len(ops["peft"][1]) > len(backward_ops)


def test_apply_lora_adopts_every_plain_lora_linear():
    model = apply_lora(build_model("tiny-qwen3_5", seed=0), r=4)
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert layers and all(type(m) is in_place_lora_class() for m in layers)


MERGED_ROWS = 64  # merge_pays at IN 64, OUT 96: rows (64 + 192) >= 2 64 96 from 48 rows on


@pytest.mark.numerics
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
def test_a_capture_call_runs_on_the_merged_weight_within_its_roundings(adapter_dtype, device, monkeypatch):
    """Inside a capture, graph-free, on enough rows: one GEMM on W + s B A rounded once to bf16, within the roundings
    of that weight and of the GEMM of the layer's definition in float64; a dropped or doubled update is outside."""
    import longstraw.models.lora_linear as lora_linear

    _, layer = _layer(base_dtype=torch.bfloat16, adapter_dtype=adapter_dtype, device=device)
    calls = []
    merged_weight = lora_linear.merged_lora_weight
    monkeypatch.setattr(lora_linear, "merged_lora_weight", lambda *a: calls.append(a) or merged_weight(*a))
    x = torch.randn(2, MERGED_ROWS // 2, IN, dtype=torch.bfloat16, device=device)
    with torch.no_grad(), lora_linear.merged_lora_for_capture():
        ours = layer(x)
    assert len(calls) == 1 and ours.dtype == torch.bfloat16
    f = lambda t: t.detach().double()  # noqa: E731
    W, b = f(layer.base_layer.weight), f(layer.base_layer.bias)
    A, B = f(layer.lora_A["default"].weight), f(layer.lora_B["default"].weight)
    s, X = layer.scaling["default"], f(x).reshape(-1, IN)
    merged = W + s * B @ A
    y = X @ merged.T + b
    u = EPS_BF16 / 2
    # the merged weight: R products summed in float32 and one rounding to bf16; the GEMM: IN products summed in
    # float32 over the rounded weight, the bias added, one rounding to bf16
    weight_error = (u + R * EPS32) * (W.abs() + s * B.abs() @ A.abs())
    gemm_error = (u + IN * EPS32) * (X.abs() @ (merged.abs() + weight_error).T + b.abs())
    bound = SAFETY * (gemm_error + X.abs() @ weight_error.T + u * y.abs())
    error = (ours.double().reshape(y.shape) - y).abs()
    assert (error <= bound).all(), f"{(error / bound).max().item():.3g} of bound"
    for wrong in (X @ W.T + b, X @ (W + 2 * s * B @ A).T + b):  # the update dropped, the scaling applied twice
        assert ((wrong - y).abs() > bound).any(), "the bound cannot tell a wrong update"


@pytest.mark.numerics
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_merged_update_under_autograd_is_the_definition_within_its_roundings(dtype, device, monkeypatch):
    """`lora_update("merged")` on enough rows (`merged_update_pays`): the output and x's gradient from the merged
    weight W + s B A rounded once, within that weight's rounding and the GEMMs' (as the capture's merged call, above,
    and for gx = gy W' alike); lora_A's and lora_B's gradients are the fused update's bit for bit (the same GEMMs on
    the same operands). A dropped or doubled update is outside the bounds. On fewer rows the fused update runs."""
    import longstraw.models.lora_linear as lora_linear

    _, layer = _layer(base_dtype=dtype, adapter_dtype=dtype, device=device)
    calls = []
    merged_weight = lora_linear.merged_lora_weight
    monkeypatch.setattr(lora_linear, "merged_lora_weight", lambda *a: calls.append(a) or merged_weight(*a))
    x = torch.randn(2, MERGED_ROWS // 2, IN, dtype=dtype, device=device)
    grad_out = torch.randn(2, MERGED_ROWS // 2, OUT, dtype=dtype, device=device)
    assert lora_linear.merged_update_pays(MERGED_ROWS, IN, OUT) and not lora_linear.merged_update_pays(16, IN, OUT)
    with lora_linear.lora_update("merged"):
        ours, ours_grads = _run(lambda m, t: m(t), layer, x, grad_out)
        assert len(calls) == 1
        _run(lambda m, t: m(t), layer, x[:, :8], grad_out[:, :8])  # 16 rows: the fused update, no merge
        assert len(calls) == 1
    with lora_linear.lora_update("fused"):
        fused, fused_grads = _run(lambda m, t: m(t), layer, x, grad_out)
    assert torch.equal(ours_grads[1], fused_grads[1]) and torch.equal(ours_grads[2], fused_grads[2])
    f = lambda t: t.detach().double()  # noqa: E731
    W, b = f(layer.base_layer.weight), f(layer.base_layer.bias)
    A, B = f(layer.lora_A["default"].weight), f(layer.lora_B["default"].weight)
    s, X, G = layer.scaling["default"], f(x).reshape(-1, IN), f(grad_out).reshape(-1, OUT)
    merged = W + s * B @ A
    u = (EPS_BF16 if dtype == torch.bfloat16 else EPS32) / 2
    weight_error = (u + R * EPS32) * (W.abs() + s * B.abs() @ A.abs())  # R products in float32, one rounding
    y, gx = X @ merged.T + b, G @ merged
    y_bound = (u + IN * EPS32) * (X.abs() @ (merged.abs() + weight_error).T + b.abs()) + X.abs() @ weight_error.T
    gx_bound = (u + OUT * EPS32) * (G.abs() @ (merged.abs() + weight_error)) + G.abs() @ weight_error
    checks = (
        ("output", ours, y, SAFETY * (y_bound + u * y.abs()), (X @ W.T + b, X @ (W + 2 * s * B @ A).T + b)),
        ("x", ours_grads[0], gx, SAFETY * (gx_bound + u * gx.abs()), (G @ W, G @ (W + 2 * s * B @ A))),
    )
    for name, value, exact, bound, wrongs in checks:
        error = (value.double().reshape(exact.shape) - exact).abs()
        assert value.dtype == dtype and (error <= bound).all(), f"{name}: {(error / bound).max().item():.3g} of bound"
        for wrong in wrongs:  # the update dropped, the scaling applied twice
            assert ((wrong - exact).abs() > bound).any(), f"{name}: the bound cannot tell a wrong update"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scoring_under_the_merged_update_runs_replays_forward(dtype, monkeypatch):
    """Graph-free on enough rows (an old policy's scoring), `lora_update("merged")` computes what the call under
    autograd computes on those rows, bit for bit: the merged weight's GEMM, so an on-policy ratio stays 1. On fewer
    rows both run the fused update; inside a capture the capture's own rule (`merge_pays`) decides."""
    import longstraw.models.lora_linear as lora_linear

    _, layer = _layer(base_dtype=dtype, adapter_dtype=dtype)
    calls = []
    merged_weight = lora_linear.merged_lora_weight
    monkeypatch.setattr(lora_linear, "merged_lora_weight", lambda *a: calls.append(a) or merged_weight(*a))
    for rows, merges in ((MERGED_ROWS, 2), (16, 0)):
        x = torch.randn(rows, IN, dtype=dtype)
        with lora_update("merged"):
            with torch.no_grad():
                scored = layer(x)
            replayed = layer(x.requires_grad_())
        assert len(calls) == merges and torch.equal(scored, replayed.detach())
        calls.clear()
    # inside a capture the capture's rule decides: 40 rows pay for the update's merge, not for a kept forward's
    x = torch.randn(40, IN, dtype=dtype)
    assert lora_linear.merged_update_pays(40, IN, OUT) and not lora_linear.merge_pays(40, layer.base_layer)
    with lora_update("merged"), torch.no_grad(), lora_linear.merged_lora_for_capture():
        layer(x)
    assert not calls


@pytest.mark.numerics
def test_the_merged_update_is_peft_in_float64():
    import longstraw.models.lora_linear as lora_linear

    _, layer = _layer(base_dtype=torch.float64, adapter_dtype=torch.float64)
    x = torch.randn(2, MERGED_ROWS // 2, IN, dtype=torch.float64)
    grad_out = torch.randn(2, MERGED_ROWS // 2, OUT, dtype=torch.float64)
    with lora_linear.lora_update("merged"):
        ours, ours_grads = _run(lambda m, t: m(t), layer, x, grad_out)
    peft, peft_grads = _run(LoraLinear.forward, layer, x, grad_out)
    for a, b in zip([ours] + ours_grads, [peft] + peft_grads):
        within(relative(a, b), TOL64, "merged update against peft in float64")


@pytest.mark.numerics
def test_a_bf16_capture_on_merged_weights_keeps_a_small_trained_update(monkeypatch):
    """Rounding W + s B A to bf16 could drop an update smaller than half a bf16 spacing of W element by element; W's
    own values dither that rounding, so on average the update stays. tiny-qwen3_5 in bf16 with lora_B scaled to an
    update of 3% of |W| (rms): its capture's pages on merged weights are no farther from the float64 capture's
    (unmerged, the same values) than the unmerged bf16 capture's are, within 1.5x, and less than half as far as the
    adapter's own effect on them (a capture that lost the update would be as far as that effect)."""
    import contextlib
    import copy

    import longstraw.core.transaction as transaction

    model = apply_lora(
        build_model("tiny-qwen3_5", seed=0, dtype=torch.bfloat16), r=8, init_random=True, dtype=torch.bfloat16
    )
    for layer in (m for m in model.modules() if isinstance(m, LoraLinear)):
        A, B, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
        W, update = layer.base_layer.weight.float(), s * B.float() @ A.float()
        with torch.no_grad():
            B.mul_((0.03 * W.pow(2).mean().sqrt() / update.pow(2).mean().sqrt()).to(B.dtype))
    model64 = copy.deepcopy(model).double()
    prompt = torch.randint(0, 256, (1024,), generator=torch.Generator().manual_seed(0))

    def pages(m):
        state = capture(m, prompt, chunk_size=512, order="chunk")
        return torch.cat([t.double().flatten() for layer in state.layers for t in layer.tensors()])

    with torch.no_grad():
        merged = pages(model)
        monkeypatch.setattr(transaction, "merged_lora_for_capture", contextlib.nullcontext)  # the rest unmerged
        unmerged, exact = pages(model), pages(model64)
        with model64.disable_adapter():
            without_adapter = pages(model64)
    error, unmerged_error, effect = (relative(x, exact) for x in (merged, unmerged, without_adapter))
    assert error <= 1.5 * unmerged_error and error < 0.5 * effect, (error, unmerged_error, effect)


def test_the_merge_takes_the_triton_pass_only_where_it_applies(monkeypatch):
    """`merged_lora_weight` hands the merge to `lora_merge_triton` where that applies (a stand-in here) and the weight
    is already in the result's dtype; an NF4 base's float32 dequantized weight merged into bf16 keeps the addmm."""
    import longstraw.models.lora_linear as lora_linear

    calls = []
    monkeypatch.setattr(lora_linear, "_load_merge_usable", lambda: lambda *a: True)
    monkeypatch.setattr(lora_linear, "_load_merge", lambda: lambda *a: calls.append(a) or "merged in one pass")
    W, A, B = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2)
    assert lora_linear.merged_lora_weight(W, A, B, 2.0, torch.float32) == "merged in one pass"
    assert len(calls) == 1 and calls[0][0] is W and calls[0][1] is A and calls[0][2] is B and calls[0][3] == 2.0
    merged = lora_linear.merged_lora_weight(W, A, B, 2.0, torch.bfloat16)
    assert len(calls) == 1 and torch.equal(merged, (W + 2.0 * B @ A).bfloat16())


@pytest.mark.cuda
@pytest.mark.parametrize("rank", [5, 16])
def test_the_triton_merge_is_the_merged_weight_within_one_bf16_rounding(rank):
    """`lora_merge_triton` on CUDA, bf16, ragged 64-wide tiles: W + s B A within one bf16 rounding and the float32
    sum's (rank + 2) roundings of the float64 value, times SAFETY; the update left out is outside."""
    import longstraw.models.lora_linear as lora_linear
    from longstraw.kernels import lora_merge_triton

    gen = torch.Generator().manual_seed(0)
    W, A, B = (torch.randn(*shape, generator=gen).bfloat16().cuda() for shape in ((200, 130), (rank, 130), (200, rank)))
    assert lora_merge_triton.merge_usable(W, A, B)
    ours = lora_linear.merged_lora_weight(W, A, B, 0.5, torch.bfloat16)
    W64, A64, B64 = (t.double() for t in (W, A, B))
    expected = W64 + 0.5 * B64 @ A64
    terms = W64.abs() + 0.5 * B64.abs() @ A64.abs()
    bound = SAFETY * (EPS_BF16 / 2 * expected.abs() + (rank + 2) * EPS32 * terms)
    assert ours.dtype == torch.bfloat16 and ((ours.double() - expected).abs() <= bound).all()
    assert ((W64 - expected).abs() > bound).any()


def test_only_graph_free_many_row_capture_calls_merge(monkeypatch):
    """Outside a capture, with grad on, or on fewer rows than pay for the merge, the call keeps the unmerged
    forward (peft's own here, bit for bit; under `lora_update("fused")`, as "merged" merges those with enough rows
    itself); a kept weight is built once for all of a layer's calls."""
    import longstraw.models.lora_linear as lora_linear

    _, layer = _layer(base_dtype=torch.float32, adapter_dtype=torch.float32)
    calls = []
    merged_weight = lora_linear.merged_lora_weight
    monkeypatch.setattr(lora_linear, "merged_lora_weight", lambda *a: calls.append(a) or merged_weight(*a))
    many, few = torch.randn(MERGED_ROWS, IN), torch.randn(8, IN)
    monkeypatch.setattr(lora_linear._lora_update, "value", "fused")
    with torch.no_grad():
        assert torch.equal(layer(many), LoraLinear.forward(layer, many))
    with lora_linear.merged_lora_for_capture():
        assert torch.equal(layer(many), LoraLinear.forward(layer, many))  # grad on
        with torch.no_grad():
            assert torch.equal(layer(few), LoraLinear.forward(layer, few))
            assert not calls
            with lora_linear.merged_weights_kept():
                layer(many), layer(many)
            assert len(calls) == 1


@pytest.mark.numerics
def test_a_capture_on_merged_weights_leaves_the_unmerged_forwards_state(monkeypatch):
    """Every LoRA layer of a capture's full chunks runs merged; the pages and GDN states equal those of the
    unmerged forward (the merging off). In float64, adapters too: the two differ by the order of the same sums
    (TOL64), so the check does not hang on a CPU's float32 kernels. Under `lora_update("fused")`, so that the
    unmerged capture's calls do not merge by that setting."""
    import contextlib

    import longstraw.core.transaction as transaction
    import longstraw.models.lora_linear as lora_linear

    monkeypatch.setattr(lora_linear._lora_update, "value", "fused")

    model = apply_lora(
        build_model("tiny-qwen3_5", seed=0, dtype=torch.float64), r=4, init_random=True, dtype=torch.float64
    )
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    calls = []
    merged_weight = lora_linear.merged_lora_weight
    monkeypatch.setattr(lora_linear, "merged_lora_weight", lambda *a: calls.append(a) or merged_weight(*a))
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
    merged = capture(model, prompt, chunk_size=128, order="chunk")
    # the two 128-row chunks (every layer pays there) and the 299 - 256 = 43-row tail, where some layers pay
    expected = sum(2 + lora_linear.merge_pays(43, m.base_layer) for m in layers)
    assert all(lora_linear.merge_pays(128, m.base_layer) for m in layers) and len(calls) == expected
    monkeypatch.setattr(transaction, "merged_lora_for_capture", contextlib.nullcontext)
    unmerged = capture(model, prompt, chunk_size=128, order="chunk")
    assert len(calls) == expected
    for a, b in zip(merged.layers, unmerged.layers):
        for ta, tb in zip(a.tensors(), b.tensors()):
            # float64 pages and conv states; GDN's recurrent state is kept in float32 whatever the compute dtype, so
            # there the float64 values are rounded once more (one float32 rounding apart at most)
            tol = TOL64 if ta.dtype == torch.float64 else SAFETY * EPS32
            within(relative(ta, tb), tol, "state")
