"""Write scripts/benchmarks/RESULTS.md, the project's one page of measured results, from the JSON result files.

Every figure on the page is read from a JSON file under scripts/benchmarks/results/ or scripts/research/results/
(figures that no benchmark script wrote are kept by hand in results/recorded.json, each with its source). Each row
gives what was measured, the headline figure(s), the command that produced them, the date, the machine and links to
the result files. The command, date and machine of a row are read from the JSON object its figures come from, else
from the file's top level: `benchmark_command` or `command`; `date` or `measured`; `machine` (a
`benchmarking.machine()` record or a sentence).

    python scripts/benchmarks/results_page.py            # rewrites scripts/benchmarks/RESULTS.md
    python scripts/benchmarks/results_page.py --check    # exit status 1 if RESULTS.md is not what the JSON gives

tests/benchmarks/test_results_page.py regenerates the page and compares it with the committed one.
"""

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


HERE = Path(__file__).resolve().parent  # scripts/benchmarks
SCRIPTS = HERE.parent
PAGE = HERE / "RESULTS.md"
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


# --------------------------------------------------------------------------------------------------------------------
# Formatting.


def f(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}"


def n(x: float) -> str:
    """A count or a rounded rate with thousands separators."""
    return f"{round(x):,}"


def ratio(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}x"


def spread(stat: dict, digits: int = 1, scale: float = 1.0, centre: str = "median") -> str:
    """`centre (min–max)` of a {median|mean, min, max} summary."""
    low, mid, high = (f"{stat[k] * scale:,.{digits}f}" for k in ("min", centre, "max"))
    return mid if low == high else f"{mid} ({low}–{high})"


def seeds_summary(row: dict) -> str:
    """A benchmark_training.py row: the mean test accuracy (worst–best seed) and the mean wall time (min–max)."""
    return (
        f"test accuracy {spread(row['test_accuracy'], 4, centre='mean')} over seeds "
        f"{', '.join(map(str, row['seeds']))}; {spread(row['wall_seconds'], 1, 1 / 60, 'mean')} min a run"
    )


def verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


# --------------------------------------------------------------------------------------------------------------------
# Reading the JSON files.


