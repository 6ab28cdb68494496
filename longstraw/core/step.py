"""One GRPO transaction for one prompt and G given responses, in three modes:

- `replay` (ours): capture once (or reuse `state`), score the reference (beta > 0) graph-free from the
  state, replay responses one at a time with one backward each; the live graph is one response.
- `hold_all`: same capture and scoring, but all G response graphs stay alive for one backward.
- `naive`: what standard trainers do: each response's full prompt+response forward under
  autograd with gradient checkpointing (HF's own forward), scoring by full forwards too.

Unless the caller gives the old policy's log-probs, they are the gradient pass's own, detached (ratio 1),
as TRL takes them with `num_iterations=1`: a scoring pass would run the same function on the same state
with the same weights (a state reused across updates included), so it only measures whether the kernels
agree, which `StepOptions(old_policy="score")` does (`logp_mismatch`).

`StepOptions(prefix_grad=True)` (replay and hold_all) is the exact mode (`longstraw.core.exact`): the capture
keeps what the prompt-side term needs, and `state.backward_prefix()` runs after the replays (phase
`prefix_backward`), so the step applies the full-sequence gradient instead of the conditional one.

All modes share the objective (`longstraw.core.grpo`) and the token normalisation fixed before the
replays, so their accumulated gradients agree; they differ only in memory and time.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from longstraw.core import grpo
from longstraw.core.exact import clear_page_gradients
from longstraw.core.hf_reference import hf_torch_gdn_kernels
from longstraw.core.member_graphs import MemberGraphs, state_layout
from longstraw.core.transaction import (
    capture,
    check_deterministic,
    check_members_entry,
    check_state,
    check_vocabulary,
    deterministic_checked,
    replay,
    replay_members,
    reuse_state,
    score,
)
from longstraw.families import adapter_for
from longstraw.kernels.logprobs import token_logprobs
from longstraw.measure.memory import GraphBytesMeter, PhaseRecorder
from longstraw.results import SKIPPED
from longstraw.state import ResidentState
from longstraw.state.resident import check_positions

MODES = ("replay", "hold_all", "naive")
OLD_POLICIES = ("current", "score")


@dataclass(frozen=True)
class StepOptions:
    """How one step runs. `mode`: replay | hold_all | naive; `prefix_grad`: the exact mode;
    `capture`: `capture()` keyword arguments when the step captures the prompt itself;
    `max_grad_norm`: clip the accumulated gradient before the optimizer step (`grad_norm` reports
    it unclipped); `members=k`: score and replay only the first k responses (a memory probe of the
    serial modes, see `grpo_step`); `checkpoint_layers`: replay under whole-layer activation
    checkpointing (`replay`; replay and hold_all; naive checkpoints HF's layers anyway). `old_policy`: where
    the old-policy log-probs come from when the caller gives none: `current` takes the gradient pass's own,
    detached (see the module doc); `score` scores them in a graph-free pass first, which measures the
    training/inference mismatch (`logp_mismatch`). `micro_batch` (mode replay): members replayed together, one
    graph and one backward per batch of k (`replay_members`); "auto" replays the first member alone, then
    takes k as its graph bytes fit `member_budget_bytes` (default: half the device's free memory then; off
    CUDA without a budget, 1). k=1 is the serial path; the group's peak grows with k, not with G."""

    mode: str = "replay"
    prefix_grad: bool = False
    capture: dict = field(default_factory=dict)
    max_grad_norm: float | None = None
    members: int | None = None
    checkpoint_layers: bool = False
    old_policy: str = "current"
    micro_batch: int | str = 1
    member_budget_bytes: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.old_policy not in OLD_POLICIES:
            raise ValueError(f"old_policy must be one of {OLD_POLICIES}, got {self.old_policy!r}")
        k = self.micro_batch
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"micro_batch must be a positive integer or 'auto', got {k!r}")
        if k != 1 and self.mode != "replay":
            raise ValueError(f"micro_batch={k!r} batches replayed members: mode 'replay' only, not {self.mode!r}")
        if k != 1 and self.capture.get("cp") is not None:
            raise ValueError("micro_batch > 1 is not implemented for a context-parallel state")
        if self.prefix_grad and self.mode == "naive":
            raise ValueError(
                "prefix_grad needs a captured state; mode 'naive' already back-propagates through the prompt"
            )


