"""What a captured prompt leaves behind: per-layer entries (`pages`) and the `ResidentState`
that holds them (`resident`)."""

from longstraw.state.pages import (AttentionPages, DecodePages, LatentDecodePages, LatentPages, RecurrentState,
                                   chain_host_pages)
from longstraw.state.resident import ModelBinding, ResidentState, prompt_digest

__all__ = ["AttentionPages", "DecodePages", "LatentDecodePages", "LatentPages", "ModelBinding", "RecurrentState",
           "ResidentState", "chain_host_pages", "prompt_digest"]
