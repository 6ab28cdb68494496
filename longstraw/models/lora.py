"""LoRA (peft) on the attention, MLA and Gated DeltaNet projections (NF4 quantisation is `quant`)."""

from __future__ import annotations

from peft import LoraConfig, get_peft_model

# Projection names across the supported families: attention (q/k/v/o), MLA (q_a/q_b, kv_a/kv_b) and
# GDN input/output. The DSA indexer's projections are left out: HF runs the indexer without grad.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def apply_lora(model, r: int = 16, alpha: int | None = None, dropout: float = 0.0, init_random: bool = False):
    """Wrap `model` with a peft LoRA adapter on every attention and GDN projection it has.

    `init_random=True` also randomises LoRA's B matrix (peft's default zero-B adapter is an
    identity, under which the A matrices get zero gradient: tests want every path exercised).
    """
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in LORA_TARGETS if t in present]
    if not targets:
        raise ValueError(f"no LoRA target projections found in {type(model).__name__}")
    config = LoraConfig(r=r, lora_alpha=alpha or 2 * r, lora_dropout=dropout, target_modules=targets,
                        init_lora_weights=not init_random, bias="none")
    return get_peft_model(model, config)


def trainable_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
