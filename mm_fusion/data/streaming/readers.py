"""Shard readers: one shard (a webdataset tar, plain or compressed; a jsonl file; a `load_dataset` streaming source's
shard) in, raw rows out, with [`StreamSource`] naming the shards of a stream."""

import codecs
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from datasets import IterableDataset, load_dataset


logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm")


class ShardError(RuntimeError):
    """A shard that cannot be read as a whole (truncated, corrupt or missing); it is reported and skipped."""


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
