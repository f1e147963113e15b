"""
Inference speed of the pipelines against what a user would write without them, on easy-VQA test data: VQA through
the `image-text-classification` pipeline against processor + model per question, and zero-shot classification through
`cached-zero-shot-image-classification` against transformers' stock `zero-shot-image-classification`. Contenders
alternate in one process, round after round; the table gives medians (min–max over rounds). Without a trained
`--model`, random-weight models of the default run's architecture are built. Method: scripts/benchmarks/README.md.

    python scripts/benchmarks/benchmark_inference.py [--model outputs/easy_vqa] [--rounds 3]

Writes scripts/benchmarks/results/benchmark_inference.{json,md} and prints the Markdown table.
"""

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from benchmarking import RESULTS, machine, markdown_table, median_range, spread, write_report
from PIL import Image
from transformers import HfArgumentParser, pipeline

import mm_fusion
from mm_fusion.data import load_easy_vqa


@dataclass
class BenchmarkArguments:
    model: str = field(default="outputs/easy_vqa", metadata={"help": "A VQA model dir (e.g. the default run's)."})
    pretrain_model: str | None = field(default=None, metadata={"help": "A pretraining model dir for zero-shot."})
    questions: int | None = field(default=None, metadata={"help": "Test questions per round (default: all 9,673)."})
    naive_questions: int = field(default=1000, metadata={"help": "Questions per round for the naive loop."})
    map_questions: int = field(
        default=1000, metadata={"help": "Questions per round answered with and without return_map=True."}
    )
    single_questions: int = field(
        default=100, metadata={"help": "Questions per round asked one call each, with and without a map."}
    )
    zero_shot_images: int = field(default=100, metadata={"help": "Images per round for zero-shot."})
    rounds: int = field(default=3, metadata={"help": "Interleaved rounds."})
    batch_size: int = field(default=64, metadata={"help": "Pipeline batch size."})
    output_name: str = field(
        default="benchmark_inference",
        metadata={
            "help": "Name of the JSON / Markdown files in scripts/benchmarks/results (or an absolute path stem)."
        },
    )


def default_models(directory: Path) -> tuple[str, str]:
    """A VQA model and a pretraining model of the default run's architecture, random weights, saved with processors."""
    from mm_fusion.training import ModelArguments, build_config

    data = load_easy_vqa(["train"])["train"]
    answers = data.features["answer"].names
    tokenizer = mm_fusion.train_tokenizer(data["question"], vocab_size=8000)
    processor = mm_fusion.MMFusionProcessor(
        mm_fusion.MMFusionImageProcessor(size={"height": 64, "width": 64}), tokenizer, max_length=64
    )
    paths = []
    for name, labels, cls in [
        ("vqa", answers, mm_fusion.MMFusionForImageTextClassification),
        ("pretrain", None, mm_fusion.MMFusionForPretraining),
    ]:
        config = build_config(ModelArguments(vision_tower="vit"), 64, len(tokenizer), 64, labels)  # as measured
        if labels is not None:
            config.problem_type = "single_label_classification"
        cls(config).save_pretrained(directory / name)
        processor.save_pretrained(directory / name)
        paths.append(str(directory / name))
    return paths[0], paths[1]


def naive_vqa(model_dir: str, images: list[str], questions: list[str]) -> list[str]:
    """What one writes without the pipeline: processor and model, one question at a time."""
    from transformers import AutoModelForVisualQuestionAnswering, AutoProcessor

    model = AutoModelForVisualQuestionAnswering.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    answers = []
    with torch.no_grad():
        for image, question in zip(images, questions):
            batch = processor(images=[Image.open(image)], text=[question])
            answers.append(model.config.id2label[int(model(**batch).logits.argmax(-1))])
    return answers


