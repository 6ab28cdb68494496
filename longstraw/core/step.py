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

import functools
import math
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from longstraw.config.point import OUR_MODES
from longstraw.config.sections import micro_batch_refusal
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
        if self.mode not in OUR_MODES:
            raise ValueError(f"mode must be one of {OUR_MODES}, got {self.mode!r}")
        if self.old_policy not in OLD_POLICIES:
            raise ValueError(f"old_policy must be one of {OLD_POLICIES}, got {self.old_policy!r}")
        k = self.micro_batch
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"micro_batch must be a positive integer or 'auto', got {k!r}")
        if refusal := micro_batch_refusal(k, self.mode, self.capture.get("cp") is not None):
            raise ValueError(refusal)
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
    loss_masks=None,
) -> StepResult:
    """Run one transaction and the optimizer step: check, capture (unless `state`, an earlier capture, is given),
    score (`group_scores`), replay with a backward, settle the gradient (`settled_gradient`), update, measure.

    `advantages`: the group's advantages when a caller computes them by another rule (the text trainer follows
    TRL's for unscorable completions, whose reward is NaN); else `group_advantages(rewards)`. `graphs` (a
    `MemberGraphs` the caller keeps across steps; mode replay on CUDA): the members, their losses and their
    backward run as one CUDA graph, recorded on the first step of a signature (phase `graph_record`) and
    launched on later ones (`longstraw.core.member_graphs`). `loss_masks` (one bool [R_i] per response, modes
    replay, hold_all and naive): only the True tokens bear loss and count in the token weights
    (a multi-turn trajectory replayed as one member: its actions; its observations are context)."""
    rewards, advantages, weights = group_objective(responses, rewards, config, advantages, loss_masks)
    check_step_states(responses, options, state, ref_state)
    adapter = adapter_for(model)
    check_step_inputs(adapter, prompt_ids, responses, options, state, ref_state, old_logps, sampler_logps, graphs)
    warn_if_one(responses)
    recorder = PhaseRecorder(adapter.device)
    responses = responses[: options.members]
    age = state.age if state is not None else 0
    with undone_on_failure(model, state):  # a step that raises leaves no gradient for the next one to apply
        if state is None and options.mode != "naive":
            state = captured_state(model, prompt_ids, options, recorder)
        fingerprint = state.fingerprint() if state is not None else None
        # naive runs HF's own forward: its torch GDN kernel, whose backward works everywhere (fla's fails on Hopper)
        with hf_torch_gdn_kernels(model) if options.mode == "naive" else nullcontext():
            scores = group_scores(model, prompt_ids, state, ref_state, responses, old_logps, config, options, recorder)
            objective = grpo.GroupObjective(scores.old, scores.ref, advantages, weights, config, loss_masks)
            replayed = _replay_and_backward(model, prompt_ids, state, responses, objective, options, recorder, graphs)
        update = settled_gradient(model, state, replayed.losses, options, recorder)
    optimizer_step(optimizer, update, recorder)
    metrics = step_metrics(
        options, config, rewards, advantages, responses, scores, replayed, update, sampler_logps, recorder, loss_masks
    )
    metrics.update(state_metrics(state, fingerprint, age))
    hand_back_states(model, state, ref_state)
    return StepResult(metrics, state)


def warn_if_one(responses) -> None:
    """A group of one changes nothing but through its KL term: say so, at the caller of `grpo_step`."""
    if len(responses) == 1:
        warnings.warn(
            "a group of one response has zero advantage: the step leaves the policy unchanged "
            "(only a KL term, beta > 0, can move it)",
            stacklevel=3,
        )


def check_step_states(responses, options: StepOptions, state, ref_state) -> None:
    """Refuse a partial step outside the serial modes and a given state the options cannot use, before any work.

    `options.members=k` scores and replays only the first k responses (advantages and token weights still come
    from all G): one member at a time is live in the serial modes, so every member of equal length reaches the
    same peak. The metrics say so."""
    members = options.members
    if members is not None and not (options.mode != "hold_all" and 1 <= members <= len(responses)):
        raise ValueError(
            f"members={members!r}: a partial step is a memory probe of the serial modes (replay, naive) "
            f"and needs 1 <= members <= G={len(responses)}; hold_all's peak depends on all G graphs"
        )
    if (state is not None or ref_state is not None) and options.mode == "naive":
        raise ValueError("mode 'naive' recomputes the prompt per response and takes no captured state")
    if options.micro_batch != 1 and state is not None:
        check_members(state)
    if options.prefix_grad and state is not None and state.prefix_trace is None:
        raise ValueError("prefix_grad=True needs a state captured with capture(..., prefix_grad=True)")


