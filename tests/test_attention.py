"""Tests for longstraw.kernels.paged_attention.paged_attention (blockwise LSE-merged attention with own backward)."""

import itertools
import math

import pytest
import torch
from tolerances import EPS_BF16, close

import longstraw.kernels.paged_attention as attention
from longstraw.kernels.paged_attention import paged_attention, reference_attention

pytestmark = pytest.mark.numerics  # kernel numerics against references, under tolerances

# float64 kernels against the float64 dense reference: 1e-10 is ~1e5 times the differences measured (<= 1e-5
# of it on every kernel path) and far below one float32 rounding
TOL64 = 1e-10
# bf16 results of float32 computations: one bf16 rounding of the result (<= EPS_BF16 / 2 relative), or one
# spacing either side where the float32 value lies near a rounding boundary
BF16_RTOL = 2 * EPS_BF16


def dense_reference(q, k_prefix, v_prefix, k_live, v_live, scale):
    """Independent float64 reference: per query head, explicit loops over the mask, plain autograd."""
    B, H, R, _ = q.shape
    G = H // k_live.shape[1]
    P = k_prefix.shape[2]
    heads = []
    for h in range(H):
        k = torch.cat([k_prefix[:, h // G], k_live[:, h // G]], dim=1)  # [B, P+R, D]
        v = torch.cat([v_prefix[:, h // G], v_live[:, h // G]], dim=1)
        scores = torch.einsum("brd,btd->brt", q[:, h], k) * scale
        mask = torch.zeros(R, P + R, dtype=torch.bool)
        for i in range(R):
            mask[i, : P + i + 1] = True
        scores = torch.where(mask, scores, torch.full_like(scores, -math.inf))
        heads.append(torch.einsum("brt,btd->brd", torch.softmax(scores, dim=-1), v))
    return torch.stack(heads, dim=1)


def make_inputs(B, H, Hk, R, P, D, dtype=torch.float64, prefix_grad=False, seed=0, capacity_extra=5, shared=False):
    """`shared`: one prompt's pages (batch 1) for the B sequences, as a batch of replayed members reads them."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    q = rnd(B, H, R, D).requires_grad_()
    # prefix as strided views of a larger preallocated page buffer
    pages = 1 if shared else B
    k_pages, v_pages = rnd(pages, Hk, P + capacity_extra, D), rnd(pages, Hk, P + capacity_extra, D)
    if prefix_grad:
        k_pages.requires_grad_()
        v_pages.requires_grad_()
    k_prefix, v_prefix = k_pages[:, :, :P], v_pages[:, :, :P]
    k_live, v_live = rnd(B, Hk, R, D).requires_grad_(), rnd(B, Hk, R, D).requires_grad_()
    return q, k_prefix, v_prefix, k_live, v_live, (k_pages, v_pages)


def grads_of(out, tensors, dout):
    tensors = [t for t in tensors if t.requires_grad]
    return torch.autograd.grad(out, tensors, dout)


SHAPES = [
    # B, H, Hk, R, P, D, block_size
    (1, 2, 2, 5, 0, 8, 4),  # empty prefix
    (2, 4, 2, 3, 13, 8, 4),  # GQA 2, P not a multiple of block, several blocks
    (1, 6, 2, 1, 9, 16, 4),  # R == 1, GQA 3
    (2, 4, 1, 7, 16, 8, 8),  # MQA, P a multiple of block
    (1, 3, 3, 6, 37, 8, None),  # default block size (one block)
    (1, 8, 2, 4, 11, 4, 1),  # block size 1
    (2, 2, 1, 1, 0, 8, 3),  # R == 1 and P == 0
]


@pytest.mark.parametrize("B,H,Hk,R,P,D,block_size", SHAPES)
@pytest.mark.parametrize("prefix_grad", [False, True])
def test_forward_backward_matches_float64_reference(B, H, Hk, R, P, D, block_size, prefix_grad):
    q, kp, vp, kl, vl, (k_pages, v_pages) = make_inputs(B, H, Hk, R, P, D, prefix_grad=prefix_grad)
    scale = D**-0.5
    out = paged_attention(q, kp, vp, kl, vl, scale=scale, block_size=block_size, backend="math")
    ref = dense_reference(q, kp, vp, kl, vl, scale)
    assert out.dtype == torch.float64 and out.shape == (B, H, R, D)
    torch.testing.assert_close(out, ref, rtol=TOL64, atol=TOL64)

    dout = torch.randn_like(ref)
    leaves = [q, kl, vl] + ([k_pages, v_pages] if prefix_grad else [])
    got = grads_of(out, leaves, dout)
    want = grads_of(ref, leaves, dout)
    for name, a, b in zip(["q", "k_live", "v_live", "k_pages", "v_pages"], got, want):
        torch.testing.assert_close(a, b, rtol=TOL64, atol=TOL64, msg=lambda m, n=name: f"grad {n}: {m}")
    if prefix_grad and P:
        assert got[3][:, :, P:].abs().max() == 0  # positions past the prefix view get nothing


@pytest.mark.parametrize(
    "B,H,Hk,R,P,D,block_size", [(3, 4, 2, 5, 13, 8, 4), (2, 6, 2, 1, 9, 16, 4), (4, 2, 2, 3, 0, 8, 4)]
)
@pytest.mark.parametrize("prefix_grad", [False, True])
def test_sequences_sharing_one_prefix_match_the_reference_per_sequence(B, H, Hk, R, P, D, block_size, prefix_grad):
    # B sequences over one prompt's pages (batch 1): each as if it had the prefix to itself; the pages'
    # gradient is the sum of the sequences' (the reference reads them through an expand)
    q, kp, vp, kl, vl, (k_pages, v_pages) = make_inputs(B, H, Hk, R, P, D, prefix_grad=prefix_grad, shared=True)
    scale = D**-0.5
    out = paged_attention(q, kp, vp, kl, vl, scale=scale, block_size=block_size, backend="math")
    ref = dense_reference(q, kp.expand(B, -1, -1, -1), vp.expand(B, -1, -1, -1), kl, vl, scale)
    torch.testing.assert_close(out, ref, rtol=TOL64, atol=TOL64)
    dout = torch.randn_like(ref)
    leaves = [q, kl, vl] + ([k_pages, v_pages] if prefix_grad else [])
    for name, a, b in zip(
        ["q", "k_live", "v_live", "k_pages", "v_pages"], grads_of(out, leaves, dout), grads_of(ref, leaves, dout)
    ):
        torch.testing.assert_close(a, b, rtol=TOL64, atol=TOL64, msg=lambda m, n=name: f"grad {n}: {m}")


def test_reference_attention_matches_independent_reference():
    q, kp, vp, kl, vl, _ = make_inputs(2, 4, 2, 5, 7, 8)
    torch.testing.assert_close(
        reference_attention(q, kp, vp, kl, vl, 0.3), dense_reference(q, kp, vp, kl, vl, 0.3), rtol=1e-12, atol=1e-12
    )


def test_backward_with_only_some_inputs_requiring_grad():
    q, kp, vp, kl, vl, _ = make_inputs(1, 4, 2, 4, 10, 8)
    kl.requires_grad_(False)
    scale = 0.4
    out = paged_attention(q, kp, vp, kl, vl, scale=scale, block_size=3, backend="math")
    ref = dense_reference(q, kp, vp, kl, vl, scale)
    dout = torch.randn_like(ref)
    for a, b in zip(grads_of(out, [q, vl], dout), grads_of(ref, [q, vl], dout)):
        torch.testing.assert_close(a, b, rtol=TOL64, atol=TOL64)


def test_prefix_fetched_again_for_backward_is_not_kept_by_the_graph():
    """`prefix_again` (pages streamed from host memory): the forward's prefix copy is freed once the
    caller drops it, the backward takes a new one, and the gradients are the dense reference's."""
    import gc
    import weakref

    q, kp, vp, kl, vl, _ = make_inputs(1, 4, 2, 3, 10, 8)
    host = torch.cat([kp, vp], dim=-1)  # one page tensor: keys then values, as MLA latent pages are
    fetched = []

    def again():
        fetched.append(host.clone())
        return fetched[-1][..., :8], fetched[-1][..., 8:]

    copy = host.clone()  # the forward's "device copy"
    out = paged_attention(
        q, copy[..., :8], copy[..., 8:], kl, vl, scale=0.3, block_size=4, backend="math", prefix_again=again
    )
    gone = weakref.ref(copy)
    del copy
    gc.collect()
    assert gone() is None and not fetched  # the graph held no reference; nothing fetched yet
    dout = torch.randn_like(out)
    ref = dense_reference(q, kp, vp, kl, vl, 0.3)
    for a, b in zip(grads_of(out, [q, kl, vl], dout), grads_of(ref, [q, kl, vl], dout)):
        torch.testing.assert_close(a, b, rtol=TOL64, atol=TOL64)
    assert len(fetched) == 1
    with pytest.raises(ValueError, match="requires grad"):
        paged_attention(q, kp.detach().requires_grad_(), vp, kl, vl, scale=0.3, prefix_again=again)


def test_prefix_grads_not_computed_when_prefix_does_not_require_grad(monkeypatch):
    calls = []
    real = attention._math_block_bwd

    def spy(*args, **kwargs):
        calls.append(args[7] if len(args) > 7 else kwargs["need_kv"])
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "_math_block_bwd", spy)
    q, kp, vp, kl, vl, (k_pages, v_pages) = make_inputs(1, 4, 2, 3, 10, 8)
    out = paged_attention(q, kp, vp, kl, vl, scale=0.3, block_size=4, backend="math")
    out.sum().backward()
    assert k_pages.grad is None and v_pages.grad is None
    assert calls == [True, False, False, False]  # live block with dk/dv, then 3 prefix blocks dq only

    # nothing but the live K/V wants grad: the prefix is not touched at all in backward
    calls.clear()
    q2 = q.detach()
    paged_attention(q2, kp, vp, kl, vl, scale=0.3, block_size=4, backend="math").sum().backward()
    assert calls == [True]


def test_low_precision_math_and_auto_on_cpu():
    q, kp, vp, kl, vl, _ = make_inputs(2, 4, 2, 6, 21, 16, dtype=torch.bfloat16)
    out = paged_attention(q, kp, vp, kl, vl, scale=0.25, block_size=8)  # auto -> math on CPU
    assert out.dtype == torch.bfloat16
    ref = dense_reference(*(t.double() for t in (q, kp, vp, kl, vl)), 0.25)
    close(out, ref, rtol=BF16_RTOL, atol=BF16_RTOL * float(ref.detach().abs().max()), what="bf16 output")
    out.float().square().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and kl.grad.dtype == torch.bfloat16


def test_value_head_dim_may_differ_on_math_backend():
    g = torch.Generator().manual_seed(1)
    q, kp, kl = (torch.randn(1, 4, n, 8, generator=g, dtype=torch.float64) for n in (3, 5, 3))
    vp, vl = (
        torch.randn(1, 2, 5, 6, generator=g, dtype=torch.float64),
        torch.randn(1, 2, 3, 6, generator=g, dtype=torch.float64),
    )
    kp, vp, kl = kp[:, :2], vp, kl[:, :2]
    out = paged_attention(q, kp, vp, kl, vl, scale=0.3, block_size=2, backend="math")
    assert out.shape == (1, 4, 3, 6)
    torch.testing.assert_close(out, dense_reference(q, kp, vp, kl, vl, 0.3), rtol=TOL64, atol=TOL64)


def test_no_grad_forward():
    q, kp, vp, kl, vl, _ = make_inputs(1, 2, 1, 4, 9, 8)
    with torch.no_grad():
        out = paged_attention(q, kp, vp, kl, vl, scale=0.3, block_size=4, backend="math")
    assert out.grad_fn is None
    torch.testing.assert_close(out, dense_reference(q, kp, vp, kl, vl, 0.3).detach(), rtol=TOL64, atol=TOL64)


def _good():
    q, kp, vp, kl, vl, _ = make_inputs(1, 4, 2, 3, 5, 8)
    return dict(q=q, kp=kp, vp=vp, kl=kl, vl=vl)


def _call(d, **kw):
    kw.setdefault("scale", 0.5)
    return paged_attention(d["q"], d["kp"], d["vp"], d["kl"], d["vl"], **kw)


@pytest.mark.parametrize(
    "mutate,kwargs,exc,match",
    [
        (lambda d: d.update(q=d["q"][0]), {}, ValueError, "q must be 4-D"),
        (lambda d: d.update(kp=d["kp"].tolist()), {}, TypeError, "k_prefix must be a torch.Tensor"),
        (lambda d: d.update(vl=d["vl"].float()), {}, TypeError, "share one dtype"),
        (lambda d: d.update(kl=d["kl"].long()), {}, TypeError, "k_live must be a floating-point"),
        (lambda d: d.update(q=torch.zeros(1, 3, 3, 8, dtype=torch.float64)), {}, ValueError, "multiple of kv heads"),
        (lambda d: d.update(kl=d["kl"][:, :, :2]), {}, ValueError, "live length mismatch"),
        (lambda d: d.update(vp=d["vp"][:, :, :4]), {}, ValueError, "prefix length mismatch"),
        (lambda d: d.update(kp=d["kp"][:, :1]), {}, ValueError, "kv head count mismatch"),
        (lambda d: d.update(kl=d["kl"][..., :4]), {}, ValueError, "head dim mismatch"),
        (lambda d: d.update(vl=d["vl"][..., :4]), {}, ValueError, "value head dim mismatch"),
        (lambda d: d.update(vp=torch.zeros(2, 2, 5, 8, dtype=torch.float64)), {}, ValueError, "batch size mismatch"),
        (lambda d: d.update(q=d["q"][:, :, :0], kl=d["kl"][:, :, :0], vl=d["vl"][:, :, :0]), {}, ValueError, "R == 0"),
        (lambda d: d.update(kp=d["kp"].to("meta")), {}, ValueError, "one device"),
        (lambda d: None, {"backend": "triton"}, ValueError, "backend must be one of"),
        (lambda d: None, {"backend": "cuda"}, ValueError, "needs CUDA tensors"),
        (lambda d: None, {"backend": "cudnn"}, ValueError, "needs CUDA tensors"),
        (lambda d: None, {"block_size": 0}, ValueError, "block_size"),
        (lambda d: None, {"scale": None}, TypeError, "scale must be a real number"),
    ],
)
def test_bad_input_raises(mutate, kwargs, exc, match):
    d = _good()
    mutate(d)
    with pytest.raises(exc, match=match):
        _call(d, **kwargs)


# ---------------------------------------------------------------------------------------------- CUDA


CUDA_SHAPES = [
    # B, H, Hk, R, P, D, block_size
    (1, 8, 2, 64, 0, 64, None),
    (2, 4, 4, 32, 300, 128, 128),
    (1, 4, 2, 24, 100, 96, 64),
    (1, 16, 2, 1, 1000, 128, 256),
    (1, 8, 1, 100, 517, 64, 200),
]


@pytest.mark.cuda
@pytest.mark.parametrize("B,H,Hk,R,P,D,block_size", CUDA_SHAPES)
@pytest.mark.parametrize("prefix_grad", [False, True])
@pytest.mark.parametrize("backend", ["cuda", "flash"])  # "cudnn" is experimental: see module doc
def test_cuda_backend_matches_math_in_bf16(B, H, Hk, R, P, D, block_size, prefix_grad, backend):
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, grad=True):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)

    q, kl, vl = rnd(B, H, R, D), rnd(B, Hk, R, D), rnd(B, Hk, R, D)
    k_pages, v_pages = rnd(B, Hk, P + 7, D, grad=prefix_grad), rnd(B, Hk, P + 7, D, grad=prefix_grad)
    kp, vp = k_pages[:, :, :P], v_pages[:, :, :P]
    leaves = [q, kl, vl] + ([k_pages, v_pages] if prefix_grad else [])
    assert attention._pick_kernel(backend, q, D) != "math"
    results = {}
    for name in (backend, "math"):
        out = paged_attention(q, kp, vp, kl, vl, scale=D**-0.5, block_size=block_size, backend=name)
        dout = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda")
        results[name] = [out] + list(torch.autograd.grad(out, leaves, dout.to(out.dtype)))
    for a, b in zip(results[backend], results["math"]):
        assert a.dtype == b.dtype == torch.bfloat16
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 2e-2 * max(1.0, b.float().abs().max().item()), err


def _emulated_fwd(q, k, v, scale, causal=False):
    """A float32 stand-in for a CUDA block forward: (out in q's dtype, lse)."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype), lse


def _emulated_scores_gradient(do, q, k, v, out, lse, scale, causal=False):
    """(P, dS) of a block recomputed against the global out and lse, in float32."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    p = torch.exp(s - lse.unsqueeze(-1))
    return p, p * (do.float() @ v.float().transpose(-1, -2) - (do.float() * out.float()).sum(-1, keepdim=True))


def _emulated_bwd(do, q, k, v, out, lse, scale, causal=False):
    """A float32 stand-in for a CUDA block backward: (dq, dk, dv) in q's dtype."""
    p, ds = _emulated_scores_gradient(do, q, k, v, out, lse, scale, causal)
    return tuple(
        g.to(q.dtype)
        for g in (ds @ k.float() * scale, ds.transpose(-1, -2) @ q.float() * scale, p.transpose(-1, -2) @ do.float())
    )


def _emulate_cuda_kernels(monkeypatch):
    monkeypatch.setitem(attention._CUDA_KERNELS, "flash", (_emulated_fwd, _emulated_bwd))
    # "cudnn_blocks" dispatches block by block (short blocks and the live block's backward to flash)
    for name in ("_flash_block_fwd", "_cudnn_block_fwd"):
        monkeypatch.setattr(attention, name, _emulated_fwd)
    for name in ("_flash_block_bwd", "_cudnn_block_bwd"):
        monkeypatch.setattr(attention, name, _emulated_bwd)
    monkeypatch.setattr(attention, "CUDNN_MIN_ROWS", 5)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_cuda_path_plumbing_with_emulated_kernel_on_cpu(monkeypatch, with_sinks):
    """Fold/repeat/merge/accumulate logic of the CUDA path, with a float32 stand-in for the kernel; with attention
    sinks (gpt-oss) merged into its partials and their gradient, against `reference_attention`'s sink column."""
    _emulate_cuda_kernels(monkeypatch)
    cases = [
        (1, 8, 2, 6, 0, 8, 4, False),
        (2, 6, 2, 5, 23, 8, 7, False),
        (1, 4, 1, 1, 9, 8, 4, False),
        (3, 6, 2, 5, 23, 8, 7, True),
    ]  # last: three sequences over one prompt's pages, folded
    for (B, H, Hk, R, P, D, bs, shared), kernel in itertools.product(cases, ["flash", "cudnn_blocks"]):
        q, kp, vp, kl, vl, (k_pages, v_pages) = make_inputs(
            B, H, Hk, R, P, D, dtype=torch.bfloat16, prefix_grad=True, shared=shared
        )
        sinks = (1 + torch.randn(H, dtype=torch.float64)).bfloat16().requires_grad_() if with_sinks else None
        out = attention._PagedAttention.apply(q, kp, vp, kl, vl, 0.3, bs, kernel, None, sinks)
        leaves = [q, kl, vl, k_pages, v_pages] + ([sinks] if with_sinks else [])
        dout = torch.randn(out.shape, dtype=torch.float64)
        got = grads_of(out, leaves, dout.to(out.dtype))
        leaves64 = [t.detach().double().requires_grad_() for t in leaves]
        q64, kl64, vl64, kpg64, vpg64 = leaves64[:5]
        prefix64 = (kpg64[:, :, :P].expand(B, -1, -1, -1), vpg64[:, :, :P].expand(B, -1, -1, -1))
        if with_sinks:
            ref = reference_attention(q64, *prefix64, kl64, vl64, 0.3, sinks=leaves64[5])
        else:
            ref = dense_reference(q64, *prefix64, kl64, vl64, 0.3)
        # each block's partial output (and gradient) leaves the stand-in kernel in bf16: the output merges them
        # by convex weights (one rounding, then the result's); a query's gradient adds one rounded partial per
        # block, then rounds the sum
        blocks = math.ceil(P / bs) + 1  # the prefix blocks and the live block
        close(out, ref, rtol=BF16_RTOL, atol=BF16_RTOL * float(ref.detach().abs().max()), what="bf16 output")
        for a, b in zip(got, grads_of(ref, leaves64, dout)):
            rtol = (blocks + 1) * BF16_RTOL
            close(a, b, rtol=rtol, atol=rtol * float(b.detach().abs().max()), what="bf16 gradient")


@pytest.mark.parametrize("shared", [False, True])
def test_a_prefix_without_gradient_runs_the_dq_kernel_on_its_blocks_on_cpu(monkeypatch, shared):
    """The CUDA path's backward with a prefix that takes no gradient (a replay's pages), a float32 stand-in for
    `attention_dq_triton` and for the block kernels: under "dq" each prefix block goes to the dq kernel, which adds
    into the float32 accumulator it is handed (the folded rows' when sequences share one prompt's pages) and is fed
    the global out and lse; the library's backward runs the causal live block only. The gradients equal the dense
    float64 reference's within bf16 roundings; under "library" the dq kernel is not called and the gradients are the
    same."""
    _emulate_cuda_kernels(monkeypatch)
    calls = []

    def dq_kernel(do, q, k, v, out, lse, scale, dq_acc):
        assert dq_acc.dtype == torch.float32 and dq_acc.is_contiguous() and out.shape == q.shape
        calls.append(k.shape[2])
        dq_acc += _emulated_scores_gradient(do, q, k, v, out, lse, scale)[1] @ k.float() * scale

    monkeypatch.setattr(attention, "_load_dq", lambda: dq_kernel)
    monkeypatch.setattr(attention, "_load_dq_usable", lambda: lambda q, k: True)
    B, H, Hk, R, P, D, block = 3, 6, 2, 5, 23, 8, 7
    q, kp, vp, kl, vl, _ = make_inputs(B, H, Hk, R, P, D, dtype=torch.bfloat16, shared=shared)
    dout = torch.randn(B, H, R, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = {}
    for name in attention.PREFIX_BACKWARD_KERNELS:
        calls.clear()
        with attention.prefix_backward_kernel(name):
            out = attention._PagedAttention.apply(q, kp, vp, kl, vl, 0.3, block, "cudnn_blocks", None, None)
            got[name] = grads_of(out, [q, kl, vl], dout.to(out.dtype))
        assert calls == ([7, 7, 7, 2] if name == "dq" else [])
    leaves64 = [t.detach().double().requires_grad_() for t in (q, kl, vl)]
    prefix64 = (kp.detach().double().expand(B, -1, -1, -1), vp.detach().double().expand(B, -1, -1, -1))
    expected = grads_of(dense_reference(leaves64[0], *prefix64, *leaves64[1:], 0.3), leaves64, dout)
    rtol = (math.ceil(P / block) + 2) * BF16_RTOL  # a rounded partial a block, the sum's rounding
    for name, grads in got.items():
        for a, b in zip(grads, expected):
            close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()), what=f"{name}: bf16 gradient")


@pytest.mark.cuda
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("P", [300, 4096 + 7])
@pytest.mark.parametrize("D", [64, 128])
def test_the_dq_kernel_gives_the_librarys_query_gradient_on_cuda(D, P, shared):
    """Replay's backward over pages without gradient ("auto" on 512 queries a sequence, two sequences, bf16, head
    dims 64 and 128): the dq-only kernel's query gradient against the float64 dense reference, no farther from it
    than the library's (cuDNN's) plus one bf16 rounding; the live K/V gradients do not depend on the choice."""
    g = torch.Generator(device="cuda").manual_seed(P)

    def t(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    B = 2
    q, kl, vl = t(B, 8, 512, D), t(B, 2, 512, D), t(B, 2, 512, D)
    pages = 1 if shared else B
    kp, vp = t(pages, 2, P + 300, D)[:, :, :P], t(pages, 2, P + 300, D)[:, :, :P]
    dout = t(B, 8, 512, D)
    with attention.prefix_backward_kernel("dq"):
        assert attention._dq_only(q, kp)
    got = {}
    for name in attention.PREFIX_BACKWARD_KERNELS:
        leaves = [x.clone().requires_grad_() for x in (q, kl, vl)]
        with attention.prefix_backward_kernel(name):
            out = paged_attention(leaves[0], kp, vp, *leaves[1:], scale=D**-0.5, block_size=4096)
            got[name] = torch.autograd.grad(out, leaves, dout)
    leaves64 = [x.double().requires_grad_() for x in (q, kl, vl)]
    prefix64 = (kp.double().expand(B, -1, -1, -1), vp.double().expand(B, -1, -1, -1))
    expected = torch.autograd.grad(
        reference_attention(leaves64[0], *prefix64, *leaves64[1:], D**-0.5), leaves64, dout.double()
    )
    for ours, library, e in zip(got["dq"], got["library"], expected):
        scale = float(e.abs().max())
        assert (ours.double() - e).abs().max() <= (library.double() - e).abs().max() + EPS_BF16 * scale
    for ours, library in zip(got["dq"][1:], got["library"][1:]):
        assert torch.equal(ours, library)


@pytest.mark.cuda
@pytest.mark.parametrize("D", [64, 256])  # 256: the Qwen3.6-27B head dim, on cuDNN's forward since issue 20
@pytest.mark.parametrize("P", [0, 300, 4096 + 7])  # 4096 + 7: a 7-key tail block goes to flash
def test_auto_takes_cudnn_blocks_and_matches_math(P, D):
    """Capture, scoring and replay alike ("auto" on 512 queries): cuDNN's forward and its backward on
    the prefix blocks (views into longer pages), flash's on the tail and the live block; forward and
    gradients against the float64 dense reference, at head dim 256 too."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    q, kl, vl = t(1, 8, 512, D), t(1, 2, 512, D), t(1, 2, 512, D)
    kp, vp = t(1, 2, P + 300, D)[:, :, :P], t(1, 2, P + 300, D)[:, :, :P]
    if (torch.backends.cudnn.version() or 0) >= 90000:
        assert attention._pick_kernel("auto", q, D) == "cudnn_blocks"
    with torch.no_grad():
        captured = paged_attention(q, kp, vp, kl, vl, scale=D**-0.5, block_size=4096, capture=True)
    leaves = [x.clone().requires_grad_() for x in (q, kl, vl)]
    out = paged_attention(leaves[0], kp, vp, *leaves[1:], scale=D**-0.5, block_size=4096)
    dout = t(*out.shape)
    grads = torch.autograd.grad(out, leaves, dout)
    assert torch.equal(out.detach(), captured)  # scoring's forward is replay's, bit for bit
    leaves64 = [x.double().requires_grad_() for x in (q, kl, vl)]
    expected = reference_attention(leaves64[0], kp.double(), vp.double(), *leaves64[1:], D**-0.5)
    expected_grads = torch.autograd.grad(expected, leaves64, dout.double())
    assert (out.double() - expected).abs().max() < 2e-2
    for a, b in zip(grads, expected_grads):
        assert (a.double() - b).abs().max() <= 2e-2 * max(1.0, b.abs().max().item())


@pytest.mark.cuda
@pytest.mark.parametrize("R", [64, 512])  # 64 keys: under CUDNN_MIN_ROWS, flash's block; 512: cuDNN's
def test_a_capture_chunk_with_no_prefix_is_one_causal_call_on_q_as_hf_lays_it_out(R):
    """A capture's chunk with no prefix (the whole prompt, when it fits one) is one causal block call on q as HF's
    attention hands it over ([B, H, T, D] over [B, T, H, D] memory), its output in q's dtype: against the float64
    dense reference within the bound of the test above, as the general path's forward (its float32 partial rounded
    back) is."""
    from unittest import mock

    g = torch.Generator(device="cuda").manual_seed(R)

    def t(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    D = 128
    q = t(1, R, 8, D).transpose(1, 2)  # HF's layout
    kl, vl = t(1, 2, R, D), t(1, 2, R, D)
    empty = kl[:, :, :0]
    with torch.no_grad(), mock.patch.object(attention, "_causal_capture", wraps=attention._causal_capture) as fast:
        captured = paged_attention(q, empty, empty, kl, vl, scale=D**-0.5, capture=True)
        general = paged_attention(q, empty, empty, kl, vl, scale=D**-0.5)
    assert fast.call_count == 1 and captured.dtype == torch.bfloat16 and captured.shape == (1, 8, R, D)
    expected = reference_attention(q.double(), empty.double(), empty.double(), kl.double(), vl.double(), D**-0.5)
    assert (captured.double() - expected).abs().max() < 2e-2
    assert (general.double() - expected).abs().max() < 2e-2


def test_capture_flag_refuses_inputs_that_need_a_gradient():
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="capture=True is graph-free"):
        paged_attention(q, k, k, k, k, scale=0.3, capture=True)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_decode_attention_matches_dense_reference(device):
    """B sequences sharing one prefix: each query sees the shared prefix and its own keys so far."""
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    B, H, K, P, N, D = 3, 4, 2, 70, 5, 64
    q, kp, vp, ko, vo = t(B, H, 1, D), t(1, K, P, D), t(1, K, P, D), t(B, K, N, D), t(B, K, N, D)
    out = attention.decode_attention(q, kp, vp, ko, vo, scale=0.125, block_size=32)
    for b in range(B):  # per sequence: prefix + own keys, all visible to the one query
        k = torch.cat([kp[0], ko[b]], dim=1).repeat_interleave(H // K, dim=0).double()
        v = torch.cat([vp[0], vo[b]], dim=1).repeat_interleave(H // K, dim=0).double()
        expected = torch.softmax(q[b].double() @ k.transpose(-1, -2) * 0.125, dim=-1) @ v
        assert (out[b].double() - expected).abs().max() < (1e-10 if device == "cpu" else 2e-2)
    with pytest.raises(ValueError, match="one query"):
        attention.decode_attention(t(B, H, 2, D), kp, vp, ko, vo, scale=0.125)


@pytest.mark.parametrize(
    "within, setting, what, unknown, one, other",
    [
        (attention.forward_kernel, attention._forward_kernel, "forward kernel", "cudnn_blocks", "flash", "cudnn"),
        (
            attention.prefix_backward_kernel,
            attention._prefix_backward_kernel,
            "prefix backward kernel",
            "cudnn",
            "library",
            "dq",
        ),
    ],
)
def test_a_kernel_setting_is_checked_and_restored(within, setting, what, unknown, one, other):
    before = setting.value
    with pytest.raises(ValueError, match=f"{what} must be one of"):
        with within(unknown):
            pass
    with within(one):
        assert setting.value == one
        with pytest.raises(RuntimeError):
            with within(other):
                raise RuntimeError("inside")
        assert setting.value == one
    assert setting.value == before


@pytest.mark.cuda
def test_auto_runs_flash_throughout_under_the_flash_setting():
    q = torch.zeros(1, 8, 512, 128, device="cuda", dtype=torch.bfloat16)
    with attention.forward_kernel("flash"):
        assert attention._pick_kernel("auto", q, 128) == "flash"
    with attention.forward_kernel("cudnn"):
        expected = "cudnn_blocks" if (torch.backends.cudnn.version() or 0) >= 90000 else "flash"
        assert attention._pick_kernel("auto", q, 128) == expected
