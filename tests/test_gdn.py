"""Tests for longstraw.kernels.gdn: chunked gated delta rule vs references, causal conv, purity."""

from __future__ import annotations

import types

import pytest
import torch
from tolerances import EPS_BF16, close, float32_tolerance, relative
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from longstraw.kernels import gdn
from longstraw.kernels.causal_conv import causal_conv1d, causal_conv1d_channels_last, conv_split_heads
from longstraw.kernels.gdn import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_forward,
    differentiable_rule,
    fla_available,
    fla_backward_trusted,
    gated_delta_rule,
    recurrent_gated_delta_rule,
)

# HF's hub-kernel wrappers are thin; call the pure-torch references underneath when exposed.
HF_RECURRENT = getattr(hf.torch_recurrent_gated_delta_rule, "__wrapped__", hf.torch_recurrent_gated_delta_rule)
HF_CONV_FN = getattr(hf.causal_conv1d_fn, "__wrapped__", hf.causal_conv1d_fn)
HF_CONV_UPDATE = getattr(hf.causal_conv1d_update, "__wrapped__", hf.causal_conv1d_update)

pytestmark = pytest.mark.numerics  # kernel numerics against references, under tolerances

# float64 against float64 (the chunked kernel against the token-by-token recurrence): 1e-10 is ~1e5 times the
# differences measured (<= 1.1e-5 of it on every kernel path) and far below one float32 rounding.
TOL64 = 1e-10
# bf16 outputs of equal float32 computations round alike, or one bf16 spacing apart (<= EPS_BF16 relative)
BF16_RTOL = 2 * EPS_BF16


def hf_recurrent(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, state_BHDV):
    """HF's reference; q/k heads repeated here (transformers 5.17 repeats them in the layer, not the kernel)."""
    group = v_BTHV.shape[2] // q_BTHD.shape[2]
    q_BTHD, k_BTHD = (t.repeat_interleave(group, dim=2) for t in (q_BTHD, k_BTHD))
    return HF_RECURRENT(
        q_BTHD,
        k_BTHD,
        v_BTHV,
        g_BTH,
        beta_BTH,
        initial_state=state_BHDV,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )


def make_gdn_inputs(B=2, T=5, Hk=2, Hv=4, Dk=8, Dv=6, dtype=torch.float64, with_state=True, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    q_BTHD = rnd(B, T, Hk, Dk)
    k_BTHD = rnd(B, T, Hk, Dk)
    v_BTHV = rnd(B, T, Hv, Dv)
    # Realistic gates: log decay in (-1, 0), beta in (0, 1).
    g_BTH = -torch.rand(B, T, Hv, generator=gen, dtype=torch.float64).to(dtype)
    beta_BTH = torch.rand(B, T, Hv, generator=gen, dtype=torch.float64).to(dtype)
    state_BHDV = rnd(B, Hv, Dk, Dv) * 0.5 if with_state else None
    return q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, state_BHDV


def leaves(inputs):
    return [None if t is None else t.clone().requires_grad_(True) for t in inputs]


def grads_of(fn, inputs, seed=1, **kwargs):
    """Run fn on fresh leaf copies; return outputs and grads of a random projection of (out, state)."""
    xs = leaves(inputs)
    out_BTHV, state_BHDV = fn(*xs, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out_BTHV.shape, generator=gen, dtype=torch.float64).to(out_BTHV.device, out_BTHV.dtype)
    w_state = torch.randn(state_BHDV.shape, generator=gen, dtype=torch.float64).to(state_BHDV.device, state_BHDV.dtype)
    loss = (out_BTHV * w_out).sum() + (state_BHDV * w_state).sum()
    wrt = [x for x in xs if x is not None]
    return out_BTHV.detach(), state_BHDV.detach(), torch.autograd.grad(loss, wrt)


# ------------------------------------------------------------------------------------
# chunk == recurrent reference (float64): outputs, final state, gradients
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 5, 64, 130])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrent_with_grads(T, chunk_size, with_state, heads=(2, 4)):
    Hk, Hv = heads
    inputs = make_gdn_inputs(T=T, Hk=Hk, Hv=Hv, with_state=with_state)
    o_c, s_c, g_c = grads_of(chunk_gated_delta_rule, inputs, chunk_size=chunk_size)
    o_r, s_r, g_r = grads_of(recurrent_gated_delta_rule, inputs)
    assert o_c.shape == (2, T, Hv, 6) and s_c.shape == (2, Hv, 8, 6)
    torch.testing.assert_close(o_c, o_r, rtol=TOL64, atol=TOL64)
    torch.testing.assert_close(s_c, s_r, rtol=TOL64, atol=TOL64)
    assert len(g_c) == (6 if with_state else 5)
    for a, b in zip(g_c, g_r):
        torch.testing.assert_close(a, b, rtol=10 * TOL64, atol=10 * TOL64)


def test_chunk_matches_recurrent_equal_heads():
    test_chunk_matches_recurrent_with_grads(T=37, chunk_size=16, with_state=True, heads=(3, 3))


@pytest.mark.parametrize("chunk_size", [1, 3, 7])
def test_odd_chunk_sizes(chunk_size):
    inputs = make_gdn_inputs(T=11)
    o_c, s_c = chunk_gated_delta_rule(*inputs, chunk_size=chunk_size)
    o_r, s_r = recurrent_gated_delta_rule(*inputs)
    torch.testing.assert_close(o_c, o_r, rtol=TOL64, atol=TOL64)
    torch.testing.assert_close(s_c, s_r, rtol=TOL64, atol=TOL64)


