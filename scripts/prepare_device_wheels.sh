#!/usr/bin/env bash
# Download, on a machine with network, the wheels the GPU box lacks (docs/gpu.md):
#   scripts/prepare_device_wheels.sh          # run from anywhere; writes into the repo root
# .whl/      fla-core, einops, jsonschema and its needs, gguf, wonderwords  (~1.8 MB; carry on every call)
# .whl_bnb/  bitsandbytes                                (~43 MB; carry only for NF4 points)
# .whl_peers/ trl, prefix-grouper, datasets and its needs (~1 MB; carry only for the peers' points)
# The box runs Python 3.12 on manylinux x86_64 (torch 2.11, transformers 5.17, triton 3.6; attrs and
# typing-extensions, which jsonschema and referencing need, are in its image). Versions are pinned to
# match the CPU environment (jsonschema's family) and the recorded runs (fla-core, bitsandbytes).
# Both folders are git-ignored; scripts/device_setup.sh installs them on the box.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

WHL=(
    fla-core==0.6.0                    # needs einops (unpinned by fla-core 0.6.0)
    einops==0.8.2
    jsonschema==4.26.0                 # needs attrs (in the image), the three below
    jsonschema-specifications==2025.9.1
    referencing==0.37.0
    rpds-py==2026.9.1                  # compiled: cp312 manylinux wheel
    gguf==0.19.0                       # transformers' GGUF reader (longstraw fetch-model); numpy is in the image
    wonderwords==3.0.1                 # RULER's needle keys (longstraw.training.ruler)
)
WHL_BNB=(
    bitsandbytes==0.50.2
)
# the `peers` extra (pyproject.toml) at the CPU environment's versions; the box has accelerate, pyarrow,
# pandas, huggingface-hub, psutil and fsspec (transformers' and accelerate's needs), not these
WHL_PEERS=(
    trl==1.16.0                        # needs datasets (and accelerate, in the image)
    prefix-grouper==0.0.1.post1
    datasets==5.2.0                    # needs the three below, xxhash compiled
    dill==0.4.1
    multiprocess==0.70.19
    xxhash==4.1.0                      # compiled: cp312 manylinux wheel
)

# pip matches manylinux_2_N exactly, so offer every N the box's glibc could take, newest first.
PLATFORMS=()
for n in $(seq 39 -1 17); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)

fetch() {  # fetch DIR NAME==VERSION...
    local dir=$1; shift
    mkdir -p "$dir"
    local spec name version file
    for spec in "$@"; do
        name=${spec%%==*}; version=${spec##*==}
        "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
            --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d "$dir" "$spec"
        # wheel file names spell the project with underscores (fla-core -> fla_core-0.6.0-...)
        file=$(ls "$dir/${name//-/_}-${version}-"*.whl 2>/dev/null | head -1 || true)
        if [ -z "$file" ]; then echo "missing wheel for $spec in $dir/" >&2; exit 1; fi
        local others
        others=$(ls "$dir/${name//-/_}-"*.whl | grep -v -- "-${version}-" || true)
        if [ -n "$others" ]; then  # two versions of one package stop the whole install on the box
            echo "other versions of $name in $dir/ (remove them): $others" >&2; exit 1
        fi
    done
}

fetch .whl "${WHL[@]}"
fetch .whl_bnb "${WHL_BNB[@]}"
fetch .whl_peers "${WHL_PEERS[@]}"

echo "wheels for the GPU box:"
ls -l .whl/*.whl .whl_bnb/*.whl .whl_peers/*.whl | awk '{printf "  %10d  %s\n", $5, $NF}'
printf '  .whl/       %s\n  .whl_bnb/   %s\n  .whl_peers/ %s\n' "$(du -sh .whl | cut -f1)" "$(du -sh .whl_bnb | cut -f1)" \
    "$(du -sh .whl_peers | cut -f1)"
total=$(cat .whl/*.whl .whl_bnb/*.whl .whl_peers/*.whl | wc -c)
echo "  total $total bytes ($((total / 1048576)) MiB of the 64 MiB the travelling tree may hold)"
