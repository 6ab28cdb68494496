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
