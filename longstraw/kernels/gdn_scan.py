"""The gated delta rule as an affine map of its state: a shard of tokens in one transition (A, C).

Per value head, with the conventions of `longstraw.kernels.gdn` (k l2-normalised, state ``S`` of
shape ``[Dk, Dv]``, value head ``h`` reading q/k head ``h // (Hv // Hk)``), one token updates ::

    S <- exp(g_t) (I - beta_t k_t k_t^T) S + beta_t k_t v_t^T  =  M_t S + beta_t k_t v_t^T

which is affine in ``S``. A run of tokens 1..T therefore maps the state it starts from to ::

    S_end = A S0 + C,   A = M_T ... M_1  ([Dk, Dk]),   C = S_end from S0 = 0  ([Dk, Dv])

(q does not enter the state). A sequence split into shards 0..W-1 with transitions (A_r, C_r)
enters shard r with ``S_in(0) = S0`` (zeros at the sequence's start) and
``S_in(r+1) = A_r S_in(r) + C_r`` (`incoming_states`): W small matmuls instead of a pass over the
earlier shards' tokens, so the shards' transitions can be computed at the same time.

How `shard_transition` gets (A, C), with the existing chunked kernel: the rule acts on each column
of ``S`` separately (column j of ``S`` only meets column j of ``v``: ``S^T k`` and the delta write
are per column), and it is linear in (S, v) jointly. So one call on a state of ``Dk + Dv``
columns, starting from ``[A0 | C0]`` with values ``[0 | v]`` (Dk zero columns before v), ends at ::

    [A A0 | A C0 + C]

the transition of the earlier tokens (A0, C0) followed by these. From ``[I | 0]`` that is
``[A | C]``: the first Dk columns are the rule run on the identity state with zero values (exactly
the linear part ``A I``: zero values write nothing), the last Dv the rule from zero (exactly ``C``).
A chunked caller carries the transition from call to call, as a capture carries the state.

Cost: one call of the rule with ``Dk + Dv`` state / value columns instead of ``Dv`` (the intra-chunk
``K K^T`` products and the triangular solve's matrix are shared; the work proportional to the value
width grows by ``(Dk + Dv) / Dv``). Everything runs in the kernel's compute dtype: float32, or
float64 when an input (or the carried transition) is float64; on CUDA the no-grad path uses fla
when importable (`chunk_gated_delta_rule_forward`), with fla's precision.

The reference is the token-by-token `recurrent_gated_delta_rule` run over the whole sequence
(`tests/test_gdn_scan.py`).
"""

from __future__ import annotations

import torch

from longstraw.kernels.gdn import _check_shapes, _compute_dtype, chunk_gated_delta_rule_forward

__all__ = ["apply_transition", "identity_transition", "incoming_states", "shard_transition"]


def identity_transition(batch: int, heads: int, dk: int, dv: int, dtype=torch.float32, device=None):
    """The transition of no tokens: (I [B, Hv, Dk, Dk], 0 [B, Hv, Dk, Dv])."""
    eye = torch.eye(dk, dtype=dtype, device=device).expand(batch, heads, dk, dk).clone()
    return eye, torch.zeros(batch, heads, dk, dv, dtype=dtype, device=device)


@torch.no_grad()
def shard_transition(
    q_BTHD,
    k_BTHD,
    v_BTHV,
    g_BTH,
    beta_BTH,
    transition=None,
    *,
    chunk_size: int = 64,
    l2norm_qk: bool = True,
    use_fla: bool | None = None,
):
    """(A [B, Hv, Dk, Dk], C [B, Hv, Dk, Dv]) of these tokens (the arguments of
    `chunk_gated_delta_rule`), after `transition` (the (A0, C0) of the tokens before them) when given:
    then (A A0, A C0 + C). float32, or float64 when an input or `transition` is float64. No grad."""
    _check_shapes(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, None)
    B, T, Hv, Dv = v_BTHV.shape
    Dk = k_BTHD.shape[-1]
    dtype = _compute_dtype(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, *(transition or ()))
    if transition is None:
        transition = identity_transition(B, Hv, Dk, Dv, dtype, v_BTHV.device)
    a0, c0 = transition
    if tuple(a0.shape) != (B, Hv, Dk, Dk) or tuple(c0.shape) != (B, Hv, Dk, Dv):
        raise ValueError(
            f"transition must be ({(B, Hv, Dk, Dk)}, {(B, Hv, Dk, Dv)}), got ({tuple(a0.shape)}, {tuple(c0.shape)})"
        )
    start = torch.cat([a0, c0], dim=-1).to(dtype)  # [A0 | C0]
    values = torch.cat([v_BTHV.new_zeros(B, T, Hv, Dk), v_BTHV], dim=-1)  # [0 | v]
    _, end = chunk_gated_delta_rule_forward(
        q_BTHD, k_BTHD, values, g_BTH, beta_BTH, start, chunk_size=chunk_size, l2norm_qk=l2norm_qk, use_fla=use_fla
    )
    a, c = end.to(dtype).split([Dk, Dv], dim=-1)
    return a.contiguous(), c.contiguous()


def apply_transition(transition, state_BHDV):
    """A S + C: the state after the transition's tokens, from `state_BHDV` before them."""
    a, c = transition
    return a @ state_BHDV.to(a.dtype) + c


def incoming_states(transitions, initial_state_BHDV=None) -> list[torch.Tensor]:
    """The state entering each shard, given every shard's transition (A_r, C_r) in order:
    S_in(0) = `initial_state_BHDV` (zeros when None), S_in(r+1) = A_r S_in(r) + C_r. In the
    transitions' dtype (float32; float64 when they are float64). The last shard's transition is
    not read (its end state is `apply_transition(transitions[-1], states[-1])`)."""
    if not transitions:
        return []
    c = transitions[0][1]
    state = c.new_zeros(c.shape) if initial_state_BHDV is None else initial_state_BHDV.to(c.dtype).clone()
    states = [state]
    for transition in transitions[:-1]:
        states.append(apply_transition(transition, states[-1]))
    return states
