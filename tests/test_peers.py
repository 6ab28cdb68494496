"""The peers (`longstraw.peers`) compute the same thing as our exact mode where the objectives coincide:
TRL's GRPOTrainer loss path and PrefixGrouper's grouped forward give our exact mode's loss and
full-sequence gradient on the same model, prompt, responses and rewards (our exact mode is held to HF's
one-pass autograd in tests/test_prefix_grad.py). And they refuse what they cannot run before any work."""

import contextlib

import pytest
import torch

from longstraw import capture
from longstraw.core import grpo
from longstraw.core.hf_reference import global_relative_error
from longstraw.core.step import StepOptions, grpo_step, reference_policy
from longstraw.models import build_model
from longstraw.models.lora import apply_lora

pytest.importorskip("trl", reason='the peers extra is not installed: pip install -e ".[peers]"')
pytest.importorskip("prefix_grouper", reason='the peers extra is not installed: pip install -e ".[peers]"')

from float64_reference import float64_gdn_states, has_gdn, hf_float64, to_float64  # noqa: E402
from grpo_reference import GradientRecorder  # noqa: E402
from tolerances import above, float64_residue_tolerance, within  # noqa: E402

from longstraw.peers import PeerNotApplicable, build_peer  # noqa: E402


def _policy(preset, dtype=torch.float32):
    # a random LoRA (B != 0), so the policy differs from the reference and the KL term is not zero
    model = apply_lora(build_model(preset, seed=5), r=4, alpha=8, dropout=0.0, init_random=True, targets="attention")
    return to_float64(model) if dtype == torch.float64 else model


def _group(lengths=(6, 9, 3, 7)):
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 256, (41,), generator=g)
    responses = [torch.randint(0, 256, (n,), generator=g) for n in lengths]  # unequal: padding in both peers
    return prompt, responses, torch.tensor([1.0, 0.0, 0.5, 0.25])


def _run(preset, mode, config, dtype=torch.float32, **options):
    """(loss, gradients) of one step on a fresh copy of the same policy."""
    model = _policy(preset, dtype)
    prompt, responses, rewards = _group()
    recorder = GradientRecorder(model)
    with hf_float64(model) if dtype == torch.float64 else contextlib.nullcontext(), float64_gdn_states():
        if mode in ("trl", "prefix_grouper"):
            metrics = build_peer(mode, model, config).step(prompt, responses, rewards, recorder)
        else:
            # the reference's own capture of the prompt (as TRL's reference sees the prompt: the base model's)
            with reference_policy(model):
                ref_state = capture(model, prompt) if config.beta else None
            metrics = grpo_step(
                model,
                prompt,
                responses,
                rewards,
                recorder,
                config,
                StepOptions(mode=mode, **options),
                ref_state=ref_state,
            ).metrics
    assert recorder.grads, "the step produced no gradient"
    return metrics, recorder.grads


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("preset", "peer", "beta"),
    [
        ("tiny-llama", "trl", 0.0),
        ("tiny-qwen3_5", "trl", 0.0),
        ("tiny-llama", "trl", 0.04),
        ("tiny-llama", "prefix_grouper", 0.0),
        ("tiny-qwen3", "prefix_grouper", 0.04),
    ],
)
def test_peer_loss_and_gradient_equal_our_exact_mode(preset, peer, beta):
    # float64 (float64_reference): the peers compute our objective's gradient in their own order (in float32 up
    # to 1.5e-5 apart on tiny-qwen3_5 through HF's torch GDN kernel); the float32 log-softmax each keeps remains
    config = grpo.GRPOConfig(num_generations=4, beta=beta, loss_type="dapo")
    exact, exact_grads = _run(preset, "replay", config, torch.float64, prefix_grad=True)
    theirs, their_grads = _run(preset, peer, config, torch.float64)
    assert set(their_grads) == set(exact_grads)
    tol = float64_residue_tolerance(has_gdn(_policy(preset)))
    within(global_relative_error(their_grads, exact_grads), tol, "relative gradient error")
    within(abs(theirs["loss"] - exact["loss"]), tol * max(abs(exact["loss"]), 1e-2), "loss")
    within(abs(theirs["grad_norm"] - exact["grad_norm"]), tol * exact["grad_norm"], "gradient norm")
    if beta:  # the reference pass ran: the KL term is in the loss and the statistics
        assert exact["stats"]["kl"] > 0
        within(abs(theirs["stats"]["kl"] - exact["stats"]["kl"]), tol * exact["stats"]["kl"], "KL")
    # not trivially equal: the conditional-response gradient (replay without the prompt-side term) differs
    _, replay_grads = _run(preset, "replay", config, torch.float64)
    above(global_relative_error(replay_grads, exact_grads), 1e-2, "prompt-side term")


