"""
Benchmark one training step of mm_fusion against the two baselines (`baselines.py`; scripts/benchmarks/README.md,
"The baselines") on easy-VQA (VQA as classification over its 13 answers), at 64 px and upsampled to 224 px, in one
run on one machine.

All three contenders train the same towers (the recipe's ViT and BERT, 2 fusion layers), with the same tokenizer,
seed, optimizer settings (read from `mm_fusion.training`'s argument defaults) and 64 samples per optimizer step:
`seed` (the source articles' loop: PIL + torchvision transforms, `nn.MultiheadAttention` fusion, fp32, manual
accumulation), `run_clip` (transformers' contrastive example's `datasets` pipeline and the stock `Trainer`, training
our model) and `mm_fusion` (`mm_fusion.training.setup_run` with its defaults). Each trial runs in a fresh process;
contenders are interleaved and rotated per round; step time is split into data wait / forward / backward / optimizer
/ other. Targets: mm_fusion >= 2x seed and >= 1.3x run_clip samples/s, data wait < 5% of step time. Method and
targets: scripts/benchmarks/README.md; results: scripts/benchmarks/RESULTS.md.

    python scripts/benchmarks/benchmark_training_step.py   # the full run: 18 trials, at most ~30 min on 2 cores
    python scripts/benchmarks/benchmark_training_step.py --rounds 1 --sizes 64 --steps 10 --loss_samples 640  # ~4 min

Writes scripts/benchmarks/results/benchmark_training_step.{json,md,png} and prints the Markdown table.
"""

import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from baselines import (
    CONTENDERS,
    SEED_MAX_LENGTH,
    SEED_MICRO_BATCH,
    build_fusion_config,
    easy_vqa_splits,
    recipe,
    run_clip_arguments,
    run_clip_dataset,
    seed_model,
    seed_split_loader,
    tower_shapes,
)
from benchmarking import RESULTS, machine, median_range, peak_memory_mib, run_in_new_interpreter, spread, write_report
from torch import nn
from transformers import HfArgumentParser, TrainerCallback


PARTS = ("data_wait", "forward", "backward", "optimizer", "other")  # the split of a step's wall time
TARGETS = {"seed": 2.0, "run_clip": 1.3}  # mm_fusion's throughput must be at least this many times theirs
DATA_WAIT_TARGET = 0.05  # mm_fusion's data wait, as a fraction of step time
# Per-size defaults of the step counts; other sizes take those of the nearest size listed.
DEFAULT_WARMUP = {64: 3, 224: 2}
DEFAULT_STEPS = {64: 15, 224: 5}
DEFAULT_LOSS_SAMPLES = {64: 2048, 224: 512}


@dataclass
class BenchmarkArguments:
    sizes: list[int] = field(default_factory=lambda: [64, 224], metadata={"help": "Image sizes to train at."})
    contenders: list[str] = field(default_factory=lambda: list(CONTENDERS), metadata={"help": "Contenders to run."})
    rounds: int = field(default=3, metadata={"help": "Interleaved rounds (one trial per contender and size each)."})
    warmup: list[int] | None = field(
        default=None,
        metadata={"help": "Untimed optimizer steps: one value, or one per size (default 3 at 64 px, 2 at 224 px)."},
    )
    steps: list[int] | None = field(
        default=None,
        metadata={"help": "Timed optimizer steps: one value, or one per size (default 15 at 64 px, 5 at 224 px)."},
    )
    loss_samples: list[int] | None = field(
        default=None,
        metadata={
            "help": "Training samples before the evaluation loss (first round): one value, or one per size "
            "(default 2048 at 64 px, 512 at 224 px); 0 skips it."
        },
    )
    eval_questions: int = field(default=1000, metadata={"help": "The first N easy-VQA test questions evaluate."})
    patch_size: int | None = field(
        default=None, metadata={"help": "Patch size of every contender's ViT (default: the recipe's)."}
    )
    output: str = field(
        default=str(RESULTS / "benchmark_training_step"),
        metadata={"help": "Writes OUTPUT.json, OUTPUT.md and OUTPUT.png."},
    )


