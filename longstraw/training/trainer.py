"""GRPO training over long prompts: `longstraw train CONFIG.yaml`.

    longstraw train experiments/examples/train_cpu.yaml          # resumes from OUT/checkpoints
    longstraw train experiments/examples/train_cpu.yaml --no-resume

One optimizer step per prompt visit, `steps_per_prompt` consecutive steps per task example:
1. capture the prompt (or reuse the resident state captured at an earlier step of this prompt); the next
   prompt's task example is built on a worker thread meanwhile (a long RULER prompt is host work);
2. sample G responses from the state (`longstraw.training.rollout`, seeded by step), reward them;
3. old-policy log-probs are the replay's own (on-policy, ratio 1; the sampler's are compared with them:
   `logp_mismatch_sampler`); reference log-probs (when `grpo.beta > 0`) are scored
   graph-free with the adapter disabled, on the prompt as the reference captured it (one extra
   capture and resident state per prompt; the frozen base never makes it stale);
4. the replay (`grpo_step`, mode `replay`: `replay.micro_batch` members a batch, or with
   `replay.cuda_graph` one recorded CUDA graph for every step's group, padded to `max_new_tokens`), gradient
   clipping, the optimizer step and the learning-rate schedule (constant or cosine, linear warm-up).

Prefix reuse and its refresh policy (`refresh`): the state is captured with the parameters of
its capture step and goes stale as they move. `every: K` recaptures when the state is K steps
old; `never` only on a new prompt; `adaptive` recaptures when the drift signal reaches
`threshold`. The signal is the L2 norm of the trainable parameters' change since the capture:
it costs one copy of the trainable parameters (LoRA: megabytes) and one norm per step, and the
staleness oracle (`longstraw.training.oracle`) measures how it relates to the real drift of loss,
log-probs and gradient against a fresh capture.

Text prompts (`dataset`, `tokenizer`, `reward_funcs`, `reward_weights`: `longstraw.training.text_tasks`,
`longstraw.training.rewards`), in TRL's terms: a local checkpoint (`model.path`) and tokenizer, a JSONL
file (or HF `datasets`) with a `prompt` column, reward functions `f(prompts, completions, **columns)`.
Prompt visit p takes row `order[p % rows]` of pass p // rows over the dataset (a seeded permutation per
pass unless `dataset.shuffle: false`); sampling stops at the tokenizer's EOS; completions are decoded
and scored; rewards combine as TRL's do (weighted nansum, None skipped, unscorable items advantage 0).
Everything about the text inputs is checked before the model is built. The step's record adds TRL's
metrics (`reward`, `reward_std`, `rewards/<name>/mean` and `/std`, `frac_reward_zero_std`,
`completions/mean_length` ...), the decoded `completions`, each function's rewards (`rewards_per_func`,
null for None) and the `dataset_index`; `reward_mean` equals `reward` there.

Multi-turn rollouts (`environment`: `longstraw.training.agent_step`): each of the G rows acts in its own
environment, reset on the task example's `info`, within `environment.max_turns` actions of at most
`environment.max_action_tokens` tokens and the trajectory's `sampling.max_new_tokens`; the rewards are the
environments' (summed over a trajectory's turns), and a trajectory replays as one member with the loss on its
actions only. The step's token counts (`response_tokens`, `num_tokens`, `completions/*`) are its actions'; the
record adds `turns`, `turns/mean`, `trajectory_tokens` and `done_ratio`.

Outputs under `output.dir`: `metrics.jsonl` (one JSON object per step; with `report_to` its numbers also go to
tensorboard or trackio, `training.watch`), `provenance.json` (the commit, device and versions of the latest call,
and the step it resumed at), and every
`checkpoint_every` steps `checkpoints/step-N/` with the peft adapter (`adapter/`) and
`trainer.pt` (trainable parameters at the step and at the state's capture, optimizer and
schedule state, the resolved config). Resuming loads the newest checkpoint that reads (a torn one, a save or a copy
cut short, is named on stderr and left in place, and the next older one is loaded), recaptures the stale
state with the parameters it was captured with, truncates the metrics to that step (rewritten
atomically; fewer records than the checkpoint's steps are refused), and continues: on CPU the
resumed run's metrics equal the uninterrupted run's. A folder holding records but no checkpoint
(a finished run without checkpoints) is refused rather than replaced; `--no-resume` starts over. A config that differs
from the checkpoint's is refused unless `allow_config_change=True` (`--allow-config-change`):
then the new values apply (learning rate, weight decay, schedule, ...) and the change is recorded
in `config_changes.jsonl`.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from longstraw.config import TrainConfig, resolve_train, to_mapping
from longstraw.core.determinism import deterministic_mode
from longstraw.core.member_graphs import MemberGraphs
from longstraw.core.step import StepOptions, grpo_step, reference_policy
from longstraw.core.transaction import capture, reuse_state
from longstraw.cp import context_parallel
from longstraw.measure.collector import collector_frozen
from longstraw.measure.memory import PhaseRecorder
from longstraw.measure.provenance import provenance
from longstraw.models.policy import build_policy
from longstraw.models.presets import check_preset
from longstraw.results import SKIPPED, check_writable, strict_json, write_json_atomic, write_text_atomic
from longstraw.training.agent_step import AgentSampler, agent_record, check_environment
from longstraw.training.example import TaskNotReady
from longstraw.training.optimizer import build_optimizer
from longstraw.training.oracle import parameter_drift
from longstraw.training.rollout import DecodeSession, SamplingConfig, sample
from longstraw.training.tasks import build_task, check_task_ready, check_task_spec
from longstraw.training.text_tasks import TextTask, completion_metrics, json_safe
from longstraw.training.watch import check_report_to, open_watch

# what a step's record keeps of `grpo_step`'s metrics about memory (with its phases), beside the training metrics
TRANSACTION_KEYS = (
    "graph_bytes_peak",
    "resident_bytes",
    "predicted_resident_bytes",
    "prompt_positions",
    "state_unchanged",
    "state_age",
    "members_replayed",
)


def _schedule(cfg, steps: int):
    warmup, name = cfg.warmup_steps, cfg.name

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if name == "cosine":
            progress = (step - warmup) / max(1, steps - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return factor


def resolve(raw, source: str = "train config") -> TrainConfig:
    """The trainer's config checked through to the names it uses (preset, task keys), the policy, its
    task and its device (`longstraw.training.checks`) and its output folder's writability, before any work."""
    from longstraw.training.checks import check_train_inputs

    cfg = raw if isinstance(raw, TrainConfig) else resolve_train(raw, source)
    if not cfg.model.path:
        try:
            check_preset(cfg.model.preset)
        except ValueError as exc:
            raise ValueError(f"{source}: model.preset: {exc}") from None
    if cfg.task is not None:
        check_task_spec(cfg.task, f"{source}: task")
    facts = check_train_inputs(cfg, source)  # overrides, the checkpoint whole, the device, the task against the model
    if cfg.task is not None and facts.vocab_size is not None:
        try:  # what the task reads from disk (a RULER task's tokenizer), before the model is built
            check_task_ready(cfg.task, facts.vocab_size)
        except TaskNotReady as exc:
            raise ValueError(f"{source}: task.{exc}") from None
    if cfg.environment is not None:
        check_environment(
            cfg.environment, cfg.task, cfg.sampling.max_new_tokens, f"{source}: environment", "sampling.max_new_tokens"
        )
    check_writable(Path(cfg.output.dir) / "metrics.jsonl", f"{source}: output.dir", overwrite=True)  # run() guards it
    check_report_to(cfg.report_to, source)
    return cfg


