"""A capture's Gated DeltaNet forward with the state scan split across the sequence (fla's intra-card context
parallelism), for one long sequence without autograd.

fla's chunk forward scans the state chunk after chunk in one program per (value head, 64-wide value block): for
hybrid-1b's 32 value heads that is 64 programs on the H200's 132 SMs, each walking all 512 chunks of 32,768 tokens
(0.65 ms a layer, the largest of fla's four forward kernels in a capture's profile). fla 0.6 also ships the split
form it runs for long prefills under `torch.inference_mode` with `FLA_INTRACARD_CP=1`: cut the sequence into a few
chunk-aligned pieces, summarise each piece as an affine map of its start state (a pre-scan, the pieces in
parallel), chain the maps to get every piece's start state, then scan the pieces in parallel. The arithmetic is the
same recurrence, associated differently, in float32.

`split_scan_forward` calls those pieces directly (the inference-mode switch would make the captured state an
inference tensor that replay's autograd cannot save). It is fla's `chunk_gated_delta_rule_fwd` with the scan
replaced, for q and k already normalised; `gdn.chunk_gated_delta_rule` is the plain reference, and fla decides
itself when a sequence is too short to split (fewer than three pieces of 128 chunks), where it runs the plain scan.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

CHUNK = 64  # fla's GDN chunk


@functools.cache
def split_scan_parts() -> SimpleNamespace | None:
    """fla's forward pieces the split scan composes, or None where this fla lacks one (the caller keeps fla's
    whole-sequence forward)."""
    try:
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.common.intracard_cp import intracard_fwd_h
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
        from fla.ops.utils.index import prepare_chunk_indices
    except Exception:  # ImportError, or triton / driver trouble at import time
        return None
    return SimpleNamespace(
        cumsum=chunk_local_cumsum,
        intra=chunk_gated_delta_rule_fwd_intra,
        scan=intracard_fwd_h,
        output=chunk_fwd_o,
        chunk_indices=prepare_chunk_indices,
        log2_e=RCP_LN2,
    )


@functools.lru_cache(maxsize=16)
def _bounds(length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The one sequence's boundaries on the device and the host, the same objects for every layer of a length:
    fla caches its chunk indices and its split plan by the boundary tensor's identity, so a capture's later layers
    neither rebuild them nor copy them from the host (a copy would wait for the queued work)."""
    host = torch.tensor([0, length], dtype=torch.long)
    return host.to(device), host


@torch.no_grad()
def split_scan_forward(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, initial_state_BHDV, scale: float):
    """(output [1, T, Hv, Dv] in v's dtype, final state [1, Hv, Dk, Dv] float32) of one sequence (B = 1) whose q
    and k are already l2-normalised, g the float32 log decay, beta in (0, 1): fla's chunk forward with its state
    scan split across the sequence."""
    parts = split_scan_parts()
    bounds, bounds_host = _bounds(q_BTHD.shape[1], q_BTHD.device)
    q, k, v, beta = (t.contiguous() for t in (q_BTHD, k_BTHD, v_BTHV, beta_BTH))
    indices = parts.chunk_indices(bounds, CHUNK, cu_seqlens_cpu=bounds_host)
    g = parts.cumsum(
        g_BTH.float().contiguous(), chunk_size=CHUNK, scale=parts.log2_e, cu_seqlens=bounds, chunk_indices=indices
    )
    w, u, _ = parts.intra(k=k, v=v, g=g, beta=beta, cu_seqlens=bounds, chunk_indices=indices, chunk_size=CHUNK)
    h, v_new, final_state = parts.scan(
        k=k,
        w=w,
        u=u,
        g=g,
        initial_state=initial_state_BHDV,
        output_final_state=True,
        chunk_size=CHUNK,
        cu_seqlens=bounds,
        cu_seqlens_cpu=bounds_host,
        chunk_indices=indices,
    )
    out = parts.output(
        q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=bounds, chunk_indices=indices, chunk_size=CHUNK
    )
    return out, final_state
