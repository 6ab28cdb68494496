"""The fresh-prefix staleness oracle: how far a reused (stale) prompt state drifts from a fresh one.

    rows = staleness_oracle(model, prompt_ids, optimizer, grpo_config, steps=8, num_samples=4,
                            max_new_tokens=32, seed=0)

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
  adaptive refresh signal), so the report can relate the signal to the drift it stands for.
Training then steps on the stale gradient, as a trainer reusing the prefix would. Step 0's
fresh state equals the stale one: its drift is exactly zero (a check, not a data point).

Rewards are seeded uniform draws per response: drift is a property of the parameter updates, and
random rewards give every step a non-zero advantage (a task reward on an untrained model is
mostly all-zero, which would stop the updates). Cost per step: one extra capture (the fresh
state lives beside the stale one) and two gradient passes.
"""

from __future__ import annotations

import torch

from longstraw.core import grpo
from longstraw.training.rollout import SamplingConfig, sample
from longstraw.core.step import reference_policy
from longstraw.core.transaction import capture, replay, score


def parameter_drift(params, at_capture) -> float:
    """L2 norm of the parameters' change since `at_capture` (the adaptive refresh signal)."""
    return float(torch.stack([(p.detach() - p0).float().norm() for p, p0 in zip(params, at_capture)]).norm())


def _loss_and_grads(model, state, responses, old, ref, advantages, weights, config, params):
    """GRPO loss over the group replayed on `state`: (loss, flat gradient, response log-probs)."""
    total, logps = 0.0, []
    for i, y in enumerate(responses):
        logp = replay(model, state, y)
        loss = grpo.response_loss(logp, old[i], ref and ref[i], advantages[i], weights[i], config)
        loss.backward()
        total += float(loss.detach())
        logps.append(logp.detach())
    grads = torch.cat([p.grad.detach().flatten().float() if p.grad is not None else torch.zeros(p.numel())
                       for p in params])
    return total, grads, torch.cat(logps)


def staleness_oracle(model, prompt_ids, optimizer, config: grpo.GRPOConfig, *, steps: int = 8,
                     num_samples: int = 4, max_new_tokens: int = 32, seed: int = 0, capture_kwargs=None,
                     progress=None) -> list[dict]:
    capture_kwargs = capture_kwargs or {}
    params = [p for p in model.parameters() if p.requires_grad]
    stale = capture(model, prompt_ids, **capture_kwargs)
    at_capture = [p.detach().clone() for p in params]
    ref_state = None
    if config.beta > 0:
        with reference_policy(model):
            ref_state = capture(model, prompt_ids, **capture_kwargs)
    rows = []
    for step in range(steps + 1):
        rollouts = sample(model, stale, SamplingConfig(num_samples=num_samples, max_new_tokens=max_new_tokens,
                                                       seed=seed * 1_000_003 + step))
        responses, old = rollouts.responses, rollouts.logprobs
        rewards = torch.rand(num_samples, generator=torch.Generator().manual_seed(seed * 7919 + step))
        advantages = grpo.group_advantages(rewards, config.scale_rewards, num_generations=num_samples)
        weights = grpo.token_weights([int(r.numel()) for r in responses], config)
        ref = None
        if ref_state is not None:
            with reference_policy(model):
                ref = [score(model, ref_state, y) for y in responses]
        fresh = capture(model, prompt_ids, **capture_kwargs)
        group = (responses, old, ref, advantages, weights, config, params)
        loss_fresh, grad_fresh, logp_fresh = _loss_and_grads(model, fresh, *group)
        optimizer.zero_grad(set_to_none=True)
        del fresh
        loss_stale, grad_stale, logp_stale = _loss_and_grads(model, stale, *group)
        d = logp_fresh - logp_stale
        nll_stale, nll_fresh = float(-logp_stale.mean()), float(-logp_fresh.mean())
        rows.append({
            "step": step,
            "param_drift": parameter_drift(params, at_capture),
            "loss_stale": nll_stale,
            "loss_fresh": nll_fresh,
            "relative_loss_drift": abs(nll_stale - nll_fresh) / abs(nll_fresh),
            "grpo_loss_stale": loss_stale,
            "grpo_loss_fresh": loss_fresh,
            "mean_abs_logprob_diff": float(d.abs().mean()),
            "kl_k3": float((d.exp() - d - 1).mean()),
            "grad_cosine": float(torch.nn.functional.cosine_similarity(grad_stale, grad_fresh, dim=0)),
            "grad_norm_stale": float(grad_stale.norm()),
            "response_tokens": [int(r.numel()) for r in responses],
            "reward_mean": float(rewards.mean()),
        })
        if progress:
            progress(rows[-1])
        optimizer.step()  # on the stale gradient, as prefix reuse trains
        optimizer.zero_grad(set_to_none=True)
    return rows
