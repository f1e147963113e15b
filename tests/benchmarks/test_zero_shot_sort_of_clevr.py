"""scripts/benchmarks/zero_shot_sort_of_clevr.py: the flipped captions, and its accuracies against a count by hand."""

import json

import pytest
import torch
import zero_shot_sort_of_clevr as zero_shot  # scripts/benchmarks is on sys.path (conftest.py)
from helpers.training import TINY, train

from mm_fusion import MMFusionForPretraining, MMFusionProcessor
from mm_fusion.data import load_sort_of_clevr


OPTIONS = "num_train_images=24,num_test_images=8,seed=5"


def test_flipped_captions_change_one_object():
    objects = [
        {"colour": "red", "shape": "square", "x": 5, "y": 5},
        {"colour": "green", "shape": "circle", "x": 40, "y": 50},
    ]
    assert zero_shot.flipped_captions(objects, 64) == [
        "a red circle at the top left, a green circle at the bottom centre.",
        "a red square at the top left, a green square at the bottom centre.",
    ]


@torch.no_grad()
def count_by_hand(model, processor, test) -> tuple[int, int]:
    """Pairs where the true caption beats a flipped one, by ITC similarity and by ITM: one image and one caption at a
    time (the script batches captions and repeats images)."""
    itc = itm = 0
    for row in test:
        pixels = processor(images=[row["image"]], return_tensors="pt")["pixel_values"]
        image = torch.nn.functional.normalize(model.mm_fusion.get_image_features(pixels).pooler_output, dim=-1)[0]

        def similarity_and_match(caption: str) -> tuple[float, float]:
            text = processor(text=[caption], return_tensors="pt")
            features = model.mm_fusion.get_text_features(text["input_ids"], text["attention_mask"]).pooler_output
            match = model(pixel_values=pixels, **text, return_loss=False).itm_logits.softmax(-1)[0, 1]
            return float(image @ torch.nn.functional.normalize(features, dim=-1)[0]), float(match)

        true_sim, true_match = similarity_and_match(row["caption"])
        for caption in zero_shot.flipped_captions(row["objects"], 64):  # the generator's image size
            sim, match = similarity_and_match(caption)
            itc += true_sim > sim
            itm += true_match > match
    return itc, itm


def test_zero_shot_accuracies_equal_a_count_pair_by_pair(tmp_path):
    pre = tmp_path / "pre"
    argv = ["--dataset", "sort_of_clevr", "--dataset_options", OPTIONS, "--task", "pretrain", *TINY]
    train([*argv, "--output_dir", str(pre), "--max_steps", "2"])
    scores = zero_shot.main(["--model", str(pre), "--dataset_options", OPTIONS, "--output", str(tmp_path / "z.json")])
    assert json.loads((tmp_path / "z.json").read_text())["pairs"] == scores["pairs"] == 8 * 6  # each object, once

    model = MMFusionForPretraining.from_pretrained(pre).eval()
    processor = MMFusionProcessor.from_pretrained(pre)
    test = load_sort_of_clevr(["test"], rows="captions", num_train_images=24, num_test_images=8, seed=5)["test"]
    itc, itm = count_by_hand(model, processor, test)
    assert scores["zero_shot_itc_accuracy"] == pytest.approx(itc / 48)
    assert scores["zero_shot_itm_accuracy"] == pytest.approx(itm / 48)
