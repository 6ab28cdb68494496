"""Peers: other systems' GRPO loss paths run as modes of the same experiments, on the same model object,
prompt, responses and rewards as ours (`longstraw.core.step`), measured by the same phase recorder.

- `trl` (`trl_peer.py`): TRL 1.16's `GRPOTrainer.compute_loss` (its `_get_per_token_logps_and_entropies` and
  `_compute_loss`), with the gradient checkpointing `Trainer.train()` switches on.
- `prefix_grouper` (`prefix_grouper_peer.py`): PrefixGrouper 0.0.1.post1's documented usage: the prompt once,
  the G responses concatenated after it, its attention split into prefix self-attention + suffix attention.

Each is a `Peer` registered below (`registry.py`); adding one is its step's file and its `register_peer` here
(docs/extending.md). Both come with the optional extra `pip install -e ".[peers]"`. This module imports
neither the peers nor torch, so a plan checks a peer point (`check_peer`) before any work: the extra
installed, the peer applicable to the model's family.

    from longstraw.peers import build_peer
    peer = build_peer("trl", model, GRPOConfig(num_generations=8), max_response_length=2048)
    metrics = peer.step(prompt_ids, responses, rewards, optimizer)
"""

from __future__ import annotations

from longstraw.peers.registry import (
    PEER_MODES,
    Peer,
    PeerNotApplicable,
    PeerStep,
    build_peer,
    check_peer,
    not_applicable,
    peer,
    register_peer,
    unregister_peer,
)

__all__ = [
    "PEER_MODES",
    "Peer",
    "PeerNotApplicable",
    "PeerStep",
    "build_peer",
    "check_peer",
    "not_applicable",
    "peer",
    "register_peer",
    "unregister_peer",
]

# model types whose sequence mixing is attention only: the dense family's (`DenseAdapter.model_types`; written out
# because the report imports this without torch, and tests/test_peers.py ties the two)
ATTENTION_ONLY = ("llama", "qwen3", "glm4_moe")

register_peer(
    Peer(
        name="trl",
        step="longstraw.peers.trl_peer:TRLPeer",
        requirement="trl==1.16.0",
        import_name="trl",
        color="#8172b3",
        difference="TRL's GRPOTrainer puts the prompt in every one of the G rows and runs one checkpointed forward "
        "and backward over all G x (prompt + response) tokens: every row recomputes the prompt, and its gradient is "
        "the full-sequence one (as our exact mode's). On a hybrid model its Gated DeltaNet layers run HF's torch "
        "chunk kernel, as naive's do: fla's chunk backward, which a fast TRL run would take, fails on Hopper with "
        "Triton 3.4-3.7, so on a GPU its hybrid times carry that slower kernel.",
    )
)
register_peer(
    Peer(
        name="prefix_grouper",
        step="longstraw.peers.prefix_grouper_peer:PrefixGrouperPeer",
        requirement="prefix-grouper==0.0.1.post1",
        import_name="prefix_grouper",
        color="#55a868",
        model_types=ATTENTION_ONLY,
        why_not="it splits attention layers only, so the recurrent (Gated DeltaNet) or sparse-attention layers of "
        "this family would carry state from one concatenated response into the next; it applies to attention-only "
        f"types {', '.join(ATTENTION_ONLY)}",
        difference="PrefixGrouper runs the prompt once and the G responses concatenated after it in one "
        "sequence, each response attending to the shared prompt and to itself: one forward and "
        "backward over prompt + G responses, holding the whole prompt's graph (full-sequence "
        "gradient); attention layers only.",
    )
)
