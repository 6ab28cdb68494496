"""The four validation levels (docs/design.md), measured path by path.

    longstraw validate experiments/validation.yaml --profile cpu --out results/validation-cpu.json
    longstraw point experiments/validation.yaml --profile cpu --point families --out r.json   # one point

A path is model family x gradient mode x scale (prompt positions, model, device). Gradient modes:
`response-only` (the paper's: capture, replay, the conditional-response gradient) and `exact`
(`capture(..., prefix_grad=True)` + `state.backward_prefix()`: the full-sequence gradient). Every
level gives {level, reached (True / False; None: not run), tolerance, evidence (numbers), scale, note}.

- V1 executes: one GRPO step (`grpo_step`, mode replay; exact: `prefix_grad=True`) on the point's
  seeded prompt, responses and rewards completes with a finite loss and gradient norm, the resident
  state's fingerprint unchanged after all replays, and on CUDA every phase's peak allocated bytes
  below the device's total memory (on CPU there is no ceiling: completing is the check). Exact mode
  also reports backward_prefix's time and peak against the capture's.
- V2 conditional-response parity: the gradient of L = sum_i sum_t w_it log p(y_it | p, y_i<t) (w
  seeded uniform in [-1, 2]: any objective of the log-probs reaches the parameters through such a
  vector-Jacobian product) from our replays (exact mode: before backward_prefix) against the same L
  through `hf_conditional_logprobs` (HF forward of p[:-1] without grad into a cache, then p[-1] + y
  on it with grad). Reached when ||g - g_ref|| / ||g_ref|| over the whole trainable gradient vector
  is within the tolerance: 1e-4 in float32. In bfloat16 / float16 both sides carry rounding noise
  that grows with the prompt, so a fixed tolerance says little at long context: there both gradients
  are also compared with the reference computed on a float32 copy of the model (g32), and the level is
  reached when ||g - g32|| / ||g32|| <= max(2e-2, 2 x ||g_ref - g32|| / ||g32||), i.e. our path is
  no further from float32 than twice HF's own low-precision path (NF4 models, which have no float32
  copy, and points where HF's float32 pass runs out of memory keep the fixed 2e-2, and say so). Whole
  vector, not per parameter: HF's own one-pass and cache paths
  differ by ~1% on Gated DeltaNet's tiny decay-parameter gradients (`hf_reference.global_relative_error`).
- V3 full-sequence parity: the same gradient against HF one-pass autograd over p + y
  (`hf_full_logprobs`). Exact mode: reached within the same tolerance. Response-only mode drops the
  prompt-side term by design, so it is not reached; its evidence is the gap: the cosine between our
  gradient and the full one, and ||g_full - g|| / ||g_full||, the relative norm of the dropped term.
- V4 policy improvement: the trainer (`longstraw.training.trainer`, response-only) on a verifiable task, run
  twice from the same weights and seeds, so on the same prompts: with the point's learning rate and
  with 0. Reached when the paired gain on the prompts first visited in the last `window` steps (each
  prompt's first step: mean reward, trained minus lr-0) exceeds 3 standard errors of those differences
  (`longstraw.training.improvement.first_visit_gain`, the rule the learning kind uses too).

Report: one row per point (how many of its paths reached each level), and one row per path in a
table of its own (`paths`: each level's state and its evidence in words and numbers) that the
report's validation section shows beside the step points' V1 paths (`longstraw.report.levels`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from longstraw.config import PointConfig
from longstraw.config.point import trainer_sections
from longstraw.config.train import resolve_train
from longstraw.config.typed import ConfigError, bounded
from longstraw.kinds.checks import check_named_preset
from longstraw.kinds.columns import family_of, model_type_of
from longstraw.kinds.spec import Built, Kind
from longstraw.models.presets import PRESETS
from longstraw.results import as_dict

if TYPE_CHECKING:
    import torch

    from longstraw.kinds.common import Progress

MODES = ("response-only", "exact")
LEVELS = ("V1", "V2", "V3", "V4")
TOLERANCES = {"float32": 1e-4, "float64": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
NOISE_FACTOR = 2.0  # low precision: our error to float32 may be this multiple of HF's own
V1_TOLERANCE = (
    "finite loss and gradient norm, resident fingerprint unchanged after all replays; CUDA: every "
    "phase's peak allocated bytes below the device's total memory (CPU: completed, no ceiling)"
)


@dataclass
class ValidationConfig:
    """The validation levels (`longstraw.kinds.validation`): gradient modes and levels per path;
    `presets`: the models (empty: `model` alone); `tolerance`: V2/V3's (None: by dtype); `window`:
    V4's k steps; `train`: V4's trainer settings (a `longstraw train` config without model, grpo
    and capture, which are the point's)."""

    modes: list[Literal["response-only", "exact"]] = field(default_factory=lambda: ["response-only", "exact"])
    levels: list[Literal["V1", "V2", "V3", "V4"]] = field(default_factory=lambda: ["V1", "V2", "V3"])
    presets: list[str] = field(default_factory=list)
    tolerance: float | None = bounded(None, gt=0)
    weights_seed: int = 0
    window: int = bounded(8, min=2)  # V4 pairs the last `window` steps' prompts (at least 2)
    train: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.modes or not self.levels:
            raise ValueError("modes and levels must not be empty")
        if "V4" in self.levels and not self.train:
            raise ValueError("train: level V4 needs the trainer's settings (task, steps, sampling, ...)")


def trainer_mapping(cfg: PointConfig, lr: float, out_dir) -> dict:
    """The trainer's config for a validation point's V4: `trainer_sections` and `lr`, then
    `validation.train` (task, steps, sampling, ...)."""
    train = copy.deepcopy(cfg.validation.train)
    sections = trainer_sections(cfg, out_dir)
    merged = {**sections, **train}
    merged["grpo"] = {**sections["grpo"], **train.get("grpo", {})}  # the trainer's own group size, the point's rest
    merged["optimizer"] = {**train.get("optimizer", {}), "lr": lr}
    merged["output"] = {"dir": str(out_dir), "checkpoint_every": 0}
    return merged


def check(cfg: PointConfig, source: str) -> None:
    """Its presets ones this package has; with V4, a trainer config that resolves, a task it can build, and a
    window of at least two prompts within the trainer's steps (V4 pairs prompts)."""
    for i, name in enumerate(cfg.validation.presets):
        check_named_preset(name, f"{source}: validation.presets[{i}]")
    if "V4" not in cfg.validation.levels:
        return
    train = resolve_train(trainer_mapping(cfg, cfg.optimizer.lr, "unused"), f"{source}: validation.train")
    from longstraw.training.improvement import first_visits
    from longstraw.training.tasks import check_task_spec

    check_task_spec(train.task, f"{source}: validation.train.task")
    window = cfg.validation.window
    if window > train.steps:
        raise ConfigError(
            f"{source}: validation.window: {window} is more than the trainer's "
            f"{train.steps} steps (validation.train.steps)"
        )
    # V4 pairs the prompts first visited in the window: fewer than two cannot give a standard error
    firsts = first_visits(train.steps, window, train.steps_per_prompt)
    if firsts < 2:
        raise ConfigError(
            f"{source}: validation.window: the last {window} steps hold {firsts} prompts' first steps "
            f"({train.steps_per_prompt} steps per prompt); V4 needs at least 2"
        )


def level(name: str, reached, tolerance: str, evidence: dict, scale: dict, note: str = "") -> dict:
    return {
        "level": name,
        "reached": reached,
        "tolerance": tolerance,
        "evidence": evidence,
        "scale": scale,
        "note": note,
    }


def not_run(name: str, scale: dict, note: str = "not run at this point") -> dict:
    return level(name, None, "", {}, scale, note)


def highest_level(levels: list[dict]) -> str:
    """The highest level reached (levels are not nested: V4 can hold where V3 does not)."""
    reached = [entry["level"] for entry in levels if entry["reached"]]
    return max(reached, key=LEVELS.index) if reached else "none"


# ------------------------------------------------------------------------------------------ V2, V3


def objective_weights(responses, seed: int) -> list[torch.Tensor]:
    """Per-token weights w_it, seeded uniform in [-1, 2] (float32, on the responses' device)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [(torch.rand(y.numel(), generator=generator) * 3 - 1).to(y.device) for y in responses]


def _trainable_grads(model) -> dict:
    return {
        n: p.grad.detach().float().clone()
        for n, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }


def _reference_gradient(model, logprobs, prompt, responses, weights) -> dict:
    """Gradient of L through an HF reference, one response's graph at a time (HF's torch GDN
    kernel: fla's backward fails on Hopper; our own capture keeps fla's forward)."""
    from longstraw.core.hf_reference import grads_of, hf_torch_gdn_kernels

    with hf_torch_gdn_kernels(model):
        grads = grads_of(model, ((logprobs(model, prompt, y) * w).sum() for y, w in zip(responses, weights)))
    return {n: g.float() for n, g in grads.items()}


def our_gradients(model, prompt, responses, weights, mode: str, capture_settings: dict) -> dict:
    """{"conditional": after the replays, "exact": + backward_prefix (exact mode only)}."""
    from longstraw.core.transaction import capture, replay

    model.zero_grad(set_to_none=True)
    state = capture(model, prompt, prefix_grad=mode == "exact", **capture_settings)
    for y, w in zip(responses, weights):
        (replay(model, state, y) * w).sum().backward()
    grads = {"conditional": _trainable_grads(model)}
    if mode == "exact":
        state.backward_prefix()
        grads["exact"] = _trainable_grads(model)
    model.zero_grad(set_to_none=True)
    return grads


def parity(ours: dict, reference: dict, tolerance: float, reference32: dict | None = None) -> tuple[bool, dict]:
    """Whether `ours` matches `reference` (see the module doc); with `reference32`, the float32
    gradient of the same reference, the low-precision criterion anchored to it."""
    from longstraw.core.hf_reference import global_cosine, global_norm, global_relative_error

    error = global_relative_error(ours, reference)
    evidence = {
        "relative_error": error,
        "cosine": global_cosine(ours, reference),
        "reference_norm": global_norm(reference),
        "parameters_compared": len(reference),
    }
    if reference32 is None:
        return error <= tolerance, evidence
    evidence["relative_error_to_float32"] = global_relative_error(ours, reference32)
    evidence["reference_error_to_float32"] = global_relative_error(reference, reference32)
    allowed = max(tolerance, NOISE_FACTOR * evidence["reference_error_to_float32"])
    evidence["allowed_error_to_float32"] = allowed
    return evidence["relative_error_to_float32"] <= allowed, evidence


def float32_copy(model, cfg: PointConfig):
    """A float32 copy of the policy for the low-precision anchor, or None (float32 already, or NF4)."""
    if cfg.model.dtype in ("float32", "float64") or cfg.model.nf4:
        return None
    return copy.deepcopy(model).float()


def gradient_levels(model, prompt, responses, cfg: PointConfig, mode: str, scale: dict) -> dict:
    """V2 and V3 (the ones `validation.levels` asks for) for one path."""
    from longstraw.core.hf_reference import hf_conditional_logprobs, hf_full_logprobs
    from longstraw.kinds.common import capture_kwargs

    wanted = cfg.validation.levels
    tol = tolerance(cfg)
    weights = objective_weights(responses, cfg.validation.weights_seed)
    ours = our_gradients(model, prompt, responses, weights, mode, capture_kwargs(cfg))
    references = _References(model, float32_copy(model, cfg), prompt, responses, weights)

    def compared(name, ours_g, logprobs, note):
        """A level reached by parity with HF's `logprobs` path, anchored to float32 where it fits."""
        reference, reference32 = references.pair(logprobs)
        reached, evidence = parity(ours_g, reference, tol, reference32)
        if reference32 is None and references.anchor_wanted:
            evidence["float32_anchor"] = "out of memory"
        stated = _stated_tolerance(tol, cfg.model.dtype, reference32 is not None, references.anchor_wanted)
        return level(name, reached, stated, {**evidence, **references.evidence(logprobs)}, scale, note)

    out = {}
    if "V2" in wanted:
        out["V2"] = compared(
            "V2",
            ours["conditional"],
            hf_conditional_logprobs,
            "against HF's cache path (p[:-1] no "
            "grad, then p[-1] + y with grad)" + (", before backward_prefix" if mode == "exact" else ""),
        )
    if "V3" in wanted and mode == "exact":
        out["V3"] = compared("V3", ours["exact"], hf_full_logprobs, "against HF one-pass autograd over p + y")
    elif "V3" in wanted:  # response-only: the gap alone, not judged
        full, _ = references.pair(hf_full_logprobs, anchored=False)
        _, evidence = parity(ours["conditional"], full, tol)
        evidence["dropped_term_relative_norm"] = evidence.pop("relative_error")
        out["V3"] = level(
            "V3",
            False,
            "not reachable: response-only drops the prompt-side term by design; the gap is measured",
            {**evidence, **references.evidence(hf_full_logprobs)},
            scale,
            "gap to HF one-pass autograd over p + y: cosine and ||g_full - g|| / ||g_full||",
        )
    return out


