"""Balanced capture attention: every rank does the same share of a layer's causal attention.

With contiguous shards the last of N ranks attends over every earlier shard, (2N-1)/N^2 of the causal
triangle (3/4 on 2 ranks), while rank 0 does 1/N^2. Pages stay contiguous (replay, and the response's
position after the last shard, depend on it); only the capture's attention work moves:

* each rank's shard is split into two halves, so the prompt is 2N query chunks, chunk c owned by rank
  c // 2;
* rank r computes the chunks r and 2N-1-r (a zigzag): chunk c's causal work grows with c, so each rank's
  pair costs about the same, 2N-1 chunk-widths of keys over two chunks of queries;
* the layer's K/V are all-gathered once (each rank then holds the whole prompt's K/V of this one layer,
  a transient); a chunk's queries travel from their owner to the computing rank, its output back.

A chunk's output is exact attention over every earlier position and its own causal keys, computed by
`attention_partial` with cuDNN's forward on CUDA (the capture kernel) and the math kernel on CPU.
Point-to-point traffic per layer and rank: at most two chunks of queries out and two of outputs back.
`zigzag_map` is the schedule alone (a chunk's rows to its computing rank, the results back); MLA layers
run whole on it (`longstraw.cp.latent_capture`).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from longstraw.cp.group import CPGroup, shard_bounds
from longstraw.kernels.paged_attention import attention_partial, kernel_and_block
from longstraw.measure.flops import attention_forward_flops
from longstraw.measure.timing import AttentionTimer


def zigzag_chunks(bounds) -> list[tuple[int, int]]:
    """The 2N query chunks [start, end): each shard's two halves, in prompt order."""
    chunks = []
    for start, end in bounds:
        chunks += [(start + a, start + b) for a, b in shard_bounds(end - start, 2)]
    return chunks


def computing_rank(chunk: int, world: int) -> int:
    """The rank that computes query chunk `chunk` of 2 * world: rank r takes r and 2 * world - 1 - r."""
    return chunk if chunk < world else 2 * world - 1 - chunk


@torch.no_grad()
def balanced_capture_attention(
    q_1HSD, k_1KSD, v_1KSD, cp: CPGroup, bounds, scale: float, rows_per_call: int
) -> torch.Tensor:
    """[1, H, S, Dv]: exact causal attention of this rank's shard queries `q_1HSD` over the whole prompt,
    the work spread as the module doc says; `k_1KSD`, `v_1KSD` are this rank's shard K/V. A chunk's
    queries go to the kernel `rows_per_call` at a time (the capture's chunk size), as a single-process
    capture calls it: larger calls grow the math kernel's score blocks (on 2 CPU ranks, 4,096-row calls
    ran 1.7x slower per FLOP than 1,024-row ones)."""
    k_all, v_all = gather_shards(cp, bounds, k_1KSD, v_1KSD)
    kernel, block = kernel_and_block("auto", q_1HSD, v_1KSD.shape[-1], None)
    return zigzag_map(
        q_1HSD,
        2,
        lambda q_1HTD, chunk: _chunk_attention(q_1HTD, k_all, v_all, chunk, scale, block, kernel, rows_per_call),
        cp,
        bounds,
        v_1KSD.shape[-1],
    )


def zigzag_map(x_own, dim: int, compute, cp: CPGroup, bounds, out_features: int) -> torch.Tensor:
    """This rank's shard of `compute(x_chunk, (a, b))` over the zigzag's query chunks: each chunk's rows of
    `x` (along `dim`; `x_own` is this rank's shard of them) travel from their owner to the chunk's
    computing rank, and the result (x's shape, last dim `out_features`) comes back. Each rank computes its
    two chunks in prompt order."""
    chunks, world, rank = zigzag_chunks(bounds), cp.world, cp.rank
    offset = bounds[rank][0]
    mine = [c for c in (rank, 2 * world - 1 - rank) if chunks[c][1] > chunks[c][0]]
    owned = [c for c in (2 * rank, 2 * rank + 1) if chunks[c][1] > chunks[c][0]]

    def own_rows(t, c):
        return t.narrow(dim, chunks[c][0] - offset, chunks[c][1] - chunks[c][0])

    def rows_like(t, c, features):
        shape = list(t.shape)
        shape[dim], shape[-1] = chunks[c][1] - chunks[c][0], features
        return t.new_empty(shape)

    inputs = {c: own_rows(x_own, c).contiguous() for c in owned if computing_rank(c, world) == rank}
    incoming = {c: rows_like(x_own, c, x_own.shape[-1]) for c in mine if c // 2 != rank}
    exchange(
        sends=[(own_rows(x_own, c), computing_rank(c, world)) for c in owned if computing_rank(c, world) != rank],
        recvs=[(incoming[c], c // 2) for c in incoming],
    )
    inputs.update(incoming)
    outputs = {c: compute(inputs[c], chunks[c]) for c in mine}
    out_own = x_own.new_empty(*x_own.shape[:-1], out_features)
    for c in owned:
        if computing_rank(c, world) == rank:
            own_rows(out_own, c).copy_(outputs[c])
    returned = {c: rows_like(out_own, c, out_features) for c in owned if computing_rank(c, world) != rank}
    exchange(
        sends=[(outputs[c], c // 2) for c in mine if c // 2 != rank],
        recvs=[(returned[c], computing_rank(c, world)) for c in returned],
    )
    for c, part in returned.items():
        own_rows(out_own, c).copy_(part)
    return out_own


def _chunk_attention(q_1HTD, k_all, v_all, chunk, scale, block, kernel, rows_per_call: int) -> torch.Tensor:
    """One query chunk [a, b) over the keys before it and its own causal keys, `rows_per_call` queries
    per kernel call."""
    a, b = chunk
    timer = AttentionTimer.active
    flops = attention_forward_flops(q_1HTD.shape[1], q_1HTD.shape[3], b - a, a)
    parts = []
    with timer.call(flops) if timer is not None else nullcontext():
        for start in range(a, b, rows_per_call):
            end = min(start + rows_per_call, b)
            q_part = q_1HTD[:, :, start - a : end - a].contiguous()
            out, _ = attention_partial(
                q_part,
                k_all[:, :, :start],
                v_all[:, :, :start],
                k_all[:, :, start:end],
                v_all[:, :, start:end],
                scale,
                block,
                kernel,
            )
            parts.append(out.to(q_1HTD.dtype))
    return torch.cat(parts, dim=2)


def gather_shards(cp: CPGroup, bounds, *shards_1XSD):
    """The whole prompt's tensors (contiguous, as the CUDA kernels take them) from every rank's shard of
    each [1, X, S, D] tensor; shards of unequal length are padded to the longest for the all-gather,
    then trimmed."""
    longest = max(end - start for start, end in bounds)

    def gather(t):
        padded = t.new_zeros(*t.shape[:2], longest, t.shape[3])
        padded[:, :, : t.shape[2]] = t
        parts = cp.all_gather(padded)
        return torch.cat([part[:, :, : end - start] for part, (start, end) in zip(parts, bounds)], dim=2)

    return tuple(gather(t) for t in shards_1XSD)


def exchange(sends, recvs) -> None:
    """Point-to-point sends [(tensor, dst)] and receives into [(tensor, src)], posted together so no
    ordering between ranks can deadlock."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), dst) for t, dst in sends]
    ops += [dist.P2POp(dist.irecv, t, src) for t, src in recvs]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
