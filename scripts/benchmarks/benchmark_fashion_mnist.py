"""
The two Fashion-MNIST recipes (real product photographs, Debian's `dataset-fashion-mnist`), over seeds, run as a user
runs them and evaluated on the 10,000 test photos:

- `classify` (`scripts/configs/fashion_mnist_classify.yaml`): image-text classification of questions about the photo;
  test accuracy over all 20,000 test questions and per kind (`what`: which of the 10 products; `yes_no`: is it a
  named one), read from the run's own evaluation (`all_results.json`).
- `pretrain` (`scripts/configs/fashion_mnist_pretrain.yaml`): ITC + ITM on captions built from the class names, then
  - zero-shot top-1 by **transformers' own** `pipeline("zero-shot-image-classification")` on the saved model, its
    prompts in a template no training caption used (`fashion_mnist.ZERO_SHOT_TEMPLATE`);
  - retrieval Recall@1 / @5 between the test photos and their test captions, counted by product: a caption's hit
    is one of the K nearest photos showing its product; a photo's, one of its K nearest captions naming it. (Every
    product has a thousand photos and five caption texts, so recall of the one paired photo would be chance.)

- `small_cnn`, the bar to beat: a plain PyTorch CNN (two 3x3 convolutions of 32 and 64 channels, each ReLU and 2x2
  max-pooling, a hidden layer of 128, Adam at 1e-3, batches of 64), the 10-way classifier of a framework tutorial, on
  the 60,000 training photos at their 28 px, for the same 10 minutes of training on the machine's cores; its test
  top-1 over the 10,000 test photos after each epoch (not timed), read against `classify`'s `what` accuracy.

Each `classify` / `pretrain` run is `accelerate launch scripts/train.py CONFIG --seed S` in a fresh process with an
empty `datasets` cache (so each pays the photos' preprocessing, as a user's first run does), timed over its whole wall
time (the target: within 10 minutes on 2 cores); the evaluations after it are not timed. Seeds are interleaved (A B A
B).

    python scripts/benchmarks/benchmark_fashion_mnist.py --seeds 0,1   # about 40 min on 2 cores

Writes scripts/benchmarks/results/fashion_mnist.{json,md} and fashion_mnist_zero_shot_confusion.png, and prints the
report.
"""

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

import numpy as np
import torch
from benchmarking import RESULTS, ROOT, machine, markdown_table, run_in_new_interpreter, write_report
from transformers import HfArgumentParser


RECIPES = {
    "classify": "scripts/configs/fashion_mnist_classify.yaml",
    "pretrain": "scripts/configs/fashion_mnist_pretrain.yaml",
}
BASELINES = ("small_cnn",)  # not a recipe of scripts/train.py: trained here, in a new interpreter
TARGETS = {"classify": 0.93, "zero_shot": 0.85, "minutes": 10.0}


@dataclass
class FashionMNISTArguments:
    recipes: str = field(
        default="classify,pretrain", metadata={"help": f"Comma-separated, from {[*RECIPES, *BASELINES]}."}
    )
    seeds: str = field(default="0,1", metadata={"help": "Comma-separated seeds, each recipe once per seed."})
    root: str | None = field(
        default=None, metadata={"help": "The Fashion-MNIST files' directory (default: the Debian package's)."}
    )
    max_test_images: int | None = field(
        default=None, metadata={"help": "Evaluate on the first N test photos (default: all 10,000; for a test)."}
    )
    train_args: str = field(
        default="", metadata={"help": "More scripts/train.py arguments (a smaller run for a test)."}
    )
    small_cnn_budget_s: float | None = field(
        default=None, metadata={"help": "Seconds of training of small_cnn (default: the 10 minutes of the target)."}
    )
    output: str = field(default=str(RESULTS / "fashion_mnist"), metadata={"help": "Path stem of the reports."})
    keep_models: str | None = field(
        default=None,
        metadata={"help": "Keep each trained model in KEEP_MODELS/RECIPE-SEED (default: a temporary dir)."},
    )


