"""The Sort-of-CLEVR generator (answers recomputed from the scene, images checked against it), its training paths."""

import io
import json
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
from helpers.training import TINY, correct_by_hand, train
from PIL import Image

from mm_fusion.data import load_sort_of_clevr
from mm_fusion.data.sort_of_clevr import COLOURS, _rows
from mm_fusion.training import parse_arguments, setup_run, train_and_save


ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(num_train_images=60, num_test_images=20, seed=3)


@pytest.fixture(scope="module")
def data():
    return load_sort_of_clevr(**SMALL)


def expected_answer(objects, question, image_size=64):
    """The answer, worked out here from the scene and the question's words, apart from the generator's code."""
    colour = next(c for c in COLOURS if f" {c} object" in question)
    index = [o["colour"] for o in objects].index(colour)
    positions = np.array([[o["x"], o["y"]] for o in objects], dtype=float)
    distances = np.sqrt(((positions - positions[index]) ** 2).sum(axis=1))
    distances[index] = np.nan
    shapes = [o["shape"] for o in objects]
    if question.startswith("What is the shape of the object closest"):
        return shapes[int(np.nanargmin(distances))]
    if question.startswith("What is the shape of the object furthest"):
        return shapes[int(np.nanargmax(distances))]
    if question.startswith("What is the shape of the"):
        return shapes[index]
    if question.startswith("How many objects"):
        return str(shapes.count(shapes[index]))
    if question.endswith("on the left?"):
        return "yes" if objects[index]["x"] * 2 < image_size else "no"
    if question.endswith("at the top?"):
        return "yes" if objects[index]["y"] * 2 < image_size else "no"
    raise AssertionError(f"unexpected question {question!r}")


def test_named_object_masks_cover_the_named_colour(data):
    """The map checks' targets: the square of the object each question names, on the processor's image size (the 64
    px scenes served at 32 px here)."""
    from mm_fusion.training.map_checks import sort_of_clevr_masks

    test = data["test"].select(range(12))
    masks = sort_of_clevr_masks(test["question"], test["objects"], (32, 32), (64, 64), object_size=10)
    assert masks.shape == (12, 32, 32) and ((masks.sum((-1, -2)) >= 16) & (masks.sum((-1, -2)) <= 36)).all()
    for row, mask in zip(test, masks):
        colour = next(c for c in COLOURS if f" {c} object" in row["question"])
        small = np.asarray(row["image"].convert("RGB").resize((32, 32), Image.NEAREST))
        named = (small == COLOURS[colour]).all(-1)
        assert named[mask.numpy()].mean() > 0.5 and not named[~mask.numpy()].any()


def test_training_checks_where_the_map_points(tmp_path):
    """A Sort-of-CLEVR run reports its default map's pointing on the named objects of the non-relational questions."""
    options = "num_train_images=24,num_test_images=8,seed=5"
    argv = ["--dataset", "sort_of_clevr", "--dataset_options", options, "--output_dir", str(tmp_path / "vqa")]
    results = train_and_save(setup_run([*argv, *TINY, "--max_steps", "2"]))
    assert {"eval_map_on_object", "eval_map_answer_changes_at_peak", "eval_map_answer_changes_at_random"} <= set(
        results
    )
    assert all(0 <= results[k] <= 1 for k in results if k.startswith("eval_map_"))


def test_answers_match_the_scene(data):
    for split in ("train", "test"):
        names = data[split].features["answer"].names
        rows = data[split].remove_columns("image")
        assert len(rows) == 6 * SMALL[f"num_{split}_images"]
        for row in rows:
            assert names[row["answer"]] == expected_answer(row["objects"], row["question"]), row
            relational = row["question_family"] in ("closest", "furthest", "count")
            assert row["question_type"] == ("relational" if relational else "non_relational")


def test_scenes_are_unambiguous_and_do_not_overlap(data):
    for objects in data["train"].remove_columns("image")["objects"][::6]:
        assert [o["colour"] for o in objects] == list(COLOURS)
        for a, b in combinations(objects, 2):  # 10-pixel objects: their boxes must not touch
            assert max(abs(a["x"] - b["x"]), abs(a["y"] - b["y"])) >= 12
        for anchor in objects:
            d = sorted(np.hypot(o["x"] - anchor["x"], o["y"] - anchor["y"]) for o in objects if o is not anchor)
            assert d[1] - d[0] >= 2 and d[-1] - d[-2] >= 2


