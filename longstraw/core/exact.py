"""Exact mode: the full-sequence gradient from a captured prompt (`capture(..., prefix_grad=True)`).

    state = capture(model, prompt_ids, prefix_grad=True)
    for y in responses:
        loss(replay(model, state, y)).backward()   # conditional part; page gradients accumulate
    state.backward_prefix()                        # + the prompt-side part: .grad = full-sequence gradient

Replay treats the resident state as leaves (`AttentionPages.leaves`, `RecurrentState.leaves`,
`LatentPages.leaves`: MLA latent + rope pages; the DSA index keys get none, HF's indexer runs without grad), so
every replay's backward also accumulates dL/dK and dL/dV of the prompt positions in gradient pages
(allocated by autograd on first touch) and the gradient of each Gated DeltaNet layer's final conv
and recurrent state. `backward_prefix` then pushes them into the parameters by one reverse,
chunked recompute of the prompt: for chunks c = last..first, the chunk is recomputed through all
layers under autograd, reading the (final) pages before it as grad-tracking leaves, keeping its
own K/V with their graph, and running each GDN layer differentiably from the state it had at the
chunk's start (checkpointed during capture) to the state at its end. One backward, seeded with
the chunk's accumulated page gradients and the gradient of each GDN layer's end state, adds the
parameter gradients, the gradients of the earlier pages (consumed when their chunk comes up) and
of the GDN start states (the end-state seeds of the chunk before).

Cost: gradient pages as large as the K/V pages; the GDN checkpoints (one conv + recurrent state
per GDN layer per capture chunk); one chunk's full graph at a time; in time about a capture's
forward plus its attention backward. Chunks are the capture's own (`chunk_size`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw.families import adapter_for
from longstraw.state import ResidentState
from longstraw.state.pages import check_entries_implement


@dataclass
class PrefixTrace:
    model: object
    ids: torch.Tensor  # the prompt positions the state covers
    chunk: int
    checkpoints: dict  # (layer, chunk start) -> a GDN layer's (conv, recurrent) state there

    def backward(self, state: ResidentState) -> None:
        backward_prefix(state)


def enable(state: ResidentState, model, ids: torch.Tensor, chunk: int, checkpoints: dict) -> None:
    """Turn a fresh capture into an exact-mode state (leaves over the state, the prompt kept)."""
    check_entries_implement(state.layers, "enable_prefix_grad", "prefix_grad=True (the prompt-side gradient)")
    for entry in state.layers:
        entry.enable_prefix_grad()
    state.prefix_trace = PrefixTrace(model, ids[: state.positions], chunk, checkpoints)


def page_gradients(state: ResidentState) -> list[list[torch.Tensor]]:
    """Each layer's accumulated gradients of its leaves (zeros where no replay reached them)."""
    return [
        [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in entry.leaves]
        for entry in state.layers
    ]


def backward_prefix(state: ResidentState) -> None:
    trace = state.prefix_trace
    recompute_chunks(
        adapter_for(trace.model),
        trace,
        state.layers,
        page_gradients(state),
        range(0, state.positions, trace.chunk),
        state.positions,
    )
    clear_page_gradients(state)


def clear_page_gradients(state: ResidentState) -> None:
    """The page gradients are spent: a second pass starts from zero."""
    for entry in state.layers:
        for leaf in entry.leaves:
            leaf.grad = None


def recompute_chunks(adapter, trace: PrefixTrace, entries, grads, starts: range, end: int) -> None:
    """The reverse recompute of the prompt chunks at `starts` (`trace.chunk` positions each, the last
    ending at `end`), seeded from `grads` (per layer: the gradients of the pages of every position before
    `end`; a GDN layer's, of its state at `end`), through `entries` (pages covering them). Adds the
    parameter gradients; leaves in `grads` those of the pages before `starts[0]` and of each GDN layer's
    state there."""
    with torch.enable_grad(), adapter.selected():
        for start in reversed(starts):
            stop = min(start + trace.chunk, end)
            h = adapter.embed(trace.ids[None, start:stop])
            pe = adapter.position_embeddings(h, start)
            recomputes = [
                entry.for_prefix_recompute(start, trace.checkpoints.get((i, start))) for i, entry in enumerate(entries)
            ]
            for i, recompute in enumerate(recomputes):
                h = adapter.layer_forward(i, h, pe, recompute, capturing=True)
            outputs, seeds = [], []
            for recompute, pair in zip(recomputes, grads):  # pages <- their rows; a GDN end state <- the next start's
                chunk_outputs, chunk_seeds = recompute.chunk_outputs(pair, start, stop)
                outputs += chunk_outputs
                seeds += chunk_seeds
            torch.autograd.backward(outputs, seeds)
            for recompute, pair in zip(recomputes, grads):
                recompute.carry_gradients(pair, start)
