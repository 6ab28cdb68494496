"""The package's Triton kernels, run by Triton's interpreter on this CPU, against plain references in float64.

The kernels serve CUDA only (`kernels/*_triton.py`); their CUDA tests (`-m cuda`) need a GPU. Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported, so in a process of its own) runs the same kernel source on numpy
arrays, in float32 where the GPU computes in float32: their arithmetic is checked on every CI machine, at small
shapes that reach every branch (a state and none, a ragged last block, the q, k and v heads, a vocabulary past one
block). The interpreter runs no autotuner, so each autotuned kernel gets its first configuration. Speed is not
interpreted: `benchmarks/gdn_conv_split.py`, `gdn_capture_scan.py` and `swiglu_rate.py` measure it on the GPU.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from test_rotary import rotate_half_formula
from tolerances import EPS32, SAFETY, chunked_logprob_bound, close, float32_tolerance

from longstraw.kernels.causal_conv import conv_split_heads

pytestmark = pytest.mark.numerics

KEY_DIM, HEAD_DIM, CHANNELS, TAPS = 128, 64, 512, 4  # q and k 2 heads each, v 4 heads
VOCAB, HIDDEN = 300, 32
INDEX_HEADS, INDEX_DIM = 3, 32
SCAN_CHUNK = 64
SAMPLER_PAD = 1  # a token id: a finished row's writes


def _gdn_rule_inputs(with_state: bool):
    """q and k [2, 150, 2, 32] with unit rows (as the conv's norm leaves them), v [2, 150, 4, 64], log decays in
    (-0.2, 0), beta in (0, 1) and a state or none, in float64: 150 tokens, two whole chunks and a ragged one, two
    value heads a q/k head, two 32-wide value blocks."""
    gen = torch.Generator().manual_seed(1)
    q, k = (
        torch.nn.functional.normalize(torch.randn(2, 150, 2, 32, generator=gen, dtype=torch.float64), dim=-1)
        for _ in range(2)
    )
    v = torch.randn(2, 150, 4, 64, generator=gen, dtype=torch.float64)
    g = -0.2 * torch.rand(2, 150, 4, generator=gen, dtype=torch.float64)
    beta = torch.rand(2, 150, 4, generator=gen, dtype=torch.float64)
    state = 0.5 * torch.randn(2, 4, 32, 64, generator=gen, dtype=torch.float64) if with_state else None
    return q, k, v, g, beta, state


GDN_RULE_INPUTS = {"gdn scan from a state": _gdn_rule_inputs(True), "gdn scan from zeros": _gdn_rule_inputs(False)}


def _scan_inputs(q, k, v, g, beta, state):
    """((q, k, w, u, the within-chunk log2 decay, the state) in float32, as fla's intra-chunk kernels hand them to the
    scan), computed in float64 from the UT transform: per chunk, with G the cumulative log decay and the value head's
    keys, (I + tril(beta K K^T exp(G_i - G_j), -1)) [U | W] = [beta V | beta exp(G) K]."""
    group = v.shape[2] // k.shape[2]
    keys = k.repeat_interleave(group, dim=2)
    w, u, decay = torch.empty_like(keys), torch.empty_like(v), torch.empty_like(g)
    for start in range(0, v.shape[1], SCAN_CHUNK):
        rows = slice(start, start + SCAN_CHUNK)
        G = g[:, rows].cumsum(1).transpose(1, 2)  # [N, HV, C]
        K_ = keys[:, rows].transpose(1, 2)  # [N, HV, C, K]
        b = beta[:, rows].transpose(1, 2)
        strict = torch.tril((K_ @ K_.transpose(-1, -2)) * (G[..., :, None] - G[..., None, :]).exp(), -1)
        A = torch.eye(G.shape[-1], dtype=torch.float64) + b[..., None] * strict
        solved = torch.linalg.solve(
            A, torch.cat([b[..., None] * v[:, rows].transpose(1, 2), (b * G.exp())[..., None] * K_], -1)
        )
        u[:, rows], w[:, rows] = (t.transpose(1, 2) for t in solved.split([v.shape[-1], K_.shape[-1]], -1))
        decay[:, rows] = G.transpose(1, 2) / math.log(2)
    return tuple(None if t is None else t.float() for t in (q, k, w, u, decay, state))


# runs in the interpreter's process: every kernel on the saved inputs, outputs saved for the test to compare
KERNELS = """
import sys
import torch
from longstraw.kernels import attention_dq_triton, dsa_topk_triton, gdn_conv_triton, gdn_scan_triton, logprobs_triton
from longstraw.kernels import decode_attention_triton, gdn_decode_triton, lora_merge_triton, rms_norm_triton
from longstraw.kernels import rope_append_triton, rotary_triton, sampling_triton, swiglu_triton

conv = gdn_conv_triton
for autotuned in (
    conv._conv_split_normalized_kernel,
    conv._pre_activation_gradient_kernel,
    conv._conv_input_gradient_kernel,
    gdn_scan_triton._scan_output_kernel,
    attention_dq_triton._tuned_dq_kernel,
):
    autotuned.configs = autotuned.configs[:1]
inputs, out = torch.load(sys.argv[1]), {}
for name, (x, state, weight, bias, grads) in inputs["conv"].items():
    leaf = x.clone().requires_grad_(True)
    q, k, v = gdn_conv_triton.ConvSplitNormalized.apply(leaf, state, weight, bias, %(key_dim)d, %(head_dim)d, True)
    torch.autograd.backward((q, k, v), grads)
    out[name] = (q, k, v, leaf.grad)
hidden, weight, targets, grad = inputs["logprobs"]
leaf = hidden.clone().requires_grad_(True)
logp = logprobs_triton.FusedTokenLogprobs.apply(leaf, weight, targets)
logp.backward(grad)
out["logprobs"] = (logp, leaf.grad)
out["index_scores"] = dsa_topk_triton.fused_index_scores(*inputs["index_scores"])
gate, up, grad = (t.clone().requires_grad_(i < 2) for i, t in enumerate(inputs["swiglu"]))
product = swiglu_triton.SwiGLU.apply(gate, up)
product.backward(grad)
out["swiglu"] = (product, gate.grad, up.grad)
out["swiglu stacked"] = swiglu_triton.swiglu_stacked_triton(torch.cat(inputs["swiglu"][:2], -1))
q, k, v, cos, sin, k_own, v_own, step = inputs["rope append"]
k_own, v_own = k_own.clone(), v_own.clone()
out["rope append"] = (rope_append_triton.rope_append_triton(q, k, v, cos, sin, k_own, v_own, step), k_own, v_own)
k_own, v_own = inputs["rope append"][5].clone(), inputs["rope append"][6].clone()
rms_of = inputs["folded norm rows"]
scaled_q = rope_append_triton.rope_append_triton(q, k, v, cos, sin, k_own, v_own, step, rms_of=rms_of)
out["rope append scaled"] = (scaled_q, k_own, v_own)
x = inputs["folded norm rows"][0]
out["swiglu stacked scaled"] = swiglu_triton.swiglu_stacked_scaled_triton(
    torch.cat(inputs["swiglu"][:2], -1), x[:, 0], inputs["folded norm rows"][1]
)
for name, (x, cos, sin, grad) in inputs["rotary"].items():
    leaf = x.clone().requires_grad_(True)  # [B, T, H, D], rotated as HF's [B, H, T, D] view of it
    rotated = rotary_triton.Rotary.apply(leaf.transpose(1, 2), cos, sin)
    rotated.backward(grad)
    out[name] = (rotated, leaf.grad)
for name, (q, k, w, u, g_log2, state) in inputs["gdn scan"].items():
    out[name] = gdn_scan_triton.chunk_scan_output_triton(q, k, w, u, g_log2, state, q.shape[-1] ** -0.5)
for name, (weight, lora_A, lora_B, scaling) in inputs["lora merge"].items():
    out[name] = lora_merge_triton.merge_lora_triton(weight, lora_A, lora_B, scaling)
for name, ((do, q, k_pages, v_pages, keys, attended, lse, dq), _) in inputs["attention dq"].items():
    attention_dq_triton.attention_dq_triton(do, q, k_pages[:, :, :keys], v_pages[:, :, :keys], attended, lse, 0.25, dq)
    out[name] = dq
for name, (q, k_shared, v_shared, k_own, v_own, step, sinks) in inputs["decode attention"].items():
    out[name] = decode_attention_triton.decode_attention_triton(q, k_shared, v_shared, k_own, v_own, step, 0.25, sinks)
x, residual, weight = inputs["rows norm"]
out["rows norm"] = rms_norm_triton.rms_norm_rows(x, weight, 1e-5)
out["rows norm after the sum"] = rms_norm_triton.rms_norm_rows(x, weight, 1e-5, residual=residual)
q, k, v, g, beta, state = inputs["gdn decode"]
state = state.clone()
out["gdn decode"] = gdn_decode_triton.gdn_decode_step(q, k, v, g, beta, state)
for name, (logits, q, temperature, stop, step, forcing, buffers) in inputs["sampler"].items():
    buffers = [t.clone() for t in buffers]  # tokens_G, unfinished_G, finite_1, tokens_GT, logps_GT
    sampling_triton.sample_step_triton(logits, q, temperature, stop, %(pad)d, step, *buffers, forcing=forcing)
    out[name] = buffers
torch.save(out, sys.argv[2])
""" % {"key_dim": KEY_DIM, "head_dim": HEAD_DIM, "pad": SAMPLER_PAD}  # noqa: UP031 (the code has braces of its own)


def _conv_inputs(gen, rows: int, with_state: bool):
    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).float()

    grads = tuple(randn(2, rows, width // HEAD_DIM, HEAD_DIM) for width in (KEY_DIM, KEY_DIM, CHANNELS - 2 * KEY_DIM))
    state = randn(2, CHANNELS, TAPS - 1) if with_state else None
    return randn(2, rows, CHANNELS), state, randn(CHANNELS, TAPS), randn(CHANNELS), grads


ATTENTION_SCALE = 0.25
ATTENTION_KEYS = 150


def _attention_dq_inputs(gen, pages: int):
    """(dO, q, K pages, V pages, the prefix's keys, the global output and lse, a dq to add into) in float32 for the
    kernel, and the live K and V that only the global output and lse saw: q and dO [2, 2, 70, 32] (a block of 64 rows
    and a ragged one), 150 prefix keys read as a view of 170-key pages (two blocks of 64 and a ragged one), the pages
    each sequence's own (`pages` 2) or one prompt's for both (1), 9 live keys. The output and lse are float64 ones
    rounded, as the forward hands them over in float32 and 16 bits."""

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).float().double()

    q, do, live_k, live_v = randn(2, 2, 70, 32), randn(2, 2, 70, 32), randn(2, 2, 9, 32), randn(2, 2, 9, 32)
    k_pages, v_pages = randn(pages, 2, 170, 32), randn(pages, 2, 170, 32)
    keys = ATTENTION_KEYS
    k, v = (x[:, :, :keys].expand(2, -1, -1, -1) for x in (k_pages, v_pages))
    scores = torch.cat([q @ k.mT, q @ live_k.mT], -1) * ATTENTION_SCALE
    attended = torch.softmax(scores, -1) @ torch.cat([v, live_v], 2)
    kernel = (do, q, k_pages, v_pages, keys, attended, torch.logsumexp(scores, -1), 0.5 * randn(2, 2, 70, 32))
    return tuple(t.float() if torch.is_tensor(t) else t for t in kernel), (live_k, live_v)


SAMPLER_STOP = 1234  # a stop id, where row 5 has its spike


def _sampler_inputs(gen) -> dict:
    """Per case, `sample_step_triton`'s arguments: float32 logits [6, V] (3 randn: V two of the kernel's chunks and a
    ragged one), the Exp(1) draws or None (greedy), the temperature, stop ids, the clock's step and the forced rows,
    and the buffers a step writes (tokens_G, unfinished_G, finite_1, tokens_GT [6, 5] of -1, logps_GT of 0). Row 1
    is -inf on its whole first chunk and every 7th logit, row 2 finished, row 3 forced (with row 2) in the forced
    case, row 4 has a NaN, row 5 a spike at a stop id (drawn at every temperature: the row finishes)."""
    from longstraw.kernels.sampling_triton import CHUNK

    G, V, T = 6, 2 * CHUNK + 300, 5
    logits = 3 * torch.randn(G, V, generator=gen)
    logits[1, :CHUNK], logits[1, ::7] = float("-inf"), float("-inf")
    logits[4, 100] = float("nan")
    logits[5, SAMPLER_STOP] = 40.0
    q = torch.empty(G, V).exponential_(1, generator=gen)
    going = torch.tensor([True, True, False, True, True, True])
    forcing = (torch.tensor([False, False, True, True, False, False]), torch.tensor([0, 0, 11, V - 1, 0, 0]))
    stops, step = torch.tensor([SAMPLER_STOP, 77]), torch.tensor([2])

    def case(rows, q, temperature, stops, forcing=None):
        buffers = (torch.zeros(len(rows), dtype=torch.long), going[rows].clone(), torch.ones(1, dtype=torch.bool))
        writes = (torch.full((len(rows), T), -1, dtype=torch.long), torch.zeros(len(rows), T))
        return logits[rows], None if q is None else q[rows], temperature, stops, step, forcing, buffers + writes

    every, finite = list(range(G)), [0, 2, 3, 5]
    return {
        "sampler greedy": case(every, None, 0.0, stops),
        "sampler at 1": case(every, q, 1.0, stops),
        "sampler at 0.7, forced": case(every, q, 0.7, stops, forcing),
        "sampler, finite rows, no stop ids": case(finite, q, 0.7, torch.zeros(0, dtype=torch.long)),
    }


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """(inputs, outputs) of every kernel, run in a process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(0)
    inputs = {
        # 70 rows: whole blocks (of 16 rows, each kernel's first configuration) and a ragged one; the state read by
        # the first block, or zeros
        "conv": {"state": _conv_inputs(gen, 70, True), "no state": _conv_inputs(gen, 5, False)},
        "logprobs": (
            torch.randn(7, HIDDEN, generator=gen),
            torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5,
            torch.randint(0, VOCAB, (7,), generator=gen),
            torch.randn(7, generator=gen),
        ),
        # float32 queries and keys of bf16 values: the interpreter's dot reads bf16 operands as their raw bits
        "index_scores": (
            torch.randn(5, INDEX_HEADS, INDEX_DIM, generator=gen).bfloat16().float(),
            torch.rand(5, INDEX_HEADS, generator=gen),
            torch.randn(130, INDEX_DIM, generator=gen).bfloat16().float(),
        ),
        # gate, up and the product's gradient: two blocks of SWIGLU_BLOCK elements, the second ragged
        "swiglu": tuple(3 * torch.randn(3, 1500, generator=gen) for _ in range(3)),
        # x [B, T, H, D], cos and sin of a third of D (the batch's own, or one for all), the output's gradient: 37
        # positions, a block of 32 and a ragged one; D = 24 masks the columns of a 32-wide block
        "rotary": {
            name: (
                torch.randn(2, 37, 3, 24, generator=gen),
                *(f(angles) for f in (torch.cos, torch.sin)),
                torch.randn(2, 3, 37, 24, generator=gen),
            )
            for name, angles in (
                ("rotary per batch", 6.3 * torch.rand(2, 37, 8, generator=gen)),
                ("rotary shared", 6.3 * torch.rand(1, 37, 8, generator=gen)),
            )
        },
        # the fused scan's inputs (fla's intra-chunk results, computed here in float64) for the rule's own inputs,
        # with a state and without
        "gdn scan": {name: _scan_inputs(*GDN_RULE_INPUTS[name]) for name in GDN_RULE_INPUTS},
        # a weight [out, in], lora_A [r, in], lora_B [out, r] and the scaling: ragged 64-wide tiles both ways, a rank
        # below the dot's 16 (masked) and one of 16
        "lora merge": {
            f"lora merge rank {rank}": (
                torch.randn(out, inner, generator=gen),
                torch.randn(rank, inner, generator=gen),
                torch.randn(out, rank, generator=gen),
                scaling,
            )
            for out, inner, rank, scaling in ((70, 90, 5, 2.0), (130, 65, 16, 0.5))
        },
    }
    inputs["attention dq"] = {
        name: _attention_dq_inputs(gen, pages) for name, pages in (("own pages", 2), ("one prompt's pages", 1))
    }
    # rows of 100 features (a masked 128-wide block), in float32: the norm's arithmetic without its roundings to 16 bits
    inputs["rows norm"] = tuple(torch.randn(*shape, generator=gen) for shape in ((2, 3, 100), (2, 3, 100), (100,)))
    # one token of 2 sequences: 2 q/k heads, 4 value heads of 40 columns (two 32-wide blocks, the second masked)
    inputs["gdn decode"] = (
        *(torch.nn.functional.normalize(torch.randn(2, 1, 2, 32, generator=gen), dim=-1) for _ in range(2)),
        torch.randn(2, 1, 4, 40, generator=gen),
        -0.5 * torch.rand(2, 1, 4, generator=gen),
        torch.rand(2, 1, 4, generator=gen),
        torch.randn(2, 4, 32, 40, generator=gen),
    )
    # one token of 3 sequences: q of 3 heads, k and v of 2 (D = 24, a masked 32-wide block; v 40 wide), rotary on
    # the first 16 features; own pages of 5 slots, slot 2 written
    inputs["rope append"] = (
        torch.randn(3, 1, 3, 24, generator=gen),
        torch.randn(3, 1, 2, 24, generator=gen),
        torch.randn(3, 1, 2, 40, generator=gen),
        *(f(torch.cat([a, a], -1)) for a in [6.3 * torch.rand(1, 1, 8, generator=gen)] for f in (torch.cos, torch.sin)),
        torch.zeros(3, 2, 5, 24),
        torch.zeros(3, 2, 5, 40),
        torch.tensor([2]),
    )
    # the un-normed rows of a folded norm for the 3 sequences (100 features: a masked 128-wide block; rms near 3, so
    # the scale is far from 1) and the norm's eps
    inputs["folded norm rows"] = (3 * torch.randn(3, 1, 100, generator=gen), 1e-5)
    inputs["decode attention"] = {
        name: _decode_attention_inputs(gen, sinks) for name, sinks in (("decode", False), ("decode with sinks", True))
    }
    inputs["sampler"] = _sampler_inputs(gen)
    folder = tmp_path_factory.mktemp("interpreted")
    torch.save(inputs, folder / "inputs.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", KERNELS, str(folder / "inputs.pt"), str(folder / "outputs.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return inputs, torch.load(folder / "outputs.pt")


def _reference_conv(x, state, weight, bias, grads):
    """q, k, v and dx of HF-form conv, SiLU, split and l2 norm (`conv_split_heads` on CPU) in float64."""
    leaf = x.double().requires_grad_(True)
    q, k, v, _ = conv_split_heads(
        leaf, None if state is None else state.double(), weight.double(), bias.double(), KEY_DIM, HEAD_DIM, HEAD_DIM
    )
    torch.autograd.backward((q, k, v), [g.double() for g in grads])
    return q.detach(), k.detach(), v.detach(), leaf.grad


@pytest.mark.parametrize("case", ["state", "no state"])
def test_interpreted_gdn_conv_split_forward_and_backward_are_float32_roundings_of_float64(interpreted, case):
    """`ConvSplitNormalized` in float32: q, k and v each row of a head within (K + D + 8) EPS32 of the head row's
    largest value (K products and the bias, SiLU, a sum of D squares, a square root), dx within (K (D + 16) + 8)
    EPS32 of its largest (per tap a pre-activation's gradient: the pre-activation, norm and projection recomputed),
    times SAFETY. Flipped taps fall outside both bounds."""
    inputs, outputs = interpreted
    x, state, weight, bias, grads = inputs["conv"][case]
    expected = _reference_conv(x, state, weight, bias, grads)
    flipped = _reference_conv(x, state, weight.flip(-1), bias, grads)
    for name, ours, e, f in zip(("q", "k", "v", "dx"), outputs[case], expected, flipped):
        scale = e.abs().amax(-1, keepdim=True) if name != "dx" else e.abs().max()
        terms = TAPS + HEAD_DIM + 8 if name != "dx" else TAPS * (HEAD_DIM + 16) + 8
        bound = SAFETY * terms * EPS32 * scale
        error = (ours.double() - e).abs()
        assert ours.shape == e.shape and (error <= bound).all(), f"{name}: {(error / bound).max().item():.3g} of bound"
        assert ((f - e).abs() > bound).any(), f"{name}: the bound cannot tell flipped taps"


def test_interpreted_fused_logprobs_are_float32_roundings_of_float64(interpreted):
    """`FusedTokenLogprobs` with a float32 head, elementwise against float64. Each logit, a float32 GEMM of H products,
    is within H EPS32 (|h| @ |W|^T) of its value (delta: the row's largest such bound); the log-prob moves by 2 delta
    (the target's logit and the log-sum-exp) plus the online sum of V exponentials and its log ((V + 4) EPS32) and the
    subtraction (EPS32 |log p|). The hidden rows' gradient g (onehot - p) W: each p moves relatively by 2 delta +
    (V + 4) EPS32, and the float32 GEMM over V (g rounded once more) by (V + 1) EPS32 of sum |onehot - p| |W|. Times
    SAFETY. A log-prob of the wrong target falls outside its bound."""
    inputs, outputs = interpreted
    hidden, weight, targets, grad = (t.double() if t.is_floating_point() else t for t in inputs["logprobs"])
    leaf = hidden.clone().requires_grad_(True)
    logp_TV = torch.log_softmax(leaf @ weight.t(), dim=-1)
    expected = logp_TV.gather(-1, targets[:, None]).squeeze(-1)
    expected.backward(grad)
    ours, ours_grad = (t.double() for t in outputs["logprobs"])
    delta_T = HIDDEN * EPS32 * (hidden.abs() @ weight.abs().t()).amax(-1)
    logp = expected.detach()
    bound = SAFETY * (2 * delta_T + (VOCAB + 4) * EPS32 + EPS32 * logp.abs())
    assert ((ours - logp).abs() <= bound).all(), f"{((ours - logp).abs() / bound).max().item():.3g} of bound"
    wrong = logp_TV.gather(-1, ((targets + 1) % VOCAB)[:, None]).squeeze(-1).detach()
    assert ((wrong - logp).abs() > bound).any()
    p_TV = logp_TV.detach().exp()
    away_TV = (torch.nn.functional.one_hot(targets, VOCAB) - p_TV).abs()
    p_moves = (2 * delta_T + (VOCAB + 4) * EPS32)[:, None] * (p_TV @ weight.abs())
    grad_bound = SAFETY * grad.abs()[:, None] * (p_moves + (VOCAB + 1) * EPS32 * (away_TV @ weight.abs()))
    error = (ours_grad - leaf.grad).abs()
    assert (error <= grad_bound).all(), f"{(error / grad_bound).max().item():.3g} of bound"


def test_interpreted_index_scores_are_float32_sums_of_exact_products(interpreted):
    """`fused_index_scores`: bf16 products are exact in float32, so each score is sum_h w relu(q . k) within
    (I + H + 2) EPS32 of the sum of its terms' magnitudes, times SAFETY; a score without the ReLU falls outside."""
    inputs, outputs = interpreted
    q, w, k = (t.double() for t in inputs["index_scores"])
    dots_THN = torch.einsum("thi,ni->thn", q, k)
    expected = (dots_THN.relu() * w[..., None]).sum(1)
    magnitude = (torch.einsum("thi,ni->thn", q.abs(), k.abs()) * w[..., None]).sum(1)
    bound = SAFETY * (INDEX_DIM + INDEX_HEADS + 2) * EPS32 * magnitude
    assert ((outputs["index_scores"].double() - expected).abs() <= bound).all()
    assert (((dots_THN * w[..., None]).sum(1) - expected).abs() > bound).any()


def _reference_swiglu(gate, up, grad, silu=lambda g: g * torch.sigmoid(g)):
    """silu(gate) * up and its gradients in gate and up, in float64 by autograd."""
    gate, up = (t.double().requires_grad_(True) for t in (gate, up))
    product = silu(gate) * up
    product.backward(grad.double())
    return product.detach(), gate.grad, up.grad


def test_interpreted_swiglu_forward_and_backward_are_float32_roundings_of_float64(interpreted):
    """`SwiGLU` in float32, elementwise against float64 autograd. The product and d up are products of sigmoid(g) (an
    exp, a sum and a quotient: 4 roundings) and two or three factors: 8 EPS32 of their value. d gate is dout up
    sigmoid(g) (1 + g (1 - sigmoid(g))), whose bracket cancels near g = -1.28: 8 EPS32 of dout up sigmoid(g) (1 +
    |g (1 - sigmoid(g))|), the magnitudes of its terms. Times SAFETY. silu's derivative without its second term,
    and gate and up swapped, fall outside the bounds."""
    inputs, outputs = interpreted
    gate, up, grad = (t.double() for t in inputs["swiglu"])
    expected = _reference_swiglu(gate, up, grad)
    sigmoid = torch.sigmoid(gate)
    terms = (grad * up * sigmoid).abs() * (1 + (gate * (1 - sigmoid)).abs())
    bounds = [SAFETY * 8 * EPS32 * scale for scale in (expected[0].abs(), terms, expected[2].abs())]
    for name, ours, e, bound in zip(("product", "d gate", "d up"), outputs["swiglu"], expected, bounds):
        error = (ours.double() - e).abs()
        assert ours.shape == e.shape and (error <= bound).all(), f"{name}: {(error / bound).max().item():.3g} of bound"
    swapped = _reference_swiglu(up, gate, grad)
    assert ((swapped[0] - expected[0]).abs() > bounds[0]).any()
    first_term_only = grad * up * sigmoid  # d silu / dg taken as sigmoid(g) alone
    assert ((first_term_only - expected[1]).abs() > bounds[1]).any()


def test_interpreted_stacked_swiglu_is_a_float32_rounding_of_float64(interpreted):
    """`swiglu_stacked_triton` on [gate | up] rows in float32 against silu(gate) * up in float64: the product of
    sigmoid(g) (4 roundings) and two factors, 8 EPS32 of its value, times SAFETY; gate and up swapped fall outside."""
    inputs, outputs = interpreted
    gate, up = (t.double() for t in inputs["swiglu"][:2])
    expected = gate * torch.sigmoid(gate) * up
    bound = SAFETY * 8 * EPS32 * expected.abs()
    assert outputs["swiglu stacked"].shape == expected.shape
    assert ((outputs["swiglu stacked"].double() - expected).abs() <= bound).all()
    assert ((up * torch.sigmoid(up) * gate - expected).abs() > bound).any()


def _rotation_terms(x, cos, sin, partner_sine: bool):
    """Per feature of x [B, H, T, D] the magnitudes of the rotation's two terms, |x_c cos_c| + |x_p sin|, p the
    feature's partner (c + R/2 or c - R/2) and the sine the feature's own (forward) or the partner's (the
    transpose); |x_c| beyond R."""
    R, h = cos.shape[-1], cos.shape[-1] // 2
    cos, sin = cos[:, None].abs(), sin[:, None].abs()
    swap = lambda t: torch.cat([t[..., h:R], t[..., :h]], dim=-1)  # noqa: E731
    rotated = x[..., :R].abs() * cos + swap(x[..., :R]).abs() * (swap(sin) if partner_sine else sin)
    return torch.cat([rotated, x[..., R:].abs()], dim=-1)


@pytest.mark.parametrize("case", ["rotary per batch", "rotary shared"])
def test_interpreted_rotary_forward_and_backward_are_float32_roundings_of_float64(interpreted, case):
    """`Rotary` in float32 against the rotate-half formula in float64 (autograd for the gradient): each rotated
    feature is two products and a sum (3 EPS32 of |x cos| + |x' sin|, its terms' magnitudes), a passed one exact;
    the gradient alike. Times SAFETY. The gradient comes back laid out as the input ([B, T, H, D] contiguous); a
    rotation with the sine's sign flipped falls outside the bound."""
    inputs, outputs = interpreted
    x, cos, sin, grad = (t.double() for t in inputs["rotary"][case])
    leaf = x.clone().requires_grad_(True)
    expected = rotate_half_formula(leaf.transpose(1, 2), cos, sin)
    expected.backward(grad)
    rotated, dx = outputs[case]
    bound = SAFETY * 3 * EPS32 * _rotation_terms(x.transpose(1, 2), cos, sin, partner_sine=False)
    assert ((rotated.double() - expected.detach()).abs() <= bound).all()
    grad_bound = SAFETY * 3 * EPS32 * _rotation_terms(grad, cos, sin, partner_sine=True).transpose(1, 2)
    assert ((dx.double() - leaf.grad).abs() <= grad_bound).all()
    assert dx.is_contiguous()
    flipped = rotate_half_formula(x.transpose(1, 2), cos, -sin)
    assert ((flipped - expected.detach()).abs() > bound).any()


def test_interpreted_rope_append_rotates_q_and_k_and_writes_the_clocks_slot(interpreted):
    """`rope_append_triton` in float32 against the rotate-half formula in float64: q and k rotated within 3 EPS32 of
    their terms' magnitudes (times SAFETY; a flipped sine falls outside), k and v written at the clock's slot only,
    v exactly."""
    inputs, outputs = interpreted
    q, k, v, cos, sin, _, _, step = inputs["rope append"]
    q_out, k_own, v_own = outputs["rope append"]
    slot = int(step)
    for x, ours in ((q, q_out), (k, k_own[:, :, slot : slot + 1])):
        x_BHTD = x.double().transpose(1, 2)
        expected = rotate_half_formula(x_BHTD, cos.double(), sin.double())
        bound = SAFETY * 3 * EPS32 * _rotation_terms(x_BHTD, cos.double(), sin.double(), partner_sine=False)
        assert ((ours.double() - expected).abs() <= bound).all()
        assert ((rotate_half_formula(x_BHTD, cos.double(), -sin.double()) - expected).abs() > bound).any()
    assert torch.equal(v_own[:, :, slot], v[:, 0])
    others = [i for i in range(k_own.shape[2]) if i != slot]
    assert not k_own[:, :, others].any() and not v_own[:, :, others].any()


def _rms_scale64(x, eps):
    """rsqrt(mean(x^2) + eps) of x's rows in float64, [..., 1]."""
    return torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)


def _folded_bound(x) -> float:
    """The relative error of the kernels' float32 row scale: a sum of X squares (X EPS32), the mean, eps and the
    rsqrt (4 more roundings), and its product with a value (one more), rounded up to (X + 8) EPS32."""
    return (x.shape[-1] + 8) * EPS32


def test_interpreted_rope_append_with_a_folded_norm_scales_then_rotates(interpreted):
    """`rope_append_triton(rms_of=(x, eps))` in float32 against the float64 formula: q, k and v times each row's
    rsqrt(mean(x^2) + eps), q and k then rotated. A rotated feature within SAFETY ((X + 8) + 3) EPS32 of its terms'
    magnitudes (the scale's error, then the rotation's three roundings), v within SAFETY (X + 8) EPS32 of itself; only
    the clock's slot written. Unscaled falls outside."""
    inputs, outputs = interpreted
    q, k, v, cos, sin, _, _, step = inputs["rope append"]
    x, eps = inputs["folded norm rows"]
    scale_B111 = _rms_scale64(x, eps)[..., None]
    q_out, k_own, v_own = outputs["rope append scaled"]
    slot, cos, sin = int(step), cos.double(), sin.double()
    for t, ours in ((q, q_out), (k, k_own[:, :, slot : slot + 1])):
        x_BHTD = (t.double() * scale_B111).transpose(1, 2)
        expected = rotate_half_formula(x_BHTD, cos, sin)
        bound = SAFETY * (_folded_bound(x) + 3 * EPS32) * _rotation_terms(x_BHTD, cos, sin, partner_sine=False)
        assert ((ours.double() - expected).abs() <= bound).all()
        unscaled = rotate_half_formula(t.double().transpose(1, 2), cos, sin)
        assert ((unscaled - expected).abs() > bound).any()
    expected_v = v[:, 0].double() * scale_B111[:, 0]
    assert ((v_own[:, :, slot].double() - expected_v).abs() <= SAFETY * _folded_bound(x) * expected_v.abs()).all()
    others = [i for i in range(k_own.shape[2]) if i != slot]
    assert not k_own[:, :, others].any() and not v_own[:, :, others].any()


def test_interpreted_stacked_swiglu_with_a_folded_norm_scales_gate_and_up(interpreted):
    """`swiglu_stacked_scaled_triton` in float32 against silu(r g) (r u) in float64, r = rsqrt(mean(x^2) + eps) of
    the row: r's error (X + 8) EPS32 moves silu(y) relatively by (1 + |y (1 - sigmoid(y))|) times it and r u by it
    once more, the product's own 8 EPS32 (the stacked kernel's bound) on top; times SAFETY. Unscaled falls
    outside. Two column blocks a row, the second ragged."""
    inputs, outputs = interpreted
    gate, up = (t.double() for t in inputs["swiglu"][:2])
    x, eps = inputs["folded norm rows"]
    scale = _rms_scale64(x[:, 0], eps)
    y = scale * gate
    expected = y * torch.sigmoid(y) * (scale * up)
    sensitivity = 2 + (y * (1 - torch.sigmoid(y))).abs()
    bound = SAFETY * (_folded_bound(x) * sensitivity + 8 * EPS32) * expected.abs()
    ours = outputs["swiglu stacked scaled"]
    assert ours.shape == expected.shape and ours.dtype == torch.float32
    assert ((ours.double() - expected).abs() <= bound).all()
    assert ((gate * torch.sigmoid(gate) * up - expected).abs() > bound).any()


@pytest.mark.parametrize("case", ["gdn scan from a state", "gdn scan from zeros"])
def test_interpreted_fused_gdn_scan_is_the_token_by_token_rule_in_float32(interpreted, case):
    """`chunk_scan_output_triton` (the scan with each chunk's output inside it) in float32, fed the UT transform's W
    and U, against the float64 token-by-token rule (`recurrent_gated_delta_rule`) on the same q, k, v, g and beta:
    output and final state within float32_tolerance(T, K + C) of their largest entries (T steps, each reductions of
    the key dim and the chunk's C positions, in another order). A scan that drops the state (or the decay) falls
    outside."""
    from longstraw.kernels.gdn import recurrent_gated_delta_rule

    inputs, outputs = interpreted
    q, k, v, g, beta, state = GDN_RULE_INPUTS[case]
    expected = recurrent_gated_delta_rule(q, k, v, g, beta, state, l2norm_qk=False)
    tol = float32_tolerance(q.shape[1], q.shape[-1] + SCAN_CHUNK)
    for name, ours, e in zip(("output", "state"), outputs[case], expected):
        assert ours.dtype == torch.float32 and ours.shape == e.shape, name
        close(ours.double(), e, rtol=tol, atol=tol * float(e.abs().max()), what=f"{case}: {name}")
    wrong = recurrent_gated_delta_rule(q, k, v, g * (0.5 if state is None else 1), beta, None, l2norm_qk=False)
    scale = float(expected[0].abs().max())
    assert ((wrong[0] - expected[0]).abs() > tol * scale + tol * expected[0].abs()).any()


@pytest.mark.parametrize("case", ["lora merge rank 5", "lora merge rank 16"])
def test_interpreted_lora_merge_is_a_float32_rounding_of_float64(interpreted, case):
    """`merge_lora_triton` in float32, elementwise against W + scaling B A in float64: the rank's r products summed
    and scaled, the sum with W, each rounding within EPS32 of the terms' magnitudes |W| + |scaling| |B| |A|: (r + 2)
    of them, times SAFETY. The sum without the scaling falls outside."""
    inputs, outputs = interpreted
    weight, lora_A, lora_B = (t.double() for t in inputs["lora merge"][case][:3])
    scaling = inputs["lora merge"][case][3]
    expected = weight + scaling * lora_B @ lora_A
    bound = SAFETY * (lora_A.shape[0] + 2) * EPS32 * (weight.abs() + abs(scaling) * lora_B.abs() @ lora_A.abs())
    ours = outputs[case]
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    assert ((ours.double() - expected).abs() <= bound).all()
    assert ((weight + lora_B @ lora_A - expected).abs() > bound).any()


DECODE_WRITTEN = 67  # own slots written so far (the clock's step + 1) of 80


def _decode_attention_inputs(gen, sinks: bool):
    """(q, the shared pages, the own pages, the step, the sinks or None) in float32 of float64 values for the
    decoding kernel: 3 sequences x 6 query heads over 2 K/V heads (9 folded rows a head: one masked tile of 16),
    150 prefix keys read as a view of 170-key pages (on the interpreter's one "multiprocessor": 2 splits of 128 keys,
    the second ragged), 80 own slots of which the first 67 are written (two blocks of 64, the second ragged); a slot
    past them holds large values that must not count."""

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).float()

    k_pages, v_pages = randn(1, 2, 170, 32), randn(1, 2, 170, 32)
    k_own, v_own = randn(3, 2, 80, 32), randn(3, 2, 80, 32)
    k_own[:, :, DECODE_WRITTEN:], v_own[:, :, DECODE_WRITTEN:] = 30.0, 30.0
    step = torch.tensor([DECODE_WRITTEN - 1])
    return randn(3, 6, 1, 32), k_pages[:, :, :150], v_pages[:, :, :150], k_own, v_own, step, randn(6) if sinks else None


@pytest.mark.parametrize("case", ["decode", "decode with sinks"])
def test_interpreted_decode_attention_is_the_softmax_over_prefix_and_written_own_keys(interpreted, case):
    """`decode_attention_triton` in float32 (two launches: the prefix's splits, then each row's own keys and the
    merge), against float64 softmax attention of each query over the 150 prefix keys, its sequence's 67 written own
    keys and, with sinks, one more logit of value 0 (HF's sink column): within `float32_tolerance` of the keys and
    the head dim, relative to the largest output. Counting the unwritten slots falls outside."""
    inputs, outputs = interpreted
    q, k_shared, v_shared, k_own, v_own, step, sinks = inputs["decode attention"][case]
    q, k_shared, v_shared, k_own, v_own = (t.double() for t in (q, k_shared, v_shared, k_own, v_own))

    def expected(written: int):
        group = q.shape[1] // k_shared.shape[1]
        keys = torch.cat([k_shared.expand(3, -1, -1, -1), k_own[:, :, :written]], 2).repeat_interleave(group, 1)
        values = torch.cat([v_shared.expand(3, -1, -1, -1), v_own[:, :, :written]], 2).repeat_interleave(group, 1)
        scores = q @ keys.mT * 0.25
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().view(1, -1, 1, 1).expand(3, -1, 1, 1)], -1)
        weights = torch.softmax(scores, -1)
        return weights[..., : keys.shape[2]] @ values

    ours, reference = outputs[case].double(), expected(DECODE_WRITTEN)
    tol = float32_tolerance(150 + DECODE_WRITTEN, q.shape[-1])
    assert outputs[case].shape == reference.shape
    close(ours, reference, rtol=tol, atol=tol * float(reference.abs().max()), what="decode attention")
    assert ((expected(80) - reference).abs() > tol * float(reference.abs().max())).any()


