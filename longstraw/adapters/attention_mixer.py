"""Full-attention layers through HF's own attention modules, with our paged attention inside.

HF attention modules do the per-token work (projections, q/k norms, rotary, output gate,
o_proj) and then call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`. We register one
more implementation, "longstraw", that attends the live queries over the layer's resident
pages plus the live keys, and (during capture) appends the live K/V to the pages in place.
The pages reach it as a keyword argument that HF forwards untouched; no HF cache is used.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

from transformers import AttentionInterface

from longstraw.attention import decode_attention, paged_attention
from longstraw.cp.attention import capture_attention, sharded_attention, sharded_decode_attention
from longstraw.cp.state import ShardPages
from longstraw.flops import attention_forward_flops
from longstraw.measure import AttentionTimer
from longstraw.state import AttentionPages, DecodePages

IMPLEMENTATION = "longstraw"


def _longstraw_attention(module, query_BHTD, key_BKTD, value_BKTD, attention_mask, scaling=None, dropout=0.0,
                         longstraw_pages: AttentionPages | None = None, longstraw_append: bool = False, **kwargs):
    if longstraw_pages is None:
        raise RuntimeError("longstraw attention called without resident pages (use longstraw.capture/replay)")
    if kwargs.get("sliding_window") is not None or getattr(module, "sliding_window", None):
        raise ValueError("sliding-window attention layers are not supported by the longstraw adapters")
    scale = scaling if scaling is not None else query_BHTD.shape[-1] ** -0.5
    if isinstance(longstraw_pages, DecodePages):  # sampling: shared prompt pages + each sequence's own
        longstraw_pages.own.append(key_BKTD, value_BKTD)
        if isinstance(longstraw_pages.shared, ShardPages):  # context parallel: the prompt's pages are sharded
            out_BHTD = sharded_decode_attention(query_BHTD, longstraw_pages, scale)
        else:
            out_BHTD = decode_attention(query_BHTD, *longstraw_pages.shared.filled(), *longstraw_pages.own.filled(),
                                        scale=scale)
        return out_BHTD.transpose(1, 2).contiguous(), None
    sharded = isinstance(longstraw_pages, ShardPages)  # context parallel: this rank holds one shard of the prompt
    if sharded and not longstraw_append:
        out_BHTD = sharded_attention(query_BHTD, key_BKTD, value_BKTD, longstraw_pages, scale)
        return out_BHTD.transpose(1, 2).contiguous(), None
    k_prefix_BKPD, v_prefix_BKPD = longstraw_pages.filled()
    timer = AttentionTimer.active
    _, H, T, D = query_BHTD.shape
    # keys before the chunk; a sharded capture's earlier shards count too (its shard starts at their end)
    prefix = k_prefix_BKPD.shape[2] + (longstraw_pages.bounds[longstraw_pages.cp.rank][0] if sharded else 0)
    with timer.call(attention_forward_flops(H, D, T, prefix)) if timer else nullcontext():
        if sharded:
            out_BHTD = capture_attention(query_BHTD, key_BKTD, value_BKTD, longstraw_pages, scale)
        else:
            out_BHTD = paged_attention(query_BHTD, k_prefix_BKPD, v_prefix_BKPD, key_BKTD, value_BKTD, scale=scale)
    if longstraw_append:  # pages copy detached values; the exact mode's recompute keeps the graph
        longstraw_pages.append(key_BKTD, value_BKTD)
    return out_BHTD.transpose(1, 2).contiguous(), None


AttentionInterface.register(IMPLEMENTATION, _longstraw_attention)


@contextmanager
def longstraw_attention_selected(configs):
    """Route the given configs' attention modules to the paged implementation, then restore."""
    saved = [(c, c._attn_implementation_internal) for c in configs]
    try:
        for c, _ in saved:
            c._attn_implementation_internal = IMPLEMENTATION
        yield
    finally:
        for c, value in saved:
            c._attn_implementation_internal = value


def attention_mix(attn_module, x_BTH, position_embeddings, pages: AttentionPages, append: bool):
    """One attention layer's token mixing over resident pages + live tokens; appends when capturing."""
    out_BTH, _ = attn_module(
        hidden_states=x_BTH,
        position_embeddings=position_embeddings,
        attention_mask=None,
        past_key_values=None,
        longstraw_pages=pages,
        longstraw_append=append,
    )
    return out_BTH
