# Source at the start of a command on the GPU box, from the tree's root (the recipe: docs/gpu.md):
#   . scripts/device_setup.sh
# - installs the carried wheels (.whl/, and .whl_bnb/ and .whl_peers/ when carried;
#   scripts/prepare_device_wheels.sh makes all three) into /tmp/site;
# - keeps Triton's compiled kernels and autotune results in .triton_cache, unpacked from a carried
#   .cache_device/triton_cache.tgz when there is one (without it fla's autotuning costs ~40 s on the
#   first call; `save_triton_cache` below makes the archive);
# - fixes the commit results record: the box's copy has no .git, so LONGSTRAW_COMMIT, which the
#   sender writes into the command (export LONGSTRAW_COMMIT=<sha>; . scripts/device_setup.sh),
#   else "unknown".
# - the real model (docs/gpu.md §6): links results/h200/checkpoints/smollm2-135m-instruct to the checkpoint
#   that real_model_checkpoint built under /tmp on this box (kept while the box is held), and points the wheel
#   cache (RULER's data) at /tmp/longstraw/wheels.
# It defines device_point, device_points, device_points_at, device_points_variant, warm_libraries, save_triton_cache,
# real_model_stash, real_model_checkpoint, bring_back_work and take_up_work, and switches no shell options on (no
# set -e/pipefail).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .whl_bnb/*.whl .whl_peers/*.whl 2>/dev/null) || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=$PWD/.triton_cache
mkdir -p "$TRITON_CACHE_DIR"; [ -f .cache_device/triton_cache.tgz ] && tar xzf .cache_device/triton_cache.tgz
if [ ! -e .git ]; then  # never let git walk up to a repo enclosing the copy (longstraw.measure.git_commit)
    export LONGSTRAW_COMMIT=${LONGSTRAW_COMMIT:-unknown}
    [ "$LONGSTRAW_COMMIT" = unknown ] && echo "device_setup: no .git and no LONGSTRAW_COMMIT: results record commit 'unknown'" >&2
fi
export LONGSTRAW_WHEELS=/tmp/longstraw/wheels
REAL_MODEL=/tmp/longstraw/checkpoints/smollm2-135m-instruct
mkdir -p results/h200/checkpoints
[ -f "$REAL_MODEL/longstraw_checkpoint.json" ] && ln -sfn "$REAL_MODEL" results/h200/checkpoints/smollm2-135m-instruct
echo "device_setup: commit ${LONGSTRAW_COMMIT:-from .git}; triton cache $(ls "$TRITON_CACHE_DIR" | wc -l) entries;" \
    "real model $([ -f "$REAL_MODEL/longstraw_checkpoint.json" ] && echo built || echo "not built")" >&2

