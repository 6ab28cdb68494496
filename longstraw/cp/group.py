"""The context-parallel group: which rank this process is, its device, and the collectives CP uses.

    torchrun --nproc-per-node 2 -m longstraw run experiments/examples/step_cp_cpu.yaml --out r.json

Launch is torchrun's (env:// rendezvous: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT);
the transport is torch.distributed: NCCL when the model is on CUDA (each rank on cuda:LOCAL_RANK),
gloo on CPU. The CP group is the whole world (one CP group per job, no data parallelism yet), so
global ranks are CP ranks.

Layout: rank r owns the contiguous prompt positions `shard_bounds(P, W)[r]`; the first P % W
ranks hold one position more. The response follows the last shard, so the last rank also owns
the response's own (live) keys in the exact attention merge.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


def shard_bounds(positions: int, world: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's contiguous shard of `positions` prompt positions."""
    base, extra = divmod(positions, world)
    bounds, start = [], 0
    for rank in range(world):
        end = start + base + (rank < extra)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass
class CPGroup:
    """This process's place in the context-parallel world, with the few collectives CP needs."""

    rank: int
    world: int
    device: torch.device
    resident_bytes: int | None = None  # this rank's bytes of its latest sharded capture (per-rank record)

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1

    def shard(self, positions: int) -> tuple[int, int]:
        return shard_bounds(positions, self.world)[self.rank]

    def send(self, tensors, dst: int) -> None:
        for t in tensors:
            dist.send(t.contiguous(), dst)

    def recv_(self, tensors, src: int) -> None:
        """Receive into `tensors` in place (each must be contiguous)."""
        for t in tensors:
            dist.recv(t, src)

    def shift_(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """One step along the ranks, every rank at once: `send` goes to the next rank while the previous
        rank's arrives in `recv` (in place, contiguous); the last rank sends nothing and rank 0 receives
        nothing. Posted together (non-blocking pairs), so no rank waits on another's exchange first."""
        ops = []
        if not self.is_last:
            ops.append(dist.P2POp(dist.isend, send.contiguous(), self.rank + 1))
        if self.rank > 0:
            ops.append(dist.P2POp(dist.irecv, recv, self.rank - 1))
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()

    def broadcast_(self, tensors, src: int) -> None:
        for t in tensors:
            dist.broadcast(t, src)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous())
        return parts

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def gather_objects(self, obj) -> list | None:
        """Every rank's `obj` on rank 0 (None elsewhere)."""
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def all_gather_objects(self, obj) -> list:
        """Every rank's `obj`, on every rank."""
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def all_reduce_together(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The sums over ranks of `tensors` (one dtype), by one all-reduce of them flattened
        together; views of one buffer, shaped as the inputs."""
        flat = self.all_reduce_(torch.cat([t.reshape(-1) for t in tensors]))
        return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]

    def average_gradients_(self, params) -> None:
        """One all-reduce of every gradient, divided by the world size: the replicated backward
        already gives every rank the same gradient; this keeps the ranks' optimizer steps identical
        where a kernel's backward is not bitwise deterministic."""
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            for g, total in zip(grads, self.all_reduce_together(grads)):
                g.copy_(total.div_(self.world))


def context_parallel(cp_size, device_type: str = "cpu") -> CPGroup | None:
    """The CP group for `cp_size` ranks: None for a single process (cp_size 1 without torchrun);
    under torchrun WORLD_SIZE must equal cp_size. Initialises torch.distributed once (env://)."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive integer, got {cp_size!r}")
    if "WORLD_SIZE" not in os.environ:
        if cp_size == 1:
            return None
        raise ValueError(
            f"cp_size={cp_size} needs {cp_size} processes: launch with `torchrun --nproc-per-node "
            f"{cp_size} -m longstraw ...` (WORLD_SIZE is unset: this is a single process)"
        )
    world = int(os.environ["WORLD_SIZE"])
    if world != cp_size:
        raise ValueError(
            f"cp_size={cp_size} but the job was launched with WORLD_SIZE={world}; "
            f"launch with `torchrun --nproc-per-node {cp_size}` or set cp_size={world}"
        )
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    elif device_type == "cpu":
        device, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"context parallelism runs on cuda (NCCL) or cpu (gloo), not {device_type!r}")
    global _GROUP
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://")
    elif dist.get_backend() != backend:
        raise ValueError(
            f"torch.distributed is already initialised with {dist.get_backend()!r}, "
            f"but {device_type} tensors need {backend!r}"
        )
    if _GROUP is None:
        _GROUP = CPGroup(rank=dist.get_rank(), world=dist.get_world_size(), device=device)
    return _GROUP


def close_context_parallel() -> None:
    """End this process's context-parallel group together with the other ranks: a barrier, so that no
    rank tears its connections down while another still uses them (the two-node gloo test once lost a
    rank to SIGABRT at exit without one), then `destroy_process_group`. Nothing when none was started."""
    global _GROUP
    if _GROUP is None or not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    _GROUP = None


_GROUP: CPGroup | None = None  # one per process (a process is one rank), made when torch.distributed starts
