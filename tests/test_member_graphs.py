"""Replayed members as a recorded CUDA graph (`longstraw.core.member_graphs`): each step's gradient is the eager
step's for that step's own prompt, responses and rewards, whether the graph was recorded in it or launched from an
earlier step; what a graph cannot run is refused before any work."""

import pytest
import torch
from float64_reference import float64_gdn_states, float64_model
from grpo_reference import GradientRecorder
from tolerances import TOL64, float64_residue_tolerance, within

from longstraw.core import grpo
from longstraw.core.hf_reference import max_relative_error
from longstraw.core.member_graphs import MemberGraphs
from longstraw.core.step import StepOptions, grpo_step
from longstraw.models import build_model


def _group(seed, lengths, device="cpu", prompt_length=29):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 256, (prompt_length,), generator=g).to(device)
    responses = [torch.randint(0, 256, (n,), generator=g).to(device) for n in lengths]
    rewards = torch.rand(len(lengths), generator=g)
    return prompt, responses, rewards


@pytest.mark.cuda
@pytest.mark.numerics
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3_5"])
@pytest.mark.parametrize("checkpoint_layers", [False, True], ids=["plain", "checkpointed"])
def test_graphed_steps_give_each_steps_own_eager_gradient(preset, checkpoint_layers):
    # float64 on CUDA: three steps through one MemberGraphs against the eager step on the same inputs (the eager
    # replay is HF's conditional gradient: test_step, test_replay; HF's float64 lift fails on transformers 5.17's
    # rotary, the GPU box's, so the CUDA test compares with it instead). The second step has another prompt,
    # responses and rewards of the first's lengths, so it launches the first step's graph on copied inputs (a
    # stale state or buffer would give the first step's gradient, 100% off); the third has other lengths and records
    # again. Two batches of two members each step: the same sums in the same order, float64 rounding apart.
    model = float64_model(preset, seed=3).cuda()
    config = grpo.GRPOConfig(num_generations=4, beta=0.0, loss_type="grpo")
    graphs = MemberGraphs()
    steps = [(1, (3, 7, 1, 5)), (2, (3, 7, 1, 5)), (3, (4, 2, 6, 3))]
    with float64_gdn_states():
        for n, (seed, lengths) in enumerate(steps):
            prompt, responses, rewards = _group(seed, lengths, "cuda")
            runs = {}
            for name, kept in (("eager", None), ("graphed", graphs)):
                recorder = GradientRecorder(model)
                options = StepOptions(micro_batch=2, checkpoint_layers=checkpoint_layers)
                step = grpo_step(model, prompt, responses, rewards, recorder, config, options, graphs=kept)
                runs[name] = step.metrics, recorder.grads
            (eager, expected), (graphed, grads) = runs["eager"], runs["graphed"]
            assert graphed["member_graph_records"] == [1, 1, 2][n]
            assert ("graph_record" in graphed["phases"]) == (n != 1)
            # the same saved tensors, but the graph's buffers: each member's advantage and token weight (two float
            # buffers of G) and its loss mask (a bool a token)
            extra = 2 * 8 * len(lengths) + sum(lengths)
            assert abs(graphed["graph_bytes_peak"] - eager["graph_bytes_peak"]) <= extra
            assert eager["graph_bytes_peak"] > 0
            within(max_relative_error(grads, expected), TOL64, f"step {n}: max relative gradient error")
            within(abs(graphed["loss"] - eager["loss"]), TOL64 * max(abs(eager["loss"]), 1.0), f"step {n}: loss")


@pytest.mark.cuda
@pytest.mark.numerics
@pytest.mark.parametrize("masked", [False, True], ids=["whole", "masked"])
def test_padded_graphs_serve_groups_of_any_lengths_with_the_eager_gradient(masked):
    # a trainer's groups: sampled lengths change every step; padded to 8 tokens inside the graph, three groups of
    # other lengths launch one graph ("auto" k sized when recording), with or without loss masks (a multi-turn
    # trajectory's). Each gives, in float64 on CUDA: the eager step on the same padded members with the pads masked
    # out, in the graph's batches (the same shapes: TOL64), and the eager unpadded step within HF's float32 residue
    # (the rotary's angles are float32 in HF's module and its GEMM over another length rounds them otherwise: 2e-8
    # measured on an H100; so do the attention's float32 partials over batches of another shape: 1.2e-8)
    model = float64_model("tiny-llama", seed=5).cuda()
    config = grpo.GRPOConfig(num_generations=4, beta=0.0, loss_type="dapo")
    graphs = MemberGraphs(pad_to=8)
    for n, (seed, lengths) in enumerate([(1, (3, 8, 1, 5)), (2, (6, 2, 7, 4)), (3, (8, 8, 2, 1))]):
        prompt, responses, rewards = _group(seed, lengths, "cuda")
        g = torch.Generator().manual_seed(seed)
        masks = [torch.rand(k, generator=g).cuda() < 0.7 for k in lengths] if masked else None
        whole = masks or [torch.ones(k, dtype=torch.bool, device="cuda") for k in lengths]
        padded = [torch.nn.functional.pad(r, (0, 8 - r.numel()), value=int(prompt[-1])) for r in responses]
        padded_masks = [torch.nn.functional.pad(m, (0, 8 - m.numel()), value=False) for m in whole]
        runs = {}
        for name, ids, kept, given in (  # the graph first: the eager steps take the k its recording chose
            ("graphed", responses, graphs, masks),
            ("eager", responses, None, masks),
            ("eager padded", padded, None, padded_masks),
        ):
            recorder = GradientRecorder(model)
            options = StepOptions(micro_batch="auto" if kept else graphs.micro_batch)
            step = grpo_step(model, prompt, ids, rewards, recorder, config, options, graphs=kept, loss_masks=given)
            runs[name] = step.metrics, recorder.grads
        graphed, grads = runs["graphed"]
        assert graphed["member_graph_records"] == 1 and graphed["micro_batch"] == graphs.micro_batch >= 1
        assert graphed["response_tokens"] == [int(m.sum()) for m in whole]  # the loss-bearing tokens
        for name, tolerance in (("eager padded", TOL64), ("eager", float64_residue_tolerance(False))):
            metrics, expected = runs[name]
            within(max_relative_error(grads, expected), tolerance, f"group {n}, {name}: max relative gradient error")
            loss_error = abs(graphed["loss"] - metrics["loss"])
            within(loss_error, tolerance * max(abs(metrics["loss"]), 1.0), f"group {n}, {name}: loss")
    with pytest.raises(ValueError, match="a response of 9 tokens exceeds the graph's 8"):
        prompt, responses, rewards = _group(4, (9, 1, 1, 1), "cuda")
        grpo_step(model, prompt, responses, rewards, GradientRecorder(model), config, graphs=graphs)


