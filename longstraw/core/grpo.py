"""The GRPO objective as pure torch functions, arranged for serial response replay.

Objective
---------
One prompt, ``G = num_generations`` sampled responses ``o_1..o_G`` with scalar rewards
``r_1..r_G``. Advantages are group-relative (:func:`group_advantages`)::

    A_i = (r_i - mean(r)) / (std(r) + 1e-4)      scale_rewards="group"
    A_i =  r_i - mean(r)                         scale_rewards="none"

where ``std`` is the *unbiased* (Bessel-corrected, ``torch.std`` default) group std, exactly
as TRL's ``GRPOTrainer`` computes it (for G == 1 the std is taken as 0, so A = 0).

Every completion token t of response i gets the clipped-surrogate loss plus an optional
k3 KL penalty towards a reference policy (:func:`per_token_loss`)::

    ratio_it = exp(logp_it - old_logp_it)
    l_it = -min(ratio_it * A_i, clip(ratio_it, 1 - epsilon, 1 + epsilon_high) * A_i)
           + beta * (exp(ref_it - logp_it) - (ref_it - logp_it) - 1)

``old_logp`` and ``ref_logp`` are constants (detached); only ``logp`` carries gradient.
The group loss aggregates ``l_it`` according to ``loss_type`` (in TRL, a padded batch with a completion
mask; `tests/grpo_reference.py` writes it that way)::

    grpo    : mean_i ( sum_t l_it / L_i )                       (length-biased)
    bnpo    : sum_it l_it / sum_i L_i
    dapo    : sum_it l_it / num_items_in_batch = sum_it l_it / sum_i L_i
    dr_grpo : sum_it l_it / (G * max_completion_length)

Serial replay
-------------
Every aggregation above is *linear* in the per-response token sums ``S_i = sum_t l_it``
with coefficients that depend only on the response lengths, which are known once sampling
is done. :func:`token_weights` returns those coefficients ``w_i``, so that::

    batch_loss(...) == sum_i w_i * S_i == sum_i response_loss(..., weight=w_i)

and calling ``response_loss(...).backward()`` once per response, one response at a time,
accumulates exactly the gradient of the one-big-batch loss.

Simplifications (relative to TRL's ``GRPOTrainer``)
---------------------------------------------------
* A single prompt per transaction and a single process: "dapo" (normalise by the active
  tokens of the global accumulated batch) and "bnpo" (normalise by the active tokens of
  the local batch) coincide, both equal ``1 / sum_i L_i``. There is no gradient
  accumulation divisor; callers that accumulate several prompts scale themselves.
* Token-level importance sampling only (no GSPO ``importance_sampling_level="sequence"``),
  no two-sided ``delta`` clipping, no entropy bonus / top-entropy token masking, no vLLM
  importance-sampling correction, no truncated-completion masking, no ``"batch"`` reward
  scaling (identical to ``"group"`` for a single-prompt batch anyway), one reward per
  response (reward-function weighting happens upstream).
* Loss arithmetic is done in at least float32 (bf16 log-probs are upcast).

Names follow TRL's ``GRPOConfig``: ``num_generations``, ``beta``, ``epsilon``,
``epsilon_high``, ``loss_type``, ``scale_rewards``, ``max_completion_length``; the logged
metric names of :func:`summarize_stats` follow TRL's (``clip_ratio/low_mean``, ``kl``, ...).

Default ``loss_type`` is ``"dapo"``, the current TRL default: it has no per-response length
bias (unlike ``"grpo"``) and needs no ``max_completion_length`` (unlike ``"dr_grpo"``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from longstraw.config.grpo import LOSS_TYPES, SCALE_REWARDS, GRPOConfig, _is_real, normalize_scale_rewards

__all__ = [
    "LOSS_TYPES",
    "SCALE_REWARDS",
    "GRPOConfig",
    "normalize_scale_rewards",
    "group_advantages",
    "reward_tensor",
    "k3_kl",
    "per_token_loss",
    "token_weights",
    "response_loss",
    "GroupObjective",
    "ResponseStats",
    "response_stats",
    "summarize_stats",
]


STD_EPS = 1e-4  # TRL: advantages / (std_rewards + 1e-4)

Advantage = float | int | torch.Tensor


# --------------------------------------------------------------------------------------
# Advantages and KL
# --------------------------------------------------------------------------------------


def group_advantages(
    rewards_G,
    scale_rewards: str | bool = "group",
    *,
    num_generations: int | None = None,
    nan_unscorable: bool = False,
) -> torch.Tensor:
    """Group-relative advantages, float32, shape ``[G]``, on the rewards' device.

    ``rewards - mean``, divided by ``(std + 1e-4)`` when ``scale_rewards`` is ``"group"``/True.
    ``std`` is the unbiased sample std (``torch.std`` default, as in TRL); for G == 1 it is 0.
    Computed in float64, returned as float32. If ``num_generations`` is given, ``G`` must
    equal it. ``nan_unscorable=True`` is TRL's rule for a response no reward function scored (its
    reward NaN): it is left out of the mean and std and its advantage is 0; otherwise a NaN is refused.
    """
    mode = normalize_scale_rewards(scale_rewards)
    r = reward_tensor(rewards_G)
    if r.dim() != 1 or r.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D sequence, got shape {tuple(r.shape)}")
    if num_generations is not None and r.numel() != num_generations:
        raise ValueError(f"rewards has {r.numel()} entries but num_generations={num_generations}")
    scored = ~torch.isnan(r) if nan_unscorable else torch.ones_like(r, dtype=torch.bool)
    if not bool(torch.isfinite(r[scored]).all()):
        raise ValueError(f"rewards must be finite{' or NaN (unscorable)' if nan_unscorable else ''}, got {r.tolist()}")
    kept = r[scored]
    adv = r - (kept.mean() if kept.numel() else 0.0)
    if mode == "group":
        std = kept.std() if kept.numel() > 1 else torch.zeros((), dtype=r.dtype, device=r.device)
        adv = adv / (std + STD_EPS)
    return torch.where(scored, adv, 0.0).to(torch.float32)


def reward_tensor(rewards, dtype=torch.float64) -> torch.Tensor:
    """`rewards` as a tensor of `dtype` (a tensor keeps its device), refusing an entry that is not a number
    (None, a string) with a ValueError naming it."""
    if isinstance(rewards, torch.Tensor):
        return rewards.detach().to(dtype)
    try:
        return torch.as_tensor(rewards, dtype=dtype)
    except (TypeError, ValueError, RuntimeError):
        if not isinstance(rewards, (list, tuple)):
            raise ValueError(f"rewards must be a sequence of numbers, one per response, got {rewards!r}") from None
        bad = next((f": rewards[{i}] is {r!r}" for i, r in enumerate(rewards) if not _is_number(r, dtype)), "")
        raise ValueError(f"rewards must be numbers, one per response, got {list(rewards)!r}{bad}") from None


def _is_number(value, dtype) -> bool:
    try:
        return torch.as_tensor(value, dtype=dtype).dim() == 0
    except (TypeError, ValueError, RuntimeError):
        return False


def k3_kl(logp_R: torch.Tensor, ref_logp_R: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0).

    Differentiable w.r.t. ``logp_R``; ``ref_logp_R`` is treated as a constant.
    """
    _check_1d("logp", logp_R)
    _check_same_len("ref_logp", ref_logp_R, logp_R)
    dtype = _compute_dtype(logp_R)
    d = ref_logp_R.detach().to(device=logp_R.device, dtype=dtype) - logp_R.to(dtype)
    return torch.exp(d) - d - 1.0


