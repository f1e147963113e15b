"""Users' own tables: every form they export trains, each defect of a table is one line naming its file and line, each
bad row is quarantined with its reason and line, and data that is mostly garbage is refused. In process through the
real loader, then each kind once through `scripts/train.py` as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.tables import LABELS, every_form, excel_csv, jsonl, pair_rows, write_images
from helpers.training import TINY

from mm_fusion import train_tokenizer
from mm_fusion.data import LINE_COLUMN, DataError, class_names, prepare_dataset, read_table
from mm_fusion.training import DataArguments, check_usable, load_raw_datasets


ROOT = Path(__file__).resolve().parents[1]
SIZE = 16


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Images, their rows, and the same rows in every form (tests/helpers/tables.py)."""
    base = tmp_path_factory.mktemp("tables")
    root = base / "images"
    rows = pair_rows(write_images(root, 12))
    tokenizer = train_tokenizer([r["text"] for r in rows] + ["a question"], vocab_size=100)
    return {
        "base": base,
        "root": root,
        "rows": rows,
        "forms": every_form(base / "forms", rows, root),
        "tokenizer": tokenizer,
    }


def _prepare(world, data, **kwargs):
    args = dict(image_column="image", text_column="text", label_column="label", image_size=SIZE)
    args.update({"data_root": str(world["root"]), **kwargs})
    return prepare_dataset(data, world["tokenizer"], **args)


FORMS = ["excel.csv", "excel.tsv", "excel_semicolons.csv", "excel_unicode.tsv", "excel.csv.gz", "pairs.jsonl",
         "lines.json", "array.json", "pandas_columns.json", "pandas_index.csv", "paths.parquet", "embedded.parquet",
         "saved", "saved_dict", "imagefolder_jsonl", "imagefolder_csv"]  # fmt: skip


@pytest.mark.parametrize("form", FORMS)
def test_every_form_a_user_exports_gives_the_same_pairs(world, form):
    data = read_table(world["forms"][form])
    # An imagefolder holds its images: --data_root, for a table's relative paths, is not given with it.
    prepared = _prepare(world, data, data_root=None if "imagefolder" in form else str(world["root"]))
    assert not prepared.quarantine, prepared.quarantine
    texts = [r["text"] for r in world["rows"]]
    if "excel" in form:  # the caption with a line break inside its quotes keeps it, as Excel wrote it
        texts[1] = texts[1].replace(", ", ",\r\n", 1)
    assert data["text"] == texts
    labels = [prepared.label_names[i] for i in prepared.pairs["labels"]]
    assert labels == [r["label"] for r in world["rows"]] and prepared.label_names == sorted(LABELS)
    assert (prepared.image_sizes == [[24 + i % 8, 20] for i in range(12)]).all()  # every image decoded as it was
    if form.endswith((".csv", ".tsv", ".gz", ".jsonl", "lines.json", "array.json")):
        # Lines as an editor shows them: after a header, across a quoted line break, 5 lines to an indented object.
        lines = {
            "excel.csv": [2, 3, 5],
            "excel.tsv": [2, 3, 5],
            "pandas_index.csv": [2, 3, 4],
            "array.json": [2, 7, 12],
        }
        assert data[LINE_COLUMN][:3] == lines.get(form, [2, 3, 5] if "excel" in form else [1, 2, 3])


def test_a_csv_train_set_and_a_jsonl_or_parquet_eval_set_combine(world, tmp_path):
    forms = world["forms"]
    for train, evaluation in [("excel.csv", "pairs.jsonl"), ("paths.parquet", "excel.tsv"), ("saved", "excel.csv")]:
        data = {"train": read_table(forms[train]), "eval": read_table(forms[evaluation])}
        from datasets import DatasetDict

        prepared = _prepare(world, DatasetDict(data))
        assert not prepared.quarantine and len(prepared.pairs["eval"]) == 12, (train, evaluation)