class _References:
    """HF's reference gradients of one path, each beside HF's on the float32 copy (`model32`) while that fits."""

    def __init__(self, model, model32, prompt, responses, weights):
        from longstraw.measure.memory import PhaseRecorder

        self.model, self.model32, self.inputs = model, model32, (prompt, responses, weights)
        self.anchor_wanted = model32 is not None
        self.recorder = PhaseRecorder(prompt.device)  # the references' time and peak: what bounds V2/V3's scale

    def pair(self, logprobs, anchored=True):
        """(HF's gradient, HF's on the float32 copy or None); once the float32 pass runs out of memory
        the anchor is dropped for the rest of the path."""
        import torch

        with self.recorder.phase(logprobs.__name__):
            reference = _reference_gradient(self.model, logprobs, *self.inputs)
        if self.model32 is None or not anchored:
            return reference, None
        try:
            with self.recorder.phase(f"{logprobs.__name__}_float32"):
                return reference, _reference_gradient(self.model32, logprobs, *self.inputs)
        except torch.OutOfMemoryError:  # HF's float32 pass keeps twice the activations: fixed tolerance then
            pass
        self.model32 = None  # (outside the handler: its traceback held the failed graph)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return reference, None

    def evidence(self, logprobs) -> dict:
        return phase_evidence({n: r for n, r in self.recorder.phases.items() if n.startswith(logprobs.__name__)})


