"""Peer `trl`: TRL 1.16.0's own GRPO loss path on our group, through a real `trl.GRPOTrainer`.

What is built (no download): `GRPOTrainer(model=<the point's model object, peft-wrapped as ours>,
reward_funcs=[a constant function, never called], args=GRPOConfig(...), train_dataset=<one in-memory row>,
processing_class=<a three-token tokenizer built locally>)` with `GRPOConfig(per_device_train_batch_size=G,
num_generations=G, steps_per_generation=1, gradient_accumulation_steps=1, max_completion_length=R,
loss_type, beta, epsilon, epsilon_high, scale_rewards as the point's objective, use_bias_correction_kl=False
(TRL 1.16 defaults it on: its KL term is then multiplied by the importance ratio, 1 in value but not in
gradient; off, the objective is ours, `longstraw.core.grpo`), gradient_checkpointing=True,
bf16 for a bfloat16 model else float32, use_cpu on CPU, report_to="none")`. The trainer's constructor adds
TRL's fused LM head to the model (`trl.trainer.utils.add_fused_lm_head`), writes the tokenizer's pad id into
the model's config and, for peft with checkpointing, calls `enable_input_require_grads()`.

What one step calls: the switch `Trainer.train()` flips before its loop (`activation_checkpointing_enable`
with the config's kwargs, `gradient_checkpointing_enable` on transformers that lack it; `longstraw.core.step.
hf_checkpointing`), `model.train()`, then inside `trainer.compute_loss_context_manager()`:
`trainer.compute_loss(model, inputs)` = `GRPOTrainer._compute_loss`, which calls
`_get_per_token_logps_and_entropies` (one forward over the G rows of prompt + response, fused LM head on the
response positions) and TRL's clipped objective and normalisation; then `trainer.accelerator.backward(loss)`,
as `Trainer.training_step` does. `inputs` is the batch TRL's `_generate_and_score_completions` would hand it:
`prompt_ids` (the prompt repeated in each of the G rows, as TRL batches it), `prompt_mask`, `completion_ids`,
`completion_mask` (right-padded), `advantages` (our `group_advantages` of the rewards: TRL's formula) and
`num_items_in_batch` (the group's response tokens); no `old_per_token_logps`, so TRL takes the current ones
detached (on-policy, `num_iterations=1`). With beta > 0, `ref_per_token_logps` comes from
`_get_per_token_logps_and_entropies` without grad with the adapter disabled, as TRL scores its reference.
Generation, rewards and `Trainer.train()`'s loop are not run; the optimizer step is the point's, as for our
modes. Hybrid models run HF's torch Gated DeltaNet kernel (`hf_torch_gdn_kernels`, as naive does: fla's
chunk backward fails on Hopper with Triton 3.6).
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager

import torch

from longstraw.core import grpo
from longstraw.core.hf_reference import hf_torch_gdn_kernels
from longstraw.core.step import hf_checkpointing
from longstraw.families import adapter_for
from longstraw.peers.measured import measured_step


def local_tokenizer():
    """A tokenizer with only pad, eos and unk (TRL reads its pad and eos ids; nothing is tokenized)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
    )


def _never_called(prompts, completions, **kwargs):  # GRPOTrainer needs a reward function; rewards are given
    raise RuntimeError("the trl peer scores with the point's rewards; TRL's reward functions are not run")


def trl_config(config: grpo.GRPOConfig, response_length: int, model, output_dir: str):
    """The `trl.GRPOConfig` of one step on one group (see the module doc)."""
    from trl import GRPOConfig

    device = adapter_for(model).device
    return GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=config.num_generations,
        num_generations=config.num_generations,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        max_completion_length=response_length,
        loss_type=config.loss_type,
        beta=config.beta,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high,
        scale_rewards=config.scale_rewards,
        gradient_checkpointing=True,
        bf16=adapter_for(model).compute_dtype == torch.bfloat16,
        fp16=False,
        use_cpu=device.type == "cpu",
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_dropout=True,
        use_bias_correction_kl=False,
    )


