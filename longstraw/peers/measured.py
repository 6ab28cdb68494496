"""A peer's step measured as `grpo_step` measures ours: the same advantages and token weights (fixed from
the group before any forward), the same phase recorder and graph-bytes meter, the same optimizer step, and
the metrics `grpo_step` returns (the step kind's report reads them unchanged).

Phases: `ref_scoring` (beta > 0: the peer's own log-prob pass with the adapter disabled, no graph),
`forward_backward` (the peer's one forward and backward over the whole group), `optimizer_step`. A peer
runs on-policy as TRL does with `num_iterations == 1`: the old log-probs are the current ones detached
(ratio 1), so it has no old-scoring pass.
"""

from __future__ import annotations

import torch

from longstraw.core import grpo
from longstraw.core.step import gradient_norm, group_objective, reference_policy, undone_on_failure
from longstraw.families import adapter_for
from longstraw.measure.memory import GraphBytesMeter, PhaseRecorder


def measured_step(
    model, optimizer, mode: str, responses, rewards, config: grpo.GRPOConfig, forward_backward, score
) -> dict:
    """Run one peer step and return its metrics.

    `score()`: the group's per-response log-probs (a list of [R_i] tensors), run without a graph for the
    reference pass; `forward_backward(advantages, token_weights, ref_logps)`: the peer's loss over the group,
    already back-propagated, as (loss value, the step's clip and KL statistics, `grpo.summarize_stats` names)."""
    adapter = adapter_for(model)
    recorder = PhaseRecorder(adapter.device)
    rewards, advantages, weights = group_objective(responses, rewards, config)
    ref = None
    if config.beta > 0:
        with recorder.phase("ref_scoring"), reference_policy(model), torch.no_grad():
            ref = score()
    meter = GraphBytesMeter(exclude=list(model.parameters()))
    with undone_on_failure(model):
        with recorder.phase("forward_backward"), meter:
            loss, stats = forward_backward(advantages, weights, ref)
        grad_norm = gradient_norm(model)
    with recorder.phase("optimizer_step"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        "mode": mode,
        "loss": float(loss),
        "grad_norm": grad_norm,
        "reward_mean": float(rewards.mean()),
        "advantages": [float(a) for a in advantages],
        "members_replayed": len(responses),
        "response_tokens": [int(r.numel()) for r in responses],
        "graph_bytes_peak": meter.peak,
        "phases": recorder.phases,
        "stats": stats,
    }
