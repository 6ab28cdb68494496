"""LoRA (peft) on a named set of projections: `attention` (attention, MLA and Gated DeltaNet projections)
or `all-linear` (those and the MLP projections). NF4 quantisation is `quant`."""

from __future__ import annotations

import contextlib
from unittest import mock

from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer

from longstraw.models.checks import ADAPTER_WEIGHTS
from longstraw.models.lora_linear import adopt_in_place_lora
from longstraw.models.quant import adopt_lora_layers

# Projection names across the supported families: attention (q/k/v/o), MLA (q_a/q_b, kv_a/kv_b) and
# GDN input/output. The DSA indexer's projections are left out: HF runs the indexer without grad.
ATTENTION_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "in_proj_qkvz",
    "in_proj_ba",
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
)
# The MLP projections: a dense FFN's and a MoE shared expert's (`mlp.shared_expert(s).gate_proj`, ...). A MoE's
# routed experts are fused 3-D parameters in transformers 5 (`experts.gate_up_proj`, `experts.down_proj`), not
# modules, so these names never reach them; the router (`mlp.gate`), the shared expert's scalar gate
# (`shared_expert_gate`), the DSA indexer (`wq_b`, `wk`, `weights_proj`) and the lm_head stay frozen. (So this is
# not peft's own "all-linear", which would take every nn.Linear but the lm_head.)
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")

# `lora.targets` -> the module names (last path component) LoRA wraps where a model has them
TARGET_SETS = {"attention": ATTENTION_TARGETS, "all-linear": ATTENTION_TARGETS + MLP_TARGETS}


def target_names(targets: str = "attention") -> tuple[str, ...]:
    """The module names of the target set `targets`; a ValueError lists the known sets."""
    if targets not in TARGET_SETS:
        raise ValueError(f"unknown LoRA target set {targets!r}; known: {sorted(TARGET_SETS)}")
    return TARGET_SETS[targets]


def apply_lora(
    model,
    r: int = 16,
    alpha: int | None = None,
    dropout: float = 0.0,
    init_random: bool = False,
    targets: str = "attention",
    dtype=None,
):
    """Wrap `model` with a peft LoRA adapter on every projection of the target set `targets` it has.

    `dtype`: the adapters' dtype; None keeps peft's float32 (its LoRA products then upcast the activations).

    `init_random=True` also randomises LoRA's B matrix (peft's default zero-B adapter is an
    identity, under which the A matrices get zero gradient: tests want every path exercised).
    """
    names = target_names(targets)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    found = [t for t in names if t in present]
    if not found:
        raise ValueError(f"no LoRA target projections ({targets}) found in {type(model).__name__}")
    config = LoraConfig(
        r=r,
        lora_alpha=alpha or 2 * r,
        lora_dropout=dropout,
        target_modules=found,
        init_lora_weights=not init_random,
        bias="none",
    )
    with _no_v4_moe_remap():
        model = get_peft_model(model, config)
    stray = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoraLayer)} - set(found))
    if stray or config.target_parameters:  # the remap below came back some other way
        raise RuntimeError(f"peft put LoRA on {stray or config.target_parameters}, outside the {targets!r} set {found}")
    if dtype is not None:
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.data = param.data.to(dtype)
    adopt_lora_layers(model)  # LoRA over NF4: the capture's merged path (longstraw.models.quant)
    adopt_in_place_lora(model)  # LoRA over nn.Linear: the update added in place (longstraw.models.lora_linear)
    return model


def load_adapter(model, path: str):
    """`model` with the trained peft adapter saved at `path` (a trainer checkpoint's `adapter/`), frozen for
    evaluation, its LoRA layers adopted as `apply_lora`'s are (the capture's merged path, the in-place update)."""
    from peft import PeftModel

    with _no_v4_moe_remap():  # the adapter names the modules it was trained on, as `apply_lora` wrapped them
        model = PeftModel.from_pretrained(model, path, is_trainable=False)
    adopt_lora_layers(model)
    adopt_in_place_lora(model)
    return model


def load_adapter_weights(model, path: str) -> None:
    """Start `model`'s fresh LoRA adapter (`apply_lora`) from the weights of the trained adapter saved at `path`,
    trainable as before: every LoRA weight of the model is replaced, each of the file's fits one of them (a
    rank, a projection set or a model of another shape is refused, naming the weights that differ)."""
    from pathlib import Path

    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = Path(path) / ADAPTER_WEIGHTS
    if not file.is_file():
        raise ValueError(f"model.lora.init: no trained adapter ({ADAPTER_WEIGHTS}) at {path}")
    saved = load_file(str(file), device="cpu")
    ours = {n: p for n, p in model.named_parameters() if "lora_" in n}
    misfit = f"model.lora.init: the adapter at {path} does not fit this model's LoRA (model.lora: r, targets)"
    try:
        result = set_peft_model_state_dict(model, saved)
    except RuntimeError as exc:  # torch's list of the weights of another shape
        first = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), str(exc))
        raise ValueError(f"{misfit}: {first}") from None
    missing = sorted(n for n in result.missing_keys if "lora_" in n)
    if result.unexpected_keys or missing or len(saved) != len(ours):
        listed = ", ".join((list(result.unexpected_keys) + missing)[:3]) or f"{len(saved)} saved, {len(ours)} here"
        raise ValueError(f"{misfit}: {listed}")


def _no_v4_moe_remap():
    """peft (0.21) turns the target names `gate_proj`/`up_proj`/`down_proj` on the MoE types transformers 5
    converts checkpoints of (glm4_moe, glm_moe_dsa, deepseek_v3/v32, qwen3_next, ...) into LoRA on the fused
    routed experts' 3-D parameters, and then wraps no dense-FFN or shared-expert module of those names: its shim
    for adapters trained on transformers 4, whose experts were nn.Linear (dotted names are rewritten too: peft
    issue #3711). A fresh adapter means the modules it names, so the shim is off while peft injects;
    `apply_lora` checks afterwards that only the named modules were wrapped."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # a peft without the shim
        return contextlib.nullcontext()
    if not hasattr(conversion, "convert_peft_config_for_transformers"):
        return contextlib.nullcontext()
    return mock.patch.object(conversion, "convert_peft_config_for_transformers", lambda *args, **kwargs: None)


def trainable_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
