"""Check paged_attention's CUDA kernels (flash, cudnn) against backend="math" in bf16, then time them.

Run on a CUDA machine from the repo root:  python benchmarks/check_attention_cuda.py [--no-bench] [--cudnn]
(--cudnn adds the experimental cudnn kernel; it has crashed the process on some shapes.)
Prints one line per check, the timings, and as the LAST stdout line one JSON object.
Exits 1 when an error exceeds its tolerance (or the run fails), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from longstraw.kernels.paged_attention import _pick_kernel, paged_attention  # noqa: E402

OUT_TOL = 2e-2  # max |cuda - math| / max |math|, bf16 inputs, math computed in float32
GRAD_TOL = 5e-2

CHECKS = [
    # name, B, H, Hk, R, P, D, block_size (None = default), prefix requires grad
    ("gqa8_empty_prefix", 1, 16, 2, 512, 0, 128, None, False),
    ("mha_blocks_prefix_grad", 2, 8, 8, 128, 3000, 64, 1024, True),
    ("gqa8_r1_prefix_grad", 1, 16, 2, 1, 5000, 128, 2048, True),
    ("gqa4_d256_ragged", 1, 8, 2, 100, 777, 256, 300, True),
    ("gqa8_p65536_r2048", 1, 16, 2, 2048, 65536, 128, 16384, False),
    ("gqa8_p65536_r2048_prefix_grad", 1, 16, 2, 2048, 65536, 128, None, True),
]
BENCH = dict(B=1, H=16, Hk=2, R=4096, P=1_048_576, D=128)
KERNELS = ["flash"]


def make_inputs(B, H, Hk, R, P, D, prefix_grad, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, grad=True):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)

    q, k_live, v_live = rnd(B, H, R, D), rnd(B, Hk, R, D), rnd(B, Hk, R, D)
    # prefix as views of a larger preallocated page buffer, as in replay
    k_pages, v_pages = rnd(B, Hk, P + 64, D, grad=prefix_grad), rnd(B, Hk, P + 64, D, grad=prefix_grad)
    leaves = [q, k_live, v_live] + ([k_pages, v_pages] if prefix_grad else [])
    return (q, k_pages[:, :, :P], v_pages[:, :, :P], k_live, v_live), leaves


def run(inputs, leaves, dout, backend, block_size):
    D = inputs[0].shape[-1]
    out = paged_attention(*inputs, scale=D**-0.5, block_size=block_size, backend=backend)
    return [out] + list(torch.autograd.grad(out, leaves, dout))


def check(name, B, H, Hk, R, P, D, block_size, prefix_grad):
    """Returns {kernel: {grad name: max error relative to max |math|}} and whether all pass."""
    inputs, leaves = make_inputs(B, H, Hk, R, P, D, prefix_grad)
    dout = torch.randn(B, H, R, D, device="cuda", dtype=torch.bfloat16)
    want = run(inputs, leaves, dout, "math", None)
    names = ["out", "dq", "dk_live", "dv_live", "dk_prefix", "dv_prefix"][: len(want)]
    ok, result = True, {}
    for kernel in KERNELS:
        if _pick_kernel(kernel, inputs[0], D) != kernel:
            print(f"skip {name} [{kernel}]: kernel does not apply", flush=True)
            continue
        got = run(inputs, leaves, dout, kernel, block_size)
        errs = {}
        for n, a, b in zip(names, got, want):
            errs[n] = (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-6)
        passed = all(e <= (OUT_TOL if n == "out" else GRAD_TOL) for n, e in errs.items())
        ok &= passed
        result[kernel] = errs
        print(
            f"{'ok  ' if passed else 'FAIL'} {name} [{kernel}]: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()),
            flush=True,
        )
        del got
    del want, inputs, leaves
    torch.cuda.empty_cache()
    return ok, result


def timed(fn, reps=3):
    fn()  # warm-up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3  # seconds


def bench(kernel, B, H, Hk, R, P, D):
    fwd_flop = 4 * B * H * R * D * (P + R / 2)  # QK^T and PV; the live block is causal (half)
    bwd_flop = 2.5 * fwd_flop  # flash convention: 5 matmuls against the forward's 2
    result = dict(kernel=kernel, shape=dict(B=B, H=H, Hk=Hk, R=R, P=P, D=D))
    torch.cuda.reset_peak_memory_stats()
    for prefix_grad in (False, True):
        inputs, leaves = make_inputs(B, H, Hk, R, P, D, prefix_grad)
        dout = torch.randn(B, H, R, D, device="cuda", dtype=torch.bfloat16)
        scale = D**-0.5

        def fwd():
            with torch.no_grad():
                return paged_attention(*inputs, scale=scale, backend=kernel)

        out = paged_attention(*inputs, scale=scale, backend=kernel)
        t_bwd = timed(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
        tag = "bwd_prefix_grad" if prefix_grad else "bwd"
        result[f"{tag}_ms"] = t_bwd * 1e3
        result[f"{tag}_tflops"] = bwd_flop / t_bwd / 1e12
        if not prefix_grad:
            t_fwd = timed(fwd)
            result["fwd_ms"] = t_fwd * 1e3
            result["fwd_tflops"] = fwd_flop / t_fwd / 1e12
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out = inputs = leaves = None  # this shape's tensors freed before the next
        torch.cuda.empty_cache()
    print(
        f"bench [{kernel}] P={P} R={R} H={H} Hk={Hk} D={D}: "
        f"fwd {result['fwd_ms']:.1f} ms = {result['fwd_tflops']:.0f} TFLOP/s, "
        f"bwd {result['bwd_ms']:.1f} ms = {result['bwd_tflops']:.0f} TFLOP/s, "
        f"bwd with prefix grads {result['bwd_prefix_grad_ms']:.1f} ms = {result['bwd_prefix_grad_tflops']:.0f} TFLOP/s",
        flush=True,
    )
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-bench", action="store_true", help="only run the correctness checks")
    parser.add_argument("--cudnn", action="store_true", help="also check and time the experimental cudnn kernel")
    args = parser.parse_args()
    if args.cudnn:
        KERNELS.append("cudnn")
    summary = dict(ok=False, torch=torch.__version__)
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        summary["device"] = torch.cuda.get_device_name()
        torch.manual_seed(0)
        summary["checks"] = {}
        ok = True
        for name, *shape in CHECKS:
            passed, errs = check(name, *shape)
            ok &= passed
            summary["checks"][name] = errs
        summary["max_err"] = {
            kernel: {
                k: max(errs.get(kernel, {}).get(k, 0.0) for errs in summary["checks"].values())
                for k in ("out", "dq", "dk_live", "dv_live", "dk_prefix", "dv_prefix")
            }
            for kernel in KERNELS
        }
        if not args.no_bench:
            summary["bench"] = {kernel: bench(kernel, **BENCH) for kernel in KERNELS}
        summary["ok"] = ok
    except Exception as exc:  # report, then fail
        traceback.print_exc()
        summary["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(summary))
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
