"""A decoding step's draw, log-prob and bookkeeping in two Triton launches (CUDA).

    sample_step_triton(logits_GV, q_GV, temperature, stop_S, pad_id, step_1,
                       tokens_G, unfinished_G, finite_1, tokens_GT, logps_GT, forcing=None)

The torch tail (`training.rollout.Decoder._torch_tail`, the reference) runs two row softmaxes (the draw's over
logits / T and the log-prob's log_softmax, one block a row: 25 us together for 8 rows of SmolLM2's 49,152 on an
H100), an argmax (13.5 us), an all-finite reduction (6 us) and a dozen small launches (gather, where, index_copy, the
stop compare: ~15 us) of a 1.17 ms step. Here, from the float32 logits and the Exp(1) draws q (torch's
`exponential_` on the decoder's generator, as the torch tail takes them: the random stream, and so HF `generate`'s
tokens, stay):

1. `_chunk_kernel`, one program per (row, chunk of CHUNK logits): the chunk's max m_c and sum of exp(x - m_c), of the
   logits and of the scaled ones y = x * (1 / T) (torch's arithmetic for logits / T on CUDA: one product by the
   float32 reciprocal), finite_1 cleared where a logit is not finite, and the chunk's candidate: the argmax of
   exp(y - m_c) / q (sampling: the order of p / q, up to rounding) or of x (greedy), the first on ties.
2. `_row_kernel`, one program per row: the chunks merged (m = max m_c, s = sum s_c exp(m_c - m)), the candidate of
   largest p / q = (exp(y - m) / s) / q (torch.multinomial's arithmetic for one sample, as `Decoder.draw`) or of
   largest logit, the first chunk on ties; the forced token where `forcing` says; its log-prob under the unscaled
   logits, (x - m) - log(s) (log_softmax's arithmetic); then the step's bookkeeping: the token (pad_id on a finished
   row) and its log-prob into tokens_GT and logps_GT at the clock's step, the row finished on a stop id, tokens_G.
   The clock's advance stays the decoder's own launch after it (every program reads the step).

The argmax is over values that share the row's max and sum, so another summation order, Triton's exp (an ex2 of a
rounded product) and the chunk's own max choosing its candidate move them by a few float32 roundings: only a near-exact
tie can go the other way. A row with a NaN takes a valid token (the device's next embedding lookup stays in range);
its finite_1 refuses the rollouts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048  # logits a program of the first launch reads: 24 chunks a row at 49,152, 192 programs for 8 rows


@triton.jit
def _max_and_exp(x):
    """max(x) and exp(x - max(x)); 0 where every x is -inf (shifted by 0, not by -inf)."""
    m = tl.max(x, 0)
    return m, tl.exp(x - tl.where(m == float("-inf"), 0.0, m))


@triton.jit
def _merged(m_c, s_c):
    """The row's max and sum of exponentials from its chunks' maxes and sums (`_max_and_exp`'s)."""
    m = tl.max(m_c, 0)
    return m, tl.sum(s_c * tl.exp(m_c - tl.where(m == float("-inf"), 0.0, m)), 0)


@triton.jit
def _first_argmax(score, inside):
    """The first index of the largest score among `inside`, NaN counted lowest: always an index inside (a row with a
    NaN is refused by finite_1, but its token still indexes the next step's embedding)."""
    return tl.argmax(tl.where(inside & (score == score), score, float("-inf")), 0)


@triton.jit
def _chunk_kernel(
    logits_ptr, q_ptr, stats_ptr, candidate_ptr, finite_ptr, inv_t, V, S,
    SAMPLED: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = cols < V
    x = tl.load(logits_ptr + row * V + cols, mask=inside, other=float("-inf"))
    finite = (tl.abs(x) < float("inf")) | ~inside  # NaN compares false
    if tl.min(finite.to(tl.int32), 0) == 0:  # every program that sees one writes the same value
        tl.store(finite_ptr, 0)
    stats = stats_ptr + (row * S + chunk) * 4
    m, e = _max_and_exp(x)
    tl.store(stats, m)
    tl.store(stats + 1, tl.sum(e, 0))
    if SAMPLED:
        m_y, e_y = _max_and_exp(x * inv_t)
        tl.store(stats + 2, m_y)
        tl.store(stats + 3, tl.sum(e_y, 0))
        score = e_y / tl.load(q_ptr + row * V + cols, mask=inside, other=1.0)
    else:
        score = x
    tl.store(candidate_ptr + row * S + chunk, chunk * CHUNK + _first_argmax(score, inside))


@triton.jit
def _row_kernel(
    logits_ptr, q_ptr, stats_ptr, candidate_ptr, forcing_ptr, forced_ptr, stop_ptr, step_ptr,
    tokens_ptr, unfinished_ptr, tokens_out_ptr, logps_out_ptr, inv_t, V, S, T, n_stop, pad_id,
    SAMPLED: tl.constexpr, FORCED: tl.constexpr, S_BLOCK: tl.constexpr, STOP_BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, S_BLOCK)
    inside = c < S
    stats = stats_ptr + (row * S + c) * 4
    candidate = tl.load(candidate_ptr + row * S + c, mask=inside, other=0)
    x_c = tl.load(logits_ptr + row * V + candidate, mask=inside, other=float("-inf"))
    if SAMPLED:
        m_y, s_y = _merged(
            tl.load(stats + 2, mask=inside, other=float("-inf")), tl.load(stats + 3, mask=inside, other=0.0)
        )
        q_c = tl.load(q_ptr + row * V + candidate, mask=inside, other=1.0)
        score = tl.exp(x_c * inv_t - m_y) / s_y / q_c
    else:
        score = x_c
    token = tl.load(candidate_ptr + row * S + _first_argmax(score, inside))
    if FORCED:
        token = tl.where(tl.load(forcing_ptr + row) != 0, tl.load(forced_ptr + row), token)
    m, s = _merged(tl.load(stats, mask=inside, other=float("-inf")), tl.load(stats + 1, mask=inside, other=0.0))
    logp = (tl.load(logits_ptr + row * V + token) - m) - tl.log(s)
    going = tl.load(unfinished_ptr + row) != 0
    token = tl.where(going, token, pad_id)
    step = tl.load(step_ptr)
    tl.store(tokens_out_ptr + row * T + step, token)
    tl.store(logps_out_ptr + row * T + step, logp)
    k = tl.arange(0, STOP_BLOCK)
    stops = tl.load(stop_ptr + k, mask=k < n_stop, other=0)
    stopped = tl.max(((stops == token) & (k < n_stop)).to(tl.int32), 0) > 0
    tl.store(unfinished_ptr + row, going & ~stopped)
    tl.store(tokens_ptr + row, token)


def reciprocal_float32(temperature: float) -> float:
    """1 / T as torch's CUDA division of a tensor by a number computes it: T rounded to float32, then its float32
    reciprocal (the logits times it: `BinaryDivTrueKernel.cu`)."""
    one, t = torch.tensor([1.0, temperature], dtype=torch.float32)
    return float(one / t)


def sample_step_triton(
    logits_GV: torch.Tensor,
    q_GV: torch.Tensor | None,
    temperature: float,
    stop_S: torch.Tensor,
    pad_id: int,
    step_1: torch.Tensor,
    tokens_G: torch.Tensor,
    unfinished_G: torch.Tensor,
    finite_1: torch.Tensor,
    tokens_GT: torch.Tensor,
    logps_GT: torch.Tensor,
    forcing: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One step's token of each row written where `Decoder.step` writes it: drawn from float32 logits [G, V] at
    `temperature` with the Exp(1) draws `q_GV`, or greedy where `q_GV` is None; (forcing_G, forced_G): the rows that
    take a forced token. No host sync: the step is read on the device."""
    logits_GV = logits_GV.contiguous()
    G, V = logits_GV.shape
    inv_t = reciprocal_float32(temperature) if q_GV is not None else 1.0
    S = triton.cdiv(V, CHUNK)
    stats = torch.empty(G, S, 4, dtype=torch.float32, device=logits_GV.device)
    candidate = torch.empty(G, S, dtype=torch.long, device=logits_GV.device)
    sampled, q = q_GV is not None, logits_GV if q_GV is None else q_GV  # q unread when greedy
    forcing_G, forced_G = forcing if forcing is not None else (unfinished_G, tokens_G)  # unread when not forced
    _chunk_kernel[(G, S)](
        logits_GV, q, stats, candidate, finite_1, inv_t, V, S, SAMPLED=sampled, CHUNK=CHUNK, num_warps=4
    )
    _row_kernel[(G,)](
        logits_GV, q, stats, candidate, forcing_G, forced_G, stop_S, step_1, tokens_G, unfinished_G, tokens_GT,
        logps_GT, inv_t, V, S, tokens_GT.shape[1], stop_S.numel(), pad_id,
        SAMPLED=sampled, FORCED=forcing is not None, S_BLOCK=triton.next_power_of_2(S),
        STOP_BLOCK=triton.next_power_of_2(max(stop_S.numel(), 1)), num_warps=1,
    )  # fmt: skip
