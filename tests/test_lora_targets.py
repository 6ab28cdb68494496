"""`lora.targets`: which projections get a LoRA adapter. `attention` (the default) wraps the attention, MLA
and Gated DeltaNet projections; `all-linear` adds the MLP projections (dense FFN and a MoE shared expert),
never a MoE router, the shared expert's scalar gate, the DSA indexer or the lm_head."""

import typing

import pytest
import torch
from float64_reference import float64_gdn_states, float64_model, has_gdn, hf_float64
from peft.tuners.lora import LoraLayer
from tolerances import float64_residue_tolerance, within

from longstraw import capture, replay
from longstraw.config.sections import LoraConfig, ModelConfig
from longstraw.core.hf_reference import global_relative_error, hf_full_logprobs, max_relative_error
from longstraw.kinds import resolve_point
from longstraw.models import build_model
from longstraw.models.lora import TARGET_SETS, apply_lora, trainable_parameters
from longstraw.models.policy import build_policy

R = 4
PREFIX = "base_model.model."


def _wrapped(model) -> set[str]:
    return {n.removeprefix(PREFIX) for n, m in model.named_modules() if isinstance(m, LoraLayer)}


# tiny presets, hand-listed from their HF module structure: hidden 64, FFN 128, 4 query heads x 16 (128 with
# Qwen3.5's output gate), 2 K/V heads x 16; GDN 2 key heads x 16, 4 value heads x 16; expert FFN 32.
# name -> (in_features, out_features)
_QWEN_GDN = {
    "linear_attn.in_proj_qkv": (64, 128),
    "linear_attn.in_proj_z": (64, 64),
    "linear_attn.in_proj_b": (64, 4),
    "linear_attn.in_proj_a": (64, 4),
    "linear_attn.out_proj": (64, 64),
}
_NEXT_GDN = {"linear_attn.in_proj_qkvz": (64, 192), "linear_attn.in_proj_ba": (64, 8), "linear_attn.out_proj": (64, 64)}
_GATED_ATTN = {
    "self_attn.q_proj": (64, 128),
    "self_attn.k_proj": (64, 32),
    "self_attn.v_proj": (64, 32),
    "self_attn.o_proj": (64, 64),
}
_ATTN = {**_GATED_ATTN, "self_attn.q_proj": (64, 64)}
_MLP = {"mlp.gate_proj": (64, 128), "mlp.up_proj": (64, 128), "mlp.down_proj": (128, 64)}
_SHARED = {
    "mlp.shared_expert.gate_proj": (64, 32),
    "mlp.shared_expert.up_proj": (64, 32),
    "mlp.shared_expert.down_proj": (32, 64),
}
_SHARED_GLM = {k.replace("shared_expert.", "shared_experts."): v for k, v in _SHARED.items()}
_MLA = {
    "self_attn.q_a_proj": (64, 32),
    "self_attn.q_b_proj": (32, 96),
    "self_attn.kv_a_proj_with_mqa": (64, 40),
    "self_attn.kv_b_proj": (32, 128),
    "self_attn.o_proj": (64, 64),
}


def _layers(*per_layer):
    """{module name: shape} over layers: per_layer[i] is layer i's {relative name: shape}."""
    return {f"model.layers.{i}.{k}": v for i, mods in enumerate(per_layer) for k, v in mods.items()}


# preset -> (attention-set modules, MLP modules all-linear adds, modules that must stay unwrapped)
EXPECTED = {
    "tiny-qwen3_5": (_layers(_QWEN_GDN, _QWEN_GDN, _QWEN_GDN, _GATED_ATTN), _layers(*[_MLP] * 4), []),
    "tiny-qwen3_5_moe": (
        _layers(_QWEN_GDN, _QWEN_GDN, _QWEN_GDN, _GATED_ATTN),
        _layers(*[_SHARED] * 4),
        [f"model.layers.{i}.mlp.{m}" for i in range(4) for m in ("gate", "experts", "shared_expert_gate")],
    ),
    "tiny-qwen3_next": (  # routed MoE with a shared expert on every layer
        _layers(_NEXT_GDN, _NEXT_GDN, _NEXT_GDN, _GATED_ATTN),
        _layers(*[_SHARED] * 4),
        [f"model.layers.{i}.mlp.{m}" for i in range(4) for m in ("gate", "experts", "shared_expert_gate")],
    ),
    "tiny-glm4_moe": (  # 1 dense FFN layer, then 2 routed-MoE layers with one shared expert
        _layers(*[_ATTN] * 3),
        _layers(_MLP, _SHARED_GLM, _SHARED_GLM),
        [f"model.layers.{i}.mlp.{m}" for i in (1, 2) for m in ("gate", "experts")],
    ),
    "tiny-glm_moe_dsa": (  # MLA + DSA indexer on every layer; 1 dense FFN layer, then 3 MoE layers
        _layers(*[_MLA] * 4),
        _layers(_MLP, _SHARED_GLM, _SHARED_GLM, _SHARED_GLM),
        [f"model.layers.{i}.mlp.{m}" for i in (1, 2, 3) for m in ("gate", "experts")]
        + [f"model.layers.{i}.self_attn.indexer.{m}" for i in (0, 2) for m in ("wq_b", "wk", "weights_proj")],
    ),
}


