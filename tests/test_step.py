"""grpo_step: serial replay accumulates exactly hold_all's gradient; naive gives HF's full-sequence one."""

import pytest
import torch
from float64_reference import float64_gdn_states, float64_model, hf_float64
from grpo_reference import GradientRecorder, batch_loss
from tolerances import TOL64, above, float32_tolerance, float64_residue_tolerance, logprob_tolerance, within

from longstraw import capture
from longstraw.core import grpo
from longstraw.core.hf_reference import (
    global_relative_error,
    hf_conditional_logprobs,
    hf_full_logprobs,
    max_relative_error,
)
from longstraw.core.step import StepOptions, grpo_step
from longstraw.models import build_model

PROMPT_TERM = 1e-2  # the conditional gradient alone is this far off the full-sequence one (measured 0.24)


def _step(model, prompt, responses, rewards, optimizer, config, state=None, capture_kwargs=None, **options):
    """grpo_step's metrics, with its options given as keywords."""
    options = StepOptions(capture=capture_kwargs or {}, **options)
    return grpo_step(model, prompt, responses, rewards, optimizer, config, options, state=state).metrics


def _group(seed=0, lengths=(3, 7, 1, 5)):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 256, (29,), generator=g)
    responses = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    return prompt, responses, torch.tensor([1.0, 0.0, 0.5, 0.25])


@pytest.mark.numerics
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_next"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_serial_replay_gradient_equals_hold_all(preset, loss_type):
    # float64 (float64_reference): one gradient summed in another order (1.3e-7 apart in float32); the float32
    # log-softmax and exp(A_log) see the same values in both modes
    model = float64_model(preset, seed=3)
    prompt, responses, rewards = _group()
    config = grpo.GRPOConfig(num_generations=4, beta=0.1, loss_type=loss_type)
    runs = {}
    with hf_float64(model), float64_gdn_states():
        for mode in ("replay", "hold_all"):
            recorder = GradientRecorder(model)
            metrics = _step(
                model, prompt, responses, rewards, recorder, config, mode=mode, capture_kwargs={"chunk_size": 8}
            )
            assert metrics["state_unchanged"]
            runs[mode] = (recorder.grads, metrics)
    within(max_relative_error(runs["replay"][0], runs["hold_all"][0]), TOL64, "max relative gradient error")
    loss = runs["hold_all"][1]["loss"]
    within(abs(runs["replay"][1]["loss"] - loss), TOL64 * max(abs(loss), 1.0), "loss")
    assert runs["hold_all"][1]["graph_bytes_peak"] > runs["replay"][1]["graph_bytes_peak"]


@pytest.mark.numerics
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_next"])
@pytest.mark.parametrize(
    "batching",
    [
        {"micro_batch": 2},
        {"micro_batch": 3},
        {"micro_batch": 4},
        {"micro_batch": "auto", "member_budget_bytes": 1 << 40},
        {"micro_batch": 2, "prefix_grad": True},
        {"micro_batch": 4, "checkpoint_layers": True},
    ],
    ids=["k2", "k3", "k4", "auto-all", "k2-exact", "k4-checkpointed"],
)
def test_members_replayed_in_batches_give_the_serial_gradient(preset, batching):
    # float64 (float64_reference): the same gradient summed in another order. Responses of 3, 7, 1 and 5 tokens,
    # so every batch pads; k=3 leaves a batch of one; "auto" with room for all replays the first member alone,
    # then the other three together. A GDN layer keeps its decay in float32 by design: a batched projection's
    # float64 value (summed in another order) may round to another float32 there, which the residue bound covers
    gdn = preset == "tiny-qwen3_next"
    tolerance = float64_residue_tolerance(gdn=True) if gdn else TOL64
    model = float64_model(preset, seed=3)
    prompt, responses, rewards = _group()
    config = grpo.GRPOConfig(num_generations=4, beta=0.1, loss_type="dapo")
    exact = batching.get("prefix_grad", False)
    runs = {}
    with hf_float64(model), float64_gdn_states():
        for name, options in (("serial", {"prefix_grad": exact}), ("batched", batching)):
            recorder = GradientRecorder(model)
            runs[name] = (
                _step(model, prompt, responses, rewards, recorder, config, capture_kwargs={"chunk_size": 8}, **options),
                recorder.grads,
            )
    serial, batched = runs["serial"][0], runs["batched"][0]
    assert serial["micro_batch"] == 1
    assert batched["micro_batch"] == (3 if batching["micro_batch"] == "auto" else batching["micro_batch"])
    assert batched["phases"]["replay"].get("count", 1) == {2: 2, 3: 2, 4: 1, "auto": 2}[batching["micro_batch"]]
    within(max_relative_error(runs["batched"][1], runs["serial"][1]), tolerance, "max relative gradient error")
    within(abs(batched["loss"] - serial["loss"]), tolerance * max(abs(serial["loss"]), 1.0), "loss")
    assert batched["state_unchanged"]
    if batching["micro_batch"] != "auto" and not batching.get("checkpoint_layers"):  # k members' graphs at once
        assert batched["graph_bytes_peak"] > serial["graph_bytes_peak"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"micro_batch": 0}, "micro_batch must be a positive integer"),
        ({"micro_batch": "all"}, "micro_batch must be a positive integer"),
        ({"micro_batch": 2, "mode": "hold_all"}, "mode 'replay' only"),
    ],
)
def test_bad_micro_batches_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        StepOptions(**options)


