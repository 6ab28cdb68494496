"""Context parallelism on torch.distributed: the prompt's resident state sharded over ranks.

    torchrun --nproc-per-node 2 -m longstraw run experiments/examples/step_cp_cpu.yaml --out r.json

- `group.py`: launch (torchrun, env://; NCCL on CUDA, gloo on CPU), the contiguous shard layout,
  the collectives.
- `capture.py`: sharded capture (GDN layers start from states composed from every shard's transition,
  `gdn_shards.py`; attention K/V passed rank to rank).
- `attention.py`: exact attention over sharded pages (capture pipeline; replay all-gather merge
  with an all-reduce in the backward).
- `state.py`: what a rank keeps. `launch.py`: spawning ranks for tests and benchmarks.

`capture(model, prompt, cp=group)` shards; `replay`, `score` and `grpo_step` take the sharded
state unchanged; every rank ends a replay's backward with the same gradient.
"""

from longstraw.cp.group import CPGroup, context_parallel, shard_bounds

__all__ = ["CPGroup", "context_parallel", "shard_bounds"]
