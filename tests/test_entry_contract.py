"""The resident-entry contract (`longstraw.state.pages.ResidentEntry`): every family's entries implement all of
it, each method does what the code above the state relies on, and core, cp and training call the methods
instead of branching on an entry's type."""

import ast
from pathlib import Path

import pytest
import torch

from longstraw import capture
from longstraw.models import build_model
from longstraw.state import AttentionPages, LatentPages, RecurrentState
from longstraw.state.pages import DecodeClock, ResidentEntry, WindowKV

PACKAGE = Path(__file__).resolve().parents[1] / "longstraw"
CONTRACT = sorted(n for n in {*vars(ResidentEntry), *ResidentEntry.__annotations__} if not n.startswith("_"))
# one preset per family: dense attention, Gated DeltaNet + attention, MLA with DSA index layers, sliding-window +
# global attention (window 16: the 41-token prompt crosses two windows), the same with attention sinks and MoE (gpt-oss,
# window 8)
FAMILIES = ["tiny-llama", "tiny-qwen3_5", "tiny-glm_moe_dsa", "tiny-gemma3", "tiny-gpt-oss"]
CHUNK = 16
STATES = (RecurrentState, WindowKV)  # entries that pass a state on, not pages per prompt position


def _captured(preset, prefix_grad=False):
    model = build_model(preset, seed=0)
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (41,), generator=torch.Generator().manual_seed(0))
    return capture(model, prompt, prefix_grad=prefix_grad, chunk_size=CHUNK, order="chunk")


@pytest.fixture(scope="module", params=FAMILIES)
def state(request):
    return _captured(request.param)


class RecordingForms:
    """A stand-in for `longstraw.cp.capture.ShardForms`: which form each entry asks for."""

    def __init__(self):
        self.asked = []

    def pages(self, entry):
        self.asked.append("pages")
        return "pages-form"

    def latent(self, entry):
        self.asked.append("latent")
        return "latent-form"

    def recurrent(self, entry):
        self.asked.append("recurrent")
        return "recurrent-form"


def test_the_contract_names_what_the_code_above_calls():
    assert CONTRACT == [
        "chunk_checkpoint",
        "enable_prefix_grad",
        "for_decoding",
        "for_prefix_recompute",
        "for_shard",
        "gathered_through",
        "positional_gradients",
        "tensors",
        "with_room",
    ]


def test_every_entry_implements_the_whole_contract(state):
    for entry in state.layers:
        missing = [name for name in CONTRACT if not hasattr(entry, name)]
        assert not missing, f"{type(entry).__name__} lacks {missing}"


def test_each_entry_names_its_own_context_parallel_form_or_refuses_one(state):
    expected = {AttentionPages: "pages", LatentPages: "latent", RecurrentState: "recurrent"}
    for entry in state.layers:
        forms = RecordingForms()
        if isinstance(entry, WindowKV):  # no context-parallel form: refused, before any form is asked for
            with pytest.raises(ValueError, match="WindowKV .* has no context-parallel form"):
                entry.for_shard(forms)
        else:
            assert entry.for_shard(forms) == f"{expected[type(entry)]}-form"
        assert forms.asked == ([] if isinstance(entry, WindowKV) else [expected[type(entry)]])
        assert entry.positional_gradients is not isinstance(entry, STATES)


def test_decoding_reads_the_prompt_entry_in_place_and_repeats_a_recurrent_state(state):
    for entry in state.layers:
        decoding = entry.for_decoding(3, DecodeClock.allocate(4, 5, "cpu"))
        if isinstance(entry, RecurrentState):
            for ours, theirs in zip(decoding.tensors(), entry.tensors()):
                assert ours.shape[0] == 3 and all(torch.equal(row, theirs[0]) for row in ours)
        else:  # the prompt's pages shared by the 3 sequences, not copied
            assert decoding.shared is entry
            assert [t.data_ptr() for t in decoding.tensors()[: len(entry.tensors())]] == [
                t.data_ptr() for t in entry.tensors()
            ]


def test_a_chunk_checkpoint_is_a_copy_of_a_passed_on_state_and_nothing_for_pages(state):
    for entry in state.layers:
        saved = entry.chunk_checkpoint()
        if isinstance(entry, STATES):  # a window: the K/V it keeps (a full one here)
            assert [torch.equal(a, b) for a, b in zip(saved, entry.tensors())] == [True, True]
            assert all(a.data_ptr() != b.data_ptr() for a, b in zip(saved, entry.tensors()))
        else:
            assert saved is None


