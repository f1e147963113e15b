"""Fashion-MNIST read from IDX files (made here, gzipped or not, damaged as real downloads are), its rows, its training
paths, and the Debian package's real files when they are installed (.ci/run installs them)."""

import gzip
import io
import os

import numpy as np
import pytest
from helpers.data import idx_bytes, make_photos, write_fashion_mnist
from helpers.training import TINY, correct_by_hand, train_and_save
from PIL import Image

from mm_fusion.data import load_fashion_mnist
from mm_fusion.data.fashion_mnist import (
    CAPTION_TEMPLATES,
    CLASS_NAMES,
    FASHION_MNIST_DIR,
    QUESTION_TEMPLATES,
    ZERO_SHOT_TEMPLATE,
    FashionMNISTError,
    read_split,
    vocabulary_texts,
)
from mm_fusion.training import setup_run


@pytest.fixture
def root(tmp_path):
    """A directory like the Debian package's: train files gzipped, test files plain (both are read)."""
    return write_fashion_mnist(tmp_path / "fashion-mnist")


def class_of(image) -> int:
    """The class drawn by make_photos, read from the decoded photo."""
    pixels = np.asarray(image.convert("L"))
    return (int(np.argmax(pixels[:, 4:24].mean(axis=1))) - 4) // 2


def test_question_rows_match_the_photos(root):
    data = load_fashion_mnist(root=str(root), seed=2)
    images, labels = make_photos(24, 0)
    train = data["train"]
    assert len(train) == 2 * 24 and len(data["test"]) == 2 * 8
    names = train.features["answer"].names
    yes_no_products = set()
    for row in train:
        index = row["image_id"]
        assert np.array_equal(np.asarray(row["image"]), images[index])  # the photo, losslessly
        product = CLASS_NAMES[labels[index]]
        assert row["product"] == product and class_of(row["image"]) == labels[index]
        if row["question_type"] == "what":
            assert row["question"] in QUESTION_TEMPLATES and names[row["answer"]] == product
        else:
            named = next(n for n in sorted(CLASS_NAMES, key=len, reverse=True) if f" {n}?" in row["question"])
            yes_no_products.add(named == product)
            assert names[row["answer"]] == ("yes" if named == product else "no"), row["question"]
    assert yes_no_products == {True, False}
    assert len(set(train["id"])) == len(train)
    again = load_fashion_mnist(["train"], root=str(root), seed=2)["train"]
    assert again["question"] == train["question"]  # the same arguments, the same rows
    other = load_fashion_mnist(["train"], root=str(root), seed=3)["train"]
    assert other["question"] != train["question"]


def test_caption_rows_never_use_the_zero_shot_template(root):
    data = load_fashion_mnist(root=str(root), rows="captions", max_images=5)
    assert len(data["train"]) == 5 and len(data["test"]) == 5
    _, labels = make_photos(24, 0)
    for row in data["train"]:
        product = CLASS_NAMES[labels[row["image_id"]]]
        assert row["caption"] in [t.format(product) for t in CAPTION_TEMPLATES]
        assert row["label"] == labels[row["image_id"]]
    assert ZERO_SHOT_TEMPLATE not in CAPTION_TEMPLATES
    assert not any(t.format(name) in vocabulary_texts() for t in [ZERO_SHOT_TEMPLATE] for name in CLASS_NAMES)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing", r"t10k-images-idx3-ubyte\[\.gz\] not found.*apt-get install dataset-fashion-mnist"),
        ("truncated_gzip", "cannot read .*train-images-idx3-ubyte.gz"),
        ("truncated", "declares shape .* truncated or damaged"),
        ("magic", "not an IDX file of 1-dimensional unsigned bytes"),
        ("count", "has 24 images but .* has 23 labels"),
        ("label", "labels outside 0-9 .*row 3: 10"),
    ],
)
def test_damaged_files_name_the_file_and_the_fault(root, damage, message):
    images_gz, labels_gz = root / "train-images-idx3-ubyte.gz", root / "train-labels-idx1-ubyte.gz"
    images, labels = make_photos(24, 0)
    if damage == "missing":
        (root / "t10k-images-idx3-ubyte").unlink()
    elif damage == "truncated_gzip":  # a download cut short
        images_gz.write_bytes(images_gz.read_bytes()[:200])
    elif damage == "truncated":
        images_gz.write_bytes(gzip.compress(idx_bytes(images)[:-28]))
    elif damage == "magic":  # the images' file where the labels' should be
        labels_gz.write_bytes(images_gz.read_bytes())
    elif damage == "count":
        labels_gz.write_bytes(gzip.compress(idx_bytes(labels[:23])))
    elif damage == "label":
        labels = labels.copy()
        labels[3] = 10
        labels_gz.write_bytes(gzip.compress(idx_bytes(labels)))
    with pytest.raises(FashionMNISTError, match=message):
        load_fashion_mnist(root=str(root))


