"""Checks that a launch (accelerate config + arguments) can run on this machine."""

import os

import torch


def check_launch(training_args) -> None:
    """Clear errors for an accelerate launch configuration that cannot run on this machine."""
    has_gpu = torch.cuda.is_available()
    env = os.environ
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not has_gpu:
        raise RuntimeError(
            "This launch asks for FSDP, which needs GPUs, but this machine has none. Use "
            "scripts/accelerate_configs/multi_cpu.yaml (or torchrun --nproc_per_node N) for multi-process CPU runs."
        )
    if env.get("ACCELERATE_MIXED_PRECISION") == "fp16" and not has_gpu:
        raise RuntimeError("The accelerate config asks for fp16, which needs a GPU; use bf16 or no on CPU.")
    world = int(env.get("WORLD_SIZE", "1"))
    state = training_args.distributed_state
    processes = state.num_processes if state is not None else 1
    if world > 1 and not has_gpu and processes != world:
        raise RuntimeError(
            f"WORLD_SIZE is {world} but accelerate set up {processes} process(es); on CPU launch with "
            "torchrun --nproc_per_node N or the multi_cpu accelerate config."
        )
    if has_gpu and world > torch.cuda.device_count() * int(env.get("NNODES", env.get("ACCELERATE_NUM_MACHINES", "1"))):
        raise RuntimeError(f"{world} processes were launched but only {torch.cuda.device_count()} GPUs are visible.")
