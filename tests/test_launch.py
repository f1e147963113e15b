"""The launches the README gives start what they say: the CPU route runs every rank, accelerate's single-process CPU
fallback is refused, and the shipped accelerate configs name the processes and precision of the README's table."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.launch import free_port, worker_env
from helpers.training import TINY


ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SMALL_RUN = [
    *TINY,
    "--max_train_samples",
    "32",
    "--max_eval_samples",
    "16",
    "--max_steps",
    "2",
    "--save_strategy",
    "no",
]


def readme_cpu_command() -> list[str]:
    """The README's multi-process CPU command, up to its `...`."""
    line = next(line for line in README.splitlines() if "CPU processes" in line and line.startswith("torchrun"))
    return shlex.split(line.split("...")[0])


@pytest.mark.distributed
def test_the_readmes_cpu_route_starts_every_rank(tmp_path):
    command = readme_cpu_command()
    assert command[:3] == ["torchrun", "--nproc_per_node", "2"] and command[-1] == "scripts/train.py", command
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    port = ["--master_port", str(free_port())]  # beside other runs on this machine
    args = [torchrun, *port, *command[1:], *SMALL_RUN, "--output_dir", str(tmp_path)]
    done = subprocess.run(args, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    seen = sorted(re.findall(r"process (\d) of (\d)", done.stderr))
    assert seen == [("0", "2"), ("1", "2")], done.stderr[-3000:]
    assert "2 process(es)" in (tmp_path / "README.md").read_text()


def test_accelerate_launch_of_several_cpu_processes_is_refused_not_run_as_one(tmp_path):
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    args = [accelerate, "launch", "--cpu", "--num_processes", "2", "scripts/train.py", *SMALL_RUN]
    done = subprocess.run(
        [*args, "--output_dir", str(tmp_path)], cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "started only this one" in done.stderr and "torchrun --nproc_per_node N" in done.stderr
    assert not (tmp_path / "model.safetensors").exists()


def test_shipped_accelerate_configs_are_the_readmes_table():
    from accelerate.commands.config.config_args import load_config_from_file

    rows = re.findall(r"^\| `(\w+)\.yaml` \| (\w+) \| (\d+)[^|]* \| (\w+) \|$", README, flags=re.M)
    table = {name: (kind, int(processes), precision) for name, kind, processes, precision in rows}
    shipped = {}
    for path in sorted((ROOT / "scripts" / "accelerate_configs").glob("*.yaml")):
        config = load_config_from_file(str(path))
        kind = str(config.distributed_type).split(".")[-1]
        shipped[path.stem] = (kind, config.num_processes, str(config.mixed_precision).split(".")[-1].lower())
    assert shipped == table
    assert set(shipped) == {"single_gpu", "multi_gpu", "fsdp"}  # no config that starts fewer processes than it says
    # Each launches on GPUs only: none would run silently on a CPU in place of what it names.
    assert all(not load_config_from_file(str(p)).use_cpu for p in (ROOT / "scripts/accelerate_configs").glob("*"))
