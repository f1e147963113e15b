"""scripts/benchmarks/benchmark_time_to_accuracy.py: its clock, its stops, its verdict, its default schedule, and a
tiny run of all three contenders end to end (each training scripts/train.py's default model)."""

import json
import math
import time
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def bench():
    import benchmark_time_to_accuracy  # scripts/benchmarks is on sys.path (conftest.py)

    return benchmark_time_to_accuracy


def test_clock_leaves_evaluations_out_and_stops_at_the_target(bench):
    clock = bench.TrainingClock(target=0.8, budget_s=60.0, eval_every=2, began=time.perf_counter())
    clock.start()
    assert clock.startup_s >= 0
    assert clock.step_end(1) is False and clock.step_end(2) is True  # every eval_every steps
    trained = clock.train_s
    time.sleep(0.05)  # an evaluation's time
    clock.evaluated(2, 0.5)
    assert clock.stop is False and clock.train_s == trained
    clock.step_end(3)
    assert clock.train_s - trained < 0.05  # the evaluation's 50 ms are not training
    clock.step_end(4)
    clock.evaluated(4, 0.81)
    assert clock.stop is True
    assert [e["step"] for e in clock.curve] == [2, 4]
    assert bench.first_time(clock.curve, 0.6)["step"] == 4 and bench.first_time(clock.curve, 0.9) is None


def test_clock_asks_for_an_evaluation_past_the_budget_and_stops_there(bench):
    clock = bench.TrainingClock(target=0.99, budget_s=0.0, eval_every=100, began=time.perf_counter())
    clock.start()
    assert clock.step_end(1) is True  # not an evaluation step, but past the budget
    clock.evaluated(1, 0.3)
    assert clock.stop is True


def test_clock_never_unsets_trainers_stop(bench):
    clock = bench.TrainingClock(target=0.99, budget_s=60.0, eval_every=1, began=time.perf_counter())
    clock.start()
    control = SimpleNamespace(should_training_stop=True, should_evaluate=False)  # Trainer's own flow, at max_steps
    clock.on_step_end(None, SimpleNamespace(global_step=1), control)
    assert control.should_evaluate is True
    clock.on_evaluate(None, SimpleNamespace(global_step=1), control, metrics={"eval_accuracy": 0.2})
    assert control.should_training_stop is True


def trial(name: str, curve: list[tuple]) -> dict:
    """A trial's result with this curve of (step, seconds of training, accuracy)."""
    curve = [{"step": s, "train_s": t, "accuracy": a} for s, t, a in curve]
    return {"contender": name, "model": "MMFusionForImageTextClassification", "parameters": 1000,
            "text_positions": 512 if name == "seed" else 64, "config_digest": "x", "startup_s": 1.0,
            "train_s": curve[-1]["train_s"], "budget_s": 60.0, "torch_threads": 2,
            "best_accuracy": max(e["accuracy"] for e in curve), "curve": curve}  # fmt: skip


