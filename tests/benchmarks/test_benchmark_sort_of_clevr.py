"""scripts/benchmarks/benchmark_sort_of_clevr.py: its table, plot and question-only ceiling."""

from collections import Counter

import benchmark_sort_of_clevr as bench  # scripts/benchmarks is on sys.path (conftest.py)
import pytest

from mm_fusion.data import load_sort_of_clevr


def test_table_and_plot(tmp_path):
    families = dict.fromkeys(("shape", "horizontal", "vertical", "closest", "furthest", "count"), 0.5)
    rows = {
        name: {"run": name, "eval_accuracy": acc, "eval_accuracy_relational": rel,
               "eval_accuracy_non_relational": 0.99, **{f"eval_accuracy_{k}": v for k, v in families.items()},
               "wall_seconds": 600, "threads": 1}
        for name, acc, rel in (("hierarchical", 0.96, 0.95), ("late", 0.8, 0.63))
    }  # fmt: skip
    table = bench.markdown(rows)
    assert "| hierarchical | 0.950 | 0.990 |" in table and "| late | 0.630 | 0.990 |" in table
    assert "10.0 min, 1 thread(s), sharing the machine |" in table
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
