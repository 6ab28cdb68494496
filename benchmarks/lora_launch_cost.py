"""Host time per call of a LoRA linear layer's forward, fused against added in place, where the GPU is not the limit.

    python benchmarks/lora_launch_cost.py [--rows 64 8192] [--calls 300]

For a bf16 layer of hybrid-1b's widest projection (2,048 -> 8,192, r=16, adapters in the base's dtype), without
autograd (capture) and with it (a member's forward and backward): seconds per call of `models.lora_linear`'s fused
path and of its in-place path, each timed over --calls calls after a warm-up, at each row count. At few rows the
device finishes each kernel before the host launches the next, so the time is the host's; prints the ratio.
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from longstraw.measure.timing import seconds_per_call
from longstraw.models import lora_linear
from longstraw.models.lora_linear import adopt_in_place_lora


def layer(device):
    net = nn.Sequential(nn.Linear(2048, 8192, bias=False))
    model = get_peft_model(net, LoraConfig(r=16, lora_alpha=32, target_modules=["0"], init_lora_weights=False))
    model.to(device=device, dtype=torch.bfloat16)
    adopt_in_place_lora(model)
    return model.base_model.model[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 8192])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    device = torch.device("cuda")
    proj = layer(device)
    out = []
    for rows in args.rows:
        x = torch.randn(rows, 2048, device=device, dtype=torch.bfloat16)
        xg = x.clone().requires_grad_(True)
        grad = torch.randn(rows, 8192, device=device, dtype=torch.bfloat16)

        def forward():
            with torch.no_grad():
                proj(x)

        def forward_backward():
            proj(xg).backward(grad)

        row = {"rows": rows}
        for path in ("fused", "in-place"):
            patch = mock.patch.object(lora_linear, "fusable", return_value=False) if path == "in-place" else None
            with patch or mock.patch.object(lora_linear, "fusable", wraps=lora_linear.fusable):
                row[f"{path}_forward_seconds"] = seconds_per_call(forward, device, args.calls, warmup=10)
                row[f"{path}_forward_backward_seconds"] = seconds_per_call(
                    forward_backward, device, args.calls, warmup=10
                )
        for phase in ("forward", "forward_backward"):
            ratio = row[f"fused_{phase}_seconds"] / row[f"in-place_{phase}_seconds"]
            print(
                f"rows {rows}, {phase}: fused {row[f'fused_{phase}_seconds'] * 1e6:.1f} us, in place "
                f"{row[f'in-place_{phase}_seconds'] * 1e6:.1f} us per call: fused / in place {ratio:.2f}",
                flush=True,
            )
        out.append(row)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
