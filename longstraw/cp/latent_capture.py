"""One MLA layer of a sharded capture (`longstraw.cp.capture`): latent, rope-key and index-key pages
owned by shard, the layer's work spread over the ranks by the zigzag.

1. Each rank writes its own shard's page entries (`mla_page_entries`: the latent after its norm, the
   rotated rope key, the index key on index layers; no queries), `chunk_size` positions at a time.
2. One all-gather per page tensor: every rank holds the layer's whole pages (a transient, as the
   attention family's capture gathers a layer's K/V).
3. The layer itself runs on the zigzag schedule (`balanced_attention.zigzag_map`): rank r runs the
   whole layer (projections, DSA selection, latent attention, MoE) for the prompt's half-shards r and
   2N-1-r, the hidden states of each travelling from its owner and the layer's outputs back. A chunk
   runs exactly as a single-process capture runs one: `adapter.layer_forward` over plain `LatentPages`
   holding the gathered pages before it, `chunk_size` positions at a time, so the indexer's causal
   scoring, the attention and the FFN are spread as evenly as the attention family's attention, and
   IndexShare layers find the selection their index layer left for each chunk (the same chunks, in the
   same order, on the same rank).

The gathered pages take the computing rank's own writes of a chunk's entries (the same values, up to
the rounding of another chunking); the resident pages are the owners' from step 1.
"""

from __future__ import annotations

import torch

from longstraw.cp.balanced_attention import gather_shards, zigzag_map
from longstraw.cp.group import CPGroup
from longstraw.families.mla import mla_page_entries
from longstraw.kernels.rms_norm import rms_norm
from longstraw.state import LatentPages


def capture_latent_layer(adapter, i: int, h_1SH, pages, cp: CPGroup, bounds, chunk: int) -> torch.Tensor:
    """Layer i over this rank's shard `h_1SH` (its start `bounds[cp.rank][0]`): writes the shard's pages
    `pages` (a `ShardLatentPages`) and returns the layer's outputs for the shard."""
    layer, attn, start = adapter.layers[i], adapter.attns[i], bounds[cp.rank][0]
    for c0 in range(0, h_1SH.shape[1], chunk):
        h_c = h_1SH[:, c0 : c0 + chunk]
        pages.append(
            *mla_page_entries(attn, rms_norm(layer.input_layernorm, h_c), adapter.position_embeddings(h_c, start + c0))
        )
    kv_11NE, index_1NI = pages.filled()
    gathered = gather_shards(cp, bounds, kv_11NE, *([] if index_1NI is None else [index_1NI[:, None]]))
    whole = LatentPages(gathered[0], gathered[1][:, 0] if index_1NI is not None else None, pages.kv_lora_rank)

    def run_chunk(h_1TH, span):
        out_1TH = torch.empty_like(h_1TH)
        for a in range(span[0], span[1], chunk):
            b = min(a + chunk, span[1])
            whole.length = a  # the pages before the chunk; the layer writes the chunk's own
            h_c = h_1TH[:, a - span[0] : b - span[0]]
            out_1TH[:, a - span[0] : b - span[0]] = adapter.layer_forward(
                i, h_c, adapter.position_embeddings(h_c, a), whole, capturing=True
            )
        return out_1TH

    return zigzag_map(h_1SH, 1, run_chunk, cp, bounds, h_1SH.shape[-1])
