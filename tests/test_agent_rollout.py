"""Multi-turn rollouts from the resident state against HF's own forward on the full growing sequence (prompt,
actions, observations), a trajectory replayed as one member with the loss on its actions only against HF's
autograd and TRL's masked loss, the prompt's state unchanged, and bad settings refused."""

import pytest
import torch
from float64_reference import float64_gdn_states, float64_model, has_gdn, hf_float64
from grpo_reference import GradientRecorder, batch_loss
from tolerances import float64_residue_tolerance, logprob_tolerance, max_abs, within

from longstraw import capture
from longstraw.core import grpo
from longstraw.core.hf_reference import hf_conditional_logprobs, hf_full_logprobs, max_relative_error
from longstraw.core.step import StepOptions, grpo_step
from longstraw.models import build_model
from longstraw.training.agent_rollout import AgentConfig, sample_trajectories
from longstraw.training.environments import LookupEnvironment, load_environment
from longstraw.training.rollout import SamplingConfig

STOP = tuple(range(3, 256, 9))  # ~11% of the vocabulary: actions end at different lengths
PRESETS = ["tiny-llama", "tiny-qwen3_5", "tiny-gemma3"]  # dense, hybrid (GDN), sliding window


class ByteTokenizer:
    """Text as its latin-1 bytes: the tiny presets' 256 ids."""

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("latin-1"))

    def decode(self, ids):
        return bytes(ids).decode("latin-1")


class EchoEnvironment:
    """Token ids in and out: observes 1 then the action reversed; done when the action's first id is even, the
    reward the action's length."""

    text = False

    def reset(self, example):
        return [7, 8]

    def step(self, action):
        return [1] + action[::-1], float(len(action)), bool(action) and action[0] % 2 == 0


