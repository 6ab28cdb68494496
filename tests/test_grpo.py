"""Tests for longstraw.core.grpo: hand-computed values, serial == batch equivalence, bad input."""

import dataclasses
import math

import pytest
import torch
from grpo_reference import batch_loss
from tolerances import float32_tolerance

from longstraw.config.grpo import GROUP_SIZE
from longstraw.core.grpo import (
    GRPOConfig,
    ResponseStats,
    group_advantages,
    k3_kl,
    per_token_loss,
    response_loss,
    response_stats,
    summarize_stats,
    token_weights,
)

LN2 = math.log(2.0)


def _clip_fraction(logp, old, advantage, cfg) -> float:
    s = response_stats(logp, old, None, advantage, cfg)
    return (s.num_low_clipped + s.num_high_clipped) / s.num_tokens


# float32 results of a few operations (<= 2 roundings apart from the float64 hand values) on values of order 1
HAND32 = float32_tolerance(roundings=2)


def _close(actual, expected, tol=HAND32):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, rtol=tol, atol=tol), (actual.tolist(), expected.tolist())


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------


def test_config_defaults_and_normalisation():
    c = GRPOConfig()  # the group size's one default, a point's and a train config's too
    assert (c.num_generations, c.beta, c.epsilon, c.epsilon_high) == (GROUP_SIZE, 0.0, 0.2, 0.2)
    assert c.loss_type == "dapo" and c.scale_rewards == "group" and c.max_completion_length is None
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"
    assert GRPOConfig(epsilon=0.1, epsilon_high=0.28).epsilon_high == 0.28
    assert GRPOConfig(epsilon=0.1).epsilon_high == 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.beta = 1.0


def test_the_group_size_has_one_default():
    from longstraw.config.point import PointConfig
    from longstraw.config.train import TrainConfig
    from longstraw.training.rollout import SamplingConfig

    sizes = (
        GRPOConfig().num_generations,
        PointConfig().grpo.num_generations,
        TrainConfig().grpo.num_generations,
        SamplingConfig().num_generations,
    )
    assert sizes == (GROUP_SIZE,) * 4


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_generations=0), "num_generations"),
        (dict(num_generations=2.0), "num_generations"),
        (dict(num_generations=True), "num_generations"),
        (dict(beta=-0.1), "beta"),
        (dict(beta=float("nan")), "beta"),
        (dict(epsilon=-0.1), "epsilon"),
        (dict(epsilon=1.0), "epsilon"),
        (dict(epsilon_high=-0.2), "epsilon_high"),
        (dict(loss_type="ppo"), "loss_type"),
        (dict(scale_rewards="batch"), "scale_rewards"),
        (dict(scale_rewards="yes"), "scale_rewards"),
        (dict(max_completion_length=0), "max_completion_length"),
        (dict(loss_type="dr_grpo"), "max_completion_length"),
    ],
)
def test_config_rejects_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GRPOConfig(**kwargs)


# --------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------


def test_group_advantages_hand_computed():
    # rewards [0, 2, 4]: mean 2, deviations [-2, 0, 2]
    # unbiased var = (4 + 0 + 4) / (3 - 1) = 4 -> std 2   (population std would be 1.633)
    # A = dev / (2 + 1e-4) = +-2 / 2.0001 = +-0.99995000250
    adv = group_advantages([0.0, 2.0, 4.0], "group")
    assert adv.dtype == torch.float32
    _close(adv, [-0.9999500025, 0.0, 0.9999500025])
    _close(group_advantages([0.0, 2.0, 4.0], True), [-0.9999500025, 0.0, 0.9999500025])

    # no scaling: just the deviations
    _close(group_advantages([0.0, 2.0, 4.0], "none"), [-2.0, 0.0, 2.0])
    _close(group_advantages(torch.tensor([0.0, 2.0, 4.0]), False), [-2.0, 0.0, 2.0])

    # G=4, rewards [1, 0, 0, 0]: mean 0.25, deviations [0.75, -0.25, -0.25, -0.25]
    # sum of squares 0.5625 + 3 * 0.0625 = 0.75, unbiased var 0.75 / 3 = 0.25 -> std 0.5
    # A = [0.75, -0.25, -0.25, -0.25] / 0.5001 = [1.49970006, -0.49990002, ...]
    _close(
        group_advantages([1, 0, 0, 0], "group", num_generations=4),
        [1.4997000600, -0.4999000200, -0.4999000200, -0.4999000200],
    )

    # G=2, rewards [3, 1]: deviations [1, -1], unbiased var 2 -> std sqrt(2)
    s = math.sqrt(2.0) + 1e-4
    _close(group_advantages([3.0, 1.0]), [1.0 / s, -1.0 / s])

    # tied rewards -> zero advantage (std 0, numerator 0); G == 1 -> 0
    _close(group_advantages([1.0, 1.0, 1.0]), [0.0, 0.0, 0.0])
    _close(group_advantages([5.0]), [0.0])


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")])
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("inf")])
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages([1.0, 2.0, 3.0], num_generations=4)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages([])
    with pytest.raises(ValueError, match="1-D"):
        group_advantages([[1.0, 2.0]])
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages([1.0, 2.0], "batch")


