"""scripts/benchmarks/benchmark_training_step.py: its timer, the size check, the report (the recipe and the seed-style
model: test_baselines.py)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainingArguments


SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmarks" / "benchmark_training_step.py"


@pytest.fixture(scope="module")
def bench():
    import benchmark_training_step  # scripts/benchmarks is on sys.path (conftest.py)

    return benchmark_training_step


def test_help_runs():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--loss_samples" in done.stdout


def test_per_size_values(bench):
    assert bench._per_size(None, {64: 30, 224: 10}, [64, 224, 128], "steps") == {64: 30, 224: 10, 128: 30}
    assert bench._per_size([3], {64: 30}, [64, 224], "steps") == {64: 3, 224: 3}
    assert bench._per_size([3, 4], {64: 30}, [64, 224], "steps") == {64: 3, 224: 4}
    with pytest.raises(ValueError, match="one per size"):
        bench._per_size([1, 2, 3], {64: 30}, [64, 224], "steps")


def test_contenders_have_the_same_size(bench):
    recipe = bench.recipe()
    for size in (64, 224):
        counts = bench.parameter_counts(size, 74, [str(i) for i in range(13)], recipe, None)
        assert counts["run_clip"] == counts["mm_fusion"]
        assert max(counts.values()) / min(counts.values()) - 1 <= 0.1


class _TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 3)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids).mean(1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_step_timer_splits_trainer_steps(bench, tmp_path):
    data = [{"input_ids": torch.randint(0, 10, (5,)), "labels": torch.tensor(i % 3)} for i in range(40)]
    model = _TinyModel()
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=6, report_to="none", disable_tqdm=True
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    timer = bench.StepTimer(warmup=2, steps=3)
    trainer.add_callback(bench.StepTimerCallback(timer, model))
    trainer.train()
    trainer.evaluate(data[:8])  # evaluation forwards are not counted
    assert len(timer.steps) == 6
    summary = timer.summary()
    assert summary["samples_per_step"] == 4
    assert summary["samples_per_s"] == pytest.approx(4 / summary["median_step_s"])
    assert sum(summary["split"].values()) == pytest.approx(1.0)
    assert summary["split"]["forward"] > 0 and summary["split"]["backward"] > 0
    assert summary["peak_memory_mib"] > 0


def _trial(bench, contender, round_, speed, wait=0.01):
    split = {p: 0.0 for p in bench.PARTS} | {"data_wait": wait, "forward": 0.4, "backward": 0.59 - wait}
    shape = {"hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 512, "num_hidden_layers": 2}
    towers = {"vision": {**shape, "patch_size": 8}, "text": shape, "fusion_layers": 2}
    return {
        "contender": contender,
        "image_size": 64,
        "round": round_,
        "samples_per_s": speed,
        "median_step_s": 64 / speed,
        "split": split,
        "peak_memory_mib": 1000.0,
        "parameters": 1_500_000 if contender == "seed" else 1_600_000,
        "towers": towers,
        "torch_threads": 2,
        "eval_loss": 1.5 if round_ == 0 else None,
        "eval_accuracy": 0.4 if round_ == 0 else None,
        "loss_samples": 128 if round_ == 0 else None,
    }


def test_report_marks_targets(bench, tmp_path):
    args = bench.BenchmarkArguments(sizes=[64], rounds=2, output=str(tmp_path / "out"))
    speeds = {"seed": (10.0, 12.0), "run_clip": (100.0, 90.0), "mm_fusion": (120.0, 125.0)}
    trials = [_trial(bench, c, r, speeds[c][r]) for r in range(2) for c in bench.CONTENDERS]
    rows, speedups = bench.summarise(trials, args)
    (entry,) = speedups
    assert entry["vs_seed"]["pass"] and entry["vs_seed"]["ratio"] == pytest.approx(122.5 / 11)
    assert not entry["vs_run_clip"]["pass"]  # 1.29x < 1.3x
    assert entry["vs_run_clip"]["per_round"] == pytest.approx([1.2, 125 / 90])
    assert entry["data_wait_pass"]
    checks = bench.parameter_check(trials)
    assert checks[0]["within_10_percent"] and checks[0]["same_towers"]
    info = {"gpu": None, "cores": 2, "cpu": "test", "trial_torch_threads": [2], "torch": "x", "transformers": "y"}
    settings = {64: {"warmup": 1, "steps": 2, "loss_samples": 128}}
    table = bench.markdown(rows, speedups, checks, args, info, bench.recipe(), settings)
    assert "| 64 | mm_fusion |" in table and "PASS (>= 2.0x)" in table and "FAIL (>= 1.3x)" in table
    bench.plot(rows, args, str(tmp_path / "chart.png"))
    assert (tmp_path / "chart.png").stat().st_size > 0
