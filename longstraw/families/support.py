"""What each family runs, declared without torch: a plan checks a point against it before any model is built
(`harness/inputs.py`), and each adapter checks its model's config against it again (`FamilyAdapter.__init__`).

    support = support_of("gpt_oss")             # None for a model type no family runs
    support.check("gpt_oss", "float64", 1, {})  # Unsupported("dtype", ...): its routed experts have no float64
    support.check("gpt_oss", "bfloat16", 2, {})  # Unsupported("cp_size", ...)
    support.check("gpt_oss", "bfloat16", 1, {"rope_parameters": {"rope_type": "dynamic"}})  # ("rope_parameters", ...)

A declaration says which compute dtypes the family's modules run (routed-MoE experts run torch's grouped_mm, which
has no float64), whether its resident entries have a context-parallel form (`ResidentEntry.for_shard`), and which
config values HF's modules take that the family does not compute as HF does. Settings are a mapping of config
fields as given (a preset's, a checkpoint's config.json, the overrides over them): an absent field is its class
default, which the family runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

SLIDING, GLOBAL = "sliding_attention", "full_attention"
# rotaries whose frequencies follow the longest position of each call (HF's `dynamic_rope_update`): a chunked
# capture would rotate its early chunks otherwise than HF's one pass over the sequence
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
ROUTED_EXPERTS = "its routed experts run torch's grouped_mm, which has no float64"
WINDOW_KV = "its sliding-window layers' WindowKV has no context-parallel form yet"
WINDOW_KV_AND_SINKS = "its sliding-window layers' WindowKV and its attention sinks have no context-parallel form yet"


class Unsupported(ValueError):
    """A value the family does not run; `key`: what it is about ('dtype', 'cp_size' or a config field)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def _runs_any(settings: Mapping) -> None:
    return None


@dataclass(frozen=True)
class Support:
    """What a family runs of its `model_types`."""

    model_types: tuple[str, ...]
    no_float64: str | None = None  # why it does not compute in float64 (None: it does)
    no_context_parallel: str | None = None  # why its capture cannot be context-parallel (None: it can)
    check_settings: Callable[[Mapping], None] = _runs_any  # raises `Unsupported` naming the config field

    def check(self, model_type: str, dtype: str, cp_size: int, settings: Mapping) -> None:
        """Refuse a compute dtype, context parallelism or a config value this family does not run."""
        if dtype == "float64" and self.no_float64:
            raise Unsupported("dtype", f"float64: {model_type} models do not run in it ({self.no_float64})")
        if cp_size > 1 and self.no_context_parallel:
            raise Unsupported(
                "cp_size",
                f"{cp_size}: {model_type} models have no context-parallel capture ({self.no_context_parallel}); "
                "use cp_size 1",
            )
        self.check_settings(settings)

    def check_config(self, config) -> None:
        """An HF config's values (its adapter's check, as the model is wrapped); a ValueError naming its type."""
        try:
            self.check_settings(vars(config))
        except Unsupported as exc:
            raise ValueError(f"{config.model_type} config: {exc}") from None


def check_sliding_settings(settings: Mapping) -> None:
    """Layer types and windows the sliding-window family computes as HF does."""
    layer_types = settings.get("layer_types")
    unknown = sorted(set(layer_types or ()) - {SLIDING, GLOBAL})
    if unknown:
        raise Unsupported("layer_types", f"layer_types {unknown} are neither {SLIDING!r} nor {GLOBAL!r}")
    window = settings.get("sliding_window")
    slides = layer_types is None or SLIDING in layer_types  # the classes' default layer types slide
    if "sliding_window" in settings and slides and not (isinstance(window, int) and window >= 1):
        raise Unsupported("sliding_window", f"sliding layers need sliding_window >= 1, got {window!r}")


def check_gemma3_settings(settings: Mapping) -> None:
    """What HF's Gemma 3 computes as this family does (transformers 5.23)."""
    check_sliding_settings(settings)
    cap = settings.get("attn_logit_softcapping")
    if cap is not None:
        raise Unsupported(
            "attn_logit_softcapping",
            f"attn_logit_softcapping={cap} is set, but HF's Gemma3Attention never applies it (its attention is "
            "not softcapped); set it to None",
        )
    if settings.get("use_bidirectional_attention"):
        raise Unsupported(
            "use_bidirectional_attention",
            "use_bidirectional_attention=True is not causal decoding; longstraw needs False",
        )


def check_gpt_oss_settings(settings: Mapping) -> None:
    """What HF's gpt-oss computes as this family does (transformers 5.17-5.23)."""
    check_sliding_settings(settings)
    for key in ("rope_parameters", "rope_scaling"):  # rope_scaling: the older name, which HF converts
        rope_type = (settings.get(key) or {}).get("rope_type", "default")
        if rope_type in LENGTH_DEPENDENT_ROPE:
            raise Unsupported(
                key,
                f"rope_type {rope_type!r} sets its frequencies from the longest position of each forward, which a "
                "chunked capture does not see as HF's one pass does; use a static rope (yarn)",
            )


# family -> its declarations (`families/<family>.py`'s adapters run these model types; a test ties the two)
FAMILIES = {
    "dense": (Support(("llama", "qwen3")), Support(("glm4_moe",), no_float64=ROUTED_EXPERTS)),
    "hybrid": (
        Support(("qwen3_5", "qwen3_5_text")),
        Support(("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"), no_float64=ROUTED_EXPERTS),
    ),
    "mla": (Support(("glm_moe_dsa", "deepseek_v32", "deepseek_v3"), no_float64=ROUTED_EXPERTS),),
    "sliding": (
        # a preset names Gemma 3 by its config class's key ("gemma3"), HF's config by its model_type
        Support(("gemma3", "gemma3_text"), no_context_parallel=WINDOW_KV, check_settings=check_gemma3_settings),
        Support(
            ("gpt_oss",),
            no_float64=ROUTED_EXPERTS,
            no_context_parallel=WINDOW_KV_AND_SINKS,
            check_settings=check_gpt_oss_settings,
        ),
    ),
}
SUPPORT = {model_type: s for supports in FAMILIES.values() for s in supports for model_type in s.model_types}


def support_of(model_type: str | None) -> Support | None:
    """The declaration of the family that runs `model_type` (None: no family does; the adapter names it)."""
    return SUPPORT.get(model_type)
