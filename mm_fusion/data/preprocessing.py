"""Validate and preprocess image-text pairs once, in a batched `Dataset.map`, into uint8 pixels and unpadded ids.

Each image is decoded once: the same pass checks it (missing, empty, truncated, not an image, too large, path
outside the data root), converts odd modes to RGB and resizes it. Rows that fail are kept out of training and
reported, never dropped silently: they go to a quarantine list (id, source, reason) with counts per reason.
"""

import io
import json
import logging
import os
from collections import Counter
from typing import Any

import numpy as np
from datasets import Array3D, Dataset, Features, List, Value
from datasets import Image as ImageFeature
from datasets.fingerprint import Hasher
from PIL import Image, UnidentifiedImageError


logger = logging.getLogger(__name__)

# Default refusal limit, in pixels, for one image (PIL warns at 89M and refuses at 179M). 50 megapixels is far above
# any photo a fusion model is trained on and keeps a single decode under ~150 MB.
MAX_IMAGE_PIXELS = 50_000_000
ON_BAD_SAMPLE = ("skip", "error")


class BadSample(Exception):
    """A row that cannot be trained on; `reason` is a short machine-readable tag."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL mode to RGB: transparency is composited on white, 16/32-bit and float images are rescaled."""
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        array = np.asarray(image, dtype=np.float64)
        high = 65535.0 if image.mode.startswith("I;16") else max(float(array.max()), 1.0)
        image = Image.fromarray(np.clip(array / high * 255.0, 0, 255).astype(np.uint8), mode="L")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _resolve_path(path: str, data_root: str | None) -> str:
    """An image path made absolute against `data_root`, refused if it points outside the root."""
    if data_root is None:
        return os.path.abspath(path)
    root = os.path.realpath(data_root)
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise BadSample("path_outside_root", f"{path!r} resolves outside the data root {data_root!r}")
    return full


