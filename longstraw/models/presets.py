"""Named model presets: real `transformers` classes built from configs with random weights.

No hub access at run time: presets build from a config; real checkpoints load from a local
directory through `load_pretrained` and then go through exactly the same code.

    from longstraw.models import build_model
    model = build_model("tiny-qwen3_5", seed=0)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

# model_type -> (config class name, causal LM class name) in `transformers`
MODEL_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}

# model_type -> its family, as the report names it; the MLA family's types follow from it
FAMILY_NAMES = {
    "llama": "dense GQA",
    "qwen3": "dense GQA",
    "glm4_moe": "dense GQA + routed MoE",
    "qwen3_next": "hybrid GDN + attention",
    "qwen3_5": "hybrid GDN + attention",
    "qwen3_5_moe": "hybrid GDN + attention",
    "glm_moe_dsa": "MLA + DSA + MoE",
    "deepseek_v32": "MLA + DSA + MoE",
    "deepseek_v3": "MLA + MoE",
    "gemma3": "sliding-window + global attention",
    "gpt_oss": "sliding-window + global attention with sinks, routed MoE",
}
MLA_MODEL_TYPES = tuple(t for t, family in FAMILY_NAMES.items() if family.startswith("MLA"))

_TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=65536,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
_TINY_GDN = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 1,
    num_hidden_layers=4,
)
# MLA + routed MoE in miniature: first_k_dense_replace dense FFN layers, then MoE with one shared expert
_TINY_MLA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    first_k_dense_replace=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    max_position_embeddings=65536,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# DSA indexer: 16 heads keep exact-zero (all heads ReLU'd away) score ties rare; top-k 2048 selects every position
# of a test sequence unless a test lowers it
_TINY_DSA = dict(index_n_heads=16, index_head_dim=16, index_topk=2048)
_TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


@dataclass(frozen=True)
class Preset:
    model_type: str
    config: dict = field(default_factory=dict)
    description: str = ""
    # GPU-scale presets initialise directly on the target device in the target dtype (a 27B shape
    # never exists in float32 on the host); small ones initialise in float32 on the CPU, so one
    # seed gives the same weights on every device
    init_on_device: bool = False


# gpt-oss's rotary as its released checkpoints set it (transformers' GptOssConfig default)
_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150_000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

# what the GPU-scale 1B presets share: width, depth and an 8M-position range
_GPU_1B = dict(
    vocab_size=32768,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=16,
    max_position_embeddings=8_388_608,
    tie_word_embeddings=False,
)

PRESETS = {
    "tiny-llama": Preset("llama", dict(_TINY_COMMON, num_hidden_layers=2), "2-layer GQA llama"),
    "tiny-qwen3": Preset("qwen3", dict(_TINY_COMMON, num_hidden_layers=2), "2-layer GQA qwen3 (q/k norm)"),
    "tiny-glm4_moe": Preset(
        "glm4_moe",
        dict(
            _TINY_COMMON,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
        ),
        "1 dense + 2 routed-MoE layers, partial rotary, q/k norm",
    ),
    "tiny-glm_moe_dsa": Preset(
        "glm_moe_dsa",
        dict(_TINY_MLA, **_TINY_DSA, indexer_types=["full", "shared", "full", "shared"]),
        "GLM-5.2 pattern in miniature: MLA + DSA, index / IndexShare layers alternating, 1 dense + 3 MoE",
    ),
    "tiny-deepseek_v32": Preset("deepseek_v32", dict(_TINY_MLA, **_TINY_DSA), "MLA + DSA indexer on every layer, MoE"),
    "tiny-deepseek_v3": Preset("deepseek_v3", dict(_TINY_MLA), "MLA without indexer (dense attention), MoE"),
    # Gemma 3 in miniature: sliding-window layers around a global one (the real 5 : 1 pattern shortened, a sliding
    # layer after the global one too), 1 KV head, window 16 so a ~100-token prompt crosses several windows, the
    # local and global rotaries Gemma 3 (4B and up) has (theta 1e4; theta 1e6 with linear scaling 8), and a
    # query_pre_attn_scalar that is not head_dim (a default 1/sqrt(head_dim) scale would show)
    "tiny-gemma3": Preset(
        "gemma3",
        dict(
            _TINY_COMMON,
            num_key_value_heads=1,
            num_hidden_layers=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=16,
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            },
            tie_word_embeddings=True,
        ),
        "3 sliding-window (16) : 1 global attention layers, Gemma 3's sandwich norms and two rotaries, 1 KV head",
    ),
    # gpt-oss in miniature: its pattern (sliding-window and full attention alternating, a sliding layer first), window
    # 8 so a 40-token prompt crosses several windows, 4 routed experts of which each token takes 2, 2 KV heads for
    # 4 query heads, and its yarn rotary (the released models' settings). Sinks, router and experts draw their
    # initial weights from HF's own init (the sinks ~N(0, 0.02): a key of score ~0, which matters)
    "tiny-gpt-oss": Preset(
        "gpt_oss",
        dict(
            _TINY_COMMON,
            intermediate_size=32,
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=131072,
            rope_parameters=dict(_GPT_OSS_ROPE),
        ),
        "2 sliding-window (8) : 2 full attention layers alternating, attention sinks, MoE 2 of 4, yarn rotary",
    ),
    "tiny-qwen3_next": Preset(
        "qwen3_next", dict(_TINY_COMMON, **_TINY_GDN, **_TINY_MOE, decoder_sparse_step=1), "3 GDN : 1 attention, MoE"
    ),
    "tiny-qwen3_5": Preset("qwen3_5", dict(_TINY_COMMON, **_TINY_GDN), "3 GDN : 1 attention, dense FFN"),
    "tiny-qwen3_5_moe": Preset(
        "qwen3_5_moe",
        dict(
            _TINY_COMMON,
            **_TINY_GDN,
            **{k: v for k, v in _TINY_MOE.items() if k != "shared_expert_intermediate_size"},
            shared_expert_intermediate_size=32,
        ),
        "3 GDN : 1 attention, MoE",
    ),
    "small-qwen3_5": Preset(
        "qwen3_5",
        dict(
            _TINY_COMMON,
            **{**_TINY_GDN, "linear_key_head_dim": 64, "linear_value_head_dim": 64},
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=768,
            head_dim=64,
        ),
        "CPU benchmark size: 3 GDN : 1 attention, hidden 256",
    ),
    "small-llama": Preset(
        "llama",
        dict(_TINY_COMMON, vocab_size=4096, hidden_size=256, intermediate_size=768, head_dim=64, num_hidden_layers=4),
        "CPU benchmark size: 4-layer GQA llama, hidden 256",
    ),
    # GPU scale: the Qwen3.6 pattern (3 Gated DeltaNet : 1 full attention, dense FFN), ~1.1B parameters.
    # Attention is 8 query heads x 128 (2 K/V heads): its causal capture cost (2 N^2 x heads x dim per
    # layer) keeps one capture of 4,456,448 positions plus 64 replays inside one 10-minute command.
    "hybrid-1b": Preset(
        "qwen3_5",
        dict(
            _GPU_1B,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
        ),
        "GPU: Qwen3.6 pattern, 16 layers (12 GDN + 4 attention), hidden 2048",
        init_on_device=True,
    ),
    # GPU scale, attention only: hybrid-1b's width, depth and attention shape with every layer full attention
    # (llama), the dense model the peers compare on (PrefixGrouper applies to attention-only models)
    "dense-1b": Preset(
        "llama",
        dict(_GPU_1B, num_attention_heads=8, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6),
        "GPU: 16-layer GQA llama, hidden 2048, hybrid-1b's attention shape",
        init_on_device=True,
    ),
    # SmolLM2-135M's shape (the real checkpoint's config, `models.real`) with random weights and an 8M-position
    # range: what the rollout benchmark decodes on without the wheel
    "smollm2-135m-shape": Preset(
        "llama",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 100_000.0},
            max_position_embeddings=8_388_608,
            tie_word_embeddings=True,
        ),
        "SmolLM2-135M's shape, random weights: 30-layer GQA llama, hidden 576, 9 / 3 heads, vocab 49,152",
        init_on_device=True,
    ),
    # GPU scale: the GLM-5.2 pattern (MLA + DSA, 1 index layer then 3 IndexShare layers, 1 dense FFN layer then
    # routed MoE 2 of 8 + 1 shared expert), ~1.2B parameters. Resident bytes per position (bf16):
    # 16 layers x (kv_lora_rank 512 + rope 64) x 2 + 4 index layers x index_head_dim 128 x 2 = 19,456;
    # 1,048,576 positions hold 19.0 GiB of pages, next to ~2.3 GiB of weights on a 139 GiB H200.
    "glm-pattern-1b": Preset(
        "glm_moe_dsa",
        dict(
            _GPU_1B,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=768,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            index_n_heads=32,
            index_head_dim=128,
            index_topk=2048,
            indexer_types=["full", "shared", "shared", "shared"] * 4,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=1024,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            rms_norm_eps=1e-5,
        ),
        "GPU: GLM-5.2 pattern, 16 MLA layers (4 index + 12 IndexShare), 1 dense + 15 MoE, hidden 2048",
        init_on_device=True,
    ),
    # The real Qwen3.6-27B text shape (26.9B parameters), random weights; run it NF4-quantised.
    "qwen3.6-27b-shape": Preset(
        "qwen3_5",
        dict(
            vocab_size=248320,
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=64,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            partial_rotary_factor=0.25,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            max_position_embeddings=8_388_608,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        "GPU: Qwen3.6-27B text shape, 64 layers (48 GDN + 16 attention), hidden 5120",
        init_on_device=True,
    ),
    # The real gpt-oss-20b shape (20.9B parameters), random weights: 24 layers alternating sliding
    # window (128) and full attention, 64 query heads x 64 on 8 KV heads with sinks, routed MoE 4 of 32 experts.
    # Resident bytes per position (bf16): 12 full layers x 8 KV heads x 64 x 2 (K and V) x 2 = 24,576, next to
    # ~39 GiB of bf16 weights (its routed experts are 3-D parameters, which NF4 leaves as they are).
    "gpt-oss-20b-shape": Preset(
        "gpt_oss",
        dict(
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            layer_types=["sliding_attention", "full_attention"] * 12,
            sliding_window=128,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            max_position_embeddings=131072,
            rope_parameters=dict(_GPT_OSS_ROPE),
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
        "GPU: gpt-oss-20b shape, 24 layers (12 sliding-window + 12 full attention, sinks), MoE 4 of 32, hidden 2880",
        init_on_device=True,
    ),
    # Learning presets (longstraw.training): small vocabularies suited to the synthetic tasks (vocab 256: 61 keys,
    # 61 values, 62 filler ids), rotary on a quarter of each head with rope_theta 64, so that every rotary
    # frequency turns through many full periods inside the training lengths (the longest period is
    # 2 pi 64^((d_rot - 2) / d_rot) positions: 50 for d_rot 4, 240 for d_rot 16): longer prompts then show the
    # attention no unseen angle, and the position-free rest of each head does the content match. Measured on
    # CPU (kv_retrieval, 4 needles, 2-token values, trained at 32-256 positions): rope_theta 10,000 gave 0.98
    # at 256 and 0.02 at 1,024; rope_theta 64 gave 0.84 at 1,024 (attention only) and 0.98 (hybrid).
    # Attention is Qwen3.5's output-gated attention: without a gate (llama) and without a fixed first token to
    # park attention on, the retrieval circuit forms several times slower.
    "learn-tiny-hybrid": Preset(
        "qwen3_5",
        dict(
            _TINY_COMMON,
            **{
                **_TINY_GDN,
                "num_hidden_layers": 4,
                "layer_types": ["full_attention", "linear_attention", "full_attention", "full_attention"],
            },
            vocab_size=256,
            rope_parameters={"rope_type": "default", "rope_theta": 64.0, "partial_rotary_factor": 0.25},
            max_position_embeddings=8_388_608,
        ),
        "learning: 1 GDN + 3 gated attention layers, hidden 64, vocab 256, rope_theta 64 on a quarter of each head",
    ),
    "learn-tiny-dense": Preset(
        "llama",
        dict(
            _TINY_COMMON,
            num_hidden_layers=3,
            vocab_size=256,
            max_position_embeddings=8_388_608,
            rope_parameters={"rope_type": "default", "rope_theta": 64.0},
        ),
        "learning: 3-layer GQA llama, hidden 64, vocab 256, rope_theta 64",
    ),
    # GPU scale (147M parameters): the tiny hybrid's pattern (attention, GDN, attention, attention) and then
    # GDN layers with a fourth attention layer, 12 layers. Attention is 8 query heads x 64 (2 K/V heads), so a
    # capture of 1,048,576 positions costs 2 P^2 x 8 x 64 = 1.1 PFLOP per attention layer (causal half),
    # 4.5 PFLOP in all: ~9 s at 500 TFLOP/s.
    "learn-hybrid-150m": Preset(
        "qwen3_5",
        dict(
            vocab_size=1024,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=12,
            layer_types=["full_attention", "linear_attention", "full_attention", "full_attention"]
            + ["linear_attention"] * 3
            + ["full_attention"]
            + ["linear_attention"] * 4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            rope_parameters={"rope_type": "default", "rope_theta": 64.0, "partial_rotary_factor": 0.25},
            linear_num_key_heads=8,
            linear_num_value_heads=16,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            max_position_embeddings=8_388_608,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        "learning, GPU: 8 GDN + 4 gated attention layers, hidden 1024, vocab 1024, rope_theta 64 on a quarter",
        init_on_device=True,
    ),
}
# the MLA family's tests live in tests/test_mla.py (HF comparisons need tie-free indexer weights once top-k
# drops positions); it has no NF4 path yet, so its presets stay out of the families' shared test lists
TINY_MLA_PRESETS = [n for n, p in PRESETS.items() if n.startswith("tiny-") and p.model_type in MLA_MODEL_TYPES]
TINY_PRESETS = [n for n in PRESETS if n.startswith("tiny-") and n not in TINY_MLA_PRESETS]


def check_preset(name: str) -> None:
    """Refuse an unknown preset name, listing the known ones (this module imports no torch: plans check early)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")


