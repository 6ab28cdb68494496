"""Timers: the capture attention rate (seconds and FLOPs spent inside paged attention while a timer is active), and
a call's seconds over repeats (each call's, their mean, or a CUDA graph's replays')."""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager, nullcontext

import torch

from longstraw.measure.flops import attention_forward_flops
from longstraw.measure.memory import synchronize


def seconds_per_call(fn, device, repeats: int, warmup: int = 1) -> float:
    """Mean wall seconds of `fn()` over `repeats` calls after `warmup` untimed ones, the device synchronised before
    and after the timed calls but not between them (where each call's kernels are small, that is the host's time)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / repeats


def copy_bandwidth(device, repeats: int = 20) -> float:
    """Bytes a second of a 1 GiB device-to-device copy (read + write): the memory bandwidth a kernel that streams
    its bytes can reach here, the denominator of a bandwidth floor."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / seconds_per_call(lambda: dst.copy_(src), device, repeats, warmup=2)


@functools.cache
def warmup_stream(device) -> torch.cuda.Stream:
    """The side stream a CUDA graph's warm-up runs on (torch's recording recipe), one a device for the process: cuBLAS
    keeps a workspace for each stream it ran on (32 MiB on an H100) as long as the process lives, so a new stream a
    recording (an agent's decode records one every trainer step) would leak one each."""
    return torch.cuda.Stream(device)


def graph_replay_seconds(fn, repeats: int, warmup: int = 3) -> float:
    """Mean device seconds of `fn()` recorded once as a CUDA graph and replayed `repeats` times back to back (CUDA
    events around the replays): work that runs inside a graph, as replay's members do, without the host's launch
    and autograd time between its kernels. `fn` runs `warmup` times first on a side stream (compiling, autotuning
    and allocating outside the recording, as torch's graph recipe asks)."""
    side = warmup_stream(torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def seconds_each(fn, device, repeats: int) -> list[float]:
    """The wall seconds of each of `repeats` calls of `fn()`, the device synchronised around every call (the first
    call is cold where nothing ran before it: callers read it apart or warm up first)."""
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


class AttentionTimer:
    """Seconds and FLOPs spent inside paged attention while active (the capture attention rate).

    The attention mixer reports each call through `AttentionTimer.active`; every call is
    bracketed by device syncs, so use it only where calls are large (capture chunks).
    """

    active: AttentionTimer | None = None

    def __init__(self, device):
        self.device = torch.device(device)
        self.seconds = 0.0
        self.flops = 0
        self.calls = 0

    def __enter__(self):
        AttentionTimer.active = self
        return self

    def __exit__(self, *exc):
        AttentionTimer.active = None

    @contextmanager
    def call(self, flops: int):
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        self.seconds += time.perf_counter() - start
        self.flops += flops
        self.calls += 1

    def summary(self) -> dict:
        return {
            "seconds": self.seconds,
            "flops": self.flops,
            "calls": self.calls,
            "tflops_per_second": self.flops / self.seconds / 1e12 if self.seconds else None,
        }


def timed_attention(q_BHTD, prefix: int):
    """The active timer's bracket around one capture chunk's attention of `q_BHTD` over `prefix` earlier keys
    and its own causal keys (a no-op when no timer is active)."""
    timer = AttentionTimer.active
    if timer is None:
        return nullcontext()
    _, H, T, D = q_BHTD.shape
    return timer.call(attention_forward_flops(H, D, T, prefix))