# --------------------------------------------------------------------------------------
# k3 KL
# --------------------------------------------------------------------------------------


def test_k3_kl_hand_computed_value_and_grad():
    # d = ref - logp in {0, ln2, -ln2}
    # kl = e^d - d - 1 = [0, 2 - ln2 - 1, 1/2 + ln2 - 1] = [0, 0.30685282, 0.19314718]
    # d kl / d logp = 1 - e^d = [0, -1, 0.5]
    logp = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.0, -1.0 + LN2, -1.0 - LN2], dtype=torch.float64, requires_grad=True)
    kl = k3_kl(logp, ref)
    _close(kl, [0.0, 0.3068528194, 0.1931471806], tol=1e-9)
    kl.sum().backward()
    _close(logp.grad, [0.0, -1.0, 0.5], tol=1e-9)
    assert ref.grad is None  # reference is a constant
    _close(k3_kl(logp, ref).mean(), (0.3068528194 + 0.1931471806) / 3, tol=1e-9)


# --------------------------------------------------------------------------------------
# Clipped surrogate
# --------------------------------------------------------------------------------------

CLIP_CFG = dict(num_generations=2, epsilon=0.2, epsilon_high=0.28)  # ratio kept in [0.8, 1.28]


def _logp_for_ratios(ratios):
    # old_logp = 0, logp = ln(ratio)  =>  exp(logp - old) = ratio
    logp = torch.tensor([math.log(r) for r in ratios], dtype=torch.float64, requires_grad=True)
    return logp, torch.zeros(len(ratios), dtype=torch.float64)


def test_clipped_loss_positive_advantage():
    # A = +2, clip range [0.8, 1.28]; loss = -min(r*A, clip(r)*A); d loss / d logp = -A*r unless clipped
    #   r=1.0 : min(2.0, 2.0)  = 2.0  -> loss -2.0 , grad -2.0
    #   r=1.1 : min(2.2, 2.2)  = 2.2  -> loss -2.2 , grad -2.2
    #   r=1.5 : min(3.0, 2.56) = 2.56 -> loss -2.56, grad 0    (high-clipped)
    #   r=0.5 : min(1.0, 1.6)  = 1.0  -> loss -1.0 , grad -1.0 (pessimistic branch, not clipped)
    cfg = GRPOConfig(**CLIP_CFG)
    logp, old = _logp_for_ratios([1.0, 1.1, 1.5, 0.5])
    loss = per_token_loss(logp, old, None, 2.0, cfg)
    _close(loss, [-2.0, -2.2, -2.56, -1.0], tol=1e-9)
    loss.sum().backward()
    _close(logp.grad, [-2.0, -2.2, 0.0, -1.0], tol=1e-9)
    assert logp.grad[2].item() == 0.0
    assert _clip_fraction(logp, old, 2.0, cfg) == 0.25


def test_clipped_loss_negative_advantage():
    # A = -2, clip range [0.8, 1.28]
    #   r=1.0 : min(-2.0, -2.0)  = -2.0 -> loss 2.0, grad 2.0
    #   r=1.5 : min(-3.0, -2.56) = -3.0 -> loss 3.0, grad 3.0 (pessimistic branch, not clipped)
    #   r=0.5 : min(-1.0, -1.6)  = -1.6 -> loss 1.6, grad 0   (low-clipped)
    #   r=0.9 : min(-1.8, -1.8)  = -1.8 -> loss 1.8, grad 1.8
    cfg = GRPOConfig(**CLIP_CFG)
    logp, old = _logp_for_ratios([1.0, 1.5, 0.5, 0.9])
    loss = per_token_loss(logp, old, None, torch.tensor(-2.0), cfg)
    _close(loss, [2.0, 3.0, 1.6, 1.8], tol=1e-9)
    loss.sum().backward()
    _close(logp.grad, [2.0, 3.0, 0.0, 1.8], tol=1e-9)
    assert logp.grad[2].item() == 0.0


