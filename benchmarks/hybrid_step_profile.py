"""Where hybrid-1b's warm replay step goes (issue 32's FLOP-floor target), under each differentiable GDN rule.

    python benchmarks/hybrid_step_profile.py [--point warm-hybrid-1b_mode-replay_length-32768_count-2] \
        [--norms fused hf] [--lora fused in-place merged] [--repeats 3] [--chunk-sizes 8192 32768] [--top 20] \
        [--sources] --out F

For the named `experiments/peers.yaml` h200 point (its model, prompt, G responses, k and checkpointing): for each
rule of `gated_delta_rule` ("auto": fla's chunk kernels forward and backward where checked on this device; "kept":
fla's kernels with w, the chunk states and corrected values kept from the forward for the backward; "torch": the
torch chunk rule), with the layers' norms fused (fla's kernels, as the package runs them on CUDA) or HF's (--norms
fused hf), and with LoRA's update fused into lora_B's GEMM where the adapters have the base's dtype (as the package
runs it), added in place or on the merged weight (--lora fused in-place merged; `longstraw.models.lora_linear`): the
capture's (at the point's chunk size and at each of --chunk-sizes; the dropout check made once before, as a step
makes it) and the G members' replay's seconds, --repeats of each, and each phase once more under torch.profiler
(kernels, busy fraction, the `--top` ops and kernels by device time and by launches, their seconds by kind
(`kernel_kind`: gemm, attention, the GDN rule, conv, norm ...); with --sources, the source lines and backward nodes
that launched them: `longstraw.measure.kernel_profile.launch_sources`); and whether fla's backward passed its check
here. The last stdout line is one JSON object, also written to --out. The point comes from
`experiments/peers.yaml`'s plan, which refuses its peer points where the peers are not installed: on the GPU box
carry `.whl_peers` (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import torch

from longstraw.core.transaction import capture, check_deterministic, deterministic_checked, replay_members
from longstraw.families.base import unwrap_causal_lm
from longstraw.harness.plan import point_config
from longstraw.kernels import gated_rms_norm as gated_rms_norm_module
from longstraw.kernels import rms_norm as rms_norm_module
from longstraw.kernels.gdn import differentiable_rule, fla_backward_trusted
from longstraw.kinds.common import compute_dtype, policy_and_prompt, seeded_group
from longstraw.measure.kernel_profile import kernel_profile, launch_sources
from longstraw.measure.memory import PhaseRecorder
from longstraw.measure.provenance import emit
from longstraw.measure.timing import seconds_each
from longstraw.models import lora_linear


@contextlib.contextmanager
def norms_as(norms: str):
    """ "fused": the layers' norms as the package runs them (fla's fused kernels on CUDA); "hf": HF's modules."""
    if norms == "fused":
        yield
        return
    with (
        mock.patch.object(rms_norm_module, "_fla_usable", return_value=False),
        mock.patch.object(gated_rms_norm_module, "_fla_norm_usable", return_value=False),
    ):
        yield


def lora_as(lora: str):
    """ "fused": LoRA as the package runs it; "in-place": the update added in place even where it could be fused;
    "merged": under autograd on the merged weight (`lora_linear.lora_update("merged")`)."""
    if lora == "merged":
        return lora_linear.lora_update("merged")
    return (
        contextlib.nullcontext() if lora == "fused" else mock.patch.object(lora_linear, "fusable", return_value=False)
    )


