"""A history that grows: `extend` continues a resident state with more prompt tokens, held to one capture of the
whole history and to HF's own forward and autograd over it, in float64 (dense, hybrid and sliding-window
families); and what cannot be extended is refused before any work."""

from dataclasses import fields

import pytest
import torch
from float64_reference import float64_gdn_states, float64_model, has_gdn, hf_float64
from state_asserts import assert_same_state
from tolerances import TOL64, float64_residue_tolerance, logprob_tolerance, max_abs, within

from longstraw import capture, extend, replay
from longstraw.core.hf_reference import grads_of, hf_conditional_logprobs, hf_full_logprobs, max_relative_error
from longstraw.cp.shards import ShardedResidentState
from longstraw.families import adapter_for
from longstraw.models import build_model
from longstraw.state import ResidentState, prompt_digest

PRESETS = ["tiny-llama", "tiny-qwen3_5", "tiny-gemma3"]  # dense, hybrid (GDN), sliding window (16) + global
# the history grows twice, by pieces that start and end inside 8-position capture chunks: 14 -> 31 -> 45 tokens
CUTS = (14, 31, 45)


def _ids(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _grown(model, ids, cuts=CUTS, chunk=8):
    """A capture of ids[:cuts[0]] extended by each next piece in turn."""
    state = capture(model, ids[: cuts[0]], chunk_size=chunk)
    for a, b in zip(cuts, cuts[1:]):
        assert extend(model, state, ids[a:b], chunk_size=chunk) is state
    return state


@pytest.mark.numerics
@pytest.mark.parametrize("preset", PRESETS)
def test_an_extended_state_is_one_capture_of_the_whole_history(preset):
    # float64 (float64_reference): the extension's chunks are not the one capture's (reordering only, ~1e-14)
    model = float64_model(preset, seed=1)
    ids, response = _ids(CUTS[-1], 0), _ids(7, 1)
    weights = torch.linspace(-1.0, 2.0, 7, dtype=torch.float64)  # every token's gradient matters
    with hf_float64(model), float64_gdn_states():  # the GDN states too: else rounded to float32 after each chunk
        grown, whole = _grown(model, ids), capture(model, ids, chunk_size=8)
        assert (grown.positions, grown.last_token, grown.prompt) == (CUTS[-1] - 1, int(ids[-1]), prompt_digest(ids))
        assert_same_state(grown, whole, rtol=TOL64)
        before = grown.fingerprint()
        logps = replay(model, grown, response)
        ours = grads_of(model, (logps * weights).sum())
        assert grown.fingerprint() == before
        one_capture = grads_of(model, (replay(model, whole, response) * weights).sum())
        hf = grads_of(model, (hf_conditional_logprobs(model, ids, response) * weights).sum())
        with torch.no_grad():
            expected = hf_full_logprobs(model, ids, response)
            once = replay(model, whole, response)
    within(max_abs(logps, once), TOL64, "log-probs against one capture")
    tol = logprob_tolerance(model.config.vocab_size, float(expected.abs().max()))
    within(max_abs(logps, expected), tol, "log-probs against HF's one pass over the whole history")
    within(max_relative_error(ours, one_capture), TOL64, "gradient against one capture")
    within(max_relative_error(ours, hf), float64_residue_tolerance(has_gdn(model)), "gradient against HF's")


def test_aligned_chunks_give_the_one_captures_state_bit_for_bit_in_every_family():
    # the extension runs the very chunks of the one capture when its start is a chunk boundary (16 = 2 x 8), so in
    # float32 each family's state (MLA's latent and index-key pages included) is the one capture's, bit for bit
    for preset in [*PRESETS, "tiny-glm_moe_dsa"]:
        model = build_model(preset, seed=1)
        vocab = model.get_input_embeddings().weight.shape[0]
        ids = torch.randint(0, vocab, (50,), generator=torch.Generator().manual_seed(2))
        grown, whole = _grown(model, ids, cuts=(17, 50)), capture(model, ids, chunk_size=8)
        for a, b in zip(grown.layers, whole.layers, strict=True):
            assert [t.shape for t in a.tensors()] == [t.shape for t in b.tensors()]
            assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors())), preset
        assert grown.nbytes == whole.nbytes == grown.predicted_nbytes


def _refused(model, state, new_ids, match):
    """`extend` refuses, and the state is as it was (its pages, their storage, its positions)."""
    before = (state.fingerprint(), [t.data_ptr() for e in state.layers for t in e.tensors()], state.positions)
    with pytest.raises(ValueError, match=match):
        extend(model, state, new_ids)
    assert (state.fingerprint(), [t.data_ptr() for e in state.layers for t in e.tensors()], state.positions) == before


def test_what_cannot_be_extended_is_refused_before_any_work():
    model = build_model("tiny-llama", seed=1, max_position_embeddings=24)
    ids = _ids(20, 3)
    state = capture(model, ids)
    _refused(model, capture(model, ids, prefix_grad=True), ids[:2], "extend: cannot grow an exact-mode state")
    sharded = ShardedResidentState(**{f.name: getattr(state, f.name) for f in fields(ResidentState)})
    _refused(model, sharded, ids[:2], "extend: cannot grow a context-parallel state")
    _refused(model, state, ids[:5], r"20 tokens and 5 more passes the model's max_position_embeddings \(24\)")
    _refused(model, state, torch.tensor([3, 256]), "new_ids has ids outside the vocabulary")
    _refused(model, state, ids[:0], "new_ids is empty")
    _refused(build_model("tiny-llama", seed=2), state, ids[:2], "does not belong to the model")
    assert extend(model, state, ids[:4]).positions == 23  # 24 tokens: the limit itself
    unlimited = capture(model, ids, beyond_max_positions=True)
    assert extend(model, unlimited, ids).positions == 39


def test_an_extension_that_fails_midway_leaves_the_state_refused(monkeypatch):
    model = build_model("tiny-qwen3_5", seed=1)
    ids = _ids(30, 4)
    state = capture(model, ids[:10])
    adapter = adapter_for(model)

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(type(adapter), "layer_state_forward", fail)  # the last layer of the second chunk's
    with pytest.raises(RuntimeError, match="out of memory"):
        extend(model, state, ids[10:], chunk_size=8)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"unusable: an extension failed midway \(RuntimeError: out of memory\)"):
        replay(model, state, ids[:3])
    with pytest.raises(ValueError, match="unusable"):
        extend(model, state, ids[:3])
