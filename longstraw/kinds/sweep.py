"""Kind `sweep`: one capture serving a series of steps, `sweep.replay` then `sweep.hold_all` group
sizes in order, each mode stopping at its first out-of-memory step (recorded with the peak it
reached). Capture is measured as in `capture` (attention time and rate included), and with
`measure.kernel_rates` the run also times torch's causal SDPA and the attention and GEMM kernels
on this device, so ratios against them come from one run."""

from __future__ import annotations

import torch

from longstraw.config import PointConfig
from longstraw.config.point import with_group
from longstraw.core.step import StepOptions, grpo_step
from longstraw.kinds.common import (Progress, compute_dtype, measure_capture, model_config, optimizer_for,
                                    phase_peaks, policy_and_prompt, seeded_group)
from longstraw.measure.memory import PhaseRecorder
from longstraw.models.lora import trainable_parameters


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    recorder = PhaseRecorder(device)
    model, vocab, prompt = policy_and_prompt(cfg, recorder)
    out = {"weights": recorder.phases["weights"], "trainable_parameters": trainable_parameters(model)}
    if cfg.measure.kernel_rates:
        from longstraw.kernels.rates import measure_kernel_rates

        out["kernel_rates"] = measure_kernel_rates(model_config(model), device=device,
                                                   response_length=cfg.responses.length, dtype=compute_dtype(cfg))
    out["capture"], state = measure_capture(model, prompt, cfg, recorder)
    out["capture"]["phase"] = recorder.phases["capture"]
    out["steps"] = []
    progress.partial(out)
    optimizer = optimizer_for(model, cfg)
    for mode in ("replay", "hold_all"):
        for count in getattr(cfg.sweep, mode):
            step = _step(model, prompt, state, optimizer, cfg, mode, count, vocab, device)
            out["steps"].append(step)
            peak = step.get("peak_allocated_bytes")
            if getattr(state, "cp", None) is None or state.cp.rank == 0:  # one line per step, not per rank
                progress.line(f"sweep {mode} G={count}: {step['status']}"
                              + (f", peak {peak / 2**30:.2f} GiB" if peak else ""))
            progress.partial(out)
            if "oom" in step.get("rank_status", [step["status"]]):
                break
    return out


def _step(model, prompt, state, optimizer, cfg, mode: str, count: int, vocab: int, device) -> dict:
    """One step of the sweep on the shared state; an out-of-memory step is recorded with its peak."""
    responses, rewards = seeded_group(cfg, count, vocab, device)
    step = {"mode": mode, "count": count}
    try:
        metrics = grpo_step(model, prompt, responses, rewards, optimizer, with_group(cfg.grpo, count),
                            StepOptions(mode=mode), state=state).metrics
        step.update(status="ok", **metrics, peak_allocated_bytes=phase_peaks(metrics["phases"]))
    except torch.OutOfMemoryError as exc:
        step.update(status="oom", error=str(exc).splitlines()[0], peak_allocated_bytes=(
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None))
    optimizer.zero_grad(set_to_none=True)
    del responses
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if getattr(state, "cp", None) is not None:  # each rank's peak; an OOM on any rank ends the mode on all
        ranks = state.cp.all_gather_objects({"status": step["status"],
                                             "peak_allocated_bytes": step.get("peak_allocated_bytes")})
        step["rank_peak_allocated_bytes"] = [r["peak_allocated_bytes"] for r in ranks]
        step["rank_status"] = [r["status"] for r in ranks]
    return step
