"""Where a length curve's cell puts each example's needle: a depth (a share of the context before the needle, 0 its
start), None (the task's own draw), or a band `[lo, hi]`, from which each example draws its own depth by its seed.

A band is what a curve by depth needs on a task whose haystack is one text: RULER's niah tasks cut the same essays
to the length, so at a fixed depth every example's needle follows the same sentence and the examples differ only in
key and value; a cell at one depth measures one place of one essay. Plain Python (the report reads the labels).
"""

from __future__ import annotations

import random
from numbers import Real


def check_depths(depths) -> None:
    """Each entry a fraction in [0, 1] or a band [lo, hi] with 0 <= lo < hi <= 1; a ValueError names the first
    that is not."""
    for depth in depths or ():
        band = isinstance(depth, (list, tuple))
        if band and len(depth) == 2 and all(isinstance(d, Real) for d in depth) and 0 <= depth[0] < depth[1] <= 1:
            continue
        if not band and isinstance(depth, Real) and not isinstance(depth, bool) and 0 <= depth <= 1:
            continue
        raise ValueError(f"depths: each a fraction in [0, 1] or a band [lo, hi] with 0 <= lo < hi <= 1, got {depth!r}")


def example_depth(depth, seed: int) -> float | None:
    """The depth the example of `seed` takes in a cell at `depth`: a band's is drawn uniformly within it from the
    seed alone (the same in every cell and process, whatever else is drawn), a number or None is itself."""
    if not isinstance(depth, (list, tuple)):
        return depth
    lo, hi = depth
    return lo + (hi - lo) * random.Random(f"depth-band/{seed}").random()


def depth_label(depth):
    """A cell's depth as tables and legends show it: a band as `lo-hi`, a number or None as it is."""
    return f"{depth[0]:g}-{depth[1]:g}" if isinstance(depth, (list, tuple)) else depth
