"""Sort-of-CLEVR: does fusion fuse? Run the relational recipes as a user would and tabulate accuracy per question type.

Each run is `accelerate launch scripts/train.py scripts/configs/sort_of_clevr*.yaml [flags]` in a fresh process from
the checkout's root, timed over its whole wall time and read back from its `all_results.json`; `pretrain` is followed
by `zero_shot_sort_of_clevr.py`, and every invocation adds the question-only ceiling computed from the data. Method:
scripts/benchmarks/README.md; results: scripts/benchmarks/RESULTS.md.

    python scripts/benchmarks/benchmark_sort_of_clevr.py --runs film   # the main recipe, ~32 min on 2 cores
    python scripts/benchmarks/benchmark_sort_of_clevr.py --runs film_seed_1   # another seed
    python scripts/benchmarks/benchmark_sort_of_clevr.py --runs late,image_only,text_only --parallel 2

Writes scripts/benchmarks/results/sort_of_clevr.{json,md,png} (merged with the runs already there) and prints the
table.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from benchmark_pointing import pointing, pointing_tables, store
from benchmarking import RESULTS, ROOT, SCRIPTS, markdown_table, write_report

from mm_fusion.training import parse_overrides


MAIN = "scripts/configs/sort_of_clevr.yaml"
SHORT = "scripts/configs/sort_of_clevr_short.yaml"
PRETRAIN = "scripts/configs/sort_of_clevr_pretrain.yaml"
HIERARCHICAL = "scripts/configs/sort_of_clevr_hierarchical.yaml"
# The main recipe's `config_overrides` without FiLM: the same tower, flattened image and head, the question only in
# the head (the Relation Network paper's CNN+MLP baseline).
LATE_OVERRIDES = "image_pooling=flatten,vision_position_embedding=none,init_scheme=pytorch"
HALF = ["--num_train_epochs", "6"]
RUNS = {
    "film": ([MAIN], "the main recipe: the ResNet tower conditioned on the question by FiLM, late head"),
    "film_seed_1": ([MAIN, "--seed", "1"], "the main recipe, another initialisation and batch order"),
    "late": ([MAIN, "--config_overrides", LATE_OVERRIDES], "late fusion (no FiLM): the question only in the head"),
    "hierarchical": (
        [HIERARCHICAL],
        "mm_fusion's cross-attention, no FiLM: the ResNet's stages read the question by cross-attention "
        "(vision_text_attention), then the question's words read its last stage, each with its own query; the head "
        "the text stream",
    ),
    "hierarchical_seed_1": ([HIERARCHICAL, "--seed", "1"], "the hierarchical recipe, another initialisation"),
    "hierarchical_seed_2": ([HIERARCHICAL, "--seed", "2"], "the hierarchical recipe, a third initialisation"),
    **{
        f"hierarchical_4_epochs{'' if seed == 0 else f'_seed_{seed}'}": (
            [HIERARCHICAL, "--num_train_epochs", "4", *([] if seed == 0 else ["--seed", str(seed)])],
            f"the hierarchical recipe stopped at 4 epochs (its schedule ending there), seed {seed}",
        )
        for seed in (0, 1, 2)
    },
    "cross_attention": (
        [HIERARCHICAL, "--fusion_type", "cross_attention"],
        "the hierarchical recipe with `cross_attention` fusion: the text tower's last layer (not the words) reads "
        "the tower's last stage",
    ),
    # The ablations at half the budget (6 epochs): what they can learn they learn early, and the machine is shared.
    "image_only": ([MAIN, "--ablation", "image_only", *HALF], "questions blanked: the image alone, 6 epochs"),
    "text_only": ([MAIN, "--ablation", "text_only", *HALF], "images blanked: the question alone, 6 epochs"),
    "pretrain": ([PRETRAIN], "contrastive (ITC) + matching (ITM) pretraining on the captions"),
    "finetune_pretrained": ([SHORT], "VQA fine-tuning from the pretrain checkpoint"),
    "finetune_scratch": ([SHORT], "the same VQA fine-tuning from scratch"),
}
# Rows of other recipes, kept in the results for comparison; this script does not run them: the ViT tower with
# hierarchical fusion (`vit_*`: commit 11a0c7d's sort_of_clevr.yaml), the hierarchical recipe with the fusion layer's
# self-attention first (`hierarchical_self_first`) and with a tower that does not read the question (`blind_tower_*`:
# commit 98a998f's sort_of_clevr_hierarchical.yaml, the words reading the stem).
OTHER_RECIPES = (
    "vit_hierarchical",
    "vit_late",
    "vit_image_only",
    "vit_text_only",
    "hierarchical_self_first",
    "blind_tower_hierarchical",
    "blind_tower_hierarchical_seed_1",
    "blind_tower_cross_attention",
)
ORDER = [*RUNS, *OTHER_RECIPES, "question_only_ceiling"]
TYPES = ("relational", "non_relational")
FAMILIES = ("shape", "horizontal", "vertical", "closest", "furthest", "count")
TARGETS = {"non_relational": 0.98, "relational": 0.94}


def recipe_dataset_options(flags: list[str]) -> str:
    """The `dataset_options` a run of these arguments trains on: its last `--dataset_options` flag, else its config
    file's."""
    given = [value for flag, value in zip(flags, flags[1:]) if flag == "--dataset_options"]
    return given[-1] if given else yaml.safe_load((ROOT / flags[0]).read_text())["dataset_options"]


