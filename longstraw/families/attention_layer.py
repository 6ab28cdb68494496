"""Full-attention layers through HF's own attention modules, with our paged attention inside.

HF attention modules do the per-token work (projections, q/k norms, rotary, output gate,
o_proj) and then call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`. We register one
more implementation, "longstraw", that hands the live queries and K/V to the layer's resident
entry (`entry.attend`: pages, decoding pages, a context-parallel shard), which attends over what
it holds plus the live keys and, during capture, appends the live K/V in place. The entry reaches
it as a keyword argument that HF forwards untouched; no HF cache is used. A sliding-window layer's
entry applies the window itself (its `window` must be the layer's). A layer with attention sinks
(gpt-oss) hands them to every attention implementation as `s_aux`; they go on to the entry's attention.
"""

from __future__ import annotations

from contextlib import contextmanager

from transformers import AttentionInterface

from longstraw.families.attention_decode import decode_attention_mix

IMPLEMENTATION = "longstraw"


def _longstraw_attention(
    module,
    query_BHTD,
    key_BKTD,
    value_BKTD,
    attention_mask,
    scaling=None,
    dropout=0.0,
    longstraw_pages=None,
    longstraw_append: bool = False,
    s_aux=None,
    **kwargs,
):
    if longstraw_pages is None:
        raise RuntimeError("longstraw attention called without resident pages (use longstraw.capture/replay)")
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if window and getattr(longstraw_pages, "window", None) != window:  # the entry applies the window, or none does
        raise ValueError(
            f"a sliding-window attention layer (window {window}) on {type(longstraw_pages).__name__} entries, "
            "which attend over every position; its family must give it a window entry (state.pages.WindowKV)"
        )
    scale = scaling if scaling is not None else query_BHTD.shape[-1] ** -0.5
    out_BHTD = longstraw_pages.attend(query_BHTD, key_BKTD, value_BKTD, scale, longstraw_append, sinks=s_aux)
    return out_BHTD.transpose(1, 2).contiguous(), None


AttentionInterface.register(IMPLEMENTATION, _longstraw_attention)


@contextmanager
def longstraw_attention_selected(configs, implementation: str = IMPLEMENTATION):
    """Route the given configs' attention modules to the paged implementation (or another registered
    `implementation`), then restore."""
    saved = [(c, c._attn_implementation_internal) for c in configs]
    try:
        for c, _ in saved:
            c._attn_implementation_internal = implementation
        yield
    finally:
        for c, value in saved:
            c._attn_implementation_internal = value


def attention_mix(attn_module, x_BTH, position_embeddings, pages, append: bool):
    """One attention layer's token mixing over its resident entry + live tokens; appends when capturing. A decoding
    step takes `decode_attention_mix` where it applies (stacked projections, one launch for rotary and the append)."""
    if append:
        out_BTH = decode_attention_mix(attn_module, x_BTH, position_embeddings, pages)
        if out_BTH is not None:
            return out_BTH
    out_BTH, _ = attn_module(
        hidden_states=x_BTH,
        position_embeddings=position_embeddings,
        attention_mask=None,
        past_key_values=None,
        longstraw_pages=pages,
        longstraw_append=append,
    )
    return out_BTH
