"""What the experiment kinds share: the point's policy and its seeded random prompt and group, the
capture settings (and the context-parallel group), a measured capture, a point run in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from longstraw.config import PointConfig, point_mapping
from longstraw.core.transaction import capture
from longstraw.families.base import unwrap_causal_lm
from longstraw.measure.memory import PhaseRecorder
from longstraw.measure.timing import AttentionTimer
from longstraw.models.policy import DTYPES, build_policy


@dataclass
class Progress:
    """How a long point reports: `partial(metrics)` after each finished step (the CLI keeps them in
    OUT.partial, so a run cut off later still leaves what it measured); `line(text)` to stderr.
    `work_dir`: a folder that outlives the process until the point's result is written (the CLI's
    OUT.work), where a kind keeps what lets the same command, run again after a cut, go on where it
    stopped (a learning point's trainer checkpoints); None: no such folder, the point starts over."""

    partial: Callable[[dict], None] = lambda metrics: None
    work_dir: Path | None = None

    @staticmethod
    def line(text: str) -> None:
        print(text, file=sys.stderr, flush=True)


def seeded_tokens(n: int, seed: int, vocab: int, device) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).to(device)


def policy_and_prompt(cfg: PointConfig, recorder: PhaseRecorder):
    """Build the policy (timed as the `weights` phase) and the point's seeded prompt tokens."""
    with recorder.phase("weights"):
        model = build_policy(cfg.model)
    vocab = model.get_input_embeddings().weight.shape[0]
    return model, vocab, seeded_tokens(cfg.prompt.length, cfg.prompt.seed, vocab, recorder.device)


def seeded_group(cfg: PointConfig, num_generations: int, vocab: int, device):
    """`num_generations` seeded random responses and seeded rewards (shapes for memory and time, not meaning)."""
    r = cfg.responses
    responses = [seeded_tokens(r.length, r.seed + i, vocab, device) for i in range(num_generations)]
    return responses, torch.rand(num_generations, generator=torch.Generator().manual_seed(r.seed))


def capture_kwargs(cfg) -> dict:
    """The `capture` settings a config sets, and the context-parallel group when the run has one
    (`cp_size`, or launched by torchrun)."""
    from longstraw.cp import context_parallel

    kwargs = cfg.capture.kwargs()
    cp = context_parallel(cfg.cp_size, torch.device(cfg.model.device).type)
    return {**kwargs, "cp": cp} if cp is not None else kwargs


def optimizer_for(model, cfg) -> torch.optim.Optimizer:
    from longstraw.training.optimizer import build_optimizer

    return build_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optimizer)


def measure_capture(model, prompt, cfg: PointConfig, recorder: PhaseRecorder):
    """Capture with its attention timed; (metrics, state)."""
    device = recorder.device
    before = current_memory(device)
    with recorder.phase("capture"), AttentionTimer(device) as attention:
        state = capture(model, prompt, **capture_kwargs(cfg))
    rec = recorder.phases["capture"]
    peak = rec.get("peak_allocated_bytes", rec["peak_rss_bytes"])
    return {
        "model_type": state.model_type,
        "positions": state.positions,
        "positions_per_second": state.positions / max(rec["seconds"], 1e-9),
        "resident_bytes": state.nbytes,
        "predicted_resident_bytes": state.predicted_nbytes,
        "resident_bytes_by_entry": state.nbytes_by_entry(),
        "bytes_per_position_measured": state.page_bytes / max(state.local_positions, 1),
        "bytes_per_position_predicted": state.predicted_bytes_per_position,
        "constant_bytes_measured": state.nbytes - state.page_bytes,
        "constant_bytes_predicted": state.predicted_constant_bytes,
        "memory_before_capture_bytes": before,
        "device_resident_bytes": state.device_nbytes,
        "transient_bytes": peak - before - state.device_nbytes,
        "capture_seconds": rec["seconds"],
        "capture_attention": attention.summary(),
    }, state


def model_config(model):
    return unwrap_causal_lm(model).config


def compute_dtype(cfg: PointConfig) -> torch.dtype:
    return DTYPES[cfg.model.dtype]


def current_memory(device) -> int:
    """Allocated CUDA bytes, or this process's current RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_point_in_fresh_process(config: PointConfig, workdir) -> dict:
    """`longstraw run` on `config` in a new process (clean allocator, a peak RSS of its own).

    Returns the result file's dict; if the process wrote none, an `error` result with its stderr.
    """
    name = config.name.replace("/", "_")
    spec, out = Path(workdir) / f"{name}.yaml", Path(workdir) / f"{name}.json"
    spec.write_text(json.dumps(point_mapping(config)))  # JSON is valid YAML
    proc = subprocess.run(
        [sys.executable, "-m", "longstraw", "run", str(spec), "--out", str(out)], capture_output=True, text=True
    )
    if not out.exists():
        return {"name": config.name, "status": "error", "error": proc.stderr[-2000:]}
    return json.loads(out.read_text())
