"""What a trainer run's config can be checked for before its model is built (`trainer.resolve` calls
`check_train_inputs`; the plan's point checks use `check_task_builds`):

- the policy: `model.overrides` against its config class (a preset's or the checkpoint's), `model.path` a
  whole checkpoint (config.json, every weights file complete); `model.device` on this machine;
- a synthetic task built against the model's vocabulary at its length (its own checks: a vocabulary
  too small for its token layout, a length that cannot hold its needles), and its prompt plus
  `sampling.max_new_tokens` within the model's `max_position_embeddings` unless
  `capture.beyond_max_positions`. (A text dataset's rows are checked by `text_tasks.TextTask`.)

Nothing here imports torch at import time (the plan imports this module).
"""

from __future__ import annotations

from longstraw.config.typed import ConfigError
from longstraw.models.checks import ModelFacts, check_device, checkpoint_facts, preset_facts


def check_task_builds(spec: dict, lengths, facts: ModelFacts, where: str) -> None:
    """Build the task at each length (None: the spec's own) against the model's vocabulary, so that
    its own checks run now; `where` starts the message (source and key)."""
    if facts.vocab_size is None:
        return
    import longstraw.training.synthetic  # noqa: F401  (registers the training tasks: mqar, periodic)
    from longstraw.training.tasks import build_task

    for length in dict.fromkeys(lengths):
        settings = dict(spec) if length is None else {**spec, "length": int(length)}
        try:
            build_task(settings, facts.vocab_size)
        except (ValueError, TypeError) as exc:
            at = "" if length is None else f" at length {length:,}"
            raise ConfigError(
                f"{where}: {exc} (the task{at}, against the vocabulary of {facts.vocab_size} of {facts.what})"
            ) from None


def policy_facts(model_cfg, source: str) -> ModelFacts:
    """The policy's facts, every check of its section made (the module docstring's first item)."""
    try:
        if model_cfg.path:
            facts = checkpoint_facts(model_cfg.path, "model.path", model_cfg.overrides, "model.overrides")
        else:
            facts = preset_facts(model_cfg.preset, model_cfg.overrides, "model.overrides")
        check_device(model_cfg.device, "model.device")
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return facts


def check_train_inputs(cfg, source: str) -> ModelFacts:
    """A `TrainConfig`'s policy and synthetic task (module docstring); the policy's facts."""
    facts = policy_facts(cfg.model, source)
    if cfg.task is not None:
        length = cfg.task.get("length")
        check_task_builds(cfg.task, [None], facts, f"{source}: task")
        limit, new = facts.max_positions, cfg.sampling.max_new_tokens
        if isinstance(length, int) and limit and not cfg.capture.beyond_max_positions:
            if length > limit:
                raise ConfigError(
                    f"{source}: task.length: {length:,} positions, more than the {limit:,} the model "
                    f"was configured for ({facts.what}: max_position_embeddings); set "
                    "capture.beyond_max_positions: true to run it anyway"
                )
            if length + new > limit:
                raise ConfigError(
                    f"{source}: sampling.max_new_tokens: {new:,} response tokens after a prompt of "
                    f"{length:,} (task.length) run to position {length + new:,}, past the {limit:,} the "
                    f"model was configured for ({facts.what}: max_position_embeddings); set "
                    "capture.beyond_max_positions: true to run them anyway"
                )
    return facts
