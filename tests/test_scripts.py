"""The user entry points run as the README shows them: `scripts/train.py` gives what `mm_fusion.training` gives in
process, and the quick-start script trains, saves and reloads (shortened here)."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from helpers.training import TINY, train
from safetensors.torch import load_file


ROOT = Path(__file__).resolve().parents[1]


def _run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / f"{name}.py"), *args], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_train_script_runs_the_steps_of_the_library(tmp_path):
    """The script and `setup_run` + `train_and_save` on the same arguments: the same weights, metrics and output."""
    flags = [*TINY, "--max_train_samples", "48", "--max_eval_samples", "24", "--num_train_epochs", "1"]
    done = _run_script("train", "--output_dir", str(tmp_path / "script"), *flags)
    results = train(["--output_dir", str(tmp_path / "library"), *flags])
    script, library = (
        load_file(tmp_path / "script" / "model.safetensors"),
        load_file(tmp_path / "library" / "model.safetensors"),
    )
    assert script.keys() == library.keys() and all((script[k] == library[k]).all() for k in script)
    saved = json.loads((tmp_path / "script" / "all_results.json").read_text())
    assert saved["eval_accuracy"] == results["eval_accuracy"] and saved["train_loss"] == results["train_loss"]
    assert f"easy_vqa evaluation (24 pairs): accuracy = {results['eval_accuracy']:.4f}" in done.stdout
    files = {p.name for p in (tmp_path / "script").iterdir()}
    assert files == {p.name for p in (tmp_path / "library").iterdir()}
    # The card records the command that ran (it showed `scripts/train.py ...` whatever the launcher).
    command = shlex.join(
        ["python", str(ROOT / "scripts" / "train.py"), "--output_dir", str(tmp_path / "script"), *flags]
    )
    assert f"| command | `{command}` |" in (tmp_path / "script" / "README.md").read_text()


def test_the_card_of_an_accelerate_launch_records_that_command(tmp_path):
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    script = str(ROOT / "scripts" / "train.py")
    flags = [*TINY, "--max_train_samples", "16", "--max_steps", "1", "--eval_strategy", "no", "--save_strategy", "no",
             "--output_dir", str(tmp_path / "out")]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    launch = [accelerate, "launch", "--num_processes", "1", "--num_cpu_threads_per_process", "1", script, *flags]
    done = subprocess.run(launch, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    command = shlex.join(["accelerate", *launch[1:]])
    assert f"| command | `{command}` |" in (tmp_path / "out" / "README.md").read_text()


def test_quickstart_trains_saves_and_reloads(tmp_path):
    done = _run_script("quickstart", "--output_dir", str(tmp_path), "--num_samples", "16", "--steps", "3",
                       "--batch_size", "4")  # fmt: skip
    saved = {p.name for p in tmp_path.iterdir()}
    assert {"model.safetensors", "config.json", "modeling_mm_fusion.py", "processor_config.json"} <= saved
    # Five test questions answered by the model reloaded with its own code and by the pipeline: the same answers.
    rows = [line.split() for line in done.stdout.splitlines() if " predicted " in line and " pipeline " in line]
    assert len(rows) == 5
    for words in rows:
        assert words[words.index("predicted") + 1] == words[words.index("pipeline") + 1], words