def _stated_tolerance(tol: float, dtype: str, anchored: bool, anchor_wanted: bool) -> str:
    """The criterion a V2/V3 comparison was judged by, in words."""
    if anchored:
        return (
            f"||g - g32|| / ||g32|| <= max({tol:.0e}, {NOISE_FACTOR:g} x ||g_ref - g32|| / ||g32||) over "
            f"the whole gradient vector; g_ref: HF in {dtype}, g32: HF on a float32 copy"
        )
    if anchor_wanted:
        return (
            f"||g - g_ref|| / ||g_ref|| <= {tol:.0e} over the whole gradient vector ({dtype}; the float32 "
            "anchor did not fit in memory)"
        )
    return f"||g - g_ref|| / ||g_ref|| <= {tol:.0e} over the whole gradient vector ({dtype})"


def phase_evidence(phases: dict) -> dict:
    """{<phase>_seconds, <phase>_peak_allocated_bytes (CUDA)} of `PhaseRecorder` phases."""
    out = {}
    for name, record in phases.items():
        out[f"{name}_seconds"] = record["seconds"]
        if "peak_allocated_bytes" in record:
            out[f"{name}_peak_allocated_bytes"] = record["peak_allocated_bytes"]
    return out


def tolerance(cfg: PointConfig) -> float:
    stated = cfg.validation.tolerance
    return float(stated) if stated is not None else TOLERANCES[cfg.model.dtype]