def test_without_l2norm_matches_recurrent():
    inputs = make_gdn_inputs(T=20)
    q, k = inputs[0] * 0.3, inputs[1] * 0.3  # keep the unnormalised recurrence tame
    inputs = (q, k) + inputs[2:]
    o_c, s_c = chunk_gated_delta_rule(*inputs, chunk_size=8, l2norm_qk=False)
    o_r, s_r = recurrent_gated_delta_rule(*inputs, l2norm_qk=False)
    torch.testing.assert_close(o_c, o_r, rtol=TOL64, atol=TOL64)
    torch.testing.assert_close(s_c, s_r, rtol=TOL64, atol=TOL64)


def test_gradcheck_chunk_small():
    inputs = leaves(make_gdn_inputs(B=1, T=3, Hk=1, Hv=2, Dk=2, Dv=2))

    def fn(*xs):
        return chunk_gated_delta_rule(*xs, chunk_size=2)

    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


# ------------------------------------------------------------------------------------
# Splitting a sequence: state carried across calls
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [1, 37, 64, 100])
@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, recurrent_gated_delta_rule], ids=["chunk", "recurrent"])
def test_split_equals_whole(split, fn):
    q, k, v, g, beta, s0 = make_gdn_inputs(T=130)
    kw = {"chunk_size": 32} if fn is chunk_gated_delta_rule else {}
    o_whole, s_whole = fn(q, k, v, g, beta, s0, **kw)
    a, b = slice(0, split), slice(split, None)
    o_1, s_1 = fn(q[:, a], k[:, a], v[:, a], g[:, a], beta[:, a], s0, **kw)
    o_2, s_2 = fn(q[:, b], k[:, b], v[:, b], g[:, b], beta[:, b], s_1, **kw)
    torch.testing.assert_close(torch.cat([o_1, o_2], dim=1), o_whole, rtol=TOL64, atol=TOL64)
    torch.testing.assert_close(s_2, s_whole, rtol=TOL64, atol=TOL64)


def test_split_gradient_reaches_first_part_through_state():
    q, k, v, g, beta, s0 = leaves(make_gdn_inputs(T=40))
    _, s_1 = chunk_gated_delta_rule(q[:, :25], k[:, :25], v[:, :25], g[:, :25], beta[:, :25], s0, chunk_size=16)
    o_2, _ = chunk_gated_delta_rule(q[:, 25:], k[:, 25:], v[:, 25:], g[:, 25:], beta[:, 25:], s_1, chunk_size=16)
    (gv,) = torch.autograd.grad(o_2.sum(), [v])
    assert gv[:, :25].abs().sum() > 0  # the second call's loss reaches the first call's values


# ------------------------------------------------------------------------------------
# Against HF's own implementation (independent reference)
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_hf_recurrent(dtype, with_state):
    q, k, v, g, beta, s0 = make_gdn_inputs(T=70, Hk=2, Hv=4, dtype=dtype, with_state=with_state)
    o_hf, s_hf = hf_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=32)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    # HF computes in float32 whatever the input dtype; we compute in float64 for float64 inputs. Its recurrence
    # against ours: T = 70 steps, each a Dk = 8 long reduction into the state, rounded in another order
    # (chunked, or float64): sqrt(T Dk) EPS32 apart (tests/tolerances.py), relative to the largest entry
    tol = float32_tolerance(70, 8)
    for o, s in ((o_c, s_c), (o_r, s_r)):
        assert o.dtype == dtype
        close(o, o_hf, rtol=tol, atol=tol * float(o_hf.abs().max()), what="output")
        close(s, s_hf, rtol=tol, atol=tol * float(s_hf.abs().max()), what="state")


def test_bf16_inputs_dtypes_and_values():
    q, k, v, g, beta, s0 = make_gdn_inputs(T=33, dtype=torch.bfloat16)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0.float(), chunk_size=16)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_hf, s_hf = hf_recurrent(q, k, v, g, beta, s0.float())
    close(o, o_hf, rtol=BF16_RTOL, atol=BF16_RTOL * float(o_hf.float().abs().max()), what="bf16 output")
    tol = float32_tolerance(33, 8)  # the state stays float32 on both sides: 33 steps of 8-long reductions
    close(s, s_hf, rtol=tol, atol=tol * float(s_hf.abs().max()), what="state")


# ------------------------------------------------------------------------------------
# No-grad capture forward (CPU: falls back to the chunk kernel)
# ------------------------------------------------------------------------------------


def test_forward_fallback_matches_and_has_no_graph():
    inputs = leaves(make_gdn_inputs(T=45, dtype=torch.float32))
    o_f, s_f = chunk_gated_delta_rule_forward(*inputs, chunk_size=16)
    assert not o_f.requires_grad and not s_f.requires_grad
    o_c, s_c = chunk_gated_delta_rule(*inputs, chunk_size=16)
    assert torch.equal(o_f, o_c.detach()) and torch.equal(s_f, s_c.detach())  # the same kernel on CPU, bit for bit
    assert s_f.dtype == torch.float32


def test_forward_use_fla_true_raises_on_cpu():
    with pytest.raises(RuntimeError):
        chunk_gated_delta_rule_forward(*make_gdn_inputs(T=3, dtype=torch.float32), use_fla=True)


