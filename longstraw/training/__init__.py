"""Learning on top of the transaction: tasks, rollouts from the resident state, the GRPO trainer,
the staleness oracle."""
