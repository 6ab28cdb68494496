"""Learning on top of the transaction: tasks (`tasks`, training variants in `synthetic`), rollouts
from the resident state, the GRPO trainer, the staleness oracle, the learning statistic
(`improvement`), pretraining task-competent models (`pretrain`) and where they break with prompt
length (`length_curve`)."""