@pytest.mark.cuda
def test_forward_cuda_matches_reference():
    q, k, v, g, beta, s0 = (t.cuda() for t in make_gdn_inputs(T=200, Hk=2, Hv=4, Dk=64, Dv=32, dtype=torch.float32))
    o_f, s_f = chunk_gated_delta_rule_forward(q, k, v, g, beta, s0)
    o_r, s_r = recurrent_gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double(), s0.double())
    torch.testing.assert_close(o_f.double(), o_r, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(s_f.double(), s_r, rtol=2e-2, atol=2e-2)


def test_the_fused_scan_tunes_no_value_block_wider_than_the_head():
    """A candidate whose value block is wider than the head launches no program (V // BV = 0): it would write
    nothing and be timed the fastest. The autotuner is offered only blocks within the head."""
    pytest.importorskip("triton")
    from longstraw.kernels import gdn_scan_triton

    kernel = gdn_scan_triton._scan_output_kernel
    for head_dim in (16, 32, 64, 128):
        kept = kernel.early_config_prune(kernel.configs, {}, V=head_dim)
        assert kept and all(config.kwargs["BV"] <= head_dim for config in kept), head_dim
    assert {config.kwargs["BV"] for config in kernel.configs} - {16, 32, 64} == set()  # the loop above saw them all
    assert len(kernel.early_config_prune(kernel.configs, {}, V=128)) == len(kernel.configs)


def test_the_gdn_kernels_tune_short_and_long_sequences_apart():
    """How the capture scan's and the conv's configurations rank depends on how much work each program gets: their
    autotuners key on a power of two of the length (`log2_bucket`: of the chunk count, of the rows), so a capture of
    32,768 tokens does not take the choice made at 1,000 (the CUDA tests) or a member's at 4,096."""
    pytest.importorskip("triton")
    from longstraw.kernels import gdn_conv_triton, gdn_scan_triton
    from longstraw.kernels.tuning import log2_bucket

    assert "CHUNKS_LOG2" in gdn_scan_triton._scan_output_kernel.keys
    conv = gdn_conv_triton
    for kernel in (
        conv._conv_split_normalized_kernel,
        conv._pre_activation_gradient_kernel,
        conv._conv_input_gradient_kernel,
    ):
        assert "ROWS_LOG2" in kernel.keys
    buckets = {count: log2_bucket(count) for count in (0, 1, 2, 16, 17, 512, 513)}
    assert buckets == {0: 0, 1: 0, 2: 1, 16: 4, 17: 5, 512: 9, 513: 10}


@pytest.mark.cuda
@pytest.mark.parametrize("value_dim", [128, 32])
def test_fused_capture_scan_on_cuda_is_as_close_to_the_recurrence_as_flas_forward(value_dim):
    """The capture's fused scan (`capture_scan("fused")`: fla's intra-chunk kernels, then the scan with each chunk's
    output inside it) at hybrid-1b's head shape (16 q/k heads, 32 value heads, dims 128; and value heads of 32,
    narrower than a tuning candidate's block) in bf16 from a state, 1,000 tokens (a ragged last chunk), q and k with
    unit rows: output and final state against the float64 token-by-token rule, norm-wise, within twice fla's own
    forward's error plus one bf16 rounding (the two round the states and the corrected values to bf16 where the same
    products read them)."""
    if not fla_available():
        pytest.skip("fla is not importable")
    q, k, v, g, beta, s0 = make_gdn_inputs(T=1000, Hk=16, Hv=32, Dk=128, Dv=value_dim, dtype=torch.float64)
    q, k = (torch.nn.functional.normalize(t, dim=-1) for t in (q, k))
    bf16 = [t.to(torch.bfloat16).cuda() for t in (q, k, v)] + [g.float().cuda(), beta.to(torch.bfloat16).cuda()]
    state = s0.float().cuda()
    reference = recurrent_gated_delta_rule(*(t.double() for t in bf16), state.double(), l2norm_qk=False)
    errors = {}
    for scan in gdn.CAPTURE_SCANS:
        with gdn.capture_scan(scan):
            out, final = chunk_gated_delta_rule_forward(*bf16, state, l2norm_qk=False)
        errors[scan] = [relative(a, b) for a, b in zip((out, final), reference)]
    for i, name in enumerate(("output", "state")):
        assert errors["fused"][i] <= 2 * errors["fla"][i] + EPS_BF16, (name, errors)


# ------------------------------------------------------------------------------------
# The differentiable rule replay runs: fla's kernels where checked, the torch chunk rule otherwise
# ------------------------------------------------------------------------------------


def test_differentiable_rule_off_cuda_is_the_torch_chunk_rule_bit_for_bit():
    inputs = make_gdn_inputs(T=70, dtype=torch.float32)
    for rule in gdn.RULES:
        with differentiable_rule(rule):
            ours = grads_of(gated_delta_rule, inputs)
        reference = grads_of(chunk_gated_delta_rule, inputs)
        assert all(
            torch.equal(a, b) for a, b in zip((ours[0], ours[1], *ours[2]), (reference[0], reference[1], *reference[2]))
        )
    with pytest.raises(ValueError, match="must be one of"):
        with differentiable_rule("fla"):
            pass


class _HalveGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


def _stand_in_for_fla(halve: str | None):
    """fla's call signature over the torch chunk rule; `halve` names an input whose gradient comes back halved
    (a miscompiled backward, as fla #640's was off by about half)."""

    def chunk(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        assert output_final_state and use_qk_l2norm_in_kernel and scale == q.shape[-1] ** -0.5
        named = dict(q=q, k=k, v=v, g=g, beta=beta)
        if halve:
            named[halve] = _HalveGradient.apply(named[halve])
        return chunk_gated_delta_rule(*named.values(), initial_state)

    return chunk


@pytest.mark.parametrize("halve", [None, "g", "beta", "k"])
def test_the_fla_backward_check_refuses_a_wrong_gradient(monkeypatch, halve):
    monkeypatch.setattr(gdn, "_load_fla", lambda: (_stand_in_for_fla(halve), (0, 6, 0)))
    monkeypatch.setattr(gdn, "_trusted", {})
    if halve is None:
        assert fla_backward_trusted(2, 4, 16, 8, torch.float32, "cpu")
    else:
        with pytest.warns(UserWarning, match=f"d{halve} "):
            assert not fla_backward_trusted(2, 4, 16, 8, torch.float32, "cpu")


def test_the_fla_backward_check_runs_at_its_first_callers_size_once_per_head_shape(monkeypatch):
    """fla's autotuner keeps its first call's choice whatever the length, so the check (whose backward is the first
    a process runs) takes its first caller's batch and whole 64-token chunks (3 to 128 of them, and a ragged tail
    of 29); a later caller of the same heads is answered without a second check."""
    seen = []
    stand_in = _stand_in_for_fla(None)

    def recording(q, *rest, **named):
        seen.append(tuple(q.shape[:2]))
        return stand_in(q, *rest, **named)

    monkeypatch.setattr(gdn, "_load_fla", lambda: (recording, (0, 6, 0)))
    monkeypatch.setattr(gdn, "_trusted", {})
    assert fla_backward_trusted(2, 4, 16, 8, torch.float32, "cpu", 3, 300)
    assert seen == [(3, 4 * 64 + 29)]
    assert fla_backward_trusted(2, 4, 16, 8, torch.float32, "cpu", 1, 5000)
    assert seen == [(3, 4 * 64 + 29)]
    assert fla_backward_trusted(2, 2, 16, 8, torch.float32, "cpu", 1, 10)
    assert fla_backward_trusted(1, 2, 16, 8, torch.float32, "cpu", 2, 1_000_000)
    assert seen == [(3, 4 * 64 + 29), (1, 3 * 64 + 29), (2, 128 * 64 + 29)]


def test_the_fla_backward_check_runs_inside_a_checkpointed_layer(monkeypatch):
    """The first GDN call of a process may come inside a checkpointed layer's forward (no grad, saved-tensor hooks
    that recompute the layer): the check runs there and the layer's backward still gives the plain gradient."""
    monkeypatch.setattr(gdn, "_load_fla", lambda: (_stand_in_for_fla(None), (0, 6, 0)))
    monkeypatch.setattr(gdn, "_trusted", {})
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    checks = []

    def layer(x):
        checks.append(fla_backward_trusted(2, 4, 16, 8, torch.float32, "cpu"))
        return (x.sin() * x).sum()

    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).backward()
    assert checks == [True, True]  # the forward, then the recompute (answered from the cache)
    torch.testing.assert_close(x.grad, x.detach().sin() + x.detach() * x.detach().cos(), rtol=0, atol=1e-12)


def test_kept_states_rule_hands_fla_backward_what_its_forward_made_and_its_gradients_to_the_inputs():
    """`_kept_states_autograd` with stand-ins for fla's functions (each returns tensors of its own): the forward's
    log2 decay (the cumsum at 1 / ln 2), w, A, the chunk states h and the corrected values reach the backward's
    functions by fla's names, none recomputed; the dv of `chunk_bwd_dv_local` goes through `bwd_dhu`, whose dv and
    `dqkwg`'s dw reach `prepare_wy_repr_bwd`; dk sums dqkwg's and the WY's, dg their sum taken back through the
    reverse cumsum; each gradient reaches its input in the input's dtype, the output comes in q's."""
    q, k, v, g, beta, state = make_gdn_inputs(T=7, dtype=torch.float32)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a strided view, as the projections may hand it over
    gen = torch.Generator().manual_seed(5)

    def like(t, dtype=None):
        return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(dtype or t.dtype)

    made, seen = {}, {}

    def cumsum(x, chunk_size, scale=None, reverse=False):
        seen["cumsum reverse" if reverse else "cumsum"] = (x, chunk_size, scale)
        return x * 10 if reverse else made.setdefault("g_log2", like(g))

    def record(name, *results):  # one result alone, several as a tuple, as fla's functions return them
        def fn(**kwargs):
            seen[name] = kwargs
            made[name] = tuple(like(t) for t in results)
            made[name + " as made"] = tuple(t.clone() for t in made[name])  # the backward adds into some in place
            return made[name] if len(results) > 1 else made[name][0]

        return fn

    fla = types.SimpleNamespace(
        chunk_local_cumsum=cumsum,
        RCP_LN2=1.4426950408889634,
        chunk_gated_delta_rule_fwd_intra=record("intra", k.repeat_interleave(2, 2), v, g),
        chunk_gated_delta_rule_fwd_h=record("fwd_h", state[:, :, :1], v, state),
        chunk_fwd_o=lambda **kwargs: seen.setdefault("fwd_o", kwargs) and made.setdefault("o", like(v, torch.float64)),
        chunk_bwd_dv_local=record("dv_local", v),
        chunk_gated_delta_rule_bwd_dhu=record("dhu", state[:, :, :1], state, v),
        chunk_bwd_dqkwg=record("dqkwg", q, k, k.repeat_interleave(2, 2), g),
        prepare_wy_repr_bwd=record("wy", k, v, beta, g),
    )
    xs = leaves((q, k, v, g, beta, state))
    out, final = gdn._kept_states_autograd(fla)(*xs, 0.25)
    w, u, A = made["intra"]
    h, v_new, final_made = made["fwd_h"]
    assert out.dtype == q.dtype and torch.equal(out, made["o"].to(q.dtype)) and final is final_made
    assert seen["cumsum"][1:] == (64, fla.RCP_LN2) and seen["intra"]["g"] is made["g_log2"]
    assert seen["intra"]["k"].is_contiguous() and torch.equal(seen["intra"]["k"], k)
    assert seen["fwd_h"]["w"] is w and seen["fwd_h"]["u"] is u and seen["fwd_h"]["output_final_state"]
    assert seen["fwd_o"]["v"] is v_new and seen["fwd_o"]["h"] is h and seen["fwd_o"]["scale"] == 0.25
    d_out, d_final = torch.randn_like(out), torch.randn_like(final)
    torch.autograd.backward((out, final), (d_out, d_final))
    (dv_local,) = made["dv_local"]
    dh, d_state, dv = made["dhu"]
    dq, dk, dw, dg = made["dqkwg"]
    dk_wy, dv_wy, dbeta, dg_wy = made["wy"]
    _, dk_made, _, dg_made = made["dqkwg as made"]
    assert torch.equal(seen["dv_local"]["do"], d_out) and torch.equal(seen["dhu"]["dht"], d_final)
    assert seen["dhu"]["w"] is w and seen["dhu"]["dv"] is dv_local and torch.equal(seen["dhu"]["h0"], state)
    assert seen["dqkwg"]["h"] is h and seen["dqkwg"]["v"] is v_new and seen["dqkwg"]["w"] is w
    assert seen["dqkwg"]["dh"] is dh and seen["dqkwg"]["dv"] is dv
    assert seen["wy"]["A"] is A and seen["wy"]["dw"] is dw and seen["wy"]["du"] is dv
    assert seen["cumsum reverse"][1] == 64
    expected = (dq, dk_made + dk_wy, dv_wy, (dg_made + dg_wy) * 10, dbeta, d_state)
    for leaf, e in zip(xs, expected):
        assert leaf.grad.dtype == leaf.dtype and torch.equal(leaf.grad, e.to(leaf.dtype))


@pytest.mark.cuda
def test_kept_states_rule_has_flas_gradients_on_cuda_at_hybrid_1bs_head_shape():
    """hybrid-1b's GDN heads in bf16, q and k with unit rows (as the conv leaves them, `l2norm_qk=False`), two
    sequences of 300 tokens from a state: under `differentiable_rule("kept")` the rule runs fla's kernels keeping
    w, the chunk states and the corrected values from its forward; its output is fla's whole rule's bit for bit (the
    same forward kernels) and its gradients are within one bf16 rounding of fla's (fla's backward recomputes w with
    another kernel than its forward's), and both are as close to the float64 recurrence (FLA_BACKWARD_TOLERANCE)."""
    if not fla_available():
        pytest.skip("fla is not importable")
    q, k, v, g, beta, state = make_gdn_inputs(T=300, Hk=16, Hv=32, Dk=128, Dv=128, dtype=torch.float64)
    q, k = (torch.nn.functional.normalize(t, dim=-1) for t in (q, k))
    bf16 = [t.to(torch.bfloat16).cuda() for t in (q, k, v)] + [
        g.float().cuda(),
        beta.bfloat16().cuda(),
        state.float().cuda(),
    ]
    assert fla_backward_trusted(16, 32, 128, 128, torch.bfloat16, str(bf16[0].device))
    with differentiable_rule("kept"):
        assert gdn._kept_states_apply(False) and not gdn._kept_states_apply(True)
        kept = grads_of(gated_delta_rule, bf16, l2norm_qk=False)
    fla = grads_of(gated_delta_rule, bf16, l2norm_qk=False)
    assert torch.equal(kept[0], fla[0]) and torch.equal(kept[1], fla[1])
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dstate"), kept[2], fla[2]):
        assert a.dtype == b.dtype and relative(a.double(), b.double()) <= EPS_BF16, name
    reference = grads_of(recurrent_gated_delta_rule, [t.double() for t in bf16], l2norm_qk=False)
    for name, ours, e in zip(("dq", "dk", "dv", "dg", "dbeta", "dstate"), kept[2], reference[2]):
        assert relative(ours.double(), e) < gdn.FLA_BACKWARD_TOLERANCE, name


@pytest.mark.cuda
def test_fla_differentiable_rule_matches_the_recurrence_on_cuda_at_hybrid_1bs_head_shape():
    """hybrid-1b's GDN heads (16 q/k heads, 32 value heads, dims 128) in bf16, two sequences of 300 tokens from a
    state: `gated_delta_rule` runs fla's kernels here (its backward passed this process's check) and its output
    and every gradient match the float64 token-by-token recurrence on the same bf16 values within bf16's rounding
    of the kernel's intermediates (norm-wise; fla #640's miscompile was off by about half)."""
    if not fla_available():
        pytest.skip("fla is not importable")
    inputs = make_gdn_inputs(T=300, Hk=16, Hv=32, Dk=128, Dv=128, dtype=torch.float64)
    bf16 = [t.to(torch.bfloat16).cuda() if i in (0, 1, 2, 4) else t.float().cuda() for i, t in enumerate(inputs)]
    assert fla_backward_trusted(16, 32, 128, 128, torch.bfloat16, str(bf16[0].device))
    ours = grads_of(gated_delta_rule, bf16)
    reference = grads_of(recurrent_gated_delta_rule, [t.double() for t in bf16])
    for name, a, b in zip(
        ("out", "state", "dq", "dk", "dv", "dg", "dbeta", "dstate"),
        (ours[0], ours[1], *ours[2]),
        (reference[0], reference[1], *reference[2]),
    ):
        error = ((a.double() - b).norm() / b.norm()).item()
        assert error < gdn.FLA_BACKWARD_TOLERANCE, (name, error)


# ------------------------------------------------------------------------------------
# Causal conv
# ------------------------------------------------------------------------------------


def make_conv_inputs(B=2, C=5, T=9, K=4, dtype=torch.float64, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x_BCT = torch.randn(B, C, T, generator=gen, dtype=torch.float64).to(dtype)
    w_CK = torch.randn(C, K, generator=gen, dtype=torch.float64).to(dtype)
    b_C = torch.randn(C, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    return x_BCT, w_CK, b_C


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_matches_hf_from_zero_state(activation, bias):
    x, w, b = make_conv_inputs(bias=bias)
    y, state = causal_conv1d(x, torch.zeros(2, 5, 3, dtype=x.dtype), w, b, activation)
    y_hf = HF_CONV_FN(x, w, b, activation=activation)
    torch.testing.assert_close(y, y_hf)
    torch.testing.assert_close(state, x[..., -3:])
    y_none, _ = causal_conv1d(x, None, w, b, activation)
    torch.testing.assert_close(y_none, y_hf)


def test_conv_matches_hf_update_single_token():
    """HF's cache keeps K columns; ours keeps the last K-1 of them."""
    x, w, b = make_conv_inputs(T=1)
    hf_state = torch.randn(2, 5, 4, dtype=x.dtype)
    ours_state = hf_state[..., 1:].clone()
    y_hf = HF_CONV_UPDATE(x, hf_state, w, b, "silu")  # updates hf_state in place
    y, new_state = causal_conv1d(x, ours_state, w, b, "silu")
    torch.testing.assert_close(y, y_hf)
    torch.testing.assert_close(new_state, hf_state[..., 1:])


@pytest.mark.parametrize("split", [0, 1, 2, 3, 5, 9])
def test_conv_split_equals_whole(split):
    x, w, b = make_conv_inputs(T=9)
    s0 = torch.randn(2, 5, 3, dtype=x.dtype)
    y_whole, s_whole = causal_conv1d(x, s0, w, b)
    y1, s1 = causal_conv1d(x[..., :split], s0, w, b)
    y2, s2 = causal_conv1d(x[..., split:], s1, w, b)
    assert s1.shape == (2, 5, 3)
    torch.testing.assert_close(torch.cat([y1, y2], dim=-1), y_whole)
    torch.testing.assert_close(s2, s_whole)


def test_conv_short_input_state():
    x, w, b = make_conv_inputs(T=1, K=4)
    s0 = torch.randn(2, 5, 3, dtype=x.dtype)
    _, s1 = causal_conv1d(x, s0, w, b)
    torch.testing.assert_close(s1, torch.cat([s0[..., 1:], x], dim=-1))


def test_conv_kernel_size_one():
    x, w, b = make_conv_inputs(K=1)
    y, state = causal_conv1d(x, torch.zeros(2, 5, 0, dtype=x.dtype), w, b)
    torch.testing.assert_close(y, HF_CONV_FN(x, w, b, activation="silu"))
    assert state.shape == (2, 5, 0)


def test_conv_gradcheck_state_x_weight_bias():
    x, w, b = (t.requires_grad_(True) for t in make_conv_inputs(B=1, C=2, T=3, K=4))
    s0 = torch.randn(1, 2, 3, dtype=torch.float64, requires_grad=True)

    def fn(x_, s_, w_, b_):
        return causal_conv1d(x_, s_, w_, b_, "silu")

    assert torch.autograd.gradcheck(fn, (x, s0, w, b), fast_mode=True)


def test_conv_bf16_dtypes():
    x, w, b = make_conv_inputs(dtype=torch.bfloat16)
    y, s = causal_conv1d(x, torch.zeros(2, 5, 3, dtype=torch.float32), w.float(), b.float())
    assert y.dtype == torch.bfloat16 and s.dtype == torch.bfloat16
    expected = HF_CONV_FN(x, w.float(), b.float(), activation="silu")
    close(y, expected, rtol=BF16_RTOL, atol=BF16_RTOL * float(expected.float().abs().max()), what="bf16 conv")


def _hf_conv_from_state(x_BCT, state_BCK1, w, b, activation="silu"):
    """HF's conv over [state, x] with the state's outputs dropped: the conv continued from `state`."""
    return HF_CONV_FN(torch.cat([state_BCK1, x_BCT], dim=-1), w, b, activation=activation)[..., state_BCK1.shape[-1] :]


@pytest.mark.parametrize("T", [1, 2, 9])
def test_conv_channels_last_off_cuda_matches_hf(T):
    x, w, b = make_conv_inputs(T=T)
    s0 = torch.randn(2, 5, 3, dtype=x.dtype)
    y_BTC, s1 = causal_conv1d_channels_last(x.transpose(1, 2).contiguous(), s0, w, b, "silu")
    torch.testing.assert_close(y_BTC.transpose(1, 2), _hf_conv_from_state(x, s0, w, b))
    torch.testing.assert_close(s1, torch.cat([s0, x], dim=-1)[..., -3:])


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(
    "change, message",
    [
        ({"activation": "gelu"}, "unsupported activation 'gelu'"),
        ({"weight": torch.zeros(4, 4, dtype=torch.float64)}, "weight has 4 channels, x has 5"),
        ({"state": torch.zeros(2, 5, 2, dtype=torch.float64)}, r"conv_state must be \(2, 5, 3\), got \(2, 5, 2\)"),
    ],
)
def test_conv_refuses_a_bad_activation_filter_or_state(channels_last, change, message):
    x, w, b = make_conv_inputs()
    args = {"state": torch.zeros(2, 5, 3, dtype=x.dtype), "weight": w, "activation": "silu", **change}
    conv = causal_conv1d_channels_last if channels_last else causal_conv1d
    with pytest.raises(ValueError, match=message):
        conv(x.transpose(1, 2) if channels_last else x, args["state"], args["weight"], b, args["activation"])


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 2, 3, 300])
def test_conv_channels_last_on_cuda_matches_hf_in_float64(T):
    """fla's Triton conv (hybrid-1b's 8,192 channels, K=4) in bf16 from a state, forward and backward (x, weight,
    bias and state; a loss on the output and on the new state) against HF's conv in float64 on the same bf16 values.
    fla sums in float32 and rounds the output once to bf16 (half of EPS_BF16 norm-wise); its backward also reads the
    pre-activation rounded to bf16 and rounds each gradient once: BF16_RTOL norm-wise covers both roundings."""
    from longstraw.kernels.causal_conv import _load_fla_conv

    if _load_fla_conv() is None:
        pytest.skip("fla is not importable")
    gen = torch.Generator().manual_seed(0)
    C, K = 8192, 4
    x, s0, w, b = (
        torch.randn(*shape, generator=gen, dtype=torch.float64).to(torch.bfloat16).cuda()
        for shape in ((2, T, C), (2, C, K - 1), (C, K), (C,))
    )
    out_weight = torch.randn(2, T, C, generator=gen, dtype=torch.float64).cuda()
    state_weight = torch.randn(2, C, K - 1, generator=gen, dtype=torch.float64).cuda()

    def run(conv, *inputs):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        y, s1 = conv(*leaves)
        ((y.double() * out_weight).sum() + (s1.double() * state_weight).sum()).backward()
        return [y.detach(), s1.detach()] + [leaf.grad for leaf in leaves]

    ours = run(lambda *a: causal_conv1d_channels_last(*a, activation="silu"), x, s0, w, b)
    reference = run(
        lambda x_, s_, w_, b_: (
            _hf_conv_from_state(x_.transpose(1, 2), s_, w_, b_).transpose(1, 2),
            torch.cat([s_, x_.transpose(1, 2)], dim=-1)[..., -(K - 1) :],
        ),
        *(t.double() for t in (x, s0, w, b)),
    )
    for name, a, e in zip(("y", "state", "dx", "dstate", "dweight", "dbias"), ours, reference):
        assert a.dtype == torch.bfloat16, name
        assert relative(a, e) <= BF16_RTOL, (name, relative(a, e))


def _split_normalized_reference(x_BTC, s0, w, b, key_dim, head_dim):
    """HF's conv continued from `s0` in float64, split into q, k, v heads, q and k divided by their l2 norm (HF's
    `l2norm`, eps 1e-6), and the new state: what `conv_split_heads` computes."""
    x64, s64, w64, b64 = (t.double() for t in (x_BTC, s0, w, b))
    y = _hf_conv_from_state(x64.transpose(1, 2), s64, w64, b64).transpose(1, 2)
    B, T, C = y.shape
    q, k, v = (t.reshape(B, T, -1, head_dim) for t in y.split([key_dim, key_dim, C - 2 * key_dim], -1))
    q, k = (hf.l2norm(t, dim=-1, eps=1e-6) for t in (q, k))
    state = torch.cat([s64, x64.transpose(1, 2)], dim=-1)[..., -(w.shape[1] - 1) :]
    return q, k, v, state


@pytest.mark.parametrize("T", [1, 2, 9])
def test_conv_split_normalized_off_cuda_is_hfs_conv_split_and_norm(T):
    """Off CUDA: the conv, the split into heads and the l2 norm of q and k, as HF computes them, in float64."""
    gen = torch.Generator().manual_seed(T)
    key_dim, head_dim, C = 8, 4, 24
    x, s0, w, b = (
        torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((2, T, C), (2, C, 3), (C, 4), (C,))
    )
    ours = conv_split_heads(x, s0, w, b, key_dim, head_dim, head_dim, "silu")
    for name, a, e in zip(("q", "k", "v", "state"), ours, _split_normalized_reference(x, s0, w, b, key_dim, head_dim)):
        assert (a.is_contiguous() or name == "state") and a.shape == e.shape, name
        torch.testing.assert_close(a, e, rtol=TOL64, atol=TOL64)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 3, 300])