@dataclass
class StepResult:
    """The step's measurements, and the resident state it used (reuse it for the next step of the
    same prompt: prefix reuse; `state.age` counts the steps it has served). No state in naive mode."""

    metrics: dict
    state: ResidentState | None


@contextmanager
def reference_policy(model):
    """The reference model = the base model with the peft adapter disabled (or the model itself)."""
    disable = getattr(model, "disable_adapter", None)
    with disable() if callable(disable) else nullcontext():
        yield


def naive_logprobs(model, prompt_ids, response_ids):
    """HF one-pass forward over prompt+response (checkpointed when grad is on), response log-probs."""
    adapter = adapter_for(model)
    ids = torch.cat([prompt_ids, response_ids[:-1]])[None]
    hidden = adapter.decoder(input_ids=ids, use_cache=False).last_hidden_state[0]
    return token_logprobs(hidden[prompt_ids.numel() - 1 :], adapter.lm_head, response_ids)


NON_REENTRANT = {"use_reentrant": False}


@contextmanager
def hf_checkpointing(model, kwargs: dict | None = NON_REENTRANT):
    """HF's own activation checkpointing on the model's layers, in training mode, for the block (`kwargs`: what
    `activation_checkpointing_enable` passes to `torch.utils.checkpoint`; None: that transformers' default)."""
    lm = adapter_for(model).lm
    was_training = lm.training
    # transformers renamed gradient -> activation checkpointing; support both spellings
    if hasattr(lm, "activation_checkpointing_enable"):
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        disable = lm.activation_checkpointing_disable
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        disable = lm.gradient_checkpointing_disable
    lm.train()
    try:
        yield
    finally:
        disable()
        lm.train(was_training)


