"""Where a dense replay step's time goes, warm and cold, in one process (issue 32's profile).

    python benchmarks/replay_speed_profile.py [--point warm-dense-1b_mode-replay_length-8192_count-8 ...]

For each named `experiments/peers.yaml` h200 point (its model, prompt, G responses): the capture's first and
warm seconds; the G members' forward+backward replayed k at a time (k = 1 and k = G) under each paged-attention
forward kernel ("cudnn": cuDNN blocks where they apply, "flash": flash throughout), first call and warm, with
the LoRA adapters in float32 (peft's default) and in the model's dtype; one warm member under torch.profiler
(kernel launches, summed kernel time against the wall: how launch-bound a member is); and PrefixGrouper's
warm step on the same model and group. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from longstraw.core.transaction import capture, replay_members
from longstraw.harness.plan import expand, load_experiment
from longstraw.kernels.paged_attention import forward_kernel
from longstraw.kinds.common import optimizer_for, policy_and_prompt, seeded_group
from longstraw.measure.memory import PhaseRecorder, synchronize


def timed(fn, device, repeats: int = 1):
    """(first seconds, median of the next `repeats - 1`, or None) of `fn()`, synchronised."""
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds[0], (statistics.median(seconds[1:]) if len(seconds) > 1 else None)


def lora_parameters(model):
    return [p for n, p in model.named_parameters() if "lora_" in n]


def replay_group(model, state, responses, k):
    for start in range(0, len(responses), k):
        logps = replay_members(model, state, responses[start:start + k])
        torch.stack([lp.sum() for lp in logps]).sum().backward()
    for p in model.parameters():
        p.grad = None


def member_profile(model, state, response, device) -> dict:
    """One warm member (k=1) under torch.profiler: kernels launched, their summed time, the wall."""
    from torch.profiler import ProfilerActivity, profile

    replay_group(model, state, [response], 1)
    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        replay_group(model, state, [response], 1)
        synchronize(device)
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_seconds = sum(e.device_time for e in kernels) / 1e6
    top = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:12]
    return {"wall_seconds": wall, "kernels": len(kernels), "kernel_seconds": kernel_seconds,
            "busy_fraction": kernel_seconds / wall,
            "top": [{"name": e.key[:90], "calls": e.count, "seconds": e.device_time_total / 1e6} for e in top]}


def measure(cfg, device) -> dict:
    recorder = PhaseRecorder(device)
    model, vocab, prompt = policy_and_prompt(cfg, recorder)
    responses, rewards = seeded_group(cfg, cfg.responses.count, vocab, device)
    G = len(responses)
    out = {"point": cfg.name, "prompt_length": cfg.prompt.length, "G": G, "response_length": cfg.responses.length}
    chunk = cfg.capture.kwargs()
    holder = {}

    def do_capture():
        holder["state"] = None
        holder["state"] = capture(model, prompt, **chunk)

    rows = []
    for kernel in ("cudnn", "flash"):
        with forward_kernel(kernel):
            out[f"capture_first_{kernel}"], out[f"capture_warm_{kernel}"] = timed(do_capture, device, 3)
            state = holder["state"]
            for k in (1, G):
                first, warm = timed(lambda: replay_group(model, state, responses, k), device, 3)
                rows.append({"kernel": kernel, "k": k, "lora": "float32", "first": first, "warm": warm,
                             "warm_per_member": warm / G})
                print(f"{cfg.prompt.length} {kernel} k={k} lora fp32: first {first:.3f} s, warm {warm:.3f} s "
                      f"({warm / G * 1e3:.1f} ms a member)", flush=True)
    out["profile_member_lora_float32"] = member_profile(model, state, responses[0], device)
    for p in lora_parameters(model):
        p.data = p.data.to(torch.bfloat16 if cfg.model.dtype == "bfloat16" else p.dtype)
    del state
    state = capture(model, prompt, **chunk)  # the weights changed: a state of the new ones
    for k in (1, G):
        first, warm = timed(lambda: replay_group(model, state, responses, k), device, 3)
        rows.append({"kernel": "cudnn", "k": k, "lora": "model dtype", "first": first, "warm": warm,
                     "warm_per_member": warm / G})
        print(f"{cfg.prompt.length} cudnn k={k} lora {cfg.model.dtype}: first {first:.3f} s, warm {warm:.3f} s "
              f"({warm / G * 1e3:.1f} ms a member)", flush=True)
    out["profile_member_lora_model_dtype"] = member_profile(model, state, responses[0], device)
    for p in lora_parameters(model):
        p.data = p.data.float()
    out["replays"] = rows
    del state, holder["state"]
    try:
        from longstraw.peers import build_peer

        peer = build_peer("prefix_grouper", model, cfg.grpo, max_response_length=cfg.responses.length)
        optimizer = optimizer_for(model, cfg)
        out["prefix_grouper_first"], out["prefix_grouper_warm"] = timed(
            lambda: peer.step(prompt, responses, rewards, optimizer), device, 3)
    except Exception as exc:  # the peers' extra absent: say so, keep the rest
        out["prefix_grouper_error"] = f"{type(exc).__name__}: {exc}"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--point", nargs="+", default=["warm-dense-1b_mode-replay_length-8192_count-8",
                                                       "warm-dense-1b_mode-replay_length-32768_count-8"])
    parser.add_argument("--profile", default="h200")
    args = parser.parse_args()
    points = expand(load_experiment("experiments/peers.yaml"), args.profile)
    results = []
    for name in args.point:
        cfg = points[name]["config"]
        results.append(measure(cfg, torch.device(cfg.model.device)))
        print(json.dumps(results[-1]), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(json.dumps({"rows": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