def test_interpreted_rows_norm_is_the_llama_norm_in_float32(interpreted):
    """`rms_norm_rows` in float32 against HF's Llama-form formula in float64 (of the rows, and of residual + rows with
    that sum): a sum of H squares, a square root and two products, within (H + 8) EPS32 of each output, times
    SAFETY. Without the weight it falls outside."""
    inputs, outputs = interpreted
    x, residual, weight = (t.double() for t in inputs["rows norm"])

    def llama(rows):
        return weight * rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-5)

    bound = SAFETY * (x.shape[-1] + 8) * EPS32
    for ours, rows in ((outputs["rows norm"], x), (outputs["rows norm after the sum"][0], x + residual)):
        expected = llama(rows)
        assert ours.dtype == torch.float32 and ((ours.double() - expected).abs() <= bound * expected.abs()).all()
        assert ((expected / weight - expected).abs() > bound * expected.abs()).any()
    assert torch.equal(outputs["rows norm after the sum"][1], inputs["rows norm"][0] + inputs["rows norm"][1])


def test_interpreted_gdn_decode_step_is_the_recurrent_rule_in_float32(interpreted):
    """`gdn_decode_step` in float32 against `recurrent_gated_delta_rule` for one token in float64, the output and
    the state written in place: each a few sums of Dk products over the state, within (4 Dk + 8) EPS32 of the
    largest state or output value, times SAFETY. The rule without the decay falls outside."""
    from longstraw.kernels.gdn import recurrent_gated_delta_rule

    inputs, outputs = interpreted
    q, k, v, g, beta, state = (t.double() for t in inputs["gdn decode"])
    ours_out, ours_state = outputs["gdn decode"]
    out, final = recurrent_gated_delta_rule(q, k, v, g, beta, state, l2norm_qk=False)
    bound = SAFETY * (4 * q.shape[-1] + 8) * EPS32
    for name, ours, expected in (("out", ours_out, out), ("state", ours_state, final)):
        scale = float(expected.abs().max())
        assert ours.shape == expected.shape and ((ours.double() - expected).abs() <= bound * scale).all(), name
    undecayed, _ = recurrent_gated_delta_rule(q, k, v, torch.zeros_like(g), beta, state, l2norm_qk=False)
    assert ((undecayed - out).abs() > bound * float(out.abs().max())).any()


