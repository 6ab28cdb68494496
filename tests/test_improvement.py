"""The learning statistic against a hand computation."""

import math

import pytest

from longstraw.training.improvement import paired_gain, per_prompt_means


def test_paired_gain_by_hand():
    trained = {0: 0.50, 1: 0.75, 2: 0.25, 3: 1.00}
    untrained = {0: 0.25, 1: 0.25, 2: 0.25, 3: 0.50, 9: 1.0}  # prompt 9 was not visited by both
    g = paired_gain(trained, untrained)
    # d = [0.25, 0.5, 0.0, 0.5]: mean 0.3125; sample var = sum((d - m)^2) / 3 = 0.171875 / 3
    assert g["prompts"] == 4 and g["gain"] == pytest.approx(0.3125)
    assert g["standard_error"] == pytest.approx(math.sqrt(0.171875 / 3 / 4))  # 0.11968
    assert g["reached"] is False  # 0.3125 < 3 x 0.1197
    assert (g["trained_mean"], g["untrained_mean"]) == pytest.approx((0.625, 0.3125))
    assert paired_gain({0: 1.0, 1: 0.9, 2: 1.0}, {0: 0.0, 1: 0.1, 2: 0.0})["reached"] is True


def test_per_prompt_means_pool_a_prompts_steps_and_samples():
    steps = [
        {"step": 0, "prompt": 0, "rewards": [0.0, 1.0]},
        {"step": 1, "prompt": 0, "rewards": [1.0, 1.0]},
        {"step": 2, "prompt": 1, "rewards": [0.0, 0.0]},
        {"step": 3, "prompt": 1, "rewards": [1.0, 0.0]},
    ]
    assert per_prompt_means(steps) == {0: 0.75, 1: 0.25}
    assert per_prompt_means(steps, first_step=3) == {1: 0.5}
    # first visits: each prompt's first step only, and no prompt whose first step is before first_step
    assert per_prompt_means(steps, first_visit=True) == {0: 0.5, 1: 0.0}
    assert per_prompt_means(steps, first_step=1, first_visit=True) == {1: 0.0}
    assert per_prompt_means(steps[::-1], first_step=3, first_visit=True) == {}
    with pytest.raises(ValueError, match="at least 2 shared prompts"):
        paired_gain({0: 1.0}, {0: 0.0})


def test_paired_change_counts_examples_gained_and_lost_with_the_exact_sign_test():
    """Hand-computed: 6 gained, 0 lost: 2 * (1/2)^6; 5 and 1: 2 * (1 + 6) / 2^6; 3 and 1: 2 * (1 + 4) / 2^4; 2 and 3:
    capped at 1; none changed: 1. Only the examples both scored count; rewards other than 0/1 are refused."""
    from longstraw.training.improvement import paired_change

    before = [0.0] * 6 + [1.0] * 2 + [0.0] * 4
    after = [1.0] * 6 + [1.0] * 2 + [0.0] * 4
    assert paired_change(before, after) == {"examples": 12, "gained": 6, "lost": 0, "p": 2 / 64}
    assert paired_change([0.0] * 5 + [1.0], [1.0] * 5 + [0.0])["p"] == 2 * 7 / 64
    assert paired_change([0, 0, 0, 1, 1], [1, 1, 1, 0, 1.0])["p"] == 2 * 5 / 16
    assert paired_change([0, 0, 1, 1, 1], [1, 1, 0, 0, 0.0])["p"] == 1.0
    assert paired_change([1.0, 0.0, 1.0], [1.0, 0.0]) == {"examples": 2, "gained": 0, "lost": 0, "p": 1.0}
    with pytest.raises(ValueError, match="0 or 1"):
        paired_change([0.5], [1.0])
