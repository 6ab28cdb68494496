"""Python's cyclic garbage collector kept out of timed phases (`collector_frozen`)."""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def collector_frozen():
    """Within the block, what exists at its start is out of the collector's reach (`gc.freeze`): a full collection
    inside a timed phase would otherwise walk the model's and the libraries' objects (up to 0.33 s measured in a
    hybrid-1b step point's process; vLLM freezes after start-up alike). After the block they are collectable again
    (`gc.unfreeze`), so a process that runs several points in turn (the tests) keeps none of them alive. Nested
    blocks (a trainer's run inside a point's) leave the freezing to the outermost: an inner exit thaws nothing."""
    global _depth
    if _depth == 0:
        gc.collect()
        gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            gc.unfreeze()


_depth = 0  # the collector_frozen blocks open now
