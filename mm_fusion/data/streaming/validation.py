"""Validation and preprocessing of a stream, shard by shard, with a quarantine report of the bad rows
([`prepare_stream`], [`read_quarantine`])."""

import glob
import json
import logging
import os
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from datasets import IterableDataset

from ...image_processing_mm_fusion import MAX_IMAGE_PIXELS
from ..image_codec import IMAGE_FORMATS, encode_pixels
from ..preprocessing import prepare_images, prepare_texts
from .readers import ShardError, StreamSource, stream_source


logger = logging.getLogger(__name__)


@dataclass
class StreamSettings:
    """What [`prepare_stream`] does to each row; pickled into the data loader's workers."""

    image_column: str = "image"
    text_column: str = "text"
    id_column: str | None = None
    label_column: str | None = None
    label_names: list[str] | None = None
    image_size: int = 224
    image_format: str = "uint8"
    image_quality: int = 90
    data_root: str | None = None
    max_pixels: int = MAX_IMAGE_PIXELS
    max_length: int | None = None
    quarantine_dir: str | None = None
    write_reports: bool = True
    report_tag: str = ""
    batch_size: int = 64
    keep_columns: tuple[str, ...] = field(default_factory=tuple)


def _safe_name(shard: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", shard).strip("_")[-150:] or "shard"


def _report(settings: StreamSettings, shard: str, entries: list[dict], mode: str) -> None:
    if settings.quarantine_dir is None or not settings.write_reports:
        return
    os.makedirs(settings.quarantine_dir, exist_ok=True)
    name = _safe_name(shard) + (f".{settings.report_tag}" if settings.report_tag else "") + ".jsonl"
    with open(os.path.join(settings.quarantine_dir, name), mode) as f:
        f.writelines(json.dumps(entry) + "\n" for entry in entries)


def _prepare_rows(rows: list[dict], shard: str, settings: StreamSettings, tokenizer) -> tuple[list, list]:
    """A batch of raw rows through `prepare_images` / `prepare_texts`: the good rows prepared, the bad reported."""
    s = settings
    errors = [row.get("__error__", "") for row in rows]
    labels = None
    if s.label_column:
        labels = []
        for i, row in enumerate(rows):
            label = row.get(s.label_column)
            if isinstance(label, str) and s.label_names is not None:
                if label in s.label_names:
                    label = s.label_names.index(label)
                else:
                    errors[i] = errors[i] or f"bad_label: {label!r} is not one of the {len(s.label_names)} labels"
                    label = -1
            elif isinstance(label, int) and s.label_names is not None and label >= len(s.label_names):
                errors[i] = errors[i] or f"bad_label: class index {label} >= {len(s.label_names)} labels"
            elif label is not None and not isinstance(label, int):
                errors[i] = errors[i] or f"bad_label: expected a class index or a label name, got {label!r}"
                label = -1
            labels.append(label)
    images = prepare_images(
        {s.image_column: [row.get(s.image_column) for row in rows]},
        image_column=s.image_column,
        image_size=s.image_size,
        data_root=s.data_root,
        max_pixels=s.max_pixels,
    )
    keys = [row["__key__"] for row in rows]
    batch = {
        s.image_column: [row.get(s.image_column) for row in rows],
        s.text_column: [row.get(s.text_column) for row in rows],
        "__id__": [row.get(s.id_column) if s.id_column else None for row in rows],
    }
    if labels is not None:
        batch["__label__"] = labels
    texts = prepare_texts(
        batch,
        list(range(len(rows))),
        tokenizer=tokenizer,
        image_rows={key: i for i, key in enumerate(images["image_key"]) if key},
        image_column=s.image_column,
        text_column=s.text_column,
        id_column="__id__" if s.id_column else None,
        label_column="__label__" if labels is not None else None,
        max_length=s.max_length,
    )
    good, bad = [], []
    for i, row in enumerate(rows):
        sample_id = texts["id"][i] if s.id_column and row.get(s.id_column) is not None else f"{shard}/{keys[i]}"
        error = errors[i] or images["error"][i] or texts["error"][i]
        if not error and not images["image_key"][i]:
            error = "missing_image: no image given"
        if error:
            bad.append(
                {"id": sample_id, "shard": shard, "key": keys[i], "source": images["source"][i], "reason": error}
            )
            continue
        data = encode_pixels(images["pixel_values"][i], s.image_format, s.image_quality)
        prepared = {
            "id": sample_id,
            "image_key": images["image_key"][i],
            "image_bytes": data,
            "image_crc": zlib.crc32(data),
            "input_ids": texts["input_ids"][i],
            "shard": shard,
            "key": keys[i],
        }
        if labels is not None:
            prepared["labels"] = texts["labels"][i]
        prepared.update({c: row.get(c) for c in s.keep_columns})
        good.append(prepared)
    return good, bad


def _validated_rows(positions: list[int], source: StreamSource, settings: StreamSettings, tokenizer):
    """`IterableDataset.from_generator` body: each shard read, validated and prepared in batches; its report
    rewritten as it is read (one pass, one report)."""
    for position in positions:
        shard = source.shards[position]
        _report(settings, shard, [], "w")
        shard_settings = settings
        if settings.data_root is None and source.kind == "jsonl":  # images relative to each file's own folder
            shard_settings = replace(settings, data_root=os.path.dirname(os.path.abspath(shard)))
        rows, batch, read = source.read(position), [], 0
        while True:
            try:
                row = next(rows)
            except StopIteration:
                break
            except Exception as err:  # a tar is checked whole before its first row; other sources may fail part-way
                kept = f" (after {read} rows, which are kept)" if read else ""
                detail = str(err) if isinstance(err, ShardError) else f"reading failed ({type(err).__name__}: {err})"
                reason = f"bad_shard: {detail}{kept}"
                _report(settings, shard, [{"id": None, "shard": shard, "key": None, "reason": reason}], "a")
                logger.warning("Shard %s: %s; the rest of it is skipped.", shard, reason)
                break
            batch.append(row)
            read += 1
            if len(batch) == settings.batch_size:
                good, bad = _prepare_rows(batch, shard, shard_settings, tokenizer)
                _report(settings, shard, bad, "a")
                yield from good
                batch = []
        if batch:
            good, bad = _prepare_rows(batch, shard, shard_settings, tokenizer)
            _report(settings, shard, bad, "a")
            yield from good


def prepare_stream(
    source: StreamSource | str | Sequence[str] | IterableDataset,
    tokenizer,
    *,
    image_column: str = "image",
    text_column: str = "text",
    id_column: str | None = None,
    label_column: str | None = None,
    label_names: Sequence[str] | None = None,
    keep_columns: Sequence[str] = (),
    image_size: int = 224,
    image_format: str = "uint8",
    image_quality: int = 90,
    data_root: str | None = None,
    max_pixels: int = MAX_IMAGE_PIXELS,
    max_length: int | None = None,
    quarantine_dir: str | os.PathLike | None = None,
    write_reports: bool = True,
    report_tag: str = "",
    batch_size: int = 64,
) -> IterableDataset:
    """
    Streaming pairs validated and preprocessed shard by shard, as a `datasets.IterableDataset` with one shard per
    source shard. Rows: `id` (the id column, or `<shard>/<key>`), `image_key`, `image_bytes` (the resized image in
    `image_format`: raw uint8, JPEG or lossless WebP), `image_crc` (its CRC-32, checked again at collation),
    `input_ids` (unpadded), `labels` (class indices; label names are mapped through `label_names`), `shard`, `key`,
    and the `keep_columns`.

    Bad rows (an image that is missing, empty, truncated, not an image or too large; empty text or text that is not
    UTF-8; a missing or unknown label; a line that is not JSON; a key used again in a tar shard) go to
    `<quarantine_dir>/<shard>.jsonl` with the shard and key; an unreadable shard is reported there and skipped.
    """
    if image_format not in IMAGE_FORMATS:
        raise ValueError(f"image_format must be one of {IMAGE_FORMATS}, got {image_format!r}.")
    if not isinstance(source, StreamSource):
        source = stream_source(source, data_root=data_root)
    data_root = data_root or source.data_root  # jsonl without one: each file's own folder
    settings = StreamSettings(
        image_column=image_column,
        text_column=text_column,
        id_column=id_column,
        label_column=label_column,
        label_names=list(label_names) if label_names is not None else None,
        image_size=image_size,
        image_format=image_format,
        image_quality=image_quality,
        data_root=data_root,
        max_pixels=max_pixels,
        max_length=max_length,
        quarantine_dir=os.fspath(quarantine_dir) if quarantine_dir is not None else None,
        write_reports=write_reports,
        report_tag=report_tag,
        batch_size=batch_size,
        keep_columns=tuple(keep_columns),
    )
    return IterableDataset.from_generator(
        _validated_rows,
        gen_kwargs={
            "positions": list(range(len(source.shards))),
            "source": source,
            "settings": settings,
            "tokenizer": tokenizer,
        },
    )


def read_quarantine(quarantine_dir: str | os.PathLike) -> list[dict]:
    """Every entry of the per-shard reports in `quarantine_dir`, once (ranks that read the same shard in different
    passes each report it)."""
    entries, seen = [], set()
    for path in sorted(glob.glob(os.path.join(os.fspath(quarantine_dir), "*.jsonl"))):
        with open(path) as f:
            for line in f:
                if line.strip():
                    entry = json.loads(line)
                    key = (entry.get("shard"), entry.get("key"), entry.get("reason"))
                    if key not in seen:
                        seen.add(key)
                        entries.append(entry)
    return entries