TABLE_DEFECTS = {
    "broken.jsonl": (
        '{"image": "0.png", "text": "a", "label": "cat"}\n' * 8 + '{"image": "8.png", "text": "b", "label": "dog"}}\n',
        r"broken.jsonl:9: not valid JSON: more text after the end of the row's object \(column 48\)",
    ),
    "unquoted.jsonl": (
        '{"image": "0.png"}\n{image: "1.png"}\n',
        r"unquoted.jsonl:2: not valid JSON: Expecting property",
    ),
    "array_row.jsonl": ('{"image": "0.png"}\n\n["1.png", "x"]\n', r"array_row.jsonl:3: a JSON array where a row"),
    "stray.csv": (
        "image,text,label\r\n0.png,a,cat\r\n1.png,b, c,dog\r\n",
        r"stray.csv:3: 4 fields where the header \(line 1\) has 3: a stray comma or quote\?",
    ),
    "open_quote.csv": (
        'image,text,label\n0.png,"a,cat\n1.png,b,dog\n2.png,c,cat\n',
        r"open_quote.csv:2: 2 fields where the header \(line 1\) has 3; a quoted field opened on it runs to line 4",
    ),
    "short.tsv": (
        "image\ttext\tlabel\n0.png\ta\tcat\n1.png\tb\n",
        r"short.tsv:3: 2 fields where the header .* stray tab",
    ),
    "latin1.csv": (
        "image,text,label\n0.png,café,cat\n".encode("cp1252"),
        r"latin1.csv:2: not UTF-8 text \(byte 0xe9\)",
    ),
    "empty.jsonl": ("", r"empty.jsonl: the file is empty"),
    "blank.csv": ("\r\n\r\n", r"blank.csv: the file is empty"),
    "header_only.csv": ("image,text,label\r\n", r"header_only.csv: a header \(line 1\) but no rows"),
    "twice.csv": ("image,text,image\n0.png,a,1.png\n", r"twice.csv:1: the header names \['image'\] more than once"),
    "unclosed.json": ('[\n {"image": "0.png"},\n {"image": "1.png"}\n', r"unclosed.json:4: not valid JSON"),
    "number.json": ("42\n", r"number.json: a JSON number that is not a table"),
    "pairs.xlsx": (b"PK\x03\x04", r"pairs.xlsx: cannot read a table from a .xlsx file; expected one of .jsonl"),
    "not.parquet": (b"PAR1 this is not parquet", r"not.parquet: cannot be read as a Parquet file"),
}


@pytest.mark.parametrize("name", list(TABLE_DEFECTS))
def test_a_table_defect_is_one_line_naming_the_file_and_line(tmp_path, name):
    content, message = TABLE_DEFECTS[name]
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError, match=message) as error:
        read_table(path)
    assert "\n" not in str(error.value)


def test_a_directory_or_name_that_is_no_table_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match=r"folder: a directory that is neither a save_to_disk directory"):
        read_table(tmp_path / "folder")
    with pytest.raises(DataError, match=r"missing.csv: no such file or directory"):
        read_table(tmp_path / "missing.csv")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"someone/pairs: cannot be read as a hub data set \(no file or directory"):
        read_table("someone/pairs")


def test_bad_rows_are_quarantined_with_their_reason_and_line(world, tmp_path):
    good = world["rows"]
    rows = [
        good[0],
        {**good[1], "label": None},  # line 2
        {k: v for k, v in good[2].items() if k != "label"},  # 3: no label key
        {**good[3], "label": ["cat", "dog"]},  # 4: not one value
        {**good[4], "label": "  "},  # 5
        {**good[5], "text": None},  # 6
        {**good[6], "text": ""},  # 7
        {**good[7], "text": 1984},  # 8: a number where a caption should be
        {**good[8], "image": "https://example.com/8.png"},  # 9
        {**good[9], "image": "nowhere.png"},  # 10
        {**good[10], "image": "../outside.png"},  # 11
        {**good[11], "label": " dog "},  # 12: kept, as "dog"
    ]
    path = jsonl(tmp_path / "rows.jsonl", rows)
    report = tmp_path / "quarantine.jsonl"
    prepared = _prepare(world, read_table(path), quarantine_path=report)
    reasons = {q["line"]: q["reason"] for q in prepared.quarantine}
    assert {line: reason.split(":")[0] for line, reason in reasons.items()} == {
        2: "bad_label", 3: "bad_label", 4: "bad_label", 5: "bad_label", 6: "bad_text", 7: "bad_text",
        8: "bad_text", 9: "url_image", 10: "missing_image", 11: "path_outside_root",
    }  # fmt: skip
    assert "not one value but a list" in reasons[4] and "a number where text should be: 1984" in reasons[8]
    assert "URLs are not fetched" in reasons[9] and "no label (null or absent)" in reasons[2] == reasons[3]
    assert [json.loads(line) for line in report.read_text().splitlines()] == prepared.quarantine
    # Nothing else is lost: the good rows are kept, in order, the padded label read as its class.
    assert prepared.pairs["id"] == ["0", "11"]
    assert [prepared.label_names[i] for i in prepared.pairs["labels"]] == ["cat", "dog"]


