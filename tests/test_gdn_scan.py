"""longstraw.kernels.gdn_scan: shard transitions of the gated delta rule against the token-by-token recurrence
(CPU, float64)."""

from __future__ import annotations

import pytest
import torch
from tolerances import float32_tolerance, within

from longstraw.kernels.gdn import _l2norm, chunk_gated_delta_rule, recurrent_gated_delta_rule
from longstraw.kernels.gdn_scan import apply_transition, identity_transition, incoming_states, shard_transition

pytestmark = pytest.mark.numerics

TOL = 1e-10  # float64 throughout: ~1e5 times the differences measured, far below one float32 rounding
T = 37
SPLITS = [[13, 24], [5, 19, 13], [1, 30, 6]]  # uneven shards, one shorter than a kernel chunk


def _inputs(B=2, Hk=2, Hv=4, Dk=8, Dv=6, seed=0):
    """GQA-style value heads (Hv = 2 Hk), Dk != Dv; a slow decay so the earlier shards still matter at the end."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = rnd(B, T, Hk, Dk), rnd(B, T, Hk, Dk), rnd(B, T, Hv, Dv)
    g = -0.1 * torch.rand(B, T, Hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, Hv, generator=gen, dtype=torch.float64)
    return (q, k, v, g, beta), 0.5 * rnd(B, Hv, Dk, Dv)


def _shard(inputs, a, b):
    return [t[:, a:b] for t in inputs]


def _bounds(sizes):
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


def _rel(actual, expected):
    """max |actual - expected| over max |expected| (0 where both are zero: the state entering shard 0)."""
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("sizes", SPLITS, ids=lambda s: "-".join(map(str, s)))
def test_incoming_states_are_the_serial_states_at_the_shard_boundaries(sizes, with_state):
    inputs, s0 = _inputs()
    s0 = s0 if with_state else None
    bounds = _bounds(sizes)
    transitions = [shard_transition(*_shard(inputs, a, b), chunk_size=4) for a, b in bounds]
    states = incoming_states(transitions, s0)
    assert len(states) == len(sizes) and all(s.dtype == torch.float64 for s in states)
    for (a, _), state in zip(bounds, states):
        _, expected = recurrent_gated_delta_rule(*_shard(inputs, 0, a), s0)
        within(_rel(state, expected), TOL, f"state entering position {a}")
    # each shard run from its incoming state gives the serial outputs and, at the end, the final state
    out, final = recurrent_gated_delta_rule(*inputs, s0)
    outs = []
    for (a, b), state in zip(bounds, states):
        o, end = chunk_gated_delta_rule(*_shard(inputs, a, b), state, chunk_size=4)
        outs.append(o)
    within(_rel(torch.cat(outs, dim=1), out), TOL)
    within(_rel(end, final), TOL)
    within(_rel(apply_transition(transitions[-1], states[-1]), final), TOL)


def test_the_transition_is_the_product_of_the_token_maps_and_the_state_from_zero():
    """A = M_T ... M_1 with M_t = exp(g_t) (I - beta_t k_t k_t^T) (k l2-normalised, q/k head h // 2 for
    value head h), C = the end state from zero; and the rule from any S0 ends at A S0 + C."""
    (q, k, v, g, beta), s0 = _inputs()
    a, c = shard_transition(q, k, v, g, beta, chunk_size=5)
    k_BHTD = _l2norm(k.repeat_interleave(2, dim=2).transpose(1, 2))
    expected = torch.eye(k.shape[-1], dtype=torch.float64).expand(*a.shape).clone()
    for t in range(T):
        kt = k_BHTD[:, :, t]
        eye = torch.eye(k.shape[-1], dtype=torch.float64)
        m = g[:, t].exp()[..., None, None] * (eye - beta[:, t, :, None, None] * kt[..., :, None] * kt[..., None, :])
        expected = m @ expected
    within(_rel(a, expected), TOL)
    within(_rel(c, recurrent_gated_delta_rule(q, k, v, g, beta)[1]), TOL)
    within(_rel(a @ s0 + c, recurrent_gated_delta_rule(q, k, v, g, beta, s0)[1]), TOL)


def test_a_transition_carried_over_calls_is_the_whole_runs():
    """A chunked caller (the sharded capture) carries (A, C) from one call to the next."""
    inputs, _ = _inputs()
    whole = shard_transition(*inputs)
    carried = None
    for a, b in _bounds([3, 11, 1, 22]):
        carried = shard_transition(*_shard(inputs, a, b), carried, chunk_size=4)
    for x, y in zip(carried, whole):
        within(_rel(x, y), TOL)


def test_no_tokens_is_the_identity_and_float32_stays_float32():
    inputs, _ = _inputs()
    a, c = shard_transition(*_shard(inputs, 0, 0))
    eye, zero = identity_transition(2, 4, 8, 6, torch.float64)
    assert torch.equal(a, eye) and torch.equal(c, zero)
    a32, c32 = shard_transition(*[t.float() for t in inputs])
    a64, c64 = shard_transition(*inputs)
    assert a32.dtype == c32.dtype == torch.float32
    # float32 against float64: T token maps, each a Dk-long reduction, rounded T times (tests/tolerances.py)
    tol = float32_tolerance(T, 8)
    within(_rel(a32.double(), a64), tol, "float32 transition A")
    within(_rel(c32.double(), c64), tol, "float32 transition C")
    assert incoming_states([]) == []


@pytest.mark.cuda
def test_on_cuda_fla_transitions_at_the_gpu_presets_width_equal_the_torch_kernels():
    """fla's Triton kernel (capture's path on CUDA) run with Dk + Dv value columns (256 at hybrid-1b's and
    the 27B shape's 128 + 128) gives the torch kernel's transition, and the composed states equal the serial
    run's; float32 inputs, as the capture feeds the rule. fla multiplies in TF32 (10-bit mantissas): on the
    H200 the two differed by 2.4e-3 of the largest entry (A's entries shrink to ~1e-5 over 300 tokens of
    decay), so the bound is 1e-2: it catches a wrong identity or layout, not fla's rounding."""
    from longstraw.kernels.gdn import fla_available

    if not fla_available():
        pytest.skip("fla is not importable")
    gen = torch.Generator().manual_seed(3)
    B, Tn, Hk, Hv, D = 1, 700, 2, 4, 128
    rnd = lambda *s: torch.randn(*s, generator=gen).cuda()  # noqa: E731
    q, k, v = rnd(B, Tn, Hk, D), rnd(B, Tn, Hk, D), rnd(B, Tn, Hv, D)
    g = (-0.05 * torch.rand(B, Tn, Hv, generator=gen)).cuda()
    beta = torch.rand(B, Tn, Hv, generator=gen).cuda()
    inputs = (q, k, v, g, beta)
    for a, b in _bounds([300, 400]):
        fast = shard_transition(*_shard(inputs, a, b), use_fla=True)
        slow = shard_transition(*_shard(inputs, a, b), use_fla=False)
        for x, y in zip(fast, slow):
            assert _rel(x.double(), y.double()) < 1e-2
    transitions = [shard_transition(*_shard(inputs, a, b), use_fla=True) for a, b in _bounds([300, 400])]
    _, serial = chunk_gated_delta_rule(*_shard(inputs, 0, 300))
    assert _rel(incoming_states(transitions)[1].double(), serial.double()) < 1e-2
