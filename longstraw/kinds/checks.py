"""What the kinds' `check` (the plan half) share: a task spec and a preset name, checked before any work."""

from __future__ import annotations

from longstraw.config import ConfigError


def check_task(spec: dict, length: int, where: str) -> None:
    """A task spec at `length` positions: its task known, its settings the task's (a misspelt key refused)."""
    import longstraw.training.synthetic  # noqa: F401  (registers the training tasks: mqar, periodic)
    from longstraw.training.tasks import check_task_spec

    check_task_spec({**spec, "length": length}, where)


def check_named_preset(name: str, where: str) -> None:
    from longstraw.models.presets import check_preset

    try:
        check_preset(name)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
