"""
Streaming image-text pairs, for corpora that do not fit one disk's Arrow cache: webdataset tar shards, jsonl files
with image folders, and any `load_dataset(..., streaming=True)` source, each as a `datasets.IterableDataset` whose
shards are the files (or the source's own shards).

Every shard is validated as it is read, by the same `prepare_images` / `prepare_texts` functions as the Arrow path:
bad rows are left out and written to a report per shard (`<quarantine_dir>/<shard>.jsonl`: id, shard, key, source,
reason); a shard that cannot be read (a truncated or corrupt tar or gzip stream, a missing file) is reported there
and skipped as a whole, and the stream goes on with the next shard. Rows are decoded, checked and resized in the
process that reads them: the data loader's workers.

[`ShuffledStream`] splits the pairs between ranks with `datasets.distributed.split_dataset_by_node`, shuffles them
with a buffer and repeats pass after pass, with a `state_dict` that resumes mid-stream exactly.
"""

import codecs
import copy
import glob
import gzip
import json
import logging
import os
import re
import shutil
import tarfile
import tempfile
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO

import numpy as np
import torch
from datasets import IterableDataset, load_dataset
from datasets.distributed import split_dataset_by_node

from ..image_processing_mm_fusion import MAX_IMAGE_PIXELS
from .image_codec import IMAGE_FORMATS, encode_pixels
from .preprocessing import prepare_images, prepare_texts


logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm")


class ShardError(RuntimeError):
    """A shard that cannot be read as a whole (truncated, corrupt or missing); it is reported and skipped."""


# --- readers: one shard in, raw rows out -------------------------------------------------------------------------


COMPRESSED_TAR = (".tar.gz", ".tgz")
TAR_SHARDS = (".tar", *COMPRESSED_TAR)

# The members that make a sample, by their role: a second member of a role already filled under one key is a second
# sample of that key, never a replacement of the first one's.
MEMBER_ROLES = {**{extension: "image" for extension in IMAGE_EXTENSIONS}, "txt": "text", "cls": "label",
                "json": "json"}  # fmt: skip