def grpo_step(
    model,
    prompt_ids,
    responses,
    rewards,
    optimizer,
    config: grpo.GRPOConfig,
    options: StepOptions = StepOptions(),
    *,
    state: ResidentState | None = None,
    ref_state: ResidentState | None = None,
    old_logps=None,
    sampler_logps=None,
    advantages=None,
    graphs: MemberGraphs | None = None,
) -> StepResult:
    """Run one transaction and the optimizer step.

    `state`: the prompt's resident state from an earlier capture (checked against the model and the
    prompt), else the step captures it. `old_logps`: the old policy's log-probs from sampling, else
    scored from the state. Reference log-probs (`config.beta > 0`) are scored with the adapter
    disabled on `ref_state`, the prompt captured by the reference policy, when given (the trainer
    keeps one per prompt: the frozen base never makes it stale); without it, on the policy's own
    state: the reference's response distribution given the policy's prompt state, which saves a
    second resident state and is what the memory experiments measure.

    `advantages`: the group's advantages when a caller computes them by another rule (the text trainer
    follows TRL's for unscorable completions, whose reward is NaN); else `group_advantages(rewards)`.

    `metrics["old_policy"]` says where the old log-probs came from: `given` (`old_logps`), `scored` (a
    graph-free pass, `options.old_policy="score"`) or `current` (the gradient pass's own, detached; no
    extra pass). `metrics["logp_mismatch"]` is the max and mean |log p_replay - log p_old| over the replayed
    tokens, before the update (None for `current`): scoring and replay run one attention kernel, so at the
    on-policy point it measures what remains of the training/inference mismatch (0 when the kernels agree
    bit for bit).
    `sampler_logps` (the sampler's own log-probs, from its decoding kernels) are compared the same way
    (`logp_mismatch_sampler`) and not used otherwise.

    A group whose loss or gradient norm is not finite is not applied: the optimizer does not step (its state
    and the weights stay as they were), the gradients are dropped, and `metrics["update_skipped"]` says why
    (None for an applied step).

    `options.members=k` scores and replays only the first k responses (advantages and token
    weights still come from all G): one member at a time is live in the serial modes, so every
    member of equal length reaches the same peak. The metrics say so.

    `graphs` (a `MemberGraphs` the caller keeps across steps; mode replay on CUDA): the members, their losses
    and their backward run as one CUDA graph, recorded on the first step of a signature (phase
    `graph_record`) and launched on later ones (`longstraw.core.member_graphs`)."""
    mode, members = options.mode, options.members
    rewards, advantages, weights = group_objective(responses, rewards, config, advantages)
    if members is not None and not (mode != "hold_all" and 1 <= members <= len(responses)):
        raise ValueError(
            f"members={members!r}: a partial step is a memory probe of the serial modes (replay, naive) "
            f"and needs 1 <= members <= G={len(responses)}; hold_all's peak depends on all G graphs"
        )
    if (state is not None or ref_state is not None) and mode == "naive":
        raise ValueError("mode 'naive' recomputes the prompt per response and takes no captured state")
    if options.micro_batch != 1 and state is not None:
        check_members(state)
    if options.prefix_grad and state is not None and state.prefix_trace is None:
        raise ValueError("prefix_grad=True needs a state captured with capture(..., prefix_grad=True)")
    adapter = adapter_for(model)
    check_step_inputs(adapter, prompt_ids, responses, options, state, ref_state, old_logps, sampler_logps)
    if graphs is not None:
        check_graphs(graphs, adapter, options, state)
    if len(responses) == 1:
        warnings.warn(
            "a group of one response has zero advantage: the step leaves the policy unchanged "
            "(only a KL term, beta > 0, can move it)",
            stacklevel=2,
        )
    recorder = PhaseRecorder(adapter.device)
    responses = responses[:members]
    age = state.age if state is not None else 0

    with undone_on_failure(model, state):  # a step that raises leaves no gradient for the next one to apply
        if mode == "naive":

            def scorer(y, scored_state=None):  # naive takes no state: it recomputes the prompt
                with torch.no_grad():
                    return naive_logprobs(model, prompt_ids, y)
        else:
            if state is None:
                with recorder.phase("capture"), deterministic_checked(model):  # check_step_inputs checked
                    state = capture(model, prompt_ids, prefix_grad=options.prefix_grad, **options.capture)
                if options.micro_batch != 1:
                    check_members(state)
            fingerprint = state.fingerprint()

            def scorer(y, scored_state=None):
                return score(model, state if scored_state is None else scored_state, y)

        # naive runs HF's own forward: its torch GDN kernel, whose backward works everywhere (fla's fails on Hopper)
        with hf_torch_gdn_kernels(model) if mode == "naive" else nullcontext():
            old_policy = old_source(old_logps, options)
            if old_policy == "scored":
                with recorder.phase("old_scoring"):
                    old = [scorer(y) for y in responses]
            else:
                old = old_logps if old_policy == "given" else [None] * len(responses)
            ref = None
            if config.beta > 0:
                with recorder.phase("ref_scoring"), reference_policy(model):
                    ref = [scorer(y, ref_state) for y in responses]
            objective = grpo.GroupObjective(old, ref, advantages, weights, config)
            losses, logps, meter, k = _replay_and_backward(
                model, prompt_ids, state, responses, objective, mode, recorder, options, graphs
            )
        if options.prefix_grad:
            with recorder.phase("prefix_backward"):
                state.backward_prefix()
        cp = getattr(state, "cp", None)
        if cp is not None:  # every rank holds the same gradient already; one all-reduce keeps the steps identical
            cp.average_gradients_([p for p in model.parameters() if p.requires_grad])
        grad_norm = gradient_norm(model)
        total_loss = float(sum(float(loss.detach()) for loss in losses))
        skipped = nonfinite_update(total_loss, grad_norm)
        if options.max_grad_norm is not None and skipped is None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], options.max_grad_norm)
    with recorder.phase("optimizer_step"):
        if skipped is None:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    metrics = {
        "mode": mode,
        "loss": total_loss,
        "grad_norm": grad_norm,
        SKIPPED: skipped,
        "reward_mean": float(rewards.nanmean()),  # NaN rewards (unscorable, with given advantages) left out
        "advantages": [float(a) for a in advantages],
        "members_replayed": len(responses),
        "micro_batch": min(k, len(responses)),  # the largest batch that ran, not what was asked
        "response_tokens": [int(r.numel()) for r in responses],
        "graph_bytes_peak": meter.peak or (graphs.graph_bytes if graphs is not None else 0),
        "old_policy": old_policy,
        "logp_mismatch": None if old_policy == "current" else logp_mismatch(logps, old),
        **({"logp_mismatch_sampler": logp_mismatch(logps, sampler_logps)} if sampler_logps is not None else {}),
        **({"member_graph_records": graphs.records} if graphs is not None else {}),
        "phases": recorder.phases,
        "stats": grpo.summarize_stats(
            [
                grpo.response_stats(lp.detach(), old[i], ref and ref[i], advantages[i], config)
                for i, lp in enumerate(logps)
            ]
        ),
    }
    if state is not None:
        metrics["resident_bytes"] = state.nbytes
        metrics["predicted_resident_bytes"] = state.predicted_nbytes
        metrics["prompt_positions"] = state.positions + 1
        metrics["state_unchanged"] = state.fingerprint() == fingerprint
        metrics["state_age"] = age
        state.age += 1  # the parameters moved once more since the capture
        reuse_state(model, state)  # it serves the updated weights as a stale prefix (prefix reuse, by design)
    if ref_state is not None:
        reuse_state(model, ref_state)  # the reference's capture: the adapter's update does not reach it
    return StepResult(metrics, state)


