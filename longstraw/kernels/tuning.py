"""What the Triton kernels' autotuners key on besides the shapes they are compiled for."""

from __future__ import annotations


def log2_bucket(count: int) -> int:
    """`count`'s power of two, rounded up (0 for 0 and 1): a length key for an autotuner. Triton's autotuner keeps
    the first call's choice for every call with the same key (on disk too, with TRITON_CACHE_AUTOTUNING), and how a
    kernel's configurations rank depends on how much work each program gets: keyed on this, a choice is reused
    within a factor of two of the length it was made at, not across (the CUDA tests' 1,000 tokens against a
    32,768-token capture: the capture scan kept 64-wide blocks there, 2 ms a step slower on an H200). A new bucket
    costs timing runs only: the configurations' binaries do not depend on it."""
    return max(0, count - 1).bit_length()
