"""scripts/benchmarks/benchmark_image_cache.py: a tiny run, its table and JSON."""

import json
import subprocess
import sys
from pathlib import Path


SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmarks" / "benchmark_image_cache.py"


def test_tiny_run_measures_every_corpus_size_and_format(tmp_path):
    output = tmp_path / "image_cache"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--images", "6", "--repeats", "1", "--batch_size", "4", "--output", str(output)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.with_suffix(".json").read_text())["results"]
    cells = {(r["corpus"], r["image_size"], r["format"]) for r in results}
    formats = ("uint8", "jpeg", "webp")
    assert cells == {(c, s, f) for c in ("easy_vqa", "synthetic") for s in (64, 224) for f in formats}
    for r in results:
        if r["format"] == "uint8":
            assert r["bytes_per_image"] == 3 * r["image_size"] ** 2 and r["mean_abs_pixel_error"] == 0
        else:
            assert r["bytes_per_image"] < 3 * r["image_size"] ** 2
        if r["format"] == "webp":
            assert r["mean_abs_pixel_error"] == 0  # lossless
        assert r["samples_per_second"]["median"] > 0
