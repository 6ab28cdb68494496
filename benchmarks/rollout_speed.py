"""Decoding from the resident state against HF's decode and the memory-bandwidth floor, in one run

    python benchmarks/rollout_speed.py --preset smollm2-135m-shape --length 16384 --group 8 --device cuda --out F
    python benchmarks/rollout_speed.py --preset hybrid-1b --length 1048576 --group 8 --device cuda --hf none --out F
    python benchmarks/rollout_speed.py --preset smollm2-135m-shape --length 16384 --device cpu --counts-only --out F

One model of the preset (random weights, bf16 on CUDA, float32 on the CPU; LoRA r16 on the attention projections,
random B, as a policy in training), one random prompt of --length tokens captured, then G rows decoding from it:

- ours, a decoding step eagerly (`training.rollout.Decoder.step`, the plain reference) and through the recorded
  CUDA graph (`DecodeGraph`), on CUDA with a dense layer's norms folded into its projections
  (`families.folded_norms`; --unfolded: without, the step before that fold), the rotary read from a table and the
  draw, log-prob and writes in two Triton launches (`rollout.RotaryTable`, `kernels.sampling_triton`; --plain-tail:
  the rotary computed each step and the torch tail, the step before them), with --launches dependent (the
  default) the attention's merge, the rotary-and-append and the SwiGLU programmatic dependent launches on Hopper
  (`kernels.dependent_launch`; serial: each after the one before): ms a step
  over --steps steps after two warm-up steps, and whether both give the same tokens from one seed; and one whole
  `sample()` call of --tokens tokens (its one-off costs: merged LoRA weights, the graph's recording); then a later
  call's wall time, plain (those costs again) and through a `DecodeSession` an earlier call built (the state copied
  in, the weights refreshed in place, only launches), as a trainer's steps;
- HF's eager decode on the same policy (peft's LoRA layers unmerged, as a peft model generates): its own forward
  over the prompt into a `DynamicCache`, repeated to the G rows
  (`batch_repeat_interleave`), then one token a step;
- HF's static-cache decode under `torch.compile(mode="reduce-overhead")` (CUDA graphs): the G rows' prompt into a
  `StaticCache`, then one token a step (the error where it does not compile);
- the floor: the bytes a step must read (every weight once, the LM head included; the prompt's resident state once
  for all rows; each row's own pages and, on a GDN layer, its recurrent state read and written), over the device's
  copy bandwidth measured here (a large device-to-device copy: read + write bytes over its time);
- where a step's device time goes (CUDA): each kernel's launches and summed duration in one eager step;
- operations a step: top-level ATen ops (the CPU's count) and kernel launches (CUDA's: the runtime's launch calls
  and graph launches), per step and per layer, for ours eagerly, ours graphed and HF's eager step, and for one
  replayed member (forward and backward of a --member-tokens response, as a step replays it).

Prints each number and the ratios (ours over the floor, over HF compiled, over HF eager); the last stdout line is
the JSON written to --out, with provenance. --counts-only skips the timings (the operation counts on any device).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from longstraw.core.transaction import capture, replay
from longstraw.families import adapter_for
from longstraw.kernels.dependent_launch import decode_launches
from longstraw.measure.provenance import provenance
from longstraw.measure.timing import copy_bandwidth, seconds_per_call, synchronize
from longstraw.models import build_model
from longstraw.models.lora import apply_lora
from longstraw.results import write_json_atomic
from longstraw.training.rollout import DecodeGraph, Decoder, DecodeSession, SamplingConfig, decoding, sample

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")


def _policy(args, device):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.preset, seed=0, dtype=dtype, device=device)
    model = apply_lora(model, r=16, init_random=True)
    model.to(device)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.length,), generator=torch.Generator().manual_seed(1)).to(device)
    return model, prompt


def _folded(args) -> bool | None:
    return False if args.unfolded else None  # None: the default (on CUDA)


def _tail(args) -> dict:
    """The rotary table and the fused sampler off (--plain-tail), else as the defaults have them (on CUDA)."""
    return dict(rotary_table=False, fused_sampler=False) if args.plain_tail else {}


def _config(args, tokens, cuda_graph=None) -> SamplingConfig:
    # no stop ids: every row decodes every token, so steps are comparable across systems
    return SamplingConfig(
        args.group, tokens, temperature=1.0, seed=0, cuda_graph=cuda_graph, folded_norms=_folded(args), **_tail(args)
    )


def _ours(model, state, args, device) -> dict:
    """Ours eagerly and graphed (ms a step), their tokens from one seed, and one whole `sample()` call."""
    adapter, out = adapter_for(model), {}
    capacity = args.steps + 4  # the warm-up steps and, graphed, the recording's warm-up step and one launch
    with decoding(adapter, folded_norms=_folded(args)):
        eager = Decoder(adapter, state, _config(args, capacity, cuda_graph=False))
        out["eager_step_seconds"] = seconds_per_call(eager.step, device, args.steps, warmup=2)
        if device.type == "cuda":
            graphed = Decoder(adapter, state, _config(args, capacity, cuda_graph=True))
            graph = DecodeGraph(graphed)  # its warm-up is the first step
            graph.step()
            out["graph_step_seconds"] = seconds_per_call(graph.step, device, args.steps - 1, warmup=2)
            steps = min(int(graphed.clock.step_1), int(eager.clock.step_1))  # the steps both decoded
            same = torch.equal(graphed.tokens_GT[:, :steps], eager.tokens_GT[:, :steps])
            out["graph_tokens_equal_eager"] = bool(same)
    synchronize(device)
    start = time.perf_counter()
    rollouts = sample(model, state, _config(args, args.tokens))
    synchronize(device)
    out["sample_call"] = {
        "tokens": args.tokens,
        "seconds": time.perf_counter() - start,
        "graphed": rollouts.graphed,
        "steps": rollouts.steps,
    }
    out["later_call"] = _later_calls(model, state, args, device)
    return out


def _later_calls(model, state, args, device, repeats: int = 3) -> dict:
    """A later `sample()` call's seconds (the best of `repeats`), plain and through a session its first call built."""
    session, config = DecodeSession(), _config(args, args.tokens)
    sample(model, state, config, session=session)
    out = {}
    for name, kwargs in (("plain", {}), ("session", {"session": session})):
        seconds = []
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            sample(model, state, config, **kwargs)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        out[f"{name}_seconds"] = min(seconds)
    return out