# ---------------------------------------------------------------------------------------------- V1


def execute(model, prompt, responses, rewards, cfg: PointConfig, mode: str, device, scale: dict) -> dict:
    """V1: one GRPO step in replay mode (exact: with backward_prefix), checked and measured."""
    import torch

    from longstraw.core.step import StepOptions, grpo_step
    from longstraw.kinds.common import capture_kwargs, optimizer_for

    options = StepOptions(mode="replay", capture=capture_kwargs(cfg), prefix_grad=mode == "exact")
    metrics = grpo_step(model, prompt, responses, rewards, optimizer_for(model, cfg), cfg.grpo, options).metrics
    phases = metrics["phases"]
    finite = math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    evidence = {
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "state_unchanged": metrics["state_unchanged"],
        "replays": len(responses),
        "resident_bytes": metrics["resident_bytes"],
        "step_seconds": sum(p["seconds"] for p in phases.values()),
        **phase_evidence(phases),
    }
    if "prefix_backward" in phases:
        evidence["prefix_backward_over_capture"] = phases["prefix_backward"]["seconds"] / phases["capture"]["seconds"]
    under = True
    if device.type == "cuda":
        peak = max(p["peak_allocated_bytes"] for p in phases.values())
        ceiling = torch.cuda.get_device_properties(device).total_memory
        evidence.update(peak_allocated_bytes=peak, ceiling_bytes=ceiling)
        under = peak < ceiling
    else:
        evidence["peak_rss_bytes"] = max(p["peak_rss_bytes"] for p in phases.values())
    reached = finite and metrics["state_unchanged"] and under
    return level(
        "V1",
        reached,
        V1_TOLERANCE,
        evidence,
        scale,
        "one GRPO step, mode replay" + (" with backward_prefix" if mode == "exact" else ""),
    )