def make_config(name: str, **overrides):
    """The `transformers` config of a preset, with optional field overrides."""
    check_preset(name)
    transformers = importlib.import_module("transformers")
    preset = PRESETS[name]
    config_cls = getattr(transformers, MODEL_CLASSES[preset.model_type][0])
    return config_cls(**{**preset.config, **overrides})


def build_model(name: str, *, seed: int = 0, dtype=None, device="cpu", **overrides):
    """Build a preset's causal LM with random weights (seeded), in eval mode (float32 unless `dtype`)."""
    import torch
    import transformers

    dtype = dtype or torch.float32
    config = make_config(name, **overrides)
    model_cls = getattr(transformers, MODEL_CLASSES[PRESETS[name].model_type][1])
    torch.manual_seed(seed)
    if PRESETS[name].init_on_device:
        with torch.device(device):
            model = model_cls._from_config(config, dtype=dtype)
    else:
        model = model_cls(config).to(dtype=dtype, device=device)
    return model.eval()


def load_pretrained(path: str, *, dtype=None, device="cpu", **kwargs):
    """Load a real checkpoint from a local directory (never the hub); bfloat16 unless `dtype`. A folder with
    a manifest (`longstraw.models.real`) loads only if its weights are the ones the manifest names."""
    import torch
    import transformers

    from longstraw.models.real import verified_manifest

    verified_manifest(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype or torch.bfloat16, local_files_only=True, **kwargs
    )
    return model.to(device).eval()
