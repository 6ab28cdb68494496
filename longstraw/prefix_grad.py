"""Exact mode: the full-sequence gradient from a captured prompt (`capture(..., prefix_grad=True)`).

    state = capture(model, prompt_ids, prefix_grad=True)
    for y in responses:
        loss(replay(model, state, y)).backward()   # conditional part; page gradients accumulate
    state.backward_prefix()                        # + the prompt-side part: .grad = full-sequence gradient

Replay treats the resident K/V pages as leaves (`AttentionPages.leaves`), so every replay's
backward also accumulates dL/dK and dL/dV of the prompt positions in gradient pages, allocated by
autograd on first touch. `backward_prefix` then pushes them into the parameters by one reverse,
chunked recompute of the prompt: for chunks c = last..first, the chunk is recomputed through all
layers under autograd, reading the (final) pages before it as grad-tracking leaves and keeping its
own K/V with their graph; one backward seeded with the chunk's accumulated page gradients adds
the parameter gradients and the gradients of the earlier pages (consumed when their own chunk
comes up). Chunk boundaries are free: the pages are final, so no capture-time checkpoint is needed.

Cost: gradient pages as large as the K/V pages, one chunk's full graph at a time, and about a
capture's forward plus its attention backward in time.

Simplification: attention-only families (llama, qwen3, glm4_moe). Gated DeltaNet layers would need
their conv and recurrent states checkpointed at chunk boundaries during capture and their state
gradients carried backward from chunk to chunk; capture(prefix_grad=True) refuses them for now.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longstraw.adapters import adapter_for
from longstraw.state import AttentionPages, ResidentState

DEFAULT_CHUNK = 2048


@dataclass
class PrefixTrace:
    model: object
    ids: torch.Tensor  # the prompt positions the state covers
    chunk: int


@dataclass
class RecomputePages:
    """An attention layer while one prompt chunk is recomputed under autograd."""

    prefix_k: torch.Tensor
    prefix_v: torch.Tensor
    live: list = field(default_factory=list)

    def filled(self):
        return self.prefix_k, self.prefix_v

    def append(self, k_BKTD, v_BKTD):
        self.live = [k_BKTD, v_BKTD]


def enable(state: ResidentState, model, ids: torch.Tensor, chunk: int | None) -> None:
    """Turn a fresh capture into an exact-mode state (leaves over the pages, the prompt kept)."""
    if not all(isinstance(entry, AttentionPages) for entry in state.layers):
        kinds = sorted({type(e).__name__ for e in state.layers} - {"AttentionPages"})
        raise NotImplementedError(f"prefix_grad=True supports attention-only families so far; this model's "
                                  f"{', '.join(kinds)} layers have no prompt-side gradient yet")
    for entry in state.layers:
        entry.leaves = tuple(t.detach().requires_grad_() for t in (entry.k_BKPD[:, :, :entry.length],
                                                                   entry.v_BKPD[:, :, :entry.length]))
    state.prefix_trace = PrefixTrace(model, ids[:state.positions], chunk or DEFAULT_CHUNK)


def backward_prefix(state: ResidentState) -> None:
    trace = state.prefix_trace
    adapter = adapter_for(trace.model)
    grads = [[leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in entry.leaves]
             for entry in state.layers]
    with torch.enable_grad(), adapter.selected():
        for start in reversed(range(0, state.positions, trace.chunk)):
            end = min(start + trace.chunk, state.positions)
            h = adapter.embed(trace.ids[None, start:end])
            pe = adapter.position_embeddings(h, start)
            pages = [RecomputePages(*(t[:, :, :start].detach().requires_grad_(start > 0)
                                      for t in (entry.k_BKPD, entry.v_BKPD))) for entry in state.layers]
            for i, recompute in enumerate(pages):
                h = adapter.layer_forward(i, h, pe, recompute, capturing=True)
            outputs = [t for recompute in pages for t in recompute.live]
            seeds = [g[:, :, start:end] for pair in grads for g in pair]
            torch.autograd.backward(outputs, seeds)
            for (dk, dv), recompute in zip(grads, pages):
                if recompute.prefix_k.grad is not None:  # None where nothing read them (the last layer)
                    dk[:, :, :start] += recompute.prefix_k.grad
                    dv[:, :, :start] += recompute.prefix_v.grad
    for entry in state.layers:  # the page gradients are spent: a second pass starts from zero
        for leaf in entry.leaves:
            leaf.grad = None