def test_peer_steps_record_the_step_phases():
    config = grpo.GRPOConfig(num_generations=4, beta=0.04)
    for peer in ("trl", "prefix_grouper"):
        metrics, _ = _run("tiny-llama", peer, config)
        assert set(metrics["phases"]) == {"ref_scoring", "forward_backward", "optimizer_step"}
        assert metrics["graph_bytes_peak"] > 0 and metrics["members_replayed"] == 4


def test_prefix_grouper_refuses_a_hybrid_model_before_any_work(monkeypatch):
    import prefix_grouper.utils.register_transformers as registry

    model = _policy("tiny-qwen3_5")
    monkeypatch.setattr(registry, "register_attention", lambda: pytest.fail("work started"))
    with pytest.raises(PeerNotApplicable, match="Gated DeltaNet"):
        build_peer("prefix_grouper", model, grpo.GRPOConfig(num_generations=4))


def _peer_experiment(mode_list, explicit=None):
    return {
        "name": "peers_t",
        "title": "t",
        "kind": "step",
        "profiles": {
            "cpu": {
                "base": {"model": {"preset": "tiny-qwen3_5"}, "prompt": {"length": 16}, "grpo": {"num_generations": 2}},
                "grid": {"model.preset": ["tiny-llama", "tiny-qwen3_5"], "mode": mode_list},
                **({"points": [explicit]} if explicit else {}),
            }
        },
    }


def test_the_plan_leaves_out_grid_points_a_peer_does_not_apply_to():
    from longstraw.harness.plan import NotApplicable, expand

    skipped = {}
    points = expand(_peer_experiment(["replay", "prefix_grouper"]), "cpu", "peers_t.yaml", not_applicable=skipped)
    assert sorted(points) == [
        "preset-tiny-llama_mode-prefix_grouper",
        "preset-tiny-llama_mode-replay",
        "preset-tiny-qwen3_5_mode-replay",
    ]
    assert list(skipped) == ["preset-tiny-qwen3_5_mode-prefix_grouper"]
    assert "does not apply to model type 'qwen3_5'" in skipped["preset-tiny-qwen3_5_mode-prefix_grouper"]
    # a point asked for by name is refused, naming the file and the point
    explicit = {"name": "pg-hybrid", "set": {"mode": "prefix_grouper", "model.preset": "tiny-qwen3_5"}}
    with pytest.raises(NotApplicable, match=r"peers_t.yaml \[profile cpu, point pg-hybrid\].*Gated DeltaNet"):
        expand(_peer_experiment(["replay"], explicit), "cpu", "peers_t.yaml")


def test_a_missing_extra_is_named_when_the_plan_is_made(monkeypatch):
    import importlib.util

    from longstraw.config import ConfigError
    from longstraw.harness.plan import expand

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    with pytest.raises(ConfigError, match=r'mode \'trl\' runs the peer trl==1\.16\.0.*pip install -e "\.\[peers\]"'):
        expand(_peer_experiment(["replay", "trl"]), "cpu", "peers_t.yaml")
    # a capacity search comparing with a peer is checked as well
    capacity = _peer_experiment(["replay"])
    capacity["profiles"]["cpu"]["base"].update(
        kind="capacity", capacity={"compare_modes": ["trl"], "ceiling_bytes": 1 << 28}
    )
    with pytest.raises(ConfigError, match=r"pip install"):
        expand(capacity, "cpu", "peers_t.yaml")


