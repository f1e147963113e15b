"""Run the easy-VQA training recipes and ablations as a user would, over seeds, and tabulate accuracy, wall time and
speed.

Each run is the README's command, `accelerate launch scripts/train.py ... --seed S`, in a fresh process from the
checkout's root, timed over its whole wall time and read back from its `all_results.json` and `trainer_state.json`.
Every recipe runs once per seed (seeds interleaved: A B A B ...), and the table gives the mean with the worst and best
seed: repeats of one seed on one CPU are nearly identical and would hide the spread a user sees. Method:
scripts/benchmarks/README.md; results: scripts/benchmarks/RESULTS.md.

    python scripts/benchmarks/benchmark_training.py --runs default --seeds 0,1,2,3,4
    python scripts/benchmarks/benchmark_training.py --runs full --seeds 0,1,2
    python scripts/benchmarks/benchmark_training.py --runs short,late,image_only,text_only --seeds 0   # ablations
    python scripts/benchmarks/benchmark_training.py --runs default,default@41766e4 --seeds 0   # against older code

A run named `RECIPE@COMMIT` is the recipe's command on the code of that commit (a git worktree of it, first on the
`PYTHONPATH`), so that a change is timed against another commit's code on the same machine, interleaved.

Writes scripts/benchmarks/results/benchmark_training.{md,json} (merged with the runs already there: a recipe's runs
of other seeds on the same machine stay in its row) and prints the table.
"""

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarking import RESULTS, ROOT, machine, markdown_table, write_report
from transformers import HfArgumentParser


SHORT = ["--num_train_epochs", "3"]  # the ablations: 3 epochs each, against the same 3-epoch baseline
TWO_LAYERS = ["--fusion_layers", "2"]
# Two fusion layers over a tower that does not read the question: the baseline model (model_configs/).
BASELINE_MODEL = Path(__file__).with_name("model_configs") / "two_fusion_layers_blind_tower.json"
BLIND_TOWER = ["--model_config", str(BASELINE_MODEL)]
RUNS = {
    "default": [],
    "default_4_epochs": ["--num_train_epochs", "4"],
    "default_3_epochs": ["--num_train_epochs", "3"],
    "default_2_fusion_layers": [*TWO_LAYERS, "--num_train_epochs", "4"],
    "default_3.5_epochs": [
        *TWO_LAYERS,
        "--num_train_epochs",
        "3.5",
        "--learning_rate",
        "7e-4",
        "--max_grad_norm",
        "5",
    ],
    "default_3.25_epochs": [
        *TWO_LAYERS,
        "--num_train_epochs",
        "3.25",
        "--learning_rate",
        "7e-4",
        "--max_grad_norm",
        "5",
    ],
    "full": ["scripts/configs/easy_vqa_full.yaml"],
    "blind_tower": BLIND_TOWER,
    "blind_tower_no_limit": ["--image_group_size", "0", *BLIND_TOWER],
    "blind_tower_full": ["scripts/configs/easy_vqa_full.yaml", *BLIND_TOWER],
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
    "default": "no arguments: a ResNet tower (stages of 24, 48, 96 channels, sine positions) whose stages read the "
    "question, one hierarchical text-to-image fusion layer reading its last stage, the questions in a random order, "
    "peak learning rate 5e-4 with gradients clipped at norm 1, 3 epochs",
    "default_4_epochs": "the default for 4 epochs",
    "default_3_epochs": "the default for 3 epochs",
    "default_2_fusion_layers": "the default with two fusion layers (reading stages 2 and 3), 4 epochs",
    "default_3.5_epochs": "two fusion layers, 3.5 epochs at 7e-4 clipped at 5",
    "default_3.25_epochs": "two fusion layers, 3.25 epochs at 7e-4 clipped at 5",
    "full": "scripts/configs/easy_vqa_full.yaml: the default model and batches, 6 epochs at 5e-4 clipped at 1",
    "blind_tower": "two fusion layers over a tower that does not read the question (model_configs/"
    "two_fusion_layers_blind_tower.json: no stage reads the text, the fusion drawn from N(0, 0.02), the tower's "
    "tokens through a second Linear)",
    "blind_tower_no_limit": "blind_tower with all questions of an image in a row (--image_group_size 0)",
    "blind_tower_full": "scripts/configs/easy_vqa_full.yaml with the blind-tower model",
    "default_late": "the default with late fusion (dual encoder, no cross-attention), 6 epochs",
    "full_late": "the full config with late fusion, 8 epochs",
    "short": "3 epochs (the ablations' baseline)",
    "late": "3 epochs, late fusion (dual encoder, no cross-attention)",
    "image_only": "3 epochs, texts blanked to [CLS] [SEP]",
    "text_only": "3 epochs, images blanked to black",
    "bidirectional": "3 epochs, co-attention in both directions",
    "default_vit": "the default with a ViT tower (4 layers, patch 8), 6 epochs",
    "full_vit": "scripts/configs/easy_vqa_full.yaml with the ViT tower, 14 epochs",
}


