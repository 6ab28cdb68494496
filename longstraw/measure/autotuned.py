"""What a Triton autotuner chose: the configuration an autotuned kernel runs and each candidate's measured time.

A benchmark of an autotuned kernel reports them beside its own timing, so a record says which configuration it
timed and by how much it won (Triton keeps these only for the key it tuned last, or read from its disk cache).
"""

from __future__ import annotations


def _described(config) -> dict:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def autotuned_choice(kernel) -> dict | None:
    """{"chosen": the configuration `kernel` (a `triton.autotune` wrapper) last ran, "candidates": each candidate
    tuned for that key with its median milliseconds (Triton's do_bench), fastest first}, or None when it has not
    run or had one configuration (nothing tuned)."""
    chosen = getattr(kernel, "best_config", None)
    if chosen is None or len(kernel.configs) < 2:
        return None
    timings = getattr(kernel, "configs_timings", None) or {}
    candidates = [
        {**_described(config), "ms": times[0] if isinstance(times, (list, tuple)) else times}
        for config, times in timings.items()
    ]
    return {"chosen": _described(chosen), "candidates": sorted(candidates, key=lambda c: c["ms"])}
