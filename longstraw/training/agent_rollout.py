"""Multi-turn rollouts from a captured prompt: G agents, each in its own environment, on one resident history.

    make = load_environment("lookup", {"seed": 0})
    sampling = SamplingConfig(num_generations=8, max_new_tokens=256, stop_ids=(eos,), seed=0)
    config = AgentConfig(sampling, max_turns=4, max_action_tokens=32)
    trajectories = sample_trajectories(model, state, make, example, config)
    t = trajectories[g]
    t.tokens, t.action_mask, t.logprobs, t.turns, t.rewards

Each row's trajectory is the suffix after the prompt: the environment's first observation, then action,
observation, action, ... Every token of it is one `rollout.Decoder` step of the G rows in lockstep (one clock):
a row either samples its action's next token or takes its pending observation's next token (`Decoder.step`'s
`forced` tokens), so its own pages (`OwnPages`, room for the token budget, actions and observations alike) hold
its trajectory without gaps and the prompt's pages are read in place, never written. The observation's tokens thus
go through the layers one a step, graph-free, batched with the other rows' steps. An action ends on a stop id or
at `max_action_tokens`; the environment then takes it (its stop id left out) and answers an observation, which the
row reads next, unless the episode is done or `max_turns` actions were taken, which ends the row. A row still going
when the token budget (`max_new_tokens`) runs out ends there; its last action may be cut short, unseen by the
environment. A trajectory ends with its last action token (no later token is ever read).

The host looks at the rows after every step (one sync: it feeds the environments) and writes the next step's forced
tokens and the rows still going into the decoder's buffers; on CUDA (as `sample` decides: `rollout.uses_graph`) the
step itself is one launch of a recorded graph (`rollout.DecodeGraph(forced=True)`, its warm-up the first step),
the eager step its reference. Log-probs are the policy's (temperature 1), as `sample` records them, at every token;
the loss reads the actions' (`action_mask`), the observations are context (replayed as one member:
`grpo_step(..., loss_masks=)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw.core.transaction import check_deterministic, check_state, check_vocabulary
from longstraw.families import adapter_for
from longstraw.state import ResidentState
from longstraw.training.environments import check_environment, checked_step
from longstraw.training.rollout import DecodeGraph, Decoder, SamplingConfig, decoding, uses_graph


@dataclass(frozen=True)
class AgentConfig:
    """`sampling`: the G rows, the token budget of a trajectory (`max_new_tokens`: actions and observations), the
    draw and the stop ids that end an action; `max_turns` actions at most; `max_action_tokens` a turn at most."""

    sampling: SamplingConfig
    max_turns: int = 4
    max_action_tokens: int = 32

    def __post_init__(self):
        for name in ("max_turns", "max_action_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"agent rollout: {name} must be an integer >= 1, got {value!r}")
        if self.max_action_tokens > self.sampling.max_new_tokens:
            raise ValueError(
                f"agent rollout: max_action_tokens {self.max_action_tokens} exceeds the trajectory's token budget "
                f"(sampling max_new_tokens {self.sampling.max_new_tokens})"
            )


@dataclass
class Trajectory:
    """One row's suffix after the prompt and what its environment said."""

    tokens: torch.Tensor  # [N] observations and actions in order, ending with the last action token
    action_mask: torch.Tensor  # [N] bool: True on sampled (loss-bearing) tokens, False on observations (context)
    logprobs: torch.Tensor  # [N] float32: the policy's log-prob of every token (the actions': old-policy log-probs)
    turns: int  # actions the environment took
    rewards: list[float]  # one per turn
    done: bool  # the environment ended the episode (else a turn or token budget did)

    @property
    def reward(self) -> float:
        return sum(self.rewards)


class _Row:
    """One agent's host-side progress: its environment, the observation tokens it still has to read, the action
    being sampled, and the mask and rewards so far."""

    def __init__(self, env, first_observation: list[int]):
        self.env, self.pending, self.action = env, first_observation, []
        self.mask, self.rewards, self.turns, self.done, self.ended = [], [], 0, False, False

    def take(self, token: int, forced: bool, config: AgentConfig, observe) -> None:
        """The row's token of this step: an observation's (read on), or an action's, which may end the turn."""
        self.mask.append(not forced)
        if forced:
            self.pending.pop(0)
            return
        self.action.append(token)
        stopped = token in config.sampling.stop_ids
        if stopped or len(self.action) == config.max_action_tokens:
            action = self.action[:-1] if stopped else self.action
            observation, reward, self.done = checked_step(self.env, self.env.step(observe.action(self.env, action)))
            self.turns, self.action = self.turns + 1, []
            self.rewards.append(reward)
            self.ended = self.done or self.turns == config.max_turns
            if not self.ended:
                self.pending = observe.ids(self.env, observation)

    def trajectory(self, tokens_T: torch.Tensor, logps_T: torch.Tensor) -> Trajectory:
        end = max(i for i, action in enumerate(self.mask) if action) + 1  # trailing observation tokens: never read
        mask = torch.tensor(self.mask[:end], dtype=torch.bool, device=tokens_T.device)
        return Trajectory(tokens_T[:end].clone(), mask, logps_T[:end].clone(), self.turns, self.rewards, self.done)


