"""
Time to accuracy of the batch-size ramp (`--batch_size_ramp_max`) against a fixed batch, as a user runs them:
`scripts/train.py` with the recipe's flags, each run in a fresh Python, one after the other.

- easy-VQA: the default recipe (64 px, 6 epochs, lr 3e-4) with random batches of 64, against batches growing
  16, 32, 48, 64, 64, 64 over the epochs with the learning rate scaled linearly (3e-4 at 64). Evaluated every 5% of
  training on the first 2,000 test questions.
- Sort-of-CLEVR: `scripts/configs/sort_of_clevr.yaml` (batches of 64, lr 1e-3, 12 epochs) against the same ramp
  from 16 to 64. Evaluated every 5% of training on 12,000 held-out questions.

The clock is `elapsed_seconds` of each evaluation log (wall time since `train()` began, evaluations included). A run
stops at the first evaluation that reaches every target of its dataset, or at the first one after `--budget_minutes`;
the learning-rate schedule is the full run's either way, so stopping early does not change what came before.

    python scripts/benchmarks/benchmark_batch_ramp.py --runs easy_vqa_fixed easy_vqa_ramp   # ~10 min on 2 cores
    python scripts/benchmarks/benchmark_batch_ramp.py   # with Sort-of-CLEVR: ~45 min more

Writes scripts/benchmarks/results/batch_ramp.{json,md} (runs kept from earlier invocations unless rerun) and prints
the Markdown table.
"""

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarking import RESULTS, machine, markdown_table, run_in_new_interpreter, write_report
from transformers import HfArgumentParser, TrainerCallback


ROOT = Path(__file__).resolve().parents[2]
RAMP = ["--per_device_train_batch_size", "16", "--batch_size_ramp_max", "64", "--batch_size_ramp_lr", "linear"]
EASY_VQA = ["--group_by_image", "False", "--max_eval_samples", "2000", "--eval_steps", "0.05"]
SORT_OF_CLEVR = [str(ROOT / "scripts/configs/sort_of_clevr.yaml")]
EASY_VQA_TARGETS = {"eval_accuracy": [0.6, 0.8, 0.9, 0.95]}
# The Sort-of-CLEVR recipe's targets.
SORT_OF_CLEVR_TARGETS = {"eval_accuracy_relational": [0.94], "eval_accuracy_non_relational": [0.98]}
RUNS = {
    "easy_vqa_fixed": (EASY_VQA, EASY_VQA_TARGETS),
    "easy_vqa_ramp": (EASY_VQA + RAMP, EASY_VQA_TARGETS),
    "sort_of_clevr_fixed": (SORT_OF_CLEVR, SORT_OF_CLEVR_TARGETS),
    "sort_of_clevr_ramp": (SORT_OF_CLEVR + RAMP, SORT_OF_CLEVR_TARGETS),
}


@dataclass
class Options:
    runs: list[str] = field(default_factory=lambda: list(RUNS))
    budget_minutes: float = 30.0
    output: str = str(RESULTS / "batch_ramp")


class StopAtTargets(TrainerCallback):
    """Records every evaluation (elapsed seconds, step, epoch, the target metrics) and stops training once every
    metric reached its highest target, or once the budget is spent."""

    def __init__(self, targets: dict[str, list[float]], budget_s: float):
        self.targets, self.budget_s, self.curve = targets, budget_s, []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "elapsed_seconds" not in logs or not any(k in logs for k in self.targets):
            return
        entry = {"seconds": logs["elapsed_seconds"], "step": state.global_step, "epoch": state.epoch}
        entry.update({k: logs[k] for k in self.targets})
        self.curve.append(entry)
        reached = all(logs[k] >= max(values) for k, values in self.targets.items())
        if reached or logs["elapsed_seconds"] > self.budget_s:
            control.should_training_stop = True


def ramp_trial(payload: dict) -> dict:
    """One run of `scripts/train.py`'s steps with a `StopAtTargets` callback; its curve and settings."""
    import torch

    from mm_fusion.training import setup_run

    with tempfile.TemporaryDirectory() as work:
        flags, targets = RUNS[payload["run"]]
        argv = [*flags, "--output_dir", work, "--save_strategy", "no", "--disable_tqdm", "True"]
        start = time.perf_counter()
        trainer = setup_run(argv)
        setup_seconds = time.perf_counter() - start
        stopper = StopAtTargets(targets, payload["budget_s"])
        trainer.add_callback(stopper)
        trainer.train()
        return {
            "run": payload["run"],
            "command": "scripts/train.py " + " ".join(argv[:-5] if argv[-5] == "--output_dir" else argv),
            "setup_seconds": setup_seconds,
            "curve": stopper.curve,
            "steps": trainer.state.global_step,
            "max_steps": trainer.state.max_steps,
            "threads": torch.get_num_threads(),
        }


def first_reach(curve: list[dict], metric: str, target: float) -> dict | None:
    return next((e for e in curve if e[metric] >= target), None)


def main() -> None:
    (options,) = HfArgumentParser(Options).parse_args_into_dataclasses()
    path = Path(options.output + ".json")
    previous = json.loads(path.read_text())["runs"] if path.is_file() else {}
    runs = dict(previous)
    for name in options.runs:
        print(f"== {name}", flush=True)
        runs[name] = run_in_new_interpreter(
            "benchmark_batch_ramp:ramp_trial", {"run": name, "budget_s": options.budget_minutes * 60}
        )
        runs[name]["measured"] = time.strftime("%Y-%m-%d %H:%M")
        write_report(options.output, {"machine": machine(), "runs": runs})
    rows = []
    for name, run in runs.items():
        _, targets = RUNS[name]
        for metric, values in targets.items():
            for target in values:
                hit = first_reach(run["curve"], metric, target)
                best = max(e[metric] for e in run["curve"])
                rows.append([name, metric.removeprefix("eval_"), target,
                             f"{hit['seconds'] / 60:.1f} min (epoch {hit['epoch']:.2f})" if hit else "not reached",
                             f"{best:.3f}", run["steps"], run["measured"]])  # fmt: skip
    header = ["run", "metric", "target", "first reached", "best", "steps run", "measured"]
    text = "# Batch-size ramp against a fixed batch: time to accuracy\n\n" + markdown_table(header, rows)
    write_report(options.output, {"machine": machine(), "runs": runs}, text)
    print(text)


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
