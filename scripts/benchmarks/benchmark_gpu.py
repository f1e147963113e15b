"""
The GPU benchmark, in one call: mm_fusion's training throughput at a realistic size (224 px), in fp32 and bf16, with
the figures of its training monitor and the batch size its memory probe picks, against the run_clip-style recipe
(`baselines.py`; scripts/benchmarks/README.md, "The baselines"), on easy-VQA (VQA as classification, 13 answers).

Two models, both at 224 px: `vit_b16_bert_base`, a ViT-B/16-size vision tower and a BERT-base-size text tower (768
wide, 12 layers, 12 heads, intermediate 3072) built from configs by `scripts/train.py`'s size flags, with 2
hierarchical fusion layers; and `resnet_default`, what `scripts/train.py` builds with no model flags (the small ResNet
tower whose stages read the question). The vocabulary is that of a tokenizer trained on the easy-VQA questions. Per
model, each trial in a fresh process (its own CUDA context and peak memory):

- `mm_fusion`, fp32 and bf16: `mm_fusion.training.setup_run` and `trainer.train()` with the shipped loader defaults
  (the uint8 Arrow cache at 224 px, image-grouped batches, `dataloader_num_workers -1`: workers sized to the machine);
- `mm_fusion_auto_batch`, bf16: the same with `--auto_find_batch_size`, starting from `--probe_batch_size`; the
  per-device batch the memory probe settles on (`AgreedBatchSizeMixin`), then `--auto_steps` steps at it;
- `run_clip`: transformers' contrastive example's data path and the stock `Trainer`, training the same model, bf16 on
  a GPU as `run_clip_arguments` sets it (fp32 on a CPU), with as many loader workers as mm_fusion's default gives.

The figures are those the training monitor (`MMFusionMonitorCallback`, added to the stock Trainer too) logs every
`--log_every` optimizer steps: samples/s, the data-wait fraction, MFU (on a GPU whose peak FLOP/s it knows, against the
dense bf16 peak, from the model's own FLOP count: `floating_point_ops`, which counts a convolutional tower at each
convolution's output size, within 10% of torch's FlopCounterMode) and peak memory (the CUDA allocator's
peak; on a CPU the process's peak RSS). The first `--warmup_steps` steps are left out; the timed windows give median
(min–max).

    python scripts/benchmarks/benchmark_gpu.py   # one H100 / H200: 8 trials, estimated 3-5 min (budget: 8 min)
    python scripts/benchmarks/benchmark_gpu.py --tiny --warmup_steps 2 --timed_steps 2 --log_every 1 \\
        --batch_size 8 --probe_batch_size 16 --auto_steps 2   # the CPU check of its test: tiny towers, 32 px

Writes scripts/benchmarks/results/gpu.{json,md} (`--output`; the JSON after every trial as well) and prints the
Markdown table and the total wall time.
"""

import os
import shlex
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
from baselines import recipe, run_clip_arguments, run_clip_dataset
from benchmarking import RESULTS, TrialRunner, machine, median_range, spread, write_report
from transformers import HfArgumentParser


# The models, as `scripts/train.py` flags (ModelArguments fields): at full size, and the tiny towers of a CPU check.
MODELS = {
    "vit_b16_bert_base": {
        "vision_tower": "vit",
        "patch_size": 16,
        "hidden_size": 768,  # towers and fusion
        "num_attention_heads": 12,
        "vision_layers": 12,
        "text_layers": 12,
        "mlp_ratio": 4,  # intermediate 3072
        "fusion_type": "hierarchical",
        "fusion_layers": 2,
    },
    "resnet_default": {},  # scripts/train.py's own model
}
TINY_MODELS = {
    "vit_b16_bert_base": {
        **MODELS["vit_b16_bert_base"],
        "patch_size": 8,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "vision_layers": 2,
        "text_layers": 2,
    },
    "resnet_default": {},
}
# (contender, precision) per model; run_clip's precision is its own: bf16 on a GPU, as run_clip_arguments sets it.
CONTENDERS = (("mm_fusion", "fp32"), ("mm_fusion", "bf16"), ("mm_fusion_auto_batch", "bf16"), ("run_clip", None))


