"""Context parallelism on torch.distributed: the prompt's resident state sharded over ranks.

    torchrun --nproc-per-node 2 -m longstraw run experiments/examples/step_cp_cpu.yaml --out r.json

- `group.py`: launch (torchrun, env://; NCCL on CUDA, gloo on CPU), the contiguous shard layout,
  the collectives. `launch.py`: spawning ranks for tests and benchmarks.
- `capture.py`: sharded capture (GDN layers start from states composed from every shard's transition,
  `gdn_shards.py`; attention layers' work spread by the zigzag, `balanced_attention.py`; MLA layers run
  whole on the same zigzag over gathered pages, `latent_capture.py`).
- `sharded_attention.py`, `sharded_latent.py`: exact attention over sharded K/V and latent pages (the
  DSA top-k merged from every rank's proposals) for replay; sampling over sharded K/V.
- `shards.py`: what a rank keeps. `scaling.py`: the capture-time model over ranks.

`capture(model, prompt, cp=group)` shards; `replay`, `score` and `grpo_step` take the sharded
state unchanged; every rank ends a replay's backward with the same gradient.
"""

from longstraw.cp.group import CPGroup, context_parallel, shard_bounds

__all__ = ["CPGroup", "context_parallel", "shard_bounds"]