def test_mixed_label_types_name_one_class(world, tmp_path):
    """1, 1.0, "1" and "1.0" are the class "1" (a table's cells are text; pandas writes an integer column with a
    blank as floats); classes of whole numbers are ordered numerically."""
    values = [1, "1", 1.0, 10, "2", 2.0, " 10", 0, "0.0", 1, 2, 10]
    rows = [{**row, "label": value} for row, value in zip(world["rows"], values)]
    prepared = _prepare(world, read_table(jsonl(tmp_path / "mixed.jsonl", rows)))
    assert prepared.label_names == ["0", "1", "2", "10"] and not prepared.quarantine
    assert [prepared.label_names[i] for i in prepared.pairs["labels"]] == [str(int(float(v))) for v in values]
    assert class_names([True, False, None, [1]]) == ["false", "true"]


def _check(world, tmp_path, rows, **data_args):
    args = DataArguments(dataset=str(jsonl(tmp_path / "rows.jsonl", rows)), image_column="image", text_column="text",
                         label_column="label", data_root=str(world["root"]), **data_args)  # fmt: skip
    data = load_raw_datasets(args, task="classify")
    prepared = _prepare(world, data)
    check_usable(prepared, args, tmp_path / "quarantine.jsonl")
    return prepared


def test_data_that_is_mostly_garbage_is_refused_with_its_likely_cause(world, tmp_path):
    rows = world["rows"]
    assert len(_check(world, tmp_path, [*rows[:10], {**rows[10], "image": "gone.png"}]).quarantine) == 1  # 1 of 11
    too_many = [{**r, "label": None} if i < 2 else r for i, r in enumerate(rows)]  # 2 of 12 > 10%
    message = (r"2 of 12 train rows are unusable \(bad_label 2\), more than --max_bad_fraction 0.1 allows. The first "
               r"bad_label is at line 1: no label .*is --label_column right\?")  # fmt: skip
    with pytest.raises(DataError, match=message):
        _check(world, tmp_path, too_many)
    _check(world, tmp_path, too_many, max_bad_fraction=0.2)
    moved = [{**r, "image": "photos/" + r["image"]} for r in rows]
    message = (r"12 of 12 train rows are unusable \(missing_image 12\), so no train pair is left. The first "
               r"missing_image is at line 1: no file at .*/images/photos/0.png; is --data_root right\? It is "
               r"'.*images'")  # fmt: skip
    with pytest.raises(DataError, match=message):
        _check(world, tmp_path, moved, max_bad_fraction=1.0)


# -- scripts/train.py, as a user runs it -----------------------------------------------------------------------------


def _train_args(work: Path, *args: str) -> dict:
    """`python scripts/train.py` on the tiny model with `args`, run in `work` (its output in `work`/out)."""
    flags = [*TINY, "--task", "classify", "--image_column", "image", "--text_column", "text", "--label_column",
             "label", "--output_dir", str(work / "out"), "--num_train_epochs", "1"]  # fmt: skip
    return {"argv": [str(ROOT / "scripts" / "train.py"), *flags, *args], "cwd": work}


