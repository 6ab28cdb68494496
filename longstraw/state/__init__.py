"""What a captured prompt leaves behind: per-layer entries (`pages`) and the `ResidentState`
that holds them (`resident`)."""

from longstraw.state.pages import (
    AttentionPages,
    DecodePages,
    IndexQueries,
    LatentDecodePages,
    LatentPages,
    RecurrentState,
    attend_latent_pages,
    attention_output_unused,
    chain_host_pages,
)
from longstraw.state.resident import ModelBinding, ResidentState, prompt_digest, prompt_hash

__all__ = [
    "AttentionPages",
    "DecodePages",
    "IndexQueries",
    "LatentDecodePages",
    "LatentPages",
    "ModelBinding",
    "RecurrentState",
    "ResidentState",
    "attend_latent_pages",
    "attention_output_unused",
    "chain_host_pages",
    "prompt_digest",
    "prompt_hash",
]