@pytest.mark.parametrize("change", [{"mode": "hold_all"}, {"cp_size": 2}])
def test_a_point_refuses_batched_members_where_it_replays_none(change):
    from longstraw.harness.plan import resolve

    with pytest.raises(ValueError, match="replay.micro_batch: micro_batch(=2 batches| > 1 is not implemented)"):
        resolve({"name": "p", "kind": "step", "replay": {"micro_batch": 2}, **change}, "p.yaml")


def test_a_step_point_replays_its_members_in_the_batches_its_config_sets():
    # the config reaches the step (its gradient is test_members_replayed_in_batches_give_the_serial_gradient's)
    from longstraw.harness.runner import run_point

    point = {**_cycles_point("seeded"), "cycles": 1, "grpo": {"num_generations": 3, "beta": 0.0}}
    serial = run_point(point)["metrics"]["cycles"][0]
    batched = run_point({**point, "replay": {"micro_batch": "auto"}})["metrics"]["cycles"][0]
    assert serial["micro_batch"] == 1 and batched["micro_batch"] == 1  # auto off CUDA without a budget: 1
    paired = run_point({**point, "replay": {"micro_batch": 3}})["metrics"]["cycles"][0]
    assert paired["micro_batch"] == 3 and paired["phases"]["replay"].get("count", 1) == 1  # G=3: one batch


def test_a_batch_of_members_is_refused_on_entries_that_cannot_share(monkeypatch):
    from longstraw.state import AttentionPages

    model = build_model("tiny-llama", seed=0)
    prompt, responses, rewards = _group()
    state = capture(model, prompt)
    monkeypatch.delattr(AttentionPages, "for_members")
    with pytest.raises(ValueError, match="AttentionPages entries cannot be read by several sequences at once"):
        _step(
            model,
            prompt,
            responses,
            rewards,
            GradientRecorder(model),
            grpo.GRPOConfig(num_generations=4),
            state=state,
            micro_batch=2,
        )


@pytest.mark.numerics
@pytest.mark.parametrize(
    "options",
    [
        {"mode": "naive"},
        {"mode": "replay", "prefix_grad": True},
        {"mode": "replay", "prefix_grad": True, "old_policy": "score"},
    ],
    ids=["naive", "exact-replay", "exact-replay-scored"],
)
def test_step_gradient_is_hf_full_sequence_gradient(options):
    # float64 (float64_reference): HF's forward on both sides, the objective written twice. The old policy is the
    # gradient pass's own log-probs unless a scoring pass is asked for; either way the gradient is the on-policy one
    model = float64_model("tiny-llama", seed=3)
    prompt, responses, rewards = _group(seed=1)
    config = grpo.GRPOConfig(num_generations=4, beta=0.0, loss_type="grpo")
    recorder = GradientRecorder(model)
    with hf_float64(model):
        metrics = _step(model, prompt, responses, rewards, recorder, config, **options)
        scored = options.get("old_policy") == "score"
        assert metrics["old_policy"] == ("scored" if scored else "current")
        assert ("old_scoring" in metrics["phases"]) == scored
        assert (metrics["logp_mismatch"] is not None) == scored
        # on-policy first step: old log-probs equal the current ones (detached), as in the step
        logps = [hf_full_logprobs(model, prompt, y) for y in responses]
        advantages = grpo.group_advantages(rewards)
        loss = batch_loss(logps, [lp.detach() for lp in logps], None, advantages, config)
        model.zero_grad()
        loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    within(
        max_relative_error(recorder.grads, expected),
        float64_residue_tolerance(gdn=False),
        "max relative gradient error",
    )