def _prompt(n=60, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _hf_greedy_trajectory(model, prompt, env, example, config: AgentConfig, tokenizer):
    """The contract written out on HF's forward: the full sequence so far through the model for every action
    token (argmax), the environment's observations appended, until done or a budget."""
    pending, tokens, mask, action, turns = tokenizer.encode(env.reset(example)), [], [], [], 0
    while len(tokens) < config.sampling.max_new_tokens:
        if pending:
            tokens.append(pending.pop(0))
            mask.append(False)
            continue
        logits = model(input_ids=torch.cat([prompt, torch.tensor(tokens, dtype=torch.long)])[None]).logits[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
        mask.append(True)
        action.append(token)
        if token in STOP or len(action) == config.max_action_tokens:
            observation, _, done = env.step(tokenizer.decode(action[:-1] if token in STOP else action))
            turns, action = turns + 1, []
            if done or turns == config.max_turns:
                break
            pending = tokenizer.encode(observation)
    end = max(i for i, m in enumerate(mask) if m) + 1
    return tokens[:end], mask[:end], turns


@pytest.mark.numerics
@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_trajectories_equal_hf_forward_turn_by_turn(preset):
    # float64 (float64_reference): the argmax of logits that agree to ~EPS64 cannot flip, as in test_rollout
    model = float64_model(preset, seed=1)
    prompt = _prompt()
    config = AgentConfig(
        SamplingConfig(num_generations=2, max_new_tokens=40, temperature=0.0, stop_ids=STOP),
        max_turns=3,
        max_action_tokens=6,
    )
    make = load_environment("lookup", {"seed": 2})
    with hf_float64(model), float64_gdn_states(), torch.no_grad():
        state = capture(model, prompt, chunk_size=16)
        before = state.fingerprint()
        trajectories = sample_trajectories(model, state, make, {"start": "k3"}, config, ByteTokenizer())
        tokens, mask, turns = _hf_greedy_trajectory(model, prompt, make(), {"start": "k3"}, config, ByteTokenizer())
    assert state.fingerprint() == before
    assert turns > 1 and not all(mask)  # more than one turn, observations in between
    for t in trajectories:
        assert t.tokens.tolist() == tokens
        assert t.action_mask.tolist() == mask
        assert t.turns == turns and len(t.rewards) == turns


@pytest.mark.numerics
@pytest.mark.parametrize("preset", PRESETS)
def test_sampled_trajectories_replay_as_members_with_the_loss_on_actions(preset):
    # float64 as above; the rows end at different steps (done on an even first id), so each row's own pages hold
    # its trajectory while the others go on. Log-probs: the sampler's against HF's one pass over prompt +
    # trajectory; the step's gradient with loss_masks against TRL's masked loss on HF's conditional forward
    model = float64_model(preset, seed=1)
    prompt = _prompt(seed=4)
    config = AgentConfig(
        SamplingConfig(num_generations=4, max_new_tokens=30, temperature=1.0, stop_ids=STOP, seed=5),
        max_turns=4,
        max_action_tokens=5,
    )
    grpo_config = grpo.GRPOConfig(num_generations=4, beta=0.0, loss_type="grpo")
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    recorder = GradientRecorder(model)
    with hf_float64(model), float64_gdn_states():
        state = capture(model, prompt, chunk_size=16)
        before = state.fingerprint()
        trajectories = sample_trajectories(model, state, EchoEnvironment, None, config)
        assert state.fingerprint() == before
        with torch.no_grad():
            expected_logps = [hf_full_logprobs(model, prompt, t.tokens) for t in trajectories]
        responses, masks = [t.tokens for t in trajectories], [t.action_mask for t in trajectories]
        grpo_step(
            model, prompt, responses, rewards, recorder, grpo_config, StepOptions(), state=state, loss_masks=masks
        )
        logps = [hf_conditional_logprobs(model, prompt, y) for y in responses]
        advantages = grpo.group_advantages(rewards)
        model.zero_grad()
        batch_loss(logps, None, None, advantages, grpo_config, tool_masks=masks).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len({t.tokens.numel() for t in trajectories}) > 1 and any(t.done for t in trajectories)
    for t, want in zip(trajectories, expected_logps):
        _assert_echoes(t)
        tol = logprob_tolerance(model.config.vocab_size, float(want.abs().max()))
        within(max_abs(t.logprobs, want), tol, "trajectory log-probs against HF's one pass")
    within(max_relative_error(recorder.grads, expected), float64_residue_tolerance(has_gdn(model)), "gradient")


def _assert_echoes(t):
    """The trajectory follows EchoEnvironment: its first observation, then actions each echoed reversed."""
    tokens, mask = t.tokens.tolist(), t.action_mask.tolist()
    assert tokens[:2] == [7, 8] and mask[:2] == [False, False]
    segments, start = [], 2
    for i in range(3, len(tokens) + 1):
        if i == len(tokens) or mask[i] != mask[start]:
            segments.append((mask[start], tokens[start:i]))
            start = i
    actions = [s for is_action, s in segments if is_action]
    observations = [s for is_action, s in segments if not is_action]
    assert segments[0][0] and segments[-1][0] and len(actions) == len(observations) + 1
    for action, observation in zip(actions, observations):
        assert observation == [1] + (action[:-1] if action[-1] in STOP else action)[::-1]
    assert t.rewards[: len(observations)] == [float(len(o) - 1) for o in observations]


def test_lookup_environment_answers_from_its_table():
    env = LookupEnvironment(keys=8, hops=2, seed=0)
    assert env.reset({"start": "k0"}) == "start k0\n"
    first, reward, done = env.step("lookup k0")
    second, _, _ = env.step(f"lookup {first.strip()}")
    assert (reward, done) == (0.0, False) and first.endswith("\n")
    assert env.step("dance") == ("unknown\n", 0.0, False)
    assert env.step(f"answer {second.strip()}") == ("", 1.0, True)
    env.reset({"start": "k0"})
    assert env.step("answer k0")[1:] == (float(second.strip() == "k0"), True)
    # a permutation: every key is some key's next hop; the same seed, the same table
    assert sorted(env.step(f"lookup k{i}")[0].strip() for i in range(8)) == [f"k{i}" for i in range(8)]
    assert LookupEnvironment(keys=8, seed=0).table == env.table


def test_bad_agent_settings_are_refused():
    with pytest.raises(ValueError, match="max_turns"):
        AgentConfig(SamplingConfig(), max_turns=0)
    with pytest.raises(ValueError, match="max_action_tokens 40 exceeds"):
        AgentConfig(SamplingConfig(max_new_tokens=32), max_action_tokens=40)
    with pytest.raises(ValueError, match="keys must be an integer >= 2"):
        load_environment("lookup", {"keys": 1})
    with pytest.raises(ValueError, match="cannot build it"):
        load_environment("lookup", {"colour": 1})
    with pytest.raises(ValueError, match="environment 'nowhere': expected"):
        load_environment("nowhere")
    with pytest.raises(ValueError, match="needs reset"):
        load_environment("test_agent_rollout:ByteTokenizer")
    model = build_model("tiny-llama", seed=1)
    state = capture(model, _prompt(20))
    config = AgentConfig(SamplingConfig(num_generations=2, max_new_tokens=8), max_action_tokens=4)
    with pytest.raises(ValueError, match="speaks text: sample_trajectories needs a tokenizer"):
        sample_trajectories(model, state, LookupEnvironment, None, config)
    with pytest.raises(ValueError, match="no room for an action"):
        sample_trajectories(model, state, LookupEnvironment, {"start": "k1"}, config, ByteTokenizer())

    class BadReward(EchoEnvironment):
        def step(self, action):
            return [1], float("nan"), False

    with pytest.raises(ValueError, match="reward must be a finite number"):
        sample_trajectories(model, state, BadReward, None, config)

    class OutOfVocabulary(EchoEnvironment):
        def reset(self, example):
            return [300]

    with pytest.raises(ValueError, match="outside the vocabulary"):
        sample_trajectories(model, state, OutOfVocabulary, None, config)
    prompt = _prompt(20)
    with pytest.raises(ValueError, match="loss_masks: one bool tensor per response"):
        grpo_step(
            model,
            prompt,
            [prompt[:3], prompt[:2]],
            [1.0, 0.0],
            GradientRecorder(model),
            grpo.GRPOConfig(num_generations=2, beta=0.0),
            loss_masks=[torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool)],
        )