def check_graphs(graphs, adapter, options: StepOptions, state) -> None:
    """Refuse, before any work, a step whose members cannot run as a recorded CUDA graph."""
    if not isinstance(graphs, MemberGraphs):
        raise TypeError(f"graphs must be a MemberGraphs kept across steps, got {type(graphs).__name__}")
    problems = [
        f"the model is on {adapter.device}, not a CUDA device" if adapter.device.type != "cuda" else None,
        f"mode {options.mode!r} (mode replay only)" if options.mode != "replay" else None,
        "micro_batch 'auto' (its k comes from an eager first member; give k)"
        if options.micro_batch == "auto"
        else None,
        "prefix_grad (the exact mode)" if options.prefix_grad else None,
        "a context-parallel capture" if options.capture.get("cp") is not None else None,
        "host_pages (a graph reads device memory)" if options.capture.get("host_pages") else None,
    ]
    problems = [p for p in problems if p]
    if problems:
        raise ValueError("replay.cuda_graph: the members cannot run as a CUDA graph here: " + "; ".join(problems))
    if state is not None:
        state_layout(state)  # refuses entries a graph cannot read


def old_source(old_logps, options: StepOptions) -> str:
    """Where a step's old-policy log-probs come from (`metrics["old_policy"]` of `grpo_step`)."""
    if old_logps is not None:
        return "given"
    return "scored" if options.old_policy == "score" else "current"