@dataclass
class GpuBenchmarkArguments:
    models: list[str] = field(default_factory=lambda: list(MODELS), metadata={"help": f"Of {list(MODELS)}."})
    tiny: bool = field(
        default=False,
        metadata={"help": "Tiny towers (ViT / BERT 32 wide, 2 layers, patch 8) and 32 px images: a quick CPU check."},
    )
    image_size: int | None = field(default=None, metadata={"help": "Image side (default 224; 32 with --tiny)."})
    batch_size: int | None = field(
        default=None, metadata={"help": "Per-device batch of every trial but the probe's (default: the recipe's, 64)."}
    )
    warmup_steps: int = field(default=20, metadata={"help": "Optimizer steps left out of the figures."})
    timed_steps: int = field(default=50, metadata={"help": "Optimizer steps measured after the warm-up."})
    log_every: int = field(
        default=10,
        metadata={"help": "The monitor's window (logging_steps); divides --warmup_steps and --timed_steps."},
    )
    probe_batch_size: int = field(
        default=1024,
        metadata={"help": "The per-device batch --auto_find_batch_size tries first (halved until a step fits)."},
    )
    auto_steps: int = field(
        default=10, metadata={"help": "Steps at the probed batch: the first half warm-up, the second half timed."}
    )
    max_train_samples: int | None = field(
        default=None,
        metadata={"help": "Training pairs cached (default: as many as the longest trial reads, so no epoch ends)."},
    )
    rounds: int = field(default=1, metadata={"help": "Rounds of every trial, the contenders' order rotated."})
    cpu_threads: int | None = field(default=None, metadata={"help": "torch threads of each trial on a CPU."})
    fresh_interpreter: bool = field(
        default=False,
        metadata={"help": "A new Python per trial (always on a GPU); else forked from a server that did the imports."},
    )
    output: str = field(default=str(RESULTS / "gpu"), metadata={"help": "Writes OUTPUT.json and OUTPUT.md."})

    def __post_init__(self):
        unknown = set(self.models) - set(MODELS)
        if unknown:
            raise ValueError(f"Unknown --models {sorted(unknown)}; choose from {list(MODELS)}.")
        for name in ("warmup_steps", "timed_steps"):
            if getattr(self, name) % self.log_every:
                raise ValueError(f"--{name} {getattr(self, name)} is not a multiple of --log_every {self.log_every}.")
        if self.timed_steps < self.log_every:
            raise ValueError("--timed_steps must hold at least one --log_every window.")
        if self.auto_steps < 2 or self.auto_steps % 2:
            raise ValueError(
                f"--auto_steps must be even and at least 2 (half warm-up, half timed), got {self.auto_steps}."
            )
        if self.image_size is None:
            self.image_size = 32 if self.tiny else 224


# --------------------------------------------------------------------------------------------------------------------
# A trial, in its own process: build the contender's trainer, train, and read the monitor's logs.


def mm_fusion_trainer(payload: dict):
    """`scripts/train.py`'s steps 1-4 for this trial (`setup_run`), with its command line."""
    from mm_fusion.training import setup_run

    argv = ["--output_dir", payload["out"], "--image_size", str(payload["image_size"])]
    argv += ["--tokenizer_name_or_path", payload["tokenizer"], "--max_train_samples", str(payload["train_samples"])]
    argv += ["--eval_split", "", "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none"]
    argv += ["--disable_tqdm", "True", "--max_steps", str(payload["steps"])]
    argv += ["--logging_steps", str(payload["log_every"]), "--per_device_train_batch_size", str(payload["batch_size"])]
    argv += ["--bf16", str(payload["precision"] == "bf16")]
    if payload["contender"] == "mm_fusion_auto_batch":
        argv += ["--auto_find_batch_size", "True"]
    if payload["cpu_threads"] is not None:
        argv += ["--cpu_threads", str(payload["cpu_threads"])]
    for key, value in payload["model_args"].items():
        argv += [f"--{key}", str(value)]
    return setup_run(argv), argv