def by_key(items: list[dict], **match) -> dict:
    """The one item of `items` whose keys have the given values."""
    found = [i for i in items if all(i.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise LookupError(f"{len(found)} items match {match}")
    return found[0]


def training_run(data: dict, name: str) -> dict:
    return by_key(data["runs"], run=name)


def best_up_to(run: dict, key: str, steps: int) -> float:
    """A ladder run's best evaluation of `key` up to `steps` optimizer steps."""
    return max(e[key] for e in run["evaluations"] if e["step"] <= steps)


def first_step(run: dict, key: str, threshold: float) -> int | None:
    return next((e["step"] for e in run["evaluations"] if e[key] >= threshold), None)


def describe_machine(record) -> str:
    """A machine as the page writes it: a sentence as recorded, or cores, CPU model and GPU of a machine() record."""
    if isinstance(record, str):
        return record
    cpu = record.get("cpu") or "CPU, model not recorded"
    cpu = re.sub(r"\((R|TM)\)", "", cpu).replace(" Processor", "").split(" @")[0]
    cpu = re.sub(r"\s+", " ", cpu).strip()
    cores = record.get("cores") or record.get("cpus")
    text = f"{cores}-core {cpu}" if cores else cpu
    return f"{text}, {record['gpu']}" if record.get("gpu") else text


def provenance(data: dict, entries: list[dict], keys: tuple[str, ...]):
    """The first value of `keys` in the entries the figures come from, else at the file's top level."""
    for obj in [*entries, data]:
        for key in keys:
            if isinstance(obj, dict) and obj.get(key):
                return obj[key]
    return None


def command(data: dict, entries: list[dict]):
    """The command that produced the entries: their `benchmark_command`, else the file's `command`, else theirs."""
    found = provenance({}, entries, ("benchmark_command",)) or data.get("command")
    return found or provenance({}, entries, ("command",))


# --------------------------------------------------------------------------------------------------------------------
# The rows.


@dataclass
class Row:
    what: str
    file: str  # relative to scripts/
    figure: Callable[[dict], str]
    entries: Callable[[dict], list[dict]] = lambda data: []  # the objects of the file the figures come from
    also: list[str] = field(default_factory=list)  # other files the row's figures are shown in (a table, a plot)


def run_entries(*names: str) -> Callable[[dict], list[dict]]:
    return lambda data: [training_run(data, name) for name in names]


def keyed_entries(*names: str) -> Callable[[dict], list[dict]]:
    return lambda data: [data[name] for name in names]


def recorded(name: str) -> Callable[[dict], list[dict]]:
    return lambda data: [by_key(data["figures"], name=name)]


# easy-VQA recipes -------------------------------------------------------------------------------------------------


def default_4_and_3(data: dict) -> str:
    four, three = training_run(data, "default_4_epochs"), training_run(data, "default_3_epochs")
    return f"4 epochs: {seeds_summary(four)}. 3 epochs: {seeds_summary(three)}"


def at_commit(data: dict) -> str:
    old, new = training_run(data, "default@41766e4"), training_run(data, "default")
    old_42, new_42 = by_key(old["runs"], seed=42), by_key(new["runs"], seed=42)
    return (
        f"{seeds_summary(old)}; seed 42: {f(old_42['test_accuracy'], 4)} in {f(old_42['wall_seconds'] / 60, 1)} min, "
        f"{ratio(old_42['wall_seconds'] / new_42['wall_seconds'])} the 3.5-epoch default's seed-42 time"
    )


def retimed(data: dict) -> str:
    entry = by_key(data["figures"], name="default_run_map_check")
    runs = "; ".join(f"seed {r['seed']}: {f(r['test_accuracy'], 4)} in {r['wall_seconds']} s" for r in entry["runs"])
    check = entry["map_check"]
    return f"{runs}; the map check at the end of training {check['seconds']} s ({check['questions']:,} questions)"


def fresh_clone(name: str) -> Callable[[dict], str]:
    def runs(data: dict) -> str:
        entry = by_key(data["figures"], name=name)
        slowest = max(r["wall_seconds"] for r in entry["runs"])
        return (
            "; ".join(f"seed {r['seed']}: {f(r['test_accuracy'], 4)} in {r['wall_seconds']} s" for r in entry["runs"])
            + f" (target <= 300 s on every seed: {verdict(slowest <= 300)})"
        )

    return runs


def fresh_clone_and_same_hour(name: str) -> Callable[[dict], str]:
    def runs(data: dict) -> str:
        other = by_key(data["figures"], name=name)["same_hour_3_5_epochs"]
        return (
            f"{fresh_clone(name)(data)}; 3.5 epochs the same hour, seed {other['seed']}: "
            f"{f(other['test_accuracy'], 4)} in {other['wall_seconds']} s"
        )

    return runs


def example_card(data: dict) -> str:
    run = by_key(training_run(data, "full")["runs"], seed=0)
    return f"test accuracy {f(run['test_accuracy'], 4)}, {f(run['train_seconds'] / 60, 1)} min of training"


def recipe_ladder(data: dict) -> str:
    def worst(key: str) -> str:
        runs = data["runs"][key]["runs"]
        return f"{f(min(r['test_accuracy'] for r in runs), 4)} (seeds {', '.join(str(r['seed']) for r in runs)})"

    return (
        f"worst seed, 6 epochs: at most 2 questions of an image in a row {worst('gs2')}; 4 {worst('gs4')}; "
        f"no limit {worst('base')}; random batches {worst('random')}; 2 in a row for 3 epochs {worst('gs2_e3')}"
    )


def schedule_ladder(data: dict) -> str:
    rows = data["rows"]

    def worst(change: str) -> str:
        finals = [r["final_accuracy"] for r in rows if r["change"] == change and r["final_accuracy"] is not None]
        return f"{f(min(finals), 4)} ({len(finals)} seeds)"

    return (
        f"{len(rows)} runs, worst seed: 4 epochs at 5e-4, random order "
        f"{worst('4 epochs, learning rate 5e-4, random order')}; 3.5 epochs at 7e-4 clipped at 5 "
        f"{worst('3.5 epochs, learning rate 7e-4, random order, --max_grad_norm 5')}; "
        "3.25 epochs at 7e-4 clipped at 5 "
        f"{worst('3.25 epochs, learning rate 7e-4, random order, --max_grad_norm 5')}; 3 epochs at 7e-4 "
        f"{worst('3 epochs, learning rate 7e-4, random order')}"
    )


# Speed and memory ---------------------------------------------------------------------------------------------------


def training_step(data: dict) -> str:
    parts = []
    for s in data["speedups"]:
        parts.append(
            f"{s['image_size']} px: {ratio(s['vs_seed']['ratio'])} the seed loop's samples/s, "
            f"{ratio(s['vs_run_clip']['ratio'])} run_clip's; "
            f"data wait {f(s['mm_fusion_data_wait']['median'] * 100, 1)}% "
            f"({verdict(s['data_wait_pass'])}, < 5%)"
        )
    at_64 = {r["contender"]: r for r in data["rows"] if r["image_size"] == 64}
    eval_ = ", ".join(f"{c} {f(at_64[c]['eval_accuracy'])}" for c in ("mm_fusion", "seed", "run_clip"))
    return "; ".join(parts) + f"; eval accuracy after 2,048 samples at 64 px: {eval_}"


def time_to_accuracy(data: dict) -> str:
    judged = [r for r in data["verdict"]["rows"] if r["judged"]]
    fractions = " / ".join(f(r["ratio"], 2) for r in judged)
    at = " / ".join(str(r["accuracy"]) for r in judged)
    seed = by_key(data["trials"], contender="seed")
    return (
        f"mm_fusion's training time to {at} over run_clip's: {fractions} (target <= 0.33: "
        f"{verdict(data['verdict']['pass'])}); the seed loop {f(seed['best_accuracy'])} best in its "
        f"{seed['budget_s']:.0f} s"
    )


def data_pipeline(data: dict) -> str:
    at = {(r["image_size"], r["pipeline"]): r for r in data["rows"]}
    startup = {s["image_size"]: s for s in data["startup"]}
    speed = lambda size, pipe: n(at[(size, pipe)]["steady_samples_per_s"]["median"])  # noqa: E731
    return (
        f"64 px: mm_fusion {speed(64, 'mm_fusion')} samples/s against seed {speed(64, 'seed')} and run_clip "
        f"{speed(64, 'run_clip')}; without workers {speed(64, 'mm_fusion_no_workers')}; 224 px: mm_fusion "
        f"{speed(224, 'mm_fusion')}, {ratio(at[(224, 'mm_fusion')]['vs_run_clip'], 1)} run_clip; a second start-up "
        f"reads the cache in {f(startup[64]['warm_s']['median'], 2)} s "
        f"instead of {f(startup[64]['cold_s']['median'], 2)} s"
    )


def training_cost(data: dict) -> str:
    rows = data["tables"]["training"]
    base = by_key(rows, image_size=64, text_length=16)
    px224, tok256 = by_key(rows, image_size=224, text_length=16), by_key(rows, image_size=64, text_length=256)
    return (
        f"64 px, 16 tokens: {n(base['samples_per_s']['median'])} samples/s, "
        f"{n(base['peak_memory_mib']['median'])} MiB; 224 px: {ratio(px224['relative_step_time'])} the step time; "
        f"256 tokens: {ratio(tok256['relative_step_time'])}"
    )


def preprocessing(data: dict) -> str:
    first = data["tables"]["preprocessing"][0]
    return (
        "; ".join(
            f"num_proc {r['num_proc']}: {f(r['prepare_s']['median'], 2)} s, {n(r['images_per_s']['median'])} images/s"
            for r in data["tables"]["preprocessing"]
        )
        + f" ({first['images']:,} images, {first['pairs']:,} questions)"
    )


def attention_block(data: dict) -> str:
    rows = [r for r in data["tables"]["attention"] if r["text_length"] == 512]
    sdpa, eager, mha = (by_key(rows, contender=c) for c in ("sdpa", "eager", "multihead_attention"))
    return (
        f"512 tokens: SDPA {f(sdpa['forward_backward_ms']['median'], 1)} ms a forward + backward; "
        f"nn.MultiheadAttention {ratio(mha['time_vs_sdpa'])}, eager {ratio(eager['time_vs_sdpa'])} that; peak memory "
        f"growth {n(sdpa['first_iteration_memory_growth_mib']['median'])} MiB against "
        f"{n(mha['first_iteration_memory_growth_mib']['median'])} (nn.MultiheadAttention)"
    )


def profile_levers(data: dict) -> str:
    steps = {s["variant"]: s for s in data["steps"]}
    shipped = steps["shipped"]
    others = ", ".join(
        f"{v} {ratio(steps[v]['speedup_vs_before'])}"
        for v in ("+share", "+channels_last", "bf16", "compile", "one_thread")
        if v in steps
    )
    return (
        f"the shipped step {f(shipped['step_ms'], 1)} ms, {ratio(shipped['speedup_vs_before'])} the step with every "
        f"lever off ({f(steps['before']['step_ms'], 1)} ms); {others}; torch.compile took "
        f"{data['compile_seconds']:.0f} s to compile; one evaluation {f(data['evaluation']['seconds'], 1)} s against "
        f"{data['evaluation']['train_epoch_seconds']:.0f} s of training steps an epoch"
    )


def profile_grouped(data: dict) -> str:
    steps = {s["variant"]: s for s in data["steps"]}
    return (
        f"{data['batch']['distinct_images']:.1f} distinct images a batch: "
        f"+share {ratio(steps['+share']['speedup_vs_before'])}, "
        f"shipped {ratio(steps['shipped']['speedup_vs_before'])} ({f(steps['shipped']['step_ms'], 1)} ms)"
    )


def grad_cache(data: dict) -> str:
    rows = [r for r in data["rows"] if r["itm_loss_weight"] == 1.0]
    plain = by_key(rows, mode="plain", micro_batch_size=16)
    cache = by_key(rows, mode="grad_cache")
    return (
        f"16 pairs as 4 micro-batches of 4: {f(cache['peak_saved_mib'], 1)} MiB of saved activations against "
        f"{f(plain['peak_saved_mib'], 1)} for one batch of 16; "
        f"{f(cache['step_s'])} s a step against {f(plain['step_s'])}"
    )


def image_formats(data: dict) -> str:
    at = {(r["corpus"], r["image_size"], r["format"]): r for r in data["results"]}

    def small(corpus: str, fmt: str) -> str:
        return ratio(at[(corpus, 224, "uint8")]["bytes_per_image"] / at[(corpus, 224, fmt)]["bytes_per_image"], 1)

    def speed(corpus: str, fmt: str) -> str:
        return n(at[(corpus, 224, fmt)]["samples_per_second"]["median"])

    return (
        f"224 px: JPEG {small('synthetic', 'jpeg')} (photo-like) to {small('easy_vqa', 'jpeg')} (easy-VQA) smaller "
        f"than uint8, decoded at {speed('synthetic', 'jpeg')}-{speed('easy_vqa', 'jpeg')} images/s in one thread "
        f"against {speed('easy_vqa', 'uint8')}-{speed('synthetic', 'uint8')}; "
        f"lossless WebP {small('synthetic', 'webp')} smaller "
        f"on photo-like images, {speed('synthetic', 'webp')} images/s"
    )


def batch_ramp(data: dict) -> str:
    def reached(run: str, key: str, target: float) -> str:
        curve = data["runs"][run]["curve"]
        hit = next((c for c in curve if c[key] >= target), None)
        return f"{f(hit['seconds'] / 60, 1)} min" if hit else "not reached"

    def both(run: str) -> str:
        curve = data["runs"][run]["curve"]
        hit = next(
            (c for c in curve if c["eval_accuracy_relational"] >= 0.94 and c["eval_accuracy_non_relational"] >= 0.98),
            None,
        )
        return f"{f(hit['seconds'] / 60, 1)} min" if hit else "not reached"

    return (
        f"easy-VQA to 0.9: fixed batch 64 {reached('easy_vqa_fixed', 'eval_accuracy', 0.9)}, ramp 16 to 64 "
        f"{reached('easy_vqa_ramp', 'eval_accuracy', 0.9)}; "
        f"to 0.95: {reached('easy_vqa_fixed', 'eval_accuracy', 0.95)} "
        f"against {reached('easy_vqa_ramp', 'eval_accuracy', 0.95)}; Sort-of-CLEVR to both targets: "
        f"{both('sort_of_clevr_fixed')} against {both('sort_of_clevr_ramp')}"
    )


# Serving ----------------------------------------------------------------------------------------------------------


def inference(data: dict) -> str:
    vqa, zero = data["vqa"], data["zero_shot"]
    return (
        f"VQA: the pipeline {n(vqa['pipeline_questions_per_s']['median'])} questions/s against "
        f"{n(vqa['naive_questions_per_s']['median'])} for processor + model per question "
        f"({spread(data['speedup']['vqa'])}x); zero-shot: cached {n(zero['cached_images_per_s']['median'])} images/s "
        f"against stock {n(zero['stock_images_per_s']['median'])} ({spread(data['speedup']['zero_shot'])}x); served "
        f"accuracy {f(vqa['served_accuracy'], 4)}, the training run's {f(vqa['training_eval_accuracy'], 4)}"
    )


def map_cost(data: dict) -> str:
    maps = data["maps"]
    return (
        "answers with the default map over answers alone: "
        f"{spread(maps['single_time_ratio'], 2)}x one question a call, "
        f"{spread(maps['batched_time_ratio'], 2)}x in batches of 64 (target <= 3x)"
    )


def onnx(data: dict) -> str:
    at = {(r["graph"], r["batch_size"]): r for r in data["results"]}
    speed = lambda graph, batch: ratio(at[(graph, batch)]["speedup"])  # noqa: E731
    worst = max(r["max_abs_difference"] for r in data["results"])
    return (
        f"onnxruntime over PyTorch, batch 1 / 64: VQA logits {speed('model', 1)} / {speed('model', 64)}, image "
        f"embeddings {speed('image_encoder', 1)} / {speed('image_encoder', 64)}, text embeddings "
        f"{speed('text_encoder', 1)} / {speed('text_encoder', 64)}; outputs within {worst:.1e} of PyTorch"
    )


# Pretrained towers and LoRA ---------------------------------------------------------------------------------------


def composition(data: dict) -> str:
    trials = [t for t in data["trials"] if t["budget_s"] == 150]
    parts = []
    for dataset, size in (
        ("fashion_mnist", 96),
        ("fashion_mnist", 128),
        ("easy_vqa", 64),
        ("easy_vqa", 96),
        ("easy_vqa", 128),
    ):
        gains = []
        for seed in (0, 1):
            composed = by_key(trials, dataset=dataset, image_size=size, recipe="mobilenet_v2", seed=seed)
            scratch = by_key(trials, dataset=dataset, image_size=size, recipe="scratch", seed=seed)
            # as benchmark_composition.py rounds them
            gains.append(f"{round(composed['final_accuracy'] - scratch['final_accuracy'], 4):+.3f}")
        parts.append(f"{dataset.replace('_', '-')} {size} px {' / '.join(gains)}")
    return "gain over scratch, seeds 0 / 1: " + "; ".join(parts) + " (target >= +0.05 on both seeds: FAIL)"


def efficientnet(data: dict) -> str:
    trials = [
        t for t in data["trials"] if t["budget_s"] == 150 and t["dataset"] == "fashion_mnist" and t["image_size"] == 96
    ]
    lite = by_key(trials, recipe="efficientnet_lite0")
    mobile = [by_key(trials, recipe="mobilenet_v2", seed=s)["final_accuracy"] for s in (0, 1)]
    return (
        f"EfficientNet-Lite0 {f(lite['final_accuracy'])} (seed 0, {lite['steps']} steps in 150 s) against "
        f"MobileNetV2 {f(mobile[0])} / {f(mobile[1])} (seeds 0 / 1)"
    )


def composition_ladder(data: dict) -> str:
    rung = data["rungs"]["freeze_text"]
    trial = rung["trials"][0]
    return (
        f"the text tower frozen: {f(trial['final_accuracy'])} in {trial['steps']} steps; "
        f"{len(data['rungs'])} rungs, one change each"
    )


def composition_rung(name: str) -> Callable[[dict], str]:
    return lambda data: composition_fewer_images(data["rungs"][name]["trials"])


def composition_fewer_images(trials: list[dict]) -> str:
    parts, gains = [], []
    for seed in (0, 1):
        composed = by_key(trials, recipe="mobilenet_v2", seed=seed)
        scratch = by_key(trials, recipe="scratch", seed=seed)
        gains.append(round(composed["final_accuracy"] - scratch["final_accuracy"], 4))
        parts.append(
            f"{f(composed['final_accuracy'])} against {f(scratch['final_accuracy'])} ({composed['steps']} against "
            f"{scratch['steps']} steps)"
        )
    return (
        f"seeds 0 / 1: {' / '.join(parts)}; gain {' / '.join(f'{g:+.3f}' for g in gains)} "
        f"(target >= +0.05 on both seeds: {verdict(min(gains) >= 0.05)})"
    )


def lora(data: dict) -> str:
    def one(recipe: str) -> str:
        t = by_key(data["trials"], recipe=recipe)
        to_09 = next((c for c in t["curve"] if c["accuracy"] >= 0.9), None)
        reached = f"0.9 at {to_09['train_s']:.0f} s" if to_09 else "0.9 not reached"
        rate = f" at {t['learning_rate']:g}" if "learning_rate" in t else ""
        return (
            f"{recipe}{rate}: best {f(t['best_accuracy'])} in {t['curve'][-1]['step']} steps, {reached}, "
            f"{t['trainable_parameters'] / 1e6:.2f}M of "
            f"{t['parameters'] / 1e6:.1f}M parameters trained, saves {f(t['saved_mib'], 2)} MiB"
        )

    best = {recipe: by_key(data["trials"], recipe=recipe)["best_accuracy"] for recipe in ("full", "lora")}
    gap = best["lora"] - best["full"]
    return f"{one('full')}; {one('lora')}; LoRA - full {gap:+.3f} (target within 0.01: {verdict(gap >= -0.01)})"


def lora_lr(data: dict) -> str:
    t = by_key(data["trials"], recipe="lora")
    to_09 = next(c for c in t["curve"] if c["accuracy"] >= 0.9)
    return f"LoRA at 1e-3: best {f(t['best_accuracy'])}, 0.9 at step {to_09['step']}"


def lora_composition(data: dict) -> str:
    defaults = [r for r in data["runs"] if r["variant"].startswith("defaults")]
    full = [r for r in data["runs"] if r["recipe"] == "full fine-tuning"]
    variants = [r for r in data["runs"] if r["recipe"] == "LoRA" and not r["variant"].startswith("defaults")]
    best_lora = max(defaults, key=lambda r: r["final_accuracy"])
    best_full = max(full, key=lambda r: r["final_accuracy"])
    best_variant = max(variants, key=lambda r: r["final_accuracy"])
    gap = best_lora["final_accuracy"] - best_full["final_accuracy"]
    return (
        f"--lora at its best rate ({best_lora['learning_rate']:g}) {f(best_lora['final_accuracy'], 4)} against full "
        f"fine-tuning at its best ({best_full['learning_rate']:g}) {f(best_full['final_accuracy'], 4)}: {gap:+.3f} "
        f"(target within 0.01: FAIL); {len(variants)} LoRA variants {f(min(r['final_accuracy'] for r in variants), 4)}"
        f"-{f(best_variant['final_accuracy'], 4)}"
    )


def lora_memory(data: dict) -> str:
    def peak(allocator: str, recipe: str) -> float:
        return by_key(data["trials"], allocator=allocator, recipe=recipe)["peak_memory_mib"]

    def step(allocator: str, recipe: str) -> float:
        return by_key(data["trials"], allocator=allocator, recipe=recipe)["seconds_per_step"]

    released, full = "glibc, mmap over 64 KiB", peak("glibc", "full")

    def against_full(recipe: str) -> tuple[float, float]:  # memory and step time against full fine-tuning's
        return peak(released, recipe) / full, step(released, recipe) / step("glibc", "full")

    def checkpointed(recipe: str) -> str:
        layers = by_key(data["trials"], allocator=released, recipe=recipe)["checkpointed_layers"]
        return f"{layers} layers checkpointed"

    # --lora as it comes: adapters on the attention's query and value, every second layer checkpointed.
    memory, slow = against_full("lora_qv+ckpt")
    text = (
        f"--lora as it comes ({checkpointed('lora_qv+ckpt')}) {n(peak(released, 'lora_qv+ckpt'))} MiB against full "
        f"fine-tuning as it comes {n(full)}: {f(memory, 2)} (target <= 0.6: {verdict(memory <= 0.6)}); a step "
        f"{step(released, 'lora_qv+ckpt'):.1f} s against {step('glibc', 'full'):.1f} s: {f(slow, 2)} (target <= 1.2: "
        f"{verdict(slow <= 1.2)})"
    )
    for again in data.get("repeats", []):  # the same pair run again, each a fresh pair of processes
        text += f"; run again: memory {f(again['memory_ratio'], 2)}, a step {f(again['step_ratio'], 2)}"
    others = {
        "lora_qv+ckpt/1": "checkpointing every layer instead",
        "lora+ckpt": "adapters on every layer (--lora_target_modules all)",
        "lora+ckpt/1": "adapters on every layer, every layer checkpointed",
    }
    for recipe, what in others.items():
        if any((t["allocator"], t["recipe"]) == (released, recipe) for t in data["trials"]):
            memory, slow = against_full(recipe)
            text += f"; {what} ({checkpointed(recipe)}): memory {f(memory, 2)}, a step {f(slow, 2)}"
    return text


def mobilenet_first_look(data: dict) -> str:
    entry = by_key(data["figures"], name="easy_vqa_mobilenet_v2")
    return (
        f"after 3 epochs at 128 px: ImageNet weights {f(entry['imagenet_accuracy'])}, from scratch "
        f"{f(entry['scratch_accuracy'])}; {entry['train_minutes'][0]} / {entry['train_minutes'][1]} min of training"
    )


# Fashion-MNIST ----------------------------------------------------------------------------------------------------


def fashion_classify(data: dict) -> str:
    runs = sorted((r for r in data["runs"] if r["recipe"] == "classify"), key=lambda r: r["seed"])
    what = " / ".join(f(r["metrics"]["eval_accuracy_what"]) for r in runs)
    every = " / ".join(f(r["metrics"]["eval_accuracy"]) for r in runs)
    minutes = " / ".join(f(r["wall_seconds"] / 60, 1) for r in runs)
    training = " / ".join(f(r["train_seconds"] / 60, 1) for r in runs)
    passed = min(r["metrics"]["eval_accuracy_what"] for r in runs) >= data["targets"]["classify"]
    return (
        f"seeds 0 / 1: {what} on the 10-product questions "
        f"(target >= {data['targets']['classify']}: {verdict(passed)}), "
        f"{every} on all questions; {minutes} min a run, {training} of them training"
    )


def fashion_pretrain(data: dict) -> str:
    runs = sorted((r for r in data["runs"] if r["recipe"] == "pretrain"), key=lambda r: r["seed"])
    top1 = " / ".join(f(r["eval"]["zero_shot_top1"]) for r in runs)
    minutes = " / ".join(f(r["wall_seconds"] / 60, 1) for r in runs)
    passed = min(r["eval"]["zero_shot_top1"] for r in runs) >= data["targets"]["zero_shot"]
    return (
        f"seeds 0 / 1: zero-shot top-1 {top1} through transformers' zero-shot pipeline (target >= "
        f"{data['targets']['zero_shot']}: {verdict(passed)}); {minutes} min a run"
    )


def fashion_ladder(data: dict) -> str:
    """The ladder's rungs, seed 0: each change's 10-product accuracy, and the small CNN's bar."""
    rows = [row for row in data["rows"] if row["seed"] == 0]
    (cnn,) = [row for row in rows if row["change"].startswith("small_cnn")]
    rungs = "; ".join(f"{row['change']}: {f(row['what'], 4)}" for row in rows if row is not cnn)
    bar = f"a small CNN (the bar) {f(cnn['what'], 4)} after {f(cnn['epochs'], 1)} epochs in 10 min"
    return f"seed 0, the 10-product questions: {rungs}; {bar}"


def fashion_pretrained_rows(data: dict) -> list[dict]:
    """The ladder's rows of the recipe that names the product in 10 minutes: the pretrained towers at 64 px."""
    return sorted((row for row in data["rows"] if row.get("recipe") == "pretrained_64px"), key=lambda r: r["seed"])


def fashion_pretrained(data: dict) -> str:
    """Both seeds of the pretrained-tower recipe against the target: 0.93 on the worst seed in 10 min of training."""
    rows = fashion_pretrained_rows(data)
    seeds = " / ".join(str(row["seed"]) for row in rows)
    worst = min(row["what"] for row in rows)
    passed = worst >= 0.93 and all(row["train_seconds"] <= 600 for row in rows)
    return (
        f"the 10-product questions, seeds {seeds}: {' / '.join(f(row['what'], 4) for row in rows)} in "
        f"{' / '.join(f(row['train_seconds'], 0) for row in rows)} s of training (yes / no "
        f"{' / '.join(f(row['yes_no'], 4) for row in rows)}); target >= 0.93 on the worst seed within 600 s: "
        f"{verdict(passed)}"
    )


# Sort-of-CLEVR ----------------------------------------------------------------------------------------------------


def soc(row: dict) -> str:
    return f"{f(row['eval_accuracy_relational'])} / {f(row['eval_accuracy_non_relational'])}"


def soc_targets(row: dict) -> str:
    hit = row.get("targets_reached")
    return f"epoch {hit['epoch']:g}, {f(hit['elapsed_seconds'] / 60, 1)} min into training" if hit else "not reached"


def soc_pair(data: dict, first: str, second: str) -> str:
    a, b = data[first], data[second]
    return (
        f"relational / non-relational: seed 0 {soc(a)}, seed 1 {soc(b)}; both targets first at {soc_targets(a)} / "
        f"{soc_targets(b)}; {f(a['wall_seconds'] / 60, 1)} / {f(b['wall_seconds'] / 60, 1)} min a run"
    )


def soc_ablations(data: dict) -> str:
    return "relational / non-relational: " + "; ".join(
        f"{label} {soc(data[key])}"
        for label, key in (
            ("late fusion, no FiLM", "late"),
            ("image only", "image_only"),
            ("text only", "text_only"),
            ("the question-only ceiling", "question_only_ceiling"),
        )
    )


def soc_cross_attention(data: dict) -> str:
    row = data["cross_attention"]
    return f"relational / non-relational {soc(row)}; both targets first at {soc_targets(row)}"


def soc_vit(data: dict) -> str:
    return f"relational / non-relational {soc(data['vit_hierarchical'])}; with late fusion {soc(data['vit_late'])}"


def soc_pretraining(data: dict) -> str:
    pre, tuned, scratch = data["pretrain"], data["finetune_pretrained"], data["finetune_scratch"]
    return (
        f"fine-tuned from the pretraining {f(tuned['eval_accuracy'])}, from scratch {f(scratch['eval_accuracy'])} "
        f"(same budget); zero-shot shape {f(pre['zero_shot_itc_accuracy'])} by ITC, "
        f"{f(pre['zero_shot_itm_accuracy'])} "
        f"by ITM (chance 0.5); text-to-image R@1 {f(pre['eval_text_to_image_R@1'])}"
    )


def soc_stage_2(data: dict) -> str:
    final = data["final"]
    both = next(
        (
            c
            for c in data["curve"]
            if c["eval_accuracy_relational"] >= 0.94 and c["eval_accuracy_non_relational"] >= 0.98
        ),
        None,
    )
    return (
        f"relational / non-relational {f(final['relational'])} / {f(final['non_relational'])} at the end; both "
        f"targets first at epoch {both['epoch']:g}"
    )


# Maps -------------------------------------------------------------------------------------------------------------


def pointing_soc(data: dict) -> str:
    seeds = [data["hierarchical"], data["hierarchical_seed_1"]]
    default = [s["by_method"]["guided_gradient"] for s in seeds]
    attention = [s["by_method"]["attention"] for s in seeds]
    layer = [m["per_layer"][m["best_layer"]] for m in default]
    passes = all(e["non_relational"] >= 0.90 and min(e["horizontal"], e["vertical"]) >= 0.80 for e in layer)
    return (
        "the default map's peak on the named object, seeds 0 / 1: non-relational "
        f"{' / '.join(f(e['non_relational']) for e in layer)}, left {' / '.join(f(e['horizontal']) for e in layer)}, "
        f"top {' / '.join(f(e['vertical']) for e in layer)} (targets 0.90, and 0.80 left and top: {verdict(passes)}); "
        "the question's attention "
        f"{' / '.join(f(m['best_non_relational']) for m in attention)}; painting the peak's square changes the answer "
        f"{' / '.join(str(round(m['deletion']['non_relational']['ratio'])) + 'x' for m in default)} "
        "as often as a random "
        f"square (target 3x: PASS); counterfactual "
        f"{' / '.join(f(s['counterfactual']['follows_the_named_object']) for s in seeds)} (PASS)"
    )


FOUR_EPOCHS = ("hierarchical_4_epochs", "hierarchical_4_epochs_seed_1", "hierarchical_4_epochs_seed_2")


def pointing_soc_4_epochs(data: dict) -> str:
    default = [data[name]["by_method"]["guided_gradient"] for name in FOUR_EPOCHS]
    layer = [m["per_layer"][m["best_layer"]] for m in default]
    passes = all(e["non_relational"] >= 0.90 and min(e["horizontal"], e["vertical"]) >= 0.80 for e in layer)
    return (
        "the default map's peak on the named object, seeds 0 / 1 / 2: non-relational "
        f"{' / '.join(f(e['non_relational']) for e in layer)}, left {' / '.join(f(e['horizontal']) for e in layer)}, "
        f"top {' / '.join(f(e['vertical']) for e in layer)} (targets 0.90, and 0.80 left and top: {verdict(passes)}); "
        "painting the peak's square changes the answer "
        f"{' / '.join(str(round(m['deletion']['non_relational']['ratio'])) + 'x' for m in default)} as often as a "
        "random square"
    )


def map_ladder(data: dict) -> str:
    rungs = (
        ("the map without the read's weight", "input x gradient x attention (the map before the read's weight)"),
        ("with it (the default)", "stage 1: ... x |read . gradient|"),
        (
            "with the first read's attention on the colour word in its place",
            "stage 1: ... x its read's attention on the colour word",
        ),
    )
    seeds = [data[f"seed_{k}"]["maps"] for k in range(3)]
    return (
        "; ".join(f"{label} {' / '.join(f(maps[key]['non_relational']) for maps in seeds)}" for label, key in rungs)
        + " (non-relational, seeds 0 / 1 / 2)"
    )


def map_ladder_heads(data: dict) -> str:
    names = ("seed_0", "seed_1", "seed_2", "seed_0_8_epochs", "seed_1_8_epochs")

    def best(maps: dict) -> dict:
        heads = [maps[key] for key in maps if key.startswith("head ") and "input x gradient" in key]
        return max(heads, key=lambda entry: entry["non_relational"])

    picked = [best(data[name]["maps"]) for name in names]
    return (
        "the best head's value path x input x gradient, non-relational / left / top: "
        + "; ".join(f"{f(e['non_relational'])} / {f(e['horizontal'])} / {f(e['vertical'])}" for e in picked)
        + " (4 epochs seeds 0 / 1 / 2; 8 epochs seeds 0 / 1)"
    )


def map_trajectory(data: dict) -> str:
    key = "stage 1: ... x |read . gradient|"
    chosen = [c for c in data["checkpoints"].values() if c["epoch"] in (1.5, 2.0, 4.0, 8.0)]
    return "the default map on left / top, and the left / top accuracy, at epochs " + "; ".join(
        f"{c['epoch']:g}: {f(c['maps'][key]['horizontal'])} / {f(c['maps'][key]['vertical'])} "
        f"({f(c['accuracy']['horizontal'])} / {f(c['accuracy']['vertical'])})"
        for c in chosen
    )


def pointing_easy_vqa(data: dict) -> str:
    maps = data["easy_vqa_default_seed_42"]["by_method"]
    default, attention = maps["guided_gradient"], maps["attention"]
    return (
        f"the default map's peak on the shape {f(default['on_shape']['all'])} (target 0.90: PASS), the question's "
        f"attention {f(attention['on_shape']['all'])}; painting the peak's square changes the answer "
        f"{default['deletion']['all']['ratio']:.0f}x as often as a random square"
    )


def pointing_film_late(data: dict) -> str:
    film, late = data["film_epoch_6"]["by_method"], data["late_epoch_6"]["by_method"]
    return (
        "input x gradient's peak on the named object, non-relational: "
        f"FiLM {f(film['input_x_gradient']['best_non_relational'])}, "
        f"late fusion {f(late['input_x_gradient']['best_non_relational'])}"
    )


# Data ---------------------------------------------------------------------------------------------------------------


def data_check(data: dict) -> str:
    check, error = data["check"], data["first_error"]
    return (
        f"{check['rows']:,} rows, {check['distinct_images']:,} images: "
        f"{spread(check['wall_seconds'], 1, centre='median')} s, "
        f"{n(check['rows_per_second']['median'])} rows/s, {n(check['images_per_second']['median'])} images/s, "
        f"{check['left_out']} planted bad rows left out; a malformed line: the error line after "
        f"{f(error['error_seconds']['median'], 2)} s against {f(error['baseline_seconds']['median'], 2)} s to import "
        f"TrainingArguments, {ratio(error['ratio'])} (target <= {error['target_ratio']}x: {verdict(error['passes'])})"
    )


# Research: Sort-of-CLEVR, the model alone -------------------------------------------------------------------------


def ladder_runs(data: dict) -> str:
    def last(variant: str, seed: int) -> dict:
        run = next(r for r in data["runs"] if r["variant"] == variant and r["settings"]["seed"] == seed)
        return run["evaluations"][-1]

    film = last("film_resnet", 1)
    recipe = last("mm_fusion", 0)
    fixed = last("mm_fusion_film_flatten_fixes", 1)
    return (
        f"FiLM on mm_fusion's ResNet (seed 1): non-relational {f(film['non_relational'])}, relational "
        f"{f(film['relational'])} at step {film['step']:,}; mm_fusion's hierarchical model at the prior "
        f"({f(recipe['non_relational'])}); its late FiLM model with the four fixes, left / top "
        f"{f(fixed['horizontal'])} / {f(fixed['vertical'])}"
    )


def ladder_h100(data: dict) -> str:
    def learned(variant: str) -> str:
        runs = [r for r in data["runs"] if r["variant"] == variant and r["settings"]["device"] == "cuda"]
        hits = sum(best_up_to(r, "non_relational", 3000) >= 0.9 for r in runs)
        return f"{hits} of {len(runs)}"

    return (
        "seeds reaching non-relational 0.9 within 3,000 steps: FiLM on the ResNet "
        f"{learned('film_resnet')}, a hand-written attention read {learned('attention')}, "
        "the recipe's cross-attention "
        f"model {learned('mm_hier_one_layer_stem_recipe_positions_after_norm')}"
    )


def ladder_words(data: dict) -> str:
    runs = [
        r for r in data["runs"] if r["variant"] == "mm_hier_one_layer_stem_recipe_embeddings_no_text_self_attention"
    ]
    runs.sort(key=lambda r: r["settings"]["seed"])
    firsts = " / ".join(f"{first_step(r, 'non_relational', 0.9):,}" for r in runs)
    finals = [r["evaluations"][-1]["non_relational"] for r in runs]
    return (
        f"the words' own queries: non-relational 0.9 first at step {firsts} (seeds "
        f"{', '.join(str(r['settings']['seed']) for r in runs)}), {f(min(finals))}-{f(max(finals))} at "
        f"{runs[0]['evaluations'][-1]['step']:,}"
    )


def ladder_seeds(data: dict) -> str:
    runs = [r for r in data["runs"] if r["variant"] == "mm_hier_one_layer_stem_recipe_positions_after_norm"]
    hits = [r["settings"]["seed"] for r in runs if best_up_to(r, "non_relational", 3000) >= 0.9]
    return (
        f"the recipe's cross-attention model reaches non-relational 0.9 within 3,000 steps on {len(hits)} of "
        f"{len(runs)} seeds (seed {', '.join(map(str, hits))})"
    )


def no_feature_map_bridge(data: dict) -> str:
    return seeds_summary(data["runs"][0])


SECTIONS: list[tuple[str, list[Row]]] = [
    (
        "easy-VQA recipes",
        [
            Row(
                "the default model for 3.5 epochs (`--runs default` when measured)",
                "benchmarks/results/benchmark_training.json",
                lambda d: seeds_summary(training_run(d, "default")),
                run_entries("default"),
                ["benchmarks/results/benchmark_training.md"],
            ),
            Row(
                "the default model for 4 epochs and for 3 (the default run)",
                "benchmarks/results/benchmark_training.json",
                default_4_and_3,
                run_entries("default_4_epochs", "default_3_epochs"),
            ),
            Row(
                "the default model with two fusion layers, 4 epochs",
                "benchmarks/results/benchmark_training.json",
                lambda d: seeds_summary(training_run(d, "default_2_fusion_layers")),
                run_entries("default_2_fusion_layers"),
            ),
            Row(
                "the same command on the code of commit 41766e4 (6 epochs)",
                "benchmarks/results/benchmark_training.json",
                at_commit,
                run_entries("default@41766e4"),
            ),
            Row(
                "the baseline model (two fusion layers, a tower that does not read the question)",
                "benchmarks/results/benchmark_training.json",
                lambda d: seeds_summary(training_run(d, "blind_tower")),
                run_entries("blind_tower"),
            ),
            Row(
                "the longer recipe, `scripts/configs/easy_vqa_full.yaml`",
                "benchmarks/results/benchmark_training.json",
                lambda d: seeds_summary(training_run(d, "full")),
                run_entries("full"),
            ),
            Row(
                "the example model card, `model_cards/examples/easy_vqa_full` (the longer recipe, seed 0)",
                "benchmarks/results/benchmark_training.json",
                example_card,
                run_entries("full"),
                ["../model_cards/examples/easy_vqa_full/README.md"],
            ),
            Row(
                "the default run with `feature_map_bridge=False`",
                "research/results/easy_vqa_no_feature_map_bridge.json",
                no_feature_map_bridge,
                lambda d: [d["runs"][0]],
                ["research/results/easy_vqa_no_feature_map_bridge.md"],
            ),
            Row(
                "the default run at 3.5 epochs from a fresh clone, and the map check at its end",
                "benchmarks/results/recorded.json",
                retimed,
                recorded("default_run_map_check"),
            ),
            Row(
                "the default run at 3.5 epochs from a fresh clone, on an AMD EPYC",
                "benchmarks/results/recorded.json",
                fresh_clone("default_run_fresh_clone_amd_epyc"),
                recorded("default_run_fresh_clone_amd_epyc"),
            ),
            Row(
                "the default run at 3.5 epochs from a fresh clone, on an AMD EPYC of another family/model",
                "benchmarks/results/recorded.json",
                fresh_clone("default_run_fresh_clone_amd_epyc_25_17"),
                recorded("default_run_fresh_clone_amd_epyc_25_17"),
            ),
            Row(
                "the default run (3 epochs) from a fresh clone, on that AMD EPYC, and 3.5 epochs the same hour",
                "benchmarks/results/recorded.json",
                fresh_clone_and_same_hour("default_run_3_epochs_fresh_clone_amd_epyc_25_17"),
                recorded("default_run_3_epochs_fresh_clone_amd_epyc_25_17"),
            ),
            Row(
                "batches by image: questions of one image in a row (the recipe ladder)",
                "benchmarks/results/easy_vqa_recipe_ladder.json",
                recipe_ladder,
                also=["benchmarks/results/easy_vqa_recipe_ladder.md"],
            ),
            Row(
                "shorter schedules, one change at a time (the schedule ladder)",
                "benchmarks/results/easy_vqa_schedule_ladder.json",
                schedule_ladder,
                also=["benchmarks/results/easy_vqa_schedule_ladder.md"],
            ),
        ],
    ),
    (
        "Speed and memory",
        [
            Row(
                "a training step against the seed loop and run_clip, same model size",
                "benchmarks/results/benchmark_training_step.json",
                training_step,
                also=["benchmarks/results/benchmark_training_step.md"],
            ),
            Row(
                "training time to an easy-VQA accuracy against the same baselines, the default model, 64 px",
                "benchmarks/results/benchmark_time_to_accuracy.json",
                time_to_accuracy,
                also=["benchmarks/results/benchmark_time_to_accuracy.md"],
            ),
            Row(
                "the data pipeline, batch 32, 2 workers",
                "benchmarks/results/benchmark_data.json",
                data_pipeline,
                also=["benchmarks/results/benchmark_data.md"],
            ),
            Row(
                "the default model's training cost by image size and text length",
                "benchmarks/results/benchmark_costs.json",
                training_cost,
                also=["benchmarks/results/benchmark_costs.md"],
            ),
            Row(
                "`prepare_dataset` on all of easy-VQA, 64 px",
                "benchmarks/results/benchmark_costs.json",
                preprocessing,
                also=["benchmarks/results/benchmark_costs.md"],
            ),
            Row(
                "one fusion block: SDPA against `nn.MultiheadAttention`",
                "benchmarks/results/benchmark_costs.json",
                attention_block,
                also=["benchmarks/results/benchmark_costs.md"],
            ),
            Row(
                "the default training step's speed levers, interleaved step by step",
                "benchmarks/results/profile_training_step.json",
                profile_levers,
                also=["benchmarks/results/profile_training_step.md"],
            ),
            Row(
                "the same levers on batches of 2 questions an image",
                "benchmarks/results/profile_training_step_grouped.json",
                profile_grouped,
                also=["benchmarks/results/profile_training_step_grouped.md"],
            ),
            Row("the ITC gradient cache, one pretraining step", "benchmarks/results/grad_cache.json", grad_cache),
            Row(
                "stored image formats (`--image_format`)",
                "benchmarks/results/image_cache.json",
                image_formats,
                also=["benchmarks/results/image_cache.md"],
            ),
            Row(
                "the batch-size ramp (`--batch_size_ramp_max 64`) against a fixed batch of 64",
                "benchmarks/results/batch_ramp.json",
                batch_ramp,
                lambda d: list(d["runs"].values()),
                ["benchmarks/results/batch_ramp.md"],
            ),
        ],
    ),
    (
        "Serving",
        [
            Row(
                "the pipelines against processor + model per question, easy-VQA",
                "benchmarks/results/benchmark_inference.json",
                inference,
                also=["benchmarks/results/benchmark_inference.md"],
            ),
            Row(
                "the cost of a map (`return_map=True`)",
                "benchmarks/results/benchmark_inference.json",
                map_cost,
                also=["benchmarks/results/benchmark_inference.md"],
            ),
            Row(
                "the default model exported to ONNX, 2 threads",
                "benchmarks/results/onnx_inference.json",
                onnx,
                also=["benchmarks/results/onnx_inference.md"],
            ),
        ],
    ),
    (
        "Pretrained towers and LoRA",
        [
            Row(
                "ImageNet MobileNetV2 + all-MiniLM-L6-v2 against the default model from scratch, 1,000 Fashion-MNIST "
                "or 400 easy-VQA training images, 150 s each",
                "benchmarks/results/composition.json",
                composition,
                also=["benchmarks/results/composition.md"],
            ),
            Row(
                "EfficientNet-Lite0 in place of MobileNetV2, Fashion-MNIST 96 px",
                "benchmarks/results/composition.json",
                efficientnet,
                also=["benchmarks/results/composition.md"],
            ),
            Row(
                "the composition, one change at a time (Fashion-MNIST)",
                "benchmarks/results/composition_ladder.json",
                composition_ladder,
                lambda d: list(d["rungs"].values()),
            ),
            Row(
                "the same at 500 training images, Fashion-MNIST 96 px, 150 s each",
                "benchmarks/results/composition_ladder.json",
                composition_rung("fashion_mnist_500_images"),
                lambda d: [d["rungs"]["fashion_mnist_500_images"]],
            ),
            Row(
                "the same at 200 training images, easy-VQA 64 px, 150 s each",
                "benchmarks/results/composition_ladder.json",
                composition_rung("easy_vqa_200_images"),
                lambda d: [d["rungs"]["easy_vqa_200_images"]],
            ),
            Row(
                "`--lora` (adapters on the attention's query and value, at 2e-3) against full fine-tuning, easy-VQA "
                "64 px, 1,000 steps or 1,800 s each, each at scripts/train.py's rate for it, seed 1",
                "benchmarks/results/lora.json",
                lora,
                also=["benchmarks/results/lora.md"],
            ),
            Row(
                "the same on seed 42 (`--lora`'s layers and rate given as flags)",
                "benchmarks/results/lora_query_value_lr2e-3.json",
                lora,
                also=["benchmarks/results/lora_query_value_lr2e-3.md"],
            ),
            Row(
                "the same, seed 42, adapters on query and value at 1e-3 (half `--lora`'s rate)",
                "benchmarks/results/lora_query_value.json",
                lora,
                also=["benchmarks/results/lora_query_value.md"],
            ),
            Row(
                "the same, seed 42, adapters on every layer at 1e-3 (`--lora_target_modules all`: `--lora` when this "
                "ran)",
                "benchmarks/results/lora_all_layers.json",
                lora,
                also=["benchmarks/results/lora_all_layers.md"],
            ),
            Row(
                "LoRA at `--learning_rate 1e-3`, the same run",
                "benchmarks/results/lora_lr1e-3.json",
                lora_lr,
                also=["benchmarks/results/lora_lr1e-3.md"],
            ),
            Row(
                "LoRA against full fine-tuning on the composition, Fashion-MNIST 96 px, 260 steps, seed 0",
                "benchmarks/results/lora_composition.json",
                lora_composition,
                lambda d: d["runs"],
                ["benchmarks/results/lora_composition.md"],
            ),
            Row(
                "peak memory of `--lora` at ViT-B/16 + BERT-base size, 224 px, batch 16",
                "benchmarks/results/lora_memory.json",
                lora_memory,
                also=["benchmarks/results/lora_memory.md"],
            ),
            Row(
                "easy-VQA from ImageNet MobileNetV2 against the same tower from scratch",
                "benchmarks/results/recorded.json",
                mobilenet_first_look,
                recorded("easy_vqa_mobilenet_v2"),
                ["benchmarks/results/easy_vqa_mobilenet_v2.md"],
            ),
        ],
    ),
    (
        "Fashion-MNIST",
        [
            Row(
                "`scripts/configs/fashion_mnist_classify.yaml`",
                "benchmarks/results/fashion_mnist_classify.json",
                fashion_classify,
                also=["benchmarks/results/fashion_mnist_classify.md"],
            ),
            Row(
                "`fashion_mnist_classify.yaml`, one change at a time (the Fashion-MNIST ladder)",
                "benchmarks/results/fashion_mnist_ladder.json",
                fashion_ladder,
                lambda d: d["rows"],
            ),
            Row(
                "ImageNet MobileNetV2 + all-MiniLM-L6-v2 (frozen) on `fashion_mnist_classify.yaml`: 64 px, the stem "
                "and first two stages frozen, 1,500 steps at 5e-4, the batch norms recalibrated at the last step",
                "benchmarks/results/fashion_mnist_ladder.json",
                fashion_pretrained,
                fashion_pretrained_rows,
            ),
            Row(
                "`scripts/configs/fashion_mnist_pretrain.yaml`, 10,000 test photos",
                "benchmarks/results/fashion_mnist.json",
                fashion_pretrain,
                also=["benchmarks/results/fashion_mnist.md"],
            ),
        ],
    ),
    (
        "Sort-of-CLEVR",
        [
            Row(
                "`scripts/configs/sort_of_clevr.yaml` (FiLM), 12 epochs",
                "benchmarks/results/sort_of_clevr.json",
                lambda d: soc_pair(d, "film", "film_seed_1"),
                keyed_entries("film", "film_seed_1"),
                ["benchmarks/results/sort_of_clevr.md"],
            ),
            Row(
                "the same towers without FiLM, and the ablations",
                "benchmarks/results/sort_of_clevr.json",
                soc_ablations,
                keyed_entries("late", "image_only", "text_only"),
                ["benchmarks/results/sort_of_clevr.md"],
            ),
            Row(
                "`scripts/configs/sort_of_clevr_hierarchical.yaml` (cross-attention), 8 epochs",
                "benchmarks/results/sort_of_clevr.json",
                lambda d: soc_pair(d, "hierarchical", "hierarchical_seed_1"),
                keyed_entries("hierarchical", "hierarchical_seed_1"),
                ["benchmarks/results/sort_of_clevr.md"],
            ),
            Row(
                "the same with `--fusion_type cross_attention`, seed 0",
                "benchmarks/results/sort_of_clevr.json",
                soc_cross_attention,
                keyed_entries("cross_attention"),
                ["benchmarks/results/sort_of_clevr.md"],
            ),
            Row(
                "the cross-attention recipe with the tower's reads from stage 2, seed 0",
                "benchmarks/results/sort_of_clevr_reads_from_stage_2.json",
                soc_stage_2,
            ),
            Row(
                "a ViT tower with hierarchical fusion (the recipe at commit 11a0c7d), 12 epochs",
                "benchmarks/results/sort_of_clevr.json",
                soc_vit,
                keyed_entries("vit_hierarchical", "vit_late"),
                ["benchmarks/results/sort_of_clevr.md"],
            ),
            Row(
                "contrastive pretraining on the captions, then VQA (ViT tower)",
                "benchmarks/results/sort_of_clevr.json",
                soc_pretraining,
                keyed_entries("pretrain", "finetune_pretrained", "finetune_scratch"),
                ["benchmarks/results/sort_of_clevr.md"],
            ),
        ],
    ),
    (
        "Where the model looked (maps)",
        [
            Row(
                "Sort-of-CLEVR, the cross-attention recipe's two 8-epoch models, 1,000 held-out images",
                "benchmarks/results/pointing.json",
                pointing_soc,
                keyed_entries("hierarchical", "hierarchical_seed_1"),
                ["benchmarks/results/pointing.md"],
            ),
            Row(
                "Sort-of-CLEVR, the cross-attention recipe stopped at 4 epochs, three seeds, 1,000 held-out images",
                "benchmarks/results/pointing.json",
                pointing_soc_4_epochs,
                keyed_entries(*FOUR_EPOCHS),
                ["benchmarks/results/pointing.md"],
            ),
            Row(
                "Sort-of-CLEVR, the 4-epoch models' candidate maps, 600 questions of 100 held-out images each",
                "research/results/map_ladder.json",
                map_ladder,
                keyed_entries("seed_0", "seed_1", "seed_2"),
            ),
            Row(
                "Sort-of-CLEVR, the fusion layer per head on the five models of the recipe, 600 questions each",
                "research/results/map_ladder.json",
                map_ladder_heads,
                lambda d: [
                    {"command": e["heads_command"], "date": e["heads_date"], "machine": e["machine"]}
                    for e in keyed_entries("seed_0", "seed_1", "seed_2", "seed_0_8_epochs", "seed_1_8_epochs")(d)
                ],
            ),
            Row(
                "Sort-of-CLEVR, seed 0 of the 8-epoch recipe along its run, a checkpoint every half epoch, 300 "
                "questions each",
                "research/results/map_ladder_trajectory.json",
                map_trajectory,
            ),
            Row(
                "easy-VQA, the default run's model (seed 42), 9,673 test questions",
                "benchmarks/results/pointing.json",
                pointing_easy_vqa,
                keyed_entries("easy_vqa_default_seed_42"),
                ["benchmarks/results/pointing.md"],
            ),
            Row(
                "Sort-of-CLEVR, the FiLM and late models at epoch 6",
                "benchmarks/results/pointing.json",
                pointing_film_late,
                keyed_entries("film_epoch_6", "late_epoch_6"),
                ["benchmarks/results/pointing.md"],
            ),
        ],
    ),
    (
        "Checking a user's table",
        [
            Row(
                "`scripts/train.py --check_data` on a 10,000-row CSV with 8 planted bad rows",
                "benchmarks/results/data_check.json",
                data_check,
                also=["benchmarks/results/data_check.md"],
            ),
        ],
    ),
    (
        "Sort-of-CLEVR, the model alone (`scripts/research/sort_of_clevr_ladder.py`)",
        [
            Row(
                "small contenders against mm_fusion's models, 4,000 steps on 3,000 images",
                "research/results/sort_of_clevr_ladder_runs.json",
                ladder_runs,
                also=["research/results/sort_of_clevr_ladder_runs.md"],
            ),
            Row(
                "the recipe's cross-attention model over five seeds, one host",
                "research/results/sort_of_clevr_ladder_seeds.json",
                ladder_seeds,
                also=["research/results/sort_of_clevr_ladder_seeds.md"],
            ),
            Row(
                "eight seeds a model on a GPU",
                "research/results/sort_of_clevr_ladder_eight_seeds_h100.json",
                ladder_h100,
                also=["research/results/sort_of_clevr_ladder_eight_seeds_h100.md"],
            ),
            Row(
                "the words' own queries, five seeds",
                "research/results/sort_of_clevr_ladder_words_queries.json",
                ladder_words,
                also=["research/results/sort_of_clevr_ladder_words_queries.md"],
            ),
        ],
    ),
]


# --------------------------------------------------------------------------------------------------------------------
# The page.


def link(path: str) -> str:
    """A link from scripts/benchmarks/RESULTS.md to scripts/PATH."""
    target = path.removeprefix("benchmarks/") if path.startswith("benchmarks/") else f"../{path}"
    return f"[{Path(path).name}]({target})"


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def dates(values: list[str]) -> str:
    found = sorted({d for v in values for d in DATE.findall(str(v))})
    if not found:
        return ""
    return found[0] if len(found) == 1 else f"{found[0]} to {found[-1]}"


def row_cells(row: Row, root: Path) -> list[str]:
    data = json.loads((root / row.file).read_text())
    entries = row.entries(data)
    groups = [[e] for e in entries] or [[]]
    commands = sorted({str(command(data, g)) for g in groups if command(data, g)})
    when = dates([provenance(data, g, ("date", "measured")) or "" for g in groups])
    machines = sorted({describe_machine(m) for g in groups if (m := provenance(data, g, ("machine",)))})
    files = [row.file, *row.also]
    return [
        cell(row.what),
        cell(row.figure(data)),
        cell("; ".join(f"`{c}`" for c in commands)),
        when,
        cell("; ".join(machines)),
        ", ".join(link(p) for p in files),
    ]


def page(root: Path = SCRIPTS) -> str:
    lines = [
        "# Results",
        "",
        "Generated by `python scripts/benchmarks/results_page.py` from the JSON files in [results/](results/) and",
        "[../research/results/](../research/results/): edit the JSON, not this page. What each benchmark measures and",
        "how: [README.md](README.md). Compare figures within a row: rows ran on different machines and days.",
        "Figures that no benchmark script wrote are kept by hand in [recorded.json](results/recorded.json).",
    ]
    for title, rows in SECTIONS:
        lines += [
            "",
            f"## {title}",
            "",
            "| what | figure | command | date | machine | results |",
            "|---|---|---|---|---|---|",
        ]
        lines += ["| " + " | ".join(row_cells(row, root)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(PAGE), help="Where to write the page (default: %(default)s).")
    parser.add_argument("--check", action="store_true", help="Only compare the page with --output; exit 1 if stale.")
    args = parser.parse_args(argv)
    text, output = page(), Path(args.output)
    if args.check:
        if not output.is_file() or output.read_text() != text:
            print(f"{output} is not what the JSON files give: run python scripts/benchmarks/results_page.py")
            return 1
        return 0
    output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
