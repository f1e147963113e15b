"""
How the training cost of mm_fusion grows with the work, in three tables, each from one run on one machine:

1. training samples/s, step split and peak memory of the default model (`scripts/train.py` with no arguments) on
   synthetic batches, as the image size (64 / 128 / 224 px) and the text length (16 / 64 / 256 tokens) grow;
2. preprocessing images/s of `prepare_dataset` on all of easy-VQA with `num_proc` 1 and 2, from an empty datasets
   cache;
3. one fusion block with SDPA attention against the same block built on `nn.MultiheadAttention`: time and peak
   memory growth of forward + backward at 64 / 128 / 512 text tokens.

Every trial runs in a fresh process (training and attention trials forked from a server that did the imports once,
preprocessing trials in new interpreters), `--rounds` interleaved rounds, medians with min-max. Method: README.md;
results: RESULTS.md (both in scripts/benchmarks).

    python scripts/benchmarks/benchmark_costs.py   # the full run: 48 trials, about 8 minutes on 2 cores
    python scripts/benchmarks/benchmark_costs.py --rounds 1 --image_sizes 64 --text_lengths 16 --steps 3 \
        --num_proc 1 --attention_lengths 64 --iterations 3   # a quick look, under a minute

Writes scripts/benchmarks/results/benchmark_costs.{json,md} and prints the Markdown tables.
"""

import gc
import os
import resource
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from baselines import SeedFusionLayer, build_fusion_config, recipe, tower_shapes
from benchmarking import (
    RESULTS,
    PeakMemory,
    TrialRunner,
    machine,
    median_range,
    peak_memory_mib,
    run_in_new_interpreter,
    spread,
    write_report,
)
from transformers import HfArgumentParser


TABLES = ("training", "preprocessing", "attention")
ATTENTION_CONTENDERS = ("sdpa", "eager", "multihead_attention", "sdpa_shared")
IMAGES_PER_STEP = 7  # easy-VQA batches of 64 questions grouped by image carry ~7 images
STEP_PARTS = ("forward", "backward", "optimizer")
PREPROCESSING_IMAGE_SIZE = 64
ATTENTION_IMAGE_SIZE = 64  # the default image: 64 patches + class token
# The default numbers of timed repeats: 10, fewer for the settings whose steps / iterations are slowest; --steps and
# --iterations set them for every setting.
DEFAULT_STEPS = {(64, 16): 10, (128, 16): 10, (224, 16): 6, (64, 64): 10, (64, 256): 5}  # (image px, text tokens)
DEFAULT_ITERATIONS = {64: 10, 128: 10, 512: 5}  # by text length, the same for every block
DEFAULT_REPEATS = 10  # for a setting not listed above