def run_clip_trainer(payload: dict):
    """The run_clip-style recipe (`baselines.run_clip_dataset`, `run_clip_arguments`, the stock Trainer) on the same
    model, with the training monitor added."""
    from transformers import AutoTokenizer, Trainer, set_seed

    from mm_fusion import MMFusionForImageTextClassification
    from mm_fusion.data import load_easy_vqa
    from mm_fusion.training import ModelArguments, add_monitor, build_config

    rec, size = payload["recipe"], payload["image_size"]
    if payload["cpu_threads"] is not None and not torch.cuda.is_available():
        torch.set_num_threads(payload["cpu_threads"])
    set_seed(rec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(payload["tokenizer"])
    train = load_easy_vqa(["train"])["train"]
    train = train.select(range(min(payload["train_samples"], len(train))))  # the pairs mm_fusion's trials cache
    dataset, collate = run_clip_dataset(train, tokenizer, size, rec)
    model_args = ModelArguments(**payload["model_args"])
    config = build_config(model_args, size, len(tokenizer), rec["max_length"], payload["labels"])
    config.problem_type = "single_label_classification"
    model = MMFusionForImageTextClassification(config)
    workers = payload["loader_workers"]
    args = run_clip_arguments(
        rec,
        payload["out"],
        payload["steps"],
        logging_steps=payload["log_every"],
        dataloader_num_workers=workers,
        dataloader_persistent_workers=workers > 0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate)
    add_monitor(trainer)
    return trainer, None


def run_trial(payload: dict) -> dict:
    """One trial: train `steps` optimizer steps; the monitor's timed windows (after `warmup_steps`)."""
    began = time.perf_counter()
    if payload["contender"] == "run_clip":
        trainer, argv = run_clip_trainer(payload)
    else:
        trainer, argv = mm_fusion_trainer(payload)
    setup_s = time.perf_counter() - began
    output = trainer.train()
    args = trainer.args
    windows = [h for h in trainer.state.log_history if "samples_per_second" in h]
    timed = [h for h in windows if h["step"] > payload["warmup_steps"]]
    if not timed:
        raise RuntimeError(f"No monitor window after step {payload['warmup_steps']}: {trainer.state.log_history}")
    if args.bf16 != (payload["precision"] == "bf16"):
        raise RuntimeError(f"The trial was to train in {payload['precision']}, but bf16 is {args.bf16}.")
    command = None  # scripts/train.py's, without its --output_dir; TOKENIZER: the one trained on easy-VQA's questions
    if argv is not None:
        command = shlex.join(["scripts/train.py", *argv[2:]]).replace(payload["tokenizer"], "TOKENIZER")
    result = {
        "command": command,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "per_device_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "loader_workers": args.dataloader_num_workers,
        "samples_per_s": [h["samples_per_second"] for h in timed],
        "data_wait_fraction": [h["data_wait_fraction"] for h in timed],
        "mfu": [h["mfu"] for h in timed if "mfu" in h],
        "peak_memory_gb": max(h["peak_memory_gb"] for h in timed),
        "windows": [
            {k: h.get(k) for k in ("step", "samples_per_second", "data_wait_fraction", "mfu")} for h in windows
        ],
        "steps": trainer.state.global_step,
        "setup_s": setup_s,
        "train_s": output.metrics["train_runtime"],
        "torch_threads": torch.get_num_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if payload["contender"] == "mm_fusion_auto_batch":
        result["picked_batch_size"] = args.per_device_train_batch_size  # what the ranks agreed on (one rank here)
        result["probe_found"] = trainer.agreed_batch_sizes  # each rank's largest batch that fitted
    return result


# --------------------------------------------------------------------------------------------------------------------
# The run: trials in fresh processes, then the rows, the ratios and the report.


def shipped_loader_workers() -> int:
    """The DataLoader workers mm_fusion's default (`dataloader_num_workers -1`) gives on this machine."""
    from mm_fusion.training import MMFusionTrainingArguments

    return MMFusionTrainingArguments(output_dir=tempfile.gettempdir(), report_to="none").dataloader_num_workers


def plan_trials(args: GpuBenchmarkArguments, common: dict) -> list[dict]:
    """Every (round, model, contender) trial; within a round and model the contenders' order rotates."""
    models = TINY_MODELS if args.tiny else MODELS
    run_clip_precision = "bf16" if torch.cuda.is_available() else "fp32"  # run_clip_arguments' bf16
    plan = []
    for r in range(args.rounds):
        order = CONTENDERS[r % len(CONTENDERS) :] + CONTENDERS[: r % len(CONTENDERS)]
        for model in args.models:
            for contender, precision in order:
                auto = contender == "mm_fusion_auto_batch"
                plan.append(
                    {
                        **common,
                        "round": r,
                        "model": model,
                        "model_args": models[model],
                        "contender": contender,
                        "precision": precision or run_clip_precision,
                        "batch_size": args.probe_batch_size if auto else common["batch_size"],
                        "steps": args.auto_steps if auto else args.warmup_steps + args.timed_steps,
                        "warmup_steps": args.auto_steps // 2 if auto else args.warmup_steps,
                        "log_every": args.auto_steps // 2 if auto else args.log_every,
                    }
                )
    return plan


def summarise(trials: list[dict], plan: list[dict]) -> tuple[list[dict], list[dict]]:
    """A row per (model, contender, precision) over its rounds, and per model the ratios between rows."""
    rows = []
    for key in dict.fromkeys((p["model"], p["contender"], p["precision"]) for p in plan):
        model, contender, precision = key
        mine = [t for t in trials if (t["model"], t["contender"], t["precision"]) == key]
        done = [t for t in mine if "error" not in t]
        row = {"model": model, "contender": contender, "precision": precision, "trials": len(mine)}
        row["errors"] = [t["error"] for t in mine if "error" in t]
        if done:
            first = done[0]
            mfu = [v for t in done for v in t["mfu"]]
            row |= {
                "parameters": first["parameters"],
                "per_device_batch_size": first["per_device_batch_size"],
                "gradient_accumulation_steps": first["gradient_accumulation_steps"],
                "loader_workers": first["loader_workers"],
                "samples_per_s": spread([v for t in done for v in t["samples_per_s"]]),
                "data_wait_fraction": spread([v for t in done for v in t["data_wait_fraction"]]),
                "mfu": spread(mfu) if mfu else None,
                "peak_memory_gb": max(t["peak_memory_gb"] for t in done),
                "timed_windows": sum(len(t["samples_per_s"]) for t in done),
            }
            if contender == "mm_fusion_auto_batch":
                row["probe_start_batch_size"] = first["batch_size"]
                row["picked_batch_size"] = min(t["picked_batch_size"] for t in done)
                row["probe_found"] = first["probe_found"]
        rows.append(row)

    def median(model, contender, precision):
        row = next(r for r in rows if (r["model"], r["contender"], r["precision"]) == (model, contender, precision))
        return row["samples_per_s"]["median"] if "samples_per_s" in row else None

    ratios = []
    for model in dict.fromkeys(p["model"] for p in plan):
        fp32, bf16 = median(model, "mm_fusion", "fp32"), median(model, "mm_fusion", "bf16")
        clip_precision = next(p["precision"] for p in plan if p["model"] == model and p["contender"] == "run_clip")
        clip, ours = median(model, "run_clip", clip_precision), median(model, "mm_fusion", clip_precision)
        ours_sizes = {
            r["parameters"] for r in rows if r["model"] == model and r["contender"] != "run_clip" and "parameters" in r
        }
        clip_size = next(r.get("parameters") for r in rows if r["model"] == model and r["contender"] == "run_clip")
        ratios.append(
            {
                "model": model,
                "bf16_over_fp32": bf16 / fp32 if bf16 and fp32 else None,
                "run_clip_precision": clip_precision,
                "mm_fusion_over_run_clip": ours / clip if ours and clip else None,
                "same_model_as_run_clip": ours_sizes == {clip_size} if ours_sizes and clip_size else None,
            }
        )
    return rows, ratios


def _last_line(error: str) -> str:
    """The last line of a failed trial's traceback (its exception)."""
    return (error.strip().splitlines() or ["failed"])[-1]


def _cell(stat: dict | None, fmt: str) -> str:
    """A spread as median (min–max) in `fmt`; "-" for None."""
    if stat is None:
        return "-"
    low, mid, high = (format(stat[k], fmt) for k in ("min", "median", "max"))
    return mid if low == high else f"{mid} ({low}–{high})"


def markdown(rows: list[dict], ratios: list[dict], args: GpuBenchmarkArguments, info: dict, settings: dict) -> str:
    device = f"GPU {info['gpu']}" if info["gpu"] else "no GPU (CPU)"
    memory = "`torch.cuda.max_memory_allocated`" if info["gpu"] else "the process's peak RSS"
    lines = [
        f"# GPU benchmark: training throughput at {args.image_size} px" + (" (tiny towers)" if args.tiny else ""),
        "",
        f"easy-VQA (VQA as classification, 13 answers), {settings['train_samples']} training pairs cached; {device}, "
        f"{info['cores']} cores ({info['cpu']}), torch {info['torch']}, transformers {info['transformers']}. Each "
        f"trial in a fresh process, {args.rounds} round(s); {args.warmup_steps} warm-up + {args.timed_steps} timed "
        f"optimizer steps (the probe's trial: {args.auto_steps // 2} + {args.auto_steps // 2} at the batch it picks, "
        f"from {args.probe_batch_size}). Figures from the training monitor's logs every {args.log_every} steps "
        "(`MMFusionMonitorCallback`), median (min–max) over the timed windows: samples/s, data-wait fraction, MFU "
        "(against the GPU's dense bf16 peak, '-' where none is known; from the model's FLOP count, "
        f"`floating_point_ops`), peak memory ({memory}). mm_fusion: `setup_run` with the shipped "
        f"loader defaults ({settings['loader_workers']} loader workers here); run_clip: "
        "`baselines.py`'s data path and the stock Trainer with the same workers, bf16 on a GPU.",
        "",
        "| model | contender | precision | batch | parameters | samples/s | data wait | MFU | peak memory (GiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['contender']} | {r['precision']} |"
        if "samples_per_s" not in r:
            lines.append(f"{head} failed: {_last_line(r['errors'][0])[:200]} | | | | | |")
            continue
        batch = f"{r['per_device_batch_size']}"
        if r["gradient_accumulation_steps"] > 1:
            batch += f" x {r['gradient_accumulation_steps']}"
        if r["contender"] == "mm_fusion_auto_batch":
            batch += f" (probe from {r['probe_start_batch_size']})"
        lines.append(
            f"{head} {batch} | {r['parameters'] / 1e6:.1f}M | {median_range(r['samples_per_s'], 1)} "
            f"| {_cell(r['data_wait_fraction'], '.1%')} | {_cell(r['mfu'], '.1%')} | {r['peak_memory_gb']:.2f} |"
        )
    lines += ["", "| model | bf16 / fp32 (mm_fusion) | mm_fusion / run_clip (same precision) | the probe picks |"]
    lines.append("|---|---|---|---|")
    for q in ratios:
        probe = next(r for r in rows if r["model"] == q["model"] and r["contender"] == "mm_fusion_auto_batch")
        picked = f"{probe['picked_batch_size']} per device" if "picked_batch_size" in probe else "-"
        speedup = f"{q['bf16_over_fp32']:.2f}x" if q["bf16_over_fp32"] else "-"
        versus = (
            f"{q['mm_fusion_over_run_clip']:.2f}x ({q['run_clip_precision']})" if q["mm_fusion_over_run_clip"] else "-"
        )
        if q["same_model_as_run_clip"] is False:
            versus += " (NOT the same parameter count)"
        lines.append(f"| {q['model']} | {speedup} | {versus} | {picked} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(GpuBenchmarkArguments).parse_args_into_dataclasses(args=argv)
    start = time.perf_counter()
    import easy_vqa

    from mm_fusion import train_tokenizer

    rec, info = recipe(), machine()
    batch_size = args.batch_size or rec["batch_size"]
    rec["batch_size"] = batch_size  # run_clip's too
    longest = max((args.warmup_steps + args.timed_steps) * batch_size, args.auto_steps * args.probe_batch_size)
    settings = {
        "train_samples": args.max_train_samples or min(longest, len(easy_vqa.get_train_questions()[0])),
        "loader_workers": shipped_loader_workers(),
    }
    work = tempfile.mkdtemp(prefix="mm_fusion_benchmark_gpu_")
    cache = os.path.join(work, "datasets_cache")  # shared by the trials: easy-VQA and its 224 px cache built once
    os.makedirs(cache)
    tokenizer = train_tokenizer(easy_vqa.get_train_questions()[0], vocab_size=rec["vocab_size"])
    tokenizer_dir = os.path.join(work, "tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    common = {
        "recipe": rec,
        "image_size": args.image_size,
        "batch_size": batch_size,
        "tokenizer": tokenizer_dir,
        "labels": list(easy_vqa.get_answers()),
        "train_samples": settings["train_samples"],
        "loader_workers": settings["loader_workers"],
        "cpu_threads": args.cpu_threads,
    }
    plan = plan_trials(args, common)
    print(f"{len(plan)} trials; vocabulary {len(tokenizer)}; {settings}", flush=True)
    # A child forked after CUDA was initialised cannot use it, and the server's imports might initialise it: on a GPU
    # every trial is a new interpreter (seconds more each).
    fresh = args.fresh_interpreter or torch.cuda.is_available()
    runner = TrialRunner(work, cache, ["transformers", "mm_fusion", "mm_fusion.training", "benchmark_gpu"], fresh)
    report = {"arguments": asdict(args), "recipe": rec, "settings": settings, "machine": info, "trials": []}
    try:
        for payload in plan:
            payload = {**payload, "out": tempfile.mkdtemp(dir=work)}
            began = time.perf_counter()
            try:
                t = runner.run("benchmark_gpu:run_trial", payload)
            except RuntimeError as err:  # one failed trial (out of memory, say) leaves the others' figures
                t = {"error": str(err)[-2000:]}
            shutil.rmtree(payload["out"], ignore_errors=True)
            keys = ("round", "model", "contender", "precision", "batch_size")
            t = {**{k: payload[k] for k in keys}, **t, "trial_wall_s": time.perf_counter() - began}
            report["trials"].append(t)
            write_report(args.output, report)  # what is measured so far survives a run cut short
            what = _last_line(t["error"]) if "error" in t else (
                f"{statistics.median(t['samples_per_s']):8.1f} samples/s, data wait "
                f"{statistics.median(t['data_wait_fraction']):.1%}, peak {t['peak_memory_gb']:.2f} GiB"
                + (f", probe picked {t['picked_batch_size']}" if "picked_batch_size" in t else "")
            )  # fmt: skip
            print(
                f"round {t['round'] + 1} {t['model']} {t['contender']} {t['precision']}: {what} "
                f"({t['trial_wall_s']:.0f} s; {(time.perf_counter() - start) / 60:.1f} min so far)",
                flush=True,
            )
    finally:
        runner.close()
        shutil.rmtree(work, ignore_errors=True)

    rows, ratios = summarise(report["trials"], plan)
    info["trial_torch_threads"] = sorted({t["torch_threads"] for t in report["trials"] if "torch_threads" in t})
    report |= {"rows": rows, "ratios": ratios, "wall_s": time.perf_counter() - start}
    text = markdown(rows, ratios, args, info, settings)
    text += f"\n\nTotal wall time: {report['wall_s'] / 60:.1f} min."
    print("\n" + text, flush=True)
    write_report(args.output, report, text)
    return report


if __name__ == "__main__":
    main()