@dataclass
class _Observe:
    """Actions to an environment's form and observations to checked token ids (text through `tokenizer`)."""

    adapter: object
    tokenizer: object

    def action(self, env, action_ids: list[int]):
        return self._tokenizer(env).decode(action_ids) if env.text else list(action_ids)

    def ids(self, env, observation) -> list[int]:
        name = type(env).__name__
        if env.text:
            if not isinstance(observation, str):
                raise ValueError(
                    f"environment {name}: a text environment's observation must be a str, got {observation!r}"
                )
            ids = list(self._tokenizer(env).encode(observation, add_special_tokens=False))
        else:
            if isinstance(observation, (str, bytes)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in observation
            ):
                raise ValueError(f"environment {name}: observations must be token ids (ints), got {observation!r}")
            ids = list(observation)
        if ids:
            check_vocabulary(torch.tensor(ids), f"environment {name}'s observation", self.adapter)
        return ids

    def _tokenizer(self, env):
        if self.tokenizer is None:
            raise ValueError(f"environment {type(env).__name__} speaks text: sample_trajectories needs a tokenizer")
        return self.tokenizer


def _first_observations(rows_envs, example, observe: _Observe, budget: int) -> list[list[int]]:
    """Each environment reset on `example`: its first observation's ids, which must leave room for an action."""
    firsts = []
    for env in rows_envs:
        check_environment(env, type(env).__name__)
        ids = observe.ids(env, env.reset(example))
        if len(ids) >= budget:
            raise ValueError(
                f"environment {type(env).__name__}: its first observation has {len(ids)} tokens, no room for an "
                f"action in the token budget (sampling max_new_tokens {budget})"
            )
        firsts.append(ids)
    return firsts


@torch.no_grad()
def sample_trajectories(
    model, state: ResidentState, make_environment, example, config: AgentConfig, tokenizer=None
) -> list[Trajectory]:
    """G trajectories (`config.sampling.num_generations`), each in a fresh environment from `make_environment` reset on
    `example`, decoded from the captured `state` (never modified)."""
    adapter = adapter_for(model)
    check_state(adapter, state)
    sampling = config.sampling
    state.check_positions(sampling.max_new_tokens, "agent rollout token budget")
    check_deterministic(model)
    observe = _Observe(adapter, tokenizer)
    envs = [make_environment() for _ in range(sampling.num_generations)]
    rows = [
        _Row(env, ids) for env, ids in zip(envs, _first_observations(envs, example, observe, sampling.max_new_tokens))
    ]
    decoder = Decoder(adapter, state, sampling)
    graphed, graph = uses_graph(decoder, sampling), None
    with decoding(adapter, sampling.stacked_projections, folded_norms=sampling.folded_norms):
        for _ in range(sampling.max_new_tokens):
            going = [not row.ended for row in rows]
            if not any(going):
                break
            forcing = [bool(row.pending) for row in rows]
            forced = [row.pending[0] if row.pending else sampling.pad_id for row in rows]
            decoder.unfinished_G.copy_(torch.tensor(going))  # ended rows write pads
            decoder.forcing_G.copy_(torch.tensor(forcing))
            decoder.forced_G.copy_(torch.tensor(forced))
            if graph is not None:
                graph.step()
            elif graphed:
                graph = DecodeGraph(decoder, forced=True)  # its warm-up is this step
            else:
                decoder.step(forced=True)
            for row, token, was_going, was_forced in zip(rows, decoder.tokens_G.tolist(), going, forcing):
                if was_going:
                    row.take(token, was_forced, config, observe)
    if not bool(decoder.finite_1):
        raise ValueError("agent rollout: the policy's logits are not finite (a non-finite weight or activation)")
    return [row.trajectory(decoder.tokens_GT[g], decoder.logps_GT[g]) for g, row in enumerate(rows)]
