"""Kind `staleness`: the fresh-prefix oracle (`longstraw.training.oracle`): capture once, train
`staleness.steps` steps on the stale state, and at each step measure its drift against a fresh
capture; the derived refresh interval is the largest step count whose loss drift stays under
`staleness.threshold`."""

from __future__ import annotations

from longstraw.config import PointConfig
from longstraw.kinds.common import Progress, capture_kwargs, optimizer_for, policy_and_prompt
from longstraw.measure.memory import PhaseRecorder
from longstraw.training.oracle import refresh_interval, staleness_oracle


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    recorder = PhaseRecorder(device)
    model, _, prompt = policy_and_prompt(cfg, recorder)
    optimizer = optimizer_for(model, cfg)
    threshold, rows = cfg.staleness.threshold, []

    def metrics():
        return {"rows": rows, "threshold": threshold, "refresh_interval": refresh_interval(rows, threshold),
                "prompt_positions": int(prompt.numel()), "phases": recorder.phases}

    def step_done(row):
        rows.append(row)
        progress.line(f"staleness step {row['step']}: loss drift {row['relative_loss_drift']:.3e}")
        progress.partial(metrics())

    with recorder.phase("oracle"):
        staleness_oracle(model, prompt, optimizer, cfg.grpo, steps=cfg.staleness.steps,
                         num_samples=cfg.responses.count, max_new_tokens=cfg.responses.length,
                         seed=cfg.responses.seed, capture_kwargs=capture_kwargs(cfg), progress=step_done)
    return metrics()
