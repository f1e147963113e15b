"""Data pipeline: sources, validation against a planted corpus of bad files, alignment of what is kept."""

import collections
import io
import json
import os

import numpy as np
import pytest
import torch
from datasets import Array3D, Dataset, DatasetDict, Features, Value, concatenate_datasets
from datasets import Image as ImageFeature
from PIL import Image

from mm_fusion import train_tokenizer
from mm_fusion.data import ImageTextCollator, load_easy_vqa, load_image, load_pairs, prepare_dataset, uint8_pixels


SIZE = 16


def _png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


@pytest.fixture
def corpus(tmp_path):
    """A data root with one file of every kind the validator must accept or refuse, and a jsonl of pairs."""
    root = tmp_path / "data"
    root.mkdir()
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8))
    rgba = Image.new("RGBA", (20, 20), (255, 0, 0, 255))
    rgba.putpixel((0, 0), (0, 0, 0, 0))  # fully transparent: must come out white
    palette = Image.new("P", (20, 20), 1)
    palette.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    palette.info["transparency"] = 0
    good_files = {
        "rgb.png": _png_bytes(noise),
        "rgba.png": _png_bytes(rgba),
        "la.png": _png_bytes(Image.new("LA", (20, 20), (128, 255))),
        "palette.png": _png_bytes(palette),
        "cmyk.jpg": _png_bytes(Image.new("CMYK", (20, 20), (0, 255, 255, 0)), "JPEG"),
        "i16.png": _png_bytes(Image.fromarray(np.full((20, 20), 65535, dtype=np.uint16))),
        "gray.png": _png_bytes(Image.new("L", (20, 20), 77)),
        "sub/nested.png": _png_bytes(noise),
    }
    full = _png_bytes(noise)
    bad_files = {
        "truncated.png": full[: len(full) // 2],
        "not_an_image.png": b"this is a text file, not a picture",
        "empty.png": b"",
        "huge.png": _png_bytes(Image.new("RGB", (120, 100))),  # over the 10,000-pixel limit set below
    }
    for name, data in {**good_files, **bad_files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (tmp_path / "outside.png").write_bytes(full)
    os.symlink(tmp_path / "outside.png", root / "link_outside.png")

    rows = [{"id": f"ok-{name}", "image": name, "text": f"question about {name}", "label": i % 3}
            for i, name in enumerate(good_files)]  # fmt: skip
    expected_bad = {
        "bad-truncated": ("truncated.png", "truncated"),
        "bad-notimage": ("not_an_image.png", "not_an_image"),
        "bad-empty": ("empty.png", "empty_file"),
        "bad-huge": ("huge.png", "too_large"),
        "bad-missing": ("nowhere.png", "missing_image"),
        "bad-escape": ("../outside.png", "path_outside_root"),
        "bad-symlink": ("link_outside.png", "path_outside_root"),
    }
    rows += [{"id": i, "image": f, "text": "a question", "label": 0} for i, (f, _) in expected_bad.items()]
    rows += [
        {"id": "bad-empty-text", "image": "rgb.png", "text": "   ", "label": 0},
        {"id": "bad-no-text", "image": "rgb.png", "text": None, "label": 0},
        {"id": "bad-no-label", "image": "rgb.png", "text": "a question", "label": None},
        {"id": "dup", "image": "rgb.png", "text": "first of two rows sharing an id", "label": 1},
        {"id": "dup", "image": "gray.png", "text": "second of two rows sharing an id", "label": 2},
    ]
    expected_bad.update(
        {
            "bad-empty-text": ("rgb.png", "bad_text"),
            "bad-no-text": ("rgb.png", "bad_text"),
            "bad-no-label": ("rgb.png", "bad_label"),
        }
    )
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = train_tokenizer([r["text"] for r in rows if isinstance(r["text"], str)], vocab_size=200)
    return {"root": str(root), "pairs": pairs, "rows": rows, "bad": expected_bad, "tokenizer": tokenizer}


def _prepare(corpus, data=None, **kwargs):
    dataset = load_pairs(corpus["pairs"]) if data is None else data
    args = dict(
        image_column="image",
        text_column="text",
        id_column="id",
        label_column="label",
        image_size=SIZE,
        data_root=corpus["root"],
        max_pixels=10_000,
    )
    return prepare_dataset(dataset, corpus["tokenizer"], **{**args, **kwargs})


def test_planted_bad_files_are_quarantined_with_reasons(corpus, tmp_path):
    report = tmp_path / "quarantine.jsonl"
    prepared = _prepare(corpus, quarantine_path=report)
    clean, quarantine = prepared.pairs, prepared.quarantine

    reasons = {q["id"]: q["reason"].split(":", 1)[0] for q in quarantine}
    expected = {i: reason for i, (_, reason) in corpus["bad"].items()}
    expected["dup"] = "duplicate_id"
    assert {k: v for k, v in reasons.items() if k != "dup"} == {k: v for k, v in expected.items() if k != "dup"}
    # The first row with an id is kept; the repeat is left out, and its reason points at the row kept.
    repeats = [q for q in quarantine if q["id"] == "dup"]
    assert len(repeats) == 1 and repeats[0]["source"] == "gray.png"
    assert repeats[0]["reason"].startswith("duplicate_id") and "row 18, which is kept" in repeats[0]["reason"]
    sources = {q["id"]: q["source"] for q in quarantine}
    assert sources["bad-truncated"] == "truncated.png" and sources["bad-escape"] == "../outside.png"

    on_disk = [json.loads(line) for line in report.read_text().splitlines()]
    assert on_disk == quarantine
    assert all(set(q) == {"id", "source", "reason", "line"} for q in on_disk)
    # Each entry names the line of pairs.jsonl its row is on (row i on line i + 1).
    assert all(q["line"] == [r["id"] for r in corpus["rows"]].index(q["id"]) + 1 for q in on_disk if q["id"] != "dup")

    good_ids = [r["id"] for r in corpus["rows"] if r["id"].startswith("ok-")] + ["dup"]
    assert clean["id"] == good_ids  # every good row kept, in order
    assert clean["input_ids"][-1] == corpus["tokenizer"]("first of two rows sharing an id")["input_ids"]
    assert len(clean) + len(quarantine) == len(corpus["rows"])


def test_kept_rows_stay_aligned(corpus):
    """After bad rows are left out, each kept pair's image, ids and label still come from the same input row."""
    prepared = _prepare(corpus)
    tokenizer = corpus["tokenizer"]
    rows = {}
    for r in corpus["rows"]:
        rows.setdefault(r["id"], r)  # of rows sharing an id, the first is the one kept
    images = prepared.images
    # Stored as uint8 in Arrow (datasets' numpy/torch formatters upcast integers to int64 when reading).
    assert images.features["pixel_values"] == Array3D(shape=(3, SIZE, SIZE), dtype="uint8")
    assert "uint8" in str(images.data.column("pixel_values").type.storage_type)
    pixels = uint8_pixels(images.data.column("pixel_values"), (3, SIZE, SIZE))
    for example in prepared.pairs:
        row = rows[example["id"]]
        image = load_image(row["image"], corpus["root"]).resize((SIZE, SIZE), Image.BILINEAR)
        assert np.array_equal(pixels[example["image_index"]], np.asarray(image).transpose(2, 0, 1))
        assert example["image_key"] == images[example["image_index"]]["image_key"] == f"path:{row['image']}"
        assert example["input_ids"] == tokenizer(row["text"]).input_ids  # unpadded
        assert example["length"] == len(example["input_ids"])
        assert example["labels"] == row["label"]


def test_each_distinct_image_is_stored_once(corpus):
    prepared = _prepare(corpus)
    distinct = {r["image"] for r in corpus["rows"]}
    assert len(prepared.images) == len(distinct)  # rgb.png is used by 5 rows, stored once
    assert len(set(prepared.images["image_key"])) == len(distinct)


def test_odd_modes_become_rgb(corpus):
    root = corpus["root"]
    assert load_image("rgba.png", root).getpixel((0, 0)) == (255, 255, 255)  # transparent -> white
    assert load_image("rgba.png", root).getpixel((5, 5)) == (255, 0, 0)
    assert load_image("palette.png", root).getpixel((0, 0)) == (0, 255, 0)
    assert load_image("i16.png", root).getpixel((0, 0)) == (255, 255, 255)  # 16-bit full scale -> 255, not clipped
    # 12-bit sensor data in a 16-bit PNG (0-4095): read against 4095, not 65535, which turned it nearly black.
    values = np.linspace(0, 4095, 20).astype(np.uint16)
    twelve_bit = np.asarray(load_image(_png_bytes(Image.fromarray(np.tile(values, (20, 1))))))
    assert np.array_equal(twelve_bit[7, :, 1], np.round(values / 4095 * 255)) and twelve_bit.max() == 255
    assert load_image("gray.png", root).getpixel((3, 3)) == (77, 77, 77)
    for name in ("la.png", "cmyk.jpg", "rgb.png"):
        assert load_image(name, root).mode == "RGB"


def test_on_bad_sample_error_raises_with_counts(corpus):
    with pytest.raises(ValueError, match=r"11 of 20 rows are unusable \(.*truncated: 1.*\)"):
        _prepare(corpus, on_bad_sample="error")
    with pytest.raises(ValueError, match="on_bad_sample must be one of skip, error"):
        _prepare(corpus, on_bad_sample="ignore")


def test_unknown_column_lists_available_ones(corpus):
    with pytest.raises(ValueError, match=r"text_column='caption' is not a column.*\['id', 'image', 'text', 'label'\]"):
        _prepare(corpus, text_column="caption")


def test_in_memory_image_column_with_a_corrupt_image(corpus):
    """An `Image` column is read undecoded, so a corrupt entry reaches the quarantine instead of crashing."""
    good = Image.new("RGB", (30, 30), (1, 2, 3))
    dataset = Dataset.from_dict(
        {
            "image": [{"bytes": _png_bytes(good), "path": None}, {"bytes": b"garbage", "path": None}],
            "text": ["a", "b"],
        },
        features=Features({"image": ImageFeature(), "text": Value("string")}),
    )
    prepared = prepare_dataset(dataset, corpus["tokenizer"], image_size=SIZE)
    assert prepared.pairs["id"] == ["0"] and [q["id"] for q in prepared.quarantine] == ["1"]
    assert prepared.quarantine[0]["reason"].startswith("not_an_image")
    assert prepared.pairs["image_key"][0].startswith("sha1:")


def test_imagefolder_with_metadata(tmp_path, corpus):
    folder = tmp_path / "folder"
    folder.mkdir()
    for i in range(3):
        Image.new("RGB", (20, 20), (i, i, i)).save(folder / f"{i}.png")
    (folder / "metadata.jsonl").write_text(
        "".join(json.dumps({"file_name": f"{i}.png", "text": f"img {i}"}) + "\n" for i in range(3))
    )
    prepared = prepare_dataset(load_pairs(folder), corpus["tokenizer"], image_size=SIZE)
    assert len(prepared.pairs) == 3 and not prepared.quarantine
    row = prepared.pairs[2]["image_index"]
    assert uint8_pixels(prepared.images.data.column("pixel_values"), (3, SIZE, SIZE))[row].max() == 2


def test_easy_vqa_source():
    data = load_easy_vqa()
    assert (len(data["train"]), len(data["test"])) == (38_575, 9_673)
    assert len(set(data["train"]["image_id"])) == 4_000 and len(set(data["test"]["image_id"])) == 1_000
    answers = data["train"].features["answer"]
    assert answers.num_classes == 13 and "yes" in answers.names
    assert len(set(data["train"]["id"])) == len(data["train"])
    row = data["train"][0]
    assert os.path.isfile(row["image"]) and row["image"].endswith(f"{row['image_id']}.png")
    # Every question has its type, and the types are the four question templates of easy-VQA.
    types = collections.Counter(data["test"]["question_type"])
    assert set(types) == {"shape", "color", "yes_no_shape", "yes_no_color"} and sum(types.values()) == 9_673
    examples = {row["question_type"]: (row["question"], answers.int2str(row["answer"])) for row in data["train"]}
    assert examples["yes_no_shape"][1] in ("yes", "no") and any(
        shape in examples["yes_no_shape"][0] for shape in ("circle", "rectangle", "triangle")
    )
    assert examples["shape"][1] in ("circle", "rectangle", "triangle") and examples["color"][1] not in ("yes", "no")


def test_easy_vqa_cache_follows_the_installed_package(monkeypatch, tmp_path):
    # The rows hold absolute paths: a cache written by an install elsewhere (another venv) must not be reused.
    import easy_vqa

    package = os.path.dirname(os.path.abspath(easy_vqa.__file__))
    paths = easy_vqa.get_test_image_paths()
    before = load_easy_vqa(["test"])["test"][0]["image"]
    assert before.startswith(package)
    moved = str(tmp_path / "elsewhere")
    monkeypatch.setattr(easy_vqa, "__file__", os.path.join(moved, "__init__.py"))
    monkeypatch.setattr(
        easy_vqa, "get_test_image_paths", lambda: {k: v.replace(package, moved) for k, v in paths.items()}
    )
    assert load_easy_vqa(["test"])["test"][0]["image"] == before.replace(package, moved)


def test_preprocessing_is_cached_by_a_stable_fingerprint(corpus):
    """The same data, settings and (re-trained, identical) tokenizer give the same fingerprint, so the Arrow cache
    is reused; another image size gives another."""
    texts = [r["text"] for r in corpus["rows"] if isinstance(r["text"], str)]
    retrained = train_tokenizer(texts, vocab_size=200)
    assert retrained.get_vocab() == corpus["tokenizer"].get_vocab()  # tokenizer training is deterministic here
    first = _prepare(corpus)
    again = _prepare({**corpus, "tokenizer": retrained})
    for table in ("pairs", "images"):
        assert getattr(again, table)._fingerprint == getattr(first, table)._fingerprint
        assert getattr(again, table).cache_files[0] == getattr(first, table).cache_files[0]
    other = _prepare(corpus, image_size=SIZE * 2)
    assert other.images._fingerprint != first.images._fingerprint


def test_quarantine_report_is_rewritten_even_when_empty(corpus, tmp_path):
    """A clean run writes an empty report, so a report left by an earlier run cannot be mistaken for this one's."""
    report = tmp_path / "quarantine.jsonl"
    _prepare(corpus, quarantine_path=report)
    assert len(report.read_text().splitlines()) == 11
    good = load_pairs(corpus["pairs"]).filter(lambda row: row["id"].startswith("ok-"))
    prepared = prepare_dataset(
        good, corpus["tokenizer"], id_column="id", image_size=SIZE, data_root=corpus["root"], quarantine_path=report
    )
    assert not prepared.quarantine and report.read_text() == ""


def test_dataset_dict_shares_one_images_table(corpus):
    """Splits that use the same picture point to one row of one images table; the report names the split."""
    pairs = load_pairs(corpus["pairs"])
    gray_again = pairs.select([6]).map(lambda row: {"id": "gray-again"})  # row 6 (train) asks about gray.png too
    test = concatenate_datasets([pairs.select(range(1, 20, 2)), gray_again])
    data = DatasetDict({"train": pairs.select(range(0, 20, 2)), "test": test})
    prepared = _prepare({**corpus}, data=data)
    assert set(prepared.pairs) == {"train", "test"}
    assert len(prepared.images) == len({r["image"] for r in corpus["rows"]})
    train_gray = {row["image_index"] for row in prepared.pairs["train"] if row["image_key"] == "path:gray.png"}
    test_gray = {row["image_index"] for row in prepared.pairs["test"] if row["image_key"] == "path:gray.png"}
    assert len(train_gray) == 1 and train_gray == test_gray
    splits = {q["id"]: q["split"] for q in prepared.quarantine}
    assert splits["bad-truncated"] == "train" and splits["bad-notimage"] == "test"
    # Ids are unique across splits: "dup" is kept in train (its first row) and its repeat in test is left out.
    assert "dup" in prepared.pairs["train"]["id"] and splits["dup"] == "test"
    reason = next(q["reason"] for q in prepared.quarantine if q["id"] == "dup")
    assert reason.startswith("duplicate_id") and "row 9 of the train split, which is kept" in reason
    assert sum(len(s) for s in prepared.pairs.values()) + len(prepared.quarantine) == len(corpus["rows"]) + 1


@pytest.mark.parametrize("image_format", ["jpeg", "webp"])
def test_compressed_images_table_feeds_the_collator(corpus, image_format):
    """`image_format` jpeg / webp: the images table holds encoded bytes, far fewer than raw, and the collator
    decodes them to the raw table's pixels (exactly for lossless WebP)."""
    raw = _prepare(corpus, image_format="uint8")
    packed = _prepare(corpus, image_format=image_format)
    assert "image_bytes" in packed.images.column_names and "pixel_values" not in packed.images.column_names
    assert packed.pairs["id"] == raw.pairs["id"] and packed.quarantine == raw.quarantine
    features = [packed.pairs[i] for i in range(len(packed.pairs))]
    batch = ImageTextCollator(packed.images)(features)
    expected = ImageTextCollator(raw.images)([raw.pairs[i] for i in range(len(raw.pairs))])
    assert batch["pixel_values"].shape == expected["pixel_values"].shape
    difference = (batch["pixel_values"].int() - expected["pixel_values"].int()).abs().float().mean().item()
    assert difference == 0 if image_format == "webp" else difference < 8
    assert torch.equal(batch["input_ids"], expected["input_ids"])


def test_auto_image_format_picks_by_the_size_of_the_raw_table():
    from mm_fusion.data import choose_image_format

    assert choose_image_format("auto", 5_000, 64) == "uint8"  # easy-VQA: 60 MB raw
    assert choose_image_format("auto", 1_000_000, 224) == "jpeg"  # 150 GB raw
    assert choose_image_format("webp", 10, 64) == "webp"
    with pytest.raises(ValueError, match="image_format"):
        choose_image_format("png", 10, 64)
