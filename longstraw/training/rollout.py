"""Rollouts: sample G responses from a captured prompt by incremental decoding on its pages.

    state = capture(model, prompt_ids)
    rollouts = sample(model, state, SamplingConfig(num_samples=8, max_new_tokens=64, temperature=1.0,
                                                   top_p=0.95, stop_ids=(eos,), seed=0))
    rollouts.responses[i], rollouts.logprobs[i]      # token ids (stop token included), log p per token

Decoding starts from the last prompt token (the state covers the prompt minus it).
The G sequences share the prompt's attention pages and MLA latent pages (read in place, never copied)
and keep their own pages for the generated tokens (MLA: latents, and index keys on DSA index layers,
so each sequence's top-k runs over the prompt's keys and its own); Gated DeltaNet states (constant
size) are copied per sequence.
The captured state itself is never written.

Sampling follows HF `generate` step for step, so the same seed gives the same tokens: float32
logits, temperature then top-p through HF's own logits warpers, one `torch.multinomial` over all
G rows per step (finished rows too, then replaced by `pad_id`), stopping when every row has
emitted a stop id or `max_new_tokens` is reached. `temperature == 0` is greedy.

The log-probs returned are the policy's (temperature 1, no top-p truncation), i.e. what
`longstraw.core.transaction.score` recomputes from the state: the old-policy log-probs of GRPO.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from longstraw.core.transaction import check_deterministic, check_state
from longstraw.families import adapter_for
from longstraw.state import ResidentState
from longstraw.state.pages import check_entries_implement


@dataclass(frozen=True)
class SamplingConfig:
    num_samples: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0
    seed: int | None = 0

    def __post_init__(self):
        if self.num_samples < 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"num_samples and max_new_tokens must be >= 1, got {self.num_samples}, {self.max_new_tokens}"
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")


@dataclass
class Rollouts:
    responses: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    finished: list[bool] = field(default_factory=list)  # ended on a stop id (else: max_new_tokens)


def _decode_entries(state: ResidentState, batch: int, capacity: int) -> list:
    """Each layer's entry as `batch` sequences decode on it (`entry.for_decoding`), refused before any step."""
    check_entries_implement(state.layers, "for_decoding", "sampling")
    return [entry.for_decoding(batch, capacity) for entry in state.layers]


def _next_tokens(logits_GV: torch.Tensor, config: SamplingConfig, generator) -> torch.Tensor:
    if config.temperature == 0:
        return logits_GV.argmax(-1)
    scores = TemperatureLogitsWarper(config.temperature)(None, logits_GV)
    if config.top_p < 1:
        scores = TopPLogitsWarper(config.top_p)(None, scores)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


@torch.no_grad()
def sample(model, state: ResidentState, config: SamplingConfig) -> Rollouts:
    """G sampled responses and their policy log-probs from the captured `state` (never modified)."""
    adapter = adapter_for(model)
    check_state(adapter, state)
    state.check_positions(config.max_new_tokens, "sampling max_new_tokens")
    check_deterministic(model)
    G, device = config.num_samples, state.device
    generator = torch.Generator(device=device).manual_seed(config.seed) if config.seed is not None else None
    entries = _decode_entries(state, G, config.max_new_tokens)
    stop = torch.tensor(config.stop_ids, dtype=torch.long, device=device)
    tokens_G = torch.full((G,), state.last_token, dtype=torch.long, device=device)
    unfinished_G = torch.ones(G, dtype=torch.bool, device=device)
    chosen, logps = [], []
    with adapter.selected():
        for step in range(config.max_new_tokens):
            h = adapter.embed(tokens_G[:, None])
            pe = adapter.position_embeddings(h, state.positions + step)
            for i, entry in enumerate(entries):
                h = adapter.layer_forward(i, h, pe, entry, capturing=True)
            logits_GV = adapter.lm_head(adapter.final_hidden(h))[:, -1].float()
            next_G = _next_tokens(logits_GV, config, generator)
            logps.append(torch.log_softmax(logits_GV, -1).gather(1, next_G[:, None]).squeeze(1))
            next_G = torch.where(unfinished_G, next_G, torch.full_like(next_G, config.pad_id))
            chosen.append(next_G)
            unfinished_G &= ~torch.isin(next_G, stop)
            if not unfinished_G.any():
                break
            tokens_G = next_G
    tokens_GT, logps_GT = torch.stack(chosen, 1), torch.stack(logps, 1)
    responses, logprobs, finished = [], [], []
    for g in range(G):
        hits = torch.isin(tokens_GT[g], stop).nonzero()
        end = int(hits[0]) + 1 if hits.numel() else tokens_GT.shape[1]
        responses.append(tokens_GT[g, :end].clone())
        logprobs.append(logps_GT[g, :end].clone())
        finished.append(bool(hits.numel()))
    return Rollouts(responses, logprobs, finished)
