"""How launch-bound a call is: one call under torch.profiler, its kernels counted and timed against the wall."""

from __future__ import annotations

import time

import torch

from longstraw.measure.memory import synchronize

# (kind, substrings of a kernel's name): the first kind with a substring in the name; the rest is "other"
# (elementwise work, reductions, gathers). Names as cuBLAS, cuDNN, torch's flash, fla and our Triton kernels give them.
KERNEL_KINDS = (
    ("gemm", ("nvjet", "gemm", "cutlass", "splitKreduce")),
    ("attention", ("sdpa", "fmha", "flash_fwd", "flash_bwd")),
    (
        "gated_delta_rule",
        (
            "gated_delta_rule",
            "chunk_fwd_kernel_o",
            "recompute_w_u",
            "prepare_wy_repr",
            "chunk_bwd_kernel",
            "chunk_local_cumsum",
            "_scan_output_kernel",
            "_chunk_scores_kernel",
        ),
    ),
    ("conv", ("_conv_", "conv1d", "_pre_activation_gradient")),
    ("norm", ("layer_norm", "rms_norm", "l2norm")),
    ("swiglu", ("swiglu",)),
    ("log_probs", ("_logsumexp_target", "_logprob_grad")),
    ("dsa_index", ("_index_scores",)),
    ("copy_fill", ("Memcpy", "Memset", "copy_kernel", "FillFunctor", "CatArrayBatchedCopy")),
)


def kernel_kind(name: str) -> str:
    """What a kernel does, by its name (`KERNEL_KINDS`): so that profiles from different commits compare by kind."""
    return next((kind for kind, marks in KERNEL_KINDS if any(mark in name for mark in marks)), "other")


def kernel_profile(fn, device, top: int = 12) -> dict:
    """Run `fn()` once under torch.profiler (CPU and CUDA activity): the kernels it launched, their summed
    device time, the wall, the fraction of the wall the device was busy, the `top` ops by device time (an op's time
    includes its children's) and by their own kernels' time (`top_self`: which op launched the time), the `top`
    kernels by their own summed time and by their launches (where a launch-bound call's host time goes), and where
    the device waited (`idle`), and the kernels' seconds summed by `kernel_kind` (`by_kind`)."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        synchronize(device)
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_seconds = sum(e.device_time for e in kernels) / 1e6
    averages = prof.key_averages()
    ops = sorted(averages, key=lambda e: e.device_time_total, reverse=True)[:top]
    own = sorted(averages, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    by_kernel: dict[str, list] = {}
    by_kind: dict[str, float] = {}
    for e in kernels:
        calls_seconds = by_kernel.setdefault(e.name[:90], [0, 0.0])
        calls_seconds[0] += 1
        calls_seconds[1] += e.device_time / 1e6
        kind = kernel_kind(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.device_time / 1e6
    top_kernels = sorted(by_kernel.items(), key=lambda item: item[1][1], reverse=True)[:top]
    most_launched = sorted(by_kernel.items(), key=lambda item: item[1][0], reverse=True)[:top]
    return {
        "wall_seconds": wall,
        "kernels": len(kernels),
        "kernel_seconds": kernel_seconds,
        "busy_fraction": kernel_seconds / wall if wall else None,
        "top": [{"name": e.key[:90], "calls": e.count, "seconds": e.device_time_total / 1e6} for e in ops],
        "top_self": [
            {"name": e.key[:90], "calls": e.count, "seconds": e.self_device_time_total / 1e6}
            for e in own
            if e.self_device_time_total > 0
        ],
        "top_kernels": [{"name": n, "calls": c, "seconds": t} for n, (c, t) in top_kernels],
        "most_launched": [{"name": n, "calls": c, "seconds": t} for n, (c, t) in most_launched],
        "idle": device_idle(kernels, wall, top),
        "by_kind": dict(sorted(by_kind.items(), key=lambda item: item[1], reverse=True)),
    }


def device_idle(kernels, wall: float, top: int) -> dict:
    """Where the device waited during a profiled call: before its first kernel and after its last (the wall less
    the kernels' span: host work the device could not overlap), and the `top` largest gaps between kernels, each
    with the kernels either side of it."""
    if not kernels:
        return {"outside_span_seconds": wall, "between_kernels_seconds": 0.0, "largest_gaps": []}
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:90]) for e in kernels)
    first, end, previous = spans[0][0], spans[0][1], spans[0][2]
    gaps = []
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append({"seconds": (start - end) / 1e6, "after": previous, "before": name})
        if stop > end:
            end, previous = stop, name
    return {
        "outside_span_seconds": wall - (end - first) / 1e6,
        "between_kernels_seconds": sum(g["seconds"] for g in gaps),
        "largest_gaps": sorted(gaps, key=lambda g: g["seconds"], reverse=True)[:top],
    }


# the frames that name a launch's source: the first (innermost) frame in one of these packages
SOURCE_PACKAGES = ("longstraw/", "transformers/", "peft/", "fla/")


def launch_sources(fn, device, top: int = 40) -> list[dict]:
    """Run `fn()` once under torch.profiler with Python stacks: every op that launched device work itself (on a
    CPU device: every op), its count and own time summed by where it came from, the innermost frame in
    `SOURCE_PACKAGES` ("file(line): function"), or for the backward's ops the autograd node that ran them
    ("backward: MulBackward0"); the `top` sources by launches, each with its ops' names."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    # verbose: without it this torch records no Python frames for ops
    with profile(activities=activities, with_stack=True, experimental_config=_ExperimentalConfig(verbose=True)) as p:
        fn()
        synchronize(device)
    sources: dict[str, dict] = {}
    for event in p.events():
        if event.device_type != torch.autograd.DeviceType.CPU or not event.name.startswith("aten::"):
            continue
        own = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if own <= 0:
            continue
        row = sources.setdefault(_source(event), {"launches": 0, "seconds": 0.0, "ops": {}})
        row["launches"] += 1
        row["seconds"] += own / 1e6
        row["ops"][event.name] = row["ops"].get(event.name, 0) + 1
    ranked = sorted(sources.items(), key=lambda item: item[1]["launches"], reverse=True)[:top]
    return [{"source": name, **row} for name, row in ranked]


def _source(event) -> str:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("autograd::engine::evaluate_function: "):
            return "backward: " + parent.name.split(": ", 1)[1]
        parent = parent.cpu_parent
    for frame in event.stack or ():
        if any(package in frame for package in SOURCE_PACKAGES):
            return frame.split("site-packages/")[-1]
    return "elsewhere"
