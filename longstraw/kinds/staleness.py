"""Kind `staleness`: the fresh-prefix oracle (`longstraw.training.oracle`): capture once, train
`staleness.steps` steps on the stale state, and at each step measure its drift against a fresh
capture; the derived refresh interval is the largest step count whose loss drift stays under
`staleness.threshold`."""

from __future__ import annotations

from longstraw.config import PointConfig
from longstraw.kinds.common import Progress, capture_kwargs, optimizer_for, policy_and_prompt
from longstraw.measure.memory import PhaseRecorder
from longstraw.training.oracle import refresh_interval, staleness_oracle
from longstraw.training.tasks import build_task


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    recorder = PhaseRecorder(device)
    model, vocab, prompt = policy_and_prompt(cfg, recorder)
    reward = None
    if cfg.staleness.task:
        task = build_task({**cfg.staleness.task, "length": cfg.prompt.length}, vocab)
        example = task.make(cfg.prompt.seed)
        prompt = example.prompt_ids.to(device)

        def reward(responses):
            return [task.reward(example, y) for y in responses]
    optimizer = optimizer_for(model, cfg)
    threshold, rows, floor = cfg.staleness.threshold, [], {}

    def metrics():
        return {"rows": rows, "threshold": threshold, "floor": floor,
                "refresh_interval": refresh_interval(rows, threshold, floor.get("relative_loss_drift", 0.0)),
                "prompt_positions": int(prompt.numel()), "phases": recorder.phases}

    def step_done(row):
        rows.append(row)
        progress.line(f"staleness step {row['step']}: loss drift {row['relative_loss_drift']:.3e}")
        progress.partial(metrics())

    with recorder.phase("oracle"):
        result = staleness_oracle(model, prompt, optimizer, cfg.grpo, steps=cfg.staleness.steps,
                                  num_samples=cfg.responses.count, max_new_tokens=cfg.responses.length,
                                  seed=cfg.responses.seed, capture_kwargs=capture_kwargs(cfg), progress=step_done,
                                  floor_perturbation=cfg.staleness.floor_perturbation, reward=reward)
        floor.update(result.floor)
    return metrics()