def trained_wall_seconds(log: Path) -> float:
    """The wall time scripts/train.py printed at the end of the run logged in `log`."""
    found = re.findall(r"^model, processor and model card in .* \((\d+) s\)$", log.read_text(), flags=re.M)
    if not found:
        raise ValueError(f"--trained: {log} holds no finished scripts/train.py run.")
    return float(found[-1])


def run_one(name: str, output_root: Path, threads: int | None, trained: bool = False) -> dict:
    """Train run `name` into `output_root/name` (its output in `output_root/name.log`) and read its row back; with
    `trained`, the run already made there (by this command, or by the same command by hand) is read back."""
    flags, description = RUNS[name]
    output_dir = output_root / name
    extra = ["--model_name_or_path", str(output_root / "pretrain")] if name == "finetune_pretrained" else []
    command = [str(Path(sys.executable).with_name("accelerate")), "launch", "scripts/train.py", *flags, *extra]
    command += ["--output_dir", str(output_dir), "--disable_tqdm", "True"]
    if threads is not None:
        command += ["--cpu_threads", str(threads)]
    print("$", " ".join(command), flush=True)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as in a new user's shell
    if trained:
        wall = trained_wall_seconds(output_root / f"{name}.log")
    else:
        start = time.perf_counter()
        with open(output_root / f"{name}.log", "w") as log:
            done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed; see {output_root / f'{name}.log'}")
    results = json.loads((output_dir / "all_results.json").read_text())
    row = {"run": name, "description": description, "command": " ".join(command[1:]), "wall_seconds": wall}
    row["threads"] = threads
    row.update({k: v for k, v in results.items() if k.startswith("eval_") or k in ("epoch", "train_runtime")})
    row["curve"] = learning_curve(output_dir)
    reached = time_to_targets(row["curve"])
    if reached is not None:
        row["targets_reached"] = reached
    if name != "pretrain" and not any(flag == "--ablation" for flag in flags):
        # Where the model looks: its map against the object each held-out question names (benchmark_pointing.py).
        options = parse_overrides(recipe_dataset_options(flags), flag="--dataset_options")
        images = options.get("num_test_images", 1000)
        report = pointing(str(output_dir), recipe_dataset_options(flags), images)
        row["pointing"] = report
        store(name, {"model": str(output_dir), "dataset": "sort_of_clevr", **report}, pointing_tables(report))
    if name == "pretrain":
        zero_shot = [sys.executable, str(SCRIPTS / "zero_shot_sort_of_clevr.py"), "--model", str(output_dir)]
        zero_shot += ["--dataset_options", recipe_dataset_options(flags)]  # the test images of the data it trained on
        done = subprocess.run(zero_shot, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"The zero-shot evaluation of {output_dir} failed:\n{done.stderr[-4000:]}")
        row.update(json.loads((output_dir / "zero_shot_results.json").read_text()))
    return row


def learning_curve(output_dir: Path) -> list[dict]:
    """The run's evaluations during training (step, epoch, `elapsed_seconds` since training began, accuracies), from
    the `trainer_state.json` of its last checkpoint; empty when it saved none."""
    checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda path: int(path.name.rpartition("-")[2]))
    if not checkpoints:
        return []
    history = json.loads((checkpoints[-1] / "trainer_state.json").read_text())["log_history"]
    keep = ("step", "epoch", "elapsed_seconds")
    return [
        {k: v for k, v in entry.items() if k in keep or k.startswith("eval_accuracy")}
        for entry in history
        if "eval_accuracy" in entry
    ]


def time_to_targets(curve: list[dict]) -> dict | None:
    """The first evaluation at or above both targets (`TARGETS`): its step, epoch and seconds into training."""
    for entry in curve:
        if all(entry.get(f"eval_accuracy_{kind}", 0.0) >= target for kind, target in TARGETS.items()):
            return {k: entry[k] for k in ("step", "epoch", "elapsed_seconds") if k in entry}
    return None