@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["replay", "hold_all"])
def test_exact_mode_step_gradient_equals_naive(mode):
    """prefix_grad=True: the step applies HF's one-pass full-sequence gradient (naive's), not the conditional one.
    In float64 (float64_reference; 2.5e-7 apart in float32)."""
    model = float64_model("tiny-qwen3_5", seed=3)
    prompt, responses, rewards = _group(seed=4)
    config = grpo.GRPOConfig(num_generations=4, beta=0.1, loss_type="dapo")
    grads, phases = {}, {}
    with hf_float64(model), float64_gdn_states():
        for run, kwargs in (
            ("exact", {"mode": mode, "prefix_grad": True, "capture_kwargs": {"chunk_size": 8}}),
            ("conditional", {"mode": mode, "capture_kwargs": {"chunk_size": 8}}),
            ("naive", {"mode": "naive"}),
        ):
            recorder = GradientRecorder(model)
            phases[run] = _step(model, prompt, responses, rewards, recorder, config, **kwargs)["phases"]
            grads[run] = recorder.grads
    assert "prefix_backward" in phases["exact"] and "prefix_backward" not in phases["conditional"]
    within(
        global_relative_error(grads["exact"], grads["naive"]),
        float64_residue_tolerance(gdn=True),
        "relative gradient error",
    )
    above(global_relative_error(grads["conditional"], grads["naive"]), PROMPT_TERM, "prompt-side term")


def test_prefix_grad_refuses_a_response_only_state():
    model = build_model("tiny-llama", seed=0)
    prompt, responses, rewards = _group()
    with pytest.raises(ValueError, match="prefix_grad=True"):
        _step(
            model,
            prompt,
            responses,
            rewards,
            GradientRecorder(model),
            grpo.GRPOConfig(num_generations=4),
            state=capture(model, prompt),
            prefix_grad=True,
        )


def test_step_applies_the_optimizer_and_reports_phases():
    model = build_model("tiny-qwen3_5", seed=0)
    prompt, responses, rewards = _group(seed=2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = _step(
        model,
        prompt,
        responses,
        rewards,
        optimizer,
        grpo.GRPOConfig(num_generations=4, beta=0.0),
        capture_kwargs={"chunk_size": 8},
    )
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert {"capture", "replay", "optimizer_step"} <= set(metrics["phases"])
    assert metrics["phases"]["replay"]["count"] == 4
    assert metrics["resident_bytes"] == metrics["predicted_resident_bytes"]


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_a_step_checks_its_responses_ids_once_whatever_its_batches(monkeypatch, micro_batch):
    """The vocabulary check costs a host sync: a step makes it once for the group, not once per batch."""
    import longstraw.core.step as step
    import longstraw.core.transaction as transaction

    checked = []
    check = transaction.check_vocabulary
    for module in (step, transaction):
        monkeypatch.setattr(
            module, "check_vocabulary", lambda ids, name, adapter: checked.append(name) or check(ids, name, adapter)
        )
    model = build_model("tiny-qwen3", seed=0)
    prompt, responses, rewards = _group(seed=2)
    _step(
        model,
        prompt,
        responses,
        rewards,
        torch.optim.SGD(model.parameters(), lr=0.1),
        grpo.GRPOConfig(num_generations=4, beta=0.0),
        micro_batch=micro_batch,
    )
    assert sorted(checked) == ["prompt_ids", "responses"]


@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["replay", "naive"])
def test_one_member_probe_reaches_the_full_steps_graph_peak_and_gradient_share(mode):
    # the capacity probe's premise: serial members of equal length have equal live graphs.
    # float64, HF's own float32 casts included, on both sides (float64_reference): in float32 the GDN
    # decay gradients put the probe and the reference 1.1e-5..7.7e-5 apart by kernel path (naive; MKL's
    # AVX2 / SSE4.2 paths the most), against 1e-4; in float64 <= 1.5e-7 apart (dt_bias off by 0.1% in our
    # GDN mixer: 3.4e-3 in replay mode)
    model = float64_model("tiny-qwen3_5", seed=4)
    prompt, responses, rewards = _group(seed=3, lengths=(6, 6, 6, 6))
    config = grpo.GRPOConfig(num_generations=4, beta=0.0, loss_type="grpo")
    full, probe = GradientRecorder(model), GradientRecorder(model)
    kwargs = {} if mode == "naive" else {"capture_kwargs": {"chunk_size": 8}}
    with hf_float64(model):
        whole = _step(model, prompt, responses, rewards, full, config, mode=mode, **kwargs)
        one = _step(model, prompt, responses, rewards, probe, config, mode=mode, members=1, **kwargs)
        assert one["members_replayed"] == 1 and whole["members_replayed"] == 4
        assert one["graph_bytes_peak"] == whole["graph_bytes_peak"] > 0
        # the probe's gradient is member 0's term of the full loss (advantage from all four rewards)
        reference = hf_full_logprobs if mode == "naive" else hf_conditional_logprobs  # naive: full-sequence gradient
        logps = [reference(model, prompt, y) for y in responses]
        logps = logps[:1] + [lp.detach() for lp in logps[1:]]
        loss = batch_loss(logps, [lp.detach() for lp in logps], None, grpo.group_advantages(rewards), config)
        model.zero_grad()
        loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert all(g.dtype == torch.float64 for g in expected.values())
    within(
        max_relative_error(probe.grads, expected), float64_residue_tolerance(gdn=True), "max relative gradient error"
    )