def checkpointed_steps(out: Path) -> list[int]:
    """The steps of the complete checkpoints under `out`, newest first."""
    folder = Path(out) / "checkpoints"
    return (
        sorted(
            (int(p.name.split("-")[1]) for p in folder.glob("step-*") if p.name.split("-")[1].isdigit()), reverse=True
        )
        if folder.is_dir()
        else []
    )


def check_not_replacing(out: Path) -> None:
    """Refuse to start a run in a folder holding an earlier run's records and no checkpoint to resume from (a
    finished run without checkpoints, another config's run): starting would replace them."""
    metrics = Path(out) / "metrics.jsonl"
    count = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    if count and not checkpointed_steps(out):
        raise ValueError(
            f"{out}: holds an earlier run's records ({count} steps in metrics.jsonl) and no checkpoint "
            "to resume from, so this run would replace them; choose another output.dir, or start over "
            "on purpose with --no-resume"
        )


class Trainer:
    def __init__(self, raw_config, source: str = "train config", *, resolved: bool = False):
        """`resolved`: `raw_config` is what `resolve` returned for `source` (the CLI resolves first, to guard
        the output folder before the model is built), so it is not checked again."""
        self.cfg = cfg = raw_config if resolved else resolve(raw_config, source)
        self.device = torch.device(cfg.model.device)
        # context parallel (`cp_size`): every rank runs this same loop on its shard; rank 0 writes
        self.cp = context_parallel(cfg.cp_size, self.device.type)
        self.writes = self.cp is None or self.cp.rank == 0
        # text prompts: tokenizer, dataset and reward functions loaded and checked before the model is built
        self.text = TextTask.from_config(cfg, source) if cfg.dataset is not None else None
        if cfg.model.path:  # a checkpoint's random LoRA init follows model.seed, as a preset's weights do
            torch.manual_seed(cfg.model.seed)
        self.model = build_policy(cfg.model)
        vocab = self.model.get_input_embeddings().weight.shape[0]
        self.task = build_task(cfg.task, vocab) if self.text is None else None
        self.agent = AgentSampler(cfg.environment, self.task) if cfg.environment is not None else None
        if self.text is not None and len(self.text.tokenizer) > vocab:
            raise ValueError(
                f"{source}: the tokenizer has {len(self.text.tokenizer)} tokens but the model's "
                f"embeddings have {vocab} rows"
            )
        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer = build_optimizer(self.params.values(), cfg.optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(cfg.schedule, cfg.steps))
        self.exact = cfg.gradient == "exact"
        self.options = StepOptions(
            max_grad_norm=cfg.max_grad_norm,
            prefix_grad=self.exact,
            checkpoint_layers=cfg.replay.checkpoint_layers,
            micro_batch=cfg.replay.micro_batch,
        )
        # sampled answers change length every step: padded to the answer budget inside the graph, the members of
        # every step launch one recorded graph (the exact gradient's prompt-side term is not recordable: eager)
        graphed = cfg.replay.cuda_graph and not self.exact
        self.member_graphs = MemberGraphs(pad_to=cfg.sampling.max_new_tokens) if graphed else None
        self.out = Path(cfg.output.dir)
        self.state = self.capture_step = self.capture_params = None
        self.ref_state = self.ref_prompt = None
        self._made = (None, None)  # (prompt index, example)
        self._maker = ThreadPoolExecutor(1, thread_name_prefix="next-prompt")  # the next prompt's example
        self._ahead: tuple[int, Future] | None = None  # (prompt index, its example being made)
        self.decode_session = DecodeSession()  # every step samples with one G and length: its decoder kept

    # ---- prefix reuse
    def _example(self, step: int):
        """This step's task example, made once per prompt (the one `_make_ahead` started, when it did)."""
        prompt = step // self.cfg.steps_per_prompt
        if self._made[0] != prompt:
            ahead, self._ahead = self._ahead, None
            example = ahead[1].result() if ahead is not None and ahead[0] == prompt else self._make_example(prompt)
            self._made = (prompt, example)
        return self._made[1]

    def _make_ahead(self, step: int) -> None:
        """Start making the next prompt's example on the worker thread, once. A long prompt is costly to build (a
        RULER prompt at 131,072 positions: ~0.4 s of host), so it is made while this step runs on the device
        (examples are functions of their seed: made ahead, they are the same). Called once the step's capture
        is launched: the worker's Python holds the GIL, and during the capture the host is what sets the pace
        (a RULER maker beside a capture slowed it 42% on the CPU), while sampling and replay wait on the device."""
        nxt = step // self.cfg.steps_per_prompt + 1
        if nxt * self.cfg.steps_per_prompt < self.cfg.steps and (self._ahead is None or self._ahead[0] != nxt):
            self._ahead = (nxt, self._maker.submit(self._make_example, nxt))

    def _make_example(self, prompt: int):
        if self.text is None:
            return self.task.make(prompt_seed(self.cfg.seed, prompt))
        rows = len(self.text)
        order = self.text.order(prompt // rows, self.cfg.seed, self.cfg.dataset.shuffle)
        return self.text.example(order[prompt % rows])

    def drift(self) -> float:
        """The adaptive policy's signal: L2 norm of the trainable parameters' change since capture."""
        if self.capture_params is None:
            return 0.0
        return parameter_drift(self.params.values(), [self.capture_params[n] for n in self.params])

    def _needs_capture(self, step: int, drift: float) -> bool:
        per_prompt = self.cfg.steps_per_prompt
        if self.state is None or step // per_prompt != self.capture_step // per_prompt:
            return True
        refresh = self.cfg.refresh
        if refresh.policy == "every":
            return step - self.capture_step >= refresh.every
        if refresh.policy == "adaptive":
            return drift >= refresh.threshold
        return False

    def _capture_kwargs(self) -> dict:
        kwargs = self.cfg.capture.kwargs()
        return {**kwargs, "cp": self.cp} if self.cp is not None else kwargs

    def _capture(self, step: int, params: dict | None = None):
        """Capture this step's prompt, with `params` loaded for the capture when given (resume)."""
        current = None
        if params is not None:
            current = {n: p.detach().clone() for n, p in self.params.items()}
            self._load_params(params)
        self.state = capture(
            self.model, self._example(step).prompt_ids.to(self.device), prefix_grad=self.exact, **self._capture_kwargs()
        )
        self.capture_step = step
        self.capture_params = {n: p.detach().clone() for n, p in self.params.items()}
        if current is not None:
            self._load_params(current)
            reuse_state(self.model, self.state)  # a resumed run's stale state, as the uninterrupted run had it

    def _reference_state(self, step: int, recorder: PhaseRecorder):
        """The reference policy's capture of this step's prompt (None when there is no KL term)."""
        prompt = step // self.cfg.steps_per_prompt
        if self.cfg.grpo.beta > 0 and self.ref_prompt != prompt:
            self.ref_state = None  # free the previous prompt's first
            with recorder.phase("ref_capture"), reference_policy(self.model):
                self.ref_state = capture(
                    self.model, self._example(step).prompt_ids.to(self.device), **self._capture_kwargs()
                )
            self.ref_prompt = prompt
        return self.ref_state

    def _load_params(self, values: dict):
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(values[n])

    # ---- one step
    def _text_rewards(self, step: int, example, rollouts) -> tuple[list[float], list[float], dict]:
        """(the rewards, NaN where unscorable; TRL's advantages; the record's text metrics) for one group
        of a text prompt."""
        epoch = (step // self.cfg.steps_per_prompt) / len(self.text)
        scored, completions = self.text.score(
            example, rollouts.responses, step=step, max_steps=self.cfg.steps, epoch=epoch
        )
        record = {
            **scored.metrics,
            "reward_mean": scored.metrics["reward"],
            "rewards": json_safe(scored.rewards),
            "rewards_per_func": json_safe(scored.per_func),
            "completions": completions,
            "dataset_index": example.index,
        }
        if scored.extra:
            record["completion_extra"] = scored.extra
        return scored.rewards, scored.advantages, record

    def _rewards(self, step: int, example, responses) -> list[float]:
        rewards = [self.task.reward(example, r) for r in responses]
        bad = [r for r in rewards if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r)]
        if bad:
            raise ValueError(
                f"step {step}: the task's reward function returned {bad[0]!r} (rewards must be finite "
                f"numbers); all rewards of the group: {rewards}"
            )
        return [float(r) for r in rewards]

    def train_step(self, step: int) -> dict:
        """One step; its record holds the step's metrics and, under `transaction`, the memory and time
        per phase (capture, sampling, ref_capture, then the transaction's own) as `grpo_step` reports them."""
        start = time.perf_counter()
        recorder = PhaseRecorder(self.device)
        example = self._example(step)
        drift = self.drift()
        refreshed = self._needs_capture(step, drift)
        if refreshed:
            with recorder.phase("capture"):
                self._capture(step)
        self._make_ahead(step)
        rollouts = self._rollouts(step, recorder)
        rewards, advantages, text = self._group_rewards(step, example, rollouts, recorder)
        ref_state = self._reference_state(step, recorder)
        metrics = self._update(example, rollouts, rewards, advantages, ref_state)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return {
            "step": step,
            "prompt": step // self.cfg.steps_per_prompt,
            # where the task put the answer's needle (None: no needle, or a text dataset's prompt)
            "depth": example.info.get("depth") if self.text is None else None,
            "refreshed": refreshed,
            "state_age": step - self.capture_step,
            "drift_before": drift,
            "lr": lr,
            **group_record(metrics, rewards, text, rollouts.finished),
            **(agent_record(rollouts) if self.agent is not None else {}),
            "transaction": transaction_record(metrics, recorder, ref_state),
            "seconds": time.perf_counter() - start,
        }

    def _rollouts(self, step: int, recorder: PhaseRecorder):
        """The step's G responses (or, with an environment, trajectories) sampled from the resident state (phase
        `sampling`)."""
        s = self.cfg.sampling
        stops = (
            dict(stop_ids=self.text.stop_ids, pad_id=self.text.pad_id)
            if self.text is not None
            else dict(stop_ids=tuple(getattr(self.task, "stop_ids", ())))
        )  # a task over a real tokenizer stops at EOS (an agent's action, too)
        sampling = SamplingConfig(
            num_generations=self.cfg.grpo.num_generations,
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=self.cfg.seed * 1_000_003 + step,
            **stops,
        )
        with recorder.phase("sampling"):
            if self.agent is not None:
                return self.agent.sample(self.model, self.state, self._example(step), sampling)
            return sample(self.model, self.state, sampling, session=self.decode_session)

    def _group_rewards(self, step: int, example, rollouts, recorder: PhaseRecorder):
        """(rewards, advantages or None, the record's reward fields): the task's, or the text rewards' (phase
        `rewards`, with advantages of their own for unscorable completions)."""
        if self.text is not None:
            with recorder.phase("rewards"):
                return self._text_rewards(step, example, rollouts)
        rewards = rollouts.rewards if self.agent is not None else self._rewards(step, example, rollouts.responses)
        return rewards, None, {"reward": float(torch.tensor(rewards).mean())}

    def _update(self, example, rollouts, rewards, advantages, ref_state) -> dict:
        """The group's transaction and optimizer step on the resident state (`grpo_step`); its metrics."""
        return grpo_step(
            self.model,
            example.prompt_ids.to(self.device),
            rollouts.responses,
            rewards,
            self.optimizer,
            self.cfg.grpo,
            self.options,
            state=self.state,
            ref_state=ref_state,
            sampler_logps=rollouts.logprobs,
            advantages=advantages,
            graphs=self.member_graphs,
            loss_masks=rollouts.masks if self.agent is not None else None,
        ).metrics

    # ---- checkpoints
    def _checkpoint_dir(self, step: int) -> Path:
        return self.out / "checkpoints" / f"step-{step}"

    def save_checkpoint(self, steps_done: int):
        final = self._checkpoint_dir(steps_done)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if hasattr(self.model, "save_pretrained"):
            self.model.save_pretrained(tmp / "adapter")
        torch.save(
            {
                "steps_done": steps_done,
                "params": {n: p.detach().cpu() for n, p in self.params.items()},
                "capture_step": self.capture_step,
                "capture_params": {n: t.cpu() for n, t in (self.capture_params or {}).items()},
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "config": json.dumps(to_mapping(self.cfg), sort_keys=True),
            },
            tmp / "trainer.pt",
        )
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # a checkpoint exists complete or not at all

    def _config_changes(self, saved: dict) -> dict:
        """{key path: [checkpoint's value, this config's]} where they differ (the output folder aside)."""
        before, now = json.loads(saved.get("config", "{}")), to_mapping(self.cfg)
        defaults = to_mapping(TrainConfig())
        changes = {}

        def walk(a, b, path, default):
            if isinstance(a, dict) and isinstance(b, dict):
                default = default if isinstance(default, dict) else {}
                for key in sorted(set(a) | set(b)):
                    if key not in a and key in default and b.get(key) == default[key]:
                        continue  # a key the checkpoint's version did not have yet, at its default here
                    walk(a.get(key), b.get(key), f"{path}.{key}" if path else key, default.get(key))
            elif a != b and path != "output.dir":
                changes[path] = [a, b]

        walk(before, now, "", defaults)
        return changes

    def _newest_intact(self, done: list[int]) -> dict:
        """The newest checkpoint whose trainer.pt reads. A torn one (a save or a copy cut short) is named on stderr
        and left in place, and the next older one is tried; none that reads is an error naming each."""
        torn = []
        for step in done:
            file = self._checkpoint_dir(step) / "trainer.pt"
            try:
                saved = torch.load(file, map_location=self.device, weights_only=True)
            except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
                torn.append(f"{file} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'cut short'})")
                continue
            if torn and self.writes:
                print(
                    f"longstraw: {'; '.join(torn)}: unreadable, left in place; resuming from step {step}'s checkpoint",
                    file=sys.stderr,
                    flush=True,
                )
            return saved
        raise ValueError(f"{self.out}: no checkpoint reads: {'; '.join(torn)}; start over with --no-resume")

    def load_latest_checkpoint(self, allow_config_change: bool = False) -> int:
        done = checkpointed_steps(self.out)
        if not done:
            return 0
        saved = self._newest_intact(done)
        changes = self._config_changes(saved)
        if changes and not allow_config_change:
            listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
            raise ValueError(
                f"{self.out}: the config differs from the checkpoint's at step {saved['steps_done']} ({listed}); "
                "resume with the same config, start over (--no-resume), or apply the change "
                "(--allow-config-change)"
            )
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        if changes:
            self._apply_optimizer_config()
            if self.writes:
                with open(self.out / "config_changes.jsonl", "a") as f:
                    f.write(json.dumps({"resumed_at_step": saved["steps_done"], "changes": changes}) + "\n")
        self._load_params(saved["params"])
        if saved["capture_step"] is not None:
            self._capture(saved["capture_step"], params=saved["capture_params"])
        return saved["steps_done"]

    def _apply_optimizer_config(self):
        """This config's learning rate, weight decay and schedule over the restored optimizer state."""
        self.scheduler.base_lrs = [self.cfg.optimizer.lr] * len(self.optimizer.param_groups)
        factor = _schedule(self.cfg.schedule, self.cfg.steps)(self.scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self.cfg.optimizer.lr
            group["lr"] = self.cfg.optimizer.lr * factor
            group["weight_decay"] = self.cfg.optimizer.weight_decay
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def _kept_records(self, path: Path, first: int) -> list[str]:
        """The metrics lines a resumed run keeps: the first `first`, checked against the checkpoint at step
        `first`. A folder holding records but no checkpoint (a finished run without checkpoints, another
        config's run) is refused: starting here would replace them."""
        if first == 0:
            check_not_replacing(self.out)
            return []
        lines = path.read_text().splitlines()
        if len(lines) < first:
            raise ValueError(
                f"{path}: {len(lines)} step records, but the newest checkpoint is at step {first}: the "
                f"records of steps {len(lines)} to {first - 1} are missing; restore the file, or start "
                "over with --no-resume"
            )
        for index, line in enumerate(lines[:first]):
            try:
                step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                step = None
            if step != index:
                raise ValueError(
                    f"{path}: line {index + 1} is not the record of step {index}; restore the file, or "
                    "start over with --no-resume"
                )
        return lines[:first]

    # ---- the loop
    def run(self, resume: bool = True, stop_after: int | None = None, allow_config_change: bool = False) -> list[dict]:
        """Train to `steps`; `stop_after` ends early after that many steps of this call (tests).
        Returns every step's metrics, the resumed ones included; `resumed_at` is the step it went on from."""
        metrics_path = self.out / "metrics.jsonl"
        first = self.resumed_at = self.load_latest_checkpoint(allow_config_change) if resume else 0
        lines = self._kept_records(metrics_path, first) if resume else []
        records = [json.loads(line) for line in lines]
        if self.writes:
            self.out.mkdir(parents=True, exist_ok=True)
            if not resume:
                shutil.rmtree(self.out / "checkpoints", ignore_errors=True)
            write_text_atomic(metrics_path, "".join(line + "\n" for line in lines))
            # what ran: the code, the device, the libraries (a resumed run's call its own, from the step it went on)
            write_json_atomic(self.out / "provenance.json", {**provenance(self.device), "resumed_at": first})
        every, steps = self.cfg.output.checkpoint_every, self.cfg.steps
        bar = tqdm(
            range(first, steps),
            desc="train",
            unit="step",
            file=sys.stderr,
            initial=first,
            total=steps,
            disable=not self.writes,
        )
        watch = open_watch(self.cfg.report_to if self.writes else "none", self.out, self.out.name, to_mapping(self.cfg))
        with collector_frozen():  # what the steps find built (the model, the libraries): no full collection walks it
            for count, step in enumerate(bar):
                if stop_after is not None and count >= stop_after:
                    break
                with deterministic_mode(self.cfg.deterministic):
                    records.append(self.train_step(step))
                if self.writes:
                    _append_line(metrics_path, strict_json(records[-1]))
                    watch.log(step, records[-1])
                reward = records[-1]["reward_mean"]
                bar.set_postfix(
                    reward="-" if reward is None else f"{reward:.3f}",
                    loss=f"{records[-1]['loss']:.4f}",
                    refreshed=records[-1]["refreshed"],
                )
                if self.writes and every and ((step + 1) % every == 0 or step + 1 == steps):
                    self.save_checkpoint(step + 1)
        bar.close()
        watch.close()
        self._ahead = None  # a prompt made ahead that no step of this call reached
        return records


def prompt_seed(seed: int, prompt: int) -> int:
    """The task seed of a run's `prompt`-th prompt (a task's examples are functions of their seed)."""
    return seed * 1_000_003 + prompt


def group_record(metrics: dict, rewards: list[float], text: dict, finished) -> dict:
    """A step record's group and update: the rewards, the completions' lengths, the loss, the gradient, the
    objective's statistics and the log-prob mismatches."""
    return {
        "reward_mean": metrics["reward_mean"],
        "reward_std": float(torch.tensor(rewards).std()),
        "rewards": rewards,
        **text,
        "advantages": metrics["advantages"],
        **completion_metrics(metrics["response_tokens"], finished),
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        SKIPPED: metrics[SKIPPED],  # None, or why the update was not applied (a loss or gradient not finite)
        **metrics["stats"],
        "logp_mismatch": metrics["logp_mismatch"],
        "logp_mismatch_sampler": metrics["logp_mismatch_sampler"],
        "response_tokens": metrics["response_tokens"],
    }


def transaction_record(metrics: dict, recorder: PhaseRecorder, ref_state) -> dict:
    """A step record's `transaction`: the transaction's memory measurements and every phase's, the trainer's
    own (capture, sampling, rewards, ref_capture) first."""
    transaction = {k: metrics[k] for k in TRANSACTION_KEYS if k in metrics}
    transaction["phases"] = {**recorder.phases, **metrics["phases"]}
    if ref_state is not None:
        transaction["ref_resident_bytes"] = ref_state.nbytes
    return transaction


def _append_line(path: Path, line: str) -> None:
    """Append one record and make it durable before the step's checkpoint can name it."""
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