@dataclass
class BenchmarkArguments:
    tables: list[str] = field(default_factory=lambda: list(TABLES), metadata={"help": "Tables to measure."})
    rounds: int = field(default=3, metadata={"help": "Interleaved rounds (one trial per setting of each table)."})
    # Table 1.
    image_sizes: list[int] = field(
        default_factory=lambda: [64, 128, 224], metadata={"help": "Training: image sizes (at --base_text_length)."}
    )
    text_lengths: list[int] = field(
        default_factory=lambda: [16, 64, 256],
        metadata={"help": "Training: text lengths in tokens (at --base_image_size)."},
    )
    base_text_length: int = field(default=16, metadata={"help": "Training: text length of the image-size sweep."})
    base_image_size: int = field(default=64, metadata={"help": "Training: image size of the text-length sweep."})
    texts_per_step: int = field(default=64, metadata={"help": "Training: texts (samples) per optimizer step."})
    images_per_step: int = field(
        default=IMAGES_PER_STEP, metadata={"help": "Training: distinct images per step, shared via image_index."}
    )
    warmup: int = field(default=2, metadata={"help": "Training: untimed optimizer steps per trial."})
    steps: int | None = field(
        default=None,
        metadata={
            "help": "Training: timed optimizer steps per trial (default: 10; 6 at 224 px and 16 tokens, 5 at 64 px "
            "and 256 tokens)."
        },
    )
    # Table 2.
    num_proc: list[int] = field(default_factory=lambda: [1, 2], metadata={"help": "Preprocessing: num_proc values."})
    # Table 3.
    attention_lengths: list[int] = field(
        default_factory=lambda: [64, 128, 512], metadata={"help": "Attention: text lengths in tokens."}
    )
    attention_contenders: list[str] = field(
        default_factory=lambda: ["sdpa", "eager", "multihead_attention"],
        metadata={"help": f"Attention: blocks to compare, from {', '.join(ATTENTION_CONTENDERS)}."},
    )
    attention_texts: int = field(default=64, metadata={"help": "Attention: texts per batch."})
    attention_warmup: int = field(default=1, metadata={"help": "Attention: untimed iterations per trial."})
    iterations: int | None = field(
        default=None,
        metadata={
            "help": "Attention: timed forward + backward iterations per trial, the same for every block (default: 10; "
            "5 at 512 tokens)."
        },
    )
    seed: int = field(default=0, metadata={"help": "Seed of the synthetic inputs and of the models' weights."})
    fresh_interpreter: bool = field(
        default=False,
        metadata={
            "help": "Start every training / attention trial as a new Python interpreter (~5-8 s more per trial "
            "here) instead of forking it from a server that has imported torch, transformers and mm_fusion once."
        },
    )
    output: str = field(
        default=str(RESULTS / "benchmark_costs"), metadata={"help": "Writes OUTPUT.json and OUTPUT.md."}
    )


def training_settings(args: BenchmarkArguments) -> list[tuple[int, int]]:
    """(image size, text length) pairs: the image-size sweep, then the text-length sweep (the shared one once)."""
    settings = [(size, args.base_text_length) for size in args.image_sizes]
    settings += [(args.base_image_size, length) for length in args.text_lengths]
    return list(dict.fromkeys(settings))


def _rotated(items: list, r: int) -> list:
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --------------------------------------------------------------------------------------------------------------------
# Table 1: training steps of the default model.


def training_batch(
    texts: int, images: int, image_size: int, length: int, vocab_size: int, num_labels: int, seed: int
) -> dict[str, torch.Tensor]:
    """A synthetic batch shaped like training's: `texts` texts of `length` ids sharing `images` uint8 images."""
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randint(0, 256, (images, 3, image_size, image_size), generator=g, dtype=torch.uint8),
        "input_ids": torch.randint(0, vocab_size, (texts, length), generator=g),
        "attention_mask": torch.ones(texts, length, dtype=torch.long),
        "image_index": torch.arange(texts) * images // texts,  # consecutive texts share an image, as when grouped
        "labels": torch.randint(0, num_labels, (texts,), generator=g),
    }


