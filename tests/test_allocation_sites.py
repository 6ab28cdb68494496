"""The peak breakdown by allocation site (`longstraw.measure.allocation_sites`): hand-built allocator
traces with hand-computed peaks, the site a stack is credited to, and the recorder's no-op off CUDA."""

import pytest
import torch

from longstraw.measure import allocation_sites
from longstraw.measure.allocation_sites import AllocationSites, default_site, peak_breakdown

X = [{"filename": "/repo/longstraw/training/replay.py", "name": "forward", "line": 10}]
Y = [{"filename": "/env/site-packages/peft/tuners/lora/layer.py", "name": "forward", "line": 20}]
X_SITE, Y_SITE = "longstraw/training/replay.py:forward:10", "peft/tuners/lora/layer.py:forward:20"


def alloc(addr, size, frames=None):
    event = {"action": "alloc", "addr": addr, "size": size, "stream": 0}
    return event if frames is None else {**event, "frames": frames}


def free(addr, size, action="free_completed"):
    return {"action": action, "addr": addr, "size": size, "stream": 0}


def snapshot(*events):
    return {"segments": [], "device_traces": [list(events)]}


def by_site(result):
    return {entry["site"]: (entry["bytes"], entry["count"]) for entry in result["sites"]}


def test_peak_is_the_largest_live_total_not_the_last():
    # A(100, x) + B(50, y) = 150 live; after free A and C(70, x) only 120
    trace = [alloc(1, 100, X), alloc(2, 50, Y), free(1, 100, "free_requested"), free(1, 100), alloc(3, 70, X)]
    result = peak_breakdown(snapshot(*trace))
    assert result["peak_traced_bytes"] == 150
    assert by_site(result) == {X_SITE: (100, 1), Y_SITE: (50, 1)}
    assert result["other_bytes"] == 0 and result["events"] == 5


def test_memory_is_held_until_free_completed():
    # B's free is requested (a stream still uses it) but completes only after C: 100 + 50 + 70 live
    trace = [alloc(1, 100, X), alloc(2, 50, Y), free(2, 50, "free_requested"), alloc(3, 70, X), free(2, 50)]
    result = peak_breakdown(snapshot(*trace))
    assert result["peak_traced_bytes"] == 220
    assert by_site(result) == {X_SITE: (170, 2), Y_SITE: (50, 1)}


def test_free_requested_releases_when_the_trace_has_no_completions():
    trace = [alloc(1, 100, X), free(1, 100, "free_requested"), alloc(2, 30, Y), alloc(3, 40, Y)]
    result = peak_breakdown(snapshot(*trace))
    assert result["peak_traced_bytes"] == 100
    assert by_site(result) == {X_SITE: (100, 1)}


def test_free_of_an_untraced_block_is_ignored():
    # address 9 was allocated before recording began
    trace = [alloc(1, 100, X), free(9, 500), alloc(2, 50, Y)]
    result = peak_breakdown(snapshot(*trace))
    assert result["peak_traced_bytes"] == 150 and result["baseline_freed_bytes"] == 0


def test_baseline_frees_move_the_peak_to_where_allocated_bytes_peak():
    # net over the start: +100 (A), -400 (baseline 9 freed), -250 (B): the peak is right after A
    trace = [alloc(1, 100, X), free(9, 500), alloc(2, 150, Y)]
    result = peak_breakdown(snapshot(*trace), baseline_addrs={9})
    assert result["peak_traced_bytes"] == 100 and result["baseline_freed_bytes"] == 0
    assert by_site(result) == {X_SITE: (100, 1)}
    # a baseline block freed before the phase allocates more than it
    trace = [free(9, 50), alloc(1, 100, X), alloc(2, 150, Y)]
    result = peak_breakdown(snapshot(*trace), baseline_addrs={9})
    assert result["peak_traced_bytes"] == 250 and result["baseline_freed_bytes"] == 50


def test_no_allocations_peak_at_the_start():
    result = peak_breakdown(snapshot(free(9, 500)), baseline_addrs={9})
    assert result == {"peak_traced_bytes": 0, "baseline_freed_bytes": 0, "sites": [], "other_bytes": 0, "events": 1}


def test_top_sites_keep_the_largest_and_the_rest_is_other():
    def site(i):
        return [{"filename": f"/r/longstraw/m{i}.py", "name": "f", "line": 1}]

    trace = [alloc(i, 10 * (i + 1), site(i)) for i in range(5)]
    result = peak_breakdown(snapshot(*trace), top=2)
    assert [entry["site"] for entry in result["sites"]] == ["longstraw/m4.py:f:1", "longstraw/m3.py:f:1"]
    assert result["other_bytes"] == 10 + 20 + 30
    assert result["peak_traced_bytes"] == 150


