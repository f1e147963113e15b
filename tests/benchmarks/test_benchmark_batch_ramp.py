"""scripts/benchmarks/benchmark_batch_ramp.py: its runs and the callback that records and stops them."""

from types import SimpleNamespace

from transformers import TrainerControl


def test_runs_compare_the_same_recipe_with_and_without_the_ramp():
    import benchmark_batch_ramp as bench  # scripts/benchmarks is on sys.path (conftest.py)

    for dataset in ("easy_vqa", "sort_of_clevr"):
        fixed, _ = bench.RUNS[f"{dataset}_fixed"]
        ramped, _ = bench.RUNS[f"{dataset}_ramp"]
        assert ramped == fixed + bench.RAMP  # one change: the ramp


def test_stop_at_targets_records_each_evaluation_and_stops_at_the_highest_targets():
    import benchmark_batch_ramp as bench

    stopper = bench.StopAtTargets({"eval_accuracy": [0.6, 0.9]}, budget_s=100)
    control = TrainerControl()
    state = SimpleNamespace(global_step=10, epoch=0.5)
    stopper.on_log(None, state, control, logs={"loss": 1.0})  # a training log: not recorded
    stopper.on_log(None, state, control, logs={"eval_accuracy": 0.7, "elapsed_seconds": 12.0})
    assert not control.should_training_stop
    stopper.on_log(None, state, control, logs={"eval_accuracy": 0.91, "elapsed_seconds": 30.0})
    assert control.should_training_stop
    assert [e["seconds"] for e in stopper.curve] == [12.0, 30.0]
    assert bench.first_reach(stopper.curve, "eval_accuracy", 0.6)["seconds"] == 12.0
    assert bench.first_reach(stopper.curve, "eval_accuracy", 0.95) is None
    late = bench.StopAtTargets({"eval_accuracy": [0.99]}, budget_s=10)
    control = TrainerControl()
    late.on_log(None, state, control, logs={"eval_accuracy": 0.5, "elapsed_seconds": 11.0})
    assert control.should_training_stop  # over budget