def _hf_prefilled(model, prompt, group: int, cache):
    """`cache` after HF's own forward over the prompt minus its last token for `group` equal rows: what one row's
    cache repeated to `group` rows holds, for every layer type (HF's linear-attention layers, the hybrids' GDN, have
    no `batch_repeat_interleave`)."""
    with torch.no_grad():
        model(prompt[None, :-1].expand(group, -1), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def _hf_prompt_cache(model, prompt, group: int):
    """The G rows' prompt in HF's DynamicCache."""
    from transformers import DynamicCache

    return _hf_prefilled(model, prompt, group, DynamicCache(config=model.config))


def _hf_eager_step(model, prompt, group):
    """One HF decode step (its forward of the G rows' next token over the growing cache), as a callable."""
    cache = _hf_prompt_cache(model, prompt, group)
    tokens = prompt[-1:].expand(group, 1).contiguous()

    def step():
        with torch.no_grad():
            logits = model(tokens, past_key_values=cache, use_cache=True).logits
        tokens.copy_(logits[:, -1].argmax(-1, keepdim=True))

    return step


def _hf_compiled_step(model, prompt, args):
    """HF's static-cache decode under torch.compile (mode reduce-overhead): the G rows' prompt in a StaticCache."""
    from transformers import StaticCache

    P, G = prompt.numel() - 1, args.group
    cache = _hf_prefilled(model, prompt, G, StaticCache(config=model.config, max_cache_len=P + args.steps + 8))
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    tokens = prompt[-1:].expand(G, 1).contiguous()
    position = torch.tensor([P], device=prompt.device)

    def step():
        with torch.no_grad():
            logits = forward(
                input_ids=tokens,
                past_key_values=cache,
                cache_position=position,
                position_ids=position[None].expand(G, 1),
            ).logits
        tokens.copy_(logits[:, -1].argmax(-1, keepdim=True))
        position.add_(1)

    return step


def _hf(model, prompt, args, device) -> dict:
    out = {}
    if args.hf == "none":
        return {"skipped": "--hf none"}
    # HF decodes the same policy, peft's LoRA layers unmerged as a peft model generates
    for name, build in (("eager", lambda: _hf_eager_step(model, prompt, args.group)),) + (
        (("compiled", lambda: _hf_compiled_step(model, prompt, args)),) if device.type == "cuda" else ()
    ):
        try:
            out[f"{name}_step_seconds"] = seconds_per_call(build(), device, args.steps, warmup=2)
        except Exception as exc:  # a system that does not run here is a measured result, with its reason
            out[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:500]
            traceback.print_exc()
    return out


def _count(run, device) -> dict:
    """Top-level ATen ops and kernel launches of one call of `run` (warm: run once before)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        synchronize(device)
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if not _has_aten_parent(e)]
    launches = sum(1 for e in events if e.name in LAUNCHES)
    graphs = sum(1 for e in events if e.name == "cudaGraphLaunch")
    return {"aten_ops": len(top), "kernel_launches": launches - graphs, "graph_launches": graphs}


def _kernel_times(run, device, top: int = 24) -> dict:
    """Where one call of `run` spends the device's time: each kernel name's launches and summed duration (warm)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run()
    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        synchronize(device)
    by_name: dict[str, list] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            row = by_name.setdefault(event.name[:100], [0, 0.0])
            row[0] += 1
            row[1] += event.time_range.elapsed_us() * 1e-6
    rows = sorted(([name, n, s] for name, (n, s) in by_name.items()), key=lambda r: -r[2])
    return {"kernels": sum(r[1] for r in rows), "seconds": sum(r[2] for r in rows), "top": rows[:top]}


def _has_aten_parent(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def _counts(model, state, prompt, args, device) -> dict:
    adapter, layers = adapter_for(model), model.config.num_hidden_layers
    out = {}
    with decoding(adapter, folded_norms=_folded(args)):
        eager = Decoder(adapter, state, _config(args, 8, cuda_graph=False))
        out["ours_eager_step"] = _count(eager.step, device)
        if device.type == "cuda":
            graphed = Decoder(adapter, state, _config(args, 8, cuda_graph=True))
            out["ours_graph_step"] = _count(DecodeGraph(graphed).step, device)
            out["ours_eager_step_kernel_time"] = _kernel_times(eager.step, device)
    response = torch.randint(0, model.config.vocab_size, (args.member_tokens,), device=device)

    def member():
        replay(model, state, response).sum().backward()
        model.zero_grad(set_to_none=True)

    out["ours_replayed_member"] = _count(member, device)
    if device.type == "cuda":
        out["ours_replayed_member_kernel_time"] = _kernel_times(member, device)
    if args.hf != "none":
        out["hf_eager_step"] = _count(_hf_eager_step(model, prompt, args.group), device)
    for name, counts in out.items():
        if name.endswith("kernel_time"):
            continue
        counts["aten_ops_per_layer"] = counts["aten_ops"] / layers
        counts["kernel_launches_per_layer"] = counts["kernel_launches"] / layers
    return out


def _floor(model, state, args, device) -> dict:
    """The bytes a decoding step must read, and that over the copy bandwidth measured here."""
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    resident = sum(t.numel() * t.element_size() for e in state.layers for t in e.tensors())
    # a GDN layer's state is repeated per row and read and written each step; attention pages are read once
    per_row = sum(t.numel() * t.element_size() for e in state.layers if not hasattr(e, "k_BKPD") for t in e.tensors())
    decode_bytes = weights + resident + per_row * (2 * args.group - 1)
    out = {"weight_bytes": weights, "resident_bytes": resident, "step_bytes": decode_bytes}
    if device.type == "cuda":
        out["copy_bandwidth_bytes_per_second"] = copy_bandwidth(device)
        out["floor_seconds"] = decode_bytes / out["copy_bandwidth_bytes_per_second"]
    return out


def _ratios(result: dict) -> dict:
    ours, hf, floor = result.get("ours", {}), result.get("hf", {}), result.get("floor", {})
    later = ours.get("later_call", {})
    best = ours.get("graph_step_seconds", ours.get("eager_step_seconds"))
    pairs = {
        "ours_over_floor": (best, floor.get("floor_seconds")),
        "ours_over_hf_compiled": (best, hf.get("compiled_step_seconds")),
        "ours_over_hf_eager": (best, hf.get("eager_step_seconds")),
        "ours_eager_over_hf_eager": (ours.get("eager_step_seconds"), hf.get("eager_step_seconds")),
        "graph_speedup_over_eager": (ours.get("eager_step_seconds"), ours.get("graph_step_seconds")),
        "later_call_plain_over_session": (later.get("plain_seconds"), later.get("session_seconds")),
    }
    return {k: a / b for k, (a, b) in pairs.items() if a is not None and b}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m-shape")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="tokens of the whole sample() call")
    parser.add_argument("--steps", type=int, default=64, help="timed decoding steps")
    parser.add_argument("--member-tokens", type=int, default=16)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hf", choices=("both", "none"), default="both")
    parser.add_argument("--counts-only", action="store_true")
    parser.add_argument("--unfolded", action="store_true", help="decode without folding norms into projections")
    parser.add_argument(
        "--plain-tail", action="store_true", help="decode without the rotary table and the fused sampler"
    )
    parser.add_argument(
        "--launches",
        choices=("dependent", "serial"),
        default="dependent",
        help="dependent (the default): the decoding kernels that can start while the one before runs (Hopper) do",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    model, prompt = _policy(args, device)
    state = capture(model, prompt)
    result = {"preset": args.preset, "length": args.length, "group": args.group, "device": str(device)}
    result["unfolded"], result["plain_tail"] = args.unfolded, args.plain_tail
    result["launches"] = args.launches
    if device.type == "cuda":
        result["card"] = torch.cuda.get_device_name(device)
    result["provenance"] = provenance(device)
    sections = [("counts", lambda: _counts(model, state, prompt, args, device))]
    if not args.counts_only:
        sections += [
            ("floor", lambda: _floor(model, state, args, device)),
            ("ours", lambda: _ours(model, state, args, device)),
            ("hf", lambda: _hf(model, prompt, args, device)),
        ]
    for name, measure in sections:  # written after each, so a run cut off at its time limit keeps what it measured
        with decode_launches(result["launches"]):
            result[name] = measure()
        result["ratios"] = _ratios(result)
        write_json_atomic(args.out, result)
        print(json.dumps({name: result[name], "ratios": result["ratios"]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
