"""Independent references built only from HF's own forward, cache and autograd (no other longstraw code):
what the tests and the validation levels (`longstraw.kinds.validation`) compare our gradients with.

    from longstraw.core.hf_reference import hf_conditional_logprobs, hf_full_logprobs, global_relative_error
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager

import torch
from transformers import DynamicCache


def _response_logprobs(logits_TV, response_R):
    logp = torch.log_softmax(logits_TV.float(), dim=-1)
    return logp.gather(-1, response_R[:, None]).squeeze(-1)


def hf_full_logprobs(model, prompt_P, response_R):
    """HF one-pass forward over prompt + response: log p(y_t | p, y_<t), under autograd."""
    ids = torch.cat([prompt_P, response_R])[None]
    logits = model(input_ids=ids).logits[0]
    P, R = prompt_P.numel(), response_R.numel()
    return _response_logprobs(logits[P - 1 : P + R - 1], response_R)


def _assigning_recurrent_update(layer):
    """HF's GDN cache copy_s the new recurrent state into the tensor autograd saved; assign instead."""

    def update_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):
        self.recurrent_states[state_idx] = recurrent_states
        return recurrent_states

    layer.update_recurrent_state = types.MethodType(update_recurrent_state, layer)


def hf_caches_latents(model, prompt_P) -> bool:
    """Whether HF's cache holds an MLA model's latents (transformers >= 5.23) or its expanded per-head K/V (5.17,
    computed without grad in `hf_conditional_logprobs`, so kv_b_proj gets no gradient through the prompt there,
    while ours, whose state is the latents, expands them under autograd as 5.23 does)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt_P[None, :2], past_key_values=cache, use_cache=True)
    return cache.layers[0].keys.shape[1] == 1


def hf_conditional_logprobs(model, prompt_P, response_R):
    """The conditional-response reference: prompt minus its last token through HF
    without grad into a DynamicCache, then the last prompt token + response on that cache with grad."""
    config = model.config if not hasattr(model, "get_base_model") else model.get_base_model().config
    cache = DynamicCache(config=config)
    with torch.no_grad():
        if prompt_P.numel() > 1:
            model(input_ids=prompt_P[None, :-1], past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            _assigning_recurrent_update(layer)
    inputs = torch.cat([prompt_P[-1:], response_R[:-1]])[None]
    logits = model(input_ids=inputs, past_key_values=cache, use_cache=True).logits[0]
    return _response_logprobs(logits, response_R)


@contextmanager
def hf_torch_gdn_kernels(model):
    """Make HF's GDN layers run HF's own torch chunk kernel, not fla's, inside the block.

    fla's chunk backward raises on Hopper with Triton 3.4-3.7 (docs/design.md), so a gradient
    reference on CUDA must take HF's torch path. transformers 5.17 binds the kernel per layer
    (`layer.chunk_gated_delta_rule`); 5.23 wraps the module-level torch function, keeping the
    original as `__wrapped__`. Both are undone on exit."""
    undo = []
    for layer in model.modules():
        modeling = sys.modules[type(layer).__module__]
        torch_kernel = getattr(modeling, "torch_chunk_gated_delta_rule", None)
        if torch_kernel is None or not hasattr(layer, "A_log"):
            continue
        plain = getattr(torch_kernel, "__wrapped__", torch_kernel)
        if "chunk_gated_delta_rule" in vars(layer):
            undo.append((vars(layer), "chunk_gated_delta_rule", layer.chunk_gated_delta_rule))
            layer.chunk_gated_delta_rule = plain
        elif plain is not torch_kernel:
            undo.append((vars(modeling), "torch_chunk_gated_delta_rule", torch_kernel))
            modeling.torch_chunk_gated_delta_rule = plain
    try:
        yield
    finally:
        for namespace, name, value in reversed(undo):
            namespace[name] = value


def grads_of(model, losses) -> dict:
    """Backward `losses` (one loss, or an iterable consumed one at a time so only one graph lives) and
    return {name: grad clone} of the trainable parameters, zeroing them before and after."""
    model.zero_grad(set_to_none=True)
    for loss in [losses] if isinstance(losses, torch.Tensor) else losses:
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def max_relative_error(actual: dict, expected: dict) -> float:
    """max over parameters of ||a - e|| / ||e|| (a missing grad counts as zero; the denominator is
    floored at 1e-6 of the whole gradient's norm so unused experts do not divide by zero)."""
    names = set(actual) | set(expected)
    zero = next(iter(expected.values()))
    total = global_norm(expected)
    worst = 0.0
    for name in names:
        e = expected.get(name, torch.zeros_like(actual.get(name, zero)))
        a = actual.get(name, torch.zeros_like(e))
        worst = max(worst, float((a - e).double().norm()) / max(float(e.double().norm()), 1e-6 * total))
    return worst


def global_norm(grads: dict) -> float:
    """The norm of the whole gradient vector {name: grad} (all parameters together)."""
    return sum(float(g.double().norm() ** 2) for g in grads.values()) ** 0.5


def global_relative_error(actual: dict, expected: dict) -> float:
    """||a - e|| / ||e|| over the whole gradient vector (all parameters together).

    For Gated DeltaNet models, HF's own full-sequence and cache paths disagree by up to ~1% on the
    tiny decay-parameter gradients (A_log, dt_bias) in float32, so per-parameter comparisons against
    HF's one-pass gradient are limited by HF, not by the code under test."""
    diff = sum(float((actual.get(k, torch.zeros_like(v)) - v).double().norm() ** 2) for k, v in expected.items())
    return diff**0.5 / global_norm(expected)


def global_cosine(actual: dict, expected: dict) -> float:
    """cos(a, e) over the whole gradient vector (all parameters together; a missing grad is zero)."""
    dot = sum(float((actual[k].double() * v.double()).sum()) for k, v in expected.items() if k in actual)
    return dot / (global_norm(actual) * global_norm(expected))
