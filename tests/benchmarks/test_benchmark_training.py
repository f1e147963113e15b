"""scripts/benchmarks/benchmark_training.py: a recipe launched from the checkout's root, its row merged into the
results, and the table."""

import json

import benchmark_training as bench  # scripts/benchmarks is on sys.path (conftest.py)
import pytest
from helpers.training import TINY


def run(seed: int, accuracy: float, wall: float, speed: float) -> dict:
    return {"seed": seed, "description": "d", "command": "c", "test_accuracy": accuracy, "wall_seconds": wall,
            "median_train_samples_per_second": speed, "accuracy_per_evaluation": [0.5, accuracy]}  # fmt: skip


def test_seeds_give_the_mean_with_the_worst_and_best_seed_and_every_seeds_figure():
    runs = [run(0, 0.93, 300, 900), run(1, 0.96, 240, 1000), run(2, 0.96, 270, 800)]
    row = bench.combine("default", runs)
    assert row["seeds"] == [0, 1, 2] and row["runs"] == runs
    assert row["test_accuracy"] == {"mean": pytest.approx(0.95), "min": 0.93, "max": 0.96}
    assert row["wall_seconds"] == {"mean": 270, "min": 240, "max": 300}
    assert row["train_samples_per_second"] == {"mean": 900, "min": 800, "max": 1000}
    single = {**bench.combine("full", [run(4, 0.99, 630, 854)]), "machine": {"cpu": "AMD EPYC"}}
    assert bench.table([row, single]).splitlines() == [
        "| run | what | seeds | test accuracy: mean (worst–best seed) | per seed | wall time (min): mean (min–max) "
        "| training samples/s | CPU |",
        "|" + "---|" * 8,
        "| default | d | 0, 1, 2 | 0.9500 (0.9300–0.9600) | 0.9300, 0.9600, 0.9600 | 4.5 (4.0–5.0) | 900 (800–1000) "
        "| ? |",
        "| full | d | 4 | 0.9900 | 0.9900 | 10.5 | 854 | AMD EPYC |",
    ]


def test_a_recipe_is_launched_from_the_checkout_root_and_merged_into_the_results(tmp_path, monkeypatch):
    flags = ["--dataset", "sort_of_clevr", "--dataset_options", "num_train_images=24,num_test_images=8,seed=5"]
    monkeypatch.setitem(bench.RUNS, "tiny", [*flags, *TINY, "--max_steps", "2"])
    monkeypatch.setitem(bench.DESCRIPTIONS, "tiny", "a tiny Sort-of-CLEVR run")
    # Results already there: a row over seeds is kept, one of the older repeats-of-one-seed format is dropped.
    kept = bench.combine("full", [run(0, 0.99, 630, 854)])
    old = {"run": "short", "repeats": 3, "test_accuracy": {"median": 0.9}}
    (tmp_path / "results.json").write_text(json.dumps({"machine": "m", "runs": [kept, old]}))
    stale = tmp_path / "runs" / "tiny-seed3" / "checkpoint-9999"  # an earlier, longer run's checkpoint
    stale.mkdir(parents=True)
    argv = ["--runs", "tiny", "--seeds", "3", "--output_root", str(tmp_path / "runs"), "--results",
            str(tmp_path / "results")]  # fmt: skip
    ordered = bench.main(argv)  # `accelerate launch scripts/train.py ...` with the checkout as working directory

    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["run"] for r in saved["runs"]] == [r["run"] for r in ordered] == ["full", "tiny"]
    assert saved["runs"][0] == kept
    (tiny,) = saved["runs"][1]["runs"]
    assert tiny["command"] == (
        f"accelerate launch scripts/train.py {' '.join(bench.RUNS['tiny'])} --seed 3 --output_dir "
        f"{tmp_path / 'runs' / 'tiny-seed3'} --disable_tqdm True"
    )
    assert saved["runs"][1]["machine"]["cpu"] and saved["runs"][1]["seeds"] == [3]
    assert not stale.exists()  # the run started in an empty directory
    results = json.loads((tmp_path / "runs" / "tiny-seed3" / "all_results.json").read_text())
    state = json.loads((tmp_path / "runs" / "tiny-seed3" / "trainer_state.json").read_text())
    assert tiny["test_accuracy"] == results["eval_accuracy"] and tiny["train_seconds"] == results["train_runtime"]
    assert tiny["wall_seconds"] > tiny["train_seconds"]
    assert tiny["accuracy_per_evaluation"] == [
        round(h["eval_accuracy"], 4) for h in state["log_history"] if "eval_accuracy" in h
    ]
    assert tiny["accuracy_per_evaluation"][-1] == round(tiny["test_accuracy"], 4)  # the final evaluation comes last
    speeds = sorted(h["samples_per_second"] for h in state["log_history"] if "samples_per_second" in h)
    assert len(speeds) == 2 and tiny["median_train_samples_per_second"] == speeds[1]
    assert saved["runs"][1]["description"] == "a tiny Sort-of-CLEVR run"