def test_conv_split_normalized_on_cuda_is_one_rounding_of_the_float64_result(T):
    """The fused Triton kernel (hybrid-1b's GDN widths: q and k 2,048, v 4,096, heads of 128, K=4) without grad, in
    bf16 from a state: each output is the float64 conv, split and norm rounded once to bf16. Its float32 work (K
    products and the bias, SiLU, a sum of 128 squares, a square root) errs by a few EPS32; bound: half a bf16
    spacing of each value, plus (K + D + 8) EPS32 of the row's largest, times SAFETY. The plain path (the conv
    rounded to bf16 before the norm: two roundings) is shown beside; flipped taps are outside the bound."""
    from tolerances import EPS32, SAFETY

    gen = torch.Generator().manual_seed(T)
    key_dim, D, C, K = 2048, 128, 8192, 4
    x, s0, w, b = (
        torch.randn(*shape, generator=gen, dtype=torch.float64).to(torch.bfloat16).cuda()
        for shape in ((1, T, C), (1, C, K - 1), (C, K), (C,))
    )
    with torch.no_grad():
        ours = conv_split_heads(x, s0, w, b, key_dim, D, D, "silu")
    expected = _split_normalized_reference(x, s0, w, b, key_dim, D)
    flipped = _split_normalized_reference(x, s0, w.flip(-1), b, key_dim, D)
    with torch.no_grad(), torch.enable_grad():
        plain = conv_split_heads(x, s0, w.requires_grad_(True), b, key_dim, D, D, "silu")  # the composition
    w.requires_grad_(False)
    for name, a, e, p, f in zip(("q", "k", "v"), ours, expected, plain, flipped):
        assert a.dtype == torch.bfloat16 and a.is_contiguous() and a.shape == e.shape, name
        bound = SAFETY * (EPS_BF16 / 2 * e.abs() + (K + D + 8) * EPS32 * e.abs().amax(-1, keepdim=True))
        error, plain_error = (a.double() - e).abs(), (p.detach().double() - e).abs()
        assert (error <= bound).all(), f"{name}: {(error / bound).max().item():.3g} of bound (plain path: "
        f"{(plain_error / bound).max().item():.3g})"
        assert ((f - e).abs() > bound).any(), f"{name}: the bound cannot tell flipped taps"
    assert torch.equal(ours[3], expected[3].to(torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 3, 300])
