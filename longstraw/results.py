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


def check_writable(path, what: str = "output") -> None:
    """Refuse, before any work, an output file whose folder cannot be created or written (the
    folder is created; nothing is written to `path`)."""
    folder = Path(path).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".longstraw-write-check-"):
            pass
    except OSError as exc:
        raise ValueError(f"{what}: cannot write to {folder}: {exc.strerror or exc}") from None
