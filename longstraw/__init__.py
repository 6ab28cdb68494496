"""LongStraw: long-context GRPO by resident-state capture and serial response replay.

from longstraw import capture, replay
state = capture(model, prompt_ids)          # ResidentState, no autograd
extend(model, state, more_ids)              # the same state grown by more prompt tokens (an agent's history)
logp = replay(model, state, response_ids)   # float32 [R], under autograd
"""

_EXPORTS = {
    "capture": "core.transaction",
    "extend": "core.transaction",
    "replay": "core.transaction",
    "score": "core.transaction",
    "ResidentState": "state",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    # Lazy: the pipeline's planning and reporting modules need neither torch nor transformers.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"longstraw.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'longstraw' has no attribute {name!r}")