def test_a_padded_objective_gives_each_members_unpadded_loss():
    # what a padded graph computes per member, on the CPU: the unpadded member's loss (response_loss, TRL's terms:
    # test_grpo), whatever the pads' log-probs hold (inf included), with and without a loss mask; float64 sums
    # of the same terms and zeros
    from longstraw.core.member_graphs import padded_objective

    g = torch.Generator().manual_seed(0)
    lengths, padded = [3, 5, 1], [6, 6, 6]
    config = grpo.GRPOConfig(num_generations=3, beta=0.0, loss_type="dapo")
    logps = [-torch.rand(n, generator=g, dtype=torch.float64) for n in lengths]
    old = [lp + 0.1 * torch.randn(n, generator=g, dtype=torch.float64) for lp, n in zip(logps, lengths)]
    for masks in (None, [torch.tensor(m) for m in ([True, False, True], [False] * 4 + [True], [True])]):
        counts = lengths if masks is None else [int(m.sum()) for m in masks]
        objective = grpo.GroupObjective(
            old, None, torch.tensor([0.5, -1.0, 2.0]), grpo.token_weights(counts, config), config, masks
        )
        padded_one = padded_objective(objective, lengths, padded, torch.device("cpu"))
        for i, lp in enumerate(logps):
            pads = torch.full((padded[i] - lengths[i],), float("-inf"), dtype=torch.float64)
            got = padded_one.member_loss(i, torch.cat([lp, pads]))
            expected = objective.member_loss(i, lp)
            within(abs(float(got - expected)), TOL64 * abs(float(expected)), f"member {i}, masks {masks}")


@pytest.mark.cuda
def test_a_graphed_bf16_step_on_the_cuda_kernels_gives_the_eager_steps_gradient():
    # bf16 with flash/cuDNN attention and fla's GDN rule: gross faults only (the backward kernels' atomics make
    # two eager runs differ at bf16 rounding); the float64 test above is the exact one
    model = build_model("tiny-qwen3_5", seed=1, dtype=torch.bfloat16, device="cuda", head_dim=64)
    prompt, responses, rewards = _group(4, (200, 130, 170, 90), "cuda", prompt_length=1500)
    config = grpo.GRPOConfig(num_generations=4, beta=0.0)
    options = StepOptions(micro_batch=2, capture={"chunk_size": 512})
    runs = {}
    graphs = MemberGraphs()
    for name, kept in (("eager", None), ("recorded", graphs), ("launched", graphs)):
        recorder = GradientRecorder(model)
        metrics = grpo_step(model, prompt, responses, rewards, recorder, config, options, graphs=kept).metrics
        runs[name] = (metrics, {n: g.float() for n, g in recorder.grads.items()})
    assert graphs.records == 1
    for name in ("recorded", "launched"):
        assert max_relative_error(runs[name][1], runs["eager"][1]) < 0.05
        assert abs(runs[name][0]["loss"] - runs["eager"][0]["loss"]) <= 0.05 * abs(runs["eager"][0]["loss"])


def test_graphs_are_refused_before_any_work_where_they_cannot_run():
    model = build_model("tiny-llama", seed=0)
    prompt, responses, rewards = _group(0, (3, 4))
    config = grpo.GRPOConfig(num_generations=2, beta=0.0)
    options = StepOptions(mode="hold_all")
    with pytest.raises(ValueError, match=r"replay.cuda_graph: .*not a CUDA device; mode 'hold_all'") as error:
        grpo_step(
            model,
            prompt,
            responses,
            rewards,
            torch.optim.SGD(model.parameters()),
            config,
            options,
            graphs=MemberGraphs(),
        )
    assert all(p.grad is None for p in model.parameters()), error.value
    with pytest.raises(TypeError, match="graphs must be a MemberGraphs"):
        grpo_step(model, prompt, responses, rewards, torch.optim.SGD(model.parameters()), config, graphs=object())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mode": "naive"}, r"mode 'naive' \(mode replay only\); device 'cpu'"),
        ({"replay": {"cuda_graph": True, "micro_batch": "auto"}}, r"device 'cpu' \(a CUDA device only\)$"),
        ({"kind": "capacity"}, r"kind 'capacity' \(kind step or learning only\)"),
    ],
)
def test_a_point_refuses_cuda_graphs_it_cannot_run(change, message):
    from longstraw.harness.plan import resolve

    point = {"name": "p", "kind": "step", "mode": "replay", "replay": {"cuda_graph": True}, **change}
    with pytest.raises(ValueError, match=r"replay.cuda_graph: the members cannot run .*" + message):
        resolve(point, "p.yaml")