# ---------------------------------------------------------------------------------------------- V4


def policy_improvement(cfg: PointConfig, scale: dict, progress: Progress) -> dict:
    from longstraw.training.improvement import SIGMAS, first_visit_gain
    from longstraw.training.trainer import Trainer

    window = cfg.validation.window
    runs = {}
    with tempfile.TemporaryDirectory(prefix="longstraw-v4-") as tmp:
        for name, lr in (("trained", cfg.optimizer.lr), ("untrained", 0.0)):
            trainer = Trainer(trainer_mapping(cfg, lr, Path(tmp) / name), source="validation.train")
            runs[name] = trainer.run(resume=False)
            progress.line(
                f"V4 {name} run (lr {lr:g}): mean reward per step "
                + " ".join(f"{sum(m['rewards']) / len(m['rewards']):.2f}" for m in runs[name])
            )
    first_step = len(runs["trained"]) - window  # the plan checked that the window fits the run
    evidence = first_visit_gain(runs["trained"], runs["untrained"], first_step)
    evidence.update(lr=cfg.optimizer.lr, window_steps=window, steps=len(runs["trained"]))
    task = trainer.cfg.task
    stated = (
        f"paired gain over the lr-0 run on the prompts first visited in the last {window} steps (each prompt's "
        f"first step: mean reward, same prompts and seeds) above {SIGMAS:g} standard errors of the differences"
    )
    return level(
        "V4",
        evidence["reached"],
        stated,
        evidence,
        {**scale, "prompt_positions": task.get("length")},
        f"trainer on {task.get('name')} ({', '.join(f'{k}={v}' for k, v in task.items() if k != 'name')}), "
        f"{trainer.cfg.grpo.num_generations} responses per step",
    )


# ------------------------------------------------------------------------------------------- paths


def validate_path(cfg: PointConfig, mode: str, device, progress: Progress) -> dict:
    """Every level `validation.levels` asks for, on one path (a fresh model: V1 steps its optimizer)."""
    from longstraw.kinds.common import seeded_group, seeded_tokens
    from longstraw.measure.provenance import device_name
    from longstraw.models.policy import build_policy

    model = build_policy(cfg.model)
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = seeded_tokens(cfg.prompt.length, cfg.prompt.seed, vocab, device)
    responses, rewards = seeded_group(cfg, cfg.grpo.num_generations, vocab, device)
    model_name = cfg.model.path or cfg.model.preset
    scale = {
        "prompt_positions": int(prompt.numel()),
        "model": model_name,
        "device": device_name(device),
        "dtype": cfg.model.dtype,
    }
    wanted = cfg.validation.levels
    done = {}
    if "V2" in wanted or "V3" in wanted:  # before V1, whose optimizer step moves the weights
        done.update(gradient_levels(model, prompt, responses, cfg, mode, scale))
    if "V1" in wanted:
        done["V1"] = execute(model, prompt, responses, rewards, cfg, mode, device, scale)
    del model
    if "V4" in wanted:
        done["V4"] = (
            policy_improvement(cfg, scale, progress)
            if mode == "response-only"
            else not_run("V4", scale, "the trainer steps in response-only mode; V4 is not run for exact mode")
        )
    levels = [done.get(name) or not_run(name, scale) for name in LEVELS]
    path = {
        "model": model_name,
        "model_type": _model_type(cfg),
        "gradient_mode": mode,
        "scale": scale,
        "levels": levels,
        "highest_level": highest_level(levels),
    }
    for entry in levels:
        progress.line(f"{model_name} {mode} {entry['level']}: {describe(entry)}")
    return path


