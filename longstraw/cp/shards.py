"""What one rank keeps of a context-parallel capture (`longstraw.cp.capture`).

- `ShardPages`: an attention layer's K/V pages for this rank's shard only (the positions
  `bounds[rank]` of the prompt); replay's attention mixer sends them to `longstraw.cp.sharded_attention`;
  a capture runs each attention layer in two passes over the shard (`longstraw.cp.capture`): `collect`
  keeps the chunks' queries and appends their K/V, then `balanced_capture_attention` computes the
  shard's outputs with the work spread over the ranks, and `provide` hands them back chunk by chunk.
- `ShardLatentPages`: an MLA layer's latent + rope-key pages (and index keys on index layers) for this
  rank's shard only; replay selects and attends across the ranks (`longstraw.cp.sharded_latent`); a
  capture writes them from `longstraw.cp.latent_capture`; sampling merges its decoding steps alike.
- GDN layers keep an ordinary `RecurrentState`: the state at the prompt's end, the same on every
  rank (the response's layers run replicated on every rank).
- `ShardedResidentState`: a `ResidentState` whose `positions` is the whole prompt's (replay's
  positions start there) and whose bytes and prediction are this rank's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw.cp.group import CPGroup
from longstraw.cp.sharded_attention import sharded_attention, sharded_decode_attention
from longstraw.cp.sharded_latent import (
    sharded_latent_attention,
    sharded_latent_decode_attention,
    sharded_select_topk,
    sharded_select_topk_decode,
)
from longstraw.state import AttentionPages, LatentPages, ResidentState


@dataclass
class ShardPages(AttentionPages):
    cp: CPGroup | None = None
    bounds: tuple = ()  # every rank's [start, end) of the prompt positions (this rank's: bounds[cp.rank])
    # capture only, one layer at a time: "collect" (queries kept, K/V appended) or "provide" (outputs
    # handed back in chunk order from `outputs`, read at `cursor`)
    phase: str | None = None
    queries: torch.Tensor | None = None
    outputs: torch.Tensor | None = None
    cursor: int = 0
    scale: float | None = None

    def attend(self, q_BHTD, k_BKTD, v_BKTD, scale: float, append: bool, sinks=None):
        """Replay: the response over every rank's pages. Capture (`append`): see `phase`."""
        _refuse_sinks(sinks)
        if not append:
            return sharded_attention(q_BHTD, k_BKTD, v_BKTD, self, scale)
        T = q_BHTD.shape[2]
        if self.phase == "collect":
            if self.queries is None:
                self.queries = q_BHTD.new_empty(*q_BHTD.shape[:2], self.k_BKPD.shape[2], q_BHTD.shape[3])
            self.queries[:, :, self.length : self.length + T] = q_BHTD
            self.scale = scale
            self.append(k_BKTD, v_BKTD)
            return q_BHTD.new_zeros(*q_BHTD.shape[:3], v_BKTD.shape[3])  # the pass's output is not used
        if self.phase == "provide":
            self.cursor += T
            return self.outputs[:, :, self.cursor - T : self.cursor]
        raise RuntimeError(
            "a context-parallel capture runs attention layers in collect/provide passes (longstraw.cp.capture)"
        )

    def attend_decode(self, q_BHTD, own: AttentionPages, scale: float, sinks=None):
        _refuse_sinks(sinks)
        return sharded_decode_attention(q_BHTD, self, own, scale)


def _refuse_sinks(sinks) -> None:
    # a capture meets it at its first attention layer, before any rank is reached
    if sinks is not None:
        raise ValueError(
            "a context-parallel capture: attention sinks (gpt-oss) have no context-parallel form yet "
            "(balanced_attention and sharded_attention merge no sink); capture without cp"
        )


@dataclass
class ShardLatentPages(LatentPages):
    cp: CPGroup | None = None
    bounds: tuple = ()  # every rank's [start, end) of the prompt positions (this rank's: bounds[cp.rank])

    def attend(self, q_1HTE, live_11TE, *, rank: int, scale: float, append: bool, index=None, selection=None):
        """Replay: the response over every rank's pages (an index layer selects over every rank's index keys)."""
        if append:
            raise RuntimeError(
                "a context-parallel capture runs MLA layers over gathered pages (longstraw.cp.latent_capture)"
            )
        if index is not None:
            selection = (
                sharded_select_topk(index, self) if index.selects(self.bounds[-1][1] + q_1HTE.shape[2]) else None
            )
        out_1HTC = sharded_latent_attention(q_1HTE, live_11TE, self, rank=rank, scale=scale, selection_TK=selection)
        return out_1HTC, selection

    def attend_decode(self, q_BH1E, own: LatentPages, *, rank: int, scale: float, index=None, selection=None):
        """Sampling: each sequence's query over every rank's pages and its own entries (replicated on every
        rank; the last rank counts them), selected and merged as replay is."""
        if index is not None:
            selection = (
                sharded_select_topk_decode(index, self, own) if index.selects(self.bounds[-1][1] + own.length) else None
            )
        return sharded_latent_decode_attention(
            q_BH1E, self, own, rank=rank, scale=scale, selection_BK=selection
        ), selection


@dataclass
class ShardedResidentState(ResidentState):
    cp: CPGroup | None = None
    shard: tuple[int, int] = (0, 0)

    @property
    def local_positions(self) -> int:
        return self.shard[1] - self.shard[0]

    def why_not_extendable(self) -> str | None:
        return (
            "a context-parallel state: its ranks hold shards of fixed bounds; capture the whole history with cp instead"
        )
