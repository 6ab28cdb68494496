"""Bad input raises a clear error naming the problem."""

import pytest
import torch
import transformers

from longstraw import capture, replay
from longstraw.kinds import resolve_point
from longstraw.models import build_model


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-qwen3", seed=0)


@pytest.fixture(scope="module")
def state(model):
    return capture(model, torch.arange(10))


def test_unsupported_model_type():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="unsupported model type 'gpt2'"):
        capture(gpt2, torch.arange(4))


def test_empty_prompt(model):
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        capture(model, torch.tensor([], dtype=torch.long))


@pytest.mark.parametrize("bad", [[1, 2, 256], [-1, 3]])
def test_out_of_vocabulary_ids(model, state, bad):
    with pytest.raises(ValueError, match=r"prompt_ids has ids outside the vocabulary \[0, 256\)"):
        capture(model, torch.tensor(bad))
    with pytest.raises(ValueError, match="response_ids has ids outside the vocabulary"):
        replay(model, state, torch.tensor(bad))


def test_float_ids_are_a_type_error(model):
    with pytest.raises(TypeError, match="integer token ids"):
        capture(model, torch.ones(4))


def test_response_on_another_device(model, state):
    with pytest.raises(ValueError, match="response_ids is on meta but the model is on cpu"):
        replay(model, state, torch.zeros(3, dtype=torch.long, device="meta"))


def test_dtype_mismatch_between_state_and_model(state):
    double = build_model("tiny-qwen3", seed=0, dtype=torch.float64)
    with pytest.raises(TypeError, match="state pages are torch.float32 but the model computes in torch.float64"):
        replay(double, state, torch.tensor([1, 2]))


def test_state_from_another_family(state):
    with pytest.raises(ValueError, match="captured from a 'qwen3' model, not 'llama'"):
        replay(build_model("tiny-llama"), state, torch.tensor([1, 2]))


def test_backward_prefix_needs_an_exact_mode_capture(state):
    with pytest.raises(RuntimeError, match="prefix_grad=True"):
        state.backward_prefix()


def test_unknown_experiment_key_is_named():
    with pytest.raises(ValueError, match=r"exp.yaml: model.presett: unknown key"):
        resolve_point({"model": {"presett": "tiny-llama"}}, source="exp.yaml")


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="unknown model preset 'tiny-gpt5'"):
        build_model("tiny-gpt5")
