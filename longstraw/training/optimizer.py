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

What is left of such a step is the host's: hybrid-1b's 152 adapter tensors took 2.9 ms of host time on an H100
box's CPU for 0.26 ms of kernels, in a 0.21 s step (`benchmarks/optimizer_step_host.py` times the path below against
torch's own step). So the masters' gradients are allocated once and kept (4 bytes per low-precision trainable
element between steps: 24 MB for hybrid-1b's LoRA), and a fused step whose state exists calls torch's fused kernel
itself (`_fused_groups`): the same kernel on the same lists that `torch.optim.AdamW.step` builds per step (its
`_init_group` and dispatch); torch's own step remains the reference, and takes every step the fast path does not
(the first, a state or group it does not know).
"""

from __future__ import annotations

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
_NOT_FAST = ("amsgrad", "maximize", "capturable", "differentiable")  # options `_fused_groups` leaves to torch


class MasterWeightsAdamW(torch.optim.AdamW):
    """AdamW over float32 masters of the low-precision parameters (float32 ones are stepped as they are)."""

    def __init__(self, params, **kwargs):
        self.model_params = list(params)
        self.masters = [p.detach().float().clone() if p.dtype in LOW_PRECISION else p for p in self.model_params]
        super().__init__(self.masters, **kwargs)
        self._pairs = [(p, m) for p, m in zip(self.model_params, self.masters) if m is not p]
        self._master_grads = [torch.empty_like(m) for _, m in self._pairs]  # kept: see the module doc

    def _low(self):
        """(model parameter, its float32 master) of each low-precision parameter."""
        return self._pairs

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:  # it would recompute the model's gradients after the masters took theirs
            raise ValueError("MasterWeightsAdamW.step takes no closure: compute the gradients, then step")
        low = self._low()
        for (p, m), kept in zip(low, self._master_grads):
            m.grad = None if p.grad is None else kept
        given = [(p.grad, m.grad) for p, m in low if p.grad is not None]
        if given:
            torch._foreach_copy_([g for _, g in given], [g for g, _ in given])  # read in float32
        groups = self._fused_groups()
        if groups is None:
            super().step()
        for group, stepped, states in groups or ():
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)  # as torch's fused AdamW counts the steps first
            beta1, beta2 = group["betas"]
            torch._fused_adamw_(
                stepped,
                [m.grad for m in stepped],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [],
                steps,
                amsgrad=False,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
                grad_scale=None,
                found_inf=None,
            )
        if low:
            torch._foreach_copy_([p for p, _ in low], [m for _, m in low])  # written back rounded

    def _fused_groups(self) -> list | None:
        """(group, its parameters with a gradient, their states) of each group, for torch's fused AdamW kernel called
        as `torch.optim.AdamW.step` calls it; None where torch's own step must run: a group not fused or with an option
        the kernel call here leaves out (amsgrad, maximize, capturable, differentiable; a tensor lr or betas), a
        parameter with a gradient and no state yet, or parameters of more than one device and dtype."""
        groups, placements = [], set()
        for group in self.param_groups:
            if not group["fused"] or any(group[flag] for flag in _NOT_FAST):
                return None
            if any(isinstance(x, torch.Tensor) for x in (group["lr"], *group["betas"])):
                return None
            stepped = [m for m in group["params"] if m.grad is not None]
            states = [self.state.get(m) for m in stepped]
            if not all(states):
                return None
            placements.update((m.device, m.dtype) for m in stepped)
            if stepped:
                groups.append((group, stepped, states))
        return groups if len(placements) <= 1 else None

    def zero_grad(self, set_to_none: bool = True):
        """The model's gradients (None, or zeros); the masters' kept gradients are overwritten by the next step."""
        for p in self.model_params:
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
            for (_, m), saved in zip(self._low(), masters or [p.float() for p, _ in self._low()], strict=True):
                m.copy_(saved)


def described(optimizer: torch.optim.Optimizer) -> dict:
    """What an optimizer from `build_optimizer` applies (its first group's base learning rate and weight decay,
    and whether it keeps float32 masters): read off the optimizer, for records that must say what ran."""
    group = optimizer.param_groups[0]
    return {
        "lr": group.get("initial_lr", group["lr"]),
        "weight_decay": group["weight_decay"],
        "master_weights": isinstance(optimizer, MasterWeightsAdamW),
    }


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
