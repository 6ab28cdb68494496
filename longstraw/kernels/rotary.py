"""The attention layers' rotary embedding: HF's own `apply_rotary_pos_emb`, or on CUDA a Triton launch each for q and k.

HF's attention modules call their modeling file's `apply_rotary_pos_emb(q, k, cos, sin)` themselves. Within
`fused_rotary_selected(modules)` that name, in the modeling files of the given modules whose models compute the
rotate-half form (`ROTATE_HALF_MODELS`: the first cos.shape[-1] features rotate, the rest pass through; checked
against the formula by the tests), is `fused_apply_rotary_pos_emb` bound to HF's function: on CUDA with [B, H, T, D]
q and k and angles that carry no gradient, `rotary_triton.Rotary` (8 bf16-rounding launches become 2, each feature
rounded once: within bf16 rounding of HF's); every other call HF's function itself, the plain reference.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager

import torch

from longstraw.kernels.optional_import import optional_function

# model types whose HF modeling file's apply_rotary_pos_emb is the rotate-half form with partial rotation
ROTATE_HALF_MODELS = ("llama", "qwen3", "qwen3_next", "qwen3_5", "qwen3_5_moe", "gemma3")
_MODELING_FILES = frozenset(f"transformers.models.{m}.modeling_{m}" for m in ROTATE_HALF_MODELS)


# `rotary_triton.rotary` (x, cos, sin), or None when Triton does not import
_load_rotary = functools.partial(optional_function, "longstraw.kernels.rotary_triton", "rotary")


def _fused_usable(q, k, cos, sin, unsqueeze_dim) -> bool:
    """q and k [B, H, T, D] on CUDA (features contiguous) and cos and sin [B or 1, T, R] of one layout, R even and at
    most D, all of one 16- or 32-bit dtype, the angles without a gradient: what `rotary_triton.Rotary` takes."""
    return (
        q.is_cuda
        and unsqueeze_dim == 1
        and q.dim() == k.dim() == 4
        and cos.dim() == 3
        and q.shape[0] == k.shape[0]
        and q.shape[2] == k.shape[2] == cos.shape[1]
        and cos.shape[0] in (1, q.shape[0])
        and cos.shape[-1] % 2 == 0
        and cos.shape[-1] <= min(q.shape[-1], k.shape[-1])
        and sin.shape == cos.shape
        and q.stride(-1) == k.stride(-1) == cos.stride(-1) == 1
        and sin.stride() == cos.stride()
        and q.dtype == k.dtype == cos.dtype == sin.dtype
        and q.dtype != torch.float64
        and not (cos.requires_grad or sin.requires_grad)
        and _load_rotary() is not None
    )


def fused_apply_rotary_pos_emb(hf_function, q, k, cos, sin, unsqueeze_dim=1):
    """`hf_function(q, k, cos, sin, unsqueeze_dim)`: one Triton launch each for q and k where usable."""
    if not _fused_usable(q, k, cos, sin, unsqueeze_dim):
        return hf_function(q, k, cos, sin, unsqueeze_dim)
    rotate = _load_rotary()
    return rotate(q, cos, sin), rotate(k, cos, sin)


@contextmanager
def fused_rotary_selected(modules):
    """Within the block, the modeling files of `modules` (HF attention modules) of the `ROTATE_HALF_MODELS` call
    `fused_apply_rotary_pos_emb`; on exit they call HF's function again. Nested blocks swap once."""
    files = {type(m).__module__ for m in modules} & _MODELING_FILES
    swapped = {}
    try:
        for name in files:
            module = sys.modules[name]
            hf_function = module.apply_rotary_pos_emb
            if not isinstance(hf_function, functools.partial):  # not already swapped by an enclosing block
                swapped[name] = hf_function
                module.apply_rotary_pos_emb = functools.partial(fused_apply_rotary_pos_emb, hf_function)
        yield
    finally:
        for name, hf_function in swapped.items():
            sys.modules[name].apply_rotary_pos_emb = hf_function