def test_partial_step_is_refused_for_hold_all():
    model = build_model("tiny-llama", seed=0)
    prompt, responses, rewards = _group()
    with pytest.raises(ValueError, match="hold_all"):
        _step(
            model,
            prompt,
            responses,
            rewards,
            GradientRecorder(model),
            grpo.GRPOConfig(num_generations=4),
            mode="hold_all",
            members=1,
        )


class _EvenShare:
    """A dense reward, so that every cycle updates: the share of even tokens in the response."""

    def __init__(self, vocab_size, length=96):
        from longstraw.training.tasks import KeyValueRetrieval

        self.inner = KeyValueRetrieval(vocab_size, length=length)

    def make(self, seed):
        return self.inner.make(seed)

    def reward(self, example, response_ids):
        return float((response_ids % 2 == 0).float().mean())


def _cycles_point(source, **responses):
    from longstraw.training.tasks import register_task

    register_task("step_even_share", _EvenShare)
    return {
        "name": f"cycles-{source}",
        "kind": "step",
        "cycles": 3,
        "model": {"preset": "tiny-qwen3_5", "lora": {"r": 4, "init_random": True}},
        "prompt": {"length": 96},
        "grpo": {"num_generations": 3, "beta": 0.04},
        "optimizer": {"lr": 1e-2},
        "capture": {"chunk_size": 32},
        "responses": {"length": 5, "source": source, **responses},
    }