def test_clip_stats_and_summary():
    cfg = GRPOConfig(**CLIP_CFG)
    lp_pos, old_pos = _logp_for_ratios([1.0, 1.1, 1.5, 0.5])  # 1 high-clipped (1.5)
    lp_neg, old_neg = _logp_for_ratios([1.0, 1.5, 0.5, 0.9])  # 1 low-clipped (0.5)
    ref = torch.tensor([0.0, LN2, 0.0, 0.0], dtype=torch.float64)
    s_pos = response_stats(lp_pos, old_pos, None, 2.0, cfg)
    s_neg = response_stats(lp_neg, old_neg, None, -2.0, cfg)
    assert s_pos == ResponseStats(4, 0, 1, None)
    assert s_neg == ResponseStats(4, 1, 0, None)
    summary = summarize_stats([s_pos, s_neg])
    assert summary == {
        "num_tokens": 8.0,
        "clip_ratio/low_mean": 1 / 8,
        "clip_ratio/high_mean": 1 / 8,
        "clip_ratio/region_mean": 2 / 8,
    }
    # with a reference: logp = [0, ln1.1, ln1.5, ln0.5] vs ref; just check it is the k3 sum
    s = response_stats(lp_pos, old_pos, ref, 2.0, cfg)
    _close(s.kl_sum, k3_kl(lp_pos.detach(), ref).sum().item(), tol=1e-12)
    assert "kl" in summarize_stats([s])


def test_on_policy_with_kl_hand_computed():
    # old = None -> ratio 1: surrogate = -A; plus beta * k3 with d = ref - logp
    # token 0: d = ln2 -> -2 + 0.1 * 0.30685282 = -1.96931472; grad -2 + 0.1 * (1 - 2)   = -2.1
    # token 1: d = 0   -> -2 + 0                = -2.0       ; grad -2 + 0               = -2.0
    cfg = GRPOConfig(num_generations=2, beta=0.1)
    logp = torch.tensor([-1.0, -3.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.0 + LN2, -3.0], dtype=torch.float64)
    loss = per_token_loss(logp, None, ref, 2.0, cfg)
    _close(loss, [-1.9693147181, -2.0], tol=1e-9)
    loss.sum().backward()
    _close(logp.grad, [-2.1, -2.0], tol=1e-9)


def test_bf16_logp_is_upcast():
    cfg = GRPOConfig(num_generations=2)
    logp = torch.tensor([-1.0, -2.0], dtype=torch.bfloat16, requires_grad=True)
    loss = per_token_loss(logp, None, None, 1.0, cfg)
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert logp.grad.dtype == torch.bfloat16
    _close(logp.grad.float(), [-1.0, -1.0])


# --------------------------------------------------------------------------------------
# Token weights and tiny hand-computed group losses
# --------------------------------------------------------------------------------------


def test_token_weights_hand_computed():
    L = [2, 3, 5]  # G = 3, sum 10
    _close(token_weights(L, GRPOConfig(num_generations=3, loss_type="grpo")), [1 / 6, 1 / 9, 1 / 15], 1e-15)
    _close(token_weights(L, GRPOConfig(num_generations=3, loss_type="bnpo")), [0.1, 0.1, 0.1], 1e-15)
    _close(token_weights(L, GRPOConfig(num_generations=3, loss_type="dapo")), [0.1, 0.1, 0.1], 1e-15)
    _close(
        token_weights(torch.tensor(L), GRPOConfig(num_generations=3, loss_type="dr_grpo", max_completion_length=8)),
        [1 / 24, 1 / 24, 1 / 24],
        1e-15,
    )


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        # G=2, lengths [1, 2], on-policy, A = [+1, -1] -> per-token loss = -A = [-1 | +1, +1]
        ("grpo", 0.0),  # mean(-1/1, 2/2) = 0
        ("bnpo", 1 / 3),  # (-1 + 1 + 1) / 3
        ("dapo", 1 / 3),
        ("dr_grpo", 0.125),  # (-1 + 1 + 1) / (2 * 4)
    ],
)
def test_group_loss_hand_computed(loss_type, expected):
    cfg = GRPOConfig(num_generations=2, loss_type=loss_type, max_completion_length=4)
    logps = [torch.tensor([-0.5]), torch.tensor([-0.7, -0.2])]
    adv = [1.0, -1.0]
    w = token_weights([1, 2], cfg)
    serial = sum(response_loss(lp, None, None, a, wi, cfg) for lp, a, wi in zip(logps, adv, w))
    _close(serial, expected, tol=1e-7)
    _close(batch_loss(logps, None, None, torch.tensor(adv), cfg), expected, tol=1e-7)


