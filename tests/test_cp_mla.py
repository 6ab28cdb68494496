"""The MLA family under context parallelism (latent, rope-key and index-key pages by shard; the DSA top-k
merged from every rank's proposals) on gloo, world sizes 2 and 3, against the single process (itself held
to HF's forward and autograd in tests/test_mla.py). In float64, HF's float32 casts included
(float64_reference): sharding computes the same thing in another order (in float32 a parameter's gradient
measured 1.0e-6 apart, pages 0.44 of a 1e-5 bound), and both sides' float32 steps (the log-softmax, the
indexer's weights) see the same values.

Top-k 6 with tie-free indexer weights (see tests/test_mla.py) drops most of the positions a query sees,
so the selection decides the result; the selected index sets are compared query by query.
"""

import os

import pytest
import torch
from float64_reference import hf_float64, to_float64
from test_mla import DROP_TOPK, _model
from tolerances import TOL64, close, logprob_tolerance, max_abs, within

from longstraw import capture, replay
from longstraw.core.hf_reference import max_relative_error
from longstraw.cp import context_parallel, shard_bounds
from longstraw.cp.launch import run_ranks
from longstraw.kernels.dsa_topk import index_scores, key_positions, ranked_keys, select_topk
from longstraw.training.rollout import SamplingConfig, sample

PROMPT_LEN = 24  # 23 resident positions: divisible by neither 2 nor 3
CHUNK = 4
# glm_moe_dsa: index and IndexShare layers alternating; deepseek_v32: an indexer on every layer;
# deepseek_v3: dense latent attention (no indexer)
CASES = [
    ("tiny-glm_moe_dsa", DROP_TOPK, 2),
    ("tiny-glm_moe_dsa", DROP_TOPK, 3),
    ("tiny-deepseek_v32", DROP_TOPK, 3),
    ("tiny-deepseek_v3", None, 2),
]


