"""The capacity search (doubling, bisection, time limit, comparison steps) on a fake probe: the
search logic is what is tested here; one real probe at the end, and whole searches in the default pipeline
(baselines) and on the GPU."""

import pytest
import torch

from longstraw.kinds import capacity, resolve_point
from longstraw.kinds.common import Progress

FITS_UP_TO = 5000  # the fake device holds prompts up to this length


def _search(point):
    return capacity.run(point, torch.device(point.model.device), Progress())


def _point(**capacity_settings):
    return resolve_point(
        {
            "name": "cap",
            "kind": "capacity",
            "mode": "naive",
            "model": {"preset": "tiny-llama", "device": "cuda"},
            "capacity": {"min_length": 1024, "max_length": 65536, "granularity": 256, **capacity_settings},
        }
    )


@pytest.fixture
def fake(monkeypatch):
    """A probe that fits below FITS_UP_TO, and a clock that advances 10 s per probe."""
    calls, clock = [], {"now": 0.0}

    def probe(point, length, workdir):
        calls.append((point.mode, length))
        clock["now"] += 10.0
        ok = length <= FITS_UP_TO
        return {
            "status": "ok" if ok else "oom",
            "wall_seconds": 10.0,
            "metrics": {"peak_allocated_bytes": length * 1000, "phase_summary": {"replay": {"seconds": 9.0}}}
            if ok
            else None,
            "peak_allocated_bytes": None if ok else 123,
        }

    monkeypatch.setattr(capacity, "_probe", probe)
    monkeypatch.setattr(capacity.time, "perf_counter", lambda: clock["now"])
    return calls


def test_search_doubles_then_bisects_to_the_granularity(fake):
    m = _search(_point())
    lengths = [length for _, length in fake]
    assert lengths[:4] == [1024, 2048, 4096, 8192]  # doubling until the first oom
    assert m["largest_fitting"] <= FITS_UP_TO < m["first_failing"]
    assert m["first_failing"] - m["largest_fitting"] <= 256
    assert not m["search_stopped_on_time_limit"] and not m["search_capped_at_max_length"]
    assert [p["status"] for p in m["probes"]] == [
        "ok" if p["prompt_length"] <= FITS_UP_TO else "oom" for p in m["probes"]
    ]


def test_time_limit_stops_the_search_and_says_so(fake):
    m = _search(_point(time_limit_seconds=25))
    # probes start at t = 0, 10, 20 (< 25); none starts after
    assert [length for _, length in fake] == [1024, 2048, 4096]
    assert m["largest_fitting"] == 4096 and m["first_failing"] is None
    assert m["search_stopped_on_time_limit"] and not m["search_capped_at_max_length"]


def test_comparison_modes_run_at_the_largest_fitting_length(fake):
    m = _search(_point(time_limit_seconds=15, compare_modes=["replay", "hold_all"]))
    assert m["largest_fitting"] == 2048
    assert fake[-2:] == [("replay", 2048), ("hold_all", 2048)]
    assert {mode: c["status"] for mode, c in m["comparison_at_largest_fitting"].items()} == {
        "replay": "ok",
        "hold_all": "ok",
    }


def test_cpu_search_needs_an_emulated_ceiling(fake):
    point = _point()
    point.model.device = "cpu"
    with pytest.raises(ValueError, match="ceiling_bytes"):
        _search(point)


def test_one_member_probes_are_refused_on_cpu(fake):
    point = _point(ceiling_bytes=1 << 28)
    point.model.device = "cpu"
    point.responses.probe_members = 1
    with pytest.raises(ValueError, match="probe_members"):
        _search(point)
    assert fake == []  # refused before any probe ran


def test_comparison_steps_run_all_members(fake, monkeypatch):
    seen = []
    monkeypatch.setattr(
        capacity,
        "_probe",
        lambda point, length, workdir: (
            seen.append((point.mode, point.responses.probe_members))
            or {"status": "ok", "metrics": {"peak_allocated_bytes": 1, "phase_summary": {}}}
        ),
    )
    point = _point(max_length=2048, compare_modes=["replay"])
    point.responses.probe_members = 1
    _search(point)
    assert ("naive", 1) in seen and ("replay", None) in seen


def test_a_real_probe_is_a_step_point_run_in_a_fresh_process(tmp_path):
    """What the search's probes run: the capacity point as a step at the probed length, in a process of its
    own, its result recording a step's config (no capacity section: a step holds none)."""
    point = resolve_point(
        {
            "name": "cap",
            "kind": "capacity",
            "model": {"preset": "tiny-llama", "device": "cpu"},
            "grpo": {"num_generations": 2},
            "responses": {"length": 4},
            "capacity": {"min_length": 32, "max_length": 64, "granularity": 32, "ceiling_bytes": 1 << 30},
        }
    )
    result = capacity._probe(point, 48, tmp_path)
    assert result["status"] == "ok", result.get("error")
    assert result["kind"] == "step" and result["config"]["prompt"]["length"] == 48
    assert "capacity" not in result["config"] and result["config"]["grpo"]["num_generations"] == 2