# --------------------------------------------------------------------------------------
# Serial replay == one big batch (value and gradient), every loss_type
# --------------------------------------------------------------------------------------

LENGTHS = [3, 7, 1, 12]


def _group(seed):
    g = torch.Generator().manual_seed(seed)
    G = len(LENGTHS)
    vocab = 11
    # a tiny "policy": shared logits table + per-position bias, so responses share parameters
    W = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.5
    toks = [torch.randint(0, vocab, (L,), generator=g) for L in LENGTHS]
    pos_bias = [torch.randn(L, vocab, generator=g, dtype=torch.float64) * 0.3 for L in LENGTHS]
    # old / ref differ enough from the policy that clipping is active on both sides
    old = [torch.randn(L, generator=g, dtype=torch.float64) * 0.5 for L in LENGTHS]
    ref = [torch.randn(L, generator=g, dtype=torch.float64) * 0.4 for L in LENGTHS]
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])  # A: [+, -, -, +]
    return G, W, toks, pos_bias, old, ref, rewards


def _logp(W, toks, bias):
    return torch.log_softmax(W[None, :] + bias, dim=-1).gather(1, toks[:, None]).squeeze(1)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_serial_replay_equals_batch(loss_type, beta):
    G, W0, toks, bias, old_d, ref, rewards = _group(seed=0)
    cfg = GRPOConfig(
        num_generations=G,
        beta=beta,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type=loss_type,
        max_completion_length=16,
    )
    adv = group_advantages(rewards, cfg.scale_rewards, num_generations=G)
    weights = token_weights(LENGTHS, cfg)  # fixed before any replay

    # --- serial: replay one response at a time, backward each, grads accumulate in W ---
    W_s = W0.clone().requires_grad_(True)
    serial_total = 0.0
    serial_logp_grads = []
    stats = []
    for i in range(G):
        logp_i = _logp(W_s, toks[i], bias[i])
        old_i = logp_i.detach() + old_d[i]
        logp_i.retain_grad()
        li = response_loss(logp_i, old_i, ref[i], adv[i], weights[i], cfg)
        li.backward()
        serial_total += li.item()
        serial_logp_grads.append(logp_i.grad.clone())
        stats.append(response_stats(logp_i, old_i, ref[i], adv[i], cfg))

    # --- batch: all responses at once, padded + masked ---
    W_b = W0.clone().requires_grad_(True)
    logps_b = [_logp(W_b, toks[i], bias[i]) for i in range(G)]
    for lp in logps_b:
        lp.retain_grad()
    olds_b = [logps_b[i].detach() + old_d[i] for i in range(G)]
    total_b = batch_loss(logps_b, olds_b, ref if beta else None, adv, cfg)
    total_b.backward()

    _close(serial_total, total_b.item(), tol=1e-12)
    for i in range(G):
        _close(serial_logp_grads[i], logps_b[i].grad, tol=1e-12)
    _close(W_s.grad, W_b.grad, tol=1e-12)
    assert W_b.grad.abs().sum() > 0

    # the example really exercises clipping on both sides
    summary = summarize_stats(stats)
    assert summary["clip_ratio/low_mean"] > 0 and summary["clip_ratio/high_mean"] > 0
    assert summary["num_tokens"] == sum(LENGTHS)