def _attention_query_gradient(do, q, k, v, live_k, live_v):
    """dQ in float64 by autograd of softmax attention over the prefix keys k, v and the live ones, the gradient
    taken through the prefix's scores only (the share of dQ a prefix block adds), or over the prefix alone when
    live_k is None."""
    leaf = q.clone().requires_grad_(True)
    scores = [leaf @ k.mT] + ([] if live_k is None else [q @ live_k.mT])
    values = torch.cat([v] + ([] if live_v is None else [live_v]), 2)
    attended = torch.softmax(torch.cat(scores, -1) * ATTENTION_SCALE, -1) @ values
    (attended * do).sum().backward()
    return leaf.grad


@pytest.mark.parametrize("case", ["own pages", "one prompt's pages"])
def test_interpreted_attention_dq_is_the_prefix_share_of_the_query_gradient_in_float32(interpreted, case):
    """`attention_dq_triton` in float32 (the autotuner's first configuration), added into a nonzero dq: against
    float64 autograd of softmax attention over the prefix and live keys, the gradient through the prefix's scores,
    within `float32_tolerance` of the products' lengths (keys, head dim) relative to the largest dQ. Against the
    gradient of the prefix alone (the lse and output the block's own, not the global ones) it falls outside. The
    pages are each sequence's own, or one prompt's for both (read through a batch stride of 0)."""
    inputs, outputs = interpreted
    kernel_inputs, (live_k, live_v) = inputs["attention dq"][case]
    do, q, k_pages, v_pages, keys, _, _, dq = (t.double() if torch.is_tensor(t) else t for t in kernel_inputs)
    k, v = (pages[:, :, :keys].expand(q.shape[0], -1, -1, -1) for pages in (k_pages, v_pages))
    expected = dq + _attention_query_gradient(do, q, k, v, live_k, live_v)
    ours = outputs[case]
    tol = float32_tolerance(keys, q.shape[-1])
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    close(ours.double(), expected, rtol=tol, atol=tol * float(expected.abs().max()), what="attention dq")
    local = dq + _attention_query_gradient(do, q, k, v, None, None)
    assert ((local - expected).abs() > tol * expected.abs() + tol * float(expected.abs().max())).any()