def test_verdict_compares_each_accuracy_with_the_faster_baseline_that_reached_it(bench):
    trials = [
        trial("seed", [(1, 50.0, 0.65)]),
        trial("run_clip", [(1, 10.0, 0.62), (2, 20.0, 0.75), (3, 30.0, 0.9)]),
        trial("mm_fusion", [(1, 2.0, 0.61), (2, 4.0, 0.66), (3, 8.0, 0.76), (4, 9.0, 0.9), (5, 10.0, 0.95)]),
    ]
    args = SimpleNamespace(report_at=[0.6, 0.7], judged_at=[0.75, 0.9, 0.95, 0.99], target=0.99, eval_questions=100,
                           image_size=64, max_steps=10, eval_every=1)  # fmt: skip
    verdict = bench.compare(trials, bench.accuracies(args), args.judged_at)
    rows = [(r["accuracy"], r["judged"], r["faster_baseline"], r["ratio"], r["pass"]) for r in verdict["rows"]]
    assert rows == [
        (0.6, False, "run_clip", 0.2, True),  # seed reached it later (50 s)
        (0.7, False, "run_clip", 0.4, False),  # over 1/3, but not judged
        (0.75, True, "run_clip", 0.4, False),
        (0.9, True, "run_clip", 0.3, True),
        (0.95, True, None, None, None),  # mm_fusion only: nothing to compare with
    ]
    assert verdict["not_reached"] == [0.99] and verdict["pass"] is False  # 0.75 is judged and over 1/3
    text = bench.markdown(trials, args, {"cores": 2, "cpu": "cpu", "torch": "x"}, {"batch_size": 64, "max_length": 64},
                          verdict)  # fmt: skip
    assert "| seed | 1,000 | 512 | 1 s | 50 s (1) | – | – | – | – | – |" in text
    assert "| 0.75 | yes | 8 s | run_clip 20 s | 0.40 | FAIL |" in text
    assert "| 0.95 | yes | 10 s | none reached it | – | – |" in text
    assert "Reached by no contender: 0.99." in text and "Verdict: FAIL." in text
    assert "scripts/train.py's default model" in text and "Each contender trains the same nn.Module" in text

    # Only the unjudged accuracies over 1/3: a pass.
    verdict = bench.compare(trials, bench.accuracies(args), [0.9, 0.95, 0.99])
    assert verdict["pass"] is True

    # A baseline reaches an accuracy that mm_fusion does not reach within its budget: a FAIL row, not a missing one,
    # judged or not.
    trials[2] = trial("mm_fusion", [(1, 2.0, 0.61), (2, 4.0, 0.66)])
    verdict = bench.compare(trials, bench.accuracies(args), [0.9])
    assert [(r["accuracy"], r["ratio"], r["pass"]) for r in verdict["rows"]] == [
        (0.6, 0.2, True),
        (0.7, None, False),
        (0.75, None, False),
        (0.9, None, False),
    ]
    assert verdict["not_reached"] == [0.95, 0.99] and verdict["pass"] is False
    text = bench.markdown(trials, args, {"cores": 2, "cpu": "cpu", "torch": "x"}, {"batch_size": 64, "max_length": 64},
                          verdict)  # fmt: skip
    assert "| 0.7 | no | not reached | run_clip 20 s | – | FAIL |" in text
    assert "Reached by no contender: 0.95, 0.99." in text

    # Without the baselines there is nothing to judge.
    assert bench.compare(trials[2:], bench.accuracies(args), [0.9]) == {"rows": [], "not_reached": [], "pass": None}


def test_default_schedule_is_the_default_runs_length(bench):
    from mm_fusion.training import MMFusionTrainingArguments

    default = MMFusionTrainingArguments.__dataclass_fields__
    epochs, batch = default["num_train_epochs"].default, default["per_device_train_batch_size"].default
    assert bench.default_run_steps() == math.ceil(epochs * math.ceil(38_575 / batch))  # easy-VQA's training questions
    (args,) = bench.HfArgumentParser(bench.TimeToAccuracyArguments).parse_args_into_dataclasses(args=[])
    assert args.max_steps is None and args.target == 0.99 and args.judged_at == [0.9, 0.95, 0.99]


def test_tiny_run_trains_the_same_default_model_in_every_contender(bench, tmp_path):
    from baselines import SEED_MAX_LENGTH, recipe

    from mm_fusion.training import ModelArguments

    output = tmp_path / "time_to_accuracy"
    argv = ["--max_steps", "2", "--eval_every", "1", "--eval_questions", "16", "--train_questions", "128",
            "--image_size", "32", "--output", str(output)]  # fmt: skip
    report = bench.main(argv)
    assert json.loads(output.with_suffix(".json").read_text())["trials"] == report["trials"]
    trials = {t["contender"]: t for t in report["trials"]}
    assert list(trials) == ["seed", "run_clip", "mm_fusion"]
    for t in trials.values():
        assert [e["step"] for e in t["curve"]] == [1, 2] and all(0 <= e["accuracy"] <= 1 for e in t["curve"])
        assert t["train_s"] > 0 and t["startup_s"] > 0
    # One class and one config; the parameters differ by the seed BERT's extra position embeddings only.
    assert {t["model"] for t in trials.values()} == {"MMFusionForImageTextClassification"}
    assert len({t["config_digest"] for t in trials.values()}) == 1
    length = recipe()["max_length"]  # scripts/train.py's --max_length, which run_clip pads to
    positions = {n: t["text_positions"] for n, t in trials.items()}
    assert positions == {"seed": SEED_MAX_LENGTH, "run_clip": length, "mm_fusion": length}
    assert trials["run_clip"]["parameters"] == trials["mm_fusion"]["parameters"]
    extra = (SEED_MAX_LENGTH - length) * ModelArguments().hidden_size
    assert trials["seed"]["parameters"] - trials["mm_fusion"]["parameters"] == extra
    assert report["verdict"]["rows"] or report["verdict"]["not_reached"]