def measure(fresh_capture, replay_group, device, chunk_sizes, top: int, sources: bool, repeats: int) -> dict:
    """First and warm seconds of the capture and the members' replay, each profiled once warm; and the capture at
    each of `chunk_sizes`."""
    row = {
        "capture_seconds": seconds_each(fresh_capture, device, repeats),
        "replay_seconds": seconds_each(replay_group, device, repeats),
    }
    row["capture_profile"] = kernel_profile(fresh_capture, device, top=top)
    row["replay_profile"] = kernel_profile(replay_group, device, top=top)
    if sources:
        row["capture_sources"] = launch_sources(fresh_capture, device, top=top)
        row["replay_sources"] = launch_sources(replay_group, device, top=top)
    for chunk in chunk_sizes:
        row[f"capture_chunk_{chunk}"] = {
            "seconds": seconds_each(lambda: fresh_capture(chunk_size=chunk), device, repeats),
            "profile": kernel_profile(lambda: fresh_capture(chunk_size=chunk), device, top=top),
        }
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--point", default="warm-hybrid-1b_mode-replay_length-32768_count-2")
    parser.add_argument("--rules", nargs="+", default=["auto", "torch"])
    parser.add_argument("--norms", nargs="+", default=["fused"], choices=["fused", "hf"])
    parser.add_argument("--lora", nargs="+", default=["fused"], choices=["fused", "in-place", "merged"])
    parser.add_argument("--repeats", type=int, default=3, help="timed captures and replays of each setting")
    parser.add_argument("--chunk-sizes", nargs="*", type=int, default=[], help="capture chunk sizes to compare")
    parser.add_argument("--top", type=int, default=20, help="ops and kernels listed per profile")
    parser.add_argument("--sources", action="store_true", help="where each phase's launches come from")
    parser.add_argument("--profile", default="h200")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cfg = point_config("experiments/peers.yaml", args.profile, args.point)
    device = torch.device(cfg.model.device)
    model, vocab, prompt = policy_and_prompt(cfg, PhaseRecorder(device))
    responses, _ = seeded_group(cfg, cfg.grpo.num_generations, vocab, device)
    k, checkpointed = cfg.replay.micro_batch, cfg.replay.checkpoint_layers
    config = unwrap_causal_lm(model).config
    gdn = getattr(config, "linear_num_key_heads", None)
    out = {
        "point": args.point,
        "k": k,
        "checkpoint_layers": checkpointed,
        "rules": {},
    }
    held = {}

    check_deterministic(model)  # once, as a step checks before its work; its captures then skip the module walk

    def fresh_capture(**override):
        held.pop("state", None)
        with deterministic_checked(model):
            held["state"] = capture(model, prompt, **{**cfg.capture.kwargs(), **override})

    def replay_group():
        for start in range(0, len(responses), k):
            logps = replay_members(model, held["state"], responses[start : start + k], checkpoint_layers=checkpointed)
            torch.stack([lp.sum() for lp in logps]).sum().backward()
        for p in model.parameters():
            p.grad = None

    for rule in args.rules:
        for norms in args.norms:
            for lora in args.lora:
                # a box without a Triton cache autotunes fla's kernels inside the first timings (minutes): say so
                print(f"rule {rule}, {norms} norms, LoRA {lora}: {args.repeats} captures and replays", flush=True)
                with differentiable_rule(rule), norms_as(norms), lora_as(lora):
                    row = measure(
                        fresh_capture, replay_group, device, args.chunk_sizes, args.top, args.sources, args.repeats
                    )
                lora_name = {"fused": "", "in-place": ", LoRA in place", "merged": ", LoRA merged"}[lora]
                name = rule + (", HF norms" if norms == "hf" else "") + lora_name
                out["rules"][name] = row
                for phase in ("capture", "replay"):
                    kinds = row[f"{phase}_profile"]["by_kind"]
                    print(f"{name}, {phase} by kind: " + ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in kinds.items()))
                print(
                    f"{name}: capture {[round(s, 3) for s in row['capture_seconds']]} s, replay "
                    f"{[round(s, 3) for s in row['replay_seconds']]} s; busy capture "
                    f"{row['capture_profile']['busy_fraction']:.2f}, replay "
                    f"{row['replay_profile']['busy_fraction']:.2f}; kernels capture "
                    f"{row['capture_profile']['kernels']}, replay {row['replay_profile']['kernels']}"
                    + "".join(
                        f"; capture at chunk {c}: {row[f'capture_chunk_{c}']['seconds']}" for c in args.chunk_sizes
                    ),
                    flush=True,
                )
    # asked after the runs: the check tunes fla's backward kernels at its first caller's size, the members' here
    out["fla_backward_trusted"] = gdn is not None and fla_backward_trusted(
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        compute_dtype(cfg),
        str(device),
    )
    emit(out, device, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
