"""Experiment points: a YAML/dict config -> one measured result dict (status ok / oom / error).

    python -m longstraw run experiments/examples/step_cpu.yaml --out results/step.json

Three kinds of point:
- `step`: build the policy, make a prompt and G responses (seeded random tokens with seeded
  rewards: a memory/time measurement needs shapes, not meaning), run `cycles` GRPO steps in
  the chosen mode; with `replay`/`hold_all` one capture serves every cycle.
- `capture`: capture only; reports time, positions/s, resident bytes against the prediction
  and the transient memory (peak minus what was there before minus the resident state),
  then times one replay (forward + backward).
- `capacity`: the largest prompt length whose step fits (`longstraw.capacity`).
- `sweep`: one capture serving a series of steps, `sweep.replay` then `sweep.hold_all` group
  sizes in order, each mode stopping at its first out-of-memory step (recorded with the peak
  it reached). Capture is measured as in `capture` (attention time and rate included), and
  with `measure.kernel_rates` the run also times torch's causal SDPA and the attention and GEMM
  kernels on this device, so ratios against them come from one run.
- `validation`: the four validation levels (`longstraw.validation`) on each path the point names
  (models x gradient modes); HF's own backward is the reference (its torch GDN kernel, scoped to
  the reference: `hf_reference.hf_torch_gdn_kernels`).
- `staleness`: the fresh-prefix oracle (`longstraw.oracle`): capture once, train `staleness.steps`
  steps on the stale state, and at each step measure its drift against a fresh capture; the
  derived refresh interval is the largest step count whose loss drift stays under
  `staleness.threshold`.

Every result carries provenance and the resolved config. Out-of-memory is a result, not a crash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from longstraw import grpo
from longstraw.config import resolve_config
from longstraw.measure import PhaseRecorder, peak_rss_bytes, provenance
from longstraw.transaction import capture, replay

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def build_policy(model_cfg: dict):
    """The policy model a point trains: preset or local checkpoint, optional NF4, optional LoRA."""
    from longstraw.lora import apply_lora
    from longstraw.models import build_model, load_pretrained

    if model_cfg["dtype"] not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(_DTYPES)}, got {model_cfg['dtype']!r}")
    dtype = _DTYPES[model_cfg["dtype"]]
    if model_cfg["path"]:
        model = load_pretrained(model_cfg["path"], dtype=dtype, device=model_cfg["device"])
    else:
        model = build_model(model_cfg["preset"], seed=model_cfg["seed"], dtype=dtype, device=model_cfg["device"],
                            **model_cfg["overrides"])
    if model_cfg["nf4"]:
        from longstraw.quant import quantize_nf4

        model = quantize_nf4(model, compute_dtype=dtype)
    if model_cfg["lora"]:
        model = apply_lora(model, **model_cfg["lora"])
    return model


def seeded_tokens(n: int, seed: int, vocab: int, device) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).to(device)


def policy_and_prompt(cfg: dict, recorder: PhaseRecorder):
    """Build the policy (timed as the `weights` phase) and the point's seeded prompt tokens."""
    with recorder.phase("weights"):
        model = build_policy(cfg["model"])
    vocab = model.get_input_embeddings().weight.shape[0]
    return model, vocab, seeded_tokens(cfg["prompt"]["length"], cfg["prompt"]["seed"], vocab, recorder.device)


def capture_kwargs(cfg: dict) -> dict:
    """The `capture` settings a config sets (unset ones keep capture()'s defaults), and the
    context-parallel group when the run has one (`cp_size`, or launched by torchrun)."""
    from longstraw.cp import context_parallel

    kwargs = {k: v for k, v in cfg["capture"].items() if v is not None}
    cp = context_parallel(cfg["cp_size"], torch.device(cfg["model"]["device"]).type)
    return {**kwargs, "cp": cp} if cp is not None else kwargs


def seeded_group(cfg: dict, count: int, vocab: int, device):
    """`count` seeded random responses and seeded rewards (shapes for memory and time, not meaning)."""
    rcfg = cfg["responses"]
    responses = [seeded_tokens(rcfg["length"], rcfg["seed"] + i, vocab, device) for i in range(count)]
    return responses, torch.rand(count, generator=torch.Generator().manual_seed(rcfg["seed"]))


KINDS = ("step", "capture", "capacity", "sweep", "staleness", "validation")


