"""Seconds of a step point's optimizer step (its `optimizer_step` phase: `step()` then `zero_grad()`), with the
optimizer's fused fast path and with torch's own `AdamW.step` taking every step, and how much of it the device spends.

    python benchmarks/optimizer_step_host.py [--point POINT] [--repeats 30] [--out F]

For the named `experiments/peers.yaml` h200 point (default: hybrid-1b's floor point, bf16 adapters): its policy
and the optimizer its steps build (`build_optimizer`: float32 masters and torch's fused AdamW for bf16 adapters on
CUDA), seeded gradients on every trainable tensor, then --repeats timed steps of each path (the device synchronised
before and after each; the median) and the kernels' seconds of one step of each under torch.profiler. A step with
little arithmetic is the host's: the ratio says what the fast path (`MasterWeightsAdamW._fused_groups`) takes off it.
The last stdout line is one JSON object, also written to --out.
"""

from __future__ import annotations

import argparse
import statistics
from unittest import mock

import torch

from longstraw.harness.plan import point_config
from longstraw.kinds.common import optimizer_for, policy_and_prompt
from longstraw.measure.kernel_profile import kernel_profile
from longstraw.measure.memory import PhaseRecorder, synchronize
from longstraw.measure.provenance import emit
from longstraw.measure.timing import seconds_each
from longstraw.training.optimizer import MasterWeightsAdamW


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--point", default="warm-hybrid-1b_mode-replay-uncheckpointed-bf16lora-graph_length-32768_count-2"
    )
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--profile", default="h200")
    parser.add_argument("--out")
    args = parser.parse_args()
    cfg = point_config("experiments/peers.yaml", args.profile, args.point)
    device = torch.device(cfg.model.device)
    model, _, _ = policy_and_prompt(cfg, PhaseRecorder(device))
    optimizer = optimizer_for(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [1e-3 * torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) for p in params]

    def give_gradients():
        for p, g in zip(params, grads):
            p.grad = g.clone()
        synchronize(device)  # the gradients' copies are not the step's

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def measured() -> dict:
        give_gradients()
        step()  # the first step builds the state (torch's own step, on either path)
        seconds = []
        for _ in range(args.repeats):
            give_gradients()
            seconds += seconds_each(step, device, 1)
        give_gradients()
        return {
            "seconds_median": statistics.median(seconds),
            "kernel_seconds": kernel_profile(step, device)["kernel_seconds"],
        }

    out = {
        "point": args.point,
        "optimizer": type(optimizer).__name__,
        "fused": bool(optimizer.defaults.get("fused")),
        "tensors": len(params),
        "elements": sum(p.numel() for p in params),
        "fast": measured(),
    }
    if isinstance(optimizer, MasterWeightsAdamW):
        with mock.patch.object(MasterWeightsAdamW, "_fused_groups", return_value=None):
            out["torch_step"] = measured()
        out["fast_over_torch_step"] = out["fast"]["seconds_median"] / out["torch_step"]["seconds_median"]
    print(
        f"{out['optimizer']} over {out['tensors']} tensors ({out['elements']:,} elements): step + zero_grad "
        + ", ".join(
            f"{name} {row['seconds_median'] * 1e3:.3f} ms (kernels {row['kernel_seconds'] * 1e3:.3f} ms)"
            for name, row in out.items()
            if isinstance(row, dict)
        )
        + (f"; fast over torch's step {out['fast_over_torch_step']:.2f}x" if "fast_over_torch_step" in out else ""),
        flush=True,
    )
    emit(out, device, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