def test_images_show_the_scene(data):
    data = data["test"].cast_column("image", data["test"].features["image"].__class__(decode=False))
    for row in data.select(range(0, len(data), 6)):
        image = np.asarray(Image.open(io.BytesIO(row["image"]["bytes"])).convert("RGB"))
        assert image.shape == (64, 64, 3)
        painted = (image != 255).any(axis=2)
        for o in row["objects"]:
            colour = COLOURS[o["colour"]]
            assert tuple(image[o["y"], o["x"]]) == colour
            corner = tuple(image[o["y"] - 5, o["x"] - 5])  # a square fills its corner, a circle does not
            assert (corner == colour) == (o["shape"] == "square"), o
        # Nothing is painted away from the objects.
        mask = np.zeros_like(painted)
        for o in row["objects"]:
            mask[o["y"] - 5 : o["y"] + 5, o["x"] - 5 : o["x"] + 5] = True
        assert not (painted & ~mask).any()


def test_captions_are_unique_and_describe_the_scene():
    captions = load_sort_of_clevr(rows="captions", **SMALL)
    train, test = (captions[s].remove_columns("image") for s in ("train", "test"))
    assert len(train) == SMALL["num_train_images"] and len(test) == SMALL["num_test_images"]
    everything = list(train["caption"]) + list(test["caption"])
    assert len(set(everything)) == len(everything)
    for row in train:
        for o in row["objects"]:
            row_word = ["top", "middle", "bottom"][o["y"] * 3 // 64]
            column_word = ["left", "centre", "right"][o["x"] * 3 // 64]
            where = (
                "the centre" if (row_word, column_word) == ("middle", "centre") else f"the {row_word} {column_word}"
            )
            assert f"{o['colour']} {o['shape']} at {where}" in row["caption"]


def test_generation_is_deterministic_and_seeded():
    options = dict(SMALL, num_objects=6, image_size=64, object_size=10, min_distance_gap=2.0, version=1)

    def rows(**changes):
        return [json.dumps({k: v for k, v in r.items() if k != "image"}) + str(hash(r["image"]["bytes"]))
                for r in _rows("test", "questions", questions_per_family=1, **{**options, **changes})]  # fmt: skip

    assert rows() == rows()
    assert rows() != rows(seed=4)


def test_sizes_and_bad_options():
    small = load_sort_of_clevr(["test"], num_train_images=5, num_test_images=4, num_objects=3, questions_per_family=2)
    assert list(small) == ["test"] and len(small["test"]) == 4 * 6 * 2
    assert small["test"].features["answer"].names == ["square", "circle", "yes", "no", "1", "2", "3"]
    with pytest.raises(ValueError, match="splits"):
        load_sort_of_clevr(["validation"])
    with pytest.raises(ValueError, match="num_objects"):
        load_sort_of_clevr(num_objects=7)
    with pytest.raises(ValueError, match="rows"):
        load_sort_of_clevr(rows="pairs")


def test_training_reports_accuracy_per_question_type(tmp_path):
    options = "num_train_images=24,num_test_images=8,seed=5"
    argv = ["--dataset", "sort_of_clevr", "--dataset_options", options, "--output_dir", str(tmp_path / "vqa")]
    trainer = setup_run([*argv, *TINY, "--max_steps", "2"])
    results = train_and_save(trainer)
    # Each figure is the accuracy within its type or family, counted by hand from the model's logits.
    correct = correct_by_hand(trainer)
    assert len(correct) == 8 * 6 and results["eval_accuracy"] == pytest.approx(correct.mean())
    for column in ("question_type", "question_family"):
        values = np.asarray(trainer.eval_dataset[column])
        assert len(set(values)) == (2 if column == "question_type" else 6)
        for value in set(values):
            assert results[f"eval_accuracy_{value}"] == pytest.approx(correct[values == value].mean()), value


def test_pretraining_reads_the_captions(tmp_path):
    options = "num_train_images=24,num_test_images=8,seed=5"
    argv = ["--dataset", "sort_of_clevr", "--dataset_options", options, "--task", "pretrain"]
    trainer = setup_run([*argv, "--output_dir", str(tmp_path / "pre"), *TINY])
    assert len(trainer.train_dataset) == 24 and len(trainer.eval_dataset) == 8
    captions = load_sort_of_clevr(["train"], rows="captions", num_train_images=24, num_test_images=8, seed=5)
    processor = trainer.processing_class  # tokenizes as training did, truncated to the training length
    expected = processor(text=list(captions["train"]["caption"]), padding=False, return_tensors=None)["input_ids"]
    assert [list(ids) for ids in trainer.train_dataset["input_ids"]] == expected


def test_dataset_options_errors(tmp_path):
    argv = ["--dataset", "sort_of_clevr", "--output_dir", str(tmp_path / "x"), *TINY]
    with pytest.raises(ValueError, match="unknown option"):
        setup_run([*argv, "--dataset_options", "num_images=3"])
    with pytest.raises(ValueError, match="for --dataset sort_of_clevr"):
        setup_run(["--dataset_options", "seed=1", "--output_dir", str(tmp_path / "y"), *TINY])


def test_too_many_images_for_the_distinct_captions_is_an_error():
    # Two objects have at most 2 x 2 shapes x 9 x 9 cells = 324 captions, fewer where they cannot share a cell.
    with pytest.raises(ValueError, match="distinct captions"):
        load_sort_of_clevr(["test"], num_train_images=400, num_test_images=10, num_objects=2)


def test_finetuning_from_a_pretraining_checkpoint_starts_from_its_towers(tmp_path):
    import torch
    from safetensors.torch import load_file

    options = "num_train_images=24,num_test_images=8,seed=5"
    common = ["--dataset", "sort_of_clevr", "--dataset_options", options, *TINY]
    pre = tmp_path / "pre"
    train([*common, "--task", "pretrain", "--output_dir", str(pre), "--max_steps", "2"])
    vqa = tmp_path / "vqa"
    flags = ["--model_name_or_path", str(pre), "--output_dir", str(vqa), "--max_steps", "1", "--learning_rate", "0"]
    train([*common, *flags])
    before, after = load_file(pre / "model.safetensors"), load_file(vqa / "model.safetensors")
    towers = [k for k in after if k.startswith("mm_fusion.") and "projection" not in k]
    assert towers and all(torch.equal(before[k], after[k]) for k in towers)  # started from the pretrained weights
    config = json.loads((vqa / "config.json").read_text())
    assert config["architectures"] == ["MMFusionForImageTextClassification"] and len(config["id2label"]) == 10


@pytest.mark.parametrize(
    "name", ["sort_of_clevr", "sort_of_clevr_hierarchical", "sort_of_clevr_pretrain", "sort_of_clevr_short"]
)
def test_shipped_recipes_parse(name):
    model_args, data_args, training_args = parse_arguments([str(ROOT / "scripts" / "configs" / f"{name}.yaml")])
    assert data_args.dataset == "sort_of_clevr" and "num_train_images=10000" in data_args.dataset_options
    assert model_args.task == ("pretrain" if name.endswith("pretrain") else "vqa")
    if name.endswith("pretrain"):
        assert training_args.gradient_accumulation_steps == 4 and training_args.itc_grad_cache
    if name in ("sort_of_clevr_pretrain", "sort_of_clevr_short"):  # as measured; scripts/train.py's default is one
        assert model_args.vision_tower == "vit" and model_args.fusion_layers == 2


def test_hierarchical_recipe_launches_the_model_it_describes(tmp_path):
    """scripts/configs/sort_of_clevr_hierarchical.yaml, on a few images for two steps: the ResNet's stages reading the
    question by cross-attention, then one text-to-image layer reading the last stage's tokens (no second linear map
    after their projection) with the words' own queries, the head on the text stream alone."""
    recipe = str(ROOT / "scripts" / "configs" / "sort_of_clevr_hierarchical.yaml")
    flags = ["--dataset_options", "num_train_images=16,num_test_images=4,seed=5", "--max_steps", "2"]
    trainer = setup_run([recipe, *flags, "--output_dir", str(tmp_path), "--disable_tqdm", "True"])
    train_and_save(trainer)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["fusion_type"] == "hierarchical" and config["fusion_direction"] == "text_to_image"
    assert config["vision_text_attention"] is True and not config["vision_film"]
    assert config["num_fusion_layers"] == 1 and config["vision_bridge_layers"] == [3]
    assert config["vision_config"]["model_type"] == "resnet" and len(config["vision_config"]["hidden_sizes"]) == 3
    reads = trainer.model.mm_fusion.vision_encoder.vision_text_attention.reads
    assert len(reads) == 3  # every stage after the stem reads
    assert config["text_bridge_layers"] == ["words"] and config["fusion_layer_order"] == "cross_first"
    assert config["joint_pooling"] == "text" and config["feature_map_bridge"] is False
    assert config["vision_position_embedding"] == "sine_attention"
    assert trainer.state.global_step == 2
