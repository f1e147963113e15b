"""Collation of prepared pairs: padding to the longest, uint8 images read once, ids, the alignment check, per-batch
augmentation, uint8 normalisation in the model, and Trainer's length grouping on the `length` column."""

import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Trainer, TrainingArguments

from mm_fusion import MMFusionForImageTextClassification, train_tokenizer
from mm_fusion.data import AlignmentError, ImageTextCollator, load_image, load_pairs, prepare_dataset


SIZE = 30
WORDS = "what color is the shape in this picture and does it contain a circle or not".split()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """200 questions of 1 to 16 words about 8 images (25 questions each), 3 labels."""
    root = tmp_path_factory.mktemp("pairs")
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (20 + i, 24, 3), dtype=np.uint8)).save(root / f"{i}.png")
    rows = [
        {"id": f"q{j}", "image": f"{j % 8}.png", "question": " ".join(WORDS[: 1 + (j * 7) % 16]), "label": j % 3}
        for j in range(200)
    ]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = train_tokenizer([r["question"] for r in rows], vocab_size=100)
    data = prepare_dataset(
        load_pairs(root / "pairs.jsonl"),
        tokenizer,
        image_column="image",
        text_column="question",
        id_column="id",
        label_column="label",
        image_size=SIZE,
        data_root=str(root),
    )
    return {"data": data, "tokenizer": tokenizer, "rows": {r["id"]: r for r in rows}, "root": str(root)}