def _per_size(values: list[int] | None, defaults: dict[int, int], sizes: list[int], name: str) -> dict[int, int]:
    """One value for all sizes, one per size, or the default of the nearest size listed in `defaults`."""
    if values is None:
        return {s: defaults[min(defaults, key=lambda d: abs(d - s))] for s in sizes}
    if len(values) == 1:
        return dict.fromkeys(sizes, values[0])
    if len(values) != len(sizes):
        raise ValueError(f"--{name} takes one value or one per size ({len(sizes)}: {sizes}); got {values}.")
    return dict(zip(sizes, values))


def parameter_counts(size: int, vocab_size: int, labels: list[str], rec: dict, patch_size: int | None) -> dict:
    """Parameters of each contender's model at this size (run_clip and mm_fusion train the same model)."""
    from mm_fusion import MMFusionForImageTextClassification

    ours = build_fusion_config(size, vocab_size, rec["max_length"], labels, patch_size)
    seed = build_fusion_config(size, vocab_size, SEED_MAX_LENGTH, labels, patch_size)
    mine = sum(p.numel() for p in MMFusionForImageTextClassification(ours).parameters())
    return {"seed": sum(p.numel() for p in seed_model(seed).parameters()), "run_clip": mine, "mm_fusion": mine}


# --------------------------------------------------------------------------------------------------------------------
# Timing.


class StepTimer:
    """
    Splits the wall time of each optimizer step into `PARTS`: every interval between two `mark`s goes to the part
    named by the later one, so a step's parts add up to the time since the previous step ended. Notes the peak
    memory and a FLOP counter at the end of the warm-up and of the timed window.
    """

    def __init__(self, warmup: int, steps: int, flops=None):
        self.warmup, self.window_end, self.flops = warmup, warmup + steps, flops
        self.steps, self.peak_memory_mib, self.window_flops = [], None, {}
        self.sync = torch.cuda.is_available()
        self._parts, self._samples, self._last = dict.fromkeys(PARTS, 0.0), 0, None

    def start(self) -> None:
        self._last = time.perf_counter()

    def mark(self, part: str) -> None:
        if self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self._parts[part] += now - self._last
        self._last = now

    def count(self, samples: int) -> None:
        self._samples += samples

    def end_step(self) -> None:
        self.steps.append({**self._parts, "samples": self._samples, "total": sum(self._parts.values())})
        self._parts, self._samples = dict.fromkeys(PARTS, 0.0), 0
        if len(self.steps) in (self.warmup, self.window_end) and self.flops is not None:
            self.window_flops[len(self.steps)] = self.flops()
        if len(self.steps) == self.window_end:
            self.peak_memory_mib = peak_memory_mib()

    def summary(self) -> dict:
        window = self.steps[self.warmup : self.window_end]
        if len(window) < self.window_end - self.warmup:
            raise RuntimeError(f"Only {len(self.steps)} steps ran; the timed window ends at step {self.window_end}.")
        total = sum(s["total"] for s in window)
        median_step = statistics.median(s["total"] for s in window)
        samples = statistics.median(s["samples"] for s in window)
        return {
            "step_s": [s["total"] for s in self.steps],
            "median_step_s": median_step,
            "samples_per_step": samples,
            "samples_per_s": samples / median_step,
            "window_samples_per_s": sum(s["samples"] for s in window) / total,
            "split": {part: sum(s[part] for s in window) / total for part in PARTS},
            "peak_memory_mib": self.peak_memory_mib,
            "window_s": total,
        }


class StepTimerCallback(TrainerCallback):
    """Feeds a [`StepTimer`] from a Trainer's step events and from forward hooks on its model."""

    def __init__(self, timer: StepTimer, model: nn.Module):
        self.timer, self.active, self._forwards = timer, False, 0
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        model.register_forward_hook(self._after_forward)

    def _before_forward(self, module, args, kwargs):
        if self.active and module.training:
            # Before the first forward of a step: input preparation; between forwards: the previous backward.
            self.timer.mark("backward" if self._forwards else "other")
            self._forwards += 1
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.timer.count(ids.shape[0])

    def _after_forward(self, module, args, output):
        if self.active and module.training:
            self.timer.mark("forward")

    def on_train_begin(self, args, state, control, **kwargs):
        self.active = True
        self.timer.start()

    def on_step_begin(self, args, state, control, **kwargs):
        self.timer.mark("data_wait")  # the batches were fetched after the previous step ended
        self._forwards = 0

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.timer.mark("backward")

    def on_step_end(self, args, state, control, **kwargs):
        self.timer.mark("optimizer")
        self.timer.end_step()

    def on_train_end(self, args, state, control, **kwargs):
        self.active = False


