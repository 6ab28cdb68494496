"""FLOP counts and the replay floor against hand-computed values, and the GPU presets' shapes
against the published / hand-derived figures (built on the meta device: shapes, no weights)."""

import pytest
import torch
import transformers

from longstraw.families import adapter_for
from longstraw.measure import flops
from longstraw.models import build_model, make_config
from longstraw.models.lora import apply_lora, trainable_parameters


def test_attention_flop_counts_by_hand():
    # 3 live queries over 5 prefix keys + their causal 3 (1 + 2 + 3 = 6 pairs): 21 pairs x 4 x 2 heads x 4 dims
    assert flops.attention_forward_flops(heads=2, head_dim=4, queries=3, prefix=5) == 672
    # tiny-qwen3_5: one attention layer of 4 heads x 16; a causal pass over 10 tokens has 55 pairs
    config = make_config("tiny-qwen3_5")
    assert flops.attention_layers(config) == 1 and flops.head_dim(config) == 16
    assert flops.attention_forward_flops(4, 16, queries=10, prefix=0) == 4 * 4 * 16 * 55
    # tiny-llama: two attention layers
    assert flops.replay_attention_flops(make_config("tiny-llama"), 3, 5) == (2 * 4 * 4 * 16 * 21, 26880)


def test_linear_parameters_count_each_projection_once_with_lora():
    # tiny-llama per layer: q 64x64, k 64x32, v 64x32, o 64x64, MLP 3 x 64x128; plus the LM head 64x256
    expected = 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192) + 256 * 64
    model = build_model("tiny-llama")
    assert flops.linear_parameters(model) == expected
    assert flops.linear_parameters(apply_lora(model, r=4)) == expected


def test_replay_floor_divides_each_part_by_its_own_rate():
    rates = {
        "flash_forward": {"tflops_per_second": 2.0},
        "flash_backward": {"tflops_per_second": 1.0},
        "gemm": {"tflops_per_second": 4.0},
    }
    linear, lora = 90112, 100
    floor = flops.replay_floor_seconds(make_config("tiny-llama"), linear, lora, 3, 5, rates)
    linear_flops = (2 * linear * 3 + 2 * lora * 3) + (2 * linear * 3 + 4 * lora * 3)
    assert floor["seconds"] == pytest.approx(10752 / 2e12 + 26880 / 1e12 + linear_flops / 4e12)
    # where cuDNN's rates were measured, replay takes cuDNN's kernels, so the floor does too
    rates |= {"cudnn_forward": {"tflops_per_second": 8.0}, "cudnn_backward": {"tflops_per_second": 16.0}}
    floor = flops.replay_floor_seconds(make_config("tiny-llama"), linear, lora, 3, 5, rates)
    assert floor["seconds"] == pytest.approx(10752 / 8e12 + 26880 / 16e12 + linear_flops / 4e12)


def test_capture_floor_leaves_out_the_lm_head_and_the_last_layers_attention_and_mlp():
    # tiny-llama: 2 attention layers of 4 heads x 16; per layer q 64x64, k and v 64x32, o 64x64, MLP 3 x 64x128;
    # LM head 64 x 256. Capture attends and runs the MLP in the first layer only, the projections in both
    model = build_model("tiny-llama")
    config = model.config
    capture_linear = 2 * (4096 + 2048 + 2048 + 4096) + 3 * 8192
    assert flops.capture_linear_parameters(model, config) == capture_linear
    assert flops.capture_linear_parameters(apply_lora(model, r=4), config) == capture_linear
    rates = {
        "cudnn_forward": {"tflops_per_second": 2.0},
        "flash_forward": {"tflops_per_second": 1.0},
        "gemm": {"tflops_per_second": 4.0},
    }
    floor = flops.capture_floor_seconds(config, capture_linear, 10, rates)
    attention = 4 * 4 * 16 * 55  # one layer; 10 tokens: 55 causal pairs per head
    assert floor["flops"] == {"attention": attention, "linear": 2 * capture_linear * 10}
    assert floor["attention_kernel"] == "cudnn_forward"
    assert floor["seconds"] == pytest.approx(attention / 2e12 + 2 * capture_linear * 10 / 4e12)
    # tiny-qwen3_5: its one attention layer is the last: capture runs no attention at all
    hybrid = make_config("tiny-qwen3_5")
    assert hybrid.layer_types[-1] == "full_attention" and flops.attention_layers(hybrid) == 1
    assert flops.capture_flops(hybrid, 0, 10)["attention"] == 0


def _meta(name):
    config = make_config(name)
    with torch.device("meta"):
        return transformers.Qwen3_5ForCausalLM(config)


def test_qwen36_27b_shape_matches_the_real_model():
    model = _meta("qwen3.6-27b-shape")
    assert sum(p.numel() for p in model.parameters()) == 26_895_998_464  # Qwen3.6-27B text: 26.9B
    per_position, constant = adapter_for(model).predicted_bytes(torch.bfloat16)
    assert per_position == 16 * 2 * 4 * 256 * 2  # 16 attention layers x K,V x 4 heads x 256 x bf16 = 64 KiB
    conv = (2 * 16 * 128 + 48 * 128) * 3 * 2  # q, k, v channels x (kernel - 1) x bf16
    assert constant == 48 * (conv + 48 * 128 * 128 * 4)  # 48 GDN layers, fp32 recurrent state
    # LoRA r=16 on attention (q with its gate, k, v, o) and GDN (qkv, z, b, a, out) projections
    attention = 16 * ((5120 + 12288) + 2 * (5120 + 1024) + (6144 + 5120))
    gdn = 16 * ((5120 + 10240) + (5120 + 6144) + 2 * (5120 + 48) + (6144 + 5120))
    assert trainable_parameters(apply_lora(model, r=16)) == 16 * attention + 48 * gdn == 47_521_792