def _check_tar(f: BinaryIO, size: int) -> list[tarfile.TarInfo]:
    """
    The members of an uncompressed tar (open as `f`, of `size` bytes) after checking it is whole: every member's data
    lies inside the file and the end-of-archive marker (two zero blocks) follows the last one. A shard cut short at a
    member boundary parses as a shorter archive, so the marker is what tells it apart. Reads headers only.
    """
    f.seek(0)
    try:
        with tarfile.open(fileobj=f, mode="r:") as tar:
            members = tar.getmembers()
    except (tarfile.TarError, EOFError, OSError) as err:
        raise ShardError(f"not a readable tar archive ({type(err).__name__}: {err})") from None
    end = 0
    for member in members:
        data_end = member.offset_data + member.size
        if data_end > size:
            raise ShardError(f"truncated: member {member.name!r} needs {data_end} bytes, the file has {size}")
        end = max(end, member.offset_data + -(-member.size // 512) * 512)
    f.seek(end)
    marker = f.read(1024)
    if len(marker) < 1024 or marker.count(0) != 1024:
        raise ShardError(f"truncated: no end-of-archive marker after the last member (file of {size} bytes)")
    return members


def _decompressed(path: str) -> BinaryIO:
    """
    The tar inside a gzip shard, in an anonymous temporary file (not in memory: shards are often a gigabyte), after
    reading the gzip stream to its end. Only there does `gzip` check the trailer's CRC-32 and length, and a stream
    cut short or corrupt anywhere fails: here, before the first row, and not part-way through the shard as `tarfile`
    reading it directly would (it stops at the first unreadable header without an error).
    """
    data = tempfile.TemporaryFile()
    try:
        with gzip.open(path, "rb") as f:
            shutil.copyfileobj(f, data, 1 << 20)
    except (OSError, EOFError, zlib.error) as err:  # BadGzipFile (CRC, length, header) is an OSError
        data.close()
        raise ShardError(f"not a whole gzip stream ({type(err).__name__}: {err})") from None
    data.seek(0)
    return data


def _utf8(data: bytes, what: str, reason: str) -> tuple[str | None, str | None]:
    """`data` decoded as UTF-8, or an error naming `what` and the first bad bytes: decoding with replacement
    characters would train on a text that is not the pair's."""
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as err:
        bad = data[err.start : err.start + 4]
        return None, f"{reason}: {what} is not UTF-8 ({err.reason}: {bad!r} at byte {err.start})"


def _sample(path: str, key: str, members: list[tuple[int, tarfile.TarInfo, bytes]]) -> dict[str, Any]:
    """One sample's row from its members (number in the shard, header, data); the first problem is its `__error__`."""
    row: dict[str, Any] = {"__key__": key}
    errors = []
    for _, member, data in members:
        extension = os.path.basename(member.name).partition(".")[2].lower()
        role = MEMBER_ROLES.get(extension)
        if role == "image":
            row["image"] = {"bytes": data, "path": f"{path}:{member.name}"}
        elif role == "text":
            text, error = _utf8(data, member.name, "bad_text")
            if error:
                errors.append(error)
            else:
                row["text"] = text
        elif role == "label":
            text, error = _utf8(data, member.name, "bad_label")
            if error:
                errors.append(error)
            else:
                text = text.strip()
                row["cls"] = int(text) if re.fullmatch(r"-?\d+", text) else text
        elif role == "json":
            try:
                fields = json.loads(data)  # bytes: JSON's own encoding detection; latin-1 fails as a ValueError
            except ValueError as err:
                errors.append(f"bad_json: {member.name}: {err}")
                continue
            if isinstance(fields, dict):
                row.update({k: v for k, v in fields.items() if not k.startswith("__")})
            else:
                row["json"] = fields
    if errors:
        row["__error__"] = errors[0]
    return row


def _describe(members: list[tuple[int, tarfile.TarInfo, bytes]]) -> str:
    names = ", ".join(os.path.basename(member.name) for _, member, _ in members)
    first, last = members[0][0], members[-1][0]
    return f"{names} (member{f's {first}-{last}' if last != first else f' {first}'})"


def read_tar_shard(path: str) -> Iterator[dict[str, Any]]:
    """
    The samples of a webdataset tar shard (`.tar`, or gzip-compressed `.tar.gz` / `.tgz`): files that share a key
    (the path up to the first dot of the file name) make one row, `{"__key__", "image": {"bytes", "path"}, "text",
    "cls", **json fields}`. `.jpg` / `.png` / `.webp` give the image, `.txt` the text (UTF-8), `.cls` an integer label
    or a label name, `.json` extra columns. The shard is checked whole before its first row ([`_check_tar`]; a
    compressed one is decompressed whole first, which checks its CRC, [`_decompressed`]).

    A key names one sample. A key used again, next to its first sample (a member of a role it already has: a second
    image, text, label or json) or anywhere later in the shard, is a duplicate: the first sample of the key is read,
    as the Arrow path keeps the first row of an id, and every later one is a row whose `__error__` is
    `duplicate_key`, naming the key and its members, so that it is reported, not merged or trained on twice.
    """
    if not os.path.isfile(path):
        raise ShardError("no such file")
    with _decompressed(path) if path.endswith(COMPRESSED_TAR) else open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        members = [m for m in _check_tar(f, size) if m.isfile()]
        first_seen: dict[str, str] = {}  # key: its first sample's members
        key, sample, roles = None, [], set()

        def finish():
            row = _sample(path, key, sample)
            if key in first_seen:
                row["__error__"] = (
                    f"duplicate_key: key {key!r} again at {_describe(sample)}; only its first sample, at "
                    f"{first_seen[key]}, is read"
                )
            else:
                first_seen[key] = _describe(sample)
            return row

        for number, member in enumerate(members, start=1):
            directory, name = os.path.split(member.name)
            if name.startswith("."):
                continue
            stem, _, extension = name.partition(".")
            role = MEMBER_ROLES.get(extension.lower())
            if sample and (os.path.join(directory, stem) != key or (role is not None and role in roles)):
                yield finish()
                sample, roles = [], set()
            key = os.path.join(directory, stem)
            f.seek(member.offset_data)
            data = f.read(member.size) if role is not None else b""  # one sample's files in memory at a time
            sample.append((number, member, data))
            if role is not None:
                roles.add(role)
        if sample:
            yield finish()


def read_jsonl_shard(path: str) -> Iterator[dict[str, Any]]:
    """
    The rows of a jsonl file, `__key__` being the line number. A line that is not a JSON object, or not UTF-8 (JSON
    text is UTF-8; a latin-1 line decoded anyway would train on other characters than the pair's), is a bad row; the
    lines after it are read.
    """
    try:
        f = open(path, "rb")  # decoded line by line, so that one bad line does not end the file
    except OSError as err:
        raise ShardError(f"cannot open ({type(err).__name__}: {err})") from None
    with f:
        for number, data in enumerate(f, start=1):
            key = f"line {number}"
            if number == 1 and data.startswith(codecs.BOM_UTF8):  # written by some Windows editors
                data = data[len(codecs.BOM_UTF8) :]
            line, error = _utf8(data, key, "bad_text")
            if error:
                yield {"__key__": key, "__error__": error}
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                yield {"__key__": key, "__error__": f"bad_json: {err}"}
                continue
            if not isinstance(row, dict):
                yield {"__key__": key, "__error__": f"bad_json: expected an object, got {type(row).__name__}"}
                continue
            yield {**row, "__key__": key}


def read_dataset_shard(index: int, dataset: IterableDataset) -> Iterator[dict[str, Any]]:
    """Shard `index` of a streaming `datasets.IterableDataset`, `__key__` being the row number within the shard."""
    part = dataset.shard(num_shards=dataset.num_shards, index=index)
    # `iter`, not `for row in part`: in a data loader worker, iterating would split this one shard between the
    # workers again, and every worker but the first would read nothing of it.
    for number, batch in enumerate(part.iter(batch_size=1)):
        yield {**{key: values[0] for key, values in batch.items()}, "__key__": f"row {number}"}


# --- sources -----------------------------------------------------------------------------------------------------


@dataclass
class StreamSource:
    """
    Where streaming pairs come from: shard names (file paths, or `"<name>[shard i]"`) and how to read one.

    Attributes:
        name (`str`): for reports and logs.
        shards (`list[str]`): one entry per shard, the unit that ranks and workers split.
        kind (`str`): `"webdataset"`, `"jsonl"` or `"datasets"`.
        dataset (`IterableDataset`, *optional*): the streaming dataset whose shards are read (`"datasets"`).
        data_root (`str`, *optional*): relative image paths are read under it (jsonl: the file's folder by default).
    """

    name: str
    shards: list[str]
    kind: str
    dataset: IterableDataset | None = None
    data_root: str | None = None

    def read(self, position: int) -> Iterator[dict[str, Any]]:
        if self.kind == "webdataset":
            return read_tar_shard(self.shards[position])
        if self.kind == "jsonl":
            return read_jsonl_shard(self.shards[position])
        return read_dataset_shard(position, self.dataset)


def _expand(paths: str | Sequence[str]) -> list[str]:
    """Paths, globs and brace ranges (`shard-{000..009}.tar`) to a sorted list of existing or named files."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files = []
    for item in map(os.fspath, items):
        match = re.search(r"\{(\d+)\.\.(\d+)\}", item)
        if match:
            width = len(match.group(1))
            numbers = range(int(match.group(1)), int(match.group(2)) + 1)
            files += [item[: match.start()] + str(n).zfill(width) + item[match.end() :] for n in numbers]
        elif any(c in item for c in "*?["):
            found = sorted(glob.glob(item))
            if not found:
                raise ValueError(f"No file matches {item!r}.")
            files += found
        elif os.path.isdir(item):
            files += _folder_shards(item)
        else:
            files.append(item)
    return files


def _folder_shards(folder: str) -> list[str]:
    """
    The shards of a folder given as a source, sorted: its webdataset shards (`.tar`, `.tar.gz`, `.tgz`) or its
    `.jsonl` files, from its top level. A folder with neither is itself the answer, for `load_dataset` (parquet or
    csv files, an imagefolder with its `metadata.jsonl`). A folder with both kinds, or with no file at all, is an
    error that names it and says what to pass; its other files are left out with a warning.
    """
    names = sorted(n for n in os.listdir(folder) if not n.startswith(".") and os.path.isfile(os.path.join(folder, n)))
    tars = [n for n in names if n.endswith(TAR_SHARDS)]
    jsonl = [n for n in names if n.endswith(".jsonl") and n != "metadata.jsonl"]  # metadata.jsonl: an imagefolder
    if tars and jsonl:
        raise ValueError(
            f"The folder {folder!r} holds webdataset shards ({', '.join(tars[:3])}...) and jsonl files "
            f"({', '.join(jsonl[:3])}...), and a stream reads one kind: pass a glob of one of them, e.g. "
            f"{os.path.join(folder, '*' + next(e for e in TAR_SHARDS if tars[0].endswith(e)))!r}."
        )
    if not names:
        subfolders = sorted(n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n)))
        inside = f" (only the folders {', '.join(subfolders[:5])}: pass one of them or a glob)" if subfolders else ""
        raise ValueError(
            f"The folder {folder!r} has no file to read{inside}. Pass webdataset shards (a folder of .tar / .tar.gz "
            "/ .tgz files, a glob or a {0000..0099} range), .jsonl files, or a folder load_dataset reads."
        )
    shards = tars or jsonl
    if not shards:
        return [folder]
    left_out = [n for n in names if n not in shards]
    if left_out:
        logger.warning("%s: reading its %d shards and not %s.", folder, len(shards), ", ".join(left_out[:10]))
    return [os.path.join(folder, n) for n in shards]


def stream_source(
    source: str | Sequence[str] | IterableDataset, split: str = "train", data_root: str | None = None, **load_kwargs
) -> StreamSource:
    """
    A [`StreamSource`] for `source`: webdataset tar shards (paths, globs or `{000..009}` ranges ending in `.tar`,
    `.tar.gz` or `.tgz`), jsonl files (their image paths relative to `data_root`, by default each file's folder), a
    folder of either ([`_folder_shards`]), a streaming `datasets.IterableDataset`, or any other name or folder, given
    to `load_dataset(..., streaming=True)`.
    """
    if isinstance(source, IterableDataset):
        shards = [f"{source.info.dataset_name or 'stream'}[shard {i}]" for i in range(source.num_shards)]
        return StreamSource(shards[0].split("[")[0], shards, "datasets", dataset=source, data_root=data_root)
    files = _expand(source)
    if files and all(f.endswith(TAR_SHARDS) for f in files):
        return StreamSource(os.path.commonpath(files) if len(files) > 1 else files[0], files, "webdataset")
    if files and all(f.endswith(".jsonl") for f in files):
        return StreamSource(
            files[0] if len(files) == 1 else os.path.commonpath(files), files, "jsonl", None, data_root
        )
    if len(files) != 1:
        raise ValueError(f"Expected .tar shards, .jsonl files or one dataset name / folder, got {files[:5]}.")
    dataset = load_dataset(files[0], split=split, streaming=True, **load_kwargs)
    return stream_source(dataset, data_root=data_root)


# --- validation and preprocessing, shard by shard ----------------------------------------------------------------


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


# --- ranks, shuffling and exact resume ----------------------------------------------------------------------------


def split_by_rank(dataset: IterableDataset, rank: int, world_size: int) -> tuple[IterableDataset, str]:
    """
    This rank's part of a stream, by `datasets.distributed.split_dataset_by_node`, and the strategy used:

    - `"shards"` when there are at least as many shards as ranks: each rank reads whole shards, ⌊n/w⌋ or ⌈n/w⌉ of
      them when `w` does not divide `n` (so ranks may get different numbers of rows);
    - `"examples"` with fewer shards than ranks: every rank reads every shard and keeps every `w`-th row.

    Either way every pair goes to exactly one rank per pass. Ranks never wait for data: [`ShuffledStream`] starts a
    rank's next pass as soon as its own ends, and the run's length is a number of steps (`max_steps`), the same on
    every rank.
    """
    if world_size == 1:
        return dataset, "shards"
    strategy = "shards" if dataset.num_shards >= world_size else "examples"
    return split_dataset_by_node(dataset, rank=rank, world_size=world_size, strategy=strategy), strategy


@contextmanager
def _quiet(name: str):
    logger_ = logging.getLogger(name)
    level = logger_.level
    logger_.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger_.setLevel(level)


class ShuffledStream(torch.utils.data.IterableDataset):
    """
    A rank's stream of pairs, shuffled by a buffer of `buffer_size` rows and repeated pass after pass (each pass with
    its own shard order and buffer draws, from `seed` and the pass number), for `passes` passes or for ever.

    It has `state_dict` / `load_state_dict` (used by torchdata's `StatefulDataLoader`, which accelerate wraps with
    `use_stateful_dataloader=True`, and which calls them in each worker) that resume exactly, buffer included:
    `datasets`' own buffered shuffle refills its buffer from later rows on resume, so the resumed order differs. The
    state holds the source's `state_dict` (datasets') at the oldest row still in the buffer, the positions of the
    buffered rows and the generator's state; loading it re-reads the source from that point (at most a few buffers
    of rows) and keeps the rows that were in the buffer.

    Args:
        dataset (`datasets.IterableDataset`): this rank's part of the stream ([`split_by_rank`]).
        buffer_size (`int`): rows in the shuffle buffer; 0 or 1 keeps the source order (the shard order is still
            shuffled when `shuffle_shards`).
        seed (`int`): the same on every rank.
        passes (`int`, *optional*): stop after this many passes (e.g. 1 for evaluation); `None` repeats for ever.
        shuffle_shards (`bool`): shuffle the order of the shards each pass (`IterableDataset.shuffle` of the source
            with no buffer of its own).
    """

    SNAPSHOT_EVERY = 32

    def __init__(
        self,
        dataset: IterableDataset,
        buffer_size: int = 1000,
        seed: int = 0,
        passes: int | None = None,
        shuffle_shards: bool = True,
    ):
        super().__init__()
        if int(buffer_size) < 0:
            raise ValueError(f"buffer_size must be 0 or more rows (0 or 1: no shuffle buffer), got {buffer_size}.")
        self.dataset = dataset
        self.buffer_size = max(int(buffer_size), 1)
        self.seed = seed
        self.passes = passes
        self.shuffle_shards = shuffle_shards
        self._live: tuple | None = None  # the running pass: (number, snapshots, buffer, rows read, generator)
        self._resume: dict[str, Any] | None = None

    def _source(self, pass_number: int) -> IterableDataset:
        if not self.shuffle_shards:
            return copy.copy(self.dataset)  # a resumed pass loads a state into it, not into the later passes' source
        # `buffer_size=1, max_buffer_input_shards=1`: datasets shuffles the shard order (from the seed and the epoch)
        # and nothing else; it neither buffers rows nor reads several shards at once.
        source = self.dataset.shuffle(seed=self.seed, buffer_size=1, max_buffer_input_shards=1)
        source.set_epoch(pass_number)
        return source

    def _generator(self, pass_number: int) -> np.random.Generator:
        worker = torch.utils.data.get_worker_info()
        return np.random.default_rng([self.seed, pass_number, worker.id if worker else 0])

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is; called between two rows (the generator paused at its `yield`)."""
        if self._live is None:  # nothing yielded yet: the state loaded (a resume not begun), or the start
            return json.loads(json.dumps(self._resume)) if self._resume is not None else {"pass": 0, "fresh": True}
        pass_number, snapshots, buffer, read, rng = self._live
        oldest = min((position for position, _ in buffer), default=read)
        position, source = next((p, state) for p, state in reversed(snapshots) if p <= oldest)
        state = {"pass": pass_number, "source_position": position, "source": source, "read": read,
                 "buffer": [p for p, _ in buffer], "rng": rng.bit_generator.state}  # fmt: skip
        return json.loads(json.dumps(state))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = None if state.get("fresh") else state
        self._live = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        resume, self._live = self._resume, None
        pass_number = resume["pass"] if resume else 0
        while self.passes is None or pass_number < self.passes:
            rows = 0
            for row in self._one_pass(pass_number, resume):
                rows += 1
                yield row
            if rows == 0 and resume is None and self.passes is None:
                # Repeating an empty pass would spin for ever without a batch, and hang the other ranks.
                worker = torch.utils.data.get_worker_info()
                where = f" (data loader worker {worker.id} of {worker.num_workers})" if worker else ""
                raise RuntimeError(
                    f"This process's part of the stream{where} has no usable pairs: every row of its shards was "
                    "quarantined or it got no shard. See the quarantine reports; use fewer workers or more shards."
                )
            resume = None
            pass_number += 1

    def _one_pass(self, pass_number: int, resume: dict | None) -> Iterator[dict[str, Any]]:
        source = self._source(pass_number)
        rng = self._generator(pass_number)
        buffer: list[tuple[int, dict]] = []  # (read position in this pass, row)
        snapshots: deque[tuple[int, dict]] = deque()  # (read position, source state before reading it)
        read = 0
        if resume:
            if resume["source"] is not None:
                with _quiet("datasets.iterable_dataset"):
                    # Its warning is about datasets' shuffle buffer, which is one row here (the shard order only).
                    source.load_state_dict(resume["source"])
            rng.bit_generator.state = resume["rng"]
            read = resume["source_position"]
            wanted = {position: slot for slot, position in enumerate(resume["buffer"])}
            slots: list[tuple[int, dict] | None] = [None] * len(wanted)
            iterator = iter(source)
            snapshots.append((read, resume["source"]))
            while read < resume["read"]:
                if read % self.SNAPSHOT_EVERY == 0 and read != snapshots[-1][0]:
                    snapshots.append((read, source.state_dict()))
                row = next(iterator)
                if read in wanted:
                    slots[wanted[read]] = (read, row)
                read += 1
            if any(slot is None for slot in slots):
                raise RuntimeError("The stream's state does not match its data: a buffered row was not found again.")
            buffer = slots
        else:
            iterator = iter(source)
            snapshots.append((0, None))  # None: the start of the pass
        exhausted = False
        while True:
            # Fill the buffer, then each row read takes the place of one drawn at random, which is yielded.
            while not exhausted and len(buffer) < self.buffer_size:
                if read % self.SNAPSHOT_EVERY == 0 and snapshots[-1][0] != read:
                    snapshots.append((read, source.state_dict()))
                try:
                    row = next(iterator)
                except StopIteration:
                    exhausted = True
                    break
                buffer.append((read, row))
                read += 1
            if not buffer:
                break
            index = int(rng.integers(len(buffer))) if len(buffer) > 1 else 0
            _, row = buffer[index]
            last = buffer.pop()
            if index < len(buffer):
                buffer[index] = last
            if len(snapshots) > 4 and read % self.SNAPSHOT_EVERY == 0:  # drop the snapshots no buffered row needs
                oldest = min((position for position, _ in buffer), default=read)
                while len(snapshots) > 1 and snapshots[1][0] <= oldest:
                    snapshots.popleft()
            self._live = (pass_number, snapshots, buffer, read, rng)
            self._resume = None  # from the first row on, the state is the live one
            yield row


def mix_streams(
    streams: Sequence[IterableDataset],
    ratios: Sequence[float],
    seed: int = 0,
    stopping_strategy: str = "all_exhausted",
) -> IterableDataset:
    """
    Several streams drawn from at the given `ratios` (normalised to probabilities), by `datasets.interleave_datasets`.
    With `"all_exhausted"` a source that runs out starts again until every source has been read through once, so the
    ratios hold for the whole pass; `"first_exhausted"` ends the pass with the first source to run out.
    """
    from datasets import interleave_datasets

    if len(ratios) != len(streams) or any(r <= 0 for r in ratios):
        raise ValueError(f"Give one positive ratio per stream: {len(streams)} streams, ratios {list(ratios)}.")
    total = float(sum(ratios))
    probabilities = [r / total for r in ratios]
    return interleave_datasets(
        list(streams), probabilities=probabilities, seed=seed, stopping_strategy=stopping_strategy
    )
