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
from dataclasses import replace

import torch

from longstraw.core.transaction import capture, replay_members
from longstraw.harness.plan import expand, load_experiment
from longstraw.kernels.paged_attention import forward_kernel
from longstraw.kinds.common import optimizer_for, policy_and_prompt, seeded_group
from longstraw.measure.kernel_profile import kernel_profile
from longstraw.measure.memory import PhaseRecorder
from longstraw.measure.timing import seconds_each


def timed(fn, device, repeats: int = 1):
    """(first seconds, median of the next `repeats - 1`, or None) of `fn()`, synchronised."""
    seconds = seconds_each(fn, device, repeats)
    return seconds[0], (statistics.median(seconds[1:]) if len(seconds) > 1 else None)


def replay_group(model, state, responses, k):
    for start in range(0, len(responses), k):
        logps = replay_members(model, state, responses[start : start + k])
        torch.stack([lp.sum() for lp in logps]).sum().backward()
    for p in model.parameters():
        p.grad = None


def member_profile(model, state, response, device) -> dict:
    """One warm member (k=1) under torch.profiler: kernels launched, their summed time, the wall."""
    replay_group(model, state, [response], 1)
    return kernel_profile(lambda: replay_group(model, state, [response], 1), device)


def measure(cfg, device) -> dict:
    out = {
        "point": cfg.name,
        "prompt_length": cfg.prompt.length,
        "G": cfg.grpo.num_generations,
        "response_length": cfg.responses.length,
    }
    rows = []
    for adapters, kernels in (("float32", ("cudnn", "flash")), ("model", ("cudnn",))):
        point = replace(cfg, model=replace(cfg.model, lora=replace(cfg.model.lora, dtype=adapters)))
        model, vocab, prompt = policy_and_prompt(point, PhaseRecorder(device))
        responses, rewards = seeded_group(point, point.grpo.num_generations, vocab, device)
        G, held = len(responses), {}

        def fresh_capture():
            held.pop("state", None)  # the previous state freed first, as a step would
            held["state"] = capture(model, prompt, **point.capture.kwargs())

        for kernel in kernels:
            with forward_kernel(kernel):
                out[f"capture_first_{kernel}_{adapters}"], out[f"capture_warm_{kernel}_{adapters}"] = timed(
                    fresh_capture, device, 3
                )
                for k in (1, G):
                    first, warm = timed(lambda: replay_group(model, held["state"], responses, k), device, 3)
                    rows.append(
                        {
                            "kernel": kernel,
                            "k": k,
                            "lora": adapters,
                            "first": first,
                            "warm": warm,
                            "warm_per_member": warm / G,
                        }
                    )
                    print(
                        f"{cfg.prompt.length} {kernel} k={k} lora {adapters}: first {first:.3f} s, warm "
                        f"{warm:.3f} s ({warm / G * 1e3:.1f} ms a member)",
                        flush=True,
                    )
        out[f"profile_member_lora_{adapters}"] = member_profile(model, held.pop("state"), responses[0], device)
        if adapters == "float32":
            out.update(prefix_grouper_steps(model, point, prompt, responses, rewards, device))
        model = None  # freed before the next adapter dtype's
    out["replays"] = rows
    return out


def prefix_grouper_steps(model, cfg, prompt, responses, rewards, device) -> dict:
    """PrefixGrouper's first and warm step on the same model and group (or why it could not run)."""
    try:
        from longstraw.peers import build_peer

        peer = build_peer("prefix_grouper", model, cfg.grpo, max_response_length=cfg.responses.length)
        optimizer = optimizer_for(model, cfg)
        first, warm = timed(lambda: peer.step(prompt, responses, rewards, optimizer), device, 3)
        return {"prefix_grouper_first": first, "prefix_grouper_warm": warm}
    except Exception as exc:  # the peers' extra absent: say so, keep the rest
        return {"prefix_grouper_error": f"{type(exc).__name__}: {exc}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--point",
        nargs="+",
        default=["warm-dense-1b_mode-replay_length-8192_count-8", "warm-dense-1b_mode-replay_length-32768_count-8"],
    )
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