def test_a_peer_point_runs_through_the_step_kind(tmp_path):
    from longstraw.harness.runner import run_point

    raw = {
        "name": "peers_t/trl",
        "kind": "step",
        "mode": "trl",
        "model": {"preset": "tiny-llama"},
        "prompt": {"length": 32},
        "responses": {"length": 4},
        "grpo": {"num_generations": 2, "beta": 0.0},
    }
    result = run_point(raw)
    assert result["status"] == "ok", result.get("error")
    metrics = result["metrics"]
    assert metrics["peer_setup"]["seconds"] > 0 and metrics["cycles"][0]["mode"] == "trl"
    assert "forward_backward" in metrics["phase_summary"]
    with pytest.raises(ValueError, match="peer 'trl' runs kind step or capacity"):
        run_point({**raw, "kind": "sweep"})


def _row(system, length, g, step_bytes, seconds, status="ok", model="tiny-llama"):
    return {
        "experiment": "peers",
        "point": f"{system}-{length}-{g}",
        "model": model,
        "model_type": "llama",
        "system": system,
        "status": status,
        "prompt_length": length,
        "G": g,
        "response_length": 64,
        "cuda": False,
        "peak_memory_bytes": step_bytes,
        "setup_rss_bytes": 0,
        "step_bytes": step_bytes,
        "step_seconds": seconds,
    }


def test_the_peers_sentences_follow_the_measured_numbers():
    from longstraw.report import peers as section

    rows = [
        _row("replay", 1024, 8, 100, 2.0),
        _row("naive", 1024, 8, 50, 3.0),
        _row("trl", 1024, 8, 400, 1.0),
        _row("replay", 4096, 8, 110, 4.0),
        _row("naive", 4096, 8, 200, 9.0),
        _row("trl", 4096, 8, 90, 5.0),
        _row("trl", 8192, 8, 3000, None, status="oom"),
        _row("replay", 8192, 8, 120, 8.0),
    ]
    section._add_ratios(rows)
    text = " ".join(section.peer_sentences("trl", rows))
    assert "step memory is 0.82-4.00x replay's and its step time 0.50-1.25x" in text
    # lighter than replay only at 4,096 (and there lighter than naive too); faster only at 1,024, and faster
    # than naive there as well, so faster than every one of our modes measured there
    assert (
        "lighter than replay at P=4,096 G=8, lighter than every one of our modes measured there at P=4,096 G=8" in text
    )
    assert "faster than replay at P=1,024 G=8, faster than every one of our modes measured there at P=1,024 G=8" in text
    assert "did not complete at P=8,192 G=8 (oom), where replay did at P=8,192 G=8" in text
    slower = [_row("replay", 1024, 2, 100, 1.0), _row("trl", 1024, 2, 300, 3.0)]
    section._add_ratios(slower)
    assert "It is lighter than replay at none of them. It is faster than replay at none of them." in " ".join(
        section.peer_sentences("trl", slower)
    )


def test_capacity_sentences_group_searches_under_one_ceiling():
    from longstraw.report import peers as section

    rows = [
        {
            "model": "tiny-qwen3_5",
            "system": system,
            "status": "ok",
            "G": 8,
            "response_length": 32,
            "ceiling_bytes": 167772160,
            "largest_fitting": reach,
            "smallest_oom": oom,
            "search_stopped_on_time_limit": False,
        }
        for system, reach, oom in (("replay", 16384, None), ("naive", 2048, 3072), ("trl", None, 128))
    ]
    assert section.capacity_sentences(rows) == [
        "Largest prompt whose G=8 step fits under 160.00 MiB on tiny-qwen3_5 (responses of 32 tokens): replay "
        "16,384 positions; naive 2,048 positions; trl none of the probed lengths (the shortest, 128, ran out)."
    ]
    # a system searched twice under one ceiling: each search named by its point
    named = [{**row, "experiment": "peers", "point": row["system"]} for row in rows]
    twice = named + [{**named[1], "experiment": "baselines", "point": "naive-memory", "largest_fitting": 4096}]
    [sentence] = section.capacity_sentences(twice)
    assert "naive (peers/naive) 2,048 positions; naive (baselines/naive-memory) 4,096 positions; trl" in sentence


