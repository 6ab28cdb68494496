"""PhaseRecorder's count of Triton kernels compiled inside a phase, and the step note that flags it: a
first call's compilation or autotuning (fla's: ~45 s on a fresh H200) must not pass for the step's work."""

from longstraw.kinds.step import notes
from longstraw.measure.memory import _merge, triton_cache_entries


def test_cache_entries_count_the_folders_of_tritons_cache(tmp_path, monkeypatch):
    for name in ("kernel-a", "kernel-b"):
        (tmp_path / name).mkdir()
    (tmp_path / "stray-file").write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert triton_cache_entries() == 2
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "absent"))
    assert triton_cache_entries() is None


def test_repeated_phases_add_up_their_compiled_kernels_and_keep_peaks():
    merged = _merge(
        {"seconds": 1.0, "triton_cache_entries_added": 2, "peak_allocated_bytes": 5},
        {"seconds": 2.5, "triton_cache_entries_added": 3, "peak_allocated_bytes": 4},
    )
    assert merged == {"seconds": 3.5, "triton_cache_entries_added": 5, "peak_allocated_bytes": 5, "count": 2}


def test_a_step_phase_that_compiled_kernels_gets_a_note():
    row = {
        "point": "replay-8192",
        "capture_triton_cache_entries_added": 3,
        "replay_triton_cache_entries_added": 0,
        "weights_triton_cache_entries_added": 7,
        "capture_seconds": 45.7,
    }
    [note] = notes(row, [])
    assert note.startswith("replay-8192: Triton compiled or autotuned kernels inside the timed step (capture 3 new")
    assert "weights" not in note and "replay 0" not in note
    assert notes({**row, "capture_triton_cache_entries_added": 0}, []) == []
