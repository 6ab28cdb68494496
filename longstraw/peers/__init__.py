"""Peers: other systems' GRPO loss paths run as modes of the same experiments, on the same model object,
prompt, responses and rewards as ours (`longstraw.core.step`), measured by the same phase recorder.

- `trl` (`trl_peer.py`): TRL 1.16's `GRPOTrainer.compute_loss` (its `_get_per_token_logps_and_entropies` and
  `_compute_loss`), with the gradient checkpointing `Trainer.train()` switches on.
- `prefix_grouper` (`prefix_grouper_peer.py`): PrefixGrouper 0.0.1.post1's documented usage: the prompt once,
  the G responses concatenated after it, its attention split into prefix self-attention + suffix attention.

Both come with the optional extra `pip install -e ".[peers]"`. This module imports neither the peers nor
torch, so a plan checks a peer point (`check_peer_point`) before any work: the extra installed, the peer
applicable to the model's family.

    from longstraw.peers import build_peer
    peer = build_peer("trl", model, GRPOConfig(num_generations=8), max_response_length=2048)
    metrics = peer.step(prompt_ids, responses, rewards, optimizer)
"""

from __future__ import annotations

import importlib.util

PEER_MODES = ("trl", "prefix_grouper")
# mode -> the distribution it needs (pinned in pyproject's `peers` extra) and its import name
REQUIREMENTS = {"trl": ("trl==1.16.0", "trl"), "prefix_grouper": ("prefix-grouper==0.0.1.post1", "prefix_grouper")}
INSTALL = 'pip install -e ".[peers]"'
# model types whose sequence mixing is attention only: the dense family's (`DenseAdapter.model_types`; written out
# because the report imports this without torch, and tests/test_peers.py ties the two)
ATTENTION_ONLY = ("llama", "qwen3", "glm4_moe")
DIFFERENCES = {
    "trl": "TRL's GRPOTrainer puts the prompt in every one of the G rows and runs one checkpointed forward and "
    "backward over all G x (prompt + response) tokens: every row recomputes the prompt, and its gradient is "
    "the full-sequence one (as our exact mode's). On a hybrid model its Gated DeltaNet layers run HF's torch "
    "chunk kernel, as naive's do: fla's chunk backward, which a fast TRL run would take, fails on Hopper with "
    "Triton 3.4-3.7, so on a GPU its hybrid times carry that slower kernel.",
    "prefix_grouper": "PrefixGrouper runs the prompt once and the G responses concatenated after it in one "
    "sequence, each response attending to the shared prompt and to itself: one forward and "
    "backward over prompt + G responses, holding the whole prompt's graph (full-sequence "
    "gradient); attention layers only.",
}


class PeerNotApplicable(ValueError):
    """The peer does not apply to this model (said before any work)."""


def not_applicable(mode: str, model_type: str) -> str | None:
    """Why peer `mode` cannot run on a model of `model_type`, or None when it can."""
    if mode == "prefix_grouper" and model_type not in ATTENTION_ONLY:
        return (
            f"prefix_grouper does not apply to model type {model_type!r}: it splits attention layers only, so "
            "the recurrent (Gated DeltaNet) or sparse-attention layers of this family would carry state from one "
            "concatenated response into the next; it applies to attention-only types "
            f"{', '.join(ATTENTION_ONLY)}"
        )
    return None


def missing_requirement(mode: str) -> str | None:
    """The install hint when peer `mode`'s package is not importable, else None."""
    requirement, module = REQUIREMENTS[mode]
    if importlib.util.find_spec(module) is None:
        return f"mode {mode!r} runs the peer {requirement}, which is not installed: {INSTALL}"
    return None


def check_peer(mode: str, model_type: str | None) -> None:
    """Refuse a peer point before any work: an unknown peer, the extra missing, or a model it does not apply
    to (`model_type` None: not known yet, e.g. a checkpoint not read; `build_peer` checks it then)."""
    if mode not in PEER_MODES:
        raise ValueError(f"unknown peer mode {mode!r}; peers: {PEER_MODES}")
    missing = missing_requirement(mode)
    if missing:
        raise ValueError(missing)
    reason = not_applicable(mode, model_type) if model_type else None
    if reason:
        raise PeerNotApplicable(reason)


def build_peer(mode: str, model, config, max_response_length: int = 1024):
    """The peer's step on `model` for the objective `config` (a `GRPOConfig`), set up (imports, TRL's trainer
    for responses of up to `max_response_length` tokens): an object whose
    `step(prompt_ids, responses, rewards, optimizer)` returns `grpo_step`'s metrics."""
    from longstraw.families import adapter_for

    check_peer(mode, adapter_for(model).config.model_type)
    if mode == "trl":
        from longstraw.peers.trl_peer import TRLPeer

        return TRLPeer(model, config, max_response_length)
    from longstraw.peers.prefix_grouper_peer import PrefixGrouperPeer

    return PrefixGrouperPeer(model, config)