def test_a_cuda_step_that_ran_out_counts_its_peak_at_the_oom(tmp_path):
    """A CUDA peer step that ran out records only the peak allocated when it did (no metrics): the Peers
    section draws it at that peak, not as a point without a value."""
    from longstraw.report import aggregate
    from longstraw.report import peers as section
    from longstraw.report.store import read_tables
    from longstraw.results import write_json_atomic

    config = {
        "name": "peers/trl-oom",
        "kind": "step",
        "mode": "trl",
        "model": {"preset": "hybrid-1b", "device": "cuda", "dtype": "bfloat16"},
        "prompt": {"length": 32768},
        "grpo": {"num_generations": 8},
        "responses": {"length": 2048},
    }
    result = {
        "experiment": "peers",
        "point": "trl-oom",
        "name": "peers/trl-oom",
        "kind": "step",
        "status": "oom",
        "error": "CUDA out of memory.",
        "config": config,
        "peak_allocated_bytes": 149282074624,
        "peak_rss_bytes": 2396184576,
        "grid": {"mode": "trl", "prompt.length": 32768, "responses.count": 8},
    }
    write_json_atomic(tmp_path / "results" / "peers" / "trl-oom.json", result)
    aggregate.write_all(tmp_path / "results", tmp_path / "tables", "h200", targets=False)
    [row] = section.step_rows(read_tables(tmp_path / "tables"))
    assert (row["system"], row["status"], row["cuda"], row["model_type"]) == ("trl", "oom", True, "qwen3_5")
    assert row["step_bytes"] == 149282074624


def test_a_peer_is_compared_with_the_replay_point_named_as_its_own():
    # two replay points at one cell (a one-batch one and a serial one): each peer point takes its named twin,
    # a peer point without one takes none, and replay's own rows carry no ratio
    from longstraw.report import peers as section

    def named(point, system, step_bytes, seconds, warm):
        return {**_row(system, 8192, 8, step_bytes, seconds), "point": point, "warm_step_seconds": warm}

    rows = [
        named("warm_mode-replay_length-8192", "replay", 100, 1.0, 0.4),
        named("warm_mode-replay-serial_length-8192", "replay", 90, 2.0, 1.0),
        named("warm_mode-prefix_grouper_length-8192", "prefix_grouper", 120, 1.5, 0.6),
        named("other_mode-prefix_grouper_length-8192", "prefix_grouper", 120, 1.5, 0.6),
    ]
    section._add_ratios(rows)
    twin, orphan = rows[2], rows[3]
    assert (twin["memory_over_replay_ratio"], twin["time_over_replay_ratio"]) == (1.2, 1.5)
    assert twin["warm_time_over_replay_ratio"] == pytest.approx(1.5)
    assert orphan["time_over_replay_ratio"] is None and rows[0]["time_over_replay_ratio"] is None
    text = " ".join(section.peer_sentences("prefix_grouper", rows))
    assert "(1 point): prefix_grouper's step memory is 1.20x replay's and its step time 1.50x; its warm step" in text


def test_prefix_grouper_applies_to_exactly_the_attention_only_family():
    """`peers.ATTENTION_ONLY` is written out (the report imports it without torch); it must stay the dense
    family's model types, every other family carrying state PrefixGrouper cannot split."""
    from longstraw.families import supported_model_types
    from longstraw.families.dense import DenseAdapter
    from longstraw.peers import ATTENTION_ONLY, not_applicable

    assert set(ATTENTION_ONLY) == set(DenseAdapter.model_types)
    for model_type in supported_model_types():
        assert (not_applicable("prefix_grouper", model_type) is None) == (model_type in DenseAdapter.model_types)
