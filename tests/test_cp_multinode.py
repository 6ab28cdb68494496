"""Multi-node launch of context parallelism, on this machine: two torchrun agents, one per "node",
meeting at a c10d rendezvous on 127.0.0.1 (as `srun torchrun --nnodes N ...` does on a cluster,
docs/cluster.md), and the one-node `--standalone` launch, each against the single-process run.

Both run the CLI entry point (`-m longstraw run CONFIG --out ...`) over gloo on CPU. What a real
cluster adds (several hosts, NCCL over the network, SLURM) is not tested here.
"""

import json
import os
import signal
import subprocess
import sys
import time

import psutil  # a dependency of peft and snakemake
import pytest
import torch
from float64_reference import hf_float64_for
from tolerances import TOL64, fixed_threads, within

from longstraw.cp import group
from longstraw.cp.launch import free_port
from longstraw.harness.runner import run_point

# float64, HF's float32 casts included (float64_reference; the workers run `-m float64_cli`): the sharded step is
# the single-process one in another order (in float32 it measured ~2e-7 relative apart)
PRESET = "tiny-llama"
TIMEOUT = 120.0  # seconds for a whole launch (one run takes ~10 s here)


def _config(cp_size):
    """A GRPO step on a dense preset: every resident byte is an attention page, so the ranks' bytes
    sum to the single process's; random LoRA so the reference differs and the loss is not 0."""
    return {
        "name": "cp-multinode",
        "cp_size": cp_size,
        "model": {"preset": PRESET, "lora": {"r": 4, "init_random": True}, "dtype": "float64"},
        "prompt": {"length": 24},
        "grpo": {"num_generations": 2},
        "responses": {"length": 5},
        "capture": {"chunk_size": 4},
    }


def _env(threads):
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": str(threads)}


def _stop(proc):
    """SIGTERM torchrun (it stops its workers), then SIGKILL whatever of it and its workers is left:
    the workers run in sessions of their own, so they are found by parentage before the signal."""
    try:
        tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def _launch(commands, tmp_path, threads):
    """Start every command (one torchrun agent each) and wait for all; on a failure or past TIMEOUT
    stop every agent and its workers. Returns each agent's output."""
    logs = [tmp_path / f"agent{i}.log" for i in range(len(commands))]
    procs = []
    try:
        for command, log in zip(commands, logs):
            with open(log, "w") as f:
                procs.append(subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=_env(threads)))
        deadline = time.monotonic() + TIMEOUT
        while any(p.poll() is None for p in procs):
            for i, p in enumerate(procs):
                assert p.poll() in (None, 0), f"agent {i} exited {p.returncode}:\n{logs[i].read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no result within {TIMEOUT} s:\n" + "\n".join(
                f"agent {i}:\n{log.read_text()[-1500:]}" for i, log in enumerate(logs)
            )
            time.sleep(0.2)
        for i, p in enumerate(procs):
            assert p.returncode == 0, f"agent {i} exited {p.returncode}:\n{logs[i].read_text()[-3000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                _stop(p)
    return [log.read_text() for log in logs]


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _two_nodes(tmp_path):
    """The same command on both "nodes" but for --out: each agent its own, so the test sees which
    one wrote. torchrun ignores --node-rank with c10d (ranks follow the rendezvous), so none is given."""
    spec, port = tmp_path / "point.yaml", free_port()
    spec.write_text(json.dumps(_config(2)))
    outs = [tmp_path / f"node{n}.json" for n in range(2)]
    commands = [
        _torchrun(
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "test-cp-multinode",
            "-m",
            "float64_cli",
            PRESET,
            "run",
            str(spec),
            "--out",
            str(out),
        )
        for out in outs
    ]
    logs = _launch(commands, tmp_path, threads=fixed_threads() or max(1, (os.cpu_count() or 2) // 2))
    written = [out for out in outs if out.exists()]
    assert len(written) == 1, f"{len(written)} of the 2 nodes wrote a result; rank 0 alone writes"
    summaries = [line for log in logs for line in log.splitlines() if line.startswith('{"name": "cp-multinode"')]
    assert len(summaries) == 1, logs  # the summary line, once: rank 0's
    return json.loads(written[0].read_text())


def _standalone(tmp_path):
    spec, out = tmp_path / "point.yaml", tmp_path / "point.json"
    spec.write_text(json.dumps(_config(2)))
    _launch(
        [
            _torchrun(
                "--standalone",
                "--nnodes",
                "1",
                "--nproc-per-node",
                "2",
                "-m",
                "float64_cli",
                PRESET,
                "run",
                str(spec),
                "--out",
                str(out),
            )
        ],
        tmp_path,
        threads=fixed_threads() or 1,
    )
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single():
    with hf_float64_for(PRESET):
        return run_point(_config(1))


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("launch", [_two_nodes, _standalone], ids=["two-nodes-c10d", "standalone-2"])
def test_launch_over_two_ranks_gives_the_single_process_step(tmp_path, single, launch):
    result = launch(tmp_path)
    assert result["status"] == single["status"] == "ok", result.get("traceback")
    assert result["cp"]["size"] == 2 and result["cp"]["rank"] == 0  # written by global rank 0
    records = result["cp"]["ranks"]
    assert [r["rank"] for r in records] == [0, 1] and [r["status"] for r in records] == ["ok", "ok"]
    assert all(r["device"] == "cpu" and r["peak_rss_bytes"] > 0 for r in records)
    mine, ref = result["metrics"]["cycles"][0], single["metrics"]["cycles"][0]
    assert mine["resident_bytes"] == records[0]["resident_bytes"] == mine["predicted_resident_bytes"]
    assert records[0]["resident_bytes"] > records[1]["resident_bytes"] > 0  # 12 prompt positions against 11
    assert sum(r["resident_bytes"] for r in records) == ref["resident_bytes"]
    assert mine["state_unchanged"] and ref["loss"] != 0
    within(abs(mine["loss"] - ref["loss"]), TOL64 * max(abs(ref["loss"]), 1.0), "loss")
    within(abs(mine["grad_norm"] - ref["grad_norm"]), TOL64 * ref["grad_norm"], "gradient norm")


def test_each_node_puts_its_ranks_on_cuda_local_rank(monkeypatch):
    """On node 2 of a 2-node x 2-GPU job, global rank 3 has LOCAL_RANK 1: it must take cuda:1 (its
    node has GPUs 0 and 1 only) and keep rank 3 (its shard, and who writes the result)."""
    chosen = []
    monkeypatch.setattr(group, "_GROUP", None)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(group.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(group.dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(group.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(group.dist, "get_world_size", lambda: 4)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cp = group.context_parallel(4, "cuda")
    assert chosen == [1] and cp.device == torch.device("cuda", 1)
    assert cp.rank == 3 and cp.world == 4 and cp.is_last