def load_image(value: Any, data_root: str | None = None, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """
    Decode one image fully and return it as RGB, or raise `BadSample`. `value` is a path (relative to `data_root`
    when given), a `datasets.Image(decode=False)` dict with `bytes` / `path`, raw bytes, or a PIL image.
    """
    if isinstance(value, Image.Image):
        image = value
    else:
        if isinstance(value, dict):
            value = value.get("bytes") or value.get("path")
        if isinstance(value, (bytes, bytearray)):
            if not value:
                raise BadSample("empty_file", "the image bytes are empty")
            stream, source = io.BytesIO(value), "<bytes>"
        elif isinstance(value, str) and value:
            source = _resolve_path(value, data_root)
            if not os.path.isfile(source):
                raise BadSample("missing_image", f"no file at {source}")
            if os.path.getsize(source) == 0:
                raise BadSample("empty_file", f"{source} has zero bytes")
            stream = source
        else:
            raise BadSample("missing_image", f"no image given ({value!r})")
        try:
            image = Image.open(stream)
        except UnidentifiedImageError:
            raise BadSample("not_an_image", f"{source} is not an image PIL can read") from None
        except Image.DecompressionBombError as err:
            raise BadSample("too_large", str(err)) from None
    width, height = image.size
    if width * height > max_pixels:  # checked from the header, before decoding
        raise BadSample("too_large", f"{width}x{height} exceeds the limit of {max_pixels} pixels")
    try:
        image.load()
    except OSError as err:
        raise BadSample("truncated", f"decoding failed: {err}") from None
    return to_rgb(image)


def _describe_source(value: Any) -> str:
    """Where an image came from, for the quarantine report."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("path"):
        return value["path"]
    return f"<{type(value).__name__}>"


def prepare_examples(
    batch: dict[str, list],
    indices: list[int] | None = None,
    *,
    tokenizer,
    image_column: str,
    text_column: str,
    id_column: str | None,
    label_column: str | None,
    image_size: int,
    data_root: str | None = None,
    max_pixels: int = MAX_IMAGE_PIXELS,
    max_length: int | None = None,
) -> dict[str, list]:
    """
    `Dataset.map(batched=True)` function: decode, check, convert and resize each image to `image_size` square uint8
    (C, H, W); tokenize each text without padding. Rows that fail keep a zero image and carry an `error` for the
    quarantine report.
    """
    n = len(batch[text_column])
    ids = [str(x) for x in batch[id_column]] if id_column else [str(i) for i in indices]
    blank = np.zeros((3, image_size, image_size), dtype=np.uint8)
    pixels, errors, sources = [], [], []
    for value in batch[image_column]:
        sources.append(_describe_source(value))
        try:
            image = load_image(value, data_root, max_pixels).resize((image_size, image_size), Image.BILINEAR)
            pixels.append(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))
            errors.append("")
        except BadSample as bad:
            pixels.append(blank)
            errors.append(f"{bad.reason}: {bad.detail}")
    if label_column:
        for i, label in enumerate(batch[label_column]):
            if (label is None or (isinstance(label, int) and label < 0)) and not errors[i]:
                errors[i] = f"bad_label: missing or negative label {label!r}"
    texts = []
    for i, text in enumerate(batch[text_column]):
        if not isinstance(text, str) or not text.strip():
            if not errors[i]:
                errors[i] = f"bad_text: expected a non-empty string, got {text!r}"
            text = ""
        texts.append(text)
    encoded = tokenizer(texts, truncation=max_length is not None, max_length=max_length, padding=False)
    output = {
        "id": ids,
        "pixel_values": pixels,
        "input_ids": encoded["input_ids"],
        "length": [len(x) for x in encoded["input_ids"]],
        "source": sources,
        "error": errors,
    }
    if label_column:
        output["labels"] = batch[label_column]
    assert all(len(v) == n for v in output.values())  # every output column stays aligned with its input row
    return output


def prepare_dataset(
    dataset: Dataset,
    tokenizer,
    *,
    image_column: str = "image",
    text_column: str = "text",
    id_column: str | None = None,
    label_column: str | None = None,
    keep_columns: tuple[str, ...] = (),
    image_size: int = 224,
    data_root: str | None = None,
    max_pixels: int = MAX_IMAGE_PIXELS,
    max_length: int | None = None,
    on_bad_sample: str = "skip",
    quarantine_path: str | os.PathLike | None = None,
    num_proc: int | None = None,
    batch_size: int = 256,
) -> tuple[Dataset, list[dict[str, str]]]:
    """
    Validate and preprocess `dataset` once (cached in the Arrow cache by its fingerprint). Returns the clean dataset
    (`id`, `pixel_values` uint8 (3, S, S), `input_ids` unpadded, `length`, `labels` if `label_column`, plus
    `keep_columns`) and the quarantine list of `{"id", "source", "reason"}` for rows that were left out.

    Args:
        on_bad_sample (`str`, *optional*, defaults to `"skip"`):
            `"skip"` leaves bad rows out and reports them (log summary, and `quarantine_path` as jsonl when given);
            `"error"` raises a `ValueError` listing them.
    """
    if on_bad_sample not in ON_BAD_SAMPLE:
        raise ValueError(f"on_bad_sample must be one of {', '.join(ON_BAD_SAMPLE)}, got {on_bad_sample!r}.")
    columns = {
        "image_column": image_column,
        "text_column": text_column,
        "id_column": id_column,
        "label_column": label_column,
    }
    for name, column in [*columns.items(), *(("keep_columns", c) for c in keep_columns)]:
        if column is not None and column not in dataset.column_names:
            raise ValueError(
                f"{name}={column!r} is not a column of this dataset; available columns: {dataset.column_names}."
            )
    if isinstance(dataset.features[image_column], ImageFeature):
        # Undecoded, so that a corrupt file reaches our checks (and the quarantine) instead of failing inside datasets.
        dataset = dataset.cast_column(image_column, ImageFeature(decode=False))
    features = Features(
        {
            "id": Value("string"),
            "pixel_values": Array3D(shape=(3, image_size, image_size), dtype="uint8"),
            "input_ids": List(Value("int32")),
            "length": Value("int32"),
            "source": Value("string"),
            "error": Value("string"),
            **({"labels": dataset.features[label_column]} if label_column else {}),
            **{c: dataset.features[c] for c in keep_columns},
        }
    )
    fn_kwargs = {
        "tokenizer": tokenizer,
        "image_size": image_size,
        "data_root": data_root,
        "max_pixels": max_pixels,
        "max_length": max_length,
        **columns,
    }
    # datasets' own hash of a tokenizer changes from one process to the next, which would defeat the cache; hash what
    # defines the tokenization instead, with the dataset and the code of the map function.
    fingerprint = Hasher.hash(
        [
            dataset._fingerprint,
            prepare_examples,
            tokenizer_fingerprint(tokenizer),
            {k: v for k, v in fn_kwargs.items() if k != "tokenizer"},
            list(keep_columns),
        ]
    )
    prepared = dataset.map(
        prepare_examples,
        batched=True,
        batch_size=batch_size,
        with_indices=True,
        num_proc=num_proc,
        features=features,
        remove_columns=[c for c in dataset.column_names if c not in keep_columns],
        fn_kwargs=fn_kwargs,
        new_fingerprint=fingerprint,
        desc="Validating and preprocessing pairs",
    )
    bad_rows, quarantine = _quarantine(prepared)
    if quarantine:
        counts = Counter(q["reason"].split(":", 1)[0] for q in quarantine)
        summary = ", ".join(f"{reason}: {count}" for reason, count in counts.most_common())
        if on_bad_sample == "error":
            examples = "; ".join(f"{q['id']} ({q['reason']})" for q in quarantine[:5])
            raise ValueError(f"{len(quarantine)} of {len(prepared)} rows are unusable ({summary}), e.g. {examples}.")
        if quarantine_path is not None:
            with open(quarantine_path, "w") as f:
                f.writelines(json.dumps(q) + "\n" for q in quarantine)
        where = f"; details in {quarantine_path}" if quarantine_path is not None else ""
        logger.warning("Left out %d of %d rows (%s)%s.", len(quarantine), len(prepared), summary, where)
    bad = set(bad_rows)
    clean = prepared.select([i for i in range(len(prepared)) if i not in bad]) if bad else prepared
    return clean.remove_columns(["source", "error"]), quarantine


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what a tokenizer does (its serialised pipeline and settings), stable across processes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return Hasher.hash(tokenizer)
    pipeline = json.dumps(json.loads(backend.to_str()), sort_keys=True)
    settings = {k: str(v) for k, v in sorted(tokenizer.init_kwargs.items())}
    return Hasher.hash([type(tokenizer).__name__, pipeline, settings])


def _quarantine(prepared: Dataset) -> tuple[list[int], list[dict[str, str]]]:
    """Rows with a decode/text/label error, and every row whose id is not unique: their indices and report."""
    table = prepared.select_columns(["id", "source", "error"]).to_dict()
    ids, sources, errors = table["id"], table["source"], table["error"]
    rows_by_id: dict[str, list[int]] = {}
    for row, sample_id in enumerate(ids):
        rows_by_id.setdefault(sample_id, []).append(row)
    bad_rows, quarantine = [], []
    for row, (sample_id, source, error) in enumerate(zip(ids, sources, errors)):
        if len(rows_by_id[sample_id]) > 1:
            error = error or f"duplicate_id: id {sample_id!r} is used by rows {rows_by_id[sample_id]}"
        if error:
            bad_rows.append(row)
            quarantine.append({"id": sample_id, "source": source, "reason": error})
    return bad_rows, quarantine