@pytest.mark.parametrize("targets", ["attention", "all-linear"])
@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_each_target_set_wraps_exactly_its_modules(preset, targets):
    attention, mlp, frozen = EXPECTED[preset]
    expected = {**attention, **(mlp if targets == "all-linear" else {})}
    base = build_model(preset, seed=0)
    names = dict(base.named_modules())
    assert all(n in names for n in [*attention, *mlp, *frozen])  # the hand list matches the HF structure
    for name, (n_in, n_out) in expected.items():
        assert (names[name].in_features, names[name].out_features) == (n_in, n_out), name
    model = apply_lora(base, r=R, targets=targets)
    assert _wrapped(model) == set(expected)
    assert not any(n.startswith(("lm_head", *frozen)) for n in _wrapped(model))
    trainable = {n.removeprefix(PREFIX) for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert trainable_parameters(model) == sum(R * (n_in + n_out) for n_in, n_out in expected.values())


def test_the_27b_shape_counts_beside_the_papers():
    """Qwen3.6-27B's shape on the meta device (no memory): r=16 LoRA on every linear projection, MLP included,
    is the paper's 116.7M; the attention + GDN set is 47,521,792 (measured before this option existed)."""
    counts = {}
    for targets in ("attention", "all-linear"):
        model = build_model("qwen3.6-27b-shape", dtype=torch.bfloat16, device="meta")
        counts[targets] = trainable_parameters(apply_lora(model, r=16, targets=targets))
    assert counts["attention"] == 47_521_792
    assert counts["all-linear"] == pytest.approx(116.7e6, abs=0.05e6)
    # the MLP's share by hand: 64 layers x 3 projections x r (5120 + 17408)
    assert counts["all-linear"] - counts["attention"] == 64 * 3 * 16 * (5120 + 17408)


def test_an_unknown_target_set_is_named():
    with pytest.raises(ValueError, match=r"unknown LoRA target set 'mlp'; known: \['all-linear', 'attention'\]"):
        apply_lora(build_model("tiny-llama"), r=R, targets="mlp")


def test_the_config_accepts_exactly_the_target_sets():
    assert set(typing.get_args(typing.get_type_hints(LoraConfig)["targets"])) == set(TARGET_SETS)
    assert resolve_point({"model": {"lora": {}}}).model.lora.targets == "attention"
    assert resolve_point({"model": {"lora": {"targets": "all-linear"}}}).model.lora.targets == "all-linear"
    with pytest.raises(
        ValueError,
        match=r"exp.yaml: model.lora.targets: must be one of \['attention', 'all-linear'\], "
        r"got 'all_linear'",
    ):
        resolve_point({"model": {"lora": {"targets": "all_linear"}}}, source="exp.yaml")


def test_build_policy_passes_the_target_set_through():
    for targets, mlp_wrapped in (("attention", False), ("all-linear", True)):
        model = build_policy(ModelConfig(preset="tiny-llama", lora=LoraConfig(r=R, targets=targets)))
        assert ("model.layers.0.mlp.down_proj" in _wrapped(model)) is mlp_wrapped
        assert "model.layers.0.self_attn.q_proj" in _wrapped(model)


@pytest.mark.numerics
@pytest.mark.parametrize("preset", ["tiny-qwen3_5_moe", "tiny-glm4_moe"])
def test_mlp_adapters_train_through_capture_and_replay(preset):
    """The family adapters run HF's MLP modules, so the MLP's LoRA gets the same gradient as in HF's
    one-pass autograd (exact mode: replay + backward_prefix). In float64 (float64_reference; 9.1e-6 apart in
    float32 on tiny-qwen3_5_moe)."""
    model = apply_lora(float64_model(preset, seed=1), r=R, init_random=True, targets="all-linear")
    gen = torch.Generator().manual_seed(0)
    prompt, response = torch.randint(0, 256, (40,), generator=gen), torch.randint(0, 256, (12,), generator=gen)
    with hf_float64(model), float64_gdn_states():
        state = capture(model, prompt, prefix_grad=True, chunk_size=16)
        replay(model, state, response).sum().backward()
        state.backward_prefix()
        ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        hf_full_logprobs(model, prompt, response).sum().backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    mlp = [n for n in expected if "_proj.lora_" in n and ".mlp." in n]
    assert mlp and all(ours[n].abs().max() > 0 for n in mlp)
    tol = float64_residue_tolerance(has_gdn(model))
    within(global_relative_error(ours, expected), tol, "relative gradient error")
    within(max_relative_error(ours, expected), tol, "max relative gradient error")


@pytest.mark.parametrize("dtype, expected", [("float32", torch.float32), ("model", torch.bfloat16)])
def test_the_adapters_take_the_dtype_the_config_names(dtype, expected):
    # peft keeps adapters in float32 over a bf16 base; lora.dtype "model" keeps them in the base's dtype, and the
    # optimizer then steps float32 masters of them (a bf16 in-place Adam step would round most updates away)
    from longstraw.config.sections import LoraConfig, ModelConfig, OptimizerConfig
    from longstraw.models.policy import build_policy
    from longstraw.training.optimizer import MasterWeightsAdamW, build_optimizer

    model = build_policy(ModelConfig(preset="tiny-llama", dtype="bfloat16", lora=LoraConfig(r=4, dtype=dtype)))
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    assert adapters and {p.dtype for p in adapters} == {expected}
    assert all(p.requires_grad for p in adapters)
    optimizer = build_optimizer(adapters, OptimizerConfig())
    assert isinstance(optimizer, MasterWeightsAdamW) == (expected == torch.bfloat16)