def test_serial_replay_equals_batch_float32():
    G, W0, toks, bias, old_d, ref, rewards = _group(seed=1)
    W0, bias, old_d, ref = W0.float(), [b.float() for b in bias], [o.float() for o in old_d], [r.float() for r in ref]
    cfg = GRPOConfig(num_generations=G, beta=0.04, loss_type="grpo")
    adv = group_advantages(rewards, "none")
    w = token_weights(LENGTHS, cfg)
    W_s = W0.clone().requires_grad_(True)
    serial = 0.0
    for i in range(G):
        lp = _logp(W_s, toks[i], bias[i])
        li = response_loss(lp, lp.detach() + old_d[i], ref[i], adv[i], w[i], cfg)
        assert li.dtype == torch.float32
        li.backward()
        serial += li.item()
    W_b = W0.clone().requires_grad_(True)
    lps = [_logp(W_b, toks[i], bias[i]) for i in range(G)]
    tb = batch_loss(lps, [lp.detach() + o for lp, o in zip(lps, old_d)], ref, adv, cfg)
    tb.backward()
    _close(serial, tb.item(), tol=1e-5)
    _close(W_s.grad, W_b.grad, tol=1e-5)


def test_empty_response_contributes_nothing():
    cfg = GRPOConfig(num_generations=2, loss_type="grpo")
    logps = [torch.tensor([-1.0, -2.0]), torch.zeros(0)]
    w = token_weights([2, 0], cfg)
    _close(w, [0.25, 0.5])
    serial = sum(response_loss(lp, None, None, a, wi, cfg) for lp, a, wi in zip(logps, [1.0, -1.0], w))
    _close(serial, -0.5)  # mean(-1 (mean of [-1,-1]), 0)
    _close(batch_loss(logps, None, None, [1.0, -1.0], cfg), -0.5)


# --------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------


def test_per_token_loss_bad_input():
    cfg = GRPOConfig(num_generations=2)
    kl_cfg = GRPOConfig(num_generations=2, beta=0.1)
    lp = torch.zeros(3)
    with pytest.raises(ValueError, match="length mismatch"):
        per_token_loss(lp, torch.zeros(2), None, 1.0, cfg)
    with pytest.raises(ValueError, match="length mismatch"):
        per_token_loss(lp, None, torch.zeros(4), 1.0, kl_cfg)
    with pytest.raises(ValueError, match="length mismatch"):
        k3_kl(lp, torch.zeros(2))
    with pytest.raises(ValueError, match="ref_logp"):
        per_token_loss(lp, None, None, 1.0, kl_cfg)
    with pytest.raises(ValueError, match="1-D"):
        per_token_loss(torch.zeros(2, 3), None, None, 1.0, cfg)
    with pytest.raises(ValueError, match="advantage"):
        per_token_loss(lp, None, None, float("nan"), cfg)
    with pytest.raises(ValueError, match="advantage"):
        per_token_loss(lp, None, None, torch.ones(2), cfg)
    with pytest.raises(ValueError, match="floating"):
        per_token_loss(torch.zeros(3, dtype=torch.long), None, None, 1.0, cfg)
    with pytest.raises(ValueError, match="weight"):
        response_loss(lp, None, None, 1.0, float("inf"), cfg)
    with pytest.raises(ValueError, match="weight"):
        response_loss(lp, None, None, 1.0, -0.5, cfg)


def test_token_weights_bad_input():
    cfg = GRPOConfig(num_generations=3, loss_type="dr_grpo", max_completion_length=4)
    with pytest.raises(ValueError, match="num_generations"):
        token_weights([1, 2], cfg)
    with pytest.raises(ValueError, match="max_completion_length"):
        token_weights([1, 2, 5], cfg)
    with pytest.raises(ValueError, match=">= 0"):
        token_weights([1, -2, 3], cfg)
    with pytest.raises(ValueError, match="integer"):
        token_weights([1, 2.5, 3], cfg)


def test_group_advantages_leave_unscorable_rewards_out_as_trl_does():
    # [NaN, 3, NaN, 1]: the scored rewards 3 and 1 have mean 2 and unbiased std sqrt(2); NaN -> advantage 0
    s = math.sqrt(2.0) + 1e-4
    _close(group_advantages([float("nan"), 3.0, float("nan"), 1.0], nan_unscorable=True), [0.0, 1.0 / s, 0.0, -1.0 / s])
    _close(group_advantages([float("nan"), 3.0, float("nan"), 1.0], "none", nan_unscorable=True), [0.0, 1.0, 0.0, -1.0])
    _close(group_advantages([float("nan"), 5.0], nan_unscorable=True), [0.0, 0.0])  # one scored: zero advantage
    _close(group_advantages([float("nan")] * 3, nan_unscorable=True), [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="finite or NaN"):
        group_advantages([1.0, float("inf")], nan_unscorable=True)