def _model_type(cfg: PointConfig) -> str:
    if cfg.model.path:
        return Path(cfg.model.path).name
    return PRESETS[cfg.model.preset].model_type


def describe(entry: dict) -> str:
    """One line: reached or not, and the level's key numbers."""
    state = {True: "reached", False: "not reached", None: "not run"}[entry["reached"]]
    shown = {k: v for k, v in entry["evidence"].items() if k in KEY_EVIDENCE}
    numbers = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())
    return state + (f" ({numbers})" if numbers else "") + (f"; {entry['note']}" if entry["reached"] is None else "")


KEY_EVIDENCE = (
    "relative_error",
    "dropped_term_relative_norm",
    "cosine",
    "loss",
    "grad_norm",
    "state_unchanged",
    "peak_allocated_bytes",
    "prefix_backward_over_capture",
    "gain",
    "standard_error",
    "trained_mean",
    "untrained_mean",
)


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    """A `validation` point: every (model, gradient mode) path; `validation.presets` lists the
    models (empty: the point's model alone)."""
    presets = cfg.validation.presets or [None]
    paths = []
    for preset in presets:
        point = (
            cfg
            if preset is None
            else dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, preset=preset, path=None))
        )
        by_mode = {mode: validate_path(point, mode, device, progress) for mode in cfg.validation.modes}
        _compare_exact_cost(by_mode)
        paths += by_mode.values()
    return {
        "paths": paths,
        "models": ", ".join(dict.fromkeys(p["model"] for p in paths)),
        "tolerance": tolerance(cfg),
        "reached": reached_counts(paths),
    }


def _compare_exact_cost(by_mode: dict) -> None:
    """Exact mode's V1 evidence gains the response-only step's time and peak at the same point."""
    if "exact" not in by_mode or "response-only" not in by_mode:
        return
    exact, plain = (by_mode[m]["levels"][0]["evidence"] for m in ("exact", "response-only"))
    for key in ("step_seconds", "peak_allocated_bytes", "capture_seconds"):
        if key in exact and key in plain:
            exact[f"response_only_{key}"] = plain[key]


# ------------------------------------------------------------------------------------ the summary


def cell(entry: dict) -> str:
    """A level in a few characters: yes / no / - and its deciding number."""
    state = {True: "yes", False: "no", None: "-"}[entry["reached"]]
    e = entry["evidence"]
    if "dropped_term_relative_norm" in e:
        return f"{state} (gap {e['dropped_term_relative_norm']:.3g}, cos {e['cosine']:.3f})"
    if "relative_error" in e:
        return f"{state} (err {e['relative_error']:.2g})"
    if "trained_mean" in e:
        return f"{state} ({e['trained_mean']:.2f} vs lr0 {e['untrained_mean']:.2f})"
    return state


def summary_table(results: list[dict]) -> str:
    """One line per path of every point result (a failed point: its error)."""
    header = ["point", "model", "mode", "positions", *LEVELS, "highest"]
    rows = []
    for result in results:
        if result["status"] != "ok":
            rows.append([result["name"], result.get("error", "")[:60], "", "", "", "", "", "", result["status"]])
            continue
        for path in result["metrics"]["paths"]:
            rows.append(
                [
                    result["name"],
                    path["model"],
                    path["gradient_mode"],
                    f"{path['scale']['prompt_positions']:,}",
                    *(cell(entry) for entry in path["levels"]),
                    path["highest_level"],
                ]
            )
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in [header] + rows)


def reached_counts(paths: list[dict]) -> dict:
    """{level: "reached/run"} over `paths`."""
    entries = [e for p in paths for e in p["levels"]]
    return {
        name: f"{sum(e['reached'] is True for e in entries if e['level'] == name)}/"
        f"{sum(e['reached'] is not None for e in entries if e['level'] == name)}"
        for name in LEVELS
    }


