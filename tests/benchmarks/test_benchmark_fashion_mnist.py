"""scripts/benchmarks/benchmark_fashion_mnist.py: both recipes launched as a user launches them (on IDX files made
here, a tiny model, two steps), and its zero-shot and retrieval figures against a count by hand."""

import json

import benchmark_fashion_mnist as bench  # scripts/benchmarks is on sys.path (conftest.py)
import numpy as np
import pytest
import torch
from helpers.data import write_fashion_mnist
from helpers.training import TINY_MODEL

from mm_fusion import MMFusionForPretraining, MMFusionProcessor
from mm_fusion.data.fashion_mnist import CLASS_NAMES, ZERO_SHOT_TEMPLATE


@torch.no_grad()
def count_by_hand(model_dir, photos, products, captions) -> tuple[float, dict]:
    """Zero-shot top-1 and retrieval recall by product, one photo and one text at a time."""
    model = MMFusionForPretraining.from_pretrained(model_dir).eval()
    processor = MMFusionProcessor.from_pretrained(model_dir)

    def image(photo):
        pixels = processor(images=[photo], return_tensors="pt")["pixel_values"]
        return torch.nn.functional.normalize(model.mm_fusion.get_image_features(pixels).pooler_output, dim=-1)[0]

    def text(words):
        ids = processor(text=[words], return_tensors="pt")
        features = model.mm_fusion.get_text_features(ids["input_ids"], ids["attention_mask"]).pooler_output
        return torch.nn.functional.normalize(features, dim=-1)[0]

    images = [image(p) for p in photos]
    prompts = [text(ZERO_SHOT_TEMPLATE.format(name)) for name in CLASS_NAMES]
    zero_shot = np.mean([int(np.argmax([float(i @ p) for p in prompts])) == y for i, y in zip(images, products)])
    texts = [text(c) for c in captions]
    distinct = [captions.index(c) for c in dict.fromkeys(captions)]  # each distinct caption text's first row
    recall = {}
    for k in (1, 5):
        hits_t2i = hits_i2t = 0
        for j in range(len(photos)):
            by_photo = sorted(range(len(photos)), key=lambda i: -float(texts[j] @ images[i]))[:k]
            hits_t2i += any(products[i] == products[j] for i in by_photo)
            by_caption = sorted(distinct, key=lambda i: -float(texts[i] @ images[j]))[:k]  # distinct texts
            hits_i2t += any(products[i] == products[j] for i in by_caption)
        recall[f"text_to_image_R@{k}"] = hits_t2i / len(photos)
        recall[f"image_to_text_R@{k}"] = hits_i2t / len(photos)
    return float(zero_shot), recall


def test_both_recipes_run_and_their_figures_match_a_count_by_hand(tmp_path, monkeypatch):
    root = write_fashion_mnist(tmp_path / "fashion-mnist", train=24, test=12)
    kept = {}
    real = bench.evaluate_pretrained

    def keep(model_dir, *photos):
        kept["model"] = tmp_path / "kept"
        import shutil

        shutil.copytree(model_dir, kept["model"])
        kept["photos"] = photos
        return real(model_dir, *photos)

    monkeypatch.setattr(bench, "evaluate_pretrained", keep)
    small = " ".join([*TINY_MODEL, "--max_steps", "2", "--per_device_train_batch_size", "8"])
    output = tmp_path / "report"
    result = bench.main(["--seeds", "0", "--root", str(root), "--train_args", small, "--output", str(output)])
    classify, pretrain = result["runs"]
    assert classify["recipe"] == "classify" and pretrain["recipe"] == "pretrain"
    assert "scripts/configs/fashion_mnist_classify.yaml" in classify["command"]
    # The classify run evaluated every test question: 2 per photo, and each kind.
    metrics = classify["metrics"]
    assert {"eval_accuracy", "eval_accuracy_what", "eval_accuracy_yes_no"} <= metrics.keys()
    evaluation = pretrain["eval"]
    assert evaluation["test_photos"] == 12 and np.asarray(evaluation["zero_shot_confusion"]).sum() == 12
    zero_shot, recall = count_by_hand(kept["model"], *kept["photos"])
    assert evaluation["zero_shot_top1"] == pytest.approx(zero_shot)
    assert evaluation["retrieval"] == pytest.approx(recall)
    saved = json.loads(output.with_name("report.json").read_text())
    assert saved["runs"][1]["eval"]["zero_shot_top1"] == evaluation["zero_shot_top1"]
    text = output.with_name("report.md").read_text()
    assert "**classify**" in text and "**pretrain**" in text and "FAIL" in text  # two steps reach no target
    assert output.with_name("report_zero_shot_confusion.png").stat().st_size > 1000


def test_the_small_cnn_bar_trains_for_its_budget_and_counts_its_test_photos(tmp_path):
    """The bar to beat: trained in a new interpreter for its seconds of training (at least one step of 64 photos
    passes them), evaluated after each epoch on the test photos; its top-1 is a count of the test photos."""
    root = write_fashion_mnist(tmp_path / "fashion-mnist", train=200, test=40)
    output = tmp_path / "bar"
    result = bench.main(
        ["--recipes", "small_cnn", "--seeds", "0", "--root", str(root), "--small_cnn_budget_s", "1.5",
         "--output", str(output)]
    )  # fmt: skip
    (run,) = result["runs"]
    assert run["recipe"] == "small_cnn" and run["train_seconds"] >= 1.5 and run["epochs"] > 0
    evaluations = run["evaluations"]
    assert [e["epochs"] for e in evaluations] == sorted(e["epochs"] for e in evaluations)
    assert all(e["accuracy"] * 40 == pytest.approx(round(e["accuracy"] * 40)) for e in evaluations)
    assert run["accuracy"] == evaluations[-1]["accuracy"] and run["best_accuracy"] >= run["accuracy"]
    assert json.loads(output.with_suffix(".json").read_text())["runs"][0]["epochs"] == run["epochs"]
    assert "**small_cnn**" in output.with_suffix(".md").read_text()
