"""Sharded capture: each rank captures its contiguous shard of the prompt (DESIGN.md §1, issue 8).

    state = capture(model, prompt_ids, cp=context_parallel(2))   # under torchrun, on every rank

Layer-major over the rank's shard (the whole shard goes through one layer, then the next), so
what crosses ranks flows one way, from rank r to rank r+1, layer by layer, as a pipeline:

- Gated DeltaNet layers: rank r starts from the conv + recurrent state that rank r-1 had at the
  end of its shard (received before the layer, zeros on rank 0) and sends its own end state on
  (state passing); the union of the shards is then the single-process recurrence.
- attention layers: the earlier shards' K/V pass rank to rank with log-sum-exp merging
  (`longstraw.cp.attention.capture_attention`); each rank keeps only its own shard's pages.
- at the end the last rank broadcasts every GDN layer's final state: replay runs the response's
  layers on every rank, and each needs the state at the prompt boundary.

Gated DeltaNet layers run `chunk_size` positions at a time (their state carries over, as in a
single-process capture). An attention layer takes the whole shard at once, its MLP `chunk_size`
positions at a time and its queries `chunk_size` at a time against each block: the transient is the
shard's hidden states, its q/k/v and a float32 (out, lse) per query for one layer (the price of
receiving each earlier shard once per layer). `order` and `memory_budget_bytes` do not apply. No exact mode
(prefix_grad) yet.
"""

from __future__ import annotations

import torch

from longstraw.adapters import adapter_for
from longstraw.cp.group import CPGroup, shard_bounds
from longstraw.cp.state import ShardedResidentState, ShardPages
from longstraw.measure import synchronize
from longstraw.state import AttentionPages, RecurrentState
from longstraw.transaction import CaptureProgress


def capture_sharded(model, ids: torch.Tensor, cp: CPGroup, chunk: int, progress: bool | None = None
                    ) -> ShardedResidentState:
    """This rank's share of the resident state of `ids` (validated 1-D prompt ids). The last rank,
    which finishes last, shows the progress bar."""
    adapter = adapter_for(model)
    device, dtype = adapter.device, adapter.compute_dtype
    positions = ids.numel() - 1
    if positions < cp.world:
        raise ValueError(f"a prompt of {ids.numel()} tokens leaves {positions} resident positions, fewer than the "
                         f"{cp.world} context-parallel ranks; use a longer prompt or a smaller cp_size")
    if device != cp.device:
        raise ValueError(f"the model is on {device} but this context-parallel rank runs on {cp.device}")
    bounds = tuple(shard_bounds(positions, cp.world))
    start, end = bounds[cp.rank]
    layers = []
    for i in range(adapter.num_layers):
        entry = adapter.allocate_entry(i, end - start, dtype, device)
        if isinstance(entry, AttentionPages):
            entry = ShardPages(entry.k_BKPD, entry.v_BKPD, cp=cp, bounds=bounds, query_chunk=chunk)
        elif not isinstance(entry, RecurrentState):
            raise ValueError(f"context parallelism covers the dense and hybrid families; {adapter.config.model_type!r} "
                             f"keeps {type(entry).__name__} entries, which have no sharded form yet")
        layers.append(entry)
    per_position, constant = adapter.predicted_bytes(dtype)
    state = ShardedResidentState(
        layers=layers, positions=positions, last_token=int(ids[-1]), model_type=adapter.config.model_type,
        predicted_bytes_per_position=per_position, predicted_constant_bytes=constant, dtype=dtype, device=device,
        cp=cp, shard=(start, end),
    )
    progress_bar = CaptureProgress((end - start) * len(layers), progress if cp.is_last else False,
                                   label=f"capture (rank {cp.rank + 1}/{cp.world}, layer-major)")
    with torch.no_grad(), adapter.selected():
        h = adapter.embed(ids[None, start:end])
        pe = adapter.position_embeddings(h, start)
        for i, entry in enumerate(layers):
            gdn = isinstance(entry, RecurrentState)
            if gdn and cp.rank > 0:
                cp.recv_(entry.tensors(), cp.rank - 1)
            if gdn:  # chunk by chunk, as a single-process capture calls it: small transients, known kernel shapes
                for c0 in range(0, end - start, chunk):
                    h_c = h[:, c0:c0 + chunk]
                    h[:, c0:c0 + chunk] = adapter.layer_forward(i, h_c, adapter.position_embeddings(h_c, start + c0),
                                                                entry, capturing=True)
            else:
                h = adapter.layer_forward(i, h, pe, entry, capturing=True, mlp_chunk=chunk)
            if gdn and not cp.is_last:
                cp.send(entry.tensors(), cp.rank + 1)
            progress_bar.advance_to((i + 1) * (end - start))
        progress_bar.close()
        del h
        for entry in (e for e in layers if isinstance(e, RecurrentState)):
            cp.broadcast_(entry.tensors(), cp.world - 1)
    synchronize(device)
    cp.resident_bytes = state.nbytes
    return state
