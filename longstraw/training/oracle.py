"""The fresh-prefix staleness oracle: how far a reused (stale) prompt state drifts from a fresh one.

    result = staleness_oracle(model, prompt_ids, optimizer, grpo_config, steps=8,
                              max_new_tokens=32, seed=0, reward=task_reward, floor_perturbation=1e-7)
    result.rows, result.floor

Step 0 captures the prompt. At every step 0..steps the policy samples G responses from the
stale state, and on those same responses the oracle compares the stale state with a fresh
capture made with the current parameters:
- `relative_loss_drift`: |L_stale - L_fresh| / L_fresh for the language-model loss L, the mean
  negative log-prob of the response tokens. (The GRPO surrogate itself is ~0 at the on-policy
  point, since group advantages sum to zero, so its relative drift is ill-conditioned; its
  stale and fresh values are recorded as `grpo_loss_stale` / `grpo_loss_fresh`, computed with the
  same rewards, old log-probs, and reference log-probs from the reference's own capture);
- `mean_abs_logprob_diff`: mean over response tokens of |log p_stale - log p_fresh|;
- `kl_k3`: mean over tokens of exp(d) - d - 1 with d = log p_fresh - log p_stale, the k3 sample
  estimate of KL(stale || fresh) on tokens sampled from the stale policy;
- `grad_cosine`: cosine between the trainable-parameter gradients of L_stale and L_fresh;
- `param_drift`: L2 norm of the trainable parameters' change since the capture (the trainer's
  adaptive refresh signal), so the report can relate the signal to the drift it stands for;
- `update_changed_fraction`: the share of trainable elements the step's own update changed (in bf16
  an update below half a weight's spacing rounds away; `longstraw.training.optimizer` keeps float32
  masters for that).
Training then steps on the stale gradient, as a trainer reusing the prefix would. Step 0's
fresh state is captured with the stale one's parameters: its drift is the recapture's own
(exactly zero where the kernels are deterministic).

The numerical floor (`numerical_floor`, at step 0): a fresh capture after a random parameter
perturbation far below one step's, compared with the stale state in the same precision. In bf16 a
tiny change of the weights re-rounds activations over the whole prompt, so the log-probs move by
that much whatever the update; only drift beyond the floor is staleness (`refresh_interval`).

Rewards: the task's (`reward`), on a model that can do the task; or seeded uniform draws, which
give every step a non-zero advantage on a random model (where a task reward is mostly all-zero and
would stop the updates). Cost per step: one extra capture (the fresh state lives beside the stale
one) and two gradient passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw.core import grpo
from longstraw.core.step import reference_policy
from longstraw.core.transaction import capture, replay, reuse_state, score
from longstraw.training.rollout import SamplingConfig, sample


def parameter_drift(params, at_capture) -> float:
    """L2 norm of the parameters' change since `at_capture` (the adaptive refresh signal)."""
    return float(torch.stack([(p.detach() - p0).float().norm() for p, p0 in zip(params, at_capture)]).norm())


def changed_fraction(params, before) -> float:
    """The share of the parameters' elements that differ from `before` (an update that rounded away: 0)."""
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(params, before))
    return changed / max(1, sum(p.numel() for p in params))


def _loss_and_grads(model, state, responses, old, ref, advantages, weights, config, params):
    """GRPO loss over the group replayed on `state`: (loss, flat gradient, response log-probs)."""
    total, logps = 0.0, []
    for i, y in enumerate(responses):
        logp = replay(model, state, y)
        loss = grpo.response_loss(logp, old[i], ref and ref[i], advantages[i], weights[i], config)
        loss.backward()
        total += float(loss.detach())
        logps.append(logp.detach())
    grads = torch.cat(
        [p.grad.detach().flatten().float() if p.grad is not None else torch.zeros(p.numel()) for p in params]
    )
    return total, grads, torch.cat(logps)


def _drift(logp_stale, logp_fresh) -> dict:
    """How far the stale state's log-probs are from the fresh one's, on the same tokens."""
    d = logp_fresh - logp_stale
    nll_stale, nll_fresh = float(-logp_stale.mean()), float(-logp_fresh.mean())
    return {
        "loss_stale": nll_stale,
        "loss_fresh": nll_fresh,
        "relative_loss_drift": abs(nll_stale - nll_fresh) / abs(nll_fresh),
        "mean_abs_logprob_diff": float(d.abs().mean()),
        "kl_k3": float((d.exp() - d - 1).mean()),
    }