def run_training_trial(payload: dict) -> dict:
    """One setting of table 1 in this process: `warmup` + `steps` optimizer steps of the default model."""
    from transformers import set_seed

    from mm_fusion import MMFusionForImageTextClassification

    rec, size, length = payload["recipe"], payload["image_size"], payload["text_length"]
    set_seed(payload["seed"])
    device = _device()
    config = build_fusion_config(size, payload["vocab_size"], max(rec["max_length"], length), payload["labels"], None)
    config.problem_type = "single_label_classification"  # as scripts/train.py sets it
    model = MMFusionForImageTextClassification(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=rec["learning_rate"], weight_decay=rec["weight_decay"])
    texts, images, vocab_size = payload["texts"], payload["images"], payload["vocab_size"]
    batch = training_batch(texts, images, size, length, vocab_size, len(payload["labels"]), payload["seed"])
    batch = {k: v.to(device) for k, v in batch.items()}
    steps = []
    for _ in range(payload["warmup"] + payload["steps"]):
        _sync()
        start = time.perf_counter()
        loss = model(**batch).loss
        _sync()
        forward = time.perf_counter()
        loss.backward()
        _sync()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync()
        end = time.perf_counter()
        steps.append({"forward": forward - start, "backward": backward - forward, "optimizer": end - backward})
    peak = peak_memory_mib()
    timed = steps[payload["warmup"] :]
    totals = [sum(s.values()) for s in timed]
    median_step = statistics.median(totals)
    vision = config.vision_config
    return {
        "image_size": size,
        "text_length": length,
        "round": payload["round"],
        "warmup_steps": payload["warmup"],
        "timed_steps": payload["steps"],
        "patches": (size // vision.patch_size) ** 2,
        "image_tokens": (size // vision.patch_size) ** 2 + 1,
        "parameters": sum(p.numel() for p in model.parameters()),
        "attn_implementation": config._attn_implementation,
        "model": {
            "fusion_type": config.fusion_type,
            "fusion_direction": config.fusion_direction,
            **tower_shapes(config),
        },
        "torch_threads": torch.get_num_threads(),
        "step_s": [sum(s.values()) for s in steps],
        "median_step_s": median_step,
        "samples_per_s": texts / median_step,
        "split": {p: sum(s[p] for s in timed) / sum(totals) for p in STEP_PARTS},
        "peak_memory_mib": peak,
        "final_loss": float(loss.detach()),
        "labels": payload["labels"],
    }


# --------------------------------------------------------------------------------------------------------------------
# Table 2: preprocessing.


def run_preprocessing_trial(payload: dict) -> dict:
    """One `prepare_dataset` call on all of easy-VQA in this process, whose datasets cache starts empty."""
    from transformers import AutoTokenizer

    from mm_fusion.data import load_easy_vqa, prepare_dataset

    cache = os.environ["HF_DATASETS_CACHE"]
    empty = not any(Path(cache).iterdir())
    tokenizer = AutoTokenizer.from_pretrained(payload["tokenizer"])
    start = time.perf_counter()
    data = load_easy_vqa()
    loaded = time.perf_counter()
    prepared = prepare_dataset(
        data,
        tokenizer,
        image_column="image",
        text_column="question",
        id_column="id",
        label_column="answer",
        image_size=payload["image_size"],
        max_length=payload["max_length"],
        on_bad_sample=payload["on_bad_sample"],
        num_proc=payload["num_proc"],
    )
    prepare_s = time.perf_counter() - loaded
    images, pairs = len(prepared.images), sum(len(p) for p in prepared.pairs.values())
    return {
        "num_proc": payload["num_proc"],
        "round": payload["round"],
        "image_size": payload["image_size"],
        "cache_was_empty": empty,
        "load_s": loaded - start,
        "prepare_s": prepare_s,
        "images": images,
        "pairs": pairs,
        "images_per_s": images / prepare_s,
        "pairs_per_s": pairs / prepare_s,
        "peak_memory_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# --------------------------------------------------------------------------------------------------------------------
# Table 3: one fusion block, SDPA against nn.MultiheadAttention.


def attention_block(contender: str, config) -> torch.nn.Module:
    """The text stream block of the default model's first fusion layer, or the seed-style equivalent."""
    from mm_fusion import MMFusionForImageTextClassification

    if contender == "multihead_attention":
        return SeedFusionLayer(
            config.fusion_hidden_size,
            config.fusion_num_attention_heads,
            config.fusion_intermediate_size,
            config.fusion_dropout,
        )
    if contender == "eager":
        model = MMFusionForImageTextClassification._from_config(config, attn_implementation="eager")
    else:  # the model as built for training: it picks sdpa
        model = MMFusionForImageTextClassification(config)
    return model.mm_fusion.encoder.layers[0].text_block


def block_parameters(config) -> dict[str, int]:
    """Parameters of our fusion block and of the seed-style one."""
    ours = attention_block("sdpa", config)
    seed = attention_block("multihead_attention", config)
    return {"mm_fusion": sum(p.numel() for p in ours.parameters()), "seed": sum(p.numel() for p in seed.parameters())}


def run_attention_trial(payload: dict) -> dict:
    """One (contender, text length) of table 3 in this process: forward + backward of one fusion block."""
    torch.manual_seed(payload["seed"])
    device = _device()
    contender, length, texts = payload["contender"], payload["text_length"], payload["texts"]
    config = build_fusion_config(ATTENTION_IMAGE_SIZE, payload["vocab_size"], 64, payload["labels"], None)
    block = attention_block(contender, config).to(device).train()
    gc.collect()
    hidden = config.fusion_hidden_size
    image_tokens = (ATTENTION_IMAGE_SIZE // config.vision_config.patch_size) ** 2 + 1
    shared = contender == "sdpa_shared"
    images = IMAGES_PER_STEP if shared else texts
    g = torch.Generator().manual_seed(payload["seed"])
    text = torch.randn(texts, length, hidden, generator=g).to(device).requires_grad_()
    image = torch.randn(images, image_tokens, hidden, generator=g).to(device).requires_grad_()
    mask = torch.ones(texts, length, dtype=torch.long, device=device)
    image_index = (torch.arange(texts) * images // texts).to(device) if shared else None

    def forward() -> torch.Tensor:
        if contender == "multihead_attention":
            return block(text, image, mask == 0)
        return block(text, image, mask, None, context_index=image_index)[0]

    times, first_growth = [], None
    with PeakMemory() as memory:
        for i in range(payload["warmup"] + payload["iterations"]):
            _sync()
            start = time.perf_counter()
            loss = forward().pow(2).mean()
            _sync()
            middle = time.perf_counter()
            loss.backward()
            block.zero_grad(set_to_none=True)
            text.grad = image.grad = None
            _sync()
            times.append((middle - start, time.perf_counter() - middle))
            if i == 0:
                first_growth = memory.growth_mib()
        growth = memory.growth_mib()
    timed = times[payload["warmup"] :]
    return {
        "contender": contender,
        "text_length": length,
        "round": payload["round"],
        "texts": texts,
        "images": images,
        "image_tokens": image_tokens,
        "warmup_iterations": payload["warmup"],
        "timed_iterations": payload["iterations"],
        "hidden_size": hidden,
        "heads": config.fusion_num_attention_heads,
        "attn_implementation": getattr(getattr(block.self_attn, "config", None), "_attn_implementation", None),
        "parameters": sum(p.numel() for p in block.parameters()),
        "torch_threads": torch.get_num_threads(),
        "median_s": statistics.median(f + b for f, b in timed),
        "forward_s": statistics.median(f for f, _ in timed),
        "backward_s": statistics.median(b for _, b in timed),
        "iteration_s": [f + b for f, b in times],
        "memory_growth_mib": growth,
        "first_iteration_memory_growth_mib": first_growth,
        "memory_baseline_mib": memory.baseline_mib,
        "memory_method": memory.method,
    }


# --------------------------------------------------------------------------------------------------------------------
# The run.


def run_trial(runner: TrialRunner, payload: dict, work: str) -> dict:
    """One trial in a fresh process: forked by `runner`, or for preprocessing in a new interpreter whose datasets
    cache starts empty (`HF_DATASETS_CACHE` must be set before `datasets` is imported)."""
    target = f"benchmark_costs:run_{payload['table']}_trial"
    if payload["table"] != "preprocessing":
        return runner.run(target, payload)
    cache = tempfile.mkdtemp(dir=work)
    try:
        return run_in_new_interpreter(target, payload, datasets_cache=cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def plan_trials(args: BenchmarkArguments, rec: dict, vocab_size: int, labels: list[str], tokenizer_dir: str):
    """Round by round, every table and setting, the order of each table's settings rotating from round to round."""
    common = {"vocab_size": vocab_size, "labels": labels, "seed": args.seed}
    steps = {
        setting: args.steps if args.steps is not None else DEFAULT_STEPS.get(setting, DEFAULT_REPEATS)
        for setting in training_settings(args)
    }
    iterations = {
        length: args.iterations if args.iterations is not None else DEFAULT_ITERATIONS.get(length, DEFAULT_REPEATS)
        for length in args.attention_lengths
    }
    plan = []
    for r in range(args.rounds):
        if "training" in args.tables:
            for size, length in _rotated(training_settings(args), r):
                plan.append(
                    {
                        "table": "training",
                        "round": r,
                        "image_size": size,
                        "text_length": length,
                        "texts": args.texts_per_step,
                        "images": args.images_per_step,
                        "warmup": args.warmup,
                        "steps": steps[(size, length)],
                        "recipe": rec,
                        **common,
                    }
                )
        if "preprocessing" in args.tables:
            for num_proc in _rotated(list(args.num_proc), r):
                plan.append(
                    {
                        "table": "preprocessing",
                        "round": r,
                        "num_proc": num_proc,
                        "image_size": PREPROCESSING_IMAGE_SIZE,
                        "max_length": rec["max_length"],
                        "on_bad_sample": "skip",
                        "tokenizer": tokenizer_dir,
                    }
                )
        if "attention" in args.tables:
            settings = [(c, t) for t in args.attention_lengths for c in args.attention_contenders]
            for contender, length in _rotated(settings, r):
                plan.append(
                    {
                        "table": "attention",
                        "round": r,
                        "contender": contender,
                        "text_length": length,
                        "texts": args.attention_texts,
                        "warmup": args.attention_warmup,
                        "iterations": iterations[length],
                        **common,
                    }
                )
    return plan


def summarise(trials: list[dict], args: BenchmarkArguments) -> dict:
    tables = {}
    training = [t for t in trials if t["table"] == "training"]
    if training:
        rows = []
        settings = training_settings(args)
        base = [t for t in training if (t["image_size"], t["text_length"]) == settings[0]]
        base_step = statistics.median(t["median_step_s"] for t in base)
        for size, length in settings:
            mine = [t for t in training if t["image_size"] == size and t["text_length"] == length]
            step = statistics.median(t["median_step_s"] for t in mine)
            rows.append(
                {
                    "image_size": size,
                    "text_length": length,
                    "patches": mine[0]["patches"],
                    "text_tokens_per_step": args.texts_per_step * length,
                    "image_tokens_per_step": args.images_per_step * mine[0]["image_tokens"],
                    "parameters": mine[0]["parameters"],
                    "timed_steps": mine[0]["timed_steps"],
                    "samples_per_s": spread([t["samples_per_s"] for t in mine]),
                    "step_ms": spread([1000 * t["median_step_s"] for t in mine]),
                    "relative_step_time": step / base_step,
                    "split": {p: statistics.median(t["split"][p] for t in mine) for p in STEP_PARTS},
                    "peak_memory_mib": spread([t["peak_memory_mib"] for t in mine]),
                }
            )
        tables["training"] = rows
        tables["training_model"], tables["training_labels"] = training[0]["model"], training[0]["labels"]
    preprocessing = [t for t in trials if t["table"] == "preprocessing"]
    if preprocessing:
        rows = []
        for num_proc in args.num_proc:
            mine = [t for t in preprocessing if t["num_proc"] == num_proc]
            rows.append(
                {
                    "num_proc": num_proc,
                    "images": mine[0]["images"],
                    "pairs": mine[0]["pairs"],
                    "images_per_s": spread([t["images_per_s"] for t in mine]),
                    "pairs_per_s": spread([t["pairs_per_s"] for t in mine]),
                    "prepare_s": spread([t["prepare_s"] for t in mine]),
                    "load_s": spread([t["load_s"] for t in mine]),
                    "peak_memory_mib": spread([t["peak_memory_mib"] for t in mine]),
                    "cache_was_empty": all(t["cache_was_empty"] for t in mine),
                }
            )
        tables["preprocessing"] = rows
    attention = [t for t in trials if t["table"] == "attention"]
    if attention:
        rows = []
        for length in args.attention_lengths:
            reference = [t["median_s"] for t in attention if t["text_length"] == length and t["contender"] == "sdpa"]
            for contender in args.attention_contenders:
                mine = [t for t in attention if t["text_length"] == length and t["contender"] == contender]
                median = statistics.median(t["median_s"] for t in mine)
                rows.append(
                    {
                        "text_length": length,
                        "contender": contender,
                        "parameters": mine[0]["parameters"],
                        "images": mine[0]["images"],
                        "timed_iterations": mine[0]["timed_iterations"],
                        "forward_backward_ms": spread([1000 * t["median_s"] for t in mine]),
                        "forward_ms": spread([1000 * t["forward_s"] for t in mine]),
                        "backward_ms": spread([1000 * t["backward_s"] for t in mine]),
                        "memory_growth_mib": spread([t["memory_growth_mib"] for t in mine]),
                        "first_iteration_memory_growth_mib": spread(
                            [t["first_iteration_memory_growth_mib"] for t in mine]
                        ),
                        "time_vs_sdpa": median / statistics.median(reference) if reference else None,
                        "memory_method": sorted({t["memory_method"] for t in mine}),
                        "hidden_size": mine[0]["hidden_size"],
                        "heads": mine[0]["heads"],
                    }
                )
        tables["attention"] = rows
    return tables


CONTENDER_NAMES = {
    "sdpa": "mm_fusion block, sdpa (as it runs)",
    "eager": "mm_fusion block, eager",
    "multihead_attention": "nn.MultiheadAttention block (seed style)",
    "sdpa_shared": "mm_fusion block, sdpa, 7 shared images",
}


def markdown(tables: dict, args: BenchmarkArguments, info: dict, rec: dict, vocab_size: int, blocks: dict) -> str:
    device = f"GPU {info['gpu']}" if info["gpu"] else "no GPU"
    threads = "/".join(map(str, info["trial_torch_threads"])) or "–"
    processes = (
        "a new interpreter each"
        if args.fresh_interpreter
        else "training and attention trials forked from a server that did the imports once, preprocessing trials "
        "new interpreters"
    )
    lines = [
        f"Machine: {info['cores']} cores ({info['cpu']}), {device}, torch {info['torch']}, transformers "
        f"{info['transformers']}; torch threads in the trials (their default): {threads}. Every trial in a fresh "
        f"process ({processes}); {args.rounds} interleaved rounds; medians (min–max over rounds).",
    ]
    if "training" in tables:
        memory = (
            "peak `torch.cuda.max_memory_allocated`"
            if info["gpu"]
            else "peak RSS of the trial process"
            + (" (a new interpreter)" if args.fresh_interpreter else " (forked from the import server)")
        )
        rows = tables["training"]
        model, labels = tables["training_model"], tables["training_labels"]
        v, t = model["vision"], model["text"]
        lines += [
            "",
            f"**1. Training cost of the default model** (`scripts/train.py` with no arguments: {model['fusion_type']} "
            f"fusion ({model['fusion_direction']}), hidden {v['hidden_size']}, {v['num_attention_heads']} heads, "
            f"{v['num_hidden_layers']} vision + {t['num_hidden_layers']} text + {model['fusion_layers']} fusion "
            f"layers, patch {v['patch_size']}, vocabulary {vocab_size} (the tokenizer trained on the easy-VQA "
            f"questions), {len(labels)} answers, {rows[0]['parameters'] / 1e6:.2f}M parameters at "
            f"{rows[0]['image_size']} px; fp32). One optimizer step = forward with "
            f"labels + backward + `torch.optim.AdamW` step (lr {rec['learning_rate']:g}, weight decay "
            f"{rec['weight_decay']:g}) + `zero_grad`, on synthetic batches of {args.texts_per_step} texts of exactly "
            f"L tokens (all-ones mask) sharing {args.images_per_step} uint8 images through `image_index`; "
            f"{args.warmup} warm-up + the timed steps of the table per trial; samples/s = {args.texts_per_step} / "
            f"median step time; memory: {memory}. Image-size sweep at {args.base_text_length} tokens, text-length "
            f"sweep at {args.base_image_size} px; image tokens are the patches + 1 class token.",
            "",
            "| image px | patches | text tokens | tokens per step (text + image) | timed steps | samples/s "
            "| step (ms) | step time vs first row | forward / backward / optimizer | peak memory (MiB) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            split = " / ".join(f"{r['split'][p]:.0%}" for p in STEP_PARTS)
            lines.append(
                f"| {r['image_size']} | {r['patches']} | {r['text_length']} | {r['text_tokens_per_step']:,} + "
                f"{r['image_tokens_per_step']:,} | {r['timed_steps']} | {median_range(r['samples_per_s'])} "
                f"| {median_range(r['step_ms'])} | {r['relative_step_time']:.2f}x | {split} "
                f"| {median_range(r['peak_memory_mib'])} |"
            )
    if "preprocessing" in tables:
        rows = tables["preprocessing"]
        lines += [
            "",
            f"**2. Preprocessing: `prepare_dataset` on all of easy-VQA** ({rows[0]['images']:,} distinct images, "
            f"{rows[0]['pairs']:,} questions) at {PREPROCESSING_IMAGE_SIZE} px, as `scripts/train.py` calls it, "
            "in a fresh process with an empty datasets cache each time. The time covers validation, decode + resize "
            "of every image, tokenisation of every question, and writing both to the Arrow cache (loading easy-VQA "
            "is timed apart). images/s = distinct images / time of `prepare_dataset`.",
            "",
            "| num_proc | images/s | questions/s | prepare_dataset (s) | loading easy-VQA (s) | peak RSS (MiB) |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['num_proc']} | {median_range(r['images_per_s'])} | {median_range(r['pairs_per_s'])} "
                f"| {median_range(r['prepare_s'], 2)} | {median_range(r['load_s'], 2)} "
                f"| {median_range(r['peak_memory_mib'])} |"
            )
    if "attention" in tables:
        memory = (
            "`torch.cuda.max_memory_allocated` minus the memory allocated just before"
            if info["gpu"]
            else "peak RSS (VmHWM, reset just before) minus the RSS just before the first iteration"
        )
        counts = f"mm_fusion {blocks['mm_fusion']:,}, nn.MultiheadAttention {blocks['seed']:,}"
        lines += [
            "",
            f"**3. One fusion block: SDPA against `nn.MultiheadAttention`.** Text self-attention + text-to-image "
            f"cross-attention + MLP, width {tables['attention'][0]['hidden_size']}, "
            f"{tables['attention'][0]['heads']} heads, "
            f"{args.attention_texts} texts of T tokens attending to 65 "
            "image tokens (64 px image: 64 patches + class token), one image per text unless said, all-ones text "
            f"mask, training mode, fp32. Parameters: {counts}. {args.attention_warmup} warm-up + the timed "
            f"iterations of the table (forward + `pow(2).mean()` + backward) per trial; memory: {memory}.",
            "",
            "| T | block | timed iterations | forward + backward (ms) | forward (ms) | backward (ms) | time vs sdpa "
            "| peak memory growth, first iteration (MiB) | peak memory growth, all iterations (MiB) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in tables["attention"]:
            ratio = f"{r['time_vs_sdpa']:.2f}x" if r["time_vs_sdpa"] is not None else "–"
            lines.append(
                f"| {r['text_length']} | {CONTENDER_NAMES[r['contender']]} | {r['timed_iterations']} "
                f"| {median_range(r['forward_backward_ms'], 1)} "
                f"| {median_range(r['forward_ms'], 1)} | {median_range(r['backward_ms'], 1)} | {ratio} "
                f"| {median_range(r['first_iteration_memory_growth_mib'])} | {median_range(r['memory_growth_mib'])} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(BenchmarkArguments).parse_args_into_dataclasses(args=argv)
    for name, given, known in (
        ("tables", args.tables, TABLES),
        ("attention_contenders", args.attention_contenders, ATTENTION_CONTENDERS),
    ):
        unknown = set(given) - set(known)
        if unknown:
            raise ValueError(f"Unknown --{name} {sorted(unknown)}; choose from {list(known)}.")
    import easy_vqa

    from mm_fusion import train_tokenizer
    from mm_fusion.training import ModelArguments

    rec, info = recipe(), machine()
    work = tempfile.mkdtemp(prefix="mm_fusion_benchmark_costs_")
    shared_cache = os.path.join(work, "datasets_cache")
    os.makedirs(shared_cache)
    # The vocabulary scripts/train.py trains by default: on the easy-VQA training questions, bounded by vocab_size.
    tokenizer = train_tokenizer(easy_vqa.get_train_questions()[0], vocab_size=ModelArguments().vocab_size)
    tokenizer_dir = os.path.join(work, "tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    vocab_size, labels = len(tokenizer), list(easy_vqa.get_answers())

    config = build_fusion_config(ATTENTION_IMAGE_SIZE, vocab_size, rec["max_length"], labels, None)
    blocks = block_parameters(config)
    print(
        f"vocabulary {vocab_size} (tokenizer trained on the easy-VQA questions, upper bound "
        f"{ModelArguments().vocab_size}); fusion block parameters: mm_fusion {blocks['mm_fusion']:,}, "
        f"nn.MultiheadAttention {blocks['seed']:,}",
        flush=True,
    )
    if abs(blocks["mm_fusion"] / blocks["seed"] - 1) > 0.01:
        raise ValueError(f"The two fusion blocks differ in size by more than 1%: {blocks}.")

    plan = plan_trials(args, rec, vocab_size, labels, tokenizer_dir)
    print(f"{len(plan)} trials", flush=True)
    trials, start = [], time.perf_counter()
    # The fork server does the imports of a new interpreter once (~6-8 s each on a busy 2-core machine).
    preload = ["transformers", "mm_fusion", "mm_fusion.training", "benchmark_costs"]
    runner = TrialRunner(work, shared_cache, preload, args.fresh_interpreter)
    try:
        for payload in plan:
            table = payload["table"]
            begun = time.perf_counter()
            t = {"table": table, **run_trial(runner, payload, work)}
            t["trial_wall_s"] = time.perf_counter() - begun
            trials.append(t)
            elapsed = time.perf_counter() - start
            if table == "training":
                what = (
                    f"training {t['image_size']:>3} px {t['text_length']:>3} tokens: {t['samples_per_s']:7.1f} "
                    f"samples/s, step {1000 * t['median_step_s']:.0f} ms, peak {t['peak_memory_mib']:.0f} MiB"
                )
            elif table == "preprocessing":
                what = (
                    f"preprocessing num_proc {t['num_proc']}: {t['images_per_s']:6.0f} images/s "
                    f"({t['prepare_s']:.1f} s)"
                )
            else:
                what = (
                    f"attention T={t['text_length']:>3} {t['contender']:>19}: {1000 * t['median_s']:7.1f} ms "
                    f"forward + backward, memory +{t['memory_growth_mib']:.0f} MiB"
                )
            print(
                f"round {payload['round'] + 1} {what}; {elapsed / 60:.1f} min so far",
                flush=True,
            )
    finally:
        runner.close()
        shutil.rmtree(work, ignore_errors=True)

    tables = summarise(trials, args)
    info["trial_torch_threads"] = sorted({t["torch_threads"] for t in trials if "torch_threads" in t})
    text = markdown(tables, args, info, rec, vocab_size, blocks)
    print("\n" + text)
    report = {"arguments": asdict(args), "recipe": rec, "machine": info, "vocab_size": vocab_size}
    report |= {"block_parameters": blocks, "tables": tables, "trials": trials}
    report["wall_s"] = time.perf_counter() - start
    write_report(args.output, report, text)
    return report


if __name__ == "__main__":
    main()