def test_more_seeds_join_a_row_of_the_same_machine_and_replace_the_seeds_run_again(tmp_path, monkeypatch):
    monkeypatch.setitem(bench.DESCRIPTIONS, "tiny", "d")
    monkeypatch.setitem(bench.RUNS, "tiny", [])
    accuracy = {0: 0.9, 1: 0.8, 2: 0.7}
    monkeypatch.setattr(
        bench,
        "run_one",
        lambda name, seed, out, code=None: {
            **run(seed, accuracy[seed], 60, 100),
            "run": name,
            "description": bench.describe(name),
        },
    )
    argv = ["--runs", "tiny", "--output_root", str(tmp_path / "runs"), "--results", str(tmp_path / "results")]
    bench.main([*argv, "--seeds", "0,1"])
    accuracy[1] = 0.85  # seed 1 again: its new run replaces the old one
    bench.main([*argv, "--seeds", "1,2"])
    (row,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert row["seeds"] == [0, 1, 2] and [r["test_accuracy"] for r in row["runs"]] == [0.9, 0.85, 0.7]
    assert row["test_accuracy"] == {"mean": pytest.approx(0.8166666), "min": 0.7, "max": 0.9}
    # On another machine the row starts again.
    another = {**bench.machine(), "cpu": "another"}
    monkeypatch.setattr(bench, "machine", lambda: another)
    bench.main([*argv, "--seeds", "2"])
    (row,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert row["seeds"] == [2] and row["machine"]["cpu"] == "another"
    # A recipe whose description changed (its defaults did) starts its row again too.
    bench.main([*argv, "--seeds", "1"])
    monkeypatch.setitem(bench.DESCRIPTIONS, "tiny", "d, 4 epochs")
    bench.main([*argv, "--seeds", "0"])
    (row,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert row["seeds"] == [0] and row["description"] == "d, 4 epochs"


UNFACTORED_READS = "41766e4"  # a commit whose stage reads are never factored (no MMFusionStageRead._factored_pays)


def test_a_recipe_at_a_commit_runs_that_commits_code(tmp_path, monkeypatch):
    """`RECIPE@COMMIT` runs the same command from a worktree of that commit, whose mm_fusion is the one imported:
    the code saved with its model is that commit's."""
    import subprocess

    known = subprocess.run(["git", "-C", str(bench.ROOT), "cat-file", "-e", f"{UNFACTORED_READS}^{{commit}}"])
    if known.returncode != 0:
        pytest.skip(f"commit {UNFACTORED_READS} is not in this clone's history")
    flags = ["--dataset", "sort_of_clevr", "--dataset_options", "num_train_images=24,num_test_images=8,seed=5"]
    monkeypatch.setitem(bench.RUNS, "tiny", [*flags, *TINY, "--max_steps", "2"])
    monkeypatch.setitem(bench.DESCRIPTIONS, "tiny", "a tiny Sort-of-CLEVR run")
    old = f"tiny@{UNFACTORED_READS}"
    worktrees = ["git", "-C", str(bench.ROOT), "worktree", "list", "--porcelain"]
    before = subprocess.run(worktrees, capture_output=True, text=True, check=True).stdout
    argv = ["--runs", f"tiny,{old}", "--seeds", "3", "--output_root", str(tmp_path / "runs"), "--results",
            str(tmp_path / "results")]  # fmt: skip
    ordered = bench.main(argv)
    assert [r["run"] for r in ordered] == ["tiny", old]
    assert ordered[1]["description"] == f"the same command on the code of commit {UNFACTORED_READS}"
    saved_code = {run: (tmp_path / "runs" / f"{run}-seed3" / "vision_towers.py").read_text() for run in ("tiny", old)}
    assert "_factored_pays" in saved_code["tiny"] and "_factored_pays" not in saved_code[old]
    # The run's worktree is gone (one left by a run killed earlier may still be listed, before and after).
    assert subprocess.run(worktrees, capture_output=True, text=True, check=True).stdout == before