def run_recipe(recipe: str, seed: int, output_dir: Path, extra: list[str]) -> dict:
    """One run of a recipe, as a user launches it: its wall time and its own evaluation's metrics."""
    command = [str(Path(sys.executable).with_name("accelerate")), "launch", "scripts/train.py", RECIPES[recipe]]
    command += [*extra, "--seed", str(seed), "--output_dir", str(output_dir), "--disable_tqdm", "True"]
    print("$", " ".join(command), flush=True)
    shutil.rmtree(output_dir, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as in a new user's shell
    with tempfile.TemporaryDirectory() as cache:
        env["HF_DATASETS_CACHE"] = cache  # empty: the run reads and preprocesses the photos, as a first run does
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{recipe} seed {seed} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    results = json.loads((output_dir / "all_results.json").read_text())
    return {
        "recipe": recipe,
        "seed": seed,
        "command": "accelerate launch " + " ".join(command[2:]),
        "wall_seconds": round(wall, 1),
        "train_seconds": results.get("train_runtime"),
        "metrics": {k: v for k, v in results.items() if k.startswith("eval_")},
    }


def small_cnn_trial(payload: dict) -> dict:
    """`small_cnn` (the module docstring): trained for `budget_s` seconds of training on `threads` torch threads,
    evaluated on the test photos after each epoch and at the end, outside the clock."""
    from mm_fusion.data.fashion_mnist import FASHION_MNIST_DIR, read_split

    torch.manual_seed(payload["seed"])
    torch.set_num_threads(payload["threads"])
    root = payload["root"] or FASHION_MNIST_DIR
    (train_x, train_y), (test_x, test_y) = (read_split(root, split) for split in ("train", "test"))
    if payload["max_test_images"]:
        test_x, test_y = test_x[: payload["max_test_images"]], test_y[: payload["max_test_images"]]

    def tensors(x, y):  # the photos scaled to [0, 1] and standardised by the training set's mean and deviation
        return (torch.from_numpy(x).float()[:, None] / 255 - 0.2860) / 0.3530, torch.from_numpy(y).long()

    (train_x, train_y), (test_x, test_y) = tensors(train_x, train_y), tensors(test_x, test_y)
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    @torch.no_grad()
    def accuracy() -> float:
        model.eval()
        predicted = torch.cat([model(test_x[i : i + 1000]).argmax(-1) for i in range(0, len(test_x), 1000)])
        model.train()
        return float((predicted == test_y).float().mean())

    spent, epochs, evaluations = 0.0, 0.0, []
    while spent < payload["budget_s"]:
        order = torch.randperm(len(train_x))
        for start in range(0, len(order), 64):
            began = time.perf_counter()
            batch = order[start : start + 64]
            loss = torch.nn.functional.cross_entropy(model(train_x[batch]), train_y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            spent += time.perf_counter() - began
            epochs += len(batch) / len(order)
            if spent >= payload["budget_s"]:
                break
        evaluations.append({"epochs": round(epochs, 3), "train_seconds": round(spent, 1), "accuracy": accuracy()})
    return {"evaluations": evaluations, "test_photos": len(test_x)}


def run_small_cnn(seed: int, root: str | None, max_test_images: int | None, budget_s: float) -> dict:
    threads = os.cpu_count() or 1
    payload = {"seed": seed, "root": root, "max_test_images": max_test_images, "budget_s": budget_s}
    payload["threads"] = threads
    start = time.perf_counter()
    result = run_in_new_interpreter("benchmark_fashion_mnist:small_cnn_trial", payload)
    last = result["evaluations"][-1]
    return {
        "recipe": "small_cnn",
        "seed": seed,
        "command": "benchmark_fashion_mnist.py's small_cnn_trial, in a new interpreter",
        "wall_seconds": round(time.perf_counter() - start, 1),
        "train_seconds": last["train_seconds"],
        "threads": threads,
        "epochs": last["epochs"],
        "accuracy": last["accuracy"],
        "best_accuracy": max(e["accuracy"] for e in result["evaluations"]),
        "evaluations": result["evaluations"],
    }


def test_photos(root: str | None, max_images: int | None):
    """The test split's photos (PIL), products (class indices) and captions (one per photo, the loader's)."""
    from mm_fusion.data import load_fashion_mnist

    kwargs = {"root": root} if root else {}
    rows = load_fashion_mnist(["test"], rows="captions", max_images=max_images, **kwargs)["test"]
    return list(rows["image"]), np.asarray(rows["label"]), list(rows["caption"])


@torch.no_grad()
def evaluate_pretrained(model_dir: Path, photos, products, captions) -> dict:
    """Zero-shot top-1 through transformers' stock pipeline, and retrieval Recall@1 / @5 counted by product."""
    from transformers import pipeline

    from mm_fusion import MMFusionForPretraining, MMFusionProcessor
    from mm_fusion.data.fashion_mnist import CLASS_NAMES, ZERO_SHOT_TEMPLATE

    classifier = pipeline("zero-shot-image-classification", model=str(model_dir), device=-1)
    start = time.perf_counter()
    ranked = classifier(
        photos, candidate_labels=list(CLASS_NAMES), hypothesis_template=ZERO_SHOT_TEMPLATE, batch_size=64
    )
    zero_shot_seconds = time.perf_counter() - start
    predicted = np.array([CLASS_NAMES.index(r[0]["label"]) for r in ranked])
    confusion = np.zeros((len(CLASS_NAMES), len(CLASS_NAMES)), dtype=np.int64)
    np.add.at(confusion, (products, predicted), 1)

    model = MMFusionForPretraining.from_pretrained(model_dir).eval()
    processor = MMFusionProcessor.from_pretrained(model_dir)
    image_embeds, text_embeds = [], []
    for start in range(0, len(photos), 256):
        batch = processor(images=photos[start : start + 256], text=captions[start : start + 256], return_tensors="pt")
        images = model.base_model.get_image_features(pixel_values=batch["pixel_values"])
        texts = model.base_model.get_text_features(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        )
        # The contrastive embeddings: a tensor, or a model output's pooler_output (as the pipelines read them).
        image_embeds.append(images if isinstance(images, torch.Tensor) else images.pooler_output)
        text_embeds.append(texts if isinstance(texts, torch.Tensor) else texts.pooler_output)
    images = torch.nn.functional.normalize(torch.cat(image_embeds).float(), dim=-1)
    texts = torch.nn.functional.normalize(torch.cat(text_embeds).float(), dim=-1)
    similarity = texts @ images.T  # (captions, photos); caption i is photo i's
    labels = torch.as_tensor(products)
    # A photo searches the distinct caption texts (a thousand photos share each text, and their copies would fill
    # every K); each text names the product of the photos it was written for.
    distinct = list(dict.fromkeys(captions))
    first = [captions.index(text) for text in distinct]
    recall = {}
    for k in (1, 5):
        nearest_photos = similarity.topk(k, dim=1).indices  # each caption's K nearest photos
        nearest_captions = similarity[first].T.topk(k, dim=1).indices  # each photo's K nearest distinct captions
        recall[f"text_to_image_R@{k}"] = float((labels[nearest_photos] == labels[:, None]).any(1).float().mean())
        named = labels[first][nearest_captions]
        recall[f"image_to_text_R@{k}"] = float((named == labels[:, None]).any(1).float().mean())
    return {
        "zero_shot_top1": float((predicted == products).mean()),
        "zero_shot_per_product": {
            name: float(confusion[i, i] / max(confusion[i].sum(), 1)) for i, name in enumerate(CLASS_NAMES)
        },
        "zero_shot_confusion": confusion.tolist(),
        "zero_shot_seconds": round(zero_shot_seconds, 1),
        "retrieval": recall,
        "test_photos": len(photos),
    }


def plot_confusion(confusion: np.ndarray, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mm_fusion.data.fashion_mnist import CLASS_NAMES

    rates = confusion / np.maximum(confusion.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    ax.imshow(rates, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(10), CLASS_NAMES, rotation=60, ha="right")
    ax.set_yticks(range(10), CLASS_NAMES)
    ax.set_xlabel("zero-shot prediction")
    ax.set_ylabel("product")
    for i in range(10):
        for j in range(10):
            if rates[i, j] >= 0.01:
                ax.text(j, i, f"{rates[i, j]:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if rates[i, j] > 0.5 else "black")  # fmt: skip
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def spread(values: list[float], digits: int, scale: float = 1.0) -> str:
    low, mean, high = (f"{v * scale:.{digits}f}" for v in (min(values), statistics.fmean(values), max(values)))
    return mean if len(values) == 1 else f"{mean} ({low}–{high})"


def report(runs: list[dict], info: dict) -> str:
    lines = [
        f"Fashion-MNIST, the two recipes as a user runs them; {info['cpu']}, {info['cores']} cores, torch "
        f"{info['torch']}; each run alone, in a fresh process, timed over its whole wall time (target: within "
        f"{TARGETS['minutes']:.0f} min); the evaluations after training not timed.",
        "",
    ]
    classify = [r for r in runs if r["recipe"] == "classify"]
    if classify:
        metric = lambda r, k: r["metrics"][f"eval_{k}"]  # noqa: E731
        rows = [
            [r["seed"], f"{metric(r, 'accuracy'):.4f}", f"{metric(r, 'accuracy_what'):.4f}",
             f"{metric(r, 'accuracy_yes_no'):.4f}", f"{r['wall_seconds'] / 60:.1f}"]
            for r in classify
        ]  # fmt: skip
        worst = min(min(metric(r, "accuracy"), metric(r, "accuracy_what")) for r in classify)
        slowest = max(r["wall_seconds"] for r in classify) / 60
        verdict = "PASS" if worst >= TARGETS["classify"] and slowest <= TARGETS["minutes"] else "FAIL"
        lines += [
            f"**classify** (`{RECIPES['classify']}`): test accuracy on the 20,000 test questions, and on each kind; "
            f"target >= {TARGETS['classify']} on every seed, all questions and the `what` ones alike: **{verdict}** "
            f"(worst {worst:.4f}, slowest {slowest:.1f} min).",
            "",
            markdown_table(["seed", "all", "what (10 products)", "yes / no", "wall time (min)"], rows),
            "",
        ]
    pretrain = [r for r in runs if r["recipe"] == "pretrain"]
    if pretrain:
        rows = [
            [r["seed"], f"{r['eval']['zero_shot_top1']:.4f}",
             *(f"{r['eval']['retrieval'][k]:.4f}" for k in ("text_to_image_R@1", "text_to_image_R@5",
                                                           "image_to_text_R@1", "image_to_text_R@5")),
             f"{r['wall_seconds'] / 60:.1f}"]
            for r in pretrain
        ]  # fmt: skip
        worst = min(r["eval"]["zero_shot_top1"] for r in pretrain)
        slowest = max(r["wall_seconds"] for r in pretrain) / 60
        verdict = "PASS" if worst >= TARGETS["zero_shot"] and slowest <= TARGETS["minutes"] else "FAIL"
        from mm_fusion.data.fashion_mnist import ZERO_SHOT_TEMPLATE

        lines += [
            f"**pretrain** (`{RECIPES['pretrain']}`): zero-shot top-1 by transformers' "
            f'`pipeline("zero-shot-image-classification")` on {pretrain[0]["eval"]["test_photos"]:,} test photos, '
            f"prompts `{ZERO_SHOT_TEMPLATE}` (a template no training caption used); retrieval by product (a hit: "
            "one of the K nearest photos shows, or distinct caption texts names, the same product). Target "
            f"zero-shot >= {TARGETS['zero_shot']} on "
            f"every seed: **{verdict}** (worst {worst:.4f}, slowest {slowest:.1f} min).",
            "",
            markdown_table(
                ["seed", "zero-shot top-1", "text→image R@1", "R@5", "image→text R@1", "R@5", "wall time (min)"], rows
            ),
            "",
            "Zero-shot accuracy per product (mean over seeds): "
            + ", ".join(
                f"{name} {statistics.fmean(r['eval']['zero_shot_per_product'][name] for r in pretrain):.3f}"
                for name in pretrain[0]["eval"]["zero_shot_per_product"]
            )
            + ". The confusion of the first seed: [fashion_mnist_zero_shot_confusion.png]"
            "(fashion_mnist_zero_shot_confusion.png).",
            "",
        ]
    baseline = [r for r in runs if r["recipe"] == "small_cnn"]
    if baseline:
        rows = [
            [r["seed"], f"{r['accuracy']:.4f}", f"{r['best_accuracy']:.4f}", f"{r['epochs']:.1f}",
             f"{r['train_seconds'] / 60:.1f}", r["threads"]]
            for r in baseline
        ]  # fmt: skip
        lines += [
            "**small_cnn**, the bar to beat: a two-convolution PyTorch CNN on the 28 px photos, 10-way top-1 on the "
            "test photos (`classify`'s `what` questions ask the same), trained for the same minutes.",
            "",
            markdown_table(["seed", "top-1 at the end", "best epoch", "epochs", "training (min)", "threads"], rows),
            "",
        ]
    for recipe in ("classify", "pretrain"):
        chosen = [r for r in runs if r["recipe"] == recipe]
        if chosen:
            lines.append(
                f"{recipe}: wall time {spread([r['wall_seconds'] for r in chosen], 1, 1 / 60)} min; command "
                f"`{chosen[0]['command']}`."
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(FashionMNISTArguments).parse_args_into_dataclasses(args=argv)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in (*RECIPES, *BASELINES)]
    if unknown:
        raise ValueError(f"Unknown recipes {unknown}; choose from {[*RECIPES, *BASELINES]}.")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    extra = args.train_args.split()
    if args.root:
        extra += ["--dataset_options", f"root={args.root}"]
    info, runs = machine(), []
    photos = None
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as temporary:
        work = args.keep_models or temporary
        for seed in seeds:
            for recipe in recipes:
                out = Path(work) / f"{recipe}-{seed}"
                if recipe == "small_cnn":
                    budget = TARGETS["minutes"] * 60 if args.small_cnn_budget_s is None else args.small_cnn_budget_s
                    run = run_small_cnn(seed, args.root, args.max_test_images, budget)
                else:
                    run = run_recipe(recipe, seed, out, extra)
                if recipe == "pretrain":
                    if photos is None:
                        photos = test_photos(args.root, args.max_test_images)
                    run["eval"] = evaluate_pretrained(out, *photos)
                print(json.dumps({k: v for k, v in run.items() if k != "command"}, default=str)[:600], flush=True)
                if recipe == "pretrain" and seed == seeds[0]:
                    image = Path(args.output).with_name(Path(args.output).name + "_zero_shot_confusion.png")
                    title = f"zero-shot, pretrain recipe, seed {seed}: top-1 {run['eval']['zero_shot_top1']:.3f}"
                    plot_confusion(np.asarray(run["eval"]["zero_shot_confusion"]), image, title)
                runs.append(run)
    text = report(runs, info)
    result = {"machine": info, "targets": TARGETS, "runs": runs}
    write_report(args.output, result, text)
    print(text)
    return result


if __name__ == "__main__":
    main()