def test_events_without_frames_are_unknown():
    trace = [alloc(1, 100), alloc(2, 50, []), alloc(3, 70, X)]
    assert by_site(peak_breakdown(snapshot(*trace))) == {"unknown": (150, 2), X_SITE: (70, 1)}


def test_custom_site_function_and_other_devices():
    trace = [alloc(1, 100, X), alloc(2, 50, Y)]
    snap = {"segments": [], "device_traces": [[], trace]}
    result = peak_breakdown(snap, device=1, site_of=lambda frames: frames[0]["line"])
    assert by_site(result) == {10: (100, 1), 20: (50, 1)}


def test_default_site_prefers_the_innermost_project_frame_over_torch():
    frames = [
        {"filename": "/env/site-packages/torch/nn/functional.py", "name": "linear", "line": 5},
        {"filename": "/env/site-packages/torch/nn/modules/linear.py", "name": "forward", "line": 6},
        *Y,
        *X,
    ]
    assert default_site(frames) == Y_SITE


def test_default_site_credits_the_deepest_package_folder():
    # a checkout named longstraw holding a venv: the frame is transformers', not longstraw's
    frames = [
        {
            "filename": "/home/u/longstraw/.venv/lib/site-packages/transformers/models/qwen3/modeling.py",
            "name": "forward",
            "line": 7,
        }
    ]
    assert default_site(frames) == "transformers/models/qwen3/modeling.py:forward:7"
    assert (
        default_site([{"filename": "/home/u/longstraw/longstraw/models/x.py", "name": "f", "line": 1}])
        == "longstraw/models/x.py:f:1"
    )


def test_default_site_falls_back_to_checkpoint_then_innermost():
    torch_frame = {"filename": "/env/site-packages/torch/nn/functional.py", "name": "linear", "line": 5}
    checkpoint = {"filename": "/env/site-packages/torch/utils/checkpoint.py", "name": "recompute_fn", "line": 9}
    assert default_site([torch_frame, checkpoint]) == "torch/utils/checkpoint.py:recompute_fn:9"
    assert default_site([torch_frame]) == "torch/nn/functional.py:linear:5"
    assert default_site([{"filename": "/tmp/script.py", "name": "main", "line": 3}]) == "script.py:main:3"
    assert default_site([]) == "unknown"


def test_allocation_sites_is_a_no_op_off_cuda():
    with AllocationSites("cpu") as sites:
        torch.zeros(1000)
    assert sites.result is None


def test_allocation_sites_disabled_is_a_no_op():
    with AllocationSites("cuda", enabled=False) as sites:
        pass
    assert sites.result is None


def test_allocation_sites_stops_recording_when_the_block_raises(monkeypatch):
    # the allocator's API faked on CPU: the baseline snapshot holds block 9, the final one a trace
    calls, snapshots = (
        [],
        iter(
            [
                {
                    "segments": [
                        {
                            "device": 0,
                            "blocks": [
                                {"address": 9, "state": "active_allocated"},
                                {"address": 8, "state": "inactive"},
                            ],
                        }
                    ],
                    "device_traces": [[]],
                },
                snapshot(free(9, 40), free(8, 10), alloc(1, 100, X)),
            ]
        ),
    )
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: next(snapshots))
    monkeypatch.setattr(allocation_sites, "_cuda_index", lambda device: 0)
    with pytest.raises(torch.OutOfMemoryError), AllocationSites("cuda:0") as sites:
        raise torch.OutOfMemoryError("phase")
    assert calls[-1] == {"enabled": None} and calls[0]["clear_history"]
    assert sites.result["baseline_freed_bytes"] == 40 and sites.result["peak_traced_bytes"] == 100
    assert not sites.result["truncated"]


@pytest.mark.cuda
def test_allocation_sites_credits_tensors_to_this_function_on_cuda():
    with AllocationSites("cuda") as sites:
        a = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        b = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
        c = torch.empty(7 << 20, dtype=torch.uint8, device="cuda")
        del a, b, c
    mine = [
        entry
        for entry in sites.result["sites"]
        if entry["site"].startswith("test_allocation_sites.py:test_allocation_sites_credits")
    ]
    assert sum(entry["bytes"] for entry in mine) >= 15 << 20
    assert sites.result["peak_traced_bytes"] >= 15 << 20 and not sites.result["truncated"]
    assert not torch._C._cuda_isHistoryEnabled()
