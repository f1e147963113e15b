"""
Users' tables of image-text pairs, read as a person would read them: every form a table is exported in, and each defect
of the table itself as one [`DataError`] that names the file, the line as an editor shows it, and what is wrong.

Forms: JSON lines (`.jsonl`, `.ndjson`, or a `.json` of lines), a JSON array of objects or an object of columns (as
pandas' `to_json` writes them), CSV / TSV as Excel, pandas and spreadsheets write them (UTF-8 with or without a
byte-order mark, or UTF-16; CRLF or LF; quoted fields holding commas and line breaks; semicolons where Excel writes
them for commas), each of these gzip-compressed too (`.csv.gz`), Parquet (image paths, or images embedded as the hub's
`Image` feature), a `save_to_disk` directory (a `Dataset`, or a `DatasetDict` and a split), an imagefolder with
`metadata.jsonl` / `metadata.csv`, and a hub data set name.

The text forms are parsed here, in Python, rather than by `datasets`' json / csv builders: those name no line (pyarrow
reports a byte offset), let pandas guess types (one blank label turns a column of integers into floats), and stop at a
byte-order mark. Parsing 10,000 rows takes a fraction of a second; the rows are then written to the Arrow cache by
`Dataset.from_generator`, keyed on the file's contents, so a later run (and its preprocessing cache) finds them. Every
value keeps its type (a column of mixed types is a `Json` column), so a number where a caption should be is still a
number when the rows are validated, and every row keeps the line it starts on ([`LINE_COLUMN`]) for the quarantine
report.
"""

import codecs
import csv
import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterator

from datasets import Dataset, Features, Json, Value, load_dataset, load_from_disk


LINE_COLUMN = "__line__"  # the line of the table a row starts on (text forms), for reports
TEXT_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv", ".tab": "tsv"}
PARQUET_SUFFIXES = (".parquet", ".pq")
METADATA_FILES = ("metadata.jsonl", "metadata.csv")
_MAX_INT64 = 2**63 - 1


class DataError(ValueError):
    """
    A defect of the data that stops a run before training: a table that cannot be read as one (a line that is not
    JSON, a row with the wrong number of fields, an empty file), a column that is not there, labels the head cannot
    predict, or too many unusable rows. Its message is one line that names the file, the line and the column where
    there is one, and what to do; `scripts/train.py` prints it as its `error:` line and exits with status 2.
    """


def where(path: str | os.PathLike, line: int | None = None) -> str:
    """`path:line`, as compilers and editors name a place in a file."""
    return f"{os.fspath(path)}:{line}" if line is not None else os.fspath(path)


def read_table(source: str | os.PathLike, split: str = "train", **load_kwargs) -> Dataset:
    """
    The rows of a table of pairs (any form in this module's docstring) as a `Dataset`; `split` picks the split of a
    `DatasetDict` directory or a hub data set. A defect of the table is a [`DataError`]; rows are not validated here
    (that is `prepare_dataset`'s job, which quarantines bad rows one by one).
    """
    path = os.fspath(source)
    if os.path.isfile(path):
        suffix = table_suffix(path)
        if suffix in TEXT_FORMATS:
            return _cached_text_table(path, TEXT_FORMATS[suffix])
        if suffix in PARQUET_SUFFIXES:
            return _nonempty(path, _load(path, "a Parquet file", "parquet", data_files={"train": path}, split="train"))
        known = ", ".join([*TEXT_FORMATS, *PARQUET_SUFFIXES]) + " (a text form also gzip-compressed, .csv.gz)"
        raise DataError(
            f"{path}: cannot read a table from a {suffix or 'suffix-less'} file; expected one of {known}, a directory "
            "written by Dataset.save_to_disk, an imagefolder with metadata.jsonl / metadata.csv, or a hub data set."
        )
    if os.path.isdir(path):
        splits = saved_splits(path)
        if splits is not None:
            if not splits:
                return _nonempty(path, _load(path, "a save_to_disk directory", path, loader=load_from_disk))
            if split not in splits:
                raise DataError(f"{path}: a DatasetDict without a {split!r} split; its splits are {splits}.")
            return _nonempty(path, _load(path, "a save_to_disk directory", path, loader=load_from_disk)[split])
        metadata = [name for name in METADATA_FILES if os.path.isfile(os.path.join(path, name))]
        if not metadata:
            raise DataError(
                f"{path}: a directory that is neither a save_to_disk directory (no dataset_info.json / "
                "dataset_dict.json) nor an imagefolder of pairs (no metadata.jsonl / metadata.csv)."
            )
        for name in metadata:  # its defects named by line, before datasets' imagefolder builder reads it
            table_rows(os.path.join(path, name))
        return _nonempty(path, _load(path, "an imagefolder", "imagefolder", data_dir=path, split=split, **load_kwargs))
    if table_suffix(path) in (*TEXT_FORMATS, *PARQUET_SUFFIXES) or path.startswith((".", os.sep, "~")):
        raise DataError(f"{path}: no such file or directory (from {os.getcwd()}).")
    what = f"a hub data set (no file or directory {path!r} here, from {os.getcwd()})"
    return _nonempty(path, _load(path, what, path, split=split, **load_kwargs))


