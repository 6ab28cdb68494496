"""Atomic file writes (temp file in the same folder + rename): an interrupted run leaves either
the previous file or none, never a half-written result, table, figure or page."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

# partial: a point cut off before its end (a command's time limit); its metrics are the steps it finished
STATUSES = ("ok", "oom", "error", "partial")


@contextmanager
def atomic_path(path):
    """Yield a temp path beside `path`; on success rename it over `path`, on failure remove it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path, text: str) -> Path:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def write_json_atomic(path, obj) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=_jsonable) + "\n")


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def check_writable(path, what: str = "output", *, overwrite: bool = False) -> None:
    """Refuse, before any work, an output file that could not be written at the end: a folder at the
    path, a folder that cannot be created or written, or (unless `overwrite`) a file already there that
    is not a failed or cut-off result (status error or partial), since a finished result is never
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
    if path.exists() and not overwrite and not replaceable(path):
        raise ValueError(
            f"{what}: {path} already exists and is not a failed result; a finished result is not "
            "replaced: choose another path, or pass --overwrite to replace it"
        )


def replaceable(path) -> bool:
    """Whether the result file at `path` may be written over without asking: a point that failed
    (status error) or was cut off (status partial), which a rerun is meant to replace."""
    try:
        status = json.loads(Path(path).read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return False  # unreadable, not JSON, or not a result: someone's file
    return status in ("error", "partial")


def write_result(path, result: dict) -> Path:
    """Write a finished result atomically; if that fails (the disk filled, the folder went away), keep it
    in the system's temp folder instead and raise naming both paths: a measured result is never lost."""
    try:
        return write_json_atomic(path, result)
    except OSError as exc:
        kept = Path(tempfile.gettempdir()) / f"longstraw-unwritten-{os.getpid()}-{Path(path).name}"
        write_json_atomic(kept, result)
        raise OSError(f"could not write the result to {path} ({exc.strerror or exc}); it is kept in {kept}") from exc
