"""
`accelerate launch` flags for a Slurm job, from the `SLURM_*` variables of the task that runs on each node: how many
machines, this one's rank, the main machine's address, and the process count. `scripts/slurm/train.sbatch` calls it
on every node:

    srun bash -c 'accelerate launch $(python -m mm_fusion.training.slurm) scripts/train.py ...'

Run `python -m mm_fusion.training.slurm --help` for the options; it prints the flags on one line.
"""

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..cli import ScriptArgumentParser, command_name


def expand_hostlist(hostlist: str) -> list[str]:
    """
    Slurm's compressed host list as host names, in order: `gpu-[07-08,10],login1` is `gpu-07 gpu-08 gpu-10 login1`;
    zero padding is kept and several bracket groups in one name multiply out (`r[1-2]n[1-2]`: `r1n1 r1n2 r2n1 r2n2`).
    """
    hosts: list[str] = []
    for name in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", name):
            choices = [literal]
            if ranges:
                choices = []
                for part in ranges.split(","):
                    low, _, high = part.partition("-")
                    if not low.isdigit() or (high and not high.isdigit()):
                        raise ValueError(f"Cannot read the host range [{ranges}] of {hostlist!r}.")
                    width = len(low)
                    choices += [literal + str(n).zfill(width) for n in range(int(low), int(high or low) + 1)]
            expanded = [head + choice for head in expanded for choice in choices]
        hosts += [h for h in expanded if h]
    return hosts


def _gpus_per_node(env: Mapping[str, str]) -> int | None:
    for variable in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = env.get(variable)
        if value:
            match = re.search(r"(\d+)\s*$", value.split(",")[0].split("(")[0])  # "4", "h100:4", "4(x2)"
            if match:
                return int(match.group(1))
    return None


def slurm_rendezvous(env: Mapping[str, str] | None = None, processes_per_node: int | None = None, port: int = 29500):
    """
    The rendezvous of this Slurm task: `num_machines` (`SLURM_JOB_NUM_NODES`), `machine_rank` (`SLURM_NODEID`),
    `main_process_ip` (the first host of `SLURM_JOB_NODELIST`), `main_process_port`, and `num_processes`, the
    processes of the whole job: machines x `processes_per_node` (default: the GPUs Slurm gave this node, from
    `SLURM_GPUS_ON_NODE` / `SLURM_GPUS_PER_NODE`, else 1). Raises a `ValueError` naming a missing variable.
    """
    env = os.environ if env is None else env
    missing = [v for v in ("SLURM_NODEID", "SLURM_JOB_NODELIST") if not env.get(v)]
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if missing or not nodes:
        missing += [] if nodes else ["SLURM_JOB_NUM_NODES"]
        raise ValueError(f"Not inside a Slurm job step: {', '.join(missing)} not set (run it under srun).")
    hosts = expand_hostlist(env["SLURM_JOB_NODELIST"])
    machines, rank = int(nodes), int(env["SLURM_NODEID"])
    if len(hosts) != machines or not 0 <= rank < machines:
        raise ValueError(
            f"SLURM_JOB_NODELIST {env['SLURM_JOB_NODELIST']!r} names {len(hosts)} hosts, SLURM_JOB_NUM_NODES is "
            f"{machines} and SLURM_NODEID {rank}: they do not agree."
        )
    per_node = processes_per_node or _gpus_per_node(env) or 1
    return {
        "num_machines": machines,
        "machine_rank": rank,
        "main_process_ip": hosts[0],
        "main_process_port": port,
        "num_processes": machines * per_node,
    }


def accelerate_flags(rendezvous: dict, multi_gpu: bool = True) -> list[str]:
    """`accelerate launch` flags for a [`slurm_rendezvous`]: a static rendezvous at the main machine, every node
    started by its own Slurm task, and no restarts (a failed node ends the job; resume it with
    `--resume_from_checkpoint last`)."""
    flags = [f"--{key}={value}" for key, value in rendezvous.items()]
    flags += ["--rdzv_backend=static", "--max_restarts=0"]
    return flags + (["--multi_gpu"] if multi_gpu and rendezvous["num_processes"] > 1 else [])


@dataclass
class SlurmArguments:
    processes_per_node: int | None = field(default=None, metadata={"help": "Default: the node's GPUs, else 1."})
    port: int = field(
        default_factory=lambda: int(os.environ.get("MM_FUSION_MAIN_PORT", 29500)),
        metadata={"help": "The main machine's port ($MM_FUSION_MAIN_PORT when set)."},
    )
    cpu: bool = field(default=False, metadata={"help": "CPU nodes: no --multi_gpu."})


def main(argv: list[str] | None = None) -> int:
    parser = ScriptArgumentParser(
        SlurmArguments, prog=command_name("mm_fusion.training.slurm"), description=__doc__.split("\n\n")[0]
    )
    (args,) = parser.parse_command_line(argv)
    try:
        rendezvous = slurm_rendezvous(processes_per_node=args.processes_per_node, port=args.port)
    except ValueError as err:
        parser.fail(err)
    print(" ".join(accelerate_flags(rendezvous, multi_gpu=not args.cpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