def test_trainer_cycles_on_one_capture_measure_what_seeded_cycles_measure():
    """`responses.source: rollouts` runs the trainer's cycles on one capture: one capture (and one reference
    capture) for all cycles, a sampling phase per cycle, real updates; its resident state and its replay's
    autograd graph are the seeded point's of the same shapes (sampled responses without a stop id are
    `length` tokens), so the operating points' memory stays comparable."""
    from longstraw.harness.runner import run_point

    rollouts = run_point(_cycles_point("rollouts", task={"name": "step_even_share"}))
    seeded = run_point(_cycles_point("seeded"))
    assert rollouts["status"] == seeded["status"] == "ok", rollouts.get("error") or seeded.get("error")
    phases = rollouts["metrics"]["phase_summary"]
    assert phases["capture"]["count"] == phases["ref_capture"]["count"] == 1
    assert phases["sampling"]["count"] == 3 and phases["replay"]["count"] == 9
    cycles = rollouts["metrics"]["cycles"]
    assert [c["state_age"] for c in cycles] == [0, 1, 2] and all(c["state_unchanged"] for c in cycles)
    assert all(c["response_tokens"] == [5, 5, 5] for c in cycles)
    assert any(c["grad_norm"] > 0 for c in cycles) and all(0 <= c["reward_mean"] <= 1 for c in cycles)
    assert cycles[0]["ref_resident_bytes"] == cycles[0]["resident_bytes"]
    for key in ("resident_bytes", "graph_bytes_peak"):
        assert [c[key] for c in cycles] == [c[key] for c in seeded["metrics"]["cycles"]], key


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mode": "hold_all"}, "rollouts are the trainer's cycles"),
        ({"responses": {"source": "rollouts"}}, "responses.task: rollouts are rewarded by a task"),
        (
            {"responses": {"source": "rollouts", "task": {"name": "kv_retrieval"}, "probe_members": 1}},
            "probe_members: a memory probe replays seeded responses",
        ),
        (
            {"responses": {"source": "rollouts", "task": {"name": "kv_retrieval", "needles": 2}}},
            "responses.task.needles: unknown setting",
        ),
    ],
)
def test_bad_rollout_points_are_refused_before_any_work(change, message):
    from longstraw.harness.plan import resolve

    raw = {"name": "p", "kind": "step", "responses": {"source": "rollouts", "task": {"name": "kv_retrieval"}}}
    raw.update(change)
    with pytest.raises(ValueError, match=message):
        resolve(raw, "p.yaml")


def test_a_recapturing_step_point_captures_every_cycle_and_reuses_no_state():
    """`recapture`: each cycle captures the prompt anew with the weights it has then (state age 0, a capture
    phase per cycle), where the default serves every cycle from the first capture (ages 0, 1, 2)."""
    from longstraw.harness.runner import run_point

    reused = run_point(_cycles_point("seeded"))
    fresh = run_point({**_cycles_point("seeded"), "recapture": True})
    assert reused["status"] == fresh["status"] == "ok", reused.get("error") or fresh.get("error")
    assert reused["metrics"]["phase_summary"]["capture"]["count"] == 1
    assert fresh["metrics"]["phase_summary"]["capture"]["count"] == 3
    assert [c["state_age"] for c in reused["metrics"]["cycles"]] == [0, 1, 2]
    assert [c["state_age"] for c in fresh["metrics"]["cycles"]] == [0, 0, 0]


@pytest.mark.parametrize("source", ["seeded", "rollouts"])
def test_the_collector_is_frozen_within_a_step_point_and_thawed_after_it(monkeypatch, source):
    """A step point's cycles, seeded or the trainer's (`rollouts`), run with what was built before them frozen out of
    the collector (no full collection walks the model inside a timed phase); after the point, or its failure, nothing
    stays frozen."""
    import gc

    import longstraw.core.step as core_step
    import longstraw.training.trainer as trainer_module
    from longstraw.harness.runner import run_point

    real, frozen = core_step.grpo_step, []

    def watched(*args, **kwargs):
        frozen.append(gc.get_freeze_count())
        return real(*args, **kwargs)

    monkeypatch.setattr(core_step, "grpo_step", watched)
    monkeypatch.setattr(trainer_module, "grpo_step", watched)  # the trainer's own import of it
    point = _cycles_point(source, **({"task": {"name": "step_even_share"}} if source == "rollouts" else {}))
    assert gc.get_freeze_count() == 0
    assert run_point(point)["status"] == "ok"
    assert len(frozen) == 3 and min(frozen) > 1000  # the model, torch's and transformers' objects
    assert gc.get_freeze_count() == 0

    def failing(*args, **kwargs):
        raise RuntimeError("a step that fails")

    monkeypatch.setattr(core_step, "grpo_step", failing)
    monkeypatch.setattr(trainer_module, "grpo_step", failing)
    assert run_point(point)["status"] == "error"
    assert gc.get_freeze_count() == 0


