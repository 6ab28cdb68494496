"""A progress bar on stderr for long captures (positions, positions/second)."""

from __future__ import annotations

import sys

from tqdm import tqdm

PROGRESS_MIN_POSITIONS = 65536


class CaptureProgress:
    """A tqdm bar; shown by default only for captures of at least `PROGRESS_MIN_POSITIONS`."""

    def __init__(self, total: int, enabled: bool | None, label: str):
        enabled = total >= PROGRESS_MIN_POSITIONS if enabled is None else enabled
        self.bar = tqdm(
            total=total, unit="pos", unit_scale=True, desc=label, disable=not enabled, file=sys.stderr, mininterval=5.0
        )

    def advance_to(self, done: int, label: str | None = None):
        if label:
            self.bar.set_description(label, refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self):
        self.bar.close()
