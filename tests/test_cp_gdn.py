"""Context-parallel capture of Gated DeltaNet layers without a rank-to-rank chain (`longstraw.cp.gdn_shards`),
on gloo, against the single-process capture. In float64, HF's float32 casts and the GDN states included
(float64_reference): the shards compose the state entering each from transitions where one process carries it
chunk by chunk, the same algebra in another order (in float32 the states measured 1e-7 apart, the gradients
2.4e-7, within a fixed 1e-5 here but not by a margin that holds on every kernel path). float32's own accuracy
of a composed transition is tests/test_gdn_scan.py's.

Ranks are forked from the test process (`run_ranks(..., start_method="fork")`), as in tests/test_cp.py.
"""

import os

import pytest
import torch
from float64_reference import float64_gdn_states, float64_model, hf_float64
from tolerances import TOL64, logprob_tolerance, max_abs, within

from longstraw import capture, replay
from longstraw.core.hf_reference import global_relative_error, max_relative_error
from longstraw.cp import context_parallel, shard_bounds
from longstraw.cp.group import CPGroup
from longstraw.cp.launch import run_ranks

CHUNK = 4  # several capture chunks per shard
# (preset, world, prompt tokens): 23 positions are divisible by neither 2 nor 3; 5 positions over 3 ranks
# are shards of 2, 2 and 1, shorter than the conv's K-1 = 3 (the ranks all-gather their conv tails)
CASES = [("tiny-qwen3_5", 2, 24), ("tiny-qwen3_5", 3, 24), ("tiny-qwen3_5", 3, 6), ("tiny-qwen3_next", 2, 24)]
COLLECTIVES = ("send", "recv_", "shift_", "all_gather", "broadcast_", "all_reduce_")


def _ids(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


RESPONSE = _ids(7, 1)


def _rel(actual, expected):
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30))


def _capture_replay(preset, prompt_len, cp=None):
    model = float64_model(preset, seed=1)
    with hf_float64(model), float64_gdn_states():
        state = capture(model, _ids(prompt_len, 0), chunk_size=CHUNK, cp=cp)
        logp = replay(model, state, RESPONSE)
        logp.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {
        "layers": [[t.clone() for t in e.tensors()] for e in state.layers],
        "kinds": [type(e).__name__ for e in state.layers],
        "logp": logp.detach(),
        "grads": grads,
        "shard": getattr(state, "shard", None),
    }


def _rank_capture_replay(preset, prompt_len):
    """One rank's capture and replay, with the state each GDN layer entered this shard with and the
    collectives each GDN layer's entry made."""
    import longstraw.cp.capture as cp_capture

    cp = context_parallel(int(os.environ["WORLD_SIZE"]))
    log, entered, real_enter = [], [], cp_capture.enter_gdn_layer
    for name in COLLECTIVES:  # on this instance only
        method = getattr(CPGroup, name)
        setattr(cp, name, lambda *a, _m=method, _n=name, **k: (log.append(_n), _m(cp, *a, **k))[1])

    def enter(*args):
        del log[:]
        real_enter(*args)
        entered.append(([t.clone() for t in args[3].tensors()], list(log)))

    cp_capture.enter_gdn_layer = enter
    try:
        result = _capture_replay(preset, prompt_len, cp)
    finally:
        cp_capture.enter_gdn_layer = real_enter
    result["entered"] = entered
    return result


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-w{c[1]}-p{c[2]}")
def sharded(request):
    preset, world, prompt_len = request.param
    ranks = run_ranks(_rank_capture_replay, world, preset, prompt_len, start_method="fork")
    single = _capture_replay(preset, prompt_len)
    starts = {s for s, _ in shard_bounds(prompt_len - 1, world)[1:]}
    # the single-process GDN states at each shard's start: captures of the prompt up to it
    prefixes = {}
    for s in starts:
        layers = _capture_replay(preset, s + 1)["layers"]
        prefixes[s] = [e for e, kind in zip(layers, single["kinds"]) if kind == "RecurrentState"]
    return world, prompt_len, ranks, single, prefixes


@pytest.mark.numerics
def test_each_shard_enters_every_gdn_layer_with_the_single_process_state(sharded):
    world, prompt_len, ranks, single, prefixes = sharded
    short = min(e - s for s, e in shard_bounds(prompt_len - 1, world)) < 3
    for r in ranks:
        start = r["shard"][0]
        assert len(r["entered"]) == single["kinds"].count("RecurrentState")
        for i, ((conv, recurrent), calls) in enumerate(r["entered"]):
            # one exchange of conv tails (an all-gather for shards shorter than K-1), one all-gather of the
            # transitions: no rank waits on the previous rank's GDN
            assert calls == (["all_gather", "all_gather"] if short else ["shift_", "all_gather"])
            if start == 0:
                assert not conv.any() and not recurrent.any()
                continue
            expected_conv, expected_recurrent = prefixes[start][i]
            within(_rel(conv, expected_conv), TOL64, f"conv state entering {start}, layer {i}")
            within(_rel(recurrent, expected_recurrent), TOL64, f"recurrent state entering {start}, layer {i}")


@pytest.mark.numerics
def test_sharded_capture_and_replay_equal_single_process(sharded):
    world, prompt_len, ranks, single, _ = sharded
    worst = {"gdn": 0.0, "pages": 0.0}
    for r in ranks:
        start, end = r["shard"]
        for kind, mine, full in zip(r["kinds"], r["layers"], single["layers"]):
            # GDN: every rank holds the single-process state at the prompt's end; attention: its shard's pages
            expected = [t[:, :, start:end] for t in full] if kind == "ShardPages" else full
            key = "gdn" if kind == "RecurrentState" else "pages"
            for a, e in zip(mine, expected):
                error = _rel(a, e)
                within(error, TOL64, kind)
                worst[key] = max(worst[key], error)
        # float32 log-probs (the log-softmax stays float32) of logits that agree to ~EPS64
        tol = logprob_tolerance(256, float(single["logp"].abs().max()))
        within(max_abs(r["logp"], single["logp"]), tol, "log-probs")
        within(global_relative_error(r["grads"], single["grads"]), TOL64, "relative gradient error")
        within(max_relative_error(r["grads"], single["grads"]), TOL64, "max relative gradient error")
    print(
        f"max relative error: GDN states {worst['gdn']:.1e}, pages {worst['pages']:.1e}, log-probs "
        f"{max(_rel(r['logp'], single['logp']) for r in ranks):.1e}"
    )