def test_collator_pads_to_longest_and_reads_each_image_once(prepared):
    data, tokenizer = prepared["data"], prepared["tokenizer"]
    collator = ImageTextCollator(data.images, pad_token_id=tokenizer.pad_token_id)
    features = [data.pairs[i] for i in (0, 8, 3, 16, 5)]  # q0, q8 and q16 share image 0.png
    batch = collator(features)

    assert batch["sample_ids"] == ["q0", "q8", "q3", "q16", "q5"]
    assert batch["pixel_values"].dtype == torch.uint8 and batch["pixel_values"].shape == (3, 3, SIZE, SIZE)
    assert batch["image_index"].tolist() == [0, 0, 1, 0, 2]
    lengths = [len(f["input_ids"]) for f in features]
    assert batch["input_ids"].shape == (5, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert (batch["input_ids"][batch["attention_mask"] == 0] == tokenizer.pad_token_id).all()
    assert batch["labels"].tolist() == [f["labels"] for f in features]
    for i, sample_id in enumerate(batch["sample_ids"]):
        row = prepared["rows"][sample_id]
        image = load_image(row["image"], prepared["root"]).resize((SIZE, SIZE), Image.BILINEAR)
        expected = torch.from_numpy(np.asarray(image).transpose(2, 0, 1).copy())
        assert torch.equal(batch["pixel_values"][batch["image_index"][i]], expected)
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        assert ids == tokenizer(row["question"]).input_ids

    unshared = ImageTextCollator(data.images, share_images=False)(features)
    assert "image_index" not in unshared and unshared["pixel_values"].shape == (5, 3, SIZE, SIZE)
    assert torch.equal(unshared["pixel_values"], batch["pixel_values"][batch["image_index"]])
    assert ImageTextCollator(data.images, pad_to_multiple_of=8)(features)["input_ids"].shape[1] % 8 == 0


def test_collator_reads_the_rows_datasets_would_from_every_chunk_and_in_workers(prepared):
    """The collator gathers image rows from the table's Arrow chunks itself (datasets' gather rebuilds the Array3D
    type per row): the pixels and keys must be those datasets returns, for a table of several chunks, for one with an
    indices mapping, and in data loader workers, which get the collator pickled without its gathered columns."""
    from datasets import concatenate_datasets

    data = prepared["data"]
    chunked = concatenate_datasets(
        [data.images.select(range(0, 3)), data.images.select(range(3, 5)), data.images.select(range(5, 8))]
    )
    assert chunked.data.column("pixel_values").num_chunks == 3
    reversed_rows = data.images.select(range(7, -1, -1))  # an indices mapping
    features = [data.pairs[i] for i in (7, 0, 3, 4, 15, 2, 5, 6)]
    for images in (data.images, chunked, reversed_rows):
        expected = torch.tensor(
            np.asarray(images.with_format("numpy")[[f["image_index"] for f in features]]["pixel_values"]),
            dtype=torch.uint8,
        )
        batch = ImageTextCollator(images, check_alignment=images is not reversed_rows)(features)
        assert torch.equal(batch["pixel_values"][batch["image_index"]], expected)
    collator = ImageTextCollator(chunked)
    collator(features)  # its gathered columns built in this process ...
    loader = torch.utils.data.DataLoader(
        [data.pairs[i] for i in range(40)], batch_size=8, collate_fn=collator, num_workers=2
    )
    in_workers = list(loader)
    assert collator._columns is not None and pickle.loads(pickle.dumps(collator))._columns is None  # ... not sent
    in_process = [collator([data.pairs[i] for i in range(j, j + 8)]) for j in range(0, 40, 8)]
    for a, b in zip(in_workers, in_process):
        assert torch.equal(a["pixel_values"], b["pixel_values"]) and a["sample_ids"] == b["sample_ids"]
    with pytest.raises(IndexError, match=r"Image rows \[8\] out of range for the images table's 8 rows"):
        collator._rows([0, 8])


def test_alignment_check_catches_an_images_table_that_does_not_belong(prepared):
    data = prepared["data"]
    features = [data.pairs[i] for i in range(6)]
    ImageTextCollator(data.images)(features)  # the right table passes
    shuffled = data.images.shuffle(seed=0)
    with pytest.raises(AlignmentError, match=r"Sample 'q\d+' was paired with image 'path:\d\.png'"):
        ImageTextCollator(shuffled)(features)
    filtered = data.images.select(range(1, len(data.images)))  # one image dropped: every later row shifts by one
    with pytest.raises(AlignmentError, match="does not belong to these pairs"):
        ImageTextCollator(filtered)(features)
    # With the check off, the same wrong table silently gives other images: the check is what makes it visible.
    wrong = ImageTextCollator(filtered, check_alignment=False)(features)
    right = ImageTextCollator(data.images)(features)
    assert not torch.equal(wrong["pixel_values"], right["pixel_values"][: len(wrong["pixel_values"])])


def test_collator_names_missing_columns(prepared):
    data = prepared["data"]
    trimmed = data.pairs.remove_columns(["id", "image_key"])
    with pytest.raises(ValueError, match=r"lacks \['id', 'image_key'\].*remove_unused_columns=False"):
        ImageTextCollator(data.images)([trimmed[0]])
    with pytest.raises(ValueError, match=r"lacks the columns \['image_key'\]"):
        ImageTextCollator(data.images.remove_columns("image_key"))
    with pytest.raises(ValueError, match="empty list of pairs"):
        ImageTextCollator(data.images)([])


def test_augmentation_runs_per_batch_on_uint8_and_never_touches_the_cache(prepared):
    data = prepared["data"]
    generator = torch.Generator().manual_seed(0)

    def random_flip(image: torch.Tensor) -> torch.Tensor:
        assert image.dtype == torch.uint8 and image.shape == (3, SIZE, SIZE)
        return image.flip(-1) if torch.rand((), generator=generator) < 0.5 else image

    features = [data.pairs[i] for i in range(8)]
    plain = ImageTextCollator(data.images)(features)["pixel_values"]
    augmenting = ImageTextCollator(data.images, image_transform=random_flip)
    draws = [augmenting(features)["pixel_values"] for _ in range(4)]
    assert all(d.dtype == torch.uint8 for d in draws)
    assert any(not torch.equal(a, b) for a, b in zip(draws, draws[1:]))  # a new draw per batch (= per epoch)
    for draw in draws:
        for image, original in zip(draw, plain):
            assert torch.equal(image, original) or torch.equal(image, original.flip(-1))
    assert torch.equal(ImageTextCollator(data.images)(features)["pixel_values"], plain)  # stored pixels unchanged


def test_photo_augmentation_flips_and_shifts_each_image_with_its_edges_repeated(prepared):
    """`--augment photo`: one call on the batch's distinct images; each image is itself or its mirror image, moved by
    at most an eighth of its side, what the move uncovers filled with the edge pixels next to it."""
    from mm_fusion.training.data import image_transform

    augment = image_transform("photo")
    assert augment.batched and image_transform("none") is None
    torch.manual_seed(0)
    images = torch.randint(0, 256, (200, 3, 48, 40), dtype=torch.uint8)
    out = augment(images)
    assert out.dtype == torch.uint8 and out.shape == images.shape
    flipped = 0
    for image, moved in zip(images, out):
        found = None
        for mirror in (image, image.flip(-1)):
            for dy in range(-5, 6):  # an eighth of the shorter side, 40 px
                for dx in range(-5, 6):
                    rows = (torch.arange(48) - dy).clamp(0, 47)
                    cols = (torch.arange(40) - dx).clamp(0, 39)
                    if torch.equal(mirror[:, rows][:, :, cols], moved):
                        found = mirror is not image
        assert found is not None, "not a flip and a shift of its image"
        flipped += found
    assert 70 < flipped < 130  # half the time
    # Through the collator: the batch's distinct images, a new draw every batch, the cache untouched.
    data = prepared["data"]
    features = [data.pairs[i] for i in range(8)]
    plain = ImageTextCollator(data.images)(features)["pixel_values"]
    collator = ImageTextCollator(data.images, image_transform=augment)
    draws = [collator(features)["pixel_values"] for _ in range(3)]
    assert all(d.shape == plain.shape and d.dtype == torch.uint8 for d in draws)
    assert not torch.equal(draws[0], draws[1]) and torch.equal(
        ImageTextCollator(data.images)(features)["pixel_values"], plain
    )


def test_model_normalises_uint8_pixels_on_its_device(tester):
    model = MMFusionForImageTextClassification(tester.config(image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3]))
    model.eval()
    inputs = tester.inputs()
    pixels = torch.randint(0, 256, inputs["pixel_values"].shape, dtype=torch.uint8)
    mean, std = torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1), torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1)
    normalised = (pixels.float() / 255 - mean) / std
    with torch.no_grad():
        from_uint8 = model(**{**inputs, "pixel_values": pixels}).logits
        from_float = model(**{**inputs, "pixel_values": normalised}).logits
    torch.testing.assert_close(from_uint8, from_float, rtol=0, atol=1e-6)


