"""Programmatic dependent launches of a decoding step's Triton kernels (CUDA, compute capability 9 and later).

A kernel launched dependent (Triton's `launch_pdl`) may start before the kernel ahead of it in the stream has ended,
and waits for that one's end (`gdc_wait`, which also makes its writes visible) before it reads what it wrote. A
decoding step is ~250 small launches whose starts cost about as long as their work; launched dependent, a kernel's
start overlaps the end of the one before it (and the attention's merge reads its rows' own keys while the prefix
pass runs: `decode_attention_triton`). "serial" starts each after the one before has ended, as a stream does.

"dependent" is the default since an H100 measured it (2026-12-07, 99b1194, two calls on one held box:
`benchmarks/rollout_speed.py --launches dependent` against `--launches serial`, SmolLM2's shape at 16,384, G = 8):
the graphed step 1.040, 1.042 and 1.046 ms against 1.083, 1.086 and 1.088 ms serial (4.84-4.86x the bandwidth
floor against 5.04-5.06x), the same tokens, and its CUDA tests passed (tests/test_decode_cuda.py; the records:
`experiments/recorded/h100-benchmarks/`). "serial" is the reference the dependent step is held to bit for bit, and
what a device without programmatic dependent launches runs."""

from __future__ import annotations

import torch

from longstraw.kernels.process_setting import ProcessSetting

_setting = ProcessSetting("decode launches", ("dependent", "serial"), "dependent")


def decode_launches(name: str):
    """Within the block the decoding kernels launch `name`: "dependent" (where the device has it) or "serial"."""
    return _setting.within(name)


def launches_dependent(device: torch.device, asked: bool | None = None) -> bool:
    """Whether a kernel on `device` launches dependent: `asked` (None: as `decode_launches` has it) and the device
    has programmatic dependent launches."""
    wanted = _setting.value == "dependent" if asked is None else asked
    return wanted and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
