"""Launching the workers of this package in new processes, alone or under torchrun (gloo on CPU)."""

import os
import subprocess
import sys
from pathlib import Path


TESTS = Path(__file__).resolve().parents[1]


def worker_command(worker: str, *args, processes: int = 0) -> list[str]:
    """The command that runs the module `helpers.<worker>` with `args`, under torchrun when `processes` > 0."""
    launcher = [sys.executable]
    if processes:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--standalone"]
    return [*launcher, "-m", f"helpers.{worker}", *map(str, args)]


def worker_env(**extra: str) -> dict[str, str]:
    """This environment, offline, one torch thread per process (bit-reproducible arithmetic) and `helpers`
    importable, plus `extra`."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": path}
    return {**os.environ, **env, **extra}


def run_worker(worker: str, *args, processes: int = 0, timeout: float = 600, **env: str) -> str:
    """Run a worker to its end and return its output; a failure shows the end of it."""
    done = subprocess.run(
        worker_command(worker, *args, processes=processes),
        env=worker_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout


def free_port() -> int:
    """A TCP port nothing listens on now, for a rendezvous on localhost."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(worker: str, args_of_node, env_of_node, nodes: int = 2, per_node: int = 1) -> list[subprocess.Popen]:
    """
    `nodes` simulated nodes on this machine: one torchrun launch per node (`--nnodes N --node_rank R`, a static
    rendezvous on localhost), `per_node` processes each, all running `helpers.<worker>`. `args_of_node(r)` and
    `env_of_node(r)` give each node's worker arguments and extra environment (e.g. its own cache directories).
    """
    port = free_port()
    processes = []
    for node in range(nodes):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                   "--nproc_per_node", str(per_node), "--node_rank", str(node), "--master_addr", "127.0.0.1",
                   "--master_port", str(port), "-m", f"helpers.{worker}", *map(str, args_of_node(node))]  # fmt: skip
        output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        processes.append(subprocess.Popen(command, env=worker_env(**env_of_node(node)), **output))
    return processes