def _checkpointing_kwargs(args) -> dict | None:
    """The kwargs `Trainer.train()` passes to the switch (transformers 5.23 names them activation_..., 5.17
    gradient_...), less the layer-selection keys it pops first; None (the model's default) when empty, as it
    passes them."""
    kwargs = dict(
        getattr(args, "activation_checkpointing_kwargs", None)
        or getattr(args, "gradient_checkpointing_kwargs", None)
        or {}
    )
    for key in ("every_n_layers", "offload"):
        kwargs.pop(key, None)
    return kwargs or None


# the step statistics TRL logs under the names `grpo.summarize_stats` gives ours
STATS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl")


class TRLPeer:
    """A `GRPOTrainer` on `model` for the objective `config`; `step` runs its loss path on one group."""

    mode = "trl"

    def __init__(self, model, config: grpo.GRPOConfig, max_response_length: int):
        from datasets import Dataset
        from trl import GRPOTrainer

        self.model, self.config, self.max_response_length = model, config, max_response_length
        self._tmp = tempfile.TemporaryDirectory(prefix="longstraw-trl-")
        self.trainer = GRPOTrainer(
            model=model,
            reward_funcs=[_never_called],
            args=trl_config(config, max_response_length, model, self._tmp.name),
            train_dataset=Dataset.from_list([{"prompt": "unused"}]),
            processing_class=local_tokenizer(),
        )
        self.trainer.current_gradient_accumulation_steps = 1  # Trainer.train() sets it per accumulation window

    def _check_lengths(self, responses) -> None:
        longest = max(int(r.numel()) for r in responses)
        if longest > self.max_response_length:
            raise ValueError(
                f"a response of {longest} tokens is longer than the trainer's max_completion_length "
                f"{self.max_response_length} (build_peer's max_response_length)"
            )

    def batch(self, prompt_ids, responses, advantages, ref=None) -> dict:
        """The inputs `GRPOTrainer._compute_loss` takes, for one prompt and its G responses."""
        G, device = len(responses), prompt_ids.device
        lengths = [int(r.numel()) for r in responses]
        completion_ids = torch.nn.utils.rnn.pad_sequence(
            [r.reshape(-1) for r in responses],
            batch_first=True,
            padding_value=self.trainer.processing_class.pad_token_id,
        )
        completion_mask = (
            torch.arange(max(lengths), device=device)[None] < torch.tensor(lengths, device=device)[:, None]
        ).long()
        prompt = prompt_ids.reshape(1, -1).expand(G, -1)
        batch = {
            "prompt_ids": prompt,
            "prompt_mask": torch.ones_like(prompt),
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": advantages.to(device),
            "num_items_in_batch": completion_mask.sum(),
        }
        if ref is not None:
            batch["ref_per_token_logps"] = torch.nn.utils.rnn.pad_sequence(ref, batch_first=True)
        return batch

    @contextmanager
    def _training(self):
        trainer = self.trainer
        with hf_torch_gdn_kernels(self.model), hf_checkpointing(trainer.model, _checkpointing_kwargs(trainer.args)):
            trainer.model.train()
            yield trainer

    def logprobs(self, prompt_ids, responses) -> list[torch.Tensor]:
        """TRL's per-token log-probs of each response (`_get_per_token_logps_and_entropies`)."""
        trainer = self.trainer
        batch = self.batch(prompt_ids, responses, torch.zeros(len(responses)))
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with hf_torch_gdn_kernels(self.model):
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, mask, batch["completion_ids"].shape[1]
            )
        return [logps[i, : int(r.numel())] for i, r in enumerate(responses)]

    def step(self, prompt_ids, responses, rewards, optimizer) -> dict:
        self._check_lengths(responses)

        def forward_backward(advantages, weights, ref):  # TRL normalises by its own num_items_in_batch
            batch = self.batch(prompt_ids, responses, advantages, ref)
            with self._training() as trainer:
                with trainer.compute_loss_context_manager():
                    loss = trainer.compute_loss(trainer.model, batch)
                trainer.accelerator.backward(loss)
            logged = {name: values[-1] for name, values in trainer._metrics["train"].items() if values}
            return loss.detach(), {name: logged[name] for name in STATS if name in logged}

        return measured_step(
            self.model,
            optimizer,
            self.mode,
            responses,
            rewards,
            self.config,
            forward_backward,
            lambda: self.logprobs(prompt_ids, responses),
        )
