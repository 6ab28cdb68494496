"""Result JSON files: written atomically (temp file + rename), so an interrupted run leaves either
the previous file or none, never a half-written one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

STATUSES = ("ok", "oom", "error")


def write_json_atomic(path, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=_jsonable)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def read_json(path):
    with open(path) as f:
        return json.load(f)
