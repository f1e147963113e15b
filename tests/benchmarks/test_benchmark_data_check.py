"""scripts/benchmarks/benchmark_data_check.py: its tables, and a quick run's report."""

import csv
import json
import subprocess
import sys
from pathlib import Path

from PIL import Image


SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmarks" / "benchmark_data_check.py"


def test_tables_hold_the_rows_images_planted_rows_and_the_broken_line(tmp_path):
    import benchmark_data_check as bench  # scripts/benchmarks is on sys.path (conftest.py)

    options = bench.Options(rows=40, error_rows=20, error_line=9)
    written = bench.make_tables(tmp_path, options)
    with open(tmp_path / "pairs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == written["rows"] == 40 and written["distinct_images"] == 10
    assert [p["kind"] for p in written["planted"]] == list(bench.PLANTED)
    for planted in written["planted"]:
        row = rows[planted["line"] - 2]  # line 1 is the header
        path = tmp_path / "images" / row["image"]
        if planted["kind"] == "missing_image":
            assert not path.exists()
        elif planted["kind"] == "null_label":
            assert row["label"] == ""
        else:
            assert path.is_file()
    bad = {p["line"] - 2 for p in written["planted"]}
    good = [r for n, r in enumerate(rows) if n not in bad]
    assert {r["label"] for r in good} <= set(bench.CLASSES[:5])
    assert {r["image"] for r in good} == {f"{i:05d}.png" for i in range(10)}  # 4 questions per image
    assert 64 <= min(Image.open(tmp_path / "images" / good[0]["image"]).size) <= 160
    lines = (tmp_path / "broken.jsonl").read_text().splitlines()
    assert len(lines) == 20
    for number, line in enumerate(lines, 1):
        try:
            json.loads(line)
            assert number != 9
        except json.JSONDecodeError:
            assert number == 9


def test_quick_run_times_the_check_and_the_first_error(tmp_path):
    output = tmp_path / "data_check"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output", str(output)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(output.with_suffix(".json").read_text())
    assert report["machine"]["cpu"] and report["options"]["rows"] == 400

    check = report["check"]
    assert check["exit_codes"] == [0] and check["ok"]
    assert check["rows_per_second"]["median"] > 0 and check["images_per_second"]["median"] > 0
    assert check["wall_seconds"]["median"] > check["report_seconds"]["median"] > 0
    assert check["left_out"] == len(check["planted"]) == 4  # every planted row, and nothing else
    assert check["usable_images"] == check["distinct_images"] == 100 and check["image_size"] == 64
    phases = check["phases"]
    assert phases["validation"] > 0 and phases["start_up"] > 0
    assert abs(sum(phases[s] for s in ("start_up", "read_table", "tokenizer", "model", "validation", "rest"))
               - phases["wall"]) < 1e-6  # fmt: skip

    first = report["first_error"]
    assert first["exit_codes"] == [2] and first["error_line_counts"] == [1]
    assert first["error_line"].startswith("train.py: error: broken.jsonl:9: not valid JSON")
    assert 0 < first["error_seconds"]["median"] <= first["exit_seconds"]["median"]
    assert first["ratio"] > 0 and first["baseline_seconds"]["median"] > 0