def test_a_recapturing_step_point_frees_each_cycles_state_before_the_next_capture(monkeypatch):
    """With `recapture`, the state a cycle captured is gone when the next cycle starts (its capture would otherwise
    be measured with two states resident); without it, the one state serves every cycle."""
    import weakref

    import longstraw.core.step as core_step
    from longstraw.harness.runner import run_point

    real, previous, alive_at_entry = core_step.grpo_step, [], []

    def watched(*args, **kwargs):
        alive_at_entry.append(bool(previous) and previous[-1]() is not None)
        step = real(*args, **kwargs)
        previous.append(weakref.ref(step.state))
        return step

    monkeypatch.setattr(core_step, "grpo_step", watched)
    result = run_point({**_cycles_point("seeded"), "recapture": True})
    assert result["status"] == "ok", result.get("error")
    assert alive_at_entry == [False, False, False]
    previous.clear()
    alive_at_entry.clear()
    assert run_point(_cycles_point("seeded"))["status"] == "ok"
    assert alive_at_entry == [False, True, True]


@pytest.mark.parametrize(
    "change",
    [{"mode": "naive"}, {"kind": "capacity"}, {"responses": {"source": "rollouts", "task": {"name": "kv_retrieval"}}}],
)
def test_recapture_is_refused_where_a_point_has_no_capture_of_its_own_to_repeat(change):
    from longstraw.harness.plan import resolve

    with pytest.raises(ValueError, match="recapture: captures a seeded step point's prompt every cycle"):
        resolve({"name": "p", "kind": "step", "recapture": True, **change}, "p.yaml")


def test_a_step_point_replays_under_checkpointing_when_its_config_says_so():
    """`replay.checkpoint_layers` reaches the replays: the same loss and gradient norm as the plain step (the
    same responses and rewards), a smaller kept graph."""
    from longstraw.harness.runner import run_point

    point = {
        "name": "ckpt",
        "kind": "step",
        "model": {"preset": "tiny-qwen3_5", "lora": {"r": 4, "init_random": True}},
        "prompt": {"length": 96},
        "grpo": {"num_generations": 3},
        "responses": {"length": 24},
        "capture": {"chunk_size": 32},
    }
    plain = run_point(point)
    checkpointed = run_point({**point, "replay": {"checkpoint_layers": True}})
    assert plain["status"] == checkpointed["status"] == "ok"
    a, b = plain["metrics"]["cycles"][0], checkpointed["metrics"]["cycles"][0]
    # the same float32 step, its layers recomputed in the backward: bit for bit on one kernel path, or the prompt's
    # sums reordered (MKL's alignment-dependent blocking)
    tol = float32_tolerance(96)
    assert b["loss"] == pytest.approx(a["loss"], rel=tol) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=tol)
    assert b["graph_bytes_peak"] < a["graph_bytes_peak"] / 5


@pytest.mark.numerics
def test_step_records_the_logp_mismatch_against_the_given_old_logps():
    # float64 (float64_reference): our replay's log-probs and HF's forward's then differ by the float32
    # log-softmax each keeps (tests/tolerances.py, logprob_tolerance)
    model = float64_model("tiny-qwen3_5", seed=0)
    prompt = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(0))
    responses = [torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with hf_float64(model), float64_gdn_states():
        with torch.no_grad():
            expected = [hf_full_logprobs(model, prompt, y) for y in responses]  # HF's own forward
        old = [torch.full_like(e, -1.0) for e in expected]
        metrics = grpo_step(
            model,
            prompt,
            responses,
            [0.0, 1.0],
            optimizer,
            grpo.GRPOConfig(num_generations=2, beta=0.0),
            old_logps=old,
            sampler_logps=expected,
        ).metrics
    distance = torch.cat([(e + 1.0).abs() for e in expected])
    tol = logprob_tolerance(model.config.vocab_size, float(torch.cat(expected).abs().max()))
    within(abs(metrics["logp_mismatch"]["max"] - float(distance.max())), tol, "max mismatch")
    within(abs(metrics["logp_mismatch"]["mean"] - float(distance.mean())), tol, "mean mismatch")
    within(metrics["logp_mismatch_sampler"]["max"], tol, "our replay against HF's forward")


def test_deterministic_mode_runs_a_step_and_restores_torch_flags():
    from longstraw.core.determinism import deterministic_mode

    model = build_model("tiny-qwen3_5", seed=0)
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    responses = [torch.randint(0, 256, (5,), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with deterministic_mode():
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        metrics = grpo_step(
            model, prompt, responses, [0.0, 1.0], optimizer, grpo.GRPOConfig(num_generations=2, beta=0.0)
        ).metrics
    assert metrics["grad_norm"] > 0
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
