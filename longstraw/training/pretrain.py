"""Pretrain a small preset from random initialisation on a synthetic long-context task.

    longstraw pretrain experiments/examples/pretrain_cpu.yaml [--set steps=400] [--set out=runs/tiny]
    curve = pretrain(PretrainConfig(model="learn-tiny-hybrid", out="runs/tiny-hybrid"))  # from Python

An ordinary training loop (nanochat style): each step draws one prompt length from `lengths`,
makes a batch of task examples of that length (every sequence is `prompt + answer[:-1]`, so no
padding), runs the HF causal LM forward, a masked cross-entropy, backward, gradient clipping and
AdamW with linear warm-up then cosine decay. Every `eval_every` steps (and at the end) it measures
greedy answer accuracy on held-out examples per prompt length. At the end it writes
`OUT/checkpoint/` (`save_pretrained`; load it with `longstraw.models.load_pretrained`) and
`OUT/curve.json` (both atomically: a checkpoint is there complete or not at all): per-step loss,
the evaluations, the config, provenance, wall seconds and tokens per second.

Simplifications, stated:
- Loss `answer` (default): cross-entropy on the answer tokens only (the filler is random, so
  next-token loss on it is irreducible noise); `next_token`: on every position (reported
  `answer_loss` stays the answer-only loss, for comparison).
- Evaluation is teacher-forced: an example counts as solved when the argmax at every answer
  position equals the answer token. For exact-match rewards this IS greedy decoding's success
  (if every earlier greedy token was right, greedy saw exactly the teacher-forced context), in one
  batched forward. `longstraw.training.length_curve` measures the same through capture + sampling.
- Seeds: training example j of a run with `seed` s uses task seed `s * 2**40 + j`
  (`TRAIN_SEED_STRIDE`); held-out evaluation uses `EVAL_SEED_BASE + i` = 2**62 + i, and the
  length curve `CURVE_SEED_BASE + i` = 2**62 + 2**40 + i: disjoint from training for s < 2**22.
- `init` continues from a checkpoint (a longer-context stage after a short one); the seeds of its
  training examples are those of `seed`, so give a continuation a seed its first stage did not use.
- One length per batch (sequences of one batch share it). `batch_tokens`, when set, sizes each
  batch as `max(1, batch_tokens // length)` so that every step costs about the same; otherwise
  every batch holds `batch_size` sequences.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from longstraw.config.pretrain import PretrainConfig
from longstraw.models.policy import DTYPES
from longstraw.models.real import WEIGHTS
from longstraw.wheels import sha256_of

TRAIN_SEED_STRIDE = 2**40
EVAL_SEED_BASE = 2**62
CURVE_SEED_BASE = 2**62 + 2**40


def lr_factor(step: int, cfg: PretrainConfig) -> float:
    """Linear warm-up to 1, then cosine down to `min_lr_ratio` at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def stage_at(cfg: PretrainConfig, step: int) -> tuple[dict, list[int], float]:
    """The task spec, prompt lengths and aux fraction at `step` (the curriculum's stage, else the config's)."""
    for stage in cfg.stages:
        if step < stage["until"]:
            overrides = {k: v for k, v in stage.items() if k not in ("until", "lengths", "aux_fraction")}
            return (
                {**cfg.task, **overrides},
                stage.get("lengths", cfg.lengths),
                stage.get("aux_fraction", cfg.aux_fraction),
            )
    return cfg.task, cfg.lengths, cfg.aux_fraction


class TaskBank:
    """One task object per (spec, prompt length) (the spec's `length` replaced)."""

    def __init__(self, spec: dict, vocab_size: int):
        import longstraw.training.synthetic  # noqa: F401  (registers "mqar", "periodic")
        from longstraw.training.tasks import build_task

        self.spec, self.vocab_size, self._build, self._tasks = dict(spec), vocab_size, build_task, {}

    def __call__(self, length: int, spec: dict | None = None):
        spec = self.spec if spec is None else spec
        key = (json.dumps(spec, sort_keys=True), int(length))
        if key not in self._tasks:
            self._tasks[key] = self._build({**spec, "length": int(length)}, self.vocab_size)
        return self._tasks[key]


