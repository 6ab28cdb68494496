"""The agent's task over RULER's real-text haystacks (`training/ruler/lookup.py`, task and environment
`ruler_lookup`): the environment against hand-computed episodes, the examples seeded, of exact length, holding the
needles but not the chain, and SmolLM2's own trajectories answered by the environment through its tokenizer."""

import re

import pytest
import torch

from longstraw import capture
from longstraw.models import load_pretrained
from longstraw.models.real import cached_checkpoint
from longstraw.training.agent_rollout import AgentConfig, sample_trajectories
from longstraw.training.environments import RulerLookupEnvironment, load_environment
from longstraw.training.example import TaskNotReady
from longstraw.training.rollout import SamplingConfig
from longstraw.training.ruler.formats import NEEDLE
from longstraw.training.ruler.lookup import make_lookup_example
from longstraw.training.tasks import build_task

INFO = {"chain": ["red-fox", "blue-owl", "tan-cat"], "references": ["1234567"], "turn_frame": ["<", ">"]}


@pytest.fixture(scope="module")
def smollm2():
    return cached_checkpoint("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2, local_files_only=True)


def test_the_environment_plays_hand_computed_episodes():
    env = RulerLookupEnvironment(turn_penalty=0.05)
    assert env.reset(INFO) == ""  # the prompt poses the task
    # two hops, then the answer: exact match less 3 turns of penalty
    assert env.step("lookup red-fox") == ("<blue-owl>", -0.05, False)
    assert env.step("I will Lookup: `blue-owl`.\n") == ("<tan-cat>", -0.05, False)
    assert env.step("`answer 1234567`") == ("", 1 - 0.05, True)
    env.reset(INFO)
    assert env.step("lookup tan-cat") == ("<tan-cat links to no key>", -0.05, False)  # the chain's end
    assert env.step("lookup grey-elk") == ("<grey-elk links to no key>", -0.05, False)  # off the chain
    assert env.step("The answer is 123456") == ("<reply `lookup KEY` or `answer NUMBER`>", -0.05, False)
    assert env.step("the number for tan-cat is 1234567.") == ("", 1 - 0.05, True)  # a 7-digit number answers
    env.reset(INFO)
    assert env.step("Answer: 7654321") == ("", -0.05, True)  # wrong: no match, the turn's penalty only
    env.reset(INFO)
    assert env.step("answer 12345678") == ("", -0.05, True)  # said as an answer: read whole, and wrong
    assert RulerLookupEnvironment().penalty == 0.02
    with pytest.raises(ValueError, match="no chain, references"):
        RulerLookupEnvironment().reset({"key": 1})
    with pytest.raises(ValueError, match="turn_penalty must be a number in"):
        load_environment("ruler_lookup", {"turn_penalty": 1.5})


def test_an_example_is_seeded_exact_and_holds_the_values_but_not_the_chain(tokenizer):
    a, b = (make_lookup_example(tokenizer, 700, 5, hops=3, distractors=2) for _ in range(2))
    assert a == b and make_lookup_example(tokenizer, 700, 6, hops=3, distractors=2).chain != a.chain
    longer = make_lookup_example(tokenizer, 1200, 5, hops=3, distractors=2)
    assert (longer.chain, longer.value) == (a.chain, a.value)  # one seed: the same needles at every length
    for ex, length in ((a, 700), (longer, 1200)):
        assert ex.length == length == len(tokenizer(ex.prompt)["input_ids"])
        assert len(ex.chain) == 4 and len(ex.depths) == 6
        needles = dict(re.findall(r"One of the special magic numbers for ([a-z-]+) is: (\d{7})\.", ex.prompt))
        assert len(needles) == 6 and len(set(needles.values())) == 6  # each chain key's and each distractor's
        assert needles[ex.chain[-1]] == ex.value and set(ex.chain) < set(needles)
        assert ex.prompt.count(NEEDLE.format(type_needle_v="numbers", key=ex.chain[-1], value=ex.value)) == 1
        # the question names the start and the hops; the links are nowhere: each later key only in its needle
        assert f"Start from the key {ex.chain[0]} and follow 3 links" in ex.prompt
        assert [ex.prompt.count(k) for k in ex.chain] == [2, 1, 1, 1]
        assert ex.prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_the_task_refuses_a_length_too_short_and_scores_one_reply(smollm2, tokenizer):
    spec = {"name": "ruler_lookup", "tokenizer": str(smollm2), "hops": 1}
    with pytest.raises(TaskNotReady, match="length: 200 tokens is too short"):
        build_task({**spec, "length": 200}, 49152).check_ready()
    with pytest.raises(ValueError, match="hops must be an integer >= 1, got 0"):
        build_task({**spec, "hops": 0, "length": 600}, 49152)
    task = build_task({**spec, "length": 600}, 49152)
    example = task.make(3)
    assert (
        example.prompt_ids.numel() == 600
        and example.info["chain"] == make_lookup_example(tokenizer, 600, 3, hops=1).chain
    )
    assert example.info["turn_frame"] == ["\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"]
    value = example.info["references"][0]
    reply = tokenizer(f"answer {value}<|im_end|>", add_special_tokens=False)["input_ids"]
    assert task.reward(example, reply) == 1.0 and task.reward(example, reply[:-3]) == 0.0


def test_smollm2s_trajectories_are_answered_by_the_environment_through_its_tokenizer(smollm2, tokenizer):
    """The real model's sampled actions (each ending at EOS) decoded, stepped through a fresh environment by hand,
    and its answers tokenized: the trajectory's observation tokens are those answers, turn after turn."""
    model = load_pretrained(smollm2, dtype=torch.float32)
    task = build_task({"name": "ruler_lookup", "tokenizer": str(smollm2), "length": 400, "hops": 2}, 49152)
    example = task.make(0)
    config = AgentConfig(
        SamplingConfig(num_generations=2, max_new_tokens=40, temperature=1.0, stop_ids=task.stop_ids, seed=2),
        max_turns=3,
        max_action_tokens=8,
    )
    state = capture(model, example.prompt_ids)
    make = load_environment("ruler_lookup")
    trajectories = sample_trajectories(model, state, make, example.info, config, tokenizer)
    assert any(t.turns > 1 for t in trajectories)
    for t in trajectories:
        env, tokens, mask, rewards = make(), t.tokens.tolist(), t.action_mask.tolist(), []
        env.reset(example.info)
        i = 0
        while i < len(tokens):
            j = next((k for k in range(i, len(tokens)) if not mask[k]), len(tokens))
            stopped = tokens[j - 1] in task.stop_ids
            if not stopped and j - i < config.max_action_tokens:  # cut short by the token budget: never stepped
                assert j == len(tokens)
                break
            observation, reward, done = env.step(tokenizer.decode(tokens[i : j - 1] if stopped else tokens[i:j]))
            rewards.append(reward)
            k = next((k for k in range(j, len(tokens)) if mask[k]), len(tokens))
            if k < len(tokens):
                assert tokens[j:k] == tokenizer(observation, add_special_tokens=False)["input_ids"]
                assert tokenizer.decode(tokens[j:k]).startswith("\n<|im_start|>user\n")
            i = k
        assert rewards == t.rewards and t.reward == pytest.approx(sum(rewards))
        assert all(r == pytest.approx(-0.02) for r in rewards[:-1])
    assert state.fingerprint() == capture(model, example.prompt_ids).fingerprint()  # the prompt's pages untouched