def captured_state(model, prompt_ids, options: StepOptions, recorder) -> ResidentState:
    """The prompt's resident state, captured by the step itself (phase `capture`)."""
    with recorder.phase("capture"), deterministic_checked(model):  # check_step_inputs checked
        state = capture(model, prompt_ids, prefix_grad=options.prefix_grad, **options.capture)
    if options.micro_batch != 1:
        check_members(state)
    return state


@dataclass
class GroupScores:
    """A group's log-probs scored before the gradient pass: the old policy's (`old`, None per member when they
    are the gradient pass's own), where they came from (`source`: `metrics["old_policy"]`) and the reference's
    (`ref`, None when beta is 0)."""

    source: str
    old: list
    ref: list | None


def group_scores(
    model, prompt_ids, state, ref_state, responses, old_logps, config: grpo.GRPOConfig, options, recorder
) -> GroupScores:
    """The old policy's log-probs: `given` (`old_logps`), `scored` (a graph-free pass, `options.old_policy=
    "score"`, phase `old_scoring`) or `current` (the gradient pass's own, detached; no extra pass). The
    reference's (`config.beta > 0`, phase `ref_scoring`) are scored with the adapter disabled on `ref_state`, the
    prompt captured by the reference policy, when given (the trainer keeps one per prompt: the frozen base never
    makes it stale); without it, on the policy's own state: the reference's response distribution given the
    policy's prompt state, which saves a second resident state and is what the memory experiments measure."""

    def scorer(y, scored_state=None):
        if options.mode == "naive":  # naive takes no state: it recomputes the prompt
            with torch.no_grad():
                return naive_logprobs(model, prompt_ids, y)
        return score(model, state if scored_state is None else scored_state, y)

    source = old_source(old_logps, options)
    if source == "scored":
        with recorder.phase("old_scoring"):
            old = [scorer(y) for y in responses]
    else:
        old = old_logps if source == "given" else [None] * len(responses)
    ref = None
    if config.beta > 0:
        with recorder.phase("ref_scoring"), reference_policy(model):
            ref = [scorer(y, ref_state) for y in responses]
    return GroupScores(source, old, ref)


@dataclass(frozen=True)
class Update:
    """The group's settled gradient: the summed loss, the gradient norm (unclipped) and why the update is not
    applied (`metrics["update_skipped"]`; None for an applied one)."""

    loss: float
    grad_norm: float
    skipped: str | None


def settled_gradient(model, state, losses, options: StepOptions, recorder) -> Update:
    """The group's gradient made whole and checked: the exact mode's prompt-side term added (phase
    `prefix_backward`), a context-parallel group's averaged, its norm taken, then clipped to
    `options.max_grad_norm`. A group whose loss or gradient norm is not finite is not applied: the optimizer does
    not step (its state and the weights stay as they were) and the gradients are dropped."""
    if options.prefix_grad:
        with recorder.phase("prefix_backward"):
            state.backward_prefix()
    cp = getattr(state, "cp", None)
    if cp is not None:  # every rank holds the same gradient already; one all-reduce keeps the steps identical
        cp.average_gradients_([p for p in model.parameters() if p.requires_grad])
    grad_norm = gradient_norm(model)
    loss = float(sum(float(loss.detach()) for loss in losses))
    skipped = nonfinite_update(loss, grad_norm)
    if options.max_grad_norm is not None and skipped is None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], options.max_grad_norm)
    return Update(loss, grad_norm, skipped)