def _ids(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


PROMPT, RESPONSE = _ids(PROMPT_LEN, 0), _ids(7, 1)
WEIGHTS = torch.linspace(-1.0, 2.0, 7)


def _recording_selections(adapter_module, records):
    """Wrap the MLA mixer: every (layer, first position of the chunk or 'replay', selection) it used."""
    real = adapter_module.mla_mix

    def spy(attn, x_BTH, pe, pages, capturing, selection=None):
        first = pages.chunk_start if capturing else "replay"
        out, used = real(attn, x_BTH, pe, pages, capturing, selection)
        if used is not None:
            records.append((attn.layer_idx, first, used.clone()))
        return out, used

    adapter_module.mla_mix = spy
    return real


def _capture_replay(preset, topk, cp=None):
    import longstraw.families.mla as mla

    model = to_float64(_model(preset, topk))
    records = []
    real = _recording_selections(mla, records)
    try:
        with hf_float64(model):
            state = capture(model, PROMPT, chunk_size=CHUNK, cp=cp)
            before = state.fingerprint()
            logp = replay(model, state, RESPONSE)
            (logp * WEIGHTS.double()).sum().backward()
    finally:
        mla.mla_mix = real
    return {
        "layers": [[t.clone() for t in e.tensors()] for e in state.layers],
        "logp": logp.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "unchanged": state.fingerprint() == before,
        "shard": getattr(state, "shard", None),
        "nbytes": state.nbytes,
        "predicted": state.predicted_nbytes,
        "selections": records,
    }


def _rank_capture_replay(preset, topk):
    return _capture_replay(preset, topk, context_parallel(int(os.environ["WORLD_SIZE"])))


def _by_position(records):
    """{(layer, query position or ('replay', row)): the selected positions, as a sorted tuple}."""
    out = {}
    for layer, first, selection in records:
        for row, selected in enumerate(selection.tolist()):
            key = (layer, first + row) if first != "replay" else (layer, "replay", row)
            # positions past the query are masked keys a row with fewer than k visible ones also holds
            out[key] = tuple(sorted(selected))
    return out


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-w{c[2]}")
def sharded(request):
    preset, topk, world = request.param
    ranks = run_ranks(_rank_capture_replay, world, preset, topk, start_method="fork")
    return world, topk, ranks, _capture_replay(preset, topk)


@pytest.mark.numerics
def test_sharded_mla_pages_equal_the_single_process_pages(sharded):
    world, _, ranks, single = sharded
    assert [r["shard"] for r in ranks] == shard_bounds(PROMPT_LEN - 1, world)
    for r in ranks:
        start, end = r["shard"]
        for mine, full in zip(r["layers"], single["layers"]):
            for a, e in zip(mine, full):  # latent + rope key [1, 1, P, E]; index keys [1, P, I]
                e = e[:, :, start:end] if e.dim() == 4 else e[:, start:end]
                close(a, e, rtol=TOL64, atol=TOL64 * float(e.abs().max()), what="pages")
        assert r["nbytes"] == r["predicted"]
    assert sum(r["nbytes"] for r in ranks) == single["nbytes"]


@pytest.mark.numerics
def test_sharded_mla_selections_are_the_single_process_selections(sharded):
    """The capture's selections (wherever a rank computed them) and the replay's (merged from every rank's
    proposals) select the same positions as the single process, query by query and layer by layer."""
    world, topk, ranks, single = sharded
    if topk is None:
        assert not single["selections"] and not any(r["selections"] for r in ranks)
        return
    expected = _by_position(single["selections"])
    captured = {}
    for r in ranks:
        mine = _by_position(r["selections"])
        replayed = {k: v for k, v in mine.items() if "replay" in k}
        assert replayed == {k: v for k, v in expected.items() if "replay" in k}  # every rank holds the merge
        captured.update({k: v for k, v in mine.items() if "replay" not in k})
    # a chunk selects when top-k drops some of its positions, so chunked apart the two select on slightly
    # different query ranges: compare where both did, which is every query from position 2 * CHUNK on
    common = set(captured) & set(expected)
    layers = {layer for layer, *_ in single["selections"]}
    assert {(layer, p) for layer in layers for p in range(2 * CHUNK, PROMPT_LEN - 1)} <= common
    assert {k: captured[k] for k in common} == {k: expected[k] for k in common}
    replay_rows = [k for k in expected if "replay" in k]
    assert replay_rows and all(len(expected[k]) == topk for k in replay_rows)


@pytest.mark.numerics
def test_sharded_mla_replay_logprobs_and_gradients_equal_the_single_process(sharded):
    _, _, ranks, single = sharded
    for r in ranks:
        assert r["unchanged"]
        # float32 log-probs (the log-softmax stays float32) of logits that agree to ~EPS64
        tol = logprob_tolerance(256, float(single["logp"].abs().max()))
        within(max_abs(r["logp"], single["logp"]), tol, "log-probs")
        assert set(r["grads"]) == set(single["grads"])
        within(max_relative_error(r["grads"], single["grads"]), TOL64, "max relative gradient error")
        for name, g in r["grads"].items():  # the replicated backward gives every rank the same gradient
            assert torch.equal(g, ranks[0]["grads"][name]), name


def test_sharded_mla_capture_runs_each_rank_on_its_zigzag_chunks(sharded):
    """The layers' work is spread as the attention family's: the queries a rank selected for in the capture
    are those of the prompt's half-shards r and 2W-1-r, both of them."""
    world, topk, ranks, _ = sharded
    if topk is None:
        pytest.skip("dense latent attention records no selections")
    halves = [(s + a, s + b) for s, e in shard_bounds(PROMPT_LEN - 1, world) for a, b in shard_bounds(e - s, 2)]
    for rank, r in enumerate(ranks):
        positions = {
            p for _, first, sel in r["selections"] if first != "replay" for p in range(first, first + len(sel))
        }
        spans = [halves[rank], halves[2 * world - 1 - rank]]
        assert positions <= {p for a, b in spans for p in range(a, b)}
        assert all(positions & set(range(a, b)) for a, b in spans if b > 2 * CHUNK)


def test_sharded_selection_breaks_ties_as_the_single_process():
    """Exact ties (integer scores: many keys share one) at the k-th place: every shard's top k merged is the
    single process's selection, and both keep the lower positions among equal scores."""
    g = torch.Generator().manual_seed(0)
    T, P, H, I, k = 5, 29, 2, 3, 7
    q = torch.randint(-1, 2, (T, H, I), generator=g).float()
    w = torch.ones(T, H)
    k_prefix, k_live = (torch.randint(-1, 2, (n, I), generator=g).float() for n in (P, T))
    single = select_topk(q, w, k_prefix, k_live, topk=k, scale=1.0)
    scores = index_scores(q, w, torch.cat([k_prefix, k_live]), 1.0)
    scores[torch.arange(P + T)[None] > P + torch.arange(T)[:, None]] = float("-inf")
    for t in range(T):  # the rule: by score, then the lower position
        order = sorted(range(P + T), key=lambda s: (-float(scores[t, s]), s))[:k]
        assert single[t].tolist() == order
    assert len(set(scores[0].tolist())) < P // 2  # ties are everywhere, not a corner case
    for world in (2, 3):
        proposals = []
        for rank, (start, end) in enumerate(shard_bounds(P, world)):
            live = (k_live, P) if rank == world - 1 else (None, P)
            proposals.append(ranked_keys(q, w, k_prefix[start:end], start, *live, k, 1.0))
        merged = key_positions(torch.cat(proposals, dim=1).topk(k, dim=1).values)
        assert torch.equal(merged, single)


SAMPLING = SamplingConfig(
    num_generations=4, max_new_tokens=8, temperature=1.0, stop_ids=tuple(range(3, 256, 9)), seed=5
)


def _sample(preset, topk, cp=None):
    model = to_float64(_model(preset, topk))
    with hf_float64(model):
        rollouts = sample(model, capture(model, PROMPT, chunk_size=CHUNK, cp=cp), SAMPLING)
    return {"responses": rollouts.responses, "logprobs": rollouts.logprobs}


def _rank_sample(preset, topk):
    return _sample(preset, topk, context_parallel(int(os.environ["WORLD_SIZE"])))


@pytest.mark.numerics
@pytest.mark.parametrize(
    "preset,topk,world",
    [("tiny-glm_moe_dsa", DROP_TOPK, 2), ("tiny-deepseek_v32", DROP_TOPK, 3), ("tiny-deepseek_v3", None, 3)],
    ids=lambda c: str(c),
)
def test_sampling_from_sharded_mla_pages_equals_the_single_process(preset, topk, world):
    """Each decoding step selects over every rank's index keys and the sequences' own (the last rank's
    proposal) and attends across the ranks: the same tokens and log-probs as one process."""
    ranks = run_ranks(_rank_sample, world, preset, topk, start_method="fork")
    single = _sample(preset, topk)
    assert len({tuple(r.tolist()) for r in single["responses"]}) > 1  # distinct sequences
    for r in ranks:
        assert [t.tolist() for t in r["responses"]] == [t.tolist() for t in single["responses"]]
        for mine, expected in zip(r["logprobs"], single["logprobs"]):
            # float32 log-probs of float64 logits that agree to ~EPS64: the same float32 values, but where one
            # lies at a rounding boundary (float32 tolerance of a log-prob)
            tol = logprob_tolerance(256, float(expected.abs().max()))
            within(max_abs(mine, expected), tol, "log-probs")


def _rank_host_pages():
    model = _model("tiny-glm_moe_dsa", DROP_TOPK)
    with pytest.raises(ValueError) as error:
        capture(model, PROMPT, cp=context_parallel(int(os.environ["WORLD_SIZE"])), host_pages=True)
    return str(error.value)


def test_host_pages_under_cp_are_refused():
    assert (
        "host_pages=True is not implemented for a context-parallel capture"
        in run_ranks(_rank_host_pages, 2, start_method="fork")[0]
    )
