"""gpt-oss (gpt_oss): attention sinks in the kernels against hand references, and what the family refuses of its
configs. Capture, replay, exact mode and sampling against HF, on tiny-gpt-oss beside tiny-gemma3:
tests/test_sliding.py (where `test_hf_output_depends_on_the_sinks` shows an attention without them would fail).
"""

import math
from types import SimpleNamespace

import pytest
import torch
from tolerances import TOL64, above, close, max_abs

from longstraw import capture
from longstraw.kernels.paged_attention import decode_attention, paged_attention, reference_attention
from longstraw.kernels.window_attention import window_attention
from longstraw.models import build_model

PROMPT_LEN, WINDOW = 40, 8  # tiny-gpt-oss's window


def _ids(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# ---- the sinks in the kernels, against a hand reference


def _rnd(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()


def hand_reference(q, k, v, allowed_RN, scale, sinks):
    """Per query head: scores over the allowed keys plus the head's sink as one more column, softmax, the sink's
    column dropped (a key of value 0): HF's eager attention, written out. k, v: [B, K, N, D], every key."""
    B, H, R, _ = q.shape
    G = H // k.shape[1]
    heads = []
    for h in range(H):
        scores = torch.einsum("brd,bnd->brn", q[:, h], k[:, h // G]) * scale
        scores = scores.masked_fill(~allowed_RN, -math.inf)
        column = sinks[h].expand(B, R, 1)
        p = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        heads.append(torch.einsum("brn,bnd->brd", p, v[:, h // G]))
    return torch.stack(heads, dim=1)


def _causal_allowed(R, P, window=None):
    query_pos, key_pos = torch.arange(P, P + R)[:, None], torch.arange(P + R)[None]
    allowed = key_pos <= query_pos
    return allowed if window is None else allowed & (key_pos > query_pos - window)


def _assert_same_gradients(ours, expected, inputs, g, what):
    weights = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((ours * weights).sum(), inputs)
    want = torch.autograd.grad((expected * weights).sum(), inputs)
    for a, b in zip(got, want):
        close(a, b, rtol=TOL64, atol=TOL64 * float(b.abs().max()) if b.numel() else 0.0, what=what)
    above(float(got[-1].abs().max()), 1e-3, "the sinks' gradient")  # the sinks come last: theirs is there


@pytest.mark.numerics
@pytest.mark.parametrize("B,H,K,R,P,block,shared", [(1, 4, 2, 5, 13, 4, False), (3, 4, 1, 6, 9, 4, True)])
def test_paged_attention_with_sinks_equals_the_hand_reference(B, H, K, R, P, block, shared):
    """Forward and gradients (q, prefix and live K/V, sinks) in float64, GQA, prefix blocks, and B sequences over
    one prompt's pages (batch 1) folded over them."""
    g = torch.Generator().manual_seed(0)
    D = 8
    q, k_live, v_live = _rnd(g, B, H, R, D), _rnd(g, B, K, R, D), _rnd(g, B, K, R, D)
    k_prefix, v_prefix = _rnd(g, 1 if shared else B, K, P, D), _rnd(g, 1 if shared else B, K, P, D)
    sinks = (1 + torch.randn(H, generator=g, dtype=torch.float64)).requires_grad_()
    ours = paged_attention(q, k_prefix, v_prefix, k_live, v_live, scale=0.3, block_size=block, sinks=sinks)
    k = torch.cat([k_prefix.expand(B, -1, -1, -1), k_live], dim=2)
    v = torch.cat([v_prefix.expand(B, -1, -1, -1), v_live], dim=2)
    expected = hand_reference(q, k, v, _causal_allowed(R, P), 0.3, sinks)
    close(ours, expected, rtol=TOL64, atol=TOL64, what="paged attention with sinks")
    prefix = (t.expand(B, -1, -1, -1) for t in (k_prefix, v_prefix))
    reference = reference_attention(q, *prefix, k_live, v_live, 0.3, sinks=sinks)
    close(reference, expected, rtol=TOL64, atol=TOL64, what="reference_attention with sinks")
    _assert_same_gradients(ours, expected, (q, k_prefix, v_prefix, k_live, v_live, sinks), g, "paged gradient")
    unsunk = paged_attention(q, k_prefix, v_prefix, k_live, v_live, scale=0.3, block_size=block)
    above(max_abs(unsunk, expected), 1e-2, "what the sinks change")


@pytest.mark.numerics
@pytest.mark.parametrize("prefix,live,query_block", [(0, 11, None), (7, 5, None), (7, 20, 3)])
def test_window_attention_with_sinks_equals_the_hand_reference(prefix, live, query_block):
    g = torch.Generator().manual_seed(1)
    B, H, K, D = 2, 4, 2, 8
    q, k_live, v_live = _rnd(g, B, H, live, D), _rnd(g, B, K, live, D), _rnd(g, B, K, live, D)
    k_prefix, v_prefix = _rnd(g, 1, K, prefix, D), _rnd(g, 1, K, prefix, D)
    sinks = (1 + torch.randn(H, generator=g, dtype=torch.float64)).requires_grad_()
    ours = window_attention(
        q, k_prefix, v_prefix, k_live, v_live, scale=0.3, window=WINDOW, query_block=query_block, sinks=sinks
    )
    k, v = (torch.cat([p.expand(B, -1, -1, -1), t], dim=2) for p, t in ((k_prefix, k_live), (v_prefix, v_live)))
    expected = hand_reference(q, k, v, _causal_allowed(live, prefix, WINDOW), 0.3, sinks)
    close(ours, expected, rtol=TOL64, atol=TOL64, what="window attention with sinks")
    _assert_same_gradients(ours, expected, (q, k_prefix, v_prefix, k_live, v_live, sinks), g, "window gradient")


@pytest.mark.numerics
def test_decode_attention_with_sinks_equals_the_hand_reference():
    """3 sequences, one query each, over one shared prompt (batch 1) and their own 4 keys."""
    g = torch.Generator().manual_seed(2)
    B, H, K, P, N, D = 3, 4, 2, 9, 4, 8
    q, k_own, v_own = _rnd(g, B, H, 1, D), _rnd(g, B, K, N, D), _rnd(g, B, K, N, D)
    k_shared, v_shared = _rnd(g, 1, K, P, D), _rnd(g, 1, K, P, D)
    sinks = 1 + torch.randn(H, generator=g, dtype=torch.float64)
    ours = decode_attention(q, k_shared, v_shared, k_own, v_own, scale=0.3, block_size=4, sinks=sinks)
    k, v = (torch.cat([s.expand(B, -1, -1, -1), o], dim=2) for s, o in ((k_shared, k_own), (v_shared, v_own)))
    with torch.no_grad():
        expected = hand_reference(q, k, v, torch.ones(1, P + N, dtype=torch.bool), 0.3, sinks)
    close(ours, expected, rtol=TOL64, atol=TOL64, what="decode attention with sinks")


@pytest.mark.numerics
def test_no_sinks_is_what_a_sink_of_minus_infinity_gives():
    """sinks=None is plain attention: a sink of score -inf (no weight) changes nothing."""
    g = torch.Generator().manual_seed(3)
    q, k_live, v_live, k_prefix, v_prefix = _rnd(g, 1, 4, 5, 8), *(_rnd(g, 1, 2, n, 8) for n in (5, 5, 9, 9))
    never = torch.full((4,), -math.inf, dtype=torch.float64)
    plain = paged_attention(q, k_prefix, v_prefix, k_live, v_live, scale=0.3)
    close(plain, paged_attention(q, k_prefix, v_prefix, k_live, v_live, scale=0.3, sinks=never), TOL64, TOL64)
    close(plain, reference_attention(q, k_prefix, v_prefix, k_live, v_live, 0.3), TOL64, TOL64)


@pytest.mark.parametrize(
    "sinks,message",
    [(torch.zeros(3), r"one floating-point logit per query head \(4,\), got torch.float32 of shape \(3,\)"),
     (torch.zeros(4, dtype=torch.long), r"one floating-point logit per query head \(4,\), got torch.int64")],
)  # fmt: skip
def test_sinks_that_are_not_one_logit_per_query_head_are_refused(sinks, message):
    q, k = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 2, 8)
    with pytest.raises(ValueError, match="paged_attention: sinks must be " + message):
        paged_attention(q, k, k, k, k, scale=0.3, sinks=sinks)
    with pytest.raises(ValueError, match="window_attention: sinks must be " + message):
        window_attention(q, k[:, :, :0], k[:, :, :0], k, k, scale=0.3, window=WINDOW, sinks=sinks)


# ---- refusals, before any work


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 150_000.0}), "rope_type 'dynamic'"),
        (dict(layer_types=["sliding_attention", "chunked_attention"] * 2), r"layer_types \['chunked_attention'\]"),
        (dict(sliding_window=None), "sliding layers need sliding_window >= 1, got None"),
    ],
)
def test_configs_hf_computes_otherwise_are_refused(overrides, message):
    model = build_model("tiny-gpt-oss", seed=1, **overrides)
    with pytest.raises(ValueError, match="gpt_oss config: " + message):
        capture(model, _ids(PROMPT_LEN, 0))


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({}, r"WindowKV \(sliding-window layers\) has no context-parallel form"),
        (dict(layer_types=["full_attention"] * 4), r"attention sinks \(gpt-oss\) have no context-parallel form"),
    ],
)
def test_a_context_parallel_capture_is_refused_before_any_rank_is_reached(overrides, message):
    model = build_model("tiny-gpt-oss", seed=1, **overrides)
    cp = SimpleNamespace(world=2, rank=0, device=torch.device("cpu"), is_last=False)  # no rank is ever reached
    with pytest.raises(ValueError, match=message):
        capture(model, _ids(PROMPT_LEN, 0), cp=cp)