def optimizer_step(optimizer, update: Update, recorder) -> None:
    """Apply the update unless it is skipped, then drop the gradients (phase `optimizer_step`)."""
    with recorder.phase("optimizer_step"):
        if update.skipped is None:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def step_metrics(
    options: StepOptions,
    config,
    rewards,
    advantages,
    responses,
    scores: GroupScores,
    replayed: Replayed,
    update: Update,
    sampler_logps,
    recorder,
    masks=None,
) -> dict:
    """A step's measurements. `logp_mismatch` is the max and mean |log p_replay - log p_old| over the replayed
    tokens, before the update (None for `current`): scoring and replay run one attention kernel, so at the
    on-policy point it measures what remains of the training/inference mismatch (0 when the kernels agree bit
    for bit). `logp_mismatch_sampler` compares the sampler's own log-probs (its decoding kernels differ) the same
    way; they are not used otherwise. With loss `masks`, the token counts (`response_tokens`, `num_tokens`) and
    the clip and KL statistics are over the loss-bearing tokens only (a trajectory's actions)."""
    graphs, old, ref = replayed.graphs, scores.old, scores.ref
    masks = masks if masks is not None else [None] * len(responses)
    return {
        "mode": options.mode,
        "loss": update.loss,
        "grad_norm": update.grad_norm,
        SKIPPED: update.skipped,
        "reward_mean": float(rewards.nanmean()),  # NaN rewards (unscorable, with given advantages) left out
        "advantages": [float(a) for a in advantages],
        "members_replayed": len(responses),
        "micro_batch": min(replayed.batch, len(responses)),  # the largest batch that ran, not what was asked
        "response_tokens": [int(r.numel() if m is None else m.sum()) for r, m in zip(responses, masks)],
        "graph_bytes_peak": replayed.meter.peak or (graphs.graph_bytes if graphs is not None else 0),
        "old_policy": scores.source,
        "logp_mismatch": None if scores.source == "current" else logp_mismatch(replayed.logps, old),
        **(
            {"logp_mismatch_sampler": logp_mismatch(replayed.logps, sampler_logps)} if sampler_logps is not None else {}
        ),
        **({"member_graph_records": graphs.records} if graphs is not None else {}),
        "phases": recorder.phases,
        "stats": grpo.summarize_stats(
            [
                grpo.response_stats(lp.detach(), old[i], ref and ref[i], advantages[i], config, masks[i])
                for i, lp in enumerate(replayed.logps)
            ]
        ),
    }


def state_metrics(state: ResidentState | None, fingerprint: str | None, age: int) -> dict:
    """What a step measured of its resident state, if it had one (`state_unchanged`: its fingerprint is the one
    it had before the scoring and the replays; `state_age`: the steps it had served before this one)."""
    if state is None:
        return {}
    return {
        "resident_bytes": state.nbytes,
        "predicted_resident_bytes": state.predicted_nbytes,
        "prompt_positions": state.positions + 1,
        "state_unchanged": state.fingerprint() == fingerprint,
        "state_age": age,
    }


def hand_back_states(model, state, ref_state) -> None:
    """The step's states made ready for the prompt's next step (prefix reuse)."""
    if state is not None:
        state.age += 1  # the parameters moved once more since the capture
        reuse_state(model, state)  # it serves the updated weights as a stale prefix (prefix reuse, by design)
    if ref_state is not None:
        reuse_state(model, ref_state)  # the reference's capture: the adapter's update does not reach it


def check_graphs(graphs, adapter, options: StepOptions, state) -> None:
    """Refuse, before any work, a step whose members cannot run as a recorded CUDA graph."""
    if not isinstance(graphs, MemberGraphs):
        raise TypeError(f"graphs must be a MemberGraphs kept across steps, got {type(graphs).__name__}")
    problems = [
        f"the model is on {adapter.device}, not a CUDA device" if adapter.device.type != "cuda" else None,
        f"mode {options.mode!r} (mode replay only)" if options.mode != "replay" else None,
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
    adapter, prompt_ids, responses, options: StepOptions, state, ref_state, old_logps, sampler_logps, graphs
) -> None:
    """Everything a step can check before any work: the policy deterministic, the states the model's and the
    prompt's, the responses' ids (one sync) and positions, the given log-probs one [R_i] tensor per response,
    and `graphs` (`check_graphs`)."""
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
        if given is not None:
            check_given_logps(name, given, responses)
    if graphs is not None:
        check_graphs(graphs, adapter, options, state)


def check_given_logps(name: str, given, responses) -> None:
    """Refuse log-probs given for the group that are not one [R_i] tensor per response."""
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


