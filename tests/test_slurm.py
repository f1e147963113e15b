"""The Slurm launch (mm_fusion.training.slurm, scripts/slurm/train.sbatch) against fake Slurm environments."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mm_fusion.training.slurm import accelerate_flags, expand_hostlist, slurm_rendezvous


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "hostlist,hosts",
    [
        ("node1", ["node1"]),
        ("gpu-[07-08,10],login1", ["gpu-07", "gpu-08", "gpu-10", "login1"]),
        ("a[1-3]", ["a1", "a2", "a3"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("x[009-011],y", ["x009", "x010", "x011", "y"]),
    ],
)
def test_hostlist_expansion(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def fake_job(nodes: str, node_id: int, gpus: str | None = "8") -> dict[str, str]:
    env = {"SLURM_JOB_NUM_NODES": str(len(expand_hostlist(nodes))), "SLURM_NODEID": str(node_id),
           "SLURM_JOB_NODELIST": nodes, "SLURM_JOB_ID": "4242"}  # fmt: skip
    if gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = gpus
    return env


def test_rendezvous_arithmetic_on_every_node_of_a_four_node_job():
    nodes = "gpu-[07-08,10],gpu-12"
    seen = [slurm_rendezvous(fake_job(nodes, rank)) for rank in range(4)]
    assert [r["machine_rank"] for r in seen] == [0, 1, 2, 3]
    assert {r["main_process_ip"] for r in seen} == {"gpu-07"}  # every node meets at the first host
    assert {r["num_machines"] for r in seen} == {4} and {r["num_processes"] for r in seen} == {32}
    assert slurm_rendezvous(fake_job(nodes, 1, gpus=None), processes_per_node=2)["num_processes"] == 8
    assert slurm_rendezvous(fake_job(nodes, 1, gpus=None))["num_processes"] == 4  # no GPUs: one process a node
    env = {**fake_job(nodes, 1, gpus=None), "SLURM_GPUS_PER_NODE": "h100:4"}
    assert slurm_rendezvous(env)["num_processes"] == 16
    flags = accelerate_flags(seen[2])
    assert flags[:5] == ["--num_machines=4", "--machine_rank=2", "--main_process_ip=gpu-07",
                         "--main_process_port=29500", "--num_processes=32"]  # fmt: skip
    assert "--rdzv_backend=static" in flags and "--multi_gpu" in flags


@pytest.mark.parametrize(
    "env,message",
    [
        ({}, "SLURM_NODEID, SLURM_JOB_NODELIST, SLURM_JOB_NUM_NODES not set"),
        ({"SLURM_JOB_NUM_NODES": "3", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "a[1-2]"}, "do not agree"),
        ({"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "a[1-2]"}, "do not agree"),
    ],
)
def test_outside_or_inconsistent_slurm_is_a_clear_error(env, message):
    with pytest.raises(ValueError, match=message):
        slurm_rendezvous(env)


def test_sbatch_script_launches_accelerate_with_each_nodes_rendezvous(tmp_path):
    """train.sbatch with a fake `srun` (runs the command once per node, with that node's SLURM_NODEID) and a fake
    `accelerate` (prints its arguments): every node's launch line, with the arguments passed through to train.py."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nfor n in 0 1; do SLURM_NODEID=$n "$@" || exit $?; done\n'
    )
    (bin_dir / "accelerate").write_text('#!/bin/bash\necho "node $SLURM_NODEID: $*"\n')
    (bin_dir / "python").write_text(f'#!/bin/bash\nexec {sys.executable} "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, **fake_job("n[1-2]", 0, gpus="4"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm/train.sbatch"), "scripts/configs/easy_vqa_full.yaml", "--bf16", "true"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    common = "--main_process_ip=n1 --main_process_port=29500 --num_processes=8 --rdzv_backend=static --max_restarts=0"
    tail = "--multi_gpu scripts/train.py scripts/configs/easy_vqa_full.yaml --bf16 true"
    assert lines == [
        f"node 0: launch --num_machines=2 --machine_rank=0 {common} {tail}",
        f"node 1: launch --num_machines=2 --machine_rank=1 {common} {tail}",
    ]
