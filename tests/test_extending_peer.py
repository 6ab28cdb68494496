"""docs/extending.md's peer recipe, followed at test time: a toy peer (its step class below, its registration in a
fixture, removed afterwards) is a mode a point config and the plan accept, computes the group's GRPO loss and
gradient as an independent reference does (HF's padded forward over the whole group, TRL's loss written out in
tests/grpo_reference.py, autograd; both in float64), and the report names it by its label."""

import pytest
import torch
from float64_reference import float64_model, hf_float64
from grpo_reference import GradientRecorder, batch_loss
from tolerances import TOL64, above, relative, within

from longstraw.config import ConfigError
from longstraw.core import grpo
from longstraw.core.hf_reference import global_relative_error
from longstraw.kinds import resolve_point
from longstraw.peers import Peer, build_peer, register_peer, unregister_peer
from longstraw.peers.measured import measured_step
from longstraw.plotting.styles import MODE_COLORS

TOY = "full_forward"


class FullForwardPeer:
    """The toy peer's step (what its own file would hold): one HF forward over prompt + response per response,
    our objective (`longstraw.core.grpo`) on its log-probs, one backward per response."""

    def __init__(self, model, config, max_response_length):
        self.model, self.config = model, config

    def logprobs(self, prompt_ids, responses):
        out = []
        for response in responses:
            logits = self.model(input_ids=torch.cat([prompt_ids, response])[None]).logits[0]
            predicting = logits[prompt_ids.numel() - 1 : -1].log_softmax(-1)  # the positions that predict it
            out.append(predicting.gather(-1, response[:, None])[:, 0])
        return out

    def step(self, prompt_ids, responses, rewards, optimizer):
        def forward_backward(advantages, weights, ref):
            logps = self.logprobs(prompt_ids, responses)
            losses = [
                grpo.response_loss(lp, None, ref and ref[i], advantages[i], weights[i], self.config)
                for i, lp in enumerate(logps)
            ]
            for loss in losses:
                loss.backward()
            return sum(loss.detach() for loss in losses), {}

        score = lambda: self.logprobs(prompt_ids, responses)  # noqa: E731
        return measured_step(self.model, optimizer, TOY, responses, rewards, self.config, forward_backward, score)


@pytest.fixture
def toy_peer():
    peer = register_peer(
        Peer(
            name=TOY,
            step=f"{__name__}:FullForwardPeer",
            color="#937860",
            label="full forward (toy)",
            model_types=("llama",),
            why_not="the toy is tried on llama only",
            difference="The toy peer runs HF's forward over the prompt and each response in turn.",
        )
    )
    yield peer
    unregister_peer(TOY)


def test_a_registered_peer_is_a_mode_the_plan_accepts(toy_peer):
    from longstraw.harness.plan import NotApplicable, resolve

    raw = {"kind": "step", "mode": TOY, "model": {"preset": "tiny-llama"}, "prompt": {"length": 16}}
    assert resolve(raw, "toy.yaml").mode == TOY
    with pytest.raises(NotApplicable, match="does not apply to model type 'qwen3_5': the toy is tried on llama"):
        resolve({**raw, "model": {"preset": "tiny-qwen3_5"}}, "toy.yaml")
    capacity = {
        **raw,
        "kind": "capacity",
        "mode": "replay",
        "capacity": {"compare_modes": [TOY], "ceiling_bytes": 1 << 28, "max_length": 4096},
    }
    assert resolve(capacity, "toy.yaml").capacity.compare_modes == [TOY]


def test_an_unregistered_peer_is_no_mode():
    with pytest.raises(ConfigError, match=f"toy.yaml: mode: must be one of .*got '{TOY}'"):
        resolve_point({"mode": TOY}, "toy.yaml")
    assert TOY not in MODE_COLORS


def _group():
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (19,), generator=g)
    responses = [torch.randint(0, 256, (n,), generator=g) for n in (5, 8, 3)]  # unequal: padded in the reference
    return prompt, responses, torch.tensor([1.0, 0.0, 0.25])


def _reference(model, prompt, responses, rewards, config):
    """(loss, gradients) of HF's one forward over the G right-padded rows of prompt + response, TRL's loss."""
    width = max(r.numel() for r in responses)
    rows = torch.stack([torch.cat([prompt, torch.nn.functional.pad(r, (0, width - r.numel()))]) for r in responses])
    mask = torch.stack([torch.arange(width) < r.numel() for r in responses])
    attention = torch.cat([torch.ones(len(responses), prompt.numel(), dtype=torch.bool), mask], dim=1)
    logits = model(input_ids=rows, attention_mask=attention.long()).logits[:, prompt.numel() - 1 : -1]
    logps = logits.log_softmax(-1).gather(-1, rows[:, prompt.numel() :, None])[..., 0]
    # TRL's advantages: rewards less their mean, over the unbiased std + 1e-4; a step's advantages are float32
    advantages = ((rewards - rewards.mean()) / (rewards.std() + 1e-4)).float().double()
    loss = batch_loss([lp[: r.numel()] for lp, r in zip(logps, responses)], None, None, advantages, config)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.numerics
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_the_toy_peers_loss_and_gradient_equal_hf_full_forward(toy_peer, loss_type):
    config = grpo.GRPOConfig(num_generations=3, beta=0.0, loss_type=loss_type)
    prompt, responses, rewards = _group()
    model, reference = float64_model("tiny-llama", seed=2), float64_model("tiny-llama", seed=2)
    recorder = GradientRecorder(model)
    with hf_float64(model):
        metrics = build_peer(TOY, model, config).step(prompt, responses, rewards, recorder)
        expected_loss, expected = _reference(reference, prompt, responses, rewards.double(), config)
    assert metrics["mode"] == TOY and set(metrics["phases"]) == {"forward_backward", "optimizer_step"}
    assert set(recorder.grads) == set(expected)
    within(global_relative_error(recorder.grads, expected), TOL64, "relative gradient error")
    within(abs(metrics["loss"] - expected_loss), TOL64 * max(abs(expected_loss), 1e-2), "loss")  # on-policy: near 0
    # not trivially equal: the gradient of another group's rewards differs
    _, other = _reference(float64_model("tiny-llama", seed=2), prompt, responses, rewards.flip(0).double(), config)
    above(max(relative(recorder.grads[n], other[n]) for n in other), 1e-2, "another group's gradient")


def test_the_report_names_the_toy_peer_by_its_label(toy_peer):
    from longstraw.report import peers as section

    def row(system, step_bytes, seconds):
        return {
            **{"experiment": "peers", "point": f"toy_mode-{system}", "model": "tiny-llama", "system": system},
            **{"status": "ok", "prompt_length": 1024, "G": 8, "response_length": 64},
            **{"step_bytes": step_bytes, "step_seconds": seconds, "warm_step_seconds": None},
        }

    rows = [row("replay", 100, 2.0), row(TOY, 300, 1.0)]
    section._add_ratios(rows)
    said = section.sentences(rows, [], [])[TOY]
    assert said[0] == toy_peer.difference
    assert "full forward (toy)'s step memory is 3.00x replay's and its step time 0.50x" in said[1]
    assert MODE_COLORS[TOY] == "#937860"  # its lines and bars in every figure
