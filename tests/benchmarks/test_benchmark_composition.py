"""scripts/benchmarks/benchmark_composition.py: a tiny run of both recipes on easy-VQA, its table, JSON and gains."""

import json

from transformers import MobileNetV2Model


def test_tiny_run_compares_composition_with_scratch_at_equal_time(tmp_path, tester):
    import benchmark_composition  # scripts/benchmarks is on sys.path (conftest.py)

    tower = tmp_path / "mobilenet_v2"
    MobileNetV2Model(tester.mobilenet_config(image_size=32, tf_padding=False)).save_pretrained(tower)
    output = tmp_path / "composition"
    argv = ["--vision_tower", str(tower), "--datasets", "easy_vqa", "--easy_vqa_images", "3", "--image_sizes", "32",
            "--seeds", "0", "--budget_s", "2", "--eval_every", "2", "--eval_questions", "8", "--probe_steps", "4",
            "--train_args=--per_device_train_batch_size 4 --hidden_size 32 --vision_widths 8,16",
            "--output", str(output)]  # fmt: skip
    benchmark_composition.main(argv)
    report = json.loads(output.with_suffix(".json").read_text())
    trials = {t["recipe"]: t for t in report["trials"]}
    assert set(trials) == {"scratch", "mobilenet_v2"}
    for recipe, t in trials.items():
        assert ("--vision_model_name_or_path" in t["command"]) == (recipe != "scratch")
        assert t["train_rows"] == benchmark_composition.training_rows("easy_vqa", 3) > 3
        assert f"--max_train_samples {t['train_rows']}" in t["command"]
        # the schedule is sized in seconds: the clock ends the run at the budget with the rate decayed to ~0 (the
        # probe's step time only caps the steps), and the run ends with an evaluation
        cap = max(1, int(2 * 2 / t["probe_seconds_per_step"]))
        assert (t["train_s"] >= 2 and t["final_lr_factor"] < 0.02 and t["steps"] <= cap) or t["steps"] == cap
        assert t["curve"][-1]["step"] == t["steps"] and 0 <= t["final_accuracy"] <= t["best_accuracy"] <= 1
    gain = trials["mobilenet_v2"]["final_accuracy"] - trials["scratch"]["final_accuracy"]
    assert benchmark_composition.gains(report["trials"]) == {("easy_vqa", 32, "mobilenet_v2"): [round(gain, 4)]}
    table = output.with_suffix(".md").read_text()
    assert "| easy_vqa | 3 images | 32 | mobilenet_v2 |" in table and ("PASS" in table) == (gain >= 0.05)


def test_equal_steps_instead_of_equal_time(tmp_path, tester):
    """`--steps N`: each run takes N optimizer steps on its own schedule (no probe, no clock), for learning-rate and
    LoRA comparisons by accuracy."""
    import benchmark_composition

    tower = tmp_path / "mobilenet_v2"
    MobileNetV2Model(tester.mobilenet_config(image_size=32, tf_padding=False)).save_pretrained(tower)
    output = tmp_path / "composition"
    argv = ["--vision_tower", str(tower), "--datasets", "easy_vqa", "--easy_vqa_images", "3", "--image_sizes", "32",
            "--seeds", "0", "--recipes", "mobilenet_v2", "--steps", "3", "--eval_every", "2", "--eval_questions", "8",
            "--train_args=--per_device_train_batch_size 4", "--composed_args=--learning_rate 1e-3",
            "--output", str(output)]  # fmt: skip
    report = benchmark_composition.main(argv)
    (trial,) = report["trials"]
    assert trial["steps"] == 3 and [e["step"] for e in trial["curve"]] == [2, 3]
    assert "--max_steps 3" in trial["command"] and trial["command"].endswith("--learning_rate 1e-3")
    assert "3 optimizer steps on its own schedule" in output.with_suffix(".md").read_text()
