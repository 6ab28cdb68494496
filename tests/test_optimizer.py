"""Float32 master weights for bf16 parameters (`longstraw.training.optimizer`), held to torch's own AdamW
on float32 parameters given the same gradients."""

import pytest
import torch

from longstraw.config.sections import OptimizerConfig
from longstraw.training.optimizer import MasterWeightsAdamW, build_optimizer


def _grads(step: int, shape):
    """Of one sign, so that the steps add up (about lr each) rather than cancel."""
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(step))
    return (1 + 0.1 * noise).to(torch.bfloat16)


def test_masters_follow_float32_adamw_where_bf16_in_place_rounds_the_update_away():
    start = torch.linspace(0.5, 2.0, 64)  # |w| > 256 x lr everywhere: each step is below half a bf16 ulp
    lr = 1e-4
    bf16 = torch.nn.Parameter(start.to(torch.bfloat16))
    reference = torch.nn.Parameter(start.to(torch.bfloat16).float())  # the same start, in float32
    plain = torch.nn.Parameter(start.to(torch.bfloat16))
    ours = MasterWeightsAdamW([bf16], lr=lr, weight_decay=0.0)
    theirs = torch.optim.AdamW([reference], lr=lr, weight_decay=0.0)
    naive = torch.optim.AdamW([plain], lr=lr, weight_decay=0.0)
    for step in range(100):  # ~100 x lr = 1e-2: past half an ulp of every weight
        g = _grads(step, start.shape)
        bf16.grad, plain.grad, reference.grad = g.clone(), g.clone(), g.float()
        ours.step(), theirs.step(), naive.step()
        ours.zero_grad(), theirs.zero_grad(), naive.zero_grad()
    assert torch.equal(ours.masters[0], reference.detach())  # the same float32 trajectory, bit for bit
    assert torch.equal(bf16.detach(), reference.detach().to(torch.bfloat16))  # written back rounded
    assert bf16.grad is None
    moved = (bf16.detach() != start.to(torch.bfloat16)).float().mean()
    rounded_away = (plain.detach() != start.to(torch.bfloat16)).float().mean()
    assert moved > 0.5 and rounded_away < 0.1, (moved, rounded_away)


def test_the_masters_travel_with_the_state_dict():
    p = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    first = MasterWeightsAdamW([p], lr=1e-3)
    p.grad = torch.ones_like(p)
    first.step()
    saved = first.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    second = MasterWeightsAdamW([q], lr=1e-3)
    second.load_state_dict(saved)
    assert torch.equal(second.masters[0], first.masters[0])
    assert not torch.equal(second.masters[0], q.detach().float())  # the master keeps what bf16 rounded off
    for opt, param in ((first, p), (second, q)):
        param.grad = torch.ones_like(param)
        opt.step()
    assert torch.equal(first.masters[0], second.masters[0]) and torch.equal(p, q)


def test_masters_are_the_default_exactly_for_low_precision_trainable_parameters():
    assert (
        type(build_optimizer([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))], OptimizerConfig()))
        is MasterWeightsAdamW
    )
    assert type(build_optimizer([torch.nn.Parameter(torch.ones(2))], OptimizerConfig())) is torch.optim.AdamW
    off = OptimizerConfig(master_weights=False)
    assert type(build_optimizer([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))], off)) is torch.optim.AdamW
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        build_optimizer([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))], OptimizerConfig()), lambda s: 0.5
    )
    assert scheduler.get_last_lr() == [0.5e-4]


