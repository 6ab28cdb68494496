"""The optimizer every trainer and point builds (`build_optimizer`): AdamW, with float32 master weights
for low-precision parameters.

An Adam step moves a weight by about the learning rate, which is below half a bf16 ulp for any weight
larger than about 256 x lr in magnitude: updated in place in bf16, most of such an update rounds away,
and what remains is which weights happened to round, not the step. `MasterWeightsAdamW` keeps a float32
copy of each low-precision parameter, steps on the copies (the bf16 gradient read in float32) and writes
them back rounded, so the rounding error no longer accumulates. `master_weights: null` (the default)
turns it on when a trainable parameter is bf16 or fp16 (full-parameter training of a bf16 model); peft's
LoRA adapters are float32 already, so an adapter run keeps plain AdamW.

On CUDA the step is torch's fused AdamW (one kernel over all parameters), and the masters' gradients and the
write-back are one multi-tensor copy each: a LoRA step has a few hundred small tensors, and stepping them one
kernel at a time took 7-8 ms of a 0.28 s hybrid step on the H200. On CPU AdamW keeps its default loop.
"""

from __future__ import annotations

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeightsAdamW(torch.optim.AdamW):
    """AdamW over float32 masters of the low-precision parameters (float32 ones are stepped as they are)."""

    def __init__(self, params, **kwargs):
        self.model_params = list(params)
        self.masters = [p.detach().float().clone() if p.dtype in LOW_PRECISION else p for p in self.model_params]
        super().__init__(self.masters, **kwargs)

    def _low(self):
        return [(p, m) for p, m in zip(self.model_params, self.masters) if m is not p]

    @torch.no_grad()
    def step(self, closure=None):
        low = self._low()
        for p, m in low:
            m.grad = None if p.grad is None else torch.empty_like(m)
        given = [(p.grad, m.grad) for p, m in low if p.grad is not None]
        if given:
            torch._foreach_copy_([g for _, g in given], [g for g, _ in given])  # read in float32
        loss = super().step(closure)
        if low:
            torch._foreach_copy_([p for p, _ in low], [m for _, m in low])  # written back rounded
        return loss

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        for p, _ in self._low():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self):
        return {**super().state_dict(), "masters": [m.detach().clone() for _, m in self._low()]}

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        masters = state_dict.pop("masters", None)
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for (p, m), saved in zip(self._low(), masters or [p.float() for p, _ in self._low()], strict=True):
                m.copy_(saved)


def build_optimizer(params, cfg) -> torch.optim.Optimizer:
    """AdamW over `params` from an `OptimizerConfig` (lr, weight_decay, master_weights); fused when every
    parameter is on CUDA."""
    params = list(params)
    use_masters = cfg.master_weights
    if use_masters is None:
        use_masters = any(p.dtype in LOW_PRECISION for p in params)
    cls = MasterWeightsAdamW if use_masters else torch.optim.AdamW
    fused = bool(params) and all(p.is_cuda for p in params)
    return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)