def test_conv_split_normalized_gradient_on_cuda_is_one_rounding_of_the_float64_gradient(T):
    """Replay's call (x alone needing a gradient: frozen filters and bias, a captured state) at hybrid-1b's GDN
    widths, bf16: the fused backward (`conv_split_normalized_backward_triton`, which must run) against autograd
    through HF's conv and l2 norm in float64, on the same bf16 values and a loss on q, k and v whose weights bf16
    holds exactly (so the incoming gradients are not rounded). It recomputes the pre-activations and the norms in
    float32: per tap a sum of 128 squares and of 128 products (a few (D + 16) EPS32 of the largest), K taps, dx
    rounded once; bound half a bf16 spacing of each value plus (K (D + 16) + 8) EPS32 of the largest, times SAFETY.
    The plain path's error is shown beside; flipped taps fall outside the bound."""
    from unittest import mock

    from tolerances import EPS32, SAFETY

    from longstraw.kernels import gdn_conv_triton

    gen = torch.Generator().manual_seed(T)
    key_dim, D, C, K = 2048, 128, 8192, 4
    x, s0, w, b = (
        torch.randn(*shape, generator=gen, dtype=torch.float64).to(torch.bfloat16).cuda()
        for shape in ((1, T, C), (1, C, K - 1), (C, K), (C,))
    )
    loss_weights = [
        torch.randn(1, T, heads, D, generator=gen, dtype=torch.float64).to(torch.bfloat16).double().cuda()
        for heads in (key_dim // D, key_dim // D, (C - 2 * key_dim) // D)
    ]

    def dx(split, x_, *rest):
        leaf = x_.detach().clone().requires_grad_(True)
        sum((t.double() * weight).sum() for t, weight in zip(split(leaf, *rest)[:3], loss_weights)).backward()
        return leaf.grad

    def ours(x_, s_, w_, b_):
        return conv_split_heads(x_, s_, w_, b_, key_dim, D, D, "silu")

    def reference(x_, s_, w_, b_):
        return _split_normalized_reference(x_, s_, w_, b_, key_dim, D)

    backward = gdn_conv_triton.conv_split_normalized_backward_triton
    with mock.patch.object(gdn_conv_triton, "conv_split_normalized_backward_triton", wraps=backward) as kernel:
        fused = dx(ours, x, s0, w, b)
    assert kernel.call_count == 1 and fused.dtype == torch.bfloat16
    plain = dx(ours, x, s0, w.clone().requires_grad_(True), b)  # a filter needing a gradient: the composition
    expected, flipped = (dx(reference, *(t.double() for t in (x, s0, taps, b))) for taps in (w, w.flip(-1)))
    bound = SAFETY * (EPS_BF16 / 2 * expected.abs() + (K * (D + 16) + 8) * EPS32 * expected.abs().max())
    error, plain_error = (fused.double() - expected).abs(), (plain.double() - expected).abs()
    assert (error <= bound).all(), (
        f"{(error / bound).max().item():.3g} of bound (plain path: {(plain_error / bound).max().item():.3g})"
    )
    assert ((flipped - expected).abs() > bound).any(), "the bound cannot tell flipped taps"


# ------------------------------------------------------------------------------------
# Nothing modifies its inputs
# ------------------------------------------------------------------------------------


def _snapshot(ts):
    return [None if t is None else t.detach().clone() for t in ts]


def _assert_unchanged(ts, snaps):
    for t, s in zip(ts, snaps):
        if t is not None:
            assert torch.equal(t, s)


@pytest.mark.parametrize(
    "fn",
    [chunk_gated_delta_rule, recurrent_gated_delta_rule, chunk_gated_delta_rule_forward],
    ids=["chunk", "recurrent", "forward"],
)
def test_gdn_does_not_modify_inputs(fn):
    inputs = leaves(make_gdn_inputs(T=21, dtype=torch.float32))
    snaps = _snapshot(inputs)
    out, state = fn(*inputs)
    if out.requires_grad:
        (out.sum() + state.sum()).backward()
    _assert_unchanged(inputs, snaps)
    # The returned state is a new tensor, not the initial state itself.
    assert state.data_ptr() != inputs[5].data_ptr()


def test_conv_does_not_modify_inputs():
    x, w, b = (t.requires_grad_(True) for t in make_conv_inputs())
    s0 = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    snaps = _snapshot([x, s0, w, b])
    y, s1 = causal_conv1d(x, s0, w, b)
    (y.sum() + s1.sum()).backward()
    _assert_unchanged([x, s0, w, b], snaps)