def question_only_ceiling(dataset_options: str) -> dict[str, float]:
    """
    What a model that reads only the question can be expected to reach on the test split: each distinct question
    answered with its most frequent training answer. Computed from the data, per question type and family.
    """
    from collections import Counter, defaultdict

    from mm_fusion.data import load_sort_of_clevr
    from mm_fusion.training import parse_overrides

    data = load_sort_of_clevr(**parse_overrides(dataset_options, flag="--dataset_options"))
    columns = ["question", "answer", "question_type", "question_family"]
    train, test = (data[s].select_columns(columns).to_dict() for s in ("train", "test"))
    counts = defaultdict(Counter)
    for question, answer in zip(train["question"], train["answer"]):
        counts[question][answer] += 1
    right = [counts[q].most_common(1)[0][0] == a for q, a in zip(test["question"], test["answer"])]
    row = {"run": "question_only_ceiling", "eval_accuracy": sum(right) / len(right)}
    for column in ("question_type", "question_family"):
        for value in set(test[column]):
            hits = [r for r, v in zip(right, test[column]) if v == value]
            row[f"eval_accuracy_{value}"] = sum(hits) / len(hits)
    return row


def pointing_cell(row: dict) -> str:
    """The pointing accuracy on non-relational questions of each map measured (at its best layer), or "–" without a
    measure."""
    if "pointing" not in row:
        return "–"
    parts = []
    for method, figures in row["pointing"]["by_method"].items():
        layers = figures.get("layers", [])
        where = f", {figures['best_layer']}" if len(layers) > 1 else ""
        parts.append(f"{figures['best_non_relational']:.3f} ({method}{where})")
    return "; ".join(parts)


def markdown(rows: dict[str, dict]) -> str:
    """The VQA runs' accuracy per question type and family, and the pretraining run's retrieval and zero-shot
    accuracy."""
    vqa = [rows[n] for n in ORDER if n in rows and "eval_accuracy" in rows[n]]
    header = [
        "run",
        "relational",
        "non-relational",
        "closest",
        "furthest",
        "count",
        "shape",
        "left",
        "top",
        "all",
        "targets reached",
        "pointing",
        "wall time",
    ]
    cells = []
    for r in vqa:
        keys = (*TYPES, "closest", "furthest", "count", "shape", "horizontal", "vertical")
        accuracies = [f"{r.get(f'eval_accuracy_{k}', float('nan')):.3f}" for k in keys]
        if "wall_seconds" not in r:
            wall = "computed from the data"
        else:
            where = "" if r.get("threads") is None else f", {r['threads']} thread(s), sharing the machine"
            wall = f"{r['wall_seconds'] / 60:.1f} min{where}"
        reached = r.get("targets_reached")
        if reached is None:
            reached = "no" if r.get("curve") else "–"
        else:
            reached = f"epoch {reached['epoch']:g}" + (
                f", {reached['elapsed_seconds'] / 60:.1f} min into training" if "elapsed_seconds" in reached else ""
            )
        cells.append([r["run"], *accuracies, f"{r['eval_accuracy']:.3f}", reached, pointing_cell(r), wall])
    text = markdown_table(header, cells)
    pretrain = rows.get("pretrain")
    if pretrain:
        recalls = [pretrain.get(f"eval_{d}_R@{k}", float("nan")) for d in ("text_to_image", "image_to_text")
                   for k in (1, 5, 10)]  # fmt: skip
        header = ["pretraining", *(f"{d} R@{k}" for d in ("t2i", "i2t") for k in (1, 5, 10))]
        header += ["zero-shot ITC", "zero-shot ITM", "wall time"]
        row = ["pretrain", *(f"{v:.3f}" for v in recalls), f"{pretrain['zero_shot_itc_accuracy']:.3f}"]
        row += [f"{pretrain['zero_shot_itm_accuracy']:.3f}", f"{pretrain['wall_seconds'] / 60:.1f} min"]
        text += "\n\n" + markdown_table(header, [row])
    return text + "\n"


