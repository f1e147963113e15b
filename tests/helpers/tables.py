"""Users' tables of pairs as the world writes them, made in code: every form `read_table` reads, each holding the same
rows, and the defects exported tables have."""

import csv
import gzip
import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
from datasets import Dataset, DatasetDict, Features, Value
from datasets import Image as ImageFeature
from PIL import Image


LABELS = ("cat", "dog", "bird")


def write_images(root: Path, count: int) -> list[str]:
    """`count` small PNGs of noise under `root` (sizes 24-31 x 20), their file names."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = []
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (20, 24 + i % 8, 3), dtype=np.uint8)).save(root / f"{i}.png")
        names.append(f"{i}.png")
    return names


def pair_rows(names: list[str]) -> list[dict]:
    """A row per image: a caption with a comma (CSV must quote it) and a label cycling over LABELS."""
    return [
        {"image": name, "text": f"photo {i}, a {LABELS[i % 3]}", "label": LABELS[i % 3]}
        for i, name in enumerate(names)
    ]


def excel_csv(path: Path, rows: list[dict], delimiter: str = ",", encoding: str = "utf-8-sig") -> Path:
    """As Excel's "CSV UTF-8" saves a sheet: a byte-order mark, CRLF line ends, fields quoted where needed; one caption
    holds a line break inside its quotes. Where a comma is the decimal mark, Excel separates by semicolons; its
    "Unicode Text" is UTF-16, tab-separated."""
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), delimiter=delimiter, lineterminator="\r\n")
    writer.writeheader()
    for i, row in enumerate(rows):
        writer.writerow({**row, "text": row["text"].replace(", ", ",\r\n", 1)} if i == 1 else row)
    data = buffer.getvalue().encode(encoding)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def embedded_images(rows: list[dict], root: Path) -> Dataset:
    """The rows with their images embedded as the hub's `Image` feature (bytes), as a hub parquet file holds them."""
    images = [{"bytes": (root / row["image"]).read_bytes(), "path": None} for row in rows]
    features = Features({"image": ImageFeature(), "text": Value("string"), "label": Value("string")})
    return Dataset.from_dict(
        {"image": images, "text": [r["text"] for r in rows], "label": [r["label"] for r in rows]}, features=features
    )


def every_form(folder: Path, rows: list[dict], root: Path) -> dict[str, Path]:
    """The same rows in every form a user brings, by name; image paths are relative to `root`, except in the forms
    that embed the images (`embedded.parquet`, `saved`, `saved_dict`) or hold them (`imagefolder_*`)."""
    folder.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    forms = {
        "excel.csv": excel_csv(folder / "excel.csv", rows),
        "excel.tsv": excel_csv(folder / "excel.tsv", rows, delimiter="\t"),
        "excel_semicolons.csv": excel_csv(folder / "excel_semicolons.csv", rows, delimiter=";"),
        "excel_unicode.tsv": excel_csv(folder / "excel_unicode.tsv", rows, delimiter="\t", encoding="utf-16"),
        "excel.csv.gz": excel_csv(folder / "excel.csv.gz", rows),
        "pairs.jsonl": jsonl(folder / "pairs.jsonl", rows),
        "lines.json": jsonl(folder / "lines.json", rows),
    }
    (folder / "array.json").write_text(json.dumps(rows, indent=2))
    forms["array.json"] = folder / "array.json"
    frame.to_json(folder / "pandas_columns.json")  # pandas' default: {column: {index: value}}
    forms["pandas_columns.json"] = folder / "pandas_columns.json"
    frame.to_csv(folder / "pandas_index.csv")  # pandas' default writes the index as a first, unnamed column
    forms["pandas_index.csv"] = folder / "pandas_index.csv"
    frame.to_parquet(folder / "paths.parquet")
    forms["paths.parquet"] = folder / "paths.parquet"
    embedded = embedded_images(rows, root)
    embedded.to_parquet(folder / "embedded.parquet")
    forms["embedded.parquet"] = folder / "embedded.parquet"
    embedded.save_to_disk(folder / "saved")
    forms["saved"] = folder / "saved"
    DatasetDict({"train": embedded}).save_to_disk(folder / "saved_dict")
    forms["saved_dict"] = folder / "saved_dict"
    for kind in ("jsonl", "csv"):
        images = folder / f"imagefolder_{kind}"
        images.mkdir()
        for row in rows:
            (images / row["image"]).write_bytes((root / row["image"]).read_bytes())
        metadata = [{"file_name": r["image"], "text": r["text"], "label": r["label"]} for r in rows]
        if kind == "jsonl":
            jsonl(images / "metadata.jsonl", metadata)
        else:
            pd.DataFrame(metadata).to_csv(images / "metadata.csv", index=False)
        forms[f"imagefolder_{kind}"] = images
    return forms
