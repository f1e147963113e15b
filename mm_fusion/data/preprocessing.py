"""Validate and preprocess image-text pairs once, by batched `Dataset.map`, into uint8 pixels and unpadded ids.

Each distinct image is decoded once, however many pairs share it: the same pass checks it (missing, empty,
truncated, not an image, too large, path outside the data root), converts odd modes to RGB and resizes it. Rows that
fail are kept out of training and reported, never dropped silently: they go to a quarantine list (id, source, reason)
with counts per reason.
"""

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from accelerate import PartialState
from datasets import Array3D, ClassLabel, Dataset, DatasetDict, Features, List, Value, concatenate_datasets
from datasets import Image as ImageFeature
from datasets.fingerprint import Hasher

from ..image_processing_mm_fusion import MAX_IMAGE_PIXELS, BadSample, load_image, to_pixels
from .image_codec import choose_image_format, encode_pixels
from .labels import class_names, label_name
from .tables import LINE_COLUMN, DataError


logger = logging.getLogger(__name__)

ON_BAD_SAMPLE = ("skip", "error")


def _describe_source(value: Any) -> str:
    """Where an image came from, for the quarantine report."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("path"):
        return value["path"]
    return f"<{type(value).__name__}>"


def image_key(value: Any) -> str:
    """
    The identity of an image, used to store each distinct image once: `"path:<path as given>"` for paths, or
    `"sha1:<digest>"` for image bytes. An absent image (None, empty path) has the empty key and no image row.
    """
    if isinstance(value, dict):
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return "sha1:" + hashlib.sha1(value).hexdigest()
    if isinstance(value, str) and value:
        return "path:" + value
    return ""


def prepare_images(
    batch: dict[str, list],
    *,
    image_column: str,
    image_size: int,
    data_root: str | None = None,
    max_pixels: int = MAX_IMAGE_PIXELS,
    image_format: str = "uint8",
) -> dict[str, list]:
    """
    `Dataset.map(batched=True)` function over distinct images: decode, check, convert and resize each one to
    `image_size` square uint8 (C, H, W). An image that fails keeps a zero array and carries an `error`. With an
    `image_format` other than uint8 the pixels are stored as JPEG / lossless WebP bytes (`image_bytes`).
    """
    blank = np.zeros((3, image_size, image_size), dtype=np.uint8)
    keys, pixels, errors, sources, widths, heights = [], [], [], [], [], []
    for value in batch[image_column]:
        keys.append(image_key(value))
        sources.append(_describe_source(value))
        try:
            image = load_image(value, data_root, max_pixels)
            pixels.append(to_pixels(image, image_size))  # as the processor's load_pixels does
            errors.append("")
            widths.append(image.width)
            heights.append(image.height)
        except BadSample as bad:
            pixels.append(blank)
            errors.append(f"{bad.reason}: {bad.detail}")
            widths.append(0)
            heights.append(0)
    stored = (
        {"pixel_values": pixels}
        if image_format == "uint8"
        else {"image_bytes": [encode_pixels(p, image_format) for p in pixels]}
    )
    return {"image_key": keys, **stored, "source": sources, "error": errors, "width": widths, "height": heights}


def prepare_texts(
    batch: dict[str, list],
    indices: list[int],
    *,
    tokenizer,
    image_rows: dict[str, int],
    image_column: str,
    text_column: str,
    id_column: str | None,
    label_column: str | None,
    label_names: list[str] | None = None,
    value_names: list[str] | None = None,
    max_length: int | None = None,
) -> dict[str, list]:
    """
    `Dataset.map(batched=True)` function over pairs: the pair's id, the key and row of its image in the images table,
    its text tokenized without padding, its label as an index into `label_names` (-1 for none), and an `error` for a
    bad text or label. Label values are class names ([`label_name`]); with `value_names` (a `ClassLabel` column's
    names), indices into `value_names`; without `label_names`, class indices already.
    """
    n = len(batch[text_column])
    keys = [image_key(value) for value in batch[image_column]]
    errors = [""] * n
    labels = []
    if label_column:
        index = {name: i for i, name in enumerate(label_names or ())}
        for i, value in enumerate(batch[label_column]):
            try:
                if label_names is None:  # class indices already (a stream's, mapped by its reader)
                    if not (isinstance(value, int) and value >= 0):
                        raise BadSample("bad_label", f"missing or negative class index {value!r}")
                    labels.append(value)
                    continue
                if value_names is not None:
                    if not (isinstance(value, int) and 0 <= value < len(value_names)):
                        raise BadSample("bad_label", f"no class has index {value!r}")
                    value = value_names[value]
                name = label_name(value)
                if name not in index:
                    raise BadSample("bad_label", f"{name!r} is not one of the {len(index)} classes")
                labels.append(index[name])
            except BadSample as bad:
                errors[i] = f"{bad.reason}: {bad.detail}"
                labels.append(-1)
    texts = []
    for i, text in enumerate(batch[text_column]):
        problem = text_problem(text)
        if problem:
            errors[i] = errors[i] or f"bad_text: {problem}"
            text = ""
        texts.append(text)
    encoded = tokenizer(texts, truncation=max_length is not None, max_length=max_length, padding=False)
    output = {
        "id": [str(x) for x in batch[id_column]] if id_column else [str(i) for i in indices],
        "image_key": keys,
        "image_index": [image_rows.get(key, -1) for key in keys],
        "input_ids": encoded["input_ids"],
        "length": [len(x) for x in encoded["input_ids"]],
        "error": errors,
    }
    if label_column:
        output["labels"] = labels
    assert all(len(v) == n for v in output.values())  # every output column stays aligned with its input row
    return output


def text_problem(text: Any) -> str:
    """What makes a value no text to train on (`""` when it is one): absent, not a string, or blank."""
    if text is None:
        return "no text (null or absent)"
    if not isinstance(text, str):
        kind = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}
        return f"{kind.get(type(text), 'a ' + type(text).__name__)} where text should be: {text!r:.80}"
    if not text.strip():
        return f"an empty text {text!r}"
    return ""


@dataclass
class PreparedData:
    """
    The output of [`prepare_dataset`].

    Attributes:
        pairs (`Dataset` or `DatasetDict`):
            One row per usable pair: `id`, `image_key` and `image_index` (its row in `images`), `input_ids`
            (unpadded), `length`, and `labels` when a label column was given, plus the kept columns.
        images (`Dataset`):
            One row per distinct image (of every split): `image_key` and `pixel_values`, uint8 (3, S, S). Pairs that
            share an image point to the same row, so each image is decoded, stored and read once.
        quarantine (`list[dict]`):
            The pairs left out, as `{"id", "source", "reason"}`, plus `"split"` for a `DatasetDict` and `"line"`, the
            line of the table the row starts on, for a table read by [`read_table`].
        label_names (`list[str]`, *optional*):
            The classes the `labels` index, when a label column was given.
        image_sizes (`np.ndarray`):
            `(width, height)` of each usable distinct image as it was read, before resizing: `(N, 2)`.
    """

    pairs: Dataset | DatasetDict
    images: Dataset
    quarantine: list[dict[str, str]]
    label_names: list[str] | None = None
    image_sizes: np.ndarray | None = None


def prepare_dataset(
    data: Dataset | DatasetDict,
    tokenizer,
    *,
    image_column: str = "image",
    text_column: str = "text",
    id_column: str | None = None,
    label_column: str | None = None,
    label_names: Sequence[str] | None = None,
    keep_columns: tuple[str, ...] = (),
    image_size: int = 224,
    data_root: str | None = None,
    max_pixels: int = MAX_IMAGE_PIXELS,
    max_length: int | None = None,
    on_bad_sample: str = "skip",
    quarantine_path: str | os.PathLike | None = None,
    num_proc: int | None = None,
    batch_size: int = 256,
    image_format: str = "auto",
) -> PreparedData:
    """
    Validate and preprocess image-text pairs once, with results kept in the Arrow cache under a fingerprint that is
    stable across processes, so a later run reuses them. Distinct images (by path, or by content for image bytes)
    are decoded, checked and resized once into an images table; pairs keep their tokenized text and the row of
    their image. In a multi-process run the work is done by the local main process first and the other ranks load
    it from the cache.

    Args:
        data (`Dataset` or `DatasetDict`):
            The pairs. A `DatasetDict` gives one `pairs` split per split and one images table for all of them, so one
            collator serves training and evaluation.
        image_column, text_column, id_column, label_column (`str`):
            Column names. Without an id column, ids are the row numbers (of each split). Ids from an id column must
            be unique across all splits: the first row with an id is kept and every later one is quarantined.
        label_names (`list[str]`, *optional*):
            The classes, in class-index order; labels are class names ([`mm_fusion.data.labels`]: `1` and `"1"` are
            one class), or indices of a `ClassLabel` column. Default: a `ClassLabel` column's names, else the classes
            of the first split's labels. A row whose label names no class is quarantined (`bad_label`).
        image_size (`int`, *optional*, defaults to 224):
            Images are resized to `image_size` x `image_size`.
        on_bad_sample (`str`, *optional*, defaults to `"skip"`):
            `"skip"` leaves bad rows out and reports them (log summary, and `quarantine_path` as jsonl when given);
            `"error"` raises a `ValueError` listing them.
        image_format (`str`, *optional*, defaults to `"auto"`):
            How the images table stores the resized images: `"uint8"` (raw, fastest to read), `"jpeg"` (quality 90,
            4:4:4, 15-49x smaller, lossy), `"webp"` (lossless, exact pixels) or `"auto"`: uint8 up to 8 GiB of raw
            images, JPEG above ([`choose_image_format`], measured in `scripts/benchmarks/results/image_cache.md`).
        quarantine_path (`str`, *optional*):
            Where to write the quarantine report (jsonl: id, source, reason); written on every run, empty when
            nothing was left out, so no stale report survives.
    """
    if on_bad_sample not in ON_BAD_SAMPLE:
        raise ValueError(f"on_bad_sample must be one of {', '.join(ON_BAD_SAMPLE)}, got {on_bad_sample!r}.")
    splits = dict(data) if isinstance(data, DatasetDict) else {"": data}
    columns = {
        "image_column": image_column,
        "text_column": text_column,
        "id_column": id_column,
        "label_column": label_column,
    }
    for split, dataset in splits.items():
        for name, column in [*columns.items(), *(("keep_columns", c) for c in keep_columns)]:
            if column is not None and column not in dataset.column_names:
                where = f" (split {split!r})" if split else ""
                raise DataError(
                    f"{name}={column!r} is not a column of this dataset{where}; available columns: "
                    f"{[c for c in dataset.column_names if c != LINE_COLUMN]}."
                )
        if isinstance(dataset.features[image_column], ImageFeature):
            # Undecoded, so that a corrupt file reaches our checks (and the quarantine) instead of failing in datasets.
            splits[split] = dataset.cast_column(image_column, ImageFeature(decode=False))
    if label_column and label_names is None:
        first = next(iter(splits.values()))
        feature = first.features[label_column]
        label_names = feature.names if isinstance(feature, ClassLabel) else class_names(first[label_column])
    label_names = list(label_names) if label_column else None

    state = _distributed_state()
    with state.local_main_process_first():
        images, image_rows = _prepare_images(
            splits, image_column, image_size, data_root, max_pixels, num_proc, batch_size, image_format
        )
        prepared = {
            split: _prepare_texts(
                dataset,
                tokenizer,
                images,
                image_rows,
                columns,
                label_names,
                keep_columns,
                max_length,
                num_proc,
                batch_size,
            )
            for split, dataset in splits.items()
        }

    image_table = images.select_columns(["source", "error", "width", "height"]).to_dict()
    quarantine, pairs = [], {}
    first_rows: dict[str, str] = {}  # id -> where its first row is; row-number ids are only unique within a split
    for split, dataset in prepared.items():
        bad_rows, bad = _quarantine(dataset, image_table, first_rows if id_column else {}, split)
        quarantine += [{**q, "split": split} for q in bad] if split else bad
        keep = set(bad_rows)
        clean = dataset.select([i for i in range(len(dataset)) if i not in keep]) if keep else dataset
        pairs[split] = clean.remove_columns(["error", *([LINE_COLUMN] if LINE_COLUMN in clean.column_names else [])])
    total = sum(len(d) for d in prepared.values())
    if quarantine:
        counts = Counter(q["reason"].split(":", 1)[0] for q in quarantine)
        summary = ", ".join(f"{reason}: {count}" for reason, count in counts.most_common())
        if on_bad_sample == "error":
            examples = "; ".join(f"{q['id']} ({q['reason']})" for q in quarantine[:5])
            raise ValueError(f"{len(quarantine)} of {total} rows are unusable ({summary}), e.g. {examples}.")
        if state.is_local_main_process:
            where = f"; details in {quarantine_path}" if quarantine_path is not None else ""
            logger.warning("Left out %d of %d rows (%s)%s.", len(quarantine), total, summary, where)
    if quarantine_path is not None and state.is_local_main_process:
        os.makedirs(os.path.dirname(os.path.abspath(quarantine_path)), exist_ok=True)
        with open(quarantine_path, "w") as f:
            f.writelines(json.dumps(q) + "\n" for q in quarantine)
    usable = [i for i, error in enumerate(image_table["error"]) if not error]
    return PreparedData(
        pairs=DatasetDict(pairs) if isinstance(data, DatasetDict) else pairs[""],
        images=images.remove_columns(["source", "error", "width", "height"]),
        quarantine=quarantine,
        label_names=label_names,
        image_sizes=np.array([(image_table["width"][i], image_table["height"][i]) for i in usable]).reshape(-1, 2),
    )


def _prepare_images(
    splits: dict[str, Dataset],
    image_column: str,
    image_size: int,
    data_root: str | None,
    max_pixels: int,
    num_proc: int | None,
    batch_size: int,
    image_format: str = "uint8",
) -> tuple[Dataset, dict[str, int]]:
    """The images table (each distinct image of every split once, in order of first use) and its row per key."""
    image_rows: dict[str, int] = {}
    parts = []
    for dataset in splits.values():
        first_uses = []
        column = dataset.select_columns([image_column])
        for start in range(0, len(dataset), 4096):
            for offset, value in enumerate(column[start : start + 4096][image_column]):
                key = image_key(value)
                if key and key not in image_rows:
                    image_rows[key] = len(image_rows)
                    first_uses.append(start + offset)
        parts.append(column.select(first_uses) if len(first_uses) < len(dataset) else column)
    if len({repr(part.features[image_column]) for part in parts}) > 1:
        parts = _common_image_column(parts, image_column)
    source = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
    chosen = choose_image_format(image_format, len(source), image_size)
    if image_format == "auto" and chosen != "uint8":
        logger.info("image_format auto: %d images at %d px would take %.1f GiB raw; storing them as %s.",
                    len(source), image_size, len(source) * 3 * image_size**2 / 2**30, chosen)  # fmt: skip
    settings = {
        "image_column": image_column,
        "image_size": image_size,
        "data_root": data_root,
        "max_pixels": max_pixels,
    }
    if chosen != "uint8":
        settings["image_format"] = chosen
    pixels = Value("binary") if chosen != "uint8" else Array3D(shape=(3, image_size, image_size), dtype="uint8")
    features = Features(
        {
            "image_key": Value("string"),
            "image_bytes" if chosen != "uint8" else "pixel_values": pixels,
            "source": Value("string"),
            "error": Value("string"),
            "width": Value("int32"),
            "height": Value("int32"),
        }
    )
    images = source.map(
        prepare_images,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc if num_proc and len(source) >= num_proc else None,
        features=features,
        remove_columns=[image_column],
        fn_kwargs=settings,
        # the output's schema is part of the key: a cache written with other columns is never read back
        new_fingerprint=Hasher.hash([source._fingerprint, prepare_images, settings, features.to_dict()]),
        desc="Decoding, checking and resizing images",
    )
    return images, image_rows


def _common_image_column(parts: list[Dataset], image_column: str) -> list[Dataset]:
    """The image columns of splits read from different forms (a CSV's paths as `string`, a JSON file's as
    `large_string`, a Parquet file's `Image` structs) cast to one type, so that they form one images table: `Image`
    (undecoded; a path stays a path) when any split has one, else text."""
    if any(isinstance(part.features[image_column], ImageFeature) for part in parts):
        target = ImageFeature(decode=False)
    else:
        target = Value("large_string")
    return [part.cast_column(image_column, target) for part in parts]


def _prepare_texts(
    dataset: Dataset,
    tokenizer,
    images: Dataset,
    image_rows: dict[str, int],
    columns: dict[str, str | None],
    label_names: list[str] | None,
    keep_columns: tuple[str, ...],
    max_length: int | None,
    num_proc: int | None,
    batch_size: int,
) -> Dataset:
    """Tokenize a split's texts and link each pair to its image row; bad text / labels are marked in `error`."""
    label_column = columns["label_column"]
    label_feature = dataset.features[label_column] if label_column else None
    value_names = list(label_feature.names) if isinstance(label_feature, ClassLabel) else None
    if LINE_COLUMN in dataset.column_names:  # kept for the quarantine report
        keep_columns = (*keep_columns, LINE_COLUMN)
    features = Features(
        {
            "id": Value("string"),
            "image_key": Value("string"),
            "image_index": Value("int64"),
            "input_ids": List(Value("int32")),
            "length": Value("int32"),
            "error": Value("string"),
            **({"labels": ClassLabel(names=label_names)} if label_column else {}),
            **{c: dataset.features[c] for c in keep_columns},
        }
    )
    # datasets' own hash of a tokenizer changes from one process to the next, which would defeat the cache; hash what
    # defines the tokenization instead, with the dataset, the images table (which fixes `image_rows`) and the code.
    fingerprint = Hasher.hash(
        [
            dataset._fingerprint,
            images._fingerprint,
            prepare_texts,
            tokenizer_fingerprint(tokenizer),
            columns,
            label_names,
            value_names,
            max_length,
            list(keep_columns),
        ]
    )
    return dataset.map(
        prepare_texts,
        batched=True,
        batch_size=batch_size,
        with_indices=True,
        num_proc=num_proc if num_proc and len(dataset) >= num_proc else None,
        features=features,
        remove_columns=[c for c in dataset.column_names if c not in keep_columns],
        fn_kwargs={
            "tokenizer": tokenizer,
            "image_rows": image_rows,
            "max_length": max_length,
            "label_names": label_names,
            "value_names": value_names,
            **columns,
        },
        new_fingerprint=fingerprint,
        desc="Tokenizing and linking pairs to images",
    )


def _distributed_state() -> PartialState:
    """
    Accelerate's process state (the one `Trainer` / `Accelerator` use). When nothing has set it up yet on a machine
    without an accelerator, a `torchrun` launch is taken as multi-CPU: plain `PartialState()` would treat every rank
    as a lone process there, and each would redo the preprocessing.
    """
    if not PartialState._shared_state:
        return PartialState(cpu=not torch.accelerator.is_available())
    return PartialState()


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what a tokenizer does (its serialised pipeline and settings), stable across processes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return Hasher.hash(tokenizer)
    pipeline = json.dumps(json.loads(backend.to_str()), sort_keys=True)
    settings = {k: str(v) for k, v in sorted(tokenizer.init_kwargs.items())}
    return Hasher.hash([type(tokenizer).__name__, pipeline, settings])


def _quarantine(
    pairs: Dataset, image_table: dict[str, list], first_rows: dict[str, str], split: str
) -> tuple[list[int], list[dict[str, str]]]:
    """
    Pairs whose image failed, whose text or label is bad, or whose id was already used (by an earlier row of this
    split or, with `first_rows` shared between splits, of an earlier split): their row indices and report entries.
    The first row of an id is kept; `first_rows` records where it is.
    """
    lines = LINE_COLUMN in pairs.column_names
    table = pairs.select_columns(["id", "image_index", "error", *([LINE_COLUMN] if lines else [])]).to_dict()
    bad_rows, quarantine = [], []
    for row, (sample_id, image, error) in enumerate(zip(table["id"], table["image_index"], table["error"])):
        if image < 0:
            source, image_error = "<none>", "missing_image: no image given"
        else:
            source, image_error = image_table["source"][image], image_table["error"][image]
        error = image_error or error
        if sample_id in first_rows:
            error = error or f"duplicate_id: id {sample_id!r} was already used by {first_rows[sample_id]}"
        else:
            where = f"row {row}" + (f" of the {split} split" if split else "")
            first_rows[sample_id] = where + (" (itself left out)" if error else ", which is kept")
        if error:
            bad_rows.append(row)
            quarantine.append({"id": sample_id, "source": source, "reason": error})
            if lines and table[LINE_COLUMN][row] is not None:
                quarantine[-1]["line"] = table[LINE_COLUMN][row]
    return bad_rows, quarantine
