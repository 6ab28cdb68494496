"""LongStraw: long-context GRPO by resident-state capture and serial response replay.

    from longstraw import capture, replay
    state = capture(model, prompt_ids)          # ResidentState, no autograd
    logp = replay(model, state, response_ids)   # float32 [R], under autograd
"""

from longstraw.replay import capture, replay, score
from longstraw.state import ResidentState

__all__ = ["capture", "replay", "score", "ResidentState"]