@pytest.fixture(scope="module")
def script_runs(world, tmp_path_factory) -> dict:
    """The command lines of the tests below that end before training, each as a user runs it, in one child interpreter
    (tests/helpers/run_scripts.py: one start and one import of torch for the four): name -> (its working directory,
    its outcome)."""
    from helpers.run_scripts import run_in_one_child

    rows, root = world["rows"], str(world["root"])
    runs = {}

    work = tmp_path_factory.mktemp("broken")
    path = excel_csv(work / "pairs.csv", rows)
    path.write_bytes(path.read_bytes().replace(b'"photo 5, a bird"', b"photo 5, a bird"))  # a quote lost
    runs["broken"] = _train_args(work, "--dataset", str(path), "--data_root", root, "--eval_strategy", "no")

    work = tmp_path_factory.mktemp("labels")
    train = excel_csv(work / "train.csv", rows)
    evaluation = jsonl(work / "eval.jsonl", [*rows[:4], {**rows[4], "label": "fish"}, {**rows[5], "label": "fish"}])
    runs["labels"] = _train_args(work, "--dataset", str(train), "--eval_dataset", str(evaluation), "--data_root", root)

    for name, wrong_root in (("wrong_root", True), ("check_data", False)):
        work = tmp_path_factory.mktemp(name)
        path = jsonl(work / "pairs.jsonl", rows)
        data_root = str(work / "imgs") if wrong_root else root
        runs[name] = _train_args(work, "--dataset", str(path), "--data_root", data_root,
                                 "--validation_split_percentage", "25", "--check_data")  # fmt: skip

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_in_one_child(list(runs.values()), tmp_path_factory.mktemp("runs"), env=env)
    return {name: (Path(r["cwd"]), result) for (name, r), result in zip(runs.items(), done)}


def _error_lines(done: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return [line for line in done.stderr.splitlines() if "error:" in line]


def test_the_script_refuses_a_broken_table_in_one_line_before_building_a_model(script_runs):
    work, done = script_runs["broken"]
    assert done.returncode == 2
    path = work / "pairs.csv"
    assert _error_lines(done) == [f"train.py: error: {path}:8: 4 fields where the header (line 1) has 3: a stray "
                                  "comma or quote? Quote a field that holds one."]  # fmt: skip
    assert not (work / "out" / "quarantine.jsonl").exists()  # stopped before any row was validated


def test_the_script_refuses_labels_the_head_cannot_predict(script_runs):
    work, done = script_runs["labels"]
    train, evaluation = work / "train.csv", work / "eval.jsonl"
    assert done.returncode == 2 and _error_lines(done) == [
        f"train.py: error: {evaluation}: 2 evaluation rows have a label that the training data ({train}) lacks, so "
        "the head cannot predict them: 'fish' (2, first at line 5). Add those classes to the training data or drop "
        "those rows."
    ]


def test_the_script_trains_on_every_good_row_and_quarantines_the_bad(world, tmp_path):
    """A run that trains, in a process of its own: what it logs goes to the process's stderr."""
    rows = [*world["rows"], {**world["rows"][0], "label": None}]
    path = jsonl(tmp_path / "pairs.jsonl", rows * 2)  # 26 rows, 2 without a label
    run = _train_args(tmp_path, "--dataset", str(path), "--data_root", str(world["root"]), "--eval_strategy", "no")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *run["argv"]], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0 and not _error_lines(done), done.stderr[-3000:]
    report = [json.loads(line) for line in (tmp_path / "out" / "quarantine.jsonl").read_text().splitlines()]
    assert [(q["line"], q["reason"]) for q in report] == [(13, "bad_label: no label (null or absent)"),
                                                          (26, "bad_label: no label (null or absent)")]  # fmt: skip
    assert "Left out 2 of 26 rows (bad_label: 2)" in done.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_the_script_refuses_a_wrong_data_root_and_checks_data_without_training(script_runs):
    work, done = script_runs["wrong_root"]
    path, wrong = work / "pairs.jsonl", str(work / "imgs")
    assert done.returncode == 2
    (line,) = _error_lines(done)
    assert line.startswith(f"train.py: error: {path}: 9 of 9 train rows are unusable (missing_image 9), so no train "
                           "pair is left. The first missing_image is at line ")  # fmt: skip
    assert f"is --data_root right? It is '{wrong}'." in line and "/imgs/" in line
    report = (work / "out" / "quarantine.jsonl").read_text().splitlines()
    assert len(report) == 12 and all("missing_image" in json.loads(q)["reason"] for q in report)
    assert "left out: 12 of 12 rows (100.0%): missing_image 12" in done.stdout
    assert not (work / "out" / "model.safetensors").exists()

    work, done = script_runs["check_data"]
    assert done.returncode == 0 and not _error_lines(done), done.stderr[-3000:]
    assert "train: 9 rows from" in done.stdout and "classes: 3 (usable training rows:" in done.stdout
    assert "images: 12 distinct usable, 24x20 to 31x20 pixels" in done.stdout
    assert "ok: scripts/train.py would train on 9 pairs and evaluate on 3" in done.stdout
    assert not (work / "out" / "model.safetensors").exists()
