"""The launches the README gives start what they say: the CPU route runs every rank, accelerate's single-process CPU
fallback is refused, the shipped accelerate configs name the processes and precision of the README's table, and
`--release_freed_memory` gives freed memory back to the system."""

import re
import shlex
import subprocess
import sys
import textwrap
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


# 800 blocks of 100 KiB (under glibc's default threshold of 128 KiB, so from its heap as it comes), then every other
# one freed, each between two that stay (so they cannot merge into the heap's top and be trimmed): the kilobytes of RSS
# that the frees gave back.
FREED_KIB = textwrap.dedent("""
    import ctypes, sys
    from mm_fusion.training.launch import release_freed_memory

    if sys.argv[1] == "release":
        assert release_freed_memory()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    rss = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
    blocks = [libc.malloc(100 * 1024) for _ in range(800)]
    for block in blocks:
        ctypes.memset(block, 1, 100 * 1024)
    before = rss()
    for block in blocks[::2]:
        libc.free(block)
    print(before - rss())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_release_freed_memory_gives_freed_blocks_back():
    def freed_kib(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", FREED_KIB, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    as_it_comes, released = freed_kib("as it comes"), freed_kib("release")
    assert released > 0.9 * 400 * 100  # nearly all of the 40,000 KiB freed
    assert as_it_comes < 0.1 * 400 * 100  # the control: glibc as it comes keeps them


def test_release_freed_memory_is_lora_s_default(allocator_requests):
    from mm_fusion.training import parse_arguments

    assert parse_arguments(["--output_dir", "x", "--lora", "True"])[2].release_freed_memory is True
    assert parse_arguments(["--output_dir", "x"])[2].release_freed_memory is False
    flags = ["--output_dir", "x", "--lora", "True", "--release_freed_memory", "False"]
    assert parse_arguments(flags)[2].release_freed_memory is False
    assert parse_arguments(["--output_dir", "x", "--release_freed_memory", "True"])[2].release_freed_memory is True