def test_one_shard_gathered_through_its_end_is_the_entry_itself(state):
    for entry in state.layers:
        gathered = entry.gathered_through(entry.length if hasattr(entry, "length") else 0, lambda *t: t)
        if isinstance(entry, STATES):
            assert gathered is entry
        else:
            assert gathered.length == entry.length
            kv = gathered.filled()[:1] if isinstance(entry, LatentPages) else gathered.filled()
            assert all(torch.equal(a, b) for a, b in zip(kv, entry.filled()))


def test_room_for_more_positions_copies_pages_and_keeps_a_passed_on_state(state):
    for entry in state.layers:
        roomy = entry.with_room(5)
        if isinstance(entry, STATES):  # constant size: the same entry, the same tensors
            assert roomy is entry
            continue
        assert roomy.length == entry.length and roomy.filled()[0].shape == entry.filled()[0].shape
        for grown, kept in zip(roomy.tensors(), entry.tensors()):
            axis = 1 if grown.dim() == 3 else 2  # MLA's index keys [1, P, I]; pages [B, K, P, D]
            assert grown.shape[axis] == kept.shape[axis] + 5 and grown.data_ptr() != kept.data_ptr()
            assert torch.equal(grown.narrow(axis, 0, entry.length), kept.narrow(axis, 0, entry.length))
        assert roomy.with_room(5).tensors()[0] is roomy.tensors()[0]  # room enough: no copy


@pytest.mark.parametrize("preset", FAMILIES)
def test_prefix_grad_leaves_and_recompute_entries_read_the_pages_before_the_chunk(preset):
    state = _captured(preset, prefix_grad=True)
    checkpoints = state.prefix_trace.checkpoints
    for i, entry in enumerate(state.layers):
        assert entry.leaves and all(leaf.requires_grad and leaf.grad_fn is None for leaf in entry.leaves)
        recompute = entry.for_prefix_recompute(CHUNK, checkpoints.get((i, CHUNK)))
        if isinstance(entry, RecurrentState):  # from the state the capture had at the chunk's start
            assert (i, CHUNK) in checkpoints
            assert all(torch.equal(a, b) for a, b in zip(recompute.inputs(), checkpoints[(i, CHUNK)]))
            assert recompute.keep_final
        elif isinstance(entry, WindowKV):  # the window kept at the chunk's start, as grad-tracking leaves
            window = checkpoints[(i, CHUNK)]
            assert window[0].shape[2] == entry.window - 1 < CHUNK  # the chunk before filled the window
            for leaf, kept in zip(recompute.filled(), window):
                assert leaf.requires_grad and leaf.grad_fn is None and torch.equal(leaf, kept)
        else:  # the pages before the chunk, as grad-tracking leaves
            prefix = recompute.filled()[:1] if isinstance(entry, LatentPages) else recompute.filled()
            full = entry.tensors()[:1] if isinstance(entry, LatentPages) else entry.tensors()
            for leaf, pages in zip(prefix, full):
                assert leaf.requires_grad and leaf.shape[2] == CHUNK and torch.equal(leaf, pages[:, :, :CHUNK])


def test_core_cp_and_training_never_branch_on_an_entry_type():
    names = {"AttentionPages", "LatentPages", "RecurrentState", "WindowKV", "WindowDecodeKV", "RecomputeWindow"}
    found = []
    for folder in ("core", "cp", "training"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "id", None) == "isinstance"
                    and len(node.args) == 2
                ):
                    named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                    if named & names:
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, "isinstance on a resident entry type: " + ", ".join(found)


def test_an_entry_without_a_part_of_the_contract_is_refused_before_any_work():
    """Exact mode and sampling name the entry type and the method it lacks, before touching any entry."""
    from types import SimpleNamespace

    from longstraw.core import exact
    from longstraw.training.rollout import _decode_entries

    class HalfDoneEntry:  # a new family's entry that implements only part of the contract
        def tensors(self):
            return []

    touched = RecurrentState(torch.zeros(1, 2, 3), torch.zeros(1, 1, 2, 2))
    state = SimpleNamespace(layers=[touched, HalfDoneEntry()], positions=4)
    with pytest.raises(ValueError, match=r"prefix_grad=True .*: HalfDoneEntry entries have no enable_prefix_grad\(\)"):
        exact.enable(state, None, torch.arange(5), 2, {})
    assert touched.leaves is None  # refused before any entry was enabled
    with pytest.raises(ValueError, match=r"sampling: HalfDoneEntry entries have no for_decoding\(\)"):
        _decode_entries(state, 2, DecodeClock.allocate(4, 3, "cpu"))