# --------------------------------------------------------------------------------------
# Per-token loss and serial replay
# --------------------------------------------------------------------------------------


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    if not t.is_floating_point():
        raise ValueError(f"log-probs must be a floating-point tensor, got dtype {t.dtype}")
    return torch.promote_types(t.dtype, torch.float32)


def _check_1d(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one response's tokens), got shape {tuple(t.shape)}")


def _check_same_len(name: str, t, ref: torch.Tensor) -> None:
    _check_1d(name, t)
    if t.shape[0] != ref.shape[0]:
        raise ValueError(f"length mismatch: {name} has {t.shape[0]} tokens, logp has {ref.shape[0]}")


def _advantage_value(advantage: Advantage, device, dtype):
    """Scalar advantage as a python float or a detached 0-d tensor (no host sync for tensors)."""
    if isinstance(advantage, torch.Tensor):
        if advantage.numel() != 1:
            raise ValueError(f"advantage must be a scalar, got shape {tuple(advantage.shape)}")
        return advantage.detach().reshape(()).to(device=device, dtype=dtype)
    if not _is_real(advantage) or not math.isfinite(advantage):
        raise ValueError(f"advantage must be a finite scalar, got {advantage!r}")
    return float(advantage)


def per_token_loss(
    logp_R: torch.Tensor,
    old_logp_R: torch.Tensor | None,
    ref_logp_R: torch.Tensor | None,
    advantage: Advantage,
    config: GRPOConfig,
) -> torch.Tensor:
    """Per-token GRPO loss ``[R]`` for one response (see module docstring).

    ``old_logp_R=None`` means on-policy (``old = logp.detach()``, ratio 1, as TRL does with
    ``num_iterations == 1``). ``ref_logp_R`` is required iff ``config.beta > 0`` (ignored
    when beta == 0). Only ``logp_R`` receives gradient. Result dtype: at least float32.
    """
    _check_1d("logp", logp_R)
    dtype = _compute_dtype(logp_R)
    logp = logp_R.to(dtype)
    if old_logp_R is None:
        old = logp.detach()
    else:
        _check_same_len("old_logp", old_logp_R, logp_R)
        old = old_logp_R.detach().to(device=logp.device, dtype=dtype)
    adv = _advantage_value(advantage, logp.device, dtype)

    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1.0 - config.epsilon, 1.0 + config.epsilon_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    if config.beta != 0.0:
        if ref_logp_R is None:
            raise ValueError("ref_logp is required when beta > 0")
        loss = loss + config.beta * k3_kl(logp, ref_logp_R)
    elif ref_logp_R is not None:
        _check_same_len("ref_logp", ref_logp_R, logp_R)
    return loss


def token_weights(lengths_G: Sequence[int], config: GRPOConfig) -> torch.Tensor:
    """Per-response weights ``w_G`` (float64, CPU) fixed before replay, such that
    ``sum_i w_i * per_token_loss_i.sum()`` equals the group loss above for ``config.loss_type``:

    * grpo:     ``w_i = 1 / (G * max(L_i, 1))``
    * bnpo/dapo ``w_i = 1 / max(sum_j L_j, 1)``
    * dr_grpo:  ``w_i = 1 / (G * max_completion_length)``

    (the ``max(., 1)`` clamps mirror TRL's ``.clamp(min=1.0)``; they only matter for empty
    responses, whose token sum is 0 anyway).
    """
    if isinstance(lengths_G, torch.Tensor):
        if lengths_G.dim() != 1 or lengths_G.is_floating_point() or lengths_G.is_complex():
            raise ValueError(f"lengths must be a 1-D integer sequence, got {lengths_G!r}")
        lengths = [int(x) for x in lengths_G.tolist()]
    else:
        lengths = list(lengths_G)
        for x in lengths:
            if not isinstance(x, int) or isinstance(x, bool):
                raise ValueError(f"lengths must be integers, got {x!r}")
    G = len(lengths)
    if G != config.num_generations:
        raise ValueError(f"got {G} response lengths but num_generations={config.num_generations}")
    if any(L < 0 for L in lengths):
        raise ValueError(f"lengths must be >= 0, got {lengths}")
    m = config.max_completion_length
    if m is not None and any(L > m for L in lengths):
        raise ValueError(f"a response length exceeds max_completion_length={m}: {lengths}")

    if config.loss_type == "grpo":
        w = [1.0 / (G * max(L, 1)) for L in lengths]
    elif config.loss_type in ("bnpo", "dapo"):
        w = [1.0 / max(sum(lengths), 1)] * G
    elif config.loss_type == "dr_grpo":
        w = [1.0 / (G * m)] * G
    else:  # pragma: no cover - config validation prevents this
        raise ValueError(f"unknown loss_type {config.loss_type!r}")
    return torch.tensor(w, dtype=torch.float64)


def response_loss(
    logp_R: torch.Tensor,
    old_logp_R: torch.Tensor | None,
    ref_logp_R: torch.Tensor | None,
    advantage: Advantage,
    weight: float | torch.Tensor,
    config: GRPOConfig,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One response's contribution to the group loss: ``weight * per_token_loss(...).sum()``.

    ``weight`` is this response's entry of :func:`token_weights` (a float or 0-d tensor; it is
    converted to a python float so the result keeps the per-token loss dtype; a 0-d tensor on the loss's
    device is read as is: a recorded graph's buffer, whose value is set, and was checked, at each launch:
    ``core.member_graphs``). ``mask`` (bool ``[R]``):
    only its True tokens bear loss (a multi-turn trajectory's actions; its observations are context, as
    TRL masks tool outputs), and the weights then count only those (:func:`token_weights` of the masks' sums).
    """
    if isinstance(weight, torch.Tensor) and weight.numel() != 1:
        raise ValueError(f"weight must be a scalar, got shape {tuple(weight.shape)}")
    buffer = isinstance(weight, torch.Tensor) and weight.device == logp_R.device and weight.device.type != "cpu"
    if not buffer:
        weight = float(weight) if isinstance(weight, torch.Tensor) else weight
        if not _is_real(weight) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"weight must be a finite scalar >= 0, got {weight!r}")
    loss = per_token_loss(logp_R, old_logp_R, ref_logp_R, advantage, config)
    if mask is not None:
        _check_same_len("mask", mask, logp_R)
        loss = loss.where(mask.to(loss.device), 0.0)  # where, not a product: an unmasked inf stays out
    return loss.sum() * (weight.reshape(()).to(loss.dtype) if buffer else weight)


@dataclass(frozen=True)
class GroupObjective:
    """What each member's loss reads besides its own log-probs, fixed before the replays: the old policy's
    log-probs (one ``[R_i]`` tensor per member, or ``None``: on-policy), the reference's (``None`` without a
    reference), the advantages ``[G]``, the token weights ``[G]`` (:func:`token_weights`), the settings and the
    loss masks (one bool ``[R_i]`` per member, or ``None``: every token bears loss)."""

    old: Sequence[torch.Tensor | None]
    ref: Sequence[torch.Tensor] | None
    advantages: torch.Tensor
    weights: torch.Tensor
    config: GRPOConfig
    masks: Sequence[torch.Tensor] | None = None

    def member_loss(self, i: int, logp_R: torch.Tensor) -> torch.Tensor:
        """Member ``i``'s contribution to the group loss (:func:`response_loss`)."""
        ref = None if self.ref is None else self.ref[i]
        mask = None if self.masks is None else self.masks[i]
        return response_loss(logp_R, self.old[i], ref, self.advantages[i], self.weights[i], self.config, mask)


# --------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponseStats:
    """Additive per-response counters, so serial replays can be summarised exactly.

    A token is *low-clipped* when ``ratio < 1 - epsilon`` and ``A < 0``, *high-clipped* when
    ``ratio > 1 + epsilon_high`` and ``A > 0`` (TRL's definition: exactly the tokens whose
    surrogate gradient is zeroed by clipping). ``kl_sum`` is ``None`` without a reference.
    """

    num_tokens: int
    num_low_clipped: int
    num_high_clipped: int
    kl_sum: float | None = None


@torch.no_grad()
def response_stats(
    logp_R: torch.Tensor,
    old_logp_R: torch.Tensor | None,
    ref_logp_R: torch.Tensor | None,
    advantage: Advantage,
    config: GRPOConfig,
    mask: torch.Tensor | None = None,
) -> ResponseStats:
    """Clip counts and KL sum for one response (no gradient; syncs to host); with ``mask`` (bool ``[R]``, the
    loss mask) over its True tokens only, as TRL counts a multi-turn completion's tokens without its tool
    outputs."""
    _check_1d("logp", logp_R)
    if mask is not None:
        _check_same_len("mask", mask, logp_R)
        mask = mask.to(logp_R.device)
        logp_R, old_logp_R, ref_logp_R = (
            None if t is None else t.to(logp_R.device)[mask] for t in (logp_R, old_logp_R, ref_logp_R)
        )
    dtype = _compute_dtype(logp_R)
    logp = logp_R.detach().to(dtype)
    adv = float(_advantage_value(advantage, logp.device, dtype))
    if old_logp_R is None:
        n_low = n_high = 0
    else:
        _check_same_len("old_logp", old_logp_R, logp_R)
        ratio = torch.exp(logp - old_logp_R.detach().to(device=logp.device, dtype=dtype))
        n_low = int((ratio < 1 - config.epsilon).sum()) if adv < 0 else 0
        n_high = int((ratio > 1 + config.epsilon_high).sum()) if adv > 0 else 0
    kl_sum = None if ref_logp_R is None else float(k3_kl(logp, ref_logp_R).sum())
    return ResponseStats(int(logp.shape[0]), n_low, n_high, kl_sum)


def summarize_stats(stats: Sequence[ResponseStats]) -> dict:
    """Token-weighted group metrics with TRL's names: ``clip_ratio/low_mean``,
    ``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``kl`` (only if every response had a
    reference) and ``num_tokens``."""
    stats = list(stats)
    n = sum(s.num_tokens for s in stats)
    denom = max(n, 1)
    low = sum(s.num_low_clipped for s in stats)
    high = sum(s.num_high_clipped for s in stats)
    out = {
        "num_tokens": float(n),
        "clip_ratio/low_mean": low / denom,
        "clip_ratio/high_mean": high / denom,
        "clip_ratio/region_mean": (low + high) / denom,
    }
    if stats and all(s.kl_sum is not None for s in stats):
        out["kl"] = sum(s.kl_sum for s in stats) / denom
    return out
