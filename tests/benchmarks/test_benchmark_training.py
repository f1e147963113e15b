"""scripts/benchmarks/benchmark_training.py: a recipe launched from the checkout's root, its row merged into the
results, and the table."""

import json

import benchmark_training as bench  # scripts/benchmarks is on sys.path (conftest.py)
from helpers.training import TINY


def run(accuracy: float, wall: float, speed: float, wait: float) -> dict:
    return {"description": "d", "command": "c", "test_accuracy": accuracy, "wall_seconds": wall,
            "median_train_samples_per_second": speed, "median_data_wait_fraction": wait,
            "accuracy_per_epoch": [0.5, accuracy]}  # fmt: skip


def test_repeats_give_medians_with_the_range_and_one_run_its_figures():
    runs = [run(0.93, 300, 900, 0.04), run(0.95, 240, 1000, 0.03), run(0.94, 270, 800, 0.05)]
    row = bench.combine("default", runs)
    assert row["repeats"] == 3 and row["runs"] == runs
    assert row["test_accuracy"] == {"median": 0.94, "min": 0.93, "max": 0.95}
    assert row["wall_seconds"] == {"median": 270, "min": 240, "max": 300}
    assert row["train_samples_per_second"] == {"median": 900, "min": 800, "max": 1000}
    assert row["data_wait_fraction"] == {"median": 0.04, "min": 0.03, "max": 0.05}
    single = bench.combine("full", [run(0.99, 630, 854, 0.1)])
    assert bench.table([row, single]).splitlines() == [
        "| run | what | runs | test accuracy | wall time (min) | training samples/s | data wait "
        "| accuracy at each evaluation (first run) |",
        "|" + "---|" * 8,
        "| default | d | 3 | 0.9400 (0.9300–0.9500) | 4.5 (4.0–5.0) | 900 (800–1000) | 4.0 (3.0–5.0)% "
        "| 0.500, 0.930 |",
        "| full | d | 1 | 0.9900 | 10.5 | 854 | 10.0% | 0.500, 0.990 |",
    ]


def test_a_recipe_is_launched_from_the_checkout_root_and_merged_into_the_results(tmp_path, monkeypatch):
    flags = ["--dataset", "sort_of_clevr", "--dataset_options", "num_train_images=24,num_test_images=8,seed=5"]
    monkeypatch.setitem(bench.RUNS, "tiny", [*flags, *TINY, "--max_steps", "2"])
    monkeypatch.setitem(bench.DESCRIPTIONS, "tiny", "a tiny Sort-of-CLEVR run")
    # Results already there: a row of the current format is kept, one of the older one-run format is dropped.
    kept = bench.combine("full", [run(0.99, 630, 854, 0.1)])
    old = {"run": "short", "test_accuracy": 0.9}
    (tmp_path / "results.json").write_text(json.dumps({"machine": "m", "runs": [kept, old]}))
    argv = ["--runs", "tiny", "--output_root", str(tmp_path / "runs"), "--results", str(tmp_path / "results")]
    ordered = bench.main(argv)  # `accelerate launch scripts/train.py ...` with the checkout as working directory

    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["run"] for r in saved["runs"]] == [r["run"] for r in ordered] == ["full", "tiny"]
    assert saved["runs"][0] == kept
    (tiny,) = saved["runs"][1]["runs"]
    assert tiny["command"] == (
        f"accelerate launch scripts/train.py {' '.join(bench.RUNS['tiny'])} --output_dir "
        f"{tmp_path / 'runs' / 'tiny-0'} --disable_tqdm True"
    )
    results = json.loads((tmp_path / "runs" / "tiny-0" / "all_results.json").read_text())
    state = json.loads((tmp_path / "runs" / "tiny-0" / "trainer_state.json").read_text())
    assert tiny["test_accuracy"] == results["eval_accuracy"] and tiny["train_seconds"] == results["train_runtime"]
    assert tiny["wall_seconds"] > tiny["train_seconds"]
    assert tiny["accuracy_per_epoch"] == [
        round(h["eval_accuracy"], 4) for h in state["log_history"] if "eval_accuracy" in h
    ]
    assert tiny["accuracy_per_epoch"][-1] == round(tiny["test_accuracy"], 4)  # the final evaluation comes last
    speeds = sorted(h["samples_per_second"] for h in state["log_history"] if "samples_per_second" in h)
    assert len(speeds) == 2 and tiny["median_train_samples_per_second"] == speeds[1]
    markdown = (tmp_path / "results.md").read_text()
    assert bench.table(ordered) in markdown and "| tiny | a tiny Sort-of-CLEVR run | 1 |" in markdown
