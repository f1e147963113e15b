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
        # the schedule is sized to the budget from the probe's step time, and ends with an evaluation
        assert t["steps"] == max(1, int(2 / t["probe_seconds_per_step"])) or t["train_s"] >= 2
        assert t["curve"][-1]["step"] == t["steps"] and 0 <= t["final_accuracy"] <= t["best_accuracy"] <= 1
    gain = trials["mobilenet_v2"]["final_accuracy"] - trials["scratch"]["final_accuracy"]
    assert benchmark_composition.gains(report["trials"]) == {("easy_vqa", 32, "mobilenet_v2"): [round(gain, 4)]}
    table = output.with_suffix(".md").read_text()
    assert "| easy_vqa | 3 images | 32 | mobilenet_v2 |" in table and ("PASS" in table) == (gain >= 0.05)