@dataclass
class Replayed:
    """What the gradient pass left: each member's loss and log-probs (detached), the meter of its graphs' bytes,
    the largest batch of members that ran together, and the recorded CUDA graphs it ran as (or None)."""

    losses: list
    logps: list
    meter: GraphBytesMeter
    batch: int
    graphs: MemberGraphs | None


def _replay_and_backward(
    model, prompt_ids, state, responses, objective: grpo.GroupObjective, options: StepOptions, recorder, graphs
) -> Replayed:
    """Each response's loss and its gradient, the mode's way (`hold_all_backward`, `naive_backward`,
    `replay_backward`), under a meter of the graphs' bytes (the parameters and the state's tensors left out)."""
    exclude = list(model.parameters()) + ([t for e in state.layers for t in e.tensors()] if state else [])
    meter = GraphBytesMeter(exclude=exclude)
    with meter:
        if options.mode == "hold_all":
            losses, logps, k = *hold_all_backward(model, state, responses, objective, options, recorder), 1
        elif options.mode == "naive":
            losses, logps, k = *naive_backward(model, prompt_ids, responses, objective, recorder), 1
        else:
            losses, logps, k = replay_backward(model, state, responses, objective, options, recorder, graphs, meter)
    return Replayed(losses, logps, meter, k, graphs)


def hold_all_backward(model, state, responses, objective, options: StepOptions, recorder):
    """hold_all: every member's graph alive at once, one backward over their summed losses."""
    losses, logps = [], []
    with recorder.phase("replay"):
        for i, y in enumerate(responses):
            logps.append(replay(model, state, y, checkpoint_layers=options.checkpoint_layers))
            losses.append(objective.member_loss(i, logps[-1]))
        torch.stack(losses).sum().backward()
    return [loss.detach() for loss in losses], [lp.detach() for lp in logps]


def naive_backward(model, prompt_ids, responses, objective, recorder):
    """naive: HF's checkpointed forward over prompt + response, one member and one backward at a time."""
    losses, logps = [], []
    with hf_checkpointing(model):
        for i, y in enumerate(responses):
            with recorder.phase("replay"):
                logp = naive_logprobs(model, prompt_ids, y)
                loss = objective.member_loss(i, logp)
                loss.backward()
            losses.append(loss.detach())
            logps.append(logp.detach())
            del logp, loss
    return losses, logps


def replay_backward(model, state, responses, objective, options: StepOptions, recorder, graphs, meter):
    """replay: one graph and one backward per batch of `options.micro_batch` members (all batches as one
    recorded CUDA graph with `graphs`); "auto" replays the first member alone and sizes the later batches by
    its graph bytes (with `graphs`, when recording). Returns (losses, log-probs, the batch size used)."""
    k, start = (1 if options.micro_batch == "auto" else options.micro_batch), 0
    if graphs is not None:  # "auto": sized from one member when the graph records
        sizing = options.micro_batch
        if sizing == "auto":
            sizing = functools.partial(
                members_that_fit, budget=options.member_budget_bytes, device=state.device, remaining=len(responses)
            )
        run = graphs.run(
            adapter_for(model), state, responses, sizing, objective, options.checkpoint_layers, recorder, meter
        )
        return (*run, graphs.micro_batch)
    losses, logps = [], []
    while start < len(responses):
        members = range(start, min(start + k, len(responses)))
        with recorder.phase("replay"):
            logps_k = replay_members(
                model,
                state,
                [responses[i] for i in members],  # ids: check_step_inputs
                checkpoint_layers=options.checkpoint_layers,
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
    return losses, logps, k


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


def group_objective(responses, rewards, config: grpo.GRPOConfig, advantages=None, loss_masks=None):
    """(rewards, advantages, token weights) of a group, fixed before any forward (the responses checked:
    G non-empty 1-D id tensors): the advantages are `group_advantages(rewards)` unless given (checked: one
    finite number per response); the weights count each response's tokens, or its masked ones (`loss_masks`,
    checked: one bool tensor of its shape per response)."""
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
    if loss_masks is None:
        return rewards, advantages, grpo.token_weights([int(r.numel()) for r in responses], config)
    if len(loss_masks) != len(responses) or any(
        not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.shape != r.shape
        for m, r in zip(loss_masks, responses)
    ):
        raise ValueError("loss_masks: one bool tensor per response, of the response's shape")
    return rewards, advantages, grpo.token_weights([int(m.sum()) for m in loss_masks], config)


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