# --------------------------------------------------------------------------------------------------------------------
# The contenders, each in its own process: train `total_steps` optimizer steps, then evaluate if asked.


def train_seed(size, rec, tokenizer, labels, total_steps, timer, evaluate, eval_questions, patch_size) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = build_fusion_config(size, len(tokenizer), SEED_MAX_LENGTH, labels, patch_size)
    model = seed_model(config).to(device)
    train, test = easy_vqa_splits(eval_questions)

    def forever(batches):
        while True:
            yield from batches

    optimizer = torch.optim.AdamW(model.parameters(), lr=rec["learning_rate"], weight_decay=rec["weight_decay"])
    accumulation = rec["batch_size"] // SEED_MICRO_BATCH
    batches = forever(seed_split_loader(train, tokenizer, size))
    model.train()
    timer.start()
    for _ in range(total_steps):
        for _ in range(accumulation):
            batch = next(batches)
            timer.mark("data_wait")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            timer.mark("other")
            loss = model(**batch)[0] / accumulation
            timer.mark("forward")
            loss.backward()
            timer.mark("backward")
            timer.count(batch["labels"].shape[0])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.mark("optimizer")
        timer.end_step()
    result = {"parameters": sum(p.numel() for p in model.parameters()), "towers": tower_shapes(config)}
    if evaluate:
        model.eval()
        loss_sum, correct, count = 0.0, 0, 0
        with torch.no_grad():
            for batch in seed_split_loader(test, tokenizer, size):
                batch = {k: v.to(device) for k, v in batch.items()}
                logits = model(batch["pixel_values"], batch["input_ids"], batch["attention_mask"])[1]
                loss_sum += F.cross_entropy(logits.float(), batch["labels"], reduction="sum").item()
                correct += int((logits.argmax(-1) == batch["labels"]).sum())
                count += batch["labels"].shape[0]
        result.update(eval_loss=loss_sum / count, eval_accuracy=correct / count, eval_count=count)
    return result


def train_run_clip(size, rec, tokenizer, labels, total_steps, timer, evaluate, eval_questions, patch_size, out):
    from transformers import Trainer

    from mm_fusion import MMFusionForImageTextClassification

    train, test = easy_vqa_splits(eval_questions)
    train_dataset, collate = run_clip_dataset(train, tokenizer, size, rec)
    config = build_fusion_config(size, len(tokenizer), rec["max_length"], labels, patch_size)
    config.problem_type = "single_label_classification"
    model = MMFusionForImageTextClassification(config)
    args = run_clip_arguments(rec, out, total_steps)
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, data_collator=collate)
    trainer.add_callback(StepTimerCallback(timer, model))
    trainer.train()
    result = {"parameters": sum(p.numel() for p in model.parameters()), "towers": tower_shapes(config)}
    if evaluate:
        prediction = trainer.predict(run_clip_dataset(test, tokenizer, size, rec)[0])  # Trainer's loop, logits kept
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        accuracy = float((logits.argmax(-1) == np.asarray(test["answer"])).mean())
        result.update(eval_loss=prediction.metrics["test_loss"], eval_accuracy=accuracy, eval_count=len(test))
    return result