def make_batch(task, seeds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """`batch_of` the task's examples of `seeds`, and the examples."""
    examples = [task.make(int(s)) for s in seeds]
    return (*batch_of(examples), examples)


def batch_of(examples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ids_BT` = prompt + answer[:-1] per example, `answers_BM`, `targets_BT` (the next token at every
    supervised position, -100 elsewhere: the answer's positions, plus `info["supervised"]` prompt
    positions when a task lists them, e.g. mqar's earlier queries)."""
    lengths = {(e.prompt_ids.numel(), len(e.answer)) for e in examples}
    if len(lengths) != 1:
        raise ValueError(f"a batch needs one prompt length and one answer length, got {sorted(lengths)}")
    answers_BM = torch.tensor([e.answer for e in examples], dtype=torch.long)
    ids_BT = torch.cat([torch.stack([e.prompt_ids for e in examples]), answers_BM[:, :-1]], dim=1)
    full_BT = torch.cat([ids_BT, answers_BM[:, -1:]], dim=1)
    targets_BT = torch.full_like(ids_BT, -100)
    P = examples[0].prompt_ids.numel()
    targets_BT[:, P - 1 :] = answers_BM
    for b, e in enumerate(examples):
        positions = torch.as_tensor(e.info.get("supervised", ()), dtype=torch.long)
        targets_BT[b, positions] = full_BT[b, positions + 1]
    return ids_BT, answers_BM, targets_BT


def forward_losses(model, ids_BT, answers_BM, targets_BT, loss: str):
    """(training loss, answer loss) for one batch. `answer`: cross-entropy over the supervised positions
    (logits only from the first of them on); `next_token`: over every position."""
    M = answers_BM.shape[1]
    if loss == "answer":
        supervised = (targets_BT != -100).any(0).nonzero()
        keep = ids_BT.shape[1] - int(supervised[0])
        logits_BKV = model(input_ids=ids_BT, logits_to_keep=keep, use_cache=False).logits.float()
        total = F.cross_entropy(logits_BKV.flatten(0, 1), targets_BT[:, -keep:].flatten())
    else:
        logits_BKV = model(input_ids=ids_BT, use_cache=False).logits.float()
        targets = torch.cat([ids_BT[:, 1:], answers_BM[:, -1:]], dim=1)
        total = F.cross_entropy(logits_BKV.flatten(0, 1), targets.flatten())
    answer_loss = F.cross_entropy(logits_BKV[:, -M:].flatten(0, 1), answers_BM.flatten())
    return total, answer_loss


@torch.no_grad()
def teacher_forced_rewards(model, task, examples, device, autocast=None) -> list[float]:
    """Greedy decoding's exact-match rewards of a batch from one forward over prompt + answer[:-1]:
    while greedy is right it sees exactly the teacher-forced context, so "argmax at every answer
    position is the answer token" is greedy's exact match (exact-match rewards only)."""
    ids_BT, answers_BM, _ = batch_of(examples)
    with _autocast(device, autocast):
        logits = model(input_ids=ids_BT.to(device), logits_to_keep=answers_BM.shape[1], use_cache=False).logits
    greedy_BM = logits.argmax(-1).cpu()
    return [float(task.reward(e, greedy_BM[b])) for b, e in enumerate(examples)]


def evaluate(
    model,
    bank: TaskBank,
    lengths,
    examples: int,
    batch_size: int,
    device,
    autocast=None,
    seed_base: int = EVAL_SEED_BASE,
) -> dict[int, float]:
    """Greedy exact-match accuracy per prompt length on held-out seeds `seed_base + i`
    (`teacher_forced_rewards`)."""
    was_training = model.training
    model.eval()
    accuracy = {}
    for length in lengths:
        task, hits = bank(length), 0.0
        for start in range(0, examples, batch_size):
            seeds = range(seed_base + start, seed_base + min(examples, start + batch_size))
            hits += sum(teacher_forced_rewards(model, task, [task.make(s) for s in seeds], device, autocast))
        accuracy[int(length)] = hits / examples
    model.train(was_training)
    return accuracy


def _autocast(device, dtype_name):
    if dtype_name is None:
        return torch.autocast(torch.device(device).type, enabled=False)
    return torch.autocast(torch.device(device).type, dtype=DTYPES[dtype_name])


def pretrain(cfg: PretrainConfig) -> dict:
    """Train, evaluate, and (with `cfg.out`) save the checkpoint and curve.json. Returns the curve."""
    wall_start = time.perf_counter()
    device = torch.device(cfg.device)
    model = _initial_model(cfg, device)
    with _training_kernels(cfg, model, device):
        bank = TaskBank(cfg.task, model.config.vocab_size)
        eval_bank = TaskBank(cfg.eval_task or cfg.task, model.config.vocab_size)
        run = _train(cfg, model, device, bank, eval_bank)
    model.eval()
    curve = _curve(cfg, model, run, eval_bank(cfg.lengths[0]), device, wall_start)
    if cfg.out is not None:
        _save(cfg, model, curve, wall_start)
    return curve | {"model": model}


@dataclasses.dataclass
class _Run:
    """What the training loop has done so far: the step records, the evaluations, the next training example's
    index (its seed's offset), the tokens trained on and the seconds the steps took."""

    steps: list = dataclasses.field(default_factory=list)
    evals: list = dataclasses.field(default_factory=list)
    next_example: int = 0
    tokens: int = 0
    train_seconds: float = 0.0


def _initial_model(cfg: PretrainConfig, device):
    """The model to train, in training mode: `cfg.init`'s checkpoint, else the preset at random init."""
    from longstraw.models import build_model, load_pretrained

    if cfg.init is not None:
        if not (Path(cfg.init) / "config.json").is_file():
            raise ValueError(
                f"init: {cfg.init} is not a checkpoint folder (no config.json); run the point that writes it first"
            )
        model = load_pretrained(cfg.init, dtype=DTYPES[cfg.dtype], device=device, **cfg.model_overrides)
    else:
        model = build_model(cfg.model, seed=cfg.seed, dtype=DTYPES[cfg.dtype], device=device, **cfg.model_overrides)
    model.train()
    return model


def _training_kernels(cfg: PretrainConfig, model, device) -> contextlib.AbstractContextManager:
    """HF's torch GDN kernels while training (`cfg.hf_torch_gdn`; default: on CUDA), else nothing."""
    if not (cfg.hf_torch_gdn if cfg.hf_torch_gdn is not None else device.type == "cuda"):
        return contextlib.nullcontext()
    from longstraw.core.hf_reference import hf_torch_gdn_kernels

    return hf_torch_gdn_kernels(model)


def _optimizer(cfg: PretrainConfig, model, device) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # norms, biases, GDN A_log / dt_bias
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        fused=device.type == "cuda",
    )


def _train(cfg: PretrainConfig, model, device, bank: TaskBank, eval_bank: TaskBank) -> _Run:
    """The training steps, until `cfg.steps` or the time limit, evaluating every `cfg.eval_every` steps and once
    at the end."""
    optimizer = _optimizer(cfg, model, device)
    rng = random.Random(cfg.seed)
    run = _Run()

    def run_eval(step):
        t = time.perf_counter()
        lengths = cfg.eval_lengths or cfg.lengths
        acc = evaluate(model, eval_bank, lengths, cfg.eval_examples, cfg.eval_batch_size, device, cfg.autocast)
        run.evals.append({"step": step, "accuracy": acc, "n": cfg.eval_examples, "seconds": time.perf_counter() - t})
        return acc

    bar = tqdm(
        range(cfg.steps), desc="pretrain", unit="step", file=sys.stderr, disable=not cfg.progress, dynamic_ncols=True
    )
    acc = {}
    for step in bar:
        if cfg.time_limit_seconds is not None and run.train_seconds >= cfg.time_limit_seconds:
            break
        record = _train_step(cfg, model, optimizer, bank, rng, step, run, device)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            acc = run_eval(step + 1)
        bar.set_postfix(
            loss=f"{record['answer_loss']:.3f}",
            L=record["length"],
            acc=" ".join(f"{a:.2f}" for a in acc.values()) or "-",
            refresh=False,
        )
    bar.close()
    run_eval(len(run.steps))
    return run


def _train_step(cfg: PretrainConfig, model, optimizer, bank: TaskBank, rng, step: int, run: _Run, device) -> dict:
    """One optimizer step on the step's batch; its record appended to `run.steps` and returned."""
    from longstraw.measure.memory import synchronize

    t = time.perf_counter()
    length, batch, aux, (ids_BT, answers_BM, targets_BT) = _draw_batch(cfg, bank, rng, step, run, device)
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr * lr_factor(step, cfg)
    with _autocast(device, cfg.autocast):
        loss, answer_loss = forward_losses(model, ids_BT, answers_BM, targets_BT, cfg.loss)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    run.train_seconds += time.perf_counter() - t
    run.tokens += ids_BT.numel()
    run.steps.append(
        {
            "step": step,
            "length": length,
            "batch": batch,
            "aux": aux,
            "loss": loss.item(),
            "answer_loss": answer_loss.item(),
            "grad_norm": grad_norm.item(),
            "lr": optimizer.param_groups[0]["lr"],
        }
    )
    return run.steps[-1]


def _draw_batch(cfg: PretrainConfig, bank: TaskBank, rng, step: int, run: _Run, device):
    """The step's batch: one length drawn from the stage's, the auxiliary task with the stage's probability,
    the examples' seeds following the run's last. Returns (length, batch size, aux, (ids, answers, targets))."""
    spec, lengths, aux_fraction = stage_at(cfg, step)
    length = rng.choice(lengths)
    aux = cfg.aux_task is not None and rng.random() < aux_fraction
    spec = cfg.aux_task if aux else spec
    batch = max(1, cfg.batch_tokens // length) if cfg.batch_tokens else cfg.batch_size
    first = cfg.seed * TRAIN_SEED_STRIDE + run.next_example
    run.next_example += batch
    ids_BT, answers_BM, targets_BT, _ = make_batch(bank(length, spec), range(first, first + batch))
    return length, batch, aux, (ids_BT.to(device), answers_BM.to(device), targets_BT.to(device))


def _curve(cfg: PretrainConfig, model, run: _Run, task, device, wall_start: float) -> dict:
    """The run's record (curve.json): its steps, evaluations, seeds, throughput and provenance."""
    from longstraw.measure.provenance import provenance
    from longstraw.training.tasks import chance_level

    steps_done = len(run.steps)
    return {
        "config": dataclasses.asdict(cfg),
        "model_config": model.config.to_dict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "chance": chance_level(task),
        "seeds": {
            "train": [cfg.seed * TRAIN_SEED_STRIDE, cfg.seed * TRAIN_SEED_STRIDE + run.next_example],
            "eval_base": EVAL_SEED_BASE,
            "curve_base": CURVE_SEED_BASE,
        },
        "steps": run.steps,
        "steps_done": steps_done,
        "stopped_by_time_limit": steps_done < cfg.steps,
        "evals": run.evals,
        "final_accuracy": run.evals[-1]["accuracy"],
        "tokens": run.tokens,
        "train_seconds": run.train_seconds,
        "tokens_per_second": run.tokens / run.train_seconds,
        "wall_seconds": time.perf_counter() - wall_start,
        "provenance": provenance(device),
    }


def _save(cfg: PretrainConfig, model, curve: dict, wall_start: float) -> None:
    """The checkpoint (written beside and renamed into place: there complete or not at all) and curve.json
    under `cfg.out`; `curve` gains the checkpoint's path and the wall seconds up to now."""
    from longstraw.results import write_json_atomic

    out = Path(cfg.out)
    partial = out / "checkpoint.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    shutil.rmtree(out / "checkpoint", ignore_errors=True)
    partial.rename(out / "checkpoint")
    curve["checkpoint"] = str(out / "checkpoint")
    curve["checkpoint_sha256"] = sha256_of(out / "checkpoint" / WEIGHTS)  # what a later point loads
    curve["wall_seconds"] = time.perf_counter() - wall_start
    write_json_atomic(out / "curve.json", curve)
