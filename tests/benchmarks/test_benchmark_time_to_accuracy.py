"""scripts/benchmarks/benchmark_time_to_accuracy.py: its clock, its stops and its report (the trials themselves are
the training-step benchmark's contenders)."""

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


def test_report_compares_each_accuracy_with_the_faster_baseline_that_reached_it(bench):
    def trial(name, curve):
        curve = [{"step": s, "train_s": t, "accuracy": a} for s, t, a in curve]
        return {"contender": name, "parameters": 1000, "startup_s": 1.0, "train_s": curve[-1]["train_s"],
                "budget_s": 60.0, "torch_threads": 2, "best_accuracy": max(e["accuracy"] for e in curve),
                "curve": curve}  # fmt: skip

    trials = [
        trial("seed", [(1, 50.0, 0.65)]),
        trial("run_clip", [(1, 10.0, 0.62), (2, 20.0, 0.75)]),
        trial("mm_fusion", [(1, 2.0, 0.61), (2, 4.0, 0.66), (3, 8.0, 0.76)]),
    ]
    args = SimpleNamespace(report_at=[0.6, 0.7], target=0.75, eval_questions=100, image_size=64, max_steps=10,
                           eval_every=1)  # fmt: skip
    info = {"cores": 2, "cpu": "cpu", "torch": "x"}
    text, ratios = bench.markdown(trials, args, info, {"batch_size": 64})
    assert [(r["accuracy"], r["faster_baseline"], r["ratio"]) for r in ratios] == [
        (0.6, "run_clip", 0.2),
        (0.7, "run_clip", 0.4),
        (0.75, "run_clip", 0.4),
    ]
    assert [r["pass"] for r in ratios] == [True, False, False]
    assert "| seed | 1,000 | 1 s | 50 s (1) | – | – |" in text

    # A baseline reaches an accuracy that mm_fusion does not reach within its budget: a failed row, not a missing one.
    trials[2] = trial("mm_fusion", [(1, 2.0, 0.61), (2, 4.0, 0.66)])
    text, ratios = bench.markdown(trials, args, info, {"batch_size": 64})
    assert [(r["accuracy"], r["ratio"], r["pass"]) for r in ratios] == [
        (0.6, 0.2, True),
        (0.7, None, False),
        (0.75, None, False),
    ]
    assert "| 0.7 | run_clip | not reached | FAIL |" in text


def test_every_contender_trains_the_default_model_at_about_its_size(bench):
    """The seed loop fuses the default ResNet tower's last map with nn.MultiheadAttention; run_clip and mm_fusion
    train the default model without its stages' reads of the question (`SAME_MODEL`): all three within 2% of its
    parameters."""
    import torch
    from baselines import SEED_MAX_LENGTH, build_fusion_config, seed_model

    from mm_fusion import MMFusionForImageTextClassification
    from mm_fusion.training import ModelArguments

    assert bench.default_tower() == ModelArguments().vision_tower == "resnet"
    labels = [str(i) for i in range(13)]
    same = (bench.default_tower(), bench.SAME_MODEL)
    ours = MMFusionForImageTextClassification(build_fusion_config(64, 500, 64, labels, None, *same))
    assert not ours.config.vision_text_attention
    seed = seed_model(build_fusion_config(64, 500, SEED_MAX_LENGTH, labels, None, *same))
    # The same ResNet: as a backbone in mm_fusion's model, as the plain model (its last map) in the seed loop.
    assert (type(ours.mm_fusion.vision_model).__name__, type(seed.vision_model).__name__) == (
        "ResNetBackbone",
        "ResNetModel",
    )
    sizes = [sum(p.numel() for p in m.parameters()) for m in (ours, seed)]
    assert abs(sizes[0] - sizes[1]) / sizes[0] < 0.02, sizes
    loss, logits = seed(
        torch.zeros(2, 3, 64, 64), torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5), torch.ones(2).long()
    )
    assert logits.shape == (2, 13) and loss.isfinite()