def test_collated_batches_train_with_trainer_length_grouping(prepared, tester, tmp_path):
    """The collator's batches go through Trainer unchanged (ids ignored by the model, uint8 normalised inside), and
    `train_sampling_strategy="group_by_length"` reads the `length` column: less padding than random batches."""
    data, tokenizer = prepared["data"], prepared["tokenizer"]
    config = tester.config(
        vision_config=tester.vision_config(image_size=SIZE), text_config=tester.text_config(vocab_size=100)
    )
    config.num_labels = 3
    model = MMFusionForImageTextClassification(config)
    collator = ImageTextCollator(data.images, pad_token_id=tokenizer.pad_token_id)

    def padded_fraction(strategy: str) -> float:
        args = TrainingArguments(
            output_dir=str(tmp_path / strategy),
            per_device_train_batch_size=8,
            train_sampling_strategy=strategy,
            remove_unused_columns=False,
            report_to="none",
            use_cpu=True,
            max_steps=2,
            seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data.pairs, data_collator=collator)
        batches = list(trainer.get_train_dataloader())
        assert sorted(i for b in batches for i in b["sample_ids"]) == sorted(data.pairs["id"])
        if strategy == "random":
            trainer.train()
            assert all(np.isfinite(h["train_loss"]) for h in trainer.state.log_history if "train_loss" in h)
        masks = [b["attention_mask"] for b in batches]
        return 1 - sum(m.sum().item() for m in masks) / sum(m.numel() for m in masks)

    grouped, shuffled = padded_fraction("group_by_length"), padded_fraction("random")
    assert grouped < shuffled / 2, (grouped, shuffled)