# ------------------------------------------------------------------------------------------- report

# A validation point: how many of its paths reached each level (the paths themselves: the validation section).
SHOWN = [
    "models",
    "prompt_length",
    "reached_V1",
    "reached_V2",
    "reached_V3",
    "reached_V4",
    "tolerance",
    "peak_rss_bytes",
    "wall_seconds",
]
PATHS = "paths"  # the suffix of the paths table
STATE = {True: "reached", False: "not reached", None: "not run"}


def scale_text(model, positions, device, dtype=None) -> str:
    shown = f"{positions:,}" if isinstance(positions, int) else str(positions)
    return f"{model}, {shown} positions, {device}" + (f", {dtype}" if dtype else "")


def _g(value, digits=3) -> str:
    return f"{value:.{digits}g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _v1_text(e: dict) -> str:
    from longstraw.plotting.formatting import format_bytes

    text = (
        f"loss {_g(e.get('loss'), 4)}, gradient norm {_g(e.get('grad_norm'), 4)}, state "
        f"{'unchanged' if e.get('state_unchanged') else 'CHANGED'} after {e.get('replays')} replays"
    )
    if "peak_allocated_bytes" in e:
        text += (
            f", peak allocated {format_bytes(e['peak_allocated_bytes'])} under the device's "
            f"{format_bytes(e.get('ceiling_bytes'))}"
        )
    else:
        text += f", process peak RSS {format_bytes(e.get('peak_rss_bytes'))} (CPU: completed, no ceiling)"
    if "prefix_backward_seconds" in e:
        text += (
            f"; backward_prefix {_g(e['prefix_backward_seconds'])} s = "
            f"{_g(e.get('prefix_backward_over_capture'))}x the capture's {_g(e.get('capture_seconds'))} s"
        )
        if "prefix_backward_peak_allocated_bytes" in e:
            text += f", its peak {format_bytes(e['prefix_backward_peak_allocated_bytes'])}"
    if "response_only_step_seconds" in e:
        text += f"; step {_g(e['step_seconds'])} s against response-only's {_g(e['response_only_step_seconds'])} s"
    if "response_only_peak_allocated_bytes" in e:
        text += (
            f", peak {format_bytes(e['peak_allocated_bytes'])} against response-only's "
            f"{format_bytes(e['response_only_peak_allocated_bytes'])}"
        )
    return text


def _parity_text(e: dict) -> str:
    if "dropped_term_relative_norm" in e:
        return (
            "gap to the full-sequence gradient: ||g_full - g|| / ||g_full|| = "
            f"{_g(e['dropped_term_relative_norm'])}, cosine {e['cosine']:.4f}"
        )
    return f"relative error {e['relative_error']:.2e}, cosine {e['cosine']:.6f}"


def _v4_text(e: dict) -> str:
    return (
        f"mean reward on the last {e['window_steps']} steps' {e['prompts']} prompts: {e['trained_mean']:.3f} "
        f"trained, {e['untrained_mean']:.3f} at lr 0 (paired gain {e['gain']:.3f}, SE {e['standard_error']:.3f}); "
        f"{e['steps']} steps, lr {_g(e.get('lr'))}"
    )


LEVEL_TEXT = {"V1": _v1_text, "V2": _parity_text, "V3": _parity_text, "V4": _v4_text}


def level_cell(entry: dict) -> dict:
    """A measured level as a cell: state, the evidence in words and numbers, note; its tolerance
    apart (the report states each tolerance once and cells refer to it)."""
    if entry.get("reached") is None:
        return {"state": STATE[None], "reached": None, "text": entry.get("note") or STATE[None], "tolerance": None}
    text = LEVEL_TEXT[entry["level"]](entry.get("evidence") or {})
    if entry.get("note"):
        text += f" ({entry['note']})"
    # V1's rule is the levels table's definition
    tolerance = entry.get("tolerance") if entry["level"] != "V1" else None
    return {"state": STATE[entry["reached"]], "reached": entry["reached"], "text": text, "tolerance": tolerance}