# runs in the interpreter's process: the capture's fused GDN forward as `chunk_gated_delta_rule_forward` calls it,
# fla's interpreted intra-chunk kernels included (each autotuned kernel of fla's and ours at its first configuration)
FUSED_SCAN_WITH_FLA = """
import sys
import torch
from triton.runtime.autotuner import Autotuner
from longstraw.kernels import gdn
forward = gdn._load_fused_scan()
for name, module in list(sys.modules.items()):
    if name.startswith(("fla.", "longstraw.")) and module is not None:
        for found in list(vars(module).values()):
            for _ in range(4):  # a heuristics wrapper around an autotuner around the jitted function
                if isinstance(found, Autotuner):
                    found.configs = found.configs[:1]
                found = getattr(found, "fn", None)
q, k, v, g, beta, state = torch.load(sys.argv[1])
torch.save(forward(q, k, v, g, beta, state, q.shape[-1] ** -0.5), sys.argv[2])
"""


def test_interpreted_fused_gdn_forward_with_flas_intra_chunk_kernels_is_the_rule(tmp_path):
    """Where fla imports: `gdn._load_fused_scan()`'s forward (fla's chunk_local_cumsum and intra-chunk kernels, then
    the fused scan), interpreted in float32, against the float64 token-by-token rule on the same inputs, within the
    fused scan's own bound above. It checks what the scan takes from fla: the names, the log2 decay, w and u."""
    pytest.importorskip("fla")
    q, k, v, g, beta, state = GDN_RULE_INPUTS["gdn scan from a state"]
    torch.save([t.float() for t in (q, k, v, g, beta, state)], tmp_path / "inputs.pt")
    done = subprocess.run(
        [sys.executable, "-c", FUSED_SCAN_WITH_FLA, str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    from longstraw.kernels.gdn import recurrent_gated_delta_rule

    expected = recurrent_gated_delta_rule(q, k, v, g, beta, state, l2norm_qk=False)
    tol = float32_tolerance(q.shape[1], q.shape[-1] + SCAN_CHUNK)
    for name, ours, e in zip(("output", "state"), torch.load(tmp_path / "outputs.pt"), expected):
        close(ours.double(), e, rtol=tol, atol=tol * float(e.abs().max()), what=f"with fla's kernels: {name}")


@pytest.mark.parametrize(
    "case", ["sampler greedy", "sampler at 1", "sampler at 0.7, forced", "sampler, finite rows, no stop ids"]
)
def test_interpreted_sampler_draws_torchs_tokens_and_writes_the_step(interpreted, case):
    """`sample_step_triton` in float32 against the torch tail's arithmetic on the same Exp(1) draws q: the token is
    argmax(softmax(logits * (1 / T)) / q) (torch's logits / T on CUDA, then torch.multinomial's draw) or the argmax
    (greedy), a forced row's its forced token, on every row without a NaN (a row with one takes a token in range);
    its log-prob the float64 log_softmax's within `chunked_logprob_bound`. At the clock's step only: the token, or
    the pad on a finished row, and its log-prob; the rows that wrote a stop id finished, tokens_G the written
    tokens, finite_1 whether every logit was finite. Greedy tokens differ from the drawn ones (the draws count), and
    the log-prob of the next token falls outside the bound."""
    from longstraw.kernels.sampling_triton import CHUNK

    inputs, outputs = interpreted
    logits, q, temperature, stops, step, forcing, (_, going, _, tokens_before, logps_before) = inputs["sampler"][case]
    tokens_G, unfinished_G, finite_1, tokens_GT, logps_GT = outputs[case]
    G, V = logits.shape
    drawn = logits.argmax(-1)
    if q is not None:
        inverse = 1 / torch.tensor(temperature, dtype=torch.float32)
        drawn = torch.softmax(logits * inverse, -1).div(q).argmax(-1)
        assert not torch.equal(drawn, logits.argmax(-1))
    expected = drawn if forcing is None else torch.where(forcing[0], forcing[1], drawn)
    clean = ~logits.isnan().any(-1)
    taken = torch.where(going, expected, SAMPLER_PAD)
    assert torch.equal(tokens_GT[clean, int(step)], taken[clean])
    assert ((tokens_GT[:, int(step)] >= 0) & (tokens_GT[:, int(step)] < V)).all()
    assert torch.equal(tokens_G, tokens_GT[:, int(step)])
    assert torch.equal(unfinished_G, going & ~torch.isin(tokens_G, stops))
    assert bool(finite_1) == bool(logits.isfinite().all())
    others = [t for t in range(tokens_GT.shape[1]) if t != int(step)]
    assert torch.equal(tokens_GT[:, others], tokens_before[:, others])
    assert torch.equal(logps_GT[:, others], logps_before[:, others])
    logp_GV = torch.log_softmax(logits.double(), -1)
    exact = logp_GV.gather(1, expected[:, None]).squeeze(1)[clean]
    bound = chunked_logprob_bound(V, CHUNK, exact.abs())
    ours = logps_GT[clean, int(step)].double()
    assert ((ours - exact).abs() <= bound).all(), f"{((ours - exact).abs() / bound).max().item():.3g} of bound"
    following = logp_GV.gather(1, ((expected + 1) % V)[:, None]).squeeze(1)[clean]
    assert ((following - exact).abs() > bound).any()


# runs in a process of its own with TRITON_INTERPRET=1: tiny-llama decoding through the torch tail and the fused
# sampler (CUDA's choice, made here), forced tokens on rows 0 (every other step) and 2 for the first 6 steps
FUSED_TAIL = """
import sys
import torch
from longstraw import capture
from longstraw.families import adapter_for
from longstraw.kernels import sampling_triton
from longstraw.models import build_model
from longstraw.training.rollout import Decoder, SamplingConfig, decoding

model = build_model("tiny-llama", seed=1)
adapter = adapter_for(model)
state = capture(model, torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(0)), chunk_size=32)
out = {}
for temperature in (0.0, 1.0, 0.7):
    for fused in (False, True):
        config = SamplingConfig(4, 12, temperature, stop_ids=tuple(range(3, 256, 9)), seed=3)
        with torch.no_grad(), decoding(adapter):
            decoder = Decoder(adapter, state, config)
            if fused:
                decoder.sample_step = sampling_triton.sample_step_triton
            for step in range(12):
                decoder.forcing_G.copy_(torch.tensor([step % 2 == 0, False, True, False]))
                decoder.forced_G.copy_(torch.tensor([7, 0, 200 + 9 * step, 0]))  # no stop ids
                decoder.step(forced=step < 6)
        out[temperature, fused] = (decoder.tokens_GT, decoder.logps_GT, decoder.unfinished_G, decoder.finite_1)
torch.save(out, sys.argv[1])
"""


def test_interpreted_fused_tail_decodes_the_torch_tails_tokens(tmp_path):
    """A `Decoder` stepping through the fused sampler (interpreted) against the torch tail it stands in for, from one
    seed, greedy and sampled, with forced tokens for half the steps: the same tokens written, rows finished and
    finite flag; the log-probs within both sides' float32 bounds (ours chunked, torch's log_softmax one chunk)."""
    pytest.importorskip("triton")
    from longstraw.kernels.sampling_triton import CHUNK

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", FUSED_TAIL, str(tmp_path / "out.pt")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    for temperature in (0.0, 1.0, 0.7):
        (tokens, logps, unfinished, finite), (ours, ours_logps, ours_unfinished, ours_finite) = (
            out[temperature, fused] for fused in (False, True)
        )
        assert torch.equal(ours, tokens) and torch.equal(ours_unfinished, unfinished) and bool(ours_finite == finite)
        bound = chunked_logprob_bound(256, CHUNK, logps.double().abs()) + chunked_logprob_bound(256, 256, logps.abs())
        assert ((ours_logps.double() - logps.double()).abs() <= bound).all()
        assert (tokens[2, :6] == 200 + 9 * torch.arange(6)).all() and (tokens[0, :6:2] == 7).all()
