"""Run a function on W local ranks, as torchrun would start them (tests, benchmarks).

    from longstraw.cp.launch import run_ranks
    results = run_ranks(fn, 2, arg)    # fn(arg) in 2 spawned processes; results[r] = rank r's return

Each process gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
on a free local port), so `context_parallel` initialises exactly as it does under torchrun.
With the default spawn start, `fn` must be importable (a module-level function) and its arguments
must pickle; its return value must pickle.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, fn, args, results, forked):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # the ranks share this machine's cores; a forked rank keeps one thread: GNU OpenMP's pool does not survive
    # a fork, and a forked child that runs a multi-threaded op after its parent did hangs
    torch.set_num_threads(1 if forked else max(1, (os.cpu_count() or 1) // world))
    try:
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)  # plain bytes through the queue: no shared-memory handles outlive the rank
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 300.0, start_method: str = "spawn") -> list:
    """fn(*args) on `world` new processes; their return values by rank. A failing rank raises
    RuntimeError with its traceback (the others are stopped). `start_method="fork"` starts the
    ranks from this process's memory (CPU only: no imports or model builds repeated; tests use it)."""
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, fn, args, results, start_method == "fork"))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out, failures = {}, []
    try:
        for _ in range(world):
            rank, ok, value = results.get(timeout=timeout)
            if not ok:
                failures.append(f"rank {rank} failed:\n{value}")
                break
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    except queue.Empty:
        failures.append(f"ranks {sorted(set(range(world)) - set(out))} gave no result within {timeout} s")
    finally:
        for p in procs:
            if failures and p.is_alive():
                p.terminate()
            p.join()
    if failures:
        raise RuntimeError("\n".join(failures))
    return [out[r] for r in range(world)]
