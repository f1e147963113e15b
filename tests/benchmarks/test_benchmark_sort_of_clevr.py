"""scripts/benchmarks/benchmark_sort_of_clevr.py: a run launched from the checkout's root with its zero-shot
evaluation, the table, the plot and the question-only ceiling."""

import json
from collections import Counter

import benchmark_sort_of_clevr as bench  # scripts/benchmarks is on sys.path (conftest.py)
import pytest
import zero_shot_sort_of_clevr as zero_shot
from helpers.training import TINY

from mm_fusion import MMFusionForPretraining, MMFusionProcessor
from mm_fusion.data import load_sort_of_clevr


OPTIONS = "num_train_images=24,num_test_images=8,seed=5"


def test_recipe_dataset_options_are_the_last_flag_or_the_config_files():
    assert (
        bench.recipe_dataset_options([bench.MAIN])
        == "num_train_images=10000,num_test_images=1000,questions_per_family=2"
    )
    flags = [bench.PRETRAIN, "--dataset_options", "seed=1", "--dataset_options", OPTIONS, "--max_steps", "2"]
    assert bench.recipe_dataset_options(flags) == OPTIONS


def test_pretrain_run_is_launched_from_the_checkout_root_and_followed_by_the_zero_shot_evaluation(
    tmp_path, monkeypatch
):
    flags = [bench.PRETRAIN, "--dataset_options", OPTIONS, *TINY, "--max_steps", "2"]
    flags += ["--gradient_accumulation_steps", "1"]
    monkeypatch.setitem(bench.RUNS, "pretrain", (flags, "tiny pretraining"))
    row = bench.run_one("pretrain", tmp_path, threads=1)  # `accelerate launch scripts/train.py`, cwd the checkout
    assert row["command"].startswith("launch scripts/train.py scripts/configs/sort_of_clevr_pretrain.yaml")
    assert row["command"].endswith(f"--output_dir {tmp_path / 'pretrain'} --disable_tqdm True --cpu_threads 1")
    results = json.loads((tmp_path / "pretrain" / "all_results.json").read_text())
    assert row["eval_text_to_image_R@1"] == results["eval_text_to_image_R@1"] and row["epoch"] == results["epoch"]
    assert row["wall_seconds"] > results["train_runtime"] == row["train_runtime"]
    # The zero-shot evaluation ran on the test images of the run's data (8 images of 6 objects), as it scores here.
    model = MMFusionForPretraining.from_pretrained(tmp_path / "pretrain")
    processor = MMFusionProcessor.from_pretrained(tmp_path / "pretrain")
    test = load_sort_of_clevr(["test"], rows="captions", num_train_images=24, num_test_images=8, seed=5)["test"]
    expected = zero_shot.zero_shot_accuracy(model, processor, test)
    assert row["pairs"] == expected["pairs"] == 48
    assert row["zero_shot_itc_accuracy"] == pytest.approx(expected["zero_shot_itc_accuracy"])
    assert row["zero_shot_itm_accuracy"] == pytest.approx(expected["zero_shot_itm_accuracy"])


