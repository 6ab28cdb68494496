"""Sharded capture: each rank captures its contiguous shard of the prompt.

    state = capture(model, prompt_ids, cp=context_parallel(2))   # under torchrun, on every rank

Layer-major over the rank's shard (the whole shard goes through one layer, then the next); the
ranks meet once or twice per layer, and no rank's work waits on a chain of earlier ranks:

- Gated DeltaNet layers: no rank waits on another's recurrence (`longstraw.cp.gdn_shards`): before
  the layer each rank gets the previous shard's last conv inputs (one exchange) and every shard's
  transition of the delta rule (one all-gather), composes the state at its shard's start, and the
  layer runs from it; the union of the shards is then the single-process recurrence.
- attention layers: two passes over the shard's chunks, with the layer's attention computed between
  them by `longstraw.cp.balanced_attention`, every rank doing the same share of the causal work (the
  layer's K/V all-gathered, query chunks moved in a zigzag); each rank keeps only its own shard's pages.
- at the end the last rank broadcasts every GDN layer's final state: replay runs the response's
  layers on every rank, and each needs the state at the prompt boundary.

Within a layer the shard goes `chunk_size` positions at a time, as a single-process capture
calls a layer, so the transient is the shard's hidden states ([shard, hidden]) plus one chunk's
activations, and, for an attention layer, the shard's queries and attention outputs and the whole
prompt's K/V of that one layer (all-gathered for the balanced attention). `order` and
`memory_budget_bytes` do not apply. Exact mode (prefix_grad) keeps each GDN layer's state at every
chunk start (`checkpoints`) for `longstraw.core.exact_cp`.
"""

from __future__ import annotations

import torch

from longstraw.cp.balanced_attention import balanced_capture_attention
from longstraw.cp.gdn_shards import enter_gdn_layer
from longstraw.cp.group import CPGroup, shard_bounds
from longstraw.cp.latent_capture import capture_latent_layer
from longstraw.cp.shards import ShardedResidentState, ShardLatentPages, ShardPages
from longstraw.families import adapter_for
from longstraw.kernels.rms_norm import rms_norm
from longstraw.measure.memory import synchronize
from longstraw.measure.progress import CaptureProgress
from longstraw.state.pages import check_entries_implement


def capture_sharded(
    model, ids: torch.Tensor, cp: CPGroup, chunk: int, progress: bool | None = None, checkpoints: dict | None = None
) -> ShardedResidentState:
    """This rank's share of the resident state of `ids` (validated 1-D prompt ids). The last rank,
    which finishes last, shows the progress bar. `checkpoints` (exact mode) receives each GDN layer's
    state at the start of each of this shard's chunks, keyed (layer, position)."""
    adapter = adapter_for(model)
    positions = ids.numel() - 1
    _check_shardable(ids.numel(), cp, adapter.device)
    bounds = tuple(shard_bounds(positions, cp.world))
    start, end = bounds[cp.rank]
    forms = ShardForms(cp, bounds)
    state, capture_layers = _allocated_shard(adapter, ids, forms, start, end)
    progress_bar = CaptureProgress(
        (end - start) * len(state.layers),
        progress if cp.is_last else False,
        label=f"capture (rank {cp.rank + 1}/{cp.world}, layer-major)",
    )
    with torch.no_grad(), adapter.selected():
        h = adapter.embed(ids[None, start:end])
        for i, (entry, capture_layer) in enumerate(zip(state.layers, capture_layers)):
            capture_layer(adapter, i, h, entry, forms, chunk, checkpoints, progress_bar)
            progress_bar.advance_to((i + 1) * (end - start))
        progress_bar.close()
        del h
        for entry in forms.replicated:  # the GDN states at the prompt's end, the last rank's
            cp.broadcast_(entry.tensors(), cp.world - 1)
    synchronize(adapter.device)
    cp.resident_bytes = state.nbytes
    return state


def _check_shardable(tokens: int, cp: CPGroup, device) -> None:
    """Refuse a prompt with fewer resident positions than ranks, or a model on another device than the rank's."""
    positions = tokens - 1
    if positions < cp.world:
        raise ValueError(
            f"a prompt of {tokens} tokens leaves {positions} resident positions, fewer than the "
            f"{cp.world} context-parallel ranks; use a longer prompt or a smaller cp_size"
        )
    if device != cp.device:
        raise ValueError(f"the model is on {device} but this context-parallel rank runs on {cp.device}")