@pytest.mark.cuda
def test_on_cuda_the_built_optimizer_is_fused_and_its_masters_follow_fused_float32_adamw():
    """On CUDA `build_optimizer` steps with torch's fused AdamW; the masters (gradients copied in, weights
    copied back, several tensors at once) take the float32 trajectory of fused AdamW bit for bit."""
    starts = [torch.linspace(0.5, 2.0, 64, device="cuda"), torch.linspace(-1.0, 1.0, 24, device="cuda")]
    bf16 = [torch.nn.Parameter(s.to(torch.bfloat16)) for s in starts]
    reference = [torch.nn.Parameter(s.to(torch.bfloat16).float()) for s in starts]
    ours = build_optimizer(bf16, OptimizerConfig(lr=1e-4))
    theirs = torch.optim.AdamW(reference, lr=1e-4, weight_decay=OptimizerConfig().weight_decay, fused=True)
    assert type(ours) is MasterWeightsAdamW and ours.defaults["fused"]
    assert build_optimizer([torch.nn.Parameter(starts[0])], OptimizerConfig()).defaults["fused"]
    for step in range(20):
        for i, (p, r) in enumerate(zip(bf16, reference)):
            g = _grads(100 * step + i, p.shape).cuda()
            p.grad, r.grad = g.clone(), g.float()
        bf16[1].grad = None if step % 3 == 0 else bf16[1].grad  # a parameter without a gradient is not stepped
        reference[1].grad = None if step % 3 == 0 else reference[1].grad
        ours.step(), theirs.step()
        ours.zero_grad(), theirs.zero_grad()
    for p, m, r in zip(bf16, ours.masters, reference):
        assert torch.equal(m, r.detach()) and torch.equal(p.detach(), r.detach().to(torch.bfloat16))


def test_fused_steps_after_the_first_skip_torchs_step_and_keep_its_trajectory_bit_for_bit(monkeypatch):
    """Fused (on CPU here, as on CUDA) the masters take torch's fused float32 AdamW trajectory bit for bit through
    what changes between steps: a parameter without a gradient (not stepped, its moments untouched), a scheduler's
    learning rate, a state loaded from a state dict. Once every stepped parameter has a state, the step calls the
    fused kernel itself: torch's own `AdamW.step` runs only for the first step and a parameter's first gradient."""
    starts = [torch.linspace(0.5, 2.0, 64), torch.linspace(-1.0, 1.0, 24).reshape(4, 6), torch.ones(3)]
    bf16 = [torch.nn.Parameter(s.to(torch.bfloat16)) for s in starts]
    reference = [torch.nn.Parameter(s.to(torch.bfloat16).float()) for s in starts]
    ours = MasterWeightsAdamW(bf16, lr=1e-3, weight_decay=0.1, fused=True)
    theirs = torch.optim.AdamW(reference, lr=1e-3, weight_decay=0.1, fused=True)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)) for o in (ours, theirs)]
    torch_steps = []
    plain_step = torch.optim.AdamW.step
    monkeypatch.setattr(
        torch.optim.AdamW, "step", lambda self, *a: torch_steps.append((self, step)) or plain_step(self, *a)
    )
    for step in range(12):
        for i, (p, r) in enumerate(zip(bf16, reference)):
            g = _grads(100 * step + i, p.shape)
            p.grad, r.grad = g.clone(), g.float()
        for params in (bf16, reference):
            params[1].grad = None if step % 3 == 0 else params[1].grad  # not stepped at all on those steps
            params[2].grad = None if step < 5 else params[2].grad  # its first gradient at step 5
        ours.step(), theirs.step()
        ours.zero_grad(), theirs.zero_grad()
        for schedule in schedules:
            schedule.step()
        if step == 7:  # a resumed run: the state (and the masters) from a state dict, into a fresh optimizer
            saved = ours.state_dict()
            ours = MasterWeightsAdamW(bf16, lr=1e-3, weight_decay=0.1, fused=True)
            ours.load_state_dict(saved)
            schedules[0] = torch.optim.lr_scheduler.LambdaLR(ours, lambda s: 1 / (1 + s), last_epoch=step)
        assert all(torch.equal(m, r.detach()) for m, r in zip(ours.masters, reference)), step
    assert all(torch.equal(p.detach(), r.detach().to(torch.bfloat16)) for p, r in zip(bf16, reference))
    # torch's step: the first, the second parameter's first gradient (step 1), the third's (step 5); not after loading
    assert [step for o, step in torch_steps if isinstance(o, MasterWeightsAdamW)] == [0, 1, 5]
    assert all(p.grad is None for p in bf16)
    with pytest.raises(ValueError, match="closure"):
        ours.step(lambda: 0.0)