def run_point(raw: dict, source: str = "config", on_progress=None) -> dict:
    """Run one experiment point; never raises for OOM or runtime failure (recorded as status).

    `on_progress(partial_result)` is called after each finished step of a `sweep` or `staleness`
    point, so a run cut off later still leaves what it measured.
    """
    cfg = resolve_config(raw, source)
    if cfg["kind"] not in KINDS:
        raise ValueError(f"{source}: kind must be one of {KINDS}, got {cfg['kind']!r}")
    device = torch.device(cfg["model"]["device"])
    cp = _context_parallel(cfg, source)
    if cp is not None and cp.rank != 0:
        on_progress = None  # rank 0 writes the result
    if cfg["mode"] == "naive" and cfg["kind"] == "step" and device.type == "cuda":
        use_hf_torch_gdn()
    result = {"name": cfg["name"], "kind": cfg["kind"], "config": cfg, "provenance": provenance(device)}
    start = time.perf_counter()

    def partial(metrics):
        if on_progress:
            on_progress({**result, "status": "partial", "metrics": metrics, "wall_seconds": time.perf_counter() - start})

    try:
        if cfg["kind"] == "step":
            result["metrics"] = _run_step(cfg, device)
        elif cfg["kind"] == "capture":
            result["metrics"] = _run_capture(cfg, device)
        elif cfg["kind"] == "staleness":
            result["metrics"] = _run_staleness(cfg, device, partial)
        elif cfg["kind"] == "validation":
            from longstraw.validation import run_validation

            result["metrics"] = run_validation(cfg, device, progress=lambda line: print(line, file=sys.stderr,
                                                                                         flush=True))
        elif cfg["kind"] == "sweep":
            result["metrics"] = _run_sweep(cfg, device, partial)
        else:
            from longstraw.capacity import find_capacity

            result["metrics"] = find_capacity(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
        result["status"] = "ok"
    except torch.OutOfMemoryError as exc:
        result["status"] = "oom"
        result["error"] = str(exc).splitlines()[0]
        if device.type == "cuda":
            result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    except Exception as exc:  # recorded, not swallowed: the CLI exits non-zero on status error
        result["status"] = "error"
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    result["wall_seconds"] = time.perf_counter() - start
    result["peak_rss_bytes"] = peak_rss_bytes()
    if cp is not None:
        result["cp"] = _rank_records(cp, result)
    return result


def _context_parallel(cfg: dict, source: str):
    """The run's CP group (None for a single process); kinds without a resident state refuse it."""
    from longstraw.cp import context_parallel

    cp = context_parallel(cfg["cp_size"], torch.device(cfg["model"]["device"]).type)
    if cp is not None and cp.world > 1 and (cfg["kind"] == "capacity" or cfg["mode"] == "naive"):
        raise ValueError(f"{source}: cp_size={cp.world} shards a captured prompt; kind {cfg['kind']!r} with mode "
                         f"{cfg['mode']!r} has none to shard (capacity probes run as single processes)")
    return cp


def _rank_records(cp, result: dict) -> dict:
    """Per-rank memory, gathered to rank 0: {"size", "rank", "ranks": [per rank] (rank 0 only)}.
    A rank's peak is its process's CUDA max_memory_allocated (across phases) or its peak RSS."""
    from longstraw.measure import process_peak_allocated_bytes

    record = {"rank": cp.rank, "device": str(cp.device), "status": result["status"],
              "resident_bytes": cp.resident_bytes, "peak_rss_bytes": peak_rss_bytes()}
    if cp.device.type == "cuda":
        record["peak_allocated_bytes"] = process_peak_allocated_bytes(cp.device)
    ranks = cp.gather_objects(record)
    return {"size": cp.world, "rank": cp.rank, **({"ranks": ranks} if ranks is not None else {})}


def run_point_in_fresh_process(config: dict, workdir) -> dict:
    """`longstraw run` on `config` in a new process (clean allocator, a peak RSS of its own).

    Returns the result file's dict; if the process wrote none, an `error` result with its stderr.
    """
    name = config["name"].replace("/", "_")
    spec, out = Path(workdir) / f"{name}.yaml", Path(workdir) / f"{name}.json"
    spec.write_text(json.dumps(config))  # JSON is valid YAML
    proc = subprocess.run([sys.executable, "-m", "longstraw", "run", str(spec), "--out", str(out)],
                          capture_output=True, text=True)
    if not out.exists():
        return {"name": config["name"], "status": "error", "error": proc.stderr[-2000:]}
    return json.loads(out.read_text())


def _run_step(cfg: dict, device) -> dict:
    from longstraw.lora import trainable_parameters
    from longstraw.step import grpo_step

    recorder = PhaseRecorder(device)
    model, vocab, prompt = policy_and_prompt(cfg, recorder)
    count = cfg["responses"]["count"]
    responses, rewards = seeded_group(cfg, count, vocab, device)
    config = grpo.GRPOConfig(num_generations=count, **cfg["grpo"])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg["optimizer"]["lr"])
    state, cycles = None, []
    for _ in range(cfg["cycles"]):
        metrics = grpo_step(model, prompt, responses, rewards, optimizer, config, mode=cfg["mode"], state=state,
                            capture_kwargs=capture_kwargs(cfg), device=device,
                            members=cfg["responses"]["probe_members"])
        state = metrics.pop("state")
        cycles.append(metrics)
    return {"weights": recorder.phases["weights"], "trainable_parameters": trainable_parameters(model),
            "cycles": cycles, **_summary(cycles)}