def test_table_and_plot(tmp_path):
    families = {"shape": 0.51, "horizontal": 0.52, "vertical": 0.53, "closest": 0.54, "furthest": 0.55, "count": 0.56}
    rows = {
        name: {"run": name, "eval_accuracy": acc, "eval_accuracy_relational": rel,
               "eval_accuracy_non_relational": 0.99, **{f"eval_accuracy_{k}": v for k, v in families.items()},
               "wall_seconds": 600, "threads": 1}
        for name, acc, rel in (("film", 0.96, 0.95), ("late", 0.8, 0.63))
    }  # fmt: skip
    rows["film"]["curve"] = [
        {"step": 10, "epoch": 0.5, "elapsed_seconds": 60.0, "eval_accuracy_relational": 0.9,
         "eval_accuracy_non_relational": 0.99},
        {"step": 20, "epoch": 1.0, "elapsed_seconds": 126.0, "eval_accuracy_relational": 0.95,
         "eval_accuracy_non_relational": 0.98},
    ]  # fmt: skip
    rows["film"]["targets_reached"] = bench.time_to_targets(rows["film"]["curve"])
    assert rows["film"]["targets_reached"] == {"step": 20, "epoch": 1.0, "elapsed_seconds": 126.0}
    rows["late"]["curve"] = [{"step": 20, "epoch": 1.0, "eval_accuracy_relational": 0.63,
                              "eval_accuracy_non_relational": 0.99}]  # fmt: skip
    assert bench.time_to_targets(rows["late"]["curve"]) is None
    figures = {"best_non_relational": 0.912, "best_layer": "fusion layer 1", "layers": ["fusion layer 1"]}
    rows["late"]["pointing"] = {"by_method": {"attention": figures}}
    rows["late"]["pointing"]["by_method"]["grad_cam"] = {"best_non_relational": 0.5, "best_layer": "Grad-CAM, stage 3"}
    rows["late"]["pointing"]["by_method"]["attention_colour_word"] = {**figures, "best_non_relational": 0.99,
                                                                      "token": "colour word"}  # fmt: skip
    rows["late"]["pointing"]["by_method"]["tower_attention_colour_word"] = {
        "best_non_relational": 0.3, "best_layer": "vision stage 1 read", "layers": ["vision stage 1 read", "stage 2"]
    }  # fmt: skip
    rows["question_only_ceiling"] = {"run": "question_only_ceiling", "eval_accuracy": 0.4}
    recalls = {f"eval_{d}_R@{k}": k / 100 + (d == "image_to_text") / 1000 for d in ("text_to_image", "image_to_text")
               for k in (1, 5, 10)}  # fmt: skip
    rows["pretrain"] = {"run": "pretrain", **recalls, "zero_shot_itc_accuracy": 0.77, "zero_shot_itm_accuracy": 0.566,
                        "wall_seconds": 1170}  # fmt: skip
    lines = bench.markdown(rows).splitlines()
    header = (
        "| run | relational | non-relational | closest | furthest | count | shape | left | top | all "
        "| targets reached | pointing | wall time |"
    )
    assert lines[:2] == [header, "|" + "---|" * 13]
    # Columns in the header's order: types, then the families, each row's overall accuracy and its wall time.
    assert lines[2] == (
        "| film | 0.950 | 0.990 | 0.540 | 0.550 | 0.560 | 0.510 | 0.520 | 0.530 | 0.960 | "
        "epoch 1, 2.1 min into training | – | 10.0 min, 1 thread(s), sharing the machine |"
    )
    assert lines[3].startswith("| late | 0.630 | 0.990 |") and lines[3].endswith(
        "| 0.800 | no | 0.912 (attention); 0.500 (grad_cam); 0.990 (attention_colour_word); "
        "0.300 (tower_attention_colour_word, vision stage 1 read) | 10.0 min, 1 thread(s), sharing the machine |"
    )
    assert (
        lines[4] == "| question_only_ceiling | nan | nan | nan | nan | nan | nan | nan | nan | 0.400 | – | – "
        "| computed from the data |"
    )
    assert lines[5:] == [
        "",
        "| pretraining | t2i R@1 | t2i R@5 | t2i R@10 | i2t R@1 | i2t R@5 | i2t R@10 | zero-shot ITC | zero-shot ITM "
        "| wall time |",
        "|" + "---|" * 10,
        "| pretrain | 0.010 | 0.050 | 0.100 | 0.011 | 0.051 | 0.101 | 0.770 | 0.566 | 19.5 min |",
    ]
    bench.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_question_only_ceiling_answers_each_question_with_its_most_frequent_training_answer():
    options = "num_train_images=40,num_test_images=10,seed=2"
    row = bench.question_only_ceiling(options)
    data = load_sort_of_clevr(num_train_images=40, num_test_images=10, seed=2)
    answers = {}
    for question, answer in zip(data["train"]["question"], data["train"]["answer"]):
        answers.setdefault(question, Counter())[answer] += 1
    test = data["test"]
    right = [answers[q].most_common(1)[0][0] == a for q, a in zip(test["question"], test["answer"])]
    assert row["eval_accuracy"] == pytest.approx(sum(right) / len(right))
    relational = [r for r, t in zip(right, test["question_type"]) if t == "relational"]
    assert row["eval_accuracy_relational"] == pytest.approx(sum(relational) / len(relational))


def test_learning_curve_is_read_from_the_last_checkpoint(tmp_path):
    """Checkpoints ordered by step (checkpoint-10 after checkpoint-9); only evaluation entries, their accuracies and
    clock kept."""
    assert bench.learning_curve(tmp_path) == []
    for step in (9, 10):
        history = [
            {"step": 5, "loss": 1.0, "samples_per_second": 9.0},
            {"step": 5, "epoch": 0.5, "elapsed_seconds": 3.0, "eval_loss": 0.5, "eval_accuracy": 0.4,
             "eval_accuracy_relational": 0.3, "eval_runtime": 1.0},
        ][: 1 + (step == 10)]  # fmt: skip
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert bench.learning_curve(tmp_path) == [
        {"step": 5, "epoch": 0.5, "elapsed_seconds": 3.0, "eval_accuracy": 0.4, "eval_accuracy_relational": 0.3}
    ]
