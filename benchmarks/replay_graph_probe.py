"""A warm member batch eagerly and through `MemberGraphs` on one capture: what the graph saves (issue 32: the
members are launch-bound)

    python benchmarks/replay_graph_probe.py \
        [--point warm-hybrid-1b_mode-replay-uncheckpointed-bf16lora_length-32768_count-2] [--repeats 6] --out F

For the named `experiments/peers.yaml` h200 point: one capture, then the point's members (its G responses in
batches of k, their GRPO losses) replayed forward and backward eagerly, --repeats times; then the same batches
through `longstraw.core.member_graphs.MemberGraphs` (recorded by the first call, launched by the others, the state
and inputs copied in each time, as a step with `replay.cuda_graph` does), --repeats times. Prints the eager and
graph seconds, their ratio, and how far the graph's LoRA gradients are from the eager ones (largest relative
difference), beside how far two eager runs are from each other; or, where the graph fails, the error that stopped
it. The last stdout line is one JSON object (--out).
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch

from longstraw.core import grpo
from longstraw.core.member_graphs import MemberGraphs
from longstraw.core.step import group_objective
from longstraw.core.transaction import capture, replay_members
from longstraw.families import adapter_for
from longstraw.harness.plan import point_config
from longstraw.kinds.common import policy_and_prompt, seeded_group
from longstraw.measure.memory import GraphBytesMeter, PhaseRecorder
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
    responses, rewards = seeded_group(cfg, cfg.grpo.num_generations, vocab, device)
    k, checkpointed = cfg.replay.micro_batch, cfg.replay.checkpoint_layers
    state = capture(model, prompt, **cfg.capture.kwargs())
    _, advantages, weights = group_objective(responses, rewards, cfg.grpo)
    objective = grpo.GroupObjective([None] * len(responses), None, advantages, weights, cfg.grpo)
    batches = [range(s, min(s + k, len(responses))) for s in range(0, len(responses), k)]
    params = [p for p in model.parameters() if p.requires_grad]

    def eager():
        for p in params:
            p.grad = None
        for b in batches:
            logps = replay_members(
                model, state, [responses[i] for i in b], checkpoint_layers=checkpointed, ids_checked=True
            )
            torch.stack([objective.member_loss(i, lp) for i, lp in zip(b, logps)]).sum().backward()

    graphs, recorder = MemberGraphs(), PhaseRecorder(device)

    def graphed():
        for p in params:
            p.grad = None
        with GraphBytesMeter() as meter:
            graphs.run(adapter_for(model), state, responses, batches, objective, checkpointed, recorder, meter)

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
        graphed()  # records
        result["graph_seconds"] = seconds_each(graphed, device, args.repeats)
        result["graph_gradient_max_relative_difference"] = largest_relative_difference(
            [p.grad for p in params], eager_grads
        )
        result["graph_over_eager"] = min(result["graph_seconds"]) / min(result["eager_seconds"])
    except Exception as error:  # the probe's finding: what stops a graph
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
            else f"graph failed:\n{result['graph_error']}"
        ),
        flush=True,
    )
    write_json_atomic(args.out, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
