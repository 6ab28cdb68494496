"""`longstraw.measure.timing`: `seconds_per_call` (warm-up calls untimed, the timed calls' mean) and `seconds_each`."""

import time

import torch

from longstraw.measure.timing import seconds_each, seconds_per_call


def test_the_mean_of_the_timed_calls_after_the_warm_up():
    calls = []

    def fn():
        calls.append(time.perf_counter())
        time.sleep(0.3 if len(calls) <= 2 else 0.001)  # the two warm-up calls are slow

    seconds = seconds_per_call(fn, torch.device("cpu"), repeats=5, warmup=2)
    assert len(calls) == 7
    assert 0.001 <= seconds < 0.1  # counted, the warm-ups' 0.6 s would make the mean 0.12 s or more


def test_each_call_timed_apart():
    sleeps = iter([0.05, 0.0, 0.0])
    seconds = seconds_each(lambda: time.sleep(next(sleeps)), torch.device("cpu"), repeats=3)
    assert len(seconds) == 3 and seconds[0] >= 0.05 and max(seconds[1:]) < 0.05
