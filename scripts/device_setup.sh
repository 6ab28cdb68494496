# Source at the start of a command on the GPU box (see DEVELOPERS notes in README):
#   . scripts/device_setup.sh
# installs the carried wheels into /tmp/site, and keeps Triton's compiled kernels and autotune
# results in .triton_cache (carried between calls, so fla's autotuning is paid once).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .whl_bnb/*.whl 2>/dev/null) || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=$PWD/.triton_cache
mkdir -p "$TRITON_CACHE_DIR"; [ -f .cache_device/triton_cache.tgz ] && tar xzf .cache_device/triton_cache.tgz
# run one pipeline point: device_point EXPERIMENT POINT SECONDS -> $OUT/EXPERIMENT__POINT.json
device_point() {
    timeout "$3" python3 -m longstraw point "experiments/$1.yaml" --profile h200 --point "$2" \
        --out "$OUT/$1__$2.json" 2>&1 | grep -v "^\s*$" | tail -40
}
