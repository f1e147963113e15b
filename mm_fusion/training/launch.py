"""Checks that a launch (accelerate config + arguments) can run on this machine, and the process settings a run asks
for (`--release_freed_memory`)."""

import ctypes
import ctypes.util
import logging
import os
import sys

import torch


logger = logging.getLogger(__name__)

# glibc's mallopt parameter for the size from which malloc serves a block as a mapping of its own (<malloc.h>).
M_MMAP_THRESHOLD = -3
RELEASE_THRESHOLD = 64 * 2**10


def check_launch(training_args) -> None:
    """Clear errors for an accelerate launch configuration that cannot run on this machine."""
    has_gpu = torch.cuda.is_available()
    env = os.environ
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not has_gpu:
        raise RuntimeError(
            "This launch asks for FSDP, which needs GPUs, but this machine has none. For several processes on CPUs "
            "use torchrun --nproc_per_node N scripts/train.py ..."
        )
    if env.get("ACCELERATE_MIXED_PRECISION") == "fp16" and not has_gpu:
        raise RuntimeError("The accelerate config asks for fp16, which needs a GPU; use bf16 or no on CPU.")
    # accelerate's launcher starts several CPU processes only through mpirun (an `mpirun_hostfile` in its config);
    # otherwise `--cpu --num_processes N` or a MULTI_CPU config runs this one process alone, as if N were 1. It sets
    # MASTER_ADDR only when more than one process was asked for, and no launcher that starts them sets no world size.
    accelerate_on_cpu = env.get("ACCELERATE_USE_CPU", "").lower() == "true" and "ACCELERATE_DYNAMO_BACKEND" in env
    world_sizes = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    if accelerate_on_cpu and "MASTER_ADDR" in env and not any(name in env for name in world_sizes):
        raise RuntimeError(
            "accelerate launch was asked for several processes but started only this one: on CPUs it starts them "
            "through mpirun only. Use torchrun --nproc_per_node N scripts/train.py ... (or accelerate launch "
            "--multi_gpu --num_processes N on GPUs)."
        )
    world = int(env.get("WORLD_SIZE", "1"))
    state = training_args.distributed_state
    processes = state.num_processes if state is not None else 1
    if world > 1 and not has_gpu and processes != world:
        raise RuntimeError(
            f"WORLD_SIZE is {world} but accelerate set up {processes} process(es); on CPU launch with "
            "torchrun --nproc_per_node N scripts/train.py ..."
        )
    if has_gpu and world > torch.cuda.device_count() * int(env.get("NNODES", env.get("ACCELERATE_NUM_MACHINES", "1"))):
        raise RuntimeError(f"{world} processes were launched but only {torch.cuda.device_count()} GPUs are visible.")


def release_freed_memory(threshold: int = RELEASE_THRESHOLD) -> bool:
    """
    Have glibc's malloc serve every block over `threshold` bytes as a mapping of its own, unmapped when freed, as
    `MALLOC_MMAP_THRESHOLD_=threshold` does from a process's start. As it comes, glibc raises that threshold as blocks
    are freed (up to 32 MiB) and keeps what a training step frees in its heaps, so a CPU process's RSS grows to more
    than the tensors alive: with LoRA's activation checkpointing, 4,129 against 2,552 MiB at ViT-B/16 + BERT-base
    size (scripts/benchmarks/results/lora_memory.md). Accelerators are not affected (their tensors are not malloc's).
    Returns whether it was set: False, with a warning, where the C library is not glibc (macOS, Windows, musl).
    """
    libc = None
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            libc = None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        logger.warning("--release_freed_memory is for glibc's malloc (Linux); this C library is left as it is.")
        return False
    done = libc.mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1
    if not done:
        logger.warning("glibc refused mallopt(M_MMAP_THRESHOLD, %d); the allocator is left as it is.", threshold)
    return done
