"""Exact mode under context parallelism: the full-sequence gradient from a sharded capture.

    state = capture(model, prompt_ids, prefix_grad=True, cp=group)   # every rank
    for y in responses:
        loss(replay(model, state, y)).backward()   # page gradients accumulate on their owners
    state.backward_prefix()                        # every rank, together

Replays accumulate each rank's share of the gradient of its own shard's pages (`sharded_attention`,
`sharded_latent`: a page's gradient stays with its owner); the GDN layers' final states are replicated
on every rank, and so are the gradients the replays leave on them. `backward_prefix` runs the single
process's reverse recompute (`exact.recompute_chunks`) on each rank over its own shard's chunks, in
reverse rank order, since a shard's prompt-side gradient depends on every later shard's:

1. rank W-1 seeds its chunks with its own pages' replay gradients and the GDN final states' gradients;
   every other rank waits for rank r+1, which sends the gradients of every page before its shard
   (the earlier shards' pages, which its queries read) and of each GDN layer's state entering its
   shard (the state at rank r's shard end), adds them to its own pages' and takes the GDN seeds;
2. the rank recomputes its chunks under autograd, reading the pages of every earlier position (every
   shard's pages all-gathered once at the start: a transient as large as the whole state), which adds its
   shard's prompt-side term to the parameters' gradients and leaves the gradients of the earlier
   pages and of its GDN start states, sent on to rank r-1;
3. one all-reduce of the prompt-side terms: every rank ends with the replays' conditional gradient
   (the same on every rank) plus the sum of every shard's prompt-side term, the full-sequence gradient.

Time: the ranks' recomputes run one after another (W times one shard's), as the GDN state's gradient
and the pages' gradients pass backward shard by shard; the chunks are the sharded capture's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw.core import exact
from longstraw.core.exact import PrefixTrace, clear_page_gradients, page_gradients, recompute_chunks
from longstraw.cp.balanced_attention import gather_shards
from longstraw.cp.group import shard_bounds
from longstraw.families import adapter_for


@dataclass
class ShardedPrefixTrace(PrefixTrace):
    def backward(self, state) -> None:
        backward_prefix_sharded(state)


def enable(state, model, ids: torch.Tensor, chunk: int, checkpoints: dict) -> None:
    """Turn a fresh sharded capture into an exact-mode state (leaves over this rank's pages and the GDN
    states; the prompt kept: every rank recomputes the positions of its own shard)."""
    exact.enable(state, model, ids, chunk, checkpoints)
    trace = state.prefix_trace
    state.prefix_trace = ShardedPrefixTrace(trace.model, trace.ids, trace.chunk, trace.checkpoints)


def backward_prefix_sharded(state) -> None:
    trace, cp = state.prefix_trace, state.cp
    bounds, (start, end) = shard_bounds(state.positions, cp.world), state.shard
    entries = [_through_shard_end(entry, cp, bounds, end) for entry in state.layers]
    grads = _own_gradients(state, entries, start, end)
    if not cp.is_last:  # the gradients the later shards left for this one and the pages before it
        received = [torch.empty_like(g) for g, _ in _flat(grads, entries)]
        cp.recv_(received, cp.rank + 1)
        for (mine, is_pages), got in zip(_flat(grads, entries), received):
            if is_pages:  # every later shard's queries read these pages: their shares add up
                mine.add_(got)
            else:  # the GDN state at this shard's end: only the next shard read it
                mine.copy_(got)
    params = [p for p in trace.model.parameters() if p.requires_grad]
    conditional = [p.grad.clone() if p.grad is not None else None for p in params]
    recompute_chunks(adapter_for(trace.model), trace, entries, grads, range(start, end, trace.chunk), end)
    if cp.rank > 0:
        cp.send([g[:, :, :start] if is_pages else g for g, is_pages in _flat(grads, entries)], cp.rank - 1)
    _sum_prompt_terms(cp, params, conditional)
    clear_page_gradients(state)


def _through_shard_end(entry, cp, bounds, end: int):
    """An entry whose pages cover every position before `end` (earlier shards' pages gathered once):
    what the recompute of this rank's chunks reads (`entry.gathered_through`; a GDN layer's is the entry
    itself, its recompute reads the chunk checkpoints)."""
    return entry.gathered_through(end, lambda *tensors: gather_shards(cp, bounds, *tensors))


def _own_gradients(state, entries, start: int, end: int):
    """Per layer, the seeds this rank's replays left: its pages' gradients placed at their positions in
    buffers over every position before `end` (zeros elsewhere), and the GDN final states' gradients."""
    grads = []
    for entry, own in zip(entries, page_gradients(state)):
        if not entry.positional_gradients:  # a GDN final state's: passed on as it is
            grads.append(own)
            continue
        whole = [torch.zeros(*g.shape[:2], end, g.shape[3], dtype=g.dtype, device=g.device) for g in own]
        for w, g in zip(whole, own):
            w[:, :, start:end] = g
        grads.append(whole)
    return grads


def _flat(grads, entries):
    """Every layer's gradients in one list, each with whether it is a page gradient (summed over the
    shards that read the page) or a GDN state's (passed on)."""
    return [(g, e.positional_gradients) for pair, e in zip(grads, entries) for g in pair]


def _sum_prompt_terms(cp, params, conditional) -> None:
    """grad = the conditional gradient (every rank's) + the sum over ranks of each rank's prompt-side term."""
    terms = [
        (p.grad if p.grad is not None else torch.zeros_like(p)) - (c if c is not None else 0)
        for p, c in zip(params, conditional)
    ]
    reached = cp.all_reduce_(torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64))
    for p, c, total, hit in zip(params, conditional, cp.all_reduce_together(terms), reached.tolist()):
        if hit:
            p.grad = total if c is None else c.add_(total)