def timed(fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def summary(rates: list[float]) -> dict:
    """`spread` of per-round rates, with the rates themselves."""
    return {**spread(rates), "rounds": rates}


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(BenchmarkArguments, allow_abbrev=False).parse_args_into_dataclasses(args=argv)
    test = load_easy_vqa(["test"])["test"]
    n = min(args.questions or len(test), len(test))
    images, questions = test["image"][:n], test["question"][:n]
    labels = test.features["answer"].names
    tmp = Path(tempfile.mkdtemp(prefix="mm_fusion_bench_"))
    vqa_dir, pretrain_dir = args.model, args.pretrain_model
    trained = os.path.isfile(os.path.join(vqa_dir, "config.json"))
    if not trained or pretrain_dir is None:
        random_vqa, random_pretrain = default_models(tmp)
        vqa_dir = vqa_dir if trained else random_vqa
        pretrain_dir = pretrain_dir or random_pretrain

    vqa = pipeline("image-text-classification", model=vqa_dir)
    cached = pipeline("cached-zero-shot-image-classification", model=pretrain_dir)
    stock = pipeline("zero-shot-image-classification", model=pretrain_dir)
    zs_images = list(dict.fromkeys(test["image"]))[: args.zero_shot_images]
    k = min(args.naive_questions, n)

    m, single = min(args.map_questions, n), min(args.single_questions, n)
    rates = {"pipeline": [], "naive": [], "cached_zero_shot": [], "stock_zero_shot": []}
    map_costs = {"batched": [], "single": []}  # time with return_map=True over time without, per round
    for r in range(args.rounds):
        seconds, answers = timed(lambda: vqa(image=images, question=questions, batch_size=args.batch_size))
        rates["pipeline"].append(n / seconds)
        # plain, mapped, mapped, plain: a drift of the machine's speed within the round cancels out of the ratio
        seconds_of = {False: 0.0, True: 0.0}
        for return_map in (False, True, True, False):
            started = time.perf_counter()
            vqa(image=images[:m], question=questions[:m], batch_size=args.batch_size, return_map=return_map)
            seconds_of[return_map] += time.perf_counter() - started
        map_costs["batched"].append(seconds_of[True] / seconds_of[False])
        plain, _ = timed(lambda: [vqa(image=i, question=q) for i, q in zip(images[:single], questions[:single])])
        mapped, _ = timed(
            lambda: [vqa(image=i, question=q, return_map=True) for i, q in zip(images[:single], questions[:single])]
        )
        map_costs["single"].append(mapped / plain)
        seconds, naive = timed(naive_vqa, vqa_dir, images[:k], questions[:k])
        rates["naive"].append(k / seconds)
        if r == 0:  # the two paths must agree before their speeds are compared
            agree = sum(a[0]["answer"] == b for a, b in zip(answers[:k], naive))
            truth = [labels[i] for i in test["answer"][:n]]
            served_accuracy = sum(a[0]["answer"] == t for a, t in zip(answers, truth)) / n
        cached._prompt_cache.clear()  # each round pays for embedding the prompts once
        seconds, fast = timed(lambda: cached(zs_images, candidate_labels=labels, batch_size=args.batch_size))
        rates["cached_zero_shot"].append(len(zs_images) / seconds)
        seconds, slow = timed(lambda: [stock(image, candidate_labels=labels) for image in zs_images])
        rates["stock_zero_shot"].append(len(zs_images) / seconds)
        if r == 0:
            zero_shot_top_agree = sum(a[0]["label"] == b[0]["label"] for a, b in zip(fast, slow))
        print(
            f"round {r + 1}: "
            + ", ".join(f"{key} {value[-1]:.1f}/s" for key, value in rates.items())
            + ", map cost "
            + ", ".join(f"{key} {value[-1]:.2f}x" for key, value in map_costs.items())
        )

    training = Path(vqa_dir) / "all_results.json"
    training_accuracy = (
        json.loads(training.read_text()).get("eval_accuracy") if trained and training.exists() else None
    )
    print(
        f"served accuracy over {n} test questions: {served_accuracy:.4f}; training's evaluation: {training_accuracy}"
    )
    result = {
        "machine": machine(),
        "settings": asdict(args),
        "models": {"vqa": vqa_dir, "pretrain": pretrain_dir, "trained_vqa": trained},
        "vqa": {"questions": n, "naive_questions": k, "answers_agree": f"{agree}/{k}",
                "served_accuracy": served_accuracy, "training_eval_accuracy": training_accuracy,
                "pipeline_questions_per_s": summary(rates["pipeline"]),
                "naive_questions_per_s": summary(rates["naive"])},
        "maps": {"batched_questions": m, "single_questions": single,
                 "batched_time_ratio": summary(map_costs["batched"]),
                 "single_time_ratio": summary(map_costs["single"])},
        "zero_shot": {"images": len(zs_images), "labels": len(labels),
                      "top_label_agrees": f"{zero_shot_top_agree}/{len(zs_images)}",
                      "cached_images_per_s": summary(rates["cached_zero_shot"]),
                      "stock_images_per_s": summary(rates["stock_zero_shot"])},
    }  # fmt: skip
    speedups = {
        "vqa": [p / q for p, q in zip(rates["pipeline"], rates["naive"])],
        "zero_shot": [p / q for p, q in zip(rates["cached_zero_shot"], rates["stock_zero_shot"])],
    }
    result["speedup"] = {key: summary(value) for key, value in speedups.items()}
    table = markdown(result)
    print(table)
    write_report(RESULTS / args.output_name, result, table)
    return result


def markdown(result: dict) -> str:
    def cell(s: dict) -> str:
        return median_range(s, 1)

    vqa, zs, up = result["vqa"], result["zero_shot"], result["speedup"]
    rounds = result["settings"]["rounds"]
    header = [
        "workload",
        "contender",
        f"throughput, median (min–max of {rounds} rounds)",
        "speed-up (per-round ratio)",
    ]
    cells = [
        [
            f"VQA, {vqa['questions']} test questions",
            "`image-text-classification` pipeline",
            f"{cell(vqa['pipeline_questions_per_s'])} questions/s",
            f"{cell(up['vqa'])}×",
        ],
        [
            f"VQA, first {vqa['naive_questions']}",
            "processor + model per question",
            f"{cell(vqa['naive_questions_per_s'])} questions/s",
            "1×",
        ],
        [
            f"zero-shot, {zs['images']} images × {zs['labels']} labels",
            "`cached-zero-shot-image-classification`",
            f"{cell(zs['cached_images_per_s'])} images/s",
            f"{cell(up['zero_shot'])}×",
        ],
        [
            "zero-shot, same",
            "stock `zero-shot-image-classification`",
            f"{cell(zs['stock_images_per_s'])} images/s",
            "1×",
        ],
    ]
    lines = [markdown_table(header, cells)]
    maps = result.get("maps")
    if maps is not None:
        lines.append(
            f"\nWhere the model looked (`return_map=True`, the default map), its cost: the time of the answers with "
            f"maps over the time without, **{median_range(maps['batched_time_ratio'], 2)}×** for "
            f"{maps['batched_questions']} questions in batches, **{median_range(maps['single_time_ratio'], 2)}×** "
            f"for {maps['single_questions']} questions asked one call each (target: 3× or less)."
        )
    if vqa["training_eval_accuracy"] is not None:
        lines.append(
            f"\nServed accuracy through the pipeline over the {vqa['questions']} test questions, read from the "
            f"original image files: **{vqa['served_accuracy']:.4f}**; the training run's final evaluation: "
            f"**{vqa['training_eval_accuracy']:.4f}**. Pipeline and naive loop agree on {vqa['answers_agree']} "
            "answers."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