@dataclass
class BenchmarkArguments:
    runs: str = field(default="default", metadata={"help": f"Comma-separated, from {', '.join(RUNS)}."})
    seeds: str = field(
        default="0,1,2,3,4", metadata={"help": "Comma-separated seeds (--seed); each recipe runs once per seed."}
    )
    output_root: str = field(default="outputs/benchmark_training", metadata={"help": "Where the runs write."})
    results: str = field(default=str(RESULTS / "benchmark_training"), metadata={"help": "Path stem of md/json."})


def recipe_and_commit(name: str) -> tuple[str, str | None]:
    """`RECIPE@COMMIT` as (RECIPE, COMMIT); a plain recipe name with no commit."""
    recipe, _, commit = name.partition("@")
    return recipe, commit or None


@contextlib.contextmanager
def checkouts(commits: set[str]):
    """A detached git worktree of each commit, removed afterwards: {commit: its directory}."""
    work = Path(tempfile.mkdtemp(prefix="mm_fusion_code_at_"))
    trees = {}
    try:
        for commit in sorted(commits):
            trees[commit] = work / commit
            git = ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(trees[commit]), commit]
            subprocess.run(git, check=True, capture_output=True, text=True)
        yield trees
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def run_one(name: str, seed: int, output_dir: Path, code: Path | None = None) -> dict:
    """One run of a recipe, as a user launches it; `code`: the checkout of another commit to run it from."""
    recipe, commit = recipe_and_commit(name)
    # The README's command; a config file comes first, the flags after it override it.
    command = [
        str(Path(sys.executable).with_name("accelerate")),
        "launch",
        "scripts/train.py",
        *RUNS[recipe],
        "--seed",
        str(seed),
        "--output_dir",
        str(output_dir),
        "--disable_tqdm",
        "True",
    ]
    print("$", " ".join(command), flush=True)
    shutil.rmtree(output_dir, ignore_errors=True)  # an earlier run's checkpoints and results must not be read back
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as in a new user's shell
    if code is not None:  # that commit's mm_fusion before the installed one
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH")]))
    done = subprocess.run(command, cwd=code or ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    results = json.loads((output_dir / "all_results.json").read_text())
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    train_logs = [h for h in history if "samples_per_second" in h]
    speeds = sorted(h["samples_per_second"] for h in train_logs)
    return {
        "run": name,
        "seed": seed,
        "description": describe(name),
        "command": "accelerate launch " + " ".join(command[2:]),
        "test_accuracy": results["eval_accuracy"],
        "wall_seconds": wall,
        "train_seconds": results["train_runtime"],
        "median_train_samples_per_second": speeds[len(speeds) // 2] if speeds else None,
        "median_data_wait_fraction": sorted(h["data_wait_fraction"] for h in train_logs)[len(train_logs) // 2]
        if train_logs
        else None,
        "epochs": results.get("epoch"),
        "accuracy_per_evaluation": [round(h["eval_accuracy"], 4) for h in history if "eval_accuracy" in h],
    }


def stats(values: list[float]) -> dict:
    """Mean, worst (min) and best (max) over the seeds."""
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def mean_range(stat: dict, digits: int, scale: float = 1.0) -> str:
    low, mean, high = (f"{stat[k] * scale:.{digits}f}" for k in ("min", "mean", "max"))
    return mean if stat["min"] == stat["max"] else f"{mean} ({low}–{high})"


def describe(name: str) -> str:
    """What a run is: its recipe's description, or for `RECIPE@COMMIT` the commit its code comes from."""
    recipe, commit = recipe_and_commit(name)
    return DESCRIPTIONS[recipe] if commit is None else f"the same command on the code of commit {commit}"


def combine(name: str, runs: list[dict]) -> dict:
    """One row from a recipe's runs over seeds: mean, min and max, with every run kept."""
    runs = sorted(runs, key=lambda r: r["seed"])
    first = runs[0]
    return {
        "run": name,
        "description": first["description"],
        "command": first["command"],
        "seeds": [r["seed"] for r in runs],
        "test_accuracy": stats([r["test_accuracy"] for r in runs]),
        "wall_seconds": stats([r["wall_seconds"] for r in runs]),
        "train_samples_per_second": stats([r["median_train_samples_per_second"] for r in runs]),
        "runs": runs,
    }


def table(rows: list[dict]) -> str:
    header = [
        "run",
        "what",
        "seeds",
        "test accuracy: mean (worst–best seed)",
        "per seed",
        "wall time (min): mean (min–max)",
        "training samples/s",
        "CPU",
    ]
    cells = [
        [
            r["run"],
            r["description"],
            ", ".join(map(str, r["seeds"])),
            mean_range(r["test_accuracy"], 4),
            ", ".join(f"{run['test_accuracy']:.4f}" for run in r["runs"]),
            mean_range(r["wall_seconds"], 1, 1 / 60),
            mean_range(r["train_samples_per_second"], 0),
            r.get("machine", {}).get("cpu", "?"),
        ]
        for r in rows
    ]
    return markdown_table(header, cells)


def main(argv: list[str] | None = None) -> list[dict]:
    (args,) = HfArgumentParser(BenchmarkArguments).parse_args_into_dataclasses(args=argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if recipe_and_commit(n)[0] not in RUNS]
    if unknown:
        raise ValueError(f"Unknown runs {unknown}; choose from {list(RUNS)}.")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    stem = ROOT / args.results  # a relative --results is under the checkout
    results_path = stem.with_name(stem.name + ".json")
    previous = json.loads(results_path.read_text())["runs"] if results_path.is_file() else []
    rows = {r["run"]: r for r in previous if "seeds" in r}  # rows of the older repeats-of-one-seed format are dropped
    hardware = machine()
    # A recipe's runs already there on this CPU are kept, but for the seeds run again: more seeds add to a row. Runs of
    # a recipe described otherwise (its defaults changed since) are dropped: a row is one recipe.
    done = {
        name: [
            r
            for r in (rows[name]["runs"] if name in rows and rows[name].get("machine") == hardware else [])
            if r["seed"] not in seeds and r.get("description") == describe(name)
        ]
        for name in names
    }
    with checkouts({c for n in names if (c := recipe_and_commit(n)[1])}) as trees:
        for seed in seeds:
            for name in names:  # interleaved: A B A B ...
                code = trees.get(recipe_and_commit(name)[1])
                output_dir = (ROOT / args.output_root / f"{name}-seed{seed}").resolve()
                done[name].append(run_one(name, seed, output_dir, code))
                rows[name] = {**combine(name, done[name]), "machine": hardware}
                print(table([rows[name]]), flush=True)
    order = list(RUNS)
    ordered = sorted(rows.values(), key=lambda r: (order.index(recipe_and_commit(r["run"])[0]), r["run"]))
    described = f"{hardware['cpu']}, {hardware['cores']} cores, torch {hardware['torch']}, " + (
        hardware["gpu"] or "no GPU"
    )
    header = (
        "easy-VQA (38,575 train / 9,673 test questions); each recipe launched as the README does "
        f"(`accelerate launch scripts/train.py ... --seed S`), once per seed, seeds interleaved, alone on the "
        f"machine; mean (worst–best seed); this run: {described}."
    )
    markdown = header + "\n\n" + table(ordered) + "\n"
    write_report(stem, {"machine": hardware, "runs": ordered}, markdown)
    print("\n" + markdown)
    return ordered


if __name__ == "__main__":
    main()