def _summary(cycles: list) -> dict:
    """Peaks over all cycles per phase, and the step's overall peak."""
    phases: dict = {}
    for c in cycles:
        for name, rec in c["phases"].items():
            agg = phases.setdefault(name, {"seconds": 0.0, "count": 0})
            agg["seconds"] += rec["seconds"]
            agg["count"] += rec.get("count", 1)
            for key in ("peak_allocated_bytes", "peak_rss_bytes"):
                if key in rec:
                    agg[key] = max(agg.get(key, 0), rec[key])
    peaks = [p["peak_allocated_bytes"] for p in phases.values() if "peak_allocated_bytes" in p]
    return {"phase_summary": phases, "peak_allocated_bytes": max(peaks) if peaks else None,
            "graph_bytes_peak": max(c["graph_bytes_peak"] for c in cycles)}


def use_hf_torch_gdn() -> None:
    """Make HF's GDN layers take their own torch chunk kernel instead of fla's (naive on CUDA).

    fla's chunk backward raises on Hopper with Triton 3.4-3.7 (DESIGN.md §2), and HF binds its
    GDN kernel when the modeling module is imported, so `fla` is hidden before that happens. A
    naive step needs no capture (the only place we use fla), so nothing else is lost.
    """
    if "fla" in sys.modules and sys.modules["fla"] is not None:
        raise RuntimeError("naive on CUDA must start in a fresh process: fla is already imported, so HF's "
                           "GDN layers would run fla's backward, which fails on Hopper with this Triton")
    sys.modules["fla"] = None  # `import fla` now raises ImportError; HF falls back to its torch kernel


