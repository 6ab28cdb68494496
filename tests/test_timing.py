"""`longstraw.measure.timing`: `seconds_per_call` (warm-up calls untimed, the timed calls' mean), `seconds_each` and
`graph_replay_seconds` (CUDA)."""

import time

import pytest
import torch

from longstraw.measure.timing import graph_replay_seconds, seconds_each, seconds_per_call


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


@pytest.mark.cuda
def test_a_graph_replays_the_recorded_work_once_a_repeat():
    counter = torch.zeros((), device="cuda")
    seconds = graph_replay_seconds(lambda: counter.add_(1), repeats=5, warmup=2)
    # the warm-ups, then one untimed replay and the five timed ones; recording the graph runs nothing
    assert counter.item() == 2 + 1 + 5
    assert 0 < seconds < 0.01
