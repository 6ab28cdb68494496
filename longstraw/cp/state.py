"""What one rank keeps of a context-parallel capture (`longstraw.cp.capture`).

- `ShardPages`: an attention layer's K/V pages for this rank's shard only (the positions
  `bounds[rank]` of the prompt); the attention mixer sends them to `longstraw.cp.attention`.
- GDN layers keep an ordinary `RecurrentState`: the state at the prompt's end, the same on every
  rank (the response's layers run replicated on every rank).
- `ShardedResidentState`: a `ResidentState` whose `positions` is the whole prompt's (replay's
  positions start there) and whose bytes and prediction are this rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from longstraw.cp.group import CPGroup
from longstraw.state import AttentionPages, ResidentState


@dataclass
class ShardPages(AttentionPages):
    cp: CPGroup | None = None
    bounds: tuple = ()  # every rank's [start, end) of the prompt positions (this rank's: bounds[cp.rank])
    # capture only: the earlier ranks' K/V of the layer being captured, received before its chunks
    # and dropped after them (`longstraw.cp.attention`)
    earlier: list = field(default_factory=list)


@dataclass
class ShardedResidentState(ResidentState):
    cp: CPGroup | None = None
    shard: tuple[int, int] = (0, 0)

    @property
    def local_positions(self) -> int:
        return self.shard[1] - self.shard[0]