def check_step_inputs(
    adapter, prompt_ids, responses, options: StepOptions, state, ref_state, old_logps, sampler_logps
) -> None:
    """Everything a step can check before any work: the policy deterministic, the states the model's and the
    prompt's, the responses' ids (one sync) and positions, the given log-probs one [R_i] tensor per response."""
    check_deterministic(adapter.model)
    for given in (state, ref_state):
        if given is not None:
            check_state(adapter, given)
            given.check_prompt(prompt_ids)
    ids = torch.cat([r.reshape(-1) for r in responses])
    if ids.dtype not in (torch.int64, torch.int32) or ids.device != adapter.device:
        raise ValueError(f"responses: integer token ids on {adapter.device}, got {ids.dtype} on {ids.device}")
    check_vocabulary(ids, "responses", adapter)
    limit = (
        state.max_positions
        if state is not None
        else (
            None
            if options.capture.get("beyond_max_positions")
            else getattr(adapter.config, "max_position_embeddings", None) or None
        )
    )
    check_positions(prompt_ids.numel() - 1, max(r.numel() for r in responses), limit, "responses")
    for name, given in (("old_logps", old_logps), ("sampler_logps", sampler_logps)):
        if given is None:
            continue
        if len(given) != len(responses):
            raise ValueError(f"{name}: {len(responses)} tensors, one per response, got {len(given)}")
        for i, (lp, r) in enumerate(zip(given, responses)):
            if not isinstance(lp, torch.Tensor) or lp.shape != r.shape:
                shape = tuple(lp.shape) if isinstance(lp, torch.Tensor) else type(lp).__name__
                raise ValueError(
                    f"{name}[{i}]: one log-prob per token of response {i}, shape {tuple(r.shape)}, got {shape}"
                )


@contextmanager
def undone_on_failure(model, state: ResidentState | None = None):
    """A block that leaves the model's gradients (and a given exact-mode state's page gradients) as it found
    them if it raises, so that a failed step hands nothing to the next one's optimizer step. It starts
    from none held: a step applies its own group's gradient, so gradients left by earlier work (not all
    zero) are refused before it starts."""
    params = list(model.parameters())
    held = [p.grad for p in params if p.grad is not None]
    if held and int(torch.stack([g.count_nonzero() for g in held]).sum()):
        raise ValueError(
            "the model holds gradients from earlier work (non-zero .grad); a step applies its group's "
            "gradient alone: call optimizer.zero_grad() first"
        )
    had = {id(p) for p in params if p.grad is not None}
    try:
        yield
    except BaseException:
        for p in params:
            if id(p) in had:
                p.grad.zero_()
            else:
                p.grad = None
        if state is not None and state.prefix_trace is not None:
            clear_page_gradients(state)
        raise


def _replay_and_backward(
    model, prompt_ids, state, responses, objective: grpo.GroupObjective, mode, recorder, options: StepOptions, graphs
):
    """Each response's loss and its gradient: replay (one graph per batch of `options.micro_batch` members;
    with `graphs`, all batches as one recorded CUDA graph), hold_all (all G graphs, one backward) or naive
    (HF's checkpointed forward over prompt + response, one at a time). Returns (detached losses, detached
    log-probs, the graph-bytes meter, the batch size used)."""
    exclude = list(model.parameters()) + ([t for e in state.layers for t in e.tensors()] if state else [])
    meter = GraphBytesMeter(exclude=exclude)
    losses, logps = [], []
    checkpoint_layers = options.checkpoint_layers

    with meter:
        if mode == "hold_all":
            with recorder.phase("replay"):
                for i, y in enumerate(responses):
                    logps.append(replay(model, state, y, checkpoint_layers=checkpoint_layers))
                    losses.append(objective.member_loss(i, logps[-1]))
                torch.stack(losses).sum().backward()
            return [loss.detach() for loss in losses], [lp.detach() for lp in logps], meter, 1
        if mode == "naive":
            with hf_checkpointing(model):
                for i, y in enumerate(responses):
                    with recorder.phase("replay"):
                        logp = naive_logprobs(model, prompt_ids, y)
                        loss = objective.member_loss(i, logp)
                        loss.backward()
                    losses.append(loss.detach())
                    logps.append(logp.detach())
                    del logp, loss
            return losses, logps, meter, 1
        k, start = (1 if options.micro_batch == "auto" else options.micro_batch), 0
        if graphs is not None:
            batches = [range(s, min(s + k, len(responses))) for s in range(0, len(responses), k)]
            run = graphs.run(
                adapter_for(model), state, responses, batches, objective, checkpoint_layers, recorder, meter
            )
            return (*run, meter, k)
        while start < len(responses):
            members = range(start, min(start + k, len(responses)))
            with recorder.phase("replay"):
                logps_k = replay_members(
                    model,
                    state,
                    [responses[i] for i in members],  # ids: check_step_inputs
                    checkpoint_layers=checkpoint_layers,
                    ids_checked=True,
                )
                losses_k = [objective.member_loss(i, lp) for i, lp in zip(members, logps_k)]
                torch.stack(losses_k).sum().backward()
            losses += [loss.detach() for loss in losses_k]
            logps += [lp.detach() for lp in logps_k]
            del logps_k, losses_k
            if options.micro_batch == "auto" and start == 0:
                k = members_that_fit(meter.peak, options.member_budget_bytes, state.device, len(responses) - 1)
            start = members.stop
    return losses, logps, meter, k


