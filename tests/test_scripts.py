"""The README's main command works: the quick-start script runs end to end (shortened here)."""

import importlib.util
from pathlib import Path


def _load_script(name: str):
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_trains_saves_and_reloads(tmp_path):
    quickstart = _load_script("quickstart")
    argv = ["--output_dir", str(tmp_path), "--num_samples", "16", "--steps", "3", "--batch_size", "4"]
    result = quickstart.main(argv)
    assert 0.0 <= result["fit_accuracy"] <= 1.0
    saved = {p.name for p in tmp_path.iterdir()}
    assert {"model.safetensors", "config.json", "modeling_mm_fusion.py", "processor_config.json"} <= saved
