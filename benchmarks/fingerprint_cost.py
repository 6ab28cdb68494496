"""What a resident state's fingerprint costs: the per-chunk position-weighted word sums (`state.resident._chunk_sums`,
which `grpo_step` takes twice a step for `state_unchanged`) against the plain form they replaced, on K/V pages of
SmolLM2-135M's shape (30 layers, 3 KV heads of 64, bf16) at `--positions`.

    python benchmarks/fingerprint_cost.py --positions 16384 [--device cuda] [--repeats 5] [--out F]

The plain form converts every word to int64, multiplies it by its weight and sums (five passes over int64); the
column form sums the words in rows of the weights' period first (one reduction), then weights the 65,521 column
sums. Both give the same int64 values (checked here on every tensor). Prints each one's median seconds for the whole
state and the ratio; the last stdout line is one JSON object, also written to --out.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from longstraw.measure.provenance import emit
from longstraw.state import resident


def plain_chunk_sums(t: torch.Tensor) -> torch.Tensor:
    """The form before the column sums: each chunk's words to int64, times arange % 65521 + 1, summed."""
    words = t.detach().contiguous().view(-1).view(torch.int32)
    sums = []
    for start in range(0, words.numel(), resident._FINGERPRINT_CHUNK):
        chunk = words[start : start + resident._FINGERPRINT_CHUNK].to(torch.int64)
        weights = torch.arange(chunk.numel(), device=chunk.device, dtype=torch.int64) % 65521 + 1
        sums.append((chunk * weights).sum())
    return torch.stack(sums)


def timed(fn, tensors, device, repeats: int) -> tuple[float, list]:
    seconds, out = [], None
    for _ in range(repeats + 1):  # the first warms the allocator and kernels
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = [fn(t) for t in tensors]
        torch.cat(out).tolist()  # one transfer, as `fingerprint` does
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:]), out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=16384)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (args.positions, 3, 64)
    tensors = [torch.randn(shape, generator=generator, device=device).to(torch.bfloat16) for _ in range(2 * 30)]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    plain, expected = timed(plain_chunk_sums, tensors, device, args.repeats)
    columns, got = timed(resident._chunk_sums, tensors, device, args.repeats)
    if any(not torch.equal(a, b) for a, b in zip(expected, got, strict=True)):
        raise SystemExit("the column form's sums differ from the plain form's")
    print(f"state of {args.positions:,} positions ({state_bytes / 1e9:.2f} GB) on {device}:")
    print(f"  plain int64 form {plain * 1e3:.1f} ms, column form {columns * 1e3:.1f} ms: {plain / columns:.1f}x")
    result = {
        "positions": args.positions,
        "state_bytes": state_bytes,
        "plain_seconds": plain,
        "column_seconds": columns,
        "ratio": plain / columns,
    }
    emit(result, device, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
