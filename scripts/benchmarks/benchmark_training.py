"""Run the easy-VQA training recipes and ablations as a user would, and tabulate accuracy, wall time and speed.

Each run is the README's command, `accelerate launch scripts/train.py ...`, in a fresh process from the checkout's
root, timed over its whole wall time and read back from its `all_results.json` and `trainer_state.json`; with
`--repeats N` the recipes run interleaved N times and the table gives medians (min–max). Method and results:
scripts/benchmarks/README.md.

    python scripts/benchmarks/benchmark_training.py --runs default --repeats 3
    python scripts/benchmarks/benchmark_training.py --runs short,late,image_only,text_only   # the 3-epoch ablations

Writes scripts/benchmarks/results/benchmark_training.{md,json} (merged with the runs already there) and prints the
table.
"""

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from benchmarking import RESULTS, ROOT, markdown_table, median_range, spread, write_report
from transformers import HfArgumentParser


SHORT = ["--num_train_epochs", "3"]  # the ablations: 3 epochs each, against the same 3-epoch baseline
RUNS = {
    "default": [],
    "full": ["scripts/configs/easy_vqa_full.yaml"],
    "default_late": ["--fusion_type", "late"],
    "full_late": ["scripts/configs/easy_vqa_full.yaml", "--fusion_type", "late"],
    "short": SHORT,
    "late": [*SHORT, "--fusion_type", "late"],
    "image_only": [*SHORT, "--ablation", "image_only"],
    "text_only": [*SHORT, "--ablation", "text_only"],
    "bidirectional": [*SHORT, "--fusion_direction", "bidirectional"],
    "default_vit": ["--vision_tower", "vit"],
    "full_vit": ["scripts/configs/easy_vqa_full.yaml", "--vision_tower", "vit", "--num_train_epochs", "14"],
}
DESCRIPTIONS = {
    "default": "no arguments: a ResNet tower (stages of 24, 48, 96 channels, sine positions), hierarchical fusion, "
    "text-to-image attention, 6 epochs",
    "full": "scripts/configs/easy_vqa_full.yaml: the default model (ResNet tower), 10 epochs",
    "default_late": "the default with late fusion (dual encoder, no cross-attention), 6 epochs",
    "full_late": "the full config with late fusion, 10 epochs",
    "short": "3 epochs (the ablations' baseline)",
    "late": "3 epochs, late fusion (dual encoder, no cross-attention)",
    "image_only": "3 epochs, texts blanked to [CLS] [SEP]",
    "text_only": "3 epochs, images blanked to black",
    "bidirectional": "3 epochs, co-attention in both directions",
    "default_vit": "the default with the ViT tower of the earlier default (4 layers, patch 8), 6 epochs",
    "full_vit": "scripts/configs/easy_vqa_full.yaml with the ViT tower, 14 epochs",
}


@dataclass
class BenchmarkArguments:
    runs: str = field(default="default", metadata={"help": f"Comma-separated, from {', '.join(RUNS)}."})
    repeats: int = field(default=1, metadata={"help": "Runs of each recipe, interleaved; medians with min-max."})
    output_root: str = field(default="outputs/benchmark_training", metadata={"help": "Where the runs write."})
    results: str = field(default=str(RESULTS / "benchmark_training"), metadata={"help": "Path stem of md/json."})


def run_one(name: str, output_dir: Path) -> dict:
    # The README's command; a config file comes first, the flags after it override it.
    command = [
        str(Path(sys.executable).with_name("accelerate")),
        "launch",
        "scripts/train.py",
        *RUNS[name],
        "--output_dir",
        str(output_dir),
        "--disable_tqdm",
        "True",
    ]
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as in a new user's shell
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    results = json.loads((output_dir / "all_results.json").read_text())
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    train_logs = [h for h in history if "samples_per_second" in h]
    speeds = sorted(h["samples_per_second"] for h in train_logs)
    return {
        "run": name,
        "description": DESCRIPTIONS[name],
        "command": "accelerate launch " + " ".join(command[2:]),
        "test_accuracy": results["eval_accuracy"],
        "wall_seconds": wall,
        "train_seconds": results["train_runtime"],
        "median_train_samples_per_second": speeds[len(speeds) // 2] if speeds else None,
        "median_data_wait_fraction": sorted(h["data_wait_fraction"] for h in train_logs)[len(train_logs) // 2]
        if train_logs
        else None,
        "epochs": results.get("epoch"),
        "accuracy_per_epoch": [round(h["eval_accuracy"], 4) for h in history if "eval_accuracy" in h],
    }


def combine(name: str, runs: list[dict]) -> dict:
    """One row from the repeats of a recipe: medians, with every run kept."""
    first = runs[0]
    return {
        "run": name,
        "description": first["description"],
        "command": first["command"],
        "repeats": len(runs),
        "test_accuracy": spread([r["test_accuracy"] for r in runs]),
        "wall_seconds": spread([r["wall_seconds"] for r in runs]),
        "train_samples_per_second": spread([r["median_train_samples_per_second"] for r in runs]),
        "data_wait_fraction": spread([r["median_data_wait_fraction"] for r in runs]),
        "runs": runs,
    }


def table(rows: list[dict]) -> str:
    header = [
        "run",
        "what",
        "runs",
        "test accuracy",
        "wall time (min)",
        "training samples/s",
        "data wait",
        "accuracy at each evaluation (first run)",
    ]
    cells = [
        [
            r["run"],
            r["description"],
            r["repeats"],
            median_range(r["test_accuracy"], 4),
            median_range(r["wall_seconds"], 1, 1 / 60),
            median_range(r["train_samples_per_second"]),
            median_range(r["data_wait_fraction"], 1, 100) + "%",
            ", ".join(f"{a:.3f}" for a in r["runs"][0]["accuracy_per_epoch"]),
        ]
        for r in rows
    ]
    return markdown_table(header, cells)


def main(argv: list[str] | None = None) -> list[dict]:
    (args,) = HfArgumentParser(BenchmarkArguments).parse_args_into_dataclasses(args=argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise ValueError(f"Unknown runs {unknown}; choose from {list(RUNS)}.")
    stem = ROOT / args.results  # a relative --results is under the checkout
    results_path = stem.with_name(stem.name + ".json")
    previous = json.loads(results_path.read_text())["runs"] if results_path.is_file() else []
    rows = {r["run"]: r for r in previous if "repeats" in r}  # rows of the older one-run format are dropped
    done = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names:  # interleaved: A B A B ...
            done[name].append(run_one(name, ROOT / args.output_root / f"{name}-{repeat}"))
            rows[name] = combine(name, done[name])
            print(table([rows[name]]), flush=True)
    ordered = [rows[n] for n in RUNS if n in rows]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, " + (
        torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    )
    header = (
        "easy-VQA (38,575 train / 9,673 test questions); each recipe launched as the README does "
        f"(`accelerate launch scripts/train.py ...`), repeats interleaved, median (min–max); {machine}."
    )
    markdown = header + "\n\n" + table(ordered) + "\n"
    write_report(stem, {"machine": machine, "runs": ordered}, markdown)
    print("\n" + markdown)
    return ordered


if __name__ == "__main__":
    main()