def test_no_directory_names_the_install_command(tmp_path):
    with pytest.raises(FashionMNISTError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist(root=str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="splits"):
        load_fashion_mnist(["validation"], root=str(tmp_path))
    with pytest.raises(ValueError, match="rows"):
        load_fashion_mnist(rows="pairs", root=str(tmp_path))


def test_training_reports_accuracy_per_question_type(root, tmp_path):
    argv = ["--dataset", "fashion_mnist", "--dataset_options", f"root={root}", "--output_dir", str(tmp_path / "vqa")]
    trainer = setup_run([*argv, *TINY, "--max_steps", "2"])
    results = train_and_save(trainer)
    correct = correct_by_hand(trainer)
    assert len(correct) == 2 * 8 and results["eval_accuracy"] == pytest.approx(correct.mean())
    values = np.asarray(trainer.eval_dataset["question_type"])
    for value in ("what", "yes_no"):
        assert results[f"eval_accuracy_{value}"] == pytest.approx(correct[values == value].mean()), value


def test_pretraining_reads_the_captions(root, tmp_path):
    argv = ["--dataset", "fashion_mnist", "--dataset_options", f"root={root}", "--task", "pretrain"]
    trainer = setup_run([*argv, "--output_dir", str(tmp_path / "pre"), *TINY, "--max_steps", "1"])
    assert len(trainer.train_dataset) == 24 and len(trainer.eval_dataset) == 8
    captions = load_fashion_mnist(["train"], rows="captions", root=str(root))["train"]["caption"]
    expected = trainer.processing_class(text=list(captions), padding=False, return_tensors=None)["input_ids"]
    assert [list(ids) for ids in trainer.train_dataset["input_ids"]] == expected
    with pytest.raises(ValueError, match="unknown option"):
        setup_run([*argv, "--dataset_options", "num_train_images=3", "--output_dir", str(tmp_path / "x"), *TINY])


@pytest.mark.skipif(
    not os.path.isdir(FASHION_MNIST_DIR), reason="apt-get install dataset-fashion-mnist (.ci/run installs it)"
)
def test_the_debian_package_files():
    """The real photographs: 60,000 / 10,000, 6,000 / 1,000 of each class, as the dataset's paper states."""
    for split, count in (("train", 60_000), ("test", 10_000)):
        images, labels = read_split(FASHION_MNIST_DIR, split)
        assert images.shape == (count, 28, 28) and images.dtype == np.uint8
        assert np.bincount(labels, minlength=10).tolist() == [count // 10] * 10
        assert 0 < images.mean() < 255 and images.std() > 30  # photographs, not blank
    row = load_fashion_mnist(["test"], root=FASHION_MNIST_DIR, max_images=1)["test"][0]
    buffer = io.BytesIO()
    row["image"].save(buffer, format="PNG")
    assert Image.open(buffer).size == (28, 28)


@pytest.mark.parametrize("name", ["fashion_mnist_classify", "fashion_mnist_pretrain"])
def test_shipped_recipes_parse(name):
    """The settings the results were measured with (tests/benchmarks/test_benchmark_fashion_mnist.py launches both)."""
    from pathlib import Path

    from mm_fusion.training import parse_arguments

    config = Path(__file__).resolve().parents[1] / "scripts" / "configs" / f"{name}.yaml"
    model_args, data_args, training_args = parse_arguments([str(config)])
    assert data_args.dataset == "fashion_mnist" and model_args.vision_tower == "resnet"
    classify = name.endswith("classify")
    assert model_args.task == ("classify" if classify else "pretrain")
    assert data_args.image_size == (48 if classify else 32)
    assert training_args.num_train_epochs == (3.5 if classify else 5)
    assert training_args.learning_rate == (1e-3 if classify else 5e-4)
