"""Where a trainer's step metrics go besides its record, for watching a run live: `report_to`, with TRL's name and
values ("none", "tensorboard", "trackio"). The run's `metrics.jsonl` and the HTML report stay the record; a backend
gets each step's numbers (TRL's metric names: `reward`, `reward_std`, `kl`, `loss`, ...) under the step index.

Optional: a backend's package is needed only when named, and a config naming one that is not installed is refused
before any work (`check_report_to`), naming the install. Nothing here is imported by the default pipeline.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from pathlib import Path

REPORT_TO = ("none", "tensorboard", "trackio")
_PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio"}  # what each backend imports


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_report_to(name: str, source: str) -> None:
    """Refuse a backend whose package is not installed (before the model is built)."""
    package = _PACKAGES.get(name)
    if package is not None and not installed(package):
        raise ValueError(f"{source}: report_to: {name!r} needs the {package} package (pip install {package})")


def scalars(record: dict) -> dict[str, float]:
    """The finite numbers of a step record (booleans, lists and text left out): what a backend plots."""
    return {
        key: float(value)
        for key, value in record.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


class _Silent:
    def log(self, step: int, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class _TensorBoard:
    def __init__(self, out_dir: Path, run_name: str):
        writer = importlib.import_module("torch.utils.tensorboard").SummaryWriter
        self.writer = writer(log_dir=str(out_dir / "tensorboard" / run_name))

    def log(self, step: int, record: dict) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Trackio:
    def __init__(self, out_dir: Path, run_name: str, config: dict):
        self.trackio = importlib.import_module("trackio")
        self.trackio.init(project=out_dir.name, name=run_name, config=config)

    def log(self, step: int, record: dict) -> None:
        self.trackio.log(scalars(record), step=step)

    def close(self) -> None:
        self.trackio.finish()


def open_watch(name: str, out_dir, run_name: str, config: dict):
    """The backend `name` for a run writing under `out_dir` (`log(step, record)` after each step, `close()`)."""
    if name == "tensorboard":
        return _TensorBoard(Path(out_dir), run_name)
    if name == "trackio":
        return _Trackio(Path(out_dir), run_name, config)
    return _Silent()