def path_row(point: dict, family, model_type, gradient_mode: str, scale: str, cells: dict) -> dict:
    """One path as a table row: {level}_state, {level}_reached, {level}_text, {level}_tolerance for
    every level (a level not given: not run)."""
    row = {
        "point": point.get("point"),
        "source": f"{point.get('experiment')}/{point.get('point')}",
        "family": family,
        "model_type": model_type,
        "gradient_mode": gradient_mode,
        "scale": scale,
    }
    for name in LEVELS:
        cell = cells.get(name) or {"state": STATE[None], "reached": None, "text": STATE[None]}
        row.update(
            {
                f"{name}_state": cell["state"],
                f"{name}_reached": cell["reached"],
                f"{name}_text": cell["text"],
                f"{name}_tolerance": cell.get("tolerance"),
            }
        )
    return row


def path_rows(point: dict) -> list[dict]:
    """One row per path of a validation point; a failed point: one row with its error as V1."""
    if point.get("status") != "ok":
        model_type = model_type_of(point)
        cfg = as_dict(point.get("config"))
        failed = {
            "state": f"status {point.get('status')}",
            "reached": False,
            "text": point.get("error") or "no message",
        }
        return [
            path_row(
                point,
                family_of(model_type),
                model_type,
                "—",
                scale_text(
                    as_dict(cfg.get("model")).get("preset"),
                    as_dict(cfg.get("prompt")).get("length"),
                    as_dict(point.get("provenance")).get("device"),
                ),
                {"V1": failed},
            )
        ]
    rows = []
    for path in as_dict(point.get("metrics")).get("paths") or []:
        scale = path["scale"]
        cells = {entry["level"]: level_cell(entry) for entry in path["levels"]}
        rows.append(
            path_row(
                point,
                family_of(path["model_type"]),
                path["model_type"],
                path["gradient_mode"],
                scale_text(scale["model"], scale["prompt_positions"], scale["device"], scale.get("dtype")),
                cells,
            )
        )
    return rows


def tables(points: list[dict]) -> dict[str, list[dict]]:
    """The paths of every point (a point whose paths cannot be read: one row saying so)."""
    rows = []
    for point in points:
        try:
            rows += path_rows(point)
        except Exception as exc:
            broken = {
                "state": "status error",
                "reached": False,
                "text": f"metrics not readable: {type(exc).__name__}: {exc}",
            }
            rows.append(path_row(point, None, None, "—", "", {"V1": broken}))
    return {PATHS: rows}


def v4_train(cfg: PointConfig):
    """The trainer config of V4 (None without V4)."""
    if "V4" not in cfg.validation.levels:
        return None
    return resolve_train(trainer_mapping(cfg, cfg.optimizer.lr, "unused"), "validation.train")


def models(cfg: PointConfig) -> list[Built] | None:
    """With `validation.presets`, each of them (the point's overrides on each); else the point's model."""
    if not cfg.validation.presets:
        return None
    return [
        Built(name, None, cfg.model.overrides, f"validation.presets[{i}]", dtype=cfg.model.dtype)
        for i, name in enumerate(cfg.validation.presets)
    ]


def longest_runs(cfg: PointConfig) -> list:
    """The point's prompt and responses, and V4's task length and samples."""
    runs = [("prompt.length", cfg.prompt.length, "responses.length", cfg.responses.length)]
    train = v4_train(cfg)
    if train is not None and isinstance(train.task.get("length"), int):
        runs.append(
            (
                "validation.train.task.length",
                train.task["length"],
                "validation.train.sampling.max_new_tokens",
                train.sampling.max_new_tokens,
            )
        )
    return runs


def tasks(cfg: PointConfig) -> list:
    train = v4_train(cfg)
    if train is None:
        return []
    return [("validation.train.task", train.task, [train.task.get("length")], "validation.train.task.length")]


KIND = Kind(
    "validation",
    run=run,
    section=ValidationConfig,
    check=check,
    models=models,
    longest_runs=longest_runs,
    tasks=tasks,
    exact_key=lambda cfg: "validation.modes" if "exact" in cfg.validation.modes else None,
    tables=tables,
    shown=SHOWN,
    contributes={"levels": LEVELS, "level_state": STATE, "scale_text": scale_text, "paths_table": PATHS},
)
