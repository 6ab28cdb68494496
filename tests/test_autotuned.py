"""`longstraw.measure.autotuned.autotuned_choice`: what a Triton autotuner chose, read from a stand-in that holds what
`triton.runtime.autotuner.Autotuner` keeps after tuning (its configurations, the chosen one, each one's timings)."""

from types import SimpleNamespace

import pytest

from longstraw.measure.autotuned import autotuned_choice

triton = pytest.importorskip("triton")


def _configs():
    return [
        triton.Config({"BV": 16}, num_warps=4, num_stages=2),
        triton.Config({"BV": 32}, num_warps=8, num_stages=3),
        triton.Config({"BV": 64}, num_warps=8, num_stages=2),
    ]


def test_the_chosen_configuration_and_each_candidate_fastest_first():
    slow, fast, middle = _configs()
    # do_bench's quantiles as Triton stores them: the median first
    timings = {slow: [0.9, 0.8, 1.0], fast: [0.3, 0.25, 0.35], middle: [0.5, 0.45, 0.55]}
    kernel = SimpleNamespace(configs=[slow, fast, middle], best_config=fast, configs_timings=timings)
    assert autotuned_choice(kernel) == {
        "chosen": {"BV": 32, "num_warps": 8, "num_stages": 3},
        "candidates": [
            {"BV": 32, "num_warps": 8, "num_stages": 3, "ms": 0.3},
            {"BV": 64, "num_warps": 8, "num_stages": 2, "ms": 0.5},
            {"BV": 16, "num_warps": 4, "num_stages": 2, "ms": 0.9},
        ],
    }


def test_nothing_when_the_kernel_never_ran_or_had_one_configuration():
    configs = _configs()
    assert autotuned_choice(SimpleNamespace(configs=configs)) is None  # not run: no best_config yet
    assert autotuned_choice(SimpleNamespace(configs=configs[:1], best_config=configs[0])) is None
