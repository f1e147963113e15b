"""scripts/benchmarks/benchmark_onnx.py: a tiny run, its table and JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = pytest.mark.onnx
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmarks" / "benchmark_onnx.py"


def test_tiny_run_times_every_graph_and_batch_size(tmp_path):
    pytest.importorskip("onnxruntime")
    output = tmp_path / "onnx_inference"
    command = [sys.executable, str(SCRIPT), "--batch_sizes", "1,3", "--repeats", "1", "--calls", "1"]
    done = subprocess.run([*command, "--output", str(output)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(output.with_suffix(".json").read_text())
    cells = {(r["task"], r["graph"], r["batch_size"]) for r in report["results"]}
    graphs = [("vqa", "model"), ("pretrain", "image_encoder"), ("pretrain", "text_encoder")]
    assert cells == {(task, graph, batch) for task, graph in graphs for batch in (1, 3)}
    for r in report["results"]:
        assert r["pytorch_ms_per_call"]["median"] > 0 and r["onnxruntime_ms_per_call"]["median"] > 0
        assert r["max_abs_difference"] < 1e-4
        speedup = r["pytorch_ms_per_call"]["median"] / r["onnxruntime_ms_per_call"]["median"]
        assert r["speedup"] == pytest.approx(speedup)
    assert report["threads"] >= 1
