"""The GRPO loss of a whole group at once, written the way TRL's `GRPOTrainer._compute_loss` does
(right-padding to [G, max_len], a completion mask, aggregation by `loss_type`): the independent
reference the serial per-response objective (`longstraw.core.grpo`) is tested against."""

import torch
import torch.nn.functional as F


def _pad(seqs, width, dtype):
    return torch.stack([F.pad(s.to(dtype), (0, width - s.shape[0])) for s in seqs])


def batch_loss(logps, old_logps, ref_logps, advantages_G, config, tool_masks=None) -> torch.Tensor:
    """`old_logps=None` means on-policy; `ref_logps` is used when `config.beta > 0`; `tool_masks` (one bool [R_i]
    per response, True on its own tokens) multiplies the completion mask, as TRL masks tool outputs."""
    lengths = [int(lp.shape[0]) for lp in logps]
    width = max(max(lengths), 1)
    dtype = torch.promote_types(logps[0].dtype, torch.float32)
    logp = _pad(logps, width, dtype)
    old = logp.detach() if old_logps is None else _pad([o.detach() for o in old_logps], width, dtype)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(dtype)
    if tool_masks is not None:
        mask = mask * _pad(tool_masks, width, dtype)
    adv = torch.as_tensor(advantages_G, dtype=dtype).unsqueeze(1)
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - config.epsilon, 1 + config.epsilon_high)
    loss_tok = -torch.min(coef_1 * adv, coef_2 * adv)
    if config.beta != 0.0:
        ref = _pad([r.detach() for r in ref_logps], width, dtype)
        loss_tok = loss_tok + config.beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if config.loss_type == "grpo":
        return ((loss_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if config.loss_type in ("bnpo", "dapo"):  # one prompt, one process: both normalise by the group's tokens
        return (loss_tok * mask).sum() / mask.sum().clamp(min=1.0)
    if config.loss_type == "dr_grpo":
        return (loss_tok * mask).sum() / (loss_tok.size(0) * config.max_completion_length)
    raise ValueError(f"unknown loss_type {config.loss_type!r}")


class GradientRecorder:
    """An optimizer stand-in: records the accumulated gradients at step() instead of updating."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def step(self):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)