def plot(rows: dict[str, dict], path: Path) -> None:
    """Accuracy by question type of the main recipe's runs (bars), and the learning curves of the runs that have one
    (relational solid, non-relational dashed, against minutes into training, or epochs where a run has no clock)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The main recipe's runs only: the fine-tuning runs have a shorter budget (the table has them).
    main_runs = (
        "film",
        "film_seed_1",
        "hierarchical",
        "hierarchical_seed_1",
        "hierarchical_seed_2",
        "cross_attention",
        "late",
    )
    main_runs += tuple(n for n in RUNS if n.startswith("hierarchical_4_epochs"))
    main_runs += ("image_only", "text_only", *OTHER_RECIPES, "question_only_ceiling")
    vqa = [rows[n] for n in main_runs if n in rows and "eval_accuracy_relational" in rows[n]]
    curves = [rows[n] for n in ORDER if n in rows and rows[n].get("curve")]
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(14 if curves else 8, 4.2), squeeze=False)
    ax = axes[0][0]
    width = 0.38
    for i, (kind, colour) in enumerate(zip(TYPES, ("tab:red", "tab:blue"))):
        values = [r[f"eval_accuracy_{kind}"] for r in vqa]
        bars = ax.bar([j + (i - 0.5) * width for j in range(len(vqa))], values, width, label=kind, color=colour)
        ax.bar_label(bars, fmt="%.2f", fontsize=6)
    ax.axhline(TARGETS["relational"], color="tab:red", linestyle="--", linewidth=0.8, label="target, relational")
    ax.axhline(TARGETS["non_relational"], color="tab:blue", linestyle=":", linewidth=0.8, label="target, non-rel.")
    ax.set_xticks(range(len(vqa)), [r["run"].replace("_", " ") for r in vqa], fontsize=7, rotation=30, ha="right")
    ax.set_ylim(0, 1.2)
    ax.set_ylabel("test accuracy")
    ax.set_title("Sort-of-CLEVR: accuracy by question type at the end of each run", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", ncol=4, framealpha=0.95)
    if curves:
        ax = axes[0][1]
        for k, r in enumerate(curves):
            clock = all("elapsed_seconds" in e for e in r["curve"])
            xs = [e["elapsed_seconds"] / 60 if clock else e["epoch"] for e in r["curve"]]
            unit = "min" if clock else "epochs"
            colour = plt.cm.tab10(k % 10)
            ax.plot(xs, [e["eval_accuracy_relational"] for e in r["curve"]], color=colour, marker=".",
                    label=f"{r['run']} relational ({unit})")  # fmt: skip
            ax.plot(xs, [e["eval_accuracy_non_relational"] for e in r["curve"]], color=colour, linestyle="--",
                    label=f"{r['run']} non-relational ({unit})")  # fmt: skip
        for kind, style in (("relational", "--"), ("non_relational", ":")):
            ax.axhline(TARGETS[kind], color="grey", linestyle=style, linewidth=0.8)
        ax.set_xlabel("minutes into training (or epochs, as labelled)")
        ax.set_ylim(0.3, 1.02)
        ax.set_title("learning curves (held-out accuracy)", fontsize=10)
        ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="film,late,image_only,text_only", help=f"From {', '.join(RUNS)}.")
    parser.add_argument("--parallel", type=int, default=1, help="Runs at once (each with cores / N torch threads).")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: the launcher's).")
    parser.add_argument("--output_root", default="outputs/sort_of_clevr")
    parser.add_argument(
        "--trained",
        action="store_true",
        help="Read back the runs already trained in --output_root (NAME/ and NAME.log, as this command leaves them) "
        "instead of training them: their figures, measured again.",
    )
    parser.add_argument("--results", default=str(RESULTS / "sort_of_clevr"), help="Path stem of md / json / png.")
    args = parser.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise ValueError(f"Unknown runs {unknown}; choose from {list(RUNS)}.")
    output_root = ROOT / args.output_root
    output_root.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.parallel) if args.parallel > 1 else args.threads
    stem = ROOT / args.results  # a relative --results is under the checkout
    path = stem.with_name(stem.name + ".json")
    rows = {}
    # A fine-tuning run waits for the pretraining it starts from.
    first = [n for n in names if n != "finetune_pretrained"]
    with ThreadPoolExecutor(args.parallel) as pool:
        for row in pool.map(lambda n: run_one(n, output_root, threads, args.trained), first):
            rows[row["run"]] = row
    if "finetune_pretrained" in names:
        rows["finetune_pretrained"] = run_one("finetune_pretrained", output_root, threads, args.trained)
    rows["question_only_ceiling"] = question_only_ceiling(recipe_dataset_options([MAIN]))  # of the main recipe's data
    # Merged with the runs already there, read now: another instance may have written since this one started.
    rows = {**(json.loads(path.read_text()) if path.is_file() else {}), **rows}
    table = markdown(rows)
    write_report(stem, rows, table)
    plot(rows, stem.with_name(stem.name + ".png"))
    print(table)
    return rows


if __name__ == "__main__":
    main()