# The real model over two calls (scripts/prepare_real_model_parts.sh made .cache_device/real1 and real2):
# real_model_stash keeps what this call carried (a GGUF part, RULER's wheel) under /tmp/longstraw;
# real_model_checkpoint, once both parts are there, joins them and builds the checkpoint folder (the GGUF's
# sha256 checked by longstraw fetch-model) and links it where the h200 points read it.
real_model_stash() {
    mkdir -p /tmp/longstraw/parts "$LONGSTRAW_WHEELS"
    local folder
    for folder in .cache_device/real1 .cache_device/real2; do
        [ -d "$folder" ] || continue
        cp "$folder"/model.gguf.part* /tmp/longstraw/parts/ 2>/dev/null
        cp "$folder"/*.whl "$LONGSTRAW_WHEELS"/ 2>/dev/null
    done
    echo "real_model_stash: parts $(ls /tmp/longstraw/parts | tr '\n' ' '); wheels $(ls "$LONGSTRAW_WHEELS" | tr '\n' ' ')" >&2
}
real_model_checkpoint() {
    if [ ! -f "$REAL_MODEL/longstraw_checkpoint.json" ]; then
        if [ ! -f /tmp/longstraw/parts/model.gguf.part1 ] || [ ! -f /tmp/longstraw/parts/model.gguf.part2 ]; then
            echo "real_model_checkpoint: a part is missing (the box was given back between the two calls?)" >&2
            return 1
        fi
        cat /tmp/longstraw/parts/model.gguf.part1 /tmp/longstraw/parts/model.gguf.part2 >/tmp/longstraw/model.gguf
        python3 -m longstraw fetch-model smollm2-135m-instruct --gguf /tmp/longstraw/model.gguf --out "$REAL_MODEL" \
            2>&1 | grep -v "it/s]"
        [ "${PIPESTATUS[0]}" -eq 0 ] || return 1
    fi
    ln -sfn "$REAL_MODEL" results/h200/checkpoints/smollm2-135m-instruct
}

# One pipeline point: device_point EXPERIMENT POINT SECONDS [RANKS]
#   -> $OUT/EXPERIMENT__POINT.json (the result) and $OUT/EXPERIMENT__POINT.log (the whole output);
# shows the log's last 40 non-blank lines and returns the point's exit status: 0 when it ran, 124
# when it timed out (137 if it then ignored SIGTERM for 30 s), the error's status when it crashed.
# RANKS (default 1) is the point's cp_size: more than 1 starts that many ranks through torchrun.
device_point() {
    if [ $# -lt 3 ] || [ $# -gt 4 ]; then echo "usage: device_point EXPERIMENT POINT SECONDS [RANKS]" >&2; return 2; fi
    local experiment=$1 point=$2 seconds=$3 ranks=${4:-1} status
    local start=(python3 -m longstraw)
    [ "$ranks" -gt 1 ] && start=(python3 -m torch.distributed.run --standalone --nproc-per-node "$ranks" -m longstraw)
    local log="${OUT:?OUT is not set}/${experiment}__${point}.log"
    mkdir -p "$OUT"
    timeout --kill-after=30 "$seconds" "${start[@]}" point "experiments/$experiment.yaml" --profile h200 \
        --point "$point" --out "$OUT/${experiment}__${point}.json" 2>&1 | tee "$log" | grep -v "^\s*$" | tail -40
    status=${PIPESTATUS[0]}  # the timeout/python status, not tail's (pipefail without setting it)
    if [ "$status" -ne 0 ]; then
        if [ "$status" -eq 124 ]; then
            echo "device_point $experiment $point: timed out after $seconds s (exit 124); log: $log" >&2
        else
            echo "device_point $experiment $point: failed (exit $status); log: $log" >&2
        fi
    fi
    return "$status"
}

# Several points of one experiment in order within one command's time: device_points EXPERIMENT BUDGET CAP POINT...
#   runs each point with device_point, giving it CAP seconds or what is left of BUDGET (counted from the
#   call), and starts none once fewer than 30 s are left; prints one line per point (status, seconds; a
#   failed one's last log lines) and the points it did not start, so a later command can take them up.
#   A call returns at most 8 files: the points' files go to a folder of the box, packed after every point
#   into the one archive $OUT/EXPERIMENT__points.tgz, so a call cut off later still returns those done.
device_points() {
    if [ $# -lt 4 ]; then echo "usage: device_points EXPERIMENT BUDGET CAP POINT..." >&2; return 2; fi
    local experiment=$1 budget=$2 cap=$3 start=$SECONDS point left status began
    local folder="${TMPDIR:-/tmp}/device_points/$experiment" archive="${OUT:?OUT is not set}/${experiment}__points.tgz"
    shift 3
    mkdir -p "$folder" "$OUT"
    for point in "$@"; do
        left=$((budget - (SECONDS - start)))
        if [ "$left" -lt 30 ]; then echo "device_points: not started (time): $point" >&2; continue; fi
        began=$SECONDS
        OUT=$folder device_point "$experiment" "$point" $((left < cap ? left : cap)) >/dev/null 2>&1
        status=$?
        echo "device_points: $point exit $status in $((SECONDS - began)) s" >&2
        [ "$status" -ne 0 ] && grep -v "^\s*$" "$folder/${experiment}__${point}.log" | tail -12 >&2
        tar czf "$archive.tmp" --exclude="*.work" -C "$folder" . && mv "$archive.tmp" "$archive"  # not the work folders: checkpoints
        [ "$status" -eq 0 ] && bring_back_adapter "$folder/${experiment}__${point}.json" "$OUT/${experiment}__${point}.adapter.tar"
    done
}

# The adapter a finished point kept last (a curriculum's carried-on stage: `metrics.stages[].adapter.path`, 7.4 MB on
# SmolLM2), as the tar of its stage folder: bring_back_adapter RESULT TAR. The box's results/ go with the box, and a
# later point may start from that adapter (2026-12-07: V4 at 131,072's adapter was not brought back, and is lost).
bring_back_adapter() {
    local path
    path=$(python3 -c 'import json, sys
stages = json.load(open(sys.argv[1])).get("metrics", {}).get("stages") or []
kept = [s["adapter"]["path"] for s in stages if isinstance(s.get("adapter"), dict) and s["adapter"].get("path")]
print(kept[-1] if kept else "")' "$1") || return 0
    [ -n "$path" ] && [ -d "$path" ] || return 0
    tar cf "$2" -C "$(dirname "$(dirname "$path")")" "$(basename "$(dirname "$path")")" &&
        echo "device_points: adapter $path -> $2" >&2
}

# A point's work folder (a learning point's runs' checkpoints, a curriculum's finished stages) goes with the box; a
# point longer than this session's device time goes on in a later one only from what came back:
#   bring_back_work EXPERIMENT POINT [PATH...]  -> $OUT/EXPERIMENT__POINT.work.tgz
# packs the work folder device_points left, of each run's checkpoints the newest alone (a finished curriculum stage's
# without its optimizer state: it never resumes), with the tree's PATHs (a curriculum's `out`, whose kept policies the
# stage records name and check). A later call carries the archive and runs, before device_points,
#   take_up_work EXPERIMENT POINT ARCHIVE
# which unpacks it where device_points looks (a work folder already there, the box's own, is kept) and the PATHs into
# the tree, over no file there.
bring_back_work() {
    if [ $# -lt 2 ]; then echo "usage: bring_back_work EXPERIMENT POINT [PATH...]" >&2; return 2; fi
    local name="$1__$2" folder="${TMPDIR:-/tmp}/device_points/$1" list
    shift 2
    if [ ! -d "$folder/$name.json.work" ]; then
        echo "bring_back_work: no work folder $folder/$name.json.work" >&2
        return 1
    fi
    list=$(mktemp) || return
    python3 - "$folder" "$name.json.work" >"$list" <<'PY' || return
import sys
from pathlib import Path

root = Path(sys.argv[1])
for path in sorted(p for p in (root / sys.argv[2]).rglob("*") if p.is_file()):
    parts = path.relative_to(root).parts
    if "checkpoints" in parts:
        at = parts.index("checkpoints")
        steps = [p.name for p in root.joinpath(*parts[: at + 1]).iterdir() if p.name[5:].isdigit()]
        if parts[at + 1] != max(steps, key=lambda s: int(s[5:]), default=None):
            continue  # an older checkpoint, or a torn one (step-N.tmp)
        if path.name == "trainer.pt" and (root.joinpath(*parts[: at - 1]) / "stage.json").is_file():
            continue  # a finished stage's optimizer state
    print(path.relative_to(root))
PY
    tar czf "${OUT:?OUT is not set}/$name.work.tgz" -C "$folder" -T "$list" -C "$PWD" "$@" &&
        echo "bring_back_work: $(wc -l <"$list") files of $name's work and $# paths -> $OUT/$name.work.tgz" \
            "($(wc -c <"$OUT/$name.work.tgz") bytes)" >&2
    rm -f "$list"
}
take_up_work() {
    if [ $# -ne 3 ]; then echo "usage: take_up_work EXPERIMENT POINT ARCHIVE" >&2; return 2; fi
    local name="$1__$2" folder="${TMPDIR:-/tmp}/device_points/$1"
    if [ -d "$folder/$name.json.work" ]; then
        echo "take_up_work: $folder/$name.json.work is there (this box's): kept" >&2
    else
        mkdir -p "$folder" && tar xzf "$3" -C "$folder" --wildcards "$name.json.work/*" || return
    fi
    tar xzf "$3" --exclude "$name.json.work/*" --skip-old-files && echo "take_up_work: $name's work from $3" >&2
}

# Points with an earlier commit's package, for an A/B on one box (timings compare on the same card only): here
#   git archive <sha> | gzip > .cache_device/tree_<sha>.tgz      (the full sha; carry .cache_device)
# there, after device_setup.sh,
#   device_points_at <sha> EXPERIMENT BUDGET CAP POINT...
# unpacks that tree under /tmp (once) and runs device_points from it, its results recording that commit; give each
# round its own OUT and TMPDIR, as for device_points.
device_points_at() {
    if [ $# -lt 5 ]; then echo "usage: device_points_at SHA EXPERIMENT BUDGET CAP POINT..." >&2; return 2; fi
    local sha=$1 tree=/tmp/tree_$1
    shift
    if [ ! -d "$tree" ]; then
        mkdir -p "$tree" && tar xzf ".cache_device/tree_$sha.tgz" -C "$tree" || { rm -rf "$tree"; return 1; }
    fi
    (cd "$tree" && LONGSTRAW_COMMIT=$sha PYTHONPATH=/tmp/site:$tree device_points "$@")
}

# Points with a process setting's default changed, for an A/B against the tree as it is (no carried tree needed):
#   device_points_variant NAME FILE SED EXPERIMENT BUDGET CAP POINT...
# copies this tree (without its caches and wheels) to /tmp/variant_NAME once, runs `sed -i SED FILE` there and refuses
# if that changed nothing, then runs device_points from it with LONGSTRAW_VARIANT=NAME: its results record this
# commit and the variant, which `benchmarks/point_ab.py` compares as COMMIT+NAME. Give each round its own OUT and TMPDIR.
device_points_variant() {
    if [ $# -lt 7 ]; then echo "usage: device_points_variant NAME FILE SED EXPERIMENT BUDGET CAP POINT..." >&2; return 2; fi
    local name=$1 file=$2 expression=$3 tree=/tmp/variant_$1
    shift 3
    if [ ! -d "$tree" ]; then
        mkdir -p "$tree" && tar cf - --exclude=./.triton_cache --exclude=./.cache_device --exclude=./.whl \
            --exclude=./.whl_bnb --exclude=./.whl_peers . | tar xf - -C "$tree" || { rm -rf "$tree"; return 1; }
        sed -i "$expression" "$tree/$file"
        if cmp -s "$file" "$tree/$file"; then
            echo "device_points_variant $name: '$expression' changed nothing in $file" >&2
            rm -rf "$tree"
            return 1
        fi
    fi
    (cd "$tree" && LONGSTRAW_VARIANT=$name PYTHONPATH=/tmp/site:$tree device_points "$@")
}

# Read the CUDA libraries (cuDNN's engines, cuBLAS, torch's flash kernels) once in a throwaway process, so that
# the first point's cold step is a fresh process's on a box that has run torch before, as every later point's
# is: on a freshly started box the first process to touch cuDNN read its libraries from disk (measured: replay
# at 8,192 as a command's first point, cold step 4.08 s with capture 1.46 s and replay 2.53 s in it; its
# variants later in that command 0.37-0.45 s and 0.6-0.85 s).
warm_libraries() {
    python3 - <<'PY'
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

q = torch.randn(1, 8, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
    with sdpa_kernel(backend):
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
(q.detach() @ q.detach().transpose(-1, -2)).sum().item()
print("warm_libraries: cuDNN, flash and cuBLAS loaded")
PY
}

# Pack .triton_cache into $OUT/triton_cache.tgz.part-aa, -ab, ... (a returned file may have 16 MiB; the cache
# with fla's forward and backward kernels at hybrid-1b's shapes is ~43 MB), last thing in a command; join them
# here with `cat <returned files>/triton_cache.tgz.part-* > .cache_device/triton_cache.tgz` and carry
# .cache_device on later calls.
save_triton_cache() {
    local archive="${TMPDIR:-/tmp}/triton_cache.tgz"
    mkdir -p "${OUT:?OUT is not set}"
    tar czf "$archive" -C "$(dirname "$TRITON_CACHE_DIR")" "$(basename "$TRITON_CACHE_DIR")" || return
    split -b 15000000 "$archive" "$OUT/triton_cache.tgz.part-" || return
    echo "save_triton_cache: $(wc -c <"$archive") bytes in $(ls "$OUT"/triton_cache.tgz.part-* | wc -l) parts" >&2
}
