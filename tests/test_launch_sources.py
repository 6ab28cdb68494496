"""`longstraw.measure.kernel_profile.launch_sources` names the code that launched each op: the source line of a
forward op, the autograd node of a backward one."""

import torch

from longstraw.measure.kernel_profile import launch_sources
from longstraw.models.lora_linear import fused_lora_linear


def test_ops_are_attributed_to_their_source_line_and_backward_node():
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    weight, lora_A, lora_B = torch.randn(12, 16), torch.randn(4, 16, requires_grad=True), torch.randn(12, 4)
    lora_B.requires_grad_(True)

    def step():
        fused_lora_linear(x, weight, None, lora_A, lora_B, 2.0).sum().backward()

    sources = {row["source"]: row for row in launch_sources(step, torch.device("cpu"), top=100)}
    forward = [row for name, row in sources.items() if "longstraw/models/lora_linear.py" in name]
    assert any("aten::addmm_" in row["ops"] and "_lora_forward" in name for name, row in sources.items())
    assert sum(row["ops"].get("aten::addmm_", 0) for row in forward) == 1  # lora_B's GEMM accumulating, once
    backward = sources["backward: _FusedLoraLinearBackward"]["ops"]
    assert backward.get("aten::addmm_") == 1 and backward.get("aten::addmm") == 2  # x's sum, the adapters' two
    assert all(row["launches"] > 0 and row["seconds"] >= 0 for row in sources.values())


def test_device_idle_is_the_wall_outside_the_kernels_span_and_the_gaps_between_them():
    """Kernels at [0, 10], [5, 20] (overlapping the first), [50, 60], [61, 70] us in a 100 us wall: the span is
    70 us, so 30 us lie outside it; 30 + 1 us lie between kernels, the larger after the kernel that ended last."""
    from types import SimpleNamespace

    from longstraw.measure.kernel_profile import device_idle

    def kernel(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    kernels = [kernel("c", 50, 60), kernel("a", 0, 10), kernel("b", 5, 20), kernel("d", 61, 70)]
    idle = device_idle(kernels, wall=100e-6, top=1)
    assert abs(idle["outside_span_seconds"] - 30e-6) < 1e-12
    assert abs(idle["between_kernels_seconds"] - 31e-6) < 1e-12
    assert len(idle["largest_gaps"]) == 1 and idle["largest_gaps"][0]["after"] == "b"
    assert idle["largest_gaps"][0]["before"] == "c" and abs(idle["largest_gaps"][0]["seconds"] - 30e-6) < 1e-12
    assert device_idle([], wall=1.0, top=3) == {
        "outside_span_seconds": 1.0,
        "between_kernels_seconds": 0.0,
        "largest_gaps": [],
    }