def _measure_capture(model, prompt, cfg: dict, recorder: PhaseRecorder):
    """Capture with its attention timed; (metrics, state)."""
    from longstraw.measure import AttentionTimer

    device = recorder.device
    before = _current_memory(device)
    with recorder.phase("capture"), AttentionTimer(device) as attention:
        state = capture(model, prompt, **capture_kwargs(cfg))
    rec = recorder.phases["capture"]
    peak = rec.get("peak_allocated_bytes", rec["peak_rss_bytes"])
    by_entry = state.nbytes_by_entry()
    return {
        "model_type": state.model_type,
        "positions": state.positions,
        "positions_per_second": state.positions / max(rec["seconds"], 1e-9),
        "resident_bytes": state.nbytes,
        "predicted_resident_bytes": state.predicted_nbytes,
        "resident_bytes_by_entry": by_entry,
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


def _run_capture(cfg: dict, device) -> dict:
    """Capture, then one timed replay (forward + backward) of a response of `responses.length`."""
    recorder = PhaseRecorder(device)
    model, vocab, prompt = policy_and_prompt(cfg, recorder)
    metrics, state = _measure_capture(model, prompt, cfg, recorder)
    response = seeded_tokens(cfg["responses"]["length"], cfg["responses"]["seed"], vocab, device)
    with recorder.phase("replay"):
        replay(model, state, response).sum().backward()
    return {"phases": recorder.phases, **metrics, "replay_seconds": recorder.phases["replay"]["seconds"],
            "response_length": int(response.numel())}


def _run_sweep(cfg: dict, device, on_progress) -> dict:
    """One capture, then steps at each (mode, G) of `sweep`; a mode stops at its first OOM."""
    from longstraw.lora import trainable_parameters
    from longstraw.step import grpo_step

    recorder = PhaseRecorder(device)
    model, vocab, prompt = policy_and_prompt(cfg, recorder)
    out = {"weights": recorder.phases["weights"], "trainable_parameters": trainable_parameters(model)}
    if cfg["measure"]["kernel_rates"]:
        from longstraw.kernel_rates import measure_kernel_rates

        out["kernel_rates"] = measure_kernel_rates(_unwrapped_config(model), device=device,
                                                   response_length=cfg["responses"]["length"],
                                                   dtype=_DTYPES[cfg["model"]["dtype"]])
    out["capture"], state = _measure_capture(model, prompt, cfg, recorder)
    out["capture"]["phase"] = recorder.phases["capture"]
    out["steps"] = []
    on_progress(out)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg["optimizer"]["lr"])
    for mode in ("replay", "hold_all"):
        for count in cfg["sweep"][mode]:
            responses, rewards = seeded_group(cfg, count, vocab, device)
            config = grpo.GRPOConfig(num_generations=count, **cfg["grpo"])
            step = {"mode": mode, "count": count}
            try:
                metrics = grpo_step(model, prompt, responses, rewards, optimizer, config, mode=mode, state=state,
                                    device=device)
                metrics.pop("state")
                peaks = [p["peak_allocated_bytes"] for p in metrics["phases"].values() if "peak_allocated_bytes" in p]
                step.update(status="ok", **metrics, peak_allocated_bytes=max(peaks) if peaks else None)
            except torch.OutOfMemoryError as exc:
                step.update(status="oom", error=str(exc).splitlines()[0], peak_allocated_bytes=(
                    torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None))
            optimizer.zero_grad(set_to_none=True)
            del responses
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if getattr(state, "cp", None) is not None:  # each rank's peak; an OOM on any rank ends the mode on all
                ranks = state.cp.all_gather_objects({"status": step["status"],
                                                     "peak_allocated_bytes": step.get("peak_allocated_bytes")})
                step["rank_peak_allocated_bytes"] = [r["peak_allocated_bytes"] for r in ranks]
                step["rank_status"] = [r["status"] for r in ranks]
            out["steps"].append(step)
            peak = step.get("peak_allocated_bytes")
            if getattr(state, "cp", None) is None or state.cp.rank == 0:  # one line per step, not per rank
                print(f"sweep {mode} G={count}: {step['status']}" + (f", peak {peak / 2**30:.2f} GiB" if peak else ""),
                      file=sys.stderr, flush=True)
            on_progress(out)
            if "oom" in step.get("rank_status", [step["status"]]):
                break
    return out


def _run_staleness(cfg: dict, device, on_progress) -> dict:
    from longstraw.oracle import refresh_interval, staleness_oracle

    recorder = PhaseRecorder(device)
    model, _, prompt = policy_and_prompt(cfg, recorder)
    rcfg, settings = cfg["responses"], cfg["staleness"]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg["optimizer"]["lr"])
    config = grpo.GRPOConfig(num_generations=rcfg["count"], **cfg["grpo"])
    rows = []

    def metrics():
        return {"rows": rows, "threshold": settings["threshold"],
                "refresh_interval": refresh_interval(rows, settings["threshold"]),
                "prompt_positions": int(prompt.numel()), "phases": recorder.phases}

    def progress(row):
        rows.append(row)
        print(f"staleness step {row['step']}: loss drift {row['relative_loss_drift']:.3e}", file=sys.stderr, flush=True)
        on_progress(metrics())

    with recorder.phase("oracle"):
        staleness_oracle(model, prompt, optimizer, config, steps=settings["steps"], num_samples=rcfg["count"],
                         max_new_tokens=rcfg["length"], seed=rcfg["seed"], capture_kwargs=capture_kwargs(cfg),
                         progress=progress)
    return metrics()


def _unwrapped_config(model):
    from longstraw.adapters.base import unwrap_causal_lm

    return unwrap_causal_lm(model).config


def _current_memory(device) -> int:
    """Allocated CUDA bytes, or this process's current RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