def _allocated_shard(adapter, ids, forms: ShardForms, start: int, end: int) -> tuple[ShardedResidentState, list]:
    """The rank's empty shard of the state (each layer's entry in its context-parallel form, positions
    `start:end`) and each layer's capture function."""
    device, dtype, cp = adapter.device, adapter.compute_dtype, forms.cp
    entries = [adapter.allocate_entry(i, end - start, dtype, device) for i in range(adapter.num_layers)]
    check_entries_implement(entries, "for_shard", f"a context-parallel capture of {adapter.config.model_type!r}")
    layers, capture_layers = map(list, zip(*(entry.for_shard(forms) for entry in entries)))
    per_position, constant = adapter.predicted_bytes(dtype)
    state = ShardedResidentState(
        layers=layers,
        positions=ids.numel() - 1,
        last_token=int(ids[-1]),
        model_type=adapter.config.model_type,
        predicted_bytes_per_position=per_position,
        predicted_constant_bytes=constant,
        dtype=dtype,
        device=device,
        cp=cp,
        shard=(start, end),
    )
    return state, capture_layers


class ShardForms:
    """The context-parallel form of each kind of resident entry, with how a capture runs its layer over the
    rank's shard (`entry.for_shard(forms)` picks its own: attention pages, latent pages or a recurrent state)."""

    def __init__(self, cp: CPGroup, bounds: tuple):
        self.cp, self.bounds = cp, bounds
        self.replicated = []  # entries every rank holds whole (the last rank's broadcast after the capture)

    def pages(self, entry):
        return ShardPages(entry.k_BKPD, entry.v_BKPD, cp=self.cp, bounds=self.bounds), _attention_layer

    def latent(self, entry):
        shard = ShardLatentPages(entry.kv_11PE, entry.index_1PI, entry.kv_lora_rank, cp=self.cp, bounds=self.bounds)
        return shard, _latent_layer

    def recurrent(self, entry):
        self.replicated.append(entry)
        return entry, _gdn_layer


def _latent_layer(adapter, i: int, h, pages, forms: ShardForms, chunk: int, checkpoints, progress_bar) -> None:
    h[:] = capture_latent_layer(adapter, i, h, pages, forms.cp, forms.bounds, chunk)


def _gdn_layer(adapter, i: int, h, entry, forms: ShardForms, chunk: int, checkpoints, progress_bar) -> None:
    """A GDN layer over the shard (in place), from the state at this shard's start; exact mode keeps its state
    at each chunk start (`checkpoints`)."""
    cp, bounds = forms.cp, forms.bounds
    start, end = bounds[cp.rank]
    enter_gdn_layer(adapter, i, h, entry, cp, bounds, chunk)  # GDN: the state at this shard's start
    for c0 in range(0, end - start, chunk):
        if checkpoints is not None:
            checkpoints[(i, start + c0)] = entry.chunk_checkpoint()
        h_c = h[:, c0 : c0 + chunk]
        h[:, c0 : c0 + chunk] = adapter.layer_forward(
            i, h_c, adapter.position_embeddings(h_c, start + c0), entry, capturing=True
        )
        progress_bar.advance_to(i * (end - start) + c0 + h_c.shape[1])


def _attention_layer(
    adapter, i: int, h, pages: ShardPages, forms: ShardForms, chunk: int, checkpoints, progress_bar
) -> None:
    """One attention layer over the rank's shard `h` (in place), in two passes of its chunks: the first
    keeps their queries and appends their K/V (its output unused), then the shard's attention outputs
    come from `balanced_capture_attention` (the work spread over the ranks), and the second pass runs
    the layer on them. The second pass recomputes the layer's projections: cheap beside long-prompt
    attention."""
    layer, shard, start = adapter.layers[i], h.shape[1], forms.bounds[forms.cp.rank][0]
    pages.phase = "collect"
    for c0 in range(0, shard, chunk):
        h_c = h[:, c0 : c0 + chunk]
        adapter.mix(i, rms_norm(layer.input_layernorm, h_c), adapter.position_embeddings(h_c, start + c0), pages, True)
    pages.outputs = balanced_capture_attention(
        pages.queries, *pages.filled(), pages.cp, pages.bounds, pages.scale, chunk
    )
    pages.phase, pages.queries, pages.cursor = "provide", None, 0
    for c0 in range(0, shard, chunk):
        h_c = h[:, c0 : c0 + chunk]
        h[:, c0 : c0 + chunk] = adapter.layer_forward(
            i, h_c, adapter.position_embeddings(h_c, start + c0), pages, capturing=True
        )
    pages.phase, pages.outputs = None, None
