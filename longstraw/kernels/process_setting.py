"""A kernel choice for the whole process, changed for the length of a block (`ProcessSetting.within`).

Not a ContextVar: a checkpointed replay's recompute, and every backward, run in autograd's device thread, which
must see the choice the forward saw."""

from __future__ import annotations

from contextlib import contextmanager


class ProcessSetting:
    """One of `options`, named `what` in errors; `value` is read by the kernels."""

    def __init__(self, what: str, options: tuple[str, ...], value: str):
        self.what, self.options = what, options
        self.value = self.checked(value)

    def checked(self, name: str) -> str:
        if name not in self.options:
            raise ValueError(f"{self.what} must be one of {self.options}, got {name!r}")
        return name

    @contextmanager
    def within(self, name: str):
        """Within the block the setting is `name` (checked first); then what it was."""
        before, self.value = self.value, self.checked(name)
        try:
            yield
        finally:
            self.value = before