def members_that_fit(member_bytes: int, budget: int | None, device, remaining: int) -> int:
    """`micro_batch="auto"`: how many members' graphs of `member_bytes` each fit the budget (`budget`, else half
    the device's free memory; off CUDA without a budget, 1), at least 1 and at most the members left."""
    if budget is None:
        if device.type != "cuda":
            return 1
        budget = torch.cuda.mem_get_info(device)[0] // 2
    return max(1, min(remaining, budget // max(member_bytes, 1)))


def check_members(state: ResidentState) -> None:
    """Refuse a state whose entries cannot be replayed by several members at once, before any replay."""
    for entry in state.layers:
        check_members_entry(entry)


def logp_mismatch(logps, others) -> dict:
    """max and mean |a - b| over all tokens of paired log-prob tensors (float64 sums)."""
    diffs = torch.cat(
        [(a.detach().double() - b.detach().to(a.device).double()).abs().reshape(-1) for a, b in zip(logps, others)]
    )
    return {"max": float(diffs.max()), "mean": float(diffs.mean())} if diffs.numel() else {"max": 0.0, "mean": 0.0}


def group_objective(responses, rewards, config: grpo.GRPOConfig, advantages=None):
    """(rewards, advantages, token weights) of a group, fixed before any forward (the responses checked:
    G non-empty 1-D id tensors): the advantages are `group_advantages(rewards)` unless given (checked: one
    finite number per response)."""
    if len(responses) != config.num_generations:
        raise ValueError(f"got {len(responses)} responses but num_generations={config.num_generations}")
    if any(r.dim() != 1 or r.numel() == 0 for r in responses):
        raise ValueError("responses: each a non-empty 1-D tensor of token ids")
    rewards = grpo.reward_tensor(rewards, torch.float32)
    if advantages is None:
        advantages = grpo.group_advantages(rewards, config.scale_rewards, num_generations=config.num_generations)
    else:
        advantages = torch.as_tensor(advantages, dtype=torch.float32)
        if advantages.shape != (len(responses),) or not bool(torch.isfinite(advantages).all()):
            raise ValueError(
                f"advantages: {len(responses)} finite numbers, one per response, got {advantages.tolist()}"
            )
    return rewards, advantages, grpo.token_weights([int(r.numel()) for r in responses], config)


def nonfinite_update(loss: float, grad_norm: float) -> str | None:
    """Why a step's update must not be applied (its loss or gradient is not finite: an optimizer step
    would write NaN or inf into the weights), or None."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return None
    return f"loss {loss}, grad_norm {grad_norm}: not finite, so the optimizer step was skipped"


def gradient_norm(model) -> float:
    """The L2 norm of every parameter gradient the model holds (float32 sums)."""
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0