def train_mm_fusion(size, rec, tokenizer_dir, total_steps, timer, evaluate, eval_questions, patch_size, out) -> dict:
    from mm_fusion.training import setup_run

    argv = ["--output_dir", out, "--image_size", str(size), "--max_steps", str(total_steps)]
    argv += ["--tokenizer_name_or_path", tokenizer_dir, "--max_eval_samples", str(eval_questions)]
    argv += ["--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "True"]
    argv += ["--vision_tower", "vit"]  # as build_fusion_config
    if patch_size is not None:
        argv += ["--patch_size", str(patch_size)]
    if torch.cuda.is_available():
        argv += ["--bf16", "True"]
    trainer = setup_run(argv)
    timer.flops = lambda: trainer.state.total_flos + trainer.current_flos  # Trainer's FLOP count, for the MFU
    trainer.add_callback(StepTimerCallback(timer, trainer.model))
    trainer.train()
    model = trainer.model
    result = {"parameters": sum(p.numel() for p in model.parameters()), "towers": tower_shapes(model.config)}
    if evaluate:
        metrics = trainer.evaluate()
        result.update(
            eval_loss=metrics["eval_loss"],
            eval_accuracy=metrics["eval_accuracy"],
            eval_count=len(trainer.eval_dataset),
        )
    return result


def run_trial(payload: dict) -> dict:
    """One trial, in this fresh process."""
    from transformers import AutoTokenizer, set_seed

    from mm_fusion.training.callbacks import peak_tflops

    contender, size, rec = payload["contender"], payload["size"], payload["recipe"]
    warmup, steps, loss_steps = payload["warmup"], payload["steps"], payload["loss_steps"]
    evaluate = loss_steps > 0
    total_steps = max(warmup + steps, loss_steps)
    set_seed(rec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(payload["tokenizer"])
    labels, patch, questions = payload["labels"], payload["patch_size"], payload["eval_questions"]
    timer = StepTimer(warmup, steps)
    start = time.perf_counter()
    if contender == "seed":
        result = train_seed(size, rec, tokenizer, labels, total_steps, timer, evaluate, questions, patch)
    elif contender == "run_clip":
        result = train_run_clip(
            size, rec, tokenizer, labels, total_steps, timer, evaluate, questions, patch, payload["out"]
        )
    else:
        result = train_mm_fusion(
            size, rec, payload["tokenizer"], total_steps, timer, evaluate, questions, patch, payload["out"]
        )
    summary = timer.summary()
    if len(timer.window_flops) == 2 and torch.cuda.is_available():
        peak = peak_tflops(torch.cuda.get_device_name())
        flops = timer.window_flops[timer.window_end] - timer.window_flops[warmup]
        summary["mfu"] = flops / summary["window_s"] / (peak * 1e12) if peak else None
    return {
        "contender": contender,
        "image_size": size,
        "round": payload["round"],
        "warmup_steps": warmup,
        "timed_steps": steps,
        "trained_steps": total_steps,
        "loss_samples": loss_steps * rec["batch_size"] if evaluate else None,
        "torch_threads": torch.get_num_threads(),
        "trial_s": time.perf_counter() - start,
        **summary,
        **result,
    }


# --------------------------------------------------------------------------------------------------------------------
# The run: trials in subprocesses, then tables, JSON and chart.


def _ratios(trials: list[dict], size: int, rounds: int, other: str) -> dict | None:
    """mm_fusion's throughput over `other`'s: the ratio of medians and the per-round ratios."""
    speed = {(t["contender"], t["round"]): t["samples_per_s"] for t in trials if t["image_size"] == size}
    mine = [speed[("mm_fusion", r)] for r in range(rounds) if ("mm_fusion", r) in speed]
    theirs = [speed[(other, r)] for r in range(rounds) if (other, r) in speed]
    both = [r for r in range(rounds) if ("mm_fusion", r) in speed and (other, r) in speed]
    per_round = [speed[("mm_fusion", r)] / speed[(other, r)] for r in both]
    if not per_round:
        return None
    ratio = statistics.median(mine) / statistics.median(theirs)
    return {"ratio": ratio, "per_round": per_round, "min": min(per_round), "max": max(per_round)}


def summarise(trials: list[dict], args: BenchmarkArguments) -> tuple[list[dict], list[dict]]:
    rows, speedups = [], []
    for size in args.sizes:
        for contender in args.contenders:
            mine = [t for t in trials if t["image_size"] == size and t["contender"] == contender]
            loss_trial = next((t for t in mine if t.get("eval_loss") is not None), None)
            mfu = [t["mfu"] for t in mine if t.get("mfu") is not None]
            rows.append(
                {
                    "image_size": size,
                    "contender": contender,
                    "parameters": mine[0]["parameters"],
                    "samples_per_s": spread([t["samples_per_s"] for t in mine]),
                    "median_step_ms": spread([1000 * t["median_step_s"] for t in mine]),
                    "split": {p: statistics.median(t["split"][p] for t in mine) for p in PARTS},
                    "data_wait": spread([t["split"]["data_wait"] for t in mine]),
                    "peak_memory_mib": spread([t["peak_memory_mib"] for t in mine]),
                    "eval_loss": loss_trial["eval_loss"] if loss_trial else None,
                    "eval_accuracy": loss_trial["eval_accuracy"] if loss_trial else None,
                    "loss_samples": loss_trial["loss_samples"] if loss_trial else None,
                    "mfu": statistics.median(mfu) if mfu else None,
                }
            )
        if "mm_fusion" in args.contenders:
            wait = [
                t["split"]["data_wait"] for t in trials if t["image_size"] == size and t["contender"] == "mm_fusion"
            ]
            entry = {"image_size": size, "mm_fusion_data_wait": spread(wait)}
            entry["data_wait_pass"] = statistics.median(wait) < DATA_WAIT_TARGET
            for other, target in TARGETS.items():
                ratio = _ratios(trials, size, args.rounds, other) if other in args.contenders else None
                if ratio is not None:
                    ratio |= {"target": target, "pass": ratio["ratio"] >= target}
                entry[f"vs_{other}"] = ratio
            speedups.append(entry)
    return rows, speedups


def parameter_check(trials: list[dict]) -> list[dict]:
    """At each size: parameter counts within 10% of each other, and the same towers, in every trial."""
    checks = []
    for size in dict.fromkeys(t["image_size"] for t in trials):
        mine = [t for t in trials if t["image_size"] == size]
        counts = {t["contender"]: t["parameters"] for t in mine}
        difference = max(counts.values()) / min(counts.values()) - 1
        same_towers = all(t["towers"] == mine[0]["towers"] for t in mine)
        checks.append(
            {
                "image_size": size,
                "parameters": counts,
                "spread": difference,
                "within_10_percent": difference <= 0.1,
                "same_towers": same_towers,
                "towers": mine[0]["towers"],
            }
        )
    return checks


def markdown(rows, speedups, checks, args, info, rec, settings) -> str:
    device = f"GPU {info['gpu']} (bf16 except seed)" if info["gpu"] else "CPU, fp32"
    steps = ", ".join(f"{s} px: {settings[s]['warmup']} + {settings[s]['steps']}" for s in args.sizes)
    loss = ", ".join(f"{s} px: {settings[s]['loss_samples']}" for s in args.sizes if settings[s]["loss_samples"])
    threads = "/".join(map(str, info["trial_torch_threads"]))
    memory = "peak `torch.cuda.max_memory_allocated`" if info["gpu"] else "peak RSS of the training process"
    lines = [
        f"easy-VQA training step (VQA as classification, 13 answers), {rec['batch_size']} samples per optimizer step, "
        "learning rate "
        f"{rec['learning_rate']:g}, weight decay {rec['weight_decay']:g}, dropout {rec['dropout']:g}; "
        f"{args.rounds} interleaved rounds, a fresh process per trial; warm-up + timed optimizer steps per trial "
        f"({steps}). {device}; {info['cores']} cores ({info['cpu']}), {threads} torch threads, torch "
        f"{info['torch']}, transformers {info['transformers']}. Medians (min–max over rounds); samples/s = "
        f"{rec['batch_size']} / median step time; the split is the share of the timed steps' wall time; memory is the "
        f"{memory} at the end of the timed steps.",
        "",
        f"Evaluation: mean cross-entropy and accuracy on the first {args.eval_questions} easy-VQA test questions, "
        f"each contender reading them through its own data path, after the given number of training samples ({loss}), "
        "measured once per contender and size (round 1)."
        if loss
        else "Evaluation loss: not measured (--loss_samples 0).",
        "",
        "| size | contender | parameters | samples/s | step (ms) | data wait | forward | backward | optimizer | other "
        "| peak memory (MiB) | eval loss | eval accuracy |" + (" MFU |" if info["gpu"] else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if info["gpu"] else ""),
    ]
    for r in rows:
        split = " | ".join(f"{r['split'][p]:.1%}" for p in PARTS)
        loss_cell = f"{r['eval_loss']:.3f} ({r['loss_samples']} samples)" if r["eval_loss"] is not None else "–"
        accuracy = f"{r['eval_accuracy']:.3f}" if r["eval_accuracy"] is not None else "–"
        mfu = (f" {r['mfu']:.1%} |" if r["mfu"] is not None else " – |") if info["gpu"] else ""
        lines.append(
            f"| {r['image_size']} | {r['contender']} | {r['parameters'] / 1e6:.3f}M "
            f"| {median_range(r['samples_per_s'])} | {median_range(r['median_step_ms'])} | {split} "
            f"| {median_range(r['peak_memory_mib'])} | {loss_cell} | {accuracy} |" + mfu
        )
    lines += [
        "",
        "Targets: mm_fusion >= 2x seed and >= 1.3x run_clip in samples/s (ratio of medians; per-round ratios in "
        "brackets), and mm_fusion's data wait < 5% of step time.",
        "",
        "| size | mm_fusion vs seed | | mm_fusion vs run_clip | | mm_fusion data wait | |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in speedups:
        cells = []
        for other in TARGETS:
            ratio = s[f"vs_{other}"]
            if ratio is None:
                cells += ["–", "–"]
            else:
                cells += [
                    f"{ratio['ratio']:.2f}x ({ratio['min']:.2f}–{ratio['max']:.2f})",
                    f"{'PASS' if ratio['pass'] else 'FAIL'} (>= {ratio['target']}x)",
                ]
        wait = s["mm_fusion_data_wait"]
        cells += [f"{wait['median']:.1%} ({wait['min']:.1%}–{wait['max']:.1%})"]
        cells += [f"{'PASS' if s['data_wait_pass'] else 'FAIL'} (< {DATA_WAIT_TARGET:.0%})"]
        lines.append(f"| {s['image_size']} | " + " | ".join(cells) + " |")
    lines.append("")
    for c in checks:
        counts = ", ".join(f"{k} {v:,}" for k, v in c["parameters"].items())
        within = "within 10%" if c["within_10_percent"] else "NOT within 10%"
        towers = "the same towers" if c["same_towers"] else "DIFFERENT towers"
        v, t = c["towers"]["vision"], c["towers"]["text"]
        lines.append(
            f"- Parameters at {c['image_size']} px: {counts} "
            f"({within}: spread {c['spread']:.1%}); {towers} (ViT and BERT of hidden {v['hidden_size']}, "
            f"{v['num_attention_heads']} heads, intermediate {v['intermediate_size']}, {v['num_hidden_layers']} + "
            f"{t['num_hidden_layers']} layers, patch {v['patch_size']}; {c['towers']['fusion_layers']} fusion layers)."
        )
    return "\n".join(lines)


def plot(rows: list[dict], args: BenchmarkArguments, path: str) -> None:
    """Samples/s per contender and size with min-max bars, and the split of the step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = dict(zip(CONTENDERS, ("#b0b0b0", "#7aa6d6", "#d9822b")))
    fig, (speed_ax, split_ax) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.3]})
    n, width = len(args.contenders), 0.8 / len(args.contenders)
    for j, contender in enumerate(args.contenders):
        mine = [next(r for r in rows if r["image_size"] == s and r["contender"] == contender) for s in args.sizes]
        x = [i + (j - (n - 1) / 2) * width for i in range(len(args.sizes))]
        median = [r["samples_per_s"]["median"] for r in mine]
        errors = [
            [m - r["samples_per_s"]["min"] for m, r in zip(median, mine)],
            [r["samples_per_s"]["max"] - m for m, r in zip(median, mine)],
        ]
        bars = speed_ax.bar(x, median, width, yerr=errors, capsize=3, label=contender, color=colors.get(contender))
        speed_ax.bar_label(bars, labels=[f"{m:.0f}" for m in median], padding=2, fontsize=8)
    speed_ax.set_xticks(range(len(args.sizes)), [f"{s} px" for s in args.sizes])
    speed_ax.set_ylabel("training samples/s (median, min–max)")
    speed_ax.set_yscale("log")
    speed_ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    speed_ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    speed_ax.set_title("Throughput")
    speed_ax.legend()
    part_colors = dict(zip(PARTS, ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#c7c7c7")))
    labels = [f"{r['contender']} {r['image_size']} px" for r in rows]
    left = [0.0] * len(rows)
    for part in PARTS:
        share = [r["split"][part] for r in rows]
        split_ax.barh(labels, share, left=left, color=part_colors[part], label=part.replace("_", " "))
        left = [a + b for a, b in zip(left, share)]
    split_ax.invert_yaxis()
    split_ax.set_xlim(0, 1)
    split_ax.set_xlabel("share of step time (median over rounds)")
    split_ax.set_title("Where a step's time goes")
    split_ax.legend(ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(BenchmarkArguments).parse_args_into_dataclasses(args=argv)
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown:
        raise ValueError(f"Unknown contenders {sorted(unknown)}; choose from {list(CONTENDERS)}.")
    import easy_vqa

    from mm_fusion import train_tokenizer

    rec = recipe()
    warmups = _per_size(args.warmup, DEFAULT_WARMUP, args.sizes, "warmup")
    steps = _per_size(args.steps, DEFAULT_STEPS, args.sizes, "steps")
    loss_samples = _per_size(args.loss_samples, DEFAULT_LOSS_SAMPLES, args.sizes, "loss_samples")
    loss_steps = {s: math.ceil(n / rec["batch_size"]) for s, n in loss_samples.items()}
    settings = {
        s: {"warmup": warmups[s], "steps": steps[s], "loss_samples": loss_steps[s] * rec["batch_size"]}
        for s in args.sizes
    }
    info = machine()

    work = tempfile.mkdtemp(prefix="mm_fusion_benchmark_step_")
    cache = os.path.join(work, "datasets_cache")
    tokenizer = train_tokenizer(easy_vqa.get_train_questions()[0], vocab_size=rec["vocab_size"])
    tokenizer_dir = os.path.join(work, "tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    labels = list(easy_vqa.get_answers())

    for size in args.sizes:  # before any trial: the models must be of one size
        counts = parameter_counts(size, len(tokenizer), labels, rec, args.patch_size)
        print(f"{size} px parameters: " + ", ".join(f"{c} {counts[c]:,}" for c in args.contenders), flush=True)
        difference = max(counts.values()) / min(counts.values()) - 1
        if difference > 0.1:
            raise ValueError(f"The contenders' parameter counts differ by {difference:.1%} at {size} px (limit 10%).")
    # Round-major, so that every round covers every size; within a round the contenders' order rotates.
    plan = []
    for r in range(args.rounds):
        order = args.contenders[r % len(args.contenders) :] + args.contenders[: r % len(args.contenders)]
        for size in args.sizes:
            for contender in order:
                plan.append((r, size, contender))
    print(f"{len(plan)} trials", flush=True)

    trials, start = [], time.perf_counter()
    try:
        for r, size, contender in plan:
            payload = {
                "contender": contender,
                "size": size,
                "round": r,
                "recipe": rec,
                "warmup": warmups[size],
                "steps": steps[size],
                "loss_steps": loss_steps[size] if r == 0 else 0,
                "eval_questions": args.eval_questions,
                "patch_size": args.patch_size,
                "tokenizer": tokenizer_dir,
                "labels": labels,
                "out": tempfile.mkdtemp(dir=work),
            }
            t = run_in_new_interpreter("benchmark_training_step:run_trial", payload, datasets_cache=cache)
            trials.append(t)
            elapsed = time.perf_counter() - start
            split = ", ".join(f"{p.replace('_', ' ')} {t['split'][p]:.0%}" for p in PARTS)
            loss = f", eval loss {t['eval_loss']:.3f}" if t.get("eval_loss") is not None else ""
            print(
                f"round {r + 1} {size:>3} px {contender:>9}: {t['samples_per_s']:7.1f} samples/s ({split}), "
                f"peak {t['peak_memory_mib']:.0f} MiB{loss}; {elapsed / 60:.1f} min so far",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows, speedups = summarise(trials, args)
    checks = parameter_check(trials)
    info["trial_torch_threads"] = sorted({t["torch_threads"] for t in trials})
    table = markdown(rows, speedups, checks, args, info, rec, settings)
    print("\n" + table)
    report = {"arguments": asdict(args), "recipe": rec, "settings": settings, "machine": info}
    report |= {"rows": rows, "speedups": speedups, "parameter_check": checks, "trials": trials}
    report["wall_s"] = time.perf_counter() - start
    write_report(args.output, report, table)
    plot(rows, args, args.output + ".png")
    return report


if __name__ == "__main__":
    main()