def table_suffix(path: str) -> str:
    """A table file's form by its suffix, a gzip-compressed text table's by the one before `.gz`."""
    stem, suffix = os.path.splitext(path.lower())
    return os.path.splitext(stem)[1] if suffix == ".gz" else suffix


def saved_splits(path: str | os.PathLike) -> list[str] | None:
    """The splits of a `DatasetDict.save_to_disk` directory, `[]` for a `Dataset`'s, `None` for any other path."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json")) as f:
            return list(json.load(f).get("splits", []))
    if os.path.isfile(os.path.join(path, "dataset_info.json")) and os.path.isfile(os.path.join(path, "state.json")):
        return []
    return None


def _load(path: str, what: str, *args, loader=load_dataset, **kwargs):
    """`loader(*args, **kwargs)`, its failure a [`DataError`] that says what `path` was read as."""
    try:
        return loader(*args, **kwargs)
    except DataError:
        raise
    except Exception as error:  # datasets wraps the reader's error; its cause says what is wrong
        cause = error.__cause__ or error
        detail = " ".join(str(cause).split())[:300] or type(cause).__name__
        raise DataError(f"{path}: cannot be read as {what}: {detail}") from error


def _nonempty(path: str, dataset: Dataset) -> Dataset:
    if len(dataset) == 0:
        raise DataError(f"{path}: the table has no rows.")
    return dataset


# -- The text forms ---------------------------------------------------------------------------------------------------


def table_rows(path: str | os.PathLike, kind: str | None = None) -> tuple[list[str], list[tuple[int, dict]]]:
    """
    The columns and rows of a text table (`kind`: jsonl, json, csv or tsv; default: from the suffix), each row with the
    line it starts on. A defect of the table is a [`DataError`] naming its line.
    """
    path = os.fspath(path)
    kind = kind or TEXT_FORMATS[table_suffix(path)]
    text = _read_text(path)
    if not text.strip():
        raise DataError(f"{path}: the file is empty.")
    if kind == "jsonl":
        rows = _json_lines(path, text)
    elif kind == "json":
        rows = _json_document(path, text)
    else:
        columns, rows = _delimited(path, text, _delimiter(text) if kind == "csv" else "\t")
        return columns, rows
    columns = list(dict.fromkeys(key for _, row in rows for key in row))
    if not rows:
        raise DataError(f"{path}: the table has no rows.")
    return columns, rows


def _read_text(path: str) -> str:
    """The file as text (gzip-compressed or not): UTF-8, a leading byte-order mark dropped (Excel's "CSV UTF-8"
    writes one), or UTF-16 with its byte-order mark (Excel's "Unicode Text")."""
    with open(path, "rb") as f:
        data = f.read()
    if path.lower().endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as error:
            raise DataError(f"{path}: not a complete gzip file ({error}).") from None
    try:
        if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            return data.decode("utf-16")
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise DataError(
            f"{where(path, line)}: not UTF-8 text (byte 0x{data[error.start]:02x}); save the table as UTF-8 (Excel: "
            "'CSV UTF-8 (Comma delimited)')."
        ) from None


def _json_error(path: str, error: json.JSONDecodeError, line: int | None = None) -> DataError:
    what = "more text after the end of the row's object" if error.msg == "Extra data" else error.msg
    return DataError(f"{where(path, line or error.lineno)}: not valid JSON: {what} (column {error.colno}).")


def _json_lines(path: str, text: str, first_line: int = 1) -> list[tuple[int, dict]]:
    """One JSON object per line; blank lines are skipped."""
    rows = []
    for number, line in enumerate(text.split("\n"), start=first_line):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise _json_error(path, error, number) from None
        if not isinstance(row, dict):
            raise DataError(
                f"{where(path, number)}: a JSON {_json_kind(row)} where a row (an object of column: value) should be."
            )
        rows.append((number, row))
    return rows


def _json_kind(value) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null", dict: "object"}.get(
        type(value), "number"
    )


