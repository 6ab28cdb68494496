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

from dataclasses import dataclass, field

import torch

from longstraw.families import adapter_for
from longstraw.state import AttentionPages, LatentPages, RecurrentState, ResidentState
from longstraw.state.pages import attend_latent_pages, attend_pages


@dataclass
class PrefixTrace:
    model: object
    ids: torch.Tensor  # the prompt positions the state covers
    chunk: int
    checkpoints: dict  # (layer, chunk start) -> a GDN layer's (conv, recurrent) state there

    def backward(self, state: ResidentState) -> None:
        backward_prefix(state)


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

    attend = attend_pages

    @property
    def prefix_leaves(self):
        return self.prefix_k, self.prefix_v


@dataclass
class RecomputeLatent:
    """An MLA layer while one prompt chunk is recomputed: a grad-tracking leaf over the latent pages
    before the chunk, the index pages before it (read only), the chunk's own entries with their graph."""

    prefix_kv: torch.Tensor
    prefix_index: torch.Tensor | None
    chunk_start: int  # the chunk's first position (the MLA adapter keys IndexShare selections by it)
    live: list = field(default_factory=list)

    def filled(self):
        return self.prefix_kv, self.prefix_index

    on_device = filled  # exact mode keeps its pages on the device
    attend = attend_latent_pages

    def append(self, kv_11TE, index_1TI):
        self.live = [kv_11TE]

    @property
    def prefix_leaves(self):
        return (self.prefix_kv,)


class RecomputeRecurrent(RecurrentState):
    """A GDN layer while one prompt chunk is recomputed: starts from grad-tracking leaves, keeps its
    end state (with its graph) in `final` instead of writing it back."""

    keep_final = True
    final: tuple = ()


def _leaves(*tensors):
    return tuple(t.detach().requires_grad_() for t in tensors)


def enable(state: ResidentState, model, ids: torch.Tensor, chunk: int, checkpoints: dict) -> None:
    """Turn a fresh capture into an exact-mode state (leaves over the state, the prompt kept)."""
    for entry in state.layers:
        if isinstance(entry, AttentionPages):
            entry.leaves = _leaves(entry.k_BKPD[:, :, : entry.length], entry.v_BKPD[:, :, : entry.length])
        elif isinstance(entry, LatentPages):
            entry.leaves = _leaves(entry.kv_11PE[:, :, : entry.length])
        elif isinstance(entry, RecurrentState):
            entry.leaves = _leaves(entry.conv_BCK1, entry.recurrent_BHDV)
        else:
            raise NotImplementedError(f"prefix_grad=True: no prompt-side gradient for {type(entry).__name__} layers")
    state.prefix_trace = PrefixTrace(model, ids[: state.positions], chunk, checkpoints)


def _recompute_entry(entry, layer: int, start: int, checkpoints: dict):
    if isinstance(entry, AttentionPages):
        return RecomputePages(
            *(t[:, :, :start].detach().requires_grad_(start > 0) for t in (entry.k_BKPD, entry.v_BKPD))
        )
    if isinstance(entry, LatentPages):
        index = None if entry.index_1PI is None else entry.index_1PI[:, :start]
        return RecomputeLatent(entry.kv_11PE[:, :, :start].detach().requires_grad_(start > 0), index, start)
    conv, recurrent = checkpoints[(layer, start)]
    recompute = RecomputeRecurrent(conv, recurrent)
    recompute.leaves = _leaves(conv, recurrent)
    return recompute


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
            recomputes = [_recompute_entry(entry, i, start, trace.checkpoints) for i, entry in enumerate(entries)]
            for i, recompute in enumerate(recomputes):
                h = adapter.layer_forward(i, h, pe, recompute, capturing=True)
            outputs, seeds = [], []
            for recompute, pair in zip(recomputes, grads):
                if isinstance(recompute, (RecomputePages, RecomputeLatent)):  # chunk's pages <- their gradients
                    outputs += recompute.live
                    seeds += [g[:, :, start:stop] for g in pair]
                else:  # the GDN state at this chunk's end <- the gradient of the next chunk's start
                    outputs += recompute.final
                    seeds += pair
            torch.autograd.backward(outputs, seeds)
            for i, recompute in enumerate(recomputes):
                if isinstance(recompute, (RecomputePages, RecomputeLatent)):
                    for grad, leaf in zip(grads[i], recompute.prefix_leaves):
                        if leaf.grad is not None:  # None where nothing read them (the last layer)
                            grad[:, :, :start] += leaf.grad
                else:
                    grads[i][:] = [
                        leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in recompute.leaves
                    ]
