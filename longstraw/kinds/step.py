"""Kind `step`: G seeded random responses with seeded rewards (a memory/time measurement needs
shapes, not meaning), `cycles` GRPO steps in the chosen mode; with `replay`/`hold_all` one capture
serves every cycle."""

from __future__ import annotations

from longstraw.config import PointConfig
from longstraw.core.step import StepOptions, grpo_step
from longstraw.kinds.common import Progress, capture_kwargs, optimizer_for, policy_and_prompt, seeded_group
from longstraw.measure.memory import PhaseRecorder
from longstraw.models.lora import trainable_parameters


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    recorder = PhaseRecorder(device)
    model, vocab, prompt = policy_and_prompt(cfg, recorder)
    responses, rewards = seeded_group(cfg, cfg.responses.count, vocab, device)
    optimizer = optimizer_for(model, cfg)
    options = StepOptions(mode=cfg.mode, capture=capture_kwargs(cfg), members=cfg.responses.probe_members)
    state, cycles = None, []
    for _ in range(cfg.cycles):
        step = grpo_step(model, prompt, responses, rewards, optimizer, cfg.grpo, options, state=state)
        state = step.state
        cycles.append(step.metrics)
    return {"weights": recorder.phases["weights"], "trainable_parameters": trainable_parameters(model),
            "cycles": cycles, **summary(cycles)}


def summary(cycles: list) -> dict:
    """Peaks over all cycles per phase, and the step's overall peak."""
    phases: dict = {}
    for c in cycles:
        for name, rec in c["phases"].items():
            agg = phases.setdefault(name, {"seconds": 0.0, "count": 0})
            agg["seconds"] += rec["seconds"]
            agg["count"] += rec.get("count", 1)
            for key in ("peak_allocated_bytes", "peak_rss_bytes"):
                if key in rec:
                    agg[key] = max(agg.get(key, 0), rec[key])
    peaks = [p["peak_allocated_bytes"] for p in phases.values() if "peak_allocated_bytes" in p]
    return {"phase_summary": phases, "peak_allocated_bytes": max(peaks) if peaks else None,
            "graph_bytes_peak": max(c["graph_bytes_peak"] for c in cycles)}
