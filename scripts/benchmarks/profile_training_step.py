"""
Profile the default training step and measure candidate speed-ups against it (`default`, `bf16`, `eager`, `compile`),
in one process, interleaved: the model, batches and optimizer of `scripts/train.py` with no arguments
(`mm_fusion.training.run.setup_run`), a step without data loading. Method and results: scripts/benchmarks/README.md.

    python scripts/benchmarks/profile_training_step.py     # ~4 minutes on 2 cores
    python scripts/benchmarks/profile_training_step.py --rounds 1 --steps 5 --variants default,bf16   # a quick look

Writes scripts/benchmarks/results/profile_training_step.{json,md} and prints the tables.
"""

import contextlib
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch
from benchmarking import RESULTS, median_range, spread, write_report
from transformers import HfArgumentParser

from mm_fusion.training.run import setup_run


VARIANTS = ("default", "bf16", "eager", "compile")


@dataclass
class ProfileArguments:
    variants: str = field(default=",".join(VARIANTS), metadata={"help": f"Comma-separated, from {VARIANTS}."})
    rounds: int = field(default=3, metadata={"help": "Interleaved rounds."})
    steps: int = field(default=20, metadata={"help": "Timed steps per variant and round (after 3 untimed ones)."})
    profile_steps: int = field(default=10, metadata={"help": "Steps under torch.profiler (0: no profile)."})
    output: str = field(default=str(RESULTS / "profile_training_step"), metadata={"help": "Path stem."})


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(ProfileArguments).parse_args_into_dataclasses(args=argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"Unknown variants {unknown}; choose from {VARIANTS}.")
    with tempfile.TemporaryDirectory() as out:
        trainer = setup_run(
            ["--output_dir", out, "--max_steps", "1", "--eval_strategy", "no", "--save_strategy", "no"]
        )
    model, optimizer = trainer.model, trainer.create_optimizer()
    loader = iter(trainer.get_train_dataloader())
    batches = [next(loader) for _ in range(args.steps + 3)]
    model.train()
    compiled = None

    def step(module, batch, autocast: bool) -> None:
        context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with context:
            loss = module(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def run(variant: str, batches) -> float:
        nonlocal compiled
        model.set_attn_implementation("eager" if variant == "eager" else "sdpa")
        module = model
        if variant == "compile":
            module = compiled
        for batch in batches[:3]:
            step(module, batch, variant == "bf16")
        start = time.perf_counter()
        for batch in batches[3:]:
            step(module, batch, variant == "bf16")
        return sum(len(b["input_ids"]) for b in batches[3:]) / (time.perf_counter() - start)

    profile_table = ""
    if args.profile_steps:
        from torch.profiler import profile

        for batch in batches[:3]:
            step(model, batch, False)
        with profile() as prof:
            for batch in batches[3 : 3 + args.profile_steps]:
                step(model, batch, False)
        profile_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
        print(profile_table)
    compile_seconds = None
    if "compile" in variants:
        start = time.perf_counter()
        compiled = torch.compile(model)
        for batch in batches[:3]:  # the first shapes compile; later ones may recompile once with dynamic sizes
            step(compiled, batch, False)
        compile_seconds = time.perf_counter() - start
    speeds = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            speeds[v].append(run(v, batches))
            print(f"round {r + 1} {v}: {speeds[v][-1]:.0f} samples/s", flush=True)
    base = statistics.median(speeds["default"]) if "default" in speeds else None
    rows = []
    for v in variants:
        median = statistics.median(speeds[v])
        rows.append(
            {
                "variant": v,
                "samples_per_second": spread(speeds[v]),
                "vs_default": median / base if base else None,
                "runs": speeds[v],
            }
        )
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch " + (
        f"{torch.__version__}, " + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
    )
    lines = [
        f"Default training step (batch {len(batches[0]['input_ids'])}, grouped by image), {args.rounds} interleaved "
        f"rounds of {args.steps} steps; {machine}. Median (min–max).",
        "",
        "| variant | samples/s | vs default |",
        "|---|---|---|",
    ]
    for row in rows:
        ratio = f"{row['vs_default']:.2f}x" if row["vs_default"] else "-"
        lines.append(f"| {row['variant']} | {median_range(row['samples_per_second'])} | {ratio} |")
    if compile_seconds is not None:
        lines += ["", f"`torch.compile`: {compile_seconds:.0f} s to compile (and run the first 3 steps)."]
    markdown = "\n".join(lines) + "\n"
    print("\n" + markdown)
    result = {"machine": machine, "rows": rows, "compile_seconds": compile_seconds, "profile": profile_table}
    write_report(args.output, result, markdown + ("\n```\n" + profile_table + "\n```\n" if profile_table else ""))
    return result


if __name__ == "__main__":
    main()