def numerical_floor(
    model, prompt_ids, stale, responses, params, perturbation: float, seed: int, capture_kwargs: dict
) -> dict:
    """The drift a fresh capture shows when the parameters have not really moved: the trainable
    parameters get a random perturbation of L2 norm `perturbation` (far below one optimizer step's),
    the prompt is captured again, and its log-probs on `responses` are compared with `stale`'s; then
    the parameters are restored exactly. Drift under this floor is the precision's, not staleness.
    `changed_fraction`: the share of trainable elements the perturbation changed (0: it rounded away)."""
    saved = [p.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(seed)
    noise = [torch.randn(p.shape, generator=generator, dtype=torch.float32) for p in params]
    total = float(torch.stack([n.norm() for n in noise]).norm())
    with torch.no_grad():
        for p, n in zip(params, noise):
            p.add_((n * (perturbation / total)).to(device=p.device, dtype=p.dtype))
        # in bf16 a perturbation under half a weight's spacing rounds away: then nothing moved, and the floor
        # is the recapture's determinism alone (say so, rather than read it as the precision's sensitivity)
        changed = changed_fraction(params, saved)
        fresh = capture(model, prompt_ids, **capture_kwargs)
        logp_fresh = torch.cat([score(model, fresh, y) for y in responses])
        logp_stale = torch.cat([score(model, reuse_state(model, stale), y) for y in responses])  # stale on purpose
        for p, s in zip(params, saved):
            p.copy_(s)
        reuse_state(model, stale)  # back at the weights it serves
    return {"perturbation_norm": perturbation, "changed_fraction": changed, **_drift(logp_stale, logp_fresh)}


def _reference_capture(model, prompt_ids, config: grpo.GRPOConfig, capture_kwargs: dict):
    """The prompt captured by the reference policy (the adapter disabled) when the objective has a KL term."""
    if config.beta <= 0:
        return None
    with reference_policy(model):
        return capture(model, prompt_ids, **capture_kwargs)


def _group_rewards(reward, responses, seed: int, step: int) -> torch.Tensor:
    """The group's rewards: `reward(responses)`, else uniform at random, seeded by the step."""
    if reward is not None:
        return torch.tensor(reward(responses), dtype=torch.float32)
    return torch.rand(len(responses), generator=torch.Generator().manual_seed(seed * 7919 + step))


def _group(model, rollouts, rewards, ref_state, config: grpo.GRPOConfig, params) -> tuple:
    """What `_loss_and_grads` takes of a group: (responses, old log-probs, reference log-probs, advantages,
    token weights, config, params); the old log-probs are the sampler's."""
    responses = rollouts.responses
    advantages = grpo.group_advantages(rewards, config.scale_rewards, num_generations=len(responses))
    weights = grpo.token_weights([int(r.numel()) for r in responses], config)
    ref = None
    if ref_state is not None:
        with reference_policy(model):
            ref = [score(model, ref_state, y) for y in responses]
    return responses, rollouts.logprobs, ref, advantages, weights, config, params


def _stale_against_fresh(model, prompt_ids, stale, group: tuple, capture_kwargs: dict, optimizer) -> dict:
    """The group's loss, log-probs and gradient on a fresh capture and on the stale state, compared; the stale
    state's gradient is left in place for the update."""
    fresh = capture(model, prompt_ids, **capture_kwargs)
    loss_fresh, grad_fresh, logp_fresh = _loss_and_grads(model, fresh, *group)
    optimizer.zero_grad(set_to_none=True)
    del fresh
    loss_stale, grad_stale, logp_stale = _loss_and_grads(model, stale, *group)
    return {
        **_drift(logp_stale, logp_fresh),
        "grpo_loss_stale": loss_stale,
        "grpo_loss_fresh": loss_fresh,
        "grad_cosine": float(torch.nn.functional.cosine_similarity(grad_stale, grad_fresh, dim=0)),
        "grad_norm_stale": float(grad_stale.norm()),
    }


def _stale_update(optimizer, params) -> float:
    """The optimizer step on the stale gradient, as prefix reuse trains; the fraction of parameters it changed."""
    before = [p.detach().clone() for p in params]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return changed_fraction(params, before)


def step_sampling(num_generations: int, max_new_tokens: int, seed: int, step: int) -> SamplingConfig:
    """How the oracle samples its group of G = `num_generations` at `step` (a prompt search draws step 0's group
    the same way)."""
    return SamplingConfig(num_generations=num_generations, max_new_tokens=max_new_tokens, seed=seed * 1_000_003 + step)


@dataclass
class OracleResult:
    rows: list  # one per step 0..steps: the stale state's drift against a fresh capture
    floor: dict  # `numerical_floor` at step 0 (empty when not measured)


def staleness_oracle(
    model,
    prompt_ids,
    optimizer,
    config: grpo.GRPOConfig,
    *,
    steps: int = 8,
    max_new_tokens: int = 32,
    seed: int = 0,
    capture_kwargs=None,
    reward=None,
    floor_perturbation: float | None = None,
    progress=None,
) -> OracleResult:
    """`reward(responses) -> list[float]`: the task's rewards of a group; None draws them uniform at
    random (seeded), which gives every step a non-zero advantage on a model no task reward moves.
    `floor_perturbation`: the parameter perturbation's L2 norm for `numerical_floor` (None: none)."""
    capture_kwargs = capture_kwargs or {}
    params = [p for p in model.parameters() if p.requires_grad]
    stale = capture(model, prompt_ids, **capture_kwargs)
    at_capture = [p.detach().clone() for p in params]
    ref_state = _reference_capture(model, prompt_ids, config, capture_kwargs)
    rows, floor = [], {}
    for step in range(steps + 1):
        rollouts = sample(model, stale, step_sampling(config.num_generations, max_new_tokens, seed, step))
        rewards = _group_rewards(reward, rollouts.responses, seed, step)
        group = _group(model, rollouts, rewards, ref_state, config, params)
        if step == 0 and floor_perturbation is not None:
            floor = numerical_floor(
                model, prompt_ids, stale, rollouts.responses, params, floor_perturbation, seed, capture_kwargs
            )
        row = {"step": step, "param_drift": parameter_drift(params, at_capture)}
        row |= _stale_against_fresh(model, prompt_ids, stale, group, capture_kwargs, optimizer)
        row |= {"response_tokens": [int(r.numel()) for r in rollouts.responses], "reward_mean": float(rewards.mean())}
        row["update_changed_fraction"] = _stale_update(optimizer, params)
        rows.append(row)
        if progress:
            progress(row)
        reuse_state(model, stale)
        if ref_state is not None:
            reuse_state(model, ref_state)
    return OracleResult(rows, floor)
