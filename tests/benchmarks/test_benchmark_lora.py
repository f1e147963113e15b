"""scripts/benchmarks/benchmark_lora.py: a tiny run of both recipes (a small MobileNetV2 from scratch, MiniLM), its
table and JSON."""

import json

import pytest
from transformers import MobileNetV2Model

from mm_fusion.training.arguments import DEFAULT_LEARNING_RATE, LORA_LEARNING_RATE


pytest.importorskip("peft")


def test_tiny_run_compares_lora_with_full_fine_tuning(tmp_path, tester):
    import benchmark_lora  # scripts/benchmarks is on sys.path (conftest.py)

    tower = tmp_path / "mobilenet_v2"
    MobileNetV2Model(tester.mobilenet_config(image_size=32, tf_padding=False)).save_pretrained(
        tower
    )  # as torchvision's
    output = tmp_path / "lora"
    argv = ["--vision_tower", str(tower), "--image_size", "32", "--max_steps", "2", "--eval_every", "1",
            "--lora_args=--lora --lora_r 4"]  # fmt: skip
    benchmark_lora.main([*argv, "--eval_questions", "16", "--output", str(output)])
    report = json.loads(output.with_suffix(".json").read_text())
    trials = {t["recipe"]: t for t in report["trials"]}
    assert set(trials) == {"full", "lora"} and report["runs_at_once"] == 2
    full, lora = trials["full"], trials["lora"]
    # each at the rate scripts/train.py gives it
    assert (full["learning_rate"], lora["learning_rate"]) == (DEFAULT_LEARNING_RATE, LORA_LEARNING_RATE)
    assert full["trainable_parameters"] == full["parameters"]
    # the adapters, the head and the fusion block (as wide as MiniLM: 384), against the whole model
    assert 0 < lora["trainable_parameters"] < full["trainable_parameters"] / 3
    assert (
        "--lora_r 4" in lora["command"]
        and full["saved_file"] == "model.safetensors"
        and lora["saved_file"] == "adapter_model.safetensors"
    )
    assert 0 < lora["saved_mib"] < full["saved_mib"] / 3  # the towers' frozen weights are not in the adapter
    for t in trials.values():
        assert [e["step"] for e in t["curve"]] == [1, 2] and 0 <= t["best_accuracy"] <= 1
        assert t["peak_memory_mib"] > 0 and t["train_s"] > 0 and ("--lora" in t["command"].split()) == (t is lora)
