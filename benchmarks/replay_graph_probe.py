"""Can a warm member batch run as one CUDA graph, and what would it save? (issue 32: the members are launch-bound)

    python benchmarks/replay_graph_probe.py \
        [--point warm-hybrid-1b_mode-replay-uncheckpointed-bf16lora_length-32768_count-2] [--repeats 6] --out F

For the named `experiments/peers.yaml` h200 point: one capture, then the point's members (its G responses in
batches of k) replayed forward and backward eagerly, --repeats times; then the same batches captured once into a
`torch.cuda.CUDAGraph` over the fixed resident state and responses (after three warm-up runs on a side stream, as
torch's whole-network capture does) and replayed --repeats times. Prints the eager and graph seconds, their ratio,
and how far the graph's LoRA gradients are from the eager ones (largest relative difference), beside how far two eager
runs are from each other; or, where capture fails,
the error that stopped it. The probe that led to `longstraw.core.member_graphs` (a step's members as one graph kept
across steps, `replay.cuda_graph`); it times one batch on one capture. The last stdout line is one JSON object (--out).
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch

from longstraw.core.transaction import capture, replay_members
from longstraw.harness.plan import point_config
from longstraw.kinds.common import policy_and_prompt, seeded_group
from longstraw.measure.memory import PhaseRecorder
from longstraw.measure.provenance import provenance
from longstraw.measure.timing import seconds_each
from longstraw.results import write_json_atomic


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--point", default="warm-hybrid-1b_mode-replay-uncheckpointed-bf16lora_length-32768_count-2")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--profile", default="h200")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cfg = point_config("experiments/peers.yaml", args.profile, args.point)
    device = torch.device(cfg.model.device)
    model, vocab, prompt = policy_and_prompt(cfg, PhaseRecorder(device))
    responses, _ = seeded_group(cfg, cfg.grpo.num_generations, vocab, device)
    k, checkpointed = cfg.replay.micro_batch, cfg.replay.checkpoint_layers
    state = capture(model, prompt, **cfg.capture.kwargs())
    params = [p for p in model.parameters() if p.requires_grad]

    def members():
        for start in range(0, len(responses), k):
            logps = replay_members(
                model, state, responses[start : start + k], checkpoint_layers=checkpointed, ids_checked=True
            )
            torch.stack([lp.sum() for lp in logps]).sum().backward()

    def eager():
        for p in params:
            p.grad = None
        members()

    def largest_relative_difference(grads, reference):
        return max(float((g - r).norm() / r.norm().clamp_min(1e-30)) for g, r in zip(grads, reference))

    eager()
    result = {"point": args.point, "k": k, "eager_seconds": seconds_each(eager, device, args.repeats)}
    eager_grads = [p.grad.clone() for p in params]
    eager()  # the same batches again: how far eager runs differ from each other (atomics in the backward kernels)
    result["eager_repeat_gradient_max_relative_difference"] = largest_relative_difference(
        [p.grad for p in params], eager_grads
    )
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                eager()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        for p in params:
            p.grad = None
        with torch.cuda.graph(graph):
            members()
        result["graph_seconds"] = seconds_each(graph.replay, device, args.repeats)
        result["graph_gradient_max_relative_difference"] = largest_relative_difference(
            [p.grad for p in params], eager_grads
        )
        result["graph_over_eager"] = min(result["graph_seconds"]) / min(result["eager_seconds"])
    except Exception as error:  # the probe's finding: what stops a capture
        result["graph_error"] = "".join(traceback.format_exception(error)).strip()[-3000:]
    result["provenance"] = provenance(device)
    print(
        f"eager {[round(s, 4) for s in result['eager_seconds']]} s; "
        + (
            f"graph {[round(s, 4) for s in result['graph_seconds']]} s, "
            f"graph / eager {result['graph_over_eager']:.2f}, "
            f"gradients' largest relative difference {result['graph_gradient_max_relative_difference']:.2e} "
            f"(eager against eager {result['eager_repeat_gradient_max_relative_difference']:.2e})"
            if "graph_seconds" in result
            else f"graph capture failed:\n{result['graph_error']}"
        ),
        flush=True,
    )
    write_json_atomic(args.out, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
