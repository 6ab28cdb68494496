"""Sharded capture: each rank captures its contiguous shard of the prompt.

    state = capture(model, prompt_ids, cp=context_parallel(2))   # under torchrun, on every rank

Layer-major over the rank's shard (the whole shard goes through one layer, then the next), so
what crosses ranks flows one way, from rank r to rank r+1, layer by layer, as a pipeline:

- Gated DeltaNet layers: rank r starts from the conv + recurrent state that rank r-1 had at the
  end of its shard (received before the layer, zeros on rank 0) and sends its own end state on
  (state passing); the union of the shards is then the single-process recurrence.
- attention layers: the earlier shards' K/V of the layer pass rank to rank before it, and the
  rank's own pages go on after it (`longstraw.cp.sharded_attention`); each rank keeps only its own shard's
  pages.
- at the end the last rank broadcasts every GDN layer's final state: replay runs the response's
  layers on every rank, and each needs the state at the prompt boundary.

Within a layer the shard goes `chunk_size` positions at a time, as a single-process capture
calls a layer, so the transient is the shard's hidden states ([shard, hidden]) plus one chunk's
activations, and, for an attention layer, the earlier shards' K/V of that one layer (the last
rank's share of the price of receiving each shard once per layer). `order` and
`memory_budget_bytes` do not apply. No exact mode (prefix_grad) yet.
"""

from __future__ import annotations

import torch

from longstraw.families import adapter_for
from longstraw.cp.sharded_attention import receive_earlier_shards, send_own_shard
from longstraw.cp.group import CPGroup, shard_bounds
from longstraw.cp.shards import ShardedResidentState, ShardPages
from longstraw.measure.memory import synchronize
from longstraw.measure.progress import CaptureProgress
from longstraw.state import AttentionPages, RecurrentState


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
            entry = ShardPages(entry.k_BKPD, entry.v_BKPD, cp=cp, bounds=bounds)
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
        for i, entry in enumerate(layers):
            _receive_before_layer(entry, cp)
            for c0 in range(0, end - start, chunk):
                h_c = h[:, c0:c0 + chunk]
                h[:, c0:c0 + chunk] = adapter.layer_forward(i, h_c, adapter.position_embeddings(h_c, start + c0),
                                                            entry, capturing=True)
                progress_bar.advance_to(i * (end - start) + c0 + h_c.shape[1])
            _send_after_layer(entry, cp)
        progress_bar.close()
        del h
        for entry in (e for e in layers if isinstance(e, RecurrentState)):
            cp.broadcast_(entry.tensors(), cp.world - 1)
    synchronize(device)
    cp.resident_bytes = state.nbytes
    return state


def _receive_before_layer(entry, cp: CPGroup) -> None:
    """What a layer needs from the earlier ranks: the GDN state at the end of the previous shard,
    or the earlier shards' K/V."""
    if isinstance(entry, ShardPages):
        receive_earlier_shards(entry)
    elif cp.rank > 0:
        cp.recv_(entry.tensors(), cp.rank - 1)


def _send_after_layer(entry, cp: CPGroup) -> None:
    if isinstance(entry, ShardPages):
        send_own_shard(entry)
    elif not cp.is_last:
        cp.send(entry.tensors(), cp.rank + 1)
