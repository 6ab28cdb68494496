"""Learning on top of the transaction: tasks (`tasks`, training variants in `synthetic`), text
datasets and TRL-style reward functions (`text_tasks`, `rewards`), rollouts from the resident
state, the GRPO trainer, the staleness oracle, the learning statistic
(`improvement`), pretraining task-competent models (`pretrain`) and where they break with prompt
length (`length_curve`)."""
