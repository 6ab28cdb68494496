"""Gated DeltaNet layers of a sharded capture without a rank-to-rank chain (`longstraw.cp.capture`).

A GDN layer's state entering shard r depends on every earlier shard, but only through two small
things that the ranks can compute at the same time (`enter_gdn_layer`, before the layer's chunks):

(a) the conv state: the last K-1 pre-conv inputs (`mixed`, the fused q/k/v projection) before the
    shard. Rank r-1 projects its own last positions of the layer input (it has them before the layer
    runs) and sends them to rank r: one exchange per layer, every rank at once (`CPGroup.shift_`).
    When some shard is shorter than K-1 positions, the ranks all-gather their tails instead and rank
    r takes the last K-1 of the earlier ranks' tails.
(b) the shard's transition (`longstraw.kernels.gdn_scan`): the delta rule is affine in its state,
    so the shard maps the state S it starts from to A_r S + C_r. Each rank runs its shard's mixer
    inputs (input norm, projections, conv from the state of (a), gates) chunk by chunk, `chunk_size`
    positions at a time as the capture does, carrying (A_r, C_r) through the rule on a state of
    Dk + Dv columns; the last rank's transition is never needed and it skips this pass.
(c) one all-gather of every rank's [A_r | C_r]; rank r composes S_in(r) = A_{r-1}(... A_0 0 + C_0
    ...) + C_{r-1} (r small matmuls per head).

The entry (the layer's `RecurrentState`) is set to (conv state, S_in(r)), and the capture's ordinary
chunk loop (d) runs the layer from it: its outputs and end state are the single-process capture's,
up to rounding (the incoming state is composed rather than carried chunk by chunk; in float32 a
state differs by float32 rounding). The last rank ends at the prompt's final state, which the
capture broadcasts as before.

Cost, per GDN layer and rank (all but the last): one more pass over the shard's GDN mixer inputs,
i.e. the input norm and the in_proj GEMMs (the output gate's projection included, which pass (b)
does not read: `gdn_rule_inputs` is shared with the mixer) and the conv, plus the delta rule with
Dk + Dv columns instead of Dv (roughly twice the rule's value-width work when Dk = Dv; the output
norm, out_proj and the MLP are not repeated); the previous shard's tail projection (at most 64
positions, so that a LoRA-over-NF4 layer takes the GEMM path of the capture's chunks); an all-gather
of W x Hv x Dk x (Dk + Dv) float32 (per rank 6.3 MB at Hv = 48, Dk = Dv = 128); and one chunk's
activations at a time, as the layer's own pass. What it saves: no rank waits on the previous rank's
GDN. Before, rank r started a GDN layer only when rank r-1 had finished it, so after every point
where the ranks synchronise (an attention layer's collectives) the last rank started W-1 shard-times
late; now a GDN layer costs each rank its own shard's two passes and two small collectives,
whatever the world size.
"""

from __future__ import annotations

import torch

from longstraw.cp.group import CPGroup
from longstraw.families.hybrid import gdn_rule_inputs
from longstraw.kernels.gdn_scan import incoming_states, shard_transition
from longstraw.kernels.nf4_linear import DEQUANTIZE_MIN_ROWS
from longstraw.kernels.rms_norm import rms_norm
from longstraw.state import RecurrentState


def enter_gdn_layer(adapter, i: int, h_BTH, state: RecurrentState, cp: CPGroup, bounds, chunk: int) -> None:
    """Set `state` (layer i's entry, this rank's shard `h_BTH` its input) to the state the layer has
    at this shard's start in a single-process capture; every rank calls it for the layer together."""
    layer = adapter.layers[i]
    module, project = layer.linear_attn, adapter.project
    conv_in = previous_conv_inputs(layer, module, project, h_BTH, state.conv_BCK1, cp, bounds)
    Hv, Dk, Dv = state.recurrent_BHDV.shape[1:]
    if cp.is_last:  # nobody reads the last shard's transition
        dtype = torch.promote_types(h_BTH.dtype, torch.float32)  # the rule's compute dtype, as on the other ranks
        packed = torch.zeros(1, Hv, Dk, Dk + Dv, dtype=dtype, device=h_BTH.device)
    else:
        packed = torch.cat(shard_transition_of_layer(layer, module, project, h_BTH, conv_in, chunk), dim=-1)
    transitions = [part.split([Dk, Dv], dim=-1) for part in cp.all_gather(packed)[: cp.rank + 1]]
    state.conv_BCK1.copy_(conv_in)
    state.recurrent_BHDV.copy_(incoming_states(transitions)[cp.rank])


def previous_conv_inputs(layer, module, project, h_BTH, conv_BCK1, cp: CPGroup, bounds) -> torch.Tensor:
    """The last K-1 projected inputs (`mixed`) of the positions before this rank's shard (zeros
    before the prompt), shaped as `conv_BCK1`; from the earlier ranks' layer inputs, no recurrence."""
    K1 = conv_BCK1.shape[-1]
    if K1 == 0:
        return conv_BCK1.new_zeros(conv_BCK1.shape)
    rows = min(h_BTH.shape[1], max(K1, DEQUANTIZE_MIN_ROWS))
    mixed_BTC = project(module, rms_norm(layer.input_layernorm, h_BTH[:, -rows:]))[0]
    tail_BCT = mixed_BTC[:, -K1:].transpose(1, 2).to(conv_BCK1.dtype)
    if min(e - s for s, e in bounds) >= K1:  # the previous shard alone holds the K-1 positions
        received = conv_BCK1.new_zeros(conv_BCK1.shape)
        cp.shift_(tail_BCT, received)
        return received
    padded = conv_BCK1.new_zeros(conv_BCK1.shape)  # right-aligned: a shorter shard's tail is all of it
    padded[..., K1 - tail_BCT.shape[-1] :] = tail_BCT
    parts = cp.all_gather(padded)
    earlier = [part[..., K1 - min(K1, e - s) :] for part, (s, e) in zip(parts[: cp.rank], bounds)]
    return torch.cat([conv_BCK1.new_zeros(conv_BCK1.shape), *earlier], dim=-1)[..., -K1:].contiguous()


def shard_transition_of_layer(layer, module, project, h_BTH, conv_in, chunk: int):
    """(A, C) of this shard through the layer's delta rule, the conv continuing from `conv_in`;
    `chunk` positions at a time, as the capture runs the layer."""
    transition, conv = None, conv_in
    for c0 in range(0, h_BTH.shape[1], chunk):
        x_BTH = rms_norm(layer.input_layernorm, h_BTH[:, c0 : c0 + chunk])
        q, k, v, g, beta, _, conv = gdn_rule_inputs(module, project, x_BTH, conv)
        transition = shard_transition(q, k, v, g, beta, transition, l2norm_qk=False)  # normalised with the conv
    return transition