def _json_document(path: str, text: str) -> list[tuple[int, dict]]:
    """A `.json` file: an array of row objects, JSON lines, an object of columns (pandas' `to_json()`: column ->
    {index: value}, or column -> [values]), or an object with one array of rows (`{"data": [...]}`)."""
    start = len(text) - len(text.lstrip())
    if text[start] == "[":
        return _json_array(path, text, start)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data" and text[start] == "{":  # one object per line
            return _json_lines(path, text)
        raise _json_error(path, error) from None
    if isinstance(document, dict):
        value = next(iter(document.values()), None)
        if len(document) == 1 and isinstance(value, list) and all(isinstance(row, dict) for row in value):
            # {"data": [rows]}: the array starts after the one key and its colon
            i = _skip_space(text, start + 1)
            _, i = json.JSONDecoder().raw_decode(text, i)
            return _json_array(path, text, _skip_space(text, _skip_space(text, i) + 1))
        if document and all(isinstance(v, (dict, list)) for v in document.values()):
            return _json_columns(path, document)
    raise DataError(
        f"{path}: a JSON {_json_kind(document)} that is not a table; expected an array of row objects, one object per "
        "line, or an object of columns."
    )


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _json_array(path: str, text: str, start: int) -> list[tuple[int, dict]]:
    """The objects of the JSON array at `text[start]`, each with the line it starts on."""
    decoder, rows = json.JSONDecoder(), []
    line, counted = text.count("\n", 0, start) + 1, start  # `line` is the line of position `counted`
    i = _skip_space(text, start + 1)
    while i < len(text) and text[i] != "]":
        if rows:
            if text[i] != ",":
                line += text.count("\n", counted, i)
                raise DataError(f"{where(path, line)}: not valid JSON: expected ',' or ']', found {text[i]!r}.")
            i = _skip_space(text, i + 1)
        line += text.count("\n", counted, i)
        counted = i
        try:
            row, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as error:
            raise _json_error(path, error) from None
        if not isinstance(row, dict):
            raise DataError(
                f"{where(path, line)}: a JSON {_json_kind(row)} where a row (an object of column: value) should be."
            )
        rows.append((line, row))
        i = _skip_space(text, end)
    if i >= len(text):
        raise DataError(f"{where(path, text.count(chr(10)) + 1)}: not valid JSON: the array is not closed by ']'.")
    return rows


def _json_columns(path: str, document: dict) -> list[tuple[int, dict]]:
    """Rows of an object of columns; they have no lines of their own (the rows are numbered instead, from 1)."""
    columns = {name: list(v.values()) if isinstance(v, dict) else v for name, v in document.items()}
    lengths = {name: len(values) for name, values in columns.items()}
    if len(set(lengths.values())) > 1:
        raise DataError(f"{path}: an object of columns of different lengths: {lengths}.")
    count = next(iter(lengths.values()))
    return [(None, {name: values[i] for name, values in columns.items()}) for i in range(count)]


def _delimited(path: str, text: str, delimiter: str) -> tuple[list[str], list[tuple[int, dict]]]:
    """
    CSV / TSV rows by the header's names. Every value is text, an empty field `None` (CSV has no types; nothing is
    guessed, so labels `1` and `01` stay apart and a caption `NA` stays a caption). Lines are counted as an editor
    counts them (a quoted field's line breaks included); blank lines and rows of empty fields are skipped. A row whose
    extra fields are all empty (a trailing separator) is read; any other count of fields is a [`DataError`].
    """
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    kind = "TSV" if delimiter == "\t" else "CSV"
    separator = {",": "comma", ";": "semicolon", "\t": "tab"}[delimiter]
    header, header_line, rows, last_line = None, 0, [], 0
    try:
        for record in reader:
            first_line, last_line = last_line + 1, reader.line_num
            if not any(field.strip() for field in record):
                continue
            if header is None:
                header, header_line = _header(path, first_line, record), first_line
                continue
            extra = record[len(header) :]
            if len(record) < len(header) or any(field.strip() for field in extra):
                spans = f"; a quoted field opened on it runs to line {last_line}" if last_line > first_line else ""
                raise DataError(
                    f"{where(path, first_line)}: {len(record)} fields where the header (line {header_line}) has "
                    f"{len(header)}{spans}: a stray {separator} or quote? Quote a field that holds one."
                )
            rows.append((first_line, {name: value or None for name, value in zip(header, record)}))
    except csv.Error as error:
        raise DataError(f"{where(path, reader.line_num)}: not a valid {kind} line: {error}.") from None
    if header is None:
        raise DataError(f"{path}: the file is empty.")
    if not rows:
        raise DataError(f"{path}: a header (line {header_line}) but no rows.")
    return header, rows


def _delimiter(text: str) -> str:
    """A CSV's separator: a comma, or a semicolon when the header has semicolons and no comma (Excel writes CSV so
    where a comma is the decimal mark)."""
    header = next((line for line in text.split("\n") if line.strip()), "")
    return ";" if ";" in header and "," not in header else ","


def _header(path: str, line: int, record: list[str]) -> list[str]:
    """The column names of a header line, stripped of surrounding spaces; a column without a name (pandas' `to_csv`
    writes its index so) is named as pandas reads it back, `Unnamed: <position>`."""
    names = [field.strip() or f"Unnamed: {i}" for i, field in enumerate(record)]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise DataError(f"{where(path, line)}: the header names {repeated} more than once; name each column once.")
    return names


# -- Text rows to the Arrow cache -------------------------------------------------------------------------------------


_PARSED: dict[tuple[str, str], tuple[list[str], list[tuple[int | None, dict]]]] = {}


def _cached_text_table(path: str, kind: str) -> Dataset:
    """A text table as a `Dataset` written to the Arrow cache, keyed on the file's contents and form."""
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    columns, rows = table_rows(path, kind)  # as the user named it, in errors
    path = os.path.abspath(path)
    _PARSED[(path, digest)] = columns, rows
    features = Features({name: _feature([row.get(name) for _, row in rows]) for name in columns})
    features[LINE_COLUMN] = Value("int32")
    try:
        return Dataset.from_generator(
            _generate_rows, features=features, gen_kwargs={"path": path, "digest": digest, "kind": kind}
        )
    finally:
        _PARSED.pop((path, digest), None)


def _generate_rows(path: str, digest: str, kind: str) -> Iterator[dict]:
    """The rows of a text table, for `Dataset.from_generator`; a `Json` column's values JSON-encoded, which it stores
    as they are (it would store a text that parses as JSON, `"1"`, as the number)."""
    columns, rows = _PARSED.get((path, digest)) or table_rows(path, kind)
    features = {name: _feature([row.get(name) for _, row in rows]) for name in columns}
    encoded = [name for name, feature in features.items() if isinstance(feature, Json)]
    for line, row in rows:
        values = {name: row.get(name) for name in columns}
        for name in encoded:
            if values[name] is not None:
                values[name] = json.dumps(values[name])
        values[LINE_COLUMN] = line
        yield values


def _feature(values: list):
    """The one Arrow type a column's values share (`None` is allowed in any): text, boolean, integer or float, or
    `Json` for a column of mixed or nested values, which keeps each value as it was written."""
    types = {type(v) for v in values if v is not None}
    if types <= {str}:
        return Value("string")
    if types == {bool}:
        return Value("bool")
    if types == {int} and all(-_MAX_INT64 - 1 <= v <= _MAX_INT64 for v in values if v is not None):
        return Value("int64")
    if types <= {int, float} and bool not in types:
        return Value("float64")
    return Json()
