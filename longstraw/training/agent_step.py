"""The trainer's multi-turn rollouts (`TrainConfig.environment`, a learning point's `learning.environment`).

    sampler = AgentSampler(cfg.environment, task)
    rollouts = sampler.sample(model, state, example, sampling)     # the step's G trajectories
    rollouts.responses, rollouts.masks, rollouts.rewards, rollouts.logprobs

A step's G trajectories are sampled from the resident state, each row in a fresh environment reset on the task
example's `info` (a dict, as a dataset row: `agent_rollout.sample_trajectories`); each trajectory is a response
replayed as one member with the loss on its actions (`grpo_step(..., loss_masks=)`), and its rewards summed are
the member's reward. The step's record adds the turns per trajectory (`agent_record`). An agent's greedy success
(`greedy_agent_success`) is what a learning probe measures with an environment. A text environment reads
and writes through the task's tokenizer (a RULER task's: `loaded`), which `check_environment` asks for before any
work.
"""

from __future__ import annotations

from dataclasses import dataclass

from longstraw.config.typed import ConfigError
from longstraw.training.agent_rollout import AgentConfig, Trajectory, sample_trajectories
from longstraw.training.environments import BadEnvironment, load_environment
from longstraw.training.rollout import SamplingConfig
from longstraw.training.tasks import task_folders


def check_environment(env_cfg, task_spec: dict | None, budget: int, where: str, budget_key: str) -> None:
    """Refuse, before any work, an environment that does not build with its arguments (one is built:
    `load_environment`), one that speaks text over a task without a tokenizer (a task reading a `tokenizer`
    folder: RULER's), and a turn longer than the trajectory's token `budget` (`budget_key`); `where` names the
    source and the environment's key."""
    try:
        env = load_environment(env_cfg.name, env_cfg.args)()
    except BadEnvironment as exc:
        raise ConfigError(f"{where}.{exc.setting}: {exc}") from None
    if env.text and "tokenizer" not in task_folders(task_spec or {}):
        raise ConfigError(
            f"{where}.name: {env_cfg.name!r} reads and writes text, and the task {(task_spec or {}).get('name')!r} "
            "has no tokenizer (a RULER task's `tokenizer`); give such a task, or an environment of token ids "
            "(text = False)"
        )
    if env_cfg.max_action_tokens > budget:
        raise ConfigError(
            f"{where}.max_action_tokens: {env_cfg.max_action_tokens} tokens a turn exceed the trajectory's budget, "
            f"{budget_key} {budget}"
        )


@dataclass
class AgentRollouts:
    """A step's trajectories as the trainer's rollouts: each one's tokens a response, its sampler log-probs, its
    action mask (the loss mask), its summed rewards, and whether its environment ended it (`finished`)."""

    trajectories: list[Trajectory]

    @property
    def responses(self):
        return [t.tokens for t in self.trajectories]

    @property
    def logprobs(self):
        return [t.logprobs for t in self.trajectories]

    @property
    def masks(self):
        return [t.action_mask for t in self.trajectories]

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def finished(self) -> list[bool]:
        return [t.done for t in self.trajectories]


class AgentSampler:
    """The environment of `env_cfg` (its factory built once) and its turn budgets, over `task`'s tokenizer."""

    def __init__(self, env_cfg, task):
        self.make = load_environment(env_cfg.name, env_cfg.args)
        self.text = self.make().text
        self.max_turns, self.max_action_tokens = env_cfg.max_turns, env_cfg.max_action_tokens
        self.task = task

    def sample(self, model, state, example, sampling) -> AgentRollouts:
        """G trajectories (`sampling.num_generations`) from `state`, each environment reset on `example.info`."""
        config = AgentConfig(sampling, self.max_turns, self.max_action_tokens)
        tokenizer = getattr(self.task, "loaded", None) if self.text else None
        return AgentRollouts(sample_trajectories(model, state, self.make, example.info, config, tokenizer))


def agent_record(rollouts: AgentRollouts) -> dict:
    """What a step's record adds about its trajectories: the turns each took and their mean, each one's tokens
    (actions and observations), and the share its environment ended (the rest ran out of a turn or token budget)."""
    turns = [t.turns for t in rollouts.trajectories]
    return {
        "turns": turns,
        "turns/mean": sum(turns) / len(turns),
        "trajectory_tokens": [int(t.tokens.numel()) for t in rollouts.trajectories],
        "done_ratio": sum(rollouts.finished) / len(turns),
    }


def greedy_agent_success(model, state, task, example, env_cfg, budget: int) -> float:
    """1.0 when one greedy trajectory from `state` (temperature 0, `budget` tokens, actions ending at the task's
    stop ids) earns a positive reward in its environment (for `ruler_lookup`: it answered right, the turn penalty
    being small), else 0.0: an agent's success in a length curve or a learning probe."""
    stops = tuple(getattr(task, "stop_ids", ()))
    sampling = SamplingConfig(num_generations=1, max_new_tokens=budget, temperature=0.0, seed=None, stop_ids=stops)
    trajectory = AgentSampler(env_cfg, task).sample(model, state, example, sampling).trajectories[0]
    return float(trajectory.reward > 0)
