"""What one rank keeps of a context-parallel capture (`longstraw.cp.capture`).

- `ShardPages`: an attention layer's K/V pages for this rank's shard only (the positions
  `bounds[rank]` of the prompt); the attention mixer sends them to `longstraw.cp.sharded_attention`.
- GDN layers keep an ordinary `RecurrentState`: the state at the prompt's end, the same on every
  rank (the response's layers run replicated on every rank).
- `ShardedResidentState`: a `ResidentState` whose `positions` is the whole prompt's (replay's
  positions start there) and whose bytes and prediction are this rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from longstraw.cp.group import CPGroup
from longstraw.cp.sharded_attention import capture_attention, sharded_attention, sharded_decode_attention
from longstraw.measure.timing import timed_attention
from longstraw.state import AttentionPages, ResidentState


@dataclass
class ShardPages(AttentionPages):
    cp: CPGroup | None = None
    bounds: tuple = ()  # every rank's [start, end) of the prompt positions (this rank's: bounds[cp.rank])
    # capture only: the earlier ranks' K/V of the layer being captured, received before its chunks
    # and dropped after them (`longstraw.cp.sharded_attention`)
    earlier: list = field(default_factory=list)

    def attend(self, q_BHTD, k_BKTD, v_BKTD, scale: float, append: bool):
        """Replay: the response over every rank's pages. Capture (`append`): a chunk of this shard over
        the earlier shards and this shard's pages so far, then its K/V join the pages."""
        if not append:
            return sharded_attention(q_BHTD, k_BKTD, v_BKTD, self, scale)
        with timed_attention(q_BHTD, self.bounds[self.cp.rank][0] + self.length):  # the earlier shards count
            out_BHTD = capture_attention(q_BHTD, k_BKTD, v_BKTD, self, scale)
        self.append(k_BKTD, v_BKTD)
        return out_BHTD

    def attend_decode(self, q_BHTD, own: AttentionPages, scale: float):
        return sharded_decode_attention(q_BHTD, self, own, scale)


@dataclass
class ShardedResidentState(ResidentState):
    cp: CPGroup | None = None
    shard: tuple[int, int] = (0, 0)

    @property
    def local_positions(self) -> int:
        return self.shard[1] - self.shard[0]
