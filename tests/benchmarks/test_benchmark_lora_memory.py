"""scripts/benchmarks/benchmark_lora_memory.py: a tiny run of its recipes under both allocators, its table and JSON,
and its count of the tensors saved for the backward against one made by hand."""

import json

import pytest
import torch
from torch import nn


pytest.importorskip("peft")


def test_saved_for_backward_counts_activations_by_layer_kind_without_parameters():
    from benchmark_lora_memory import saved_for_backward  # scripts/benchmarks is on sys.path (conftest.py)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1)

        def forward(self, x):
            return type("Out", (), {"loss": self.fc2(self.act(self.fc1(x))).sum()})()

    x = torch.randn(32, 64)
    total, kinds = saved_for_backward(Tiny(), {"x": x})
    # fc1 saves its input (32 x 64), GELU its input (32 x 256), fc2 its input (the GELU's output, 32 x 256); the
    # weights they save are parameters, left out.
    mib = 4 / 2**20
    assert kinds == pytest.approx({"Linear": (32 * 64 + 32 * 256) * mib, "GELU": 32 * 256 * mib})
    assert total == pytest.approx(sum(kinds.values()))


def test_tiny_run_compares_recipes_under_both_allocators(tmp_path):
    import benchmark_lora_memory

    output = tmp_path / "lora_memory"
    argv = ["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "2", "--intermediate_size",
            "64", "--image_size", "32", "--patch_size", "16", "--batch_size", "4", "--steps", "1",
            "--recipes", "full", "lora+ckpt", "lora_qv+ckpt", "lora+ckpt/1@mmap", "--output", str(output)]  # fmt: skip
    benchmark_lora_memory.main(argv)
    report = json.loads(output.with_suffix(".json").read_text())
    trials = {(t["allocator"], t["recipe"]): t for t in report["trials"]}
    recipes = ("full", "lora+ckpt", "lora_qv+ckpt")
    released = "glibc, mmap over 64 KiB"
    every_layer = trials.pop((released, "lora+ckpt/1"))  # one allocator only (@mmap)
    assert set(trials) == {(a, r) for a in benchmark_lora_memory.ALLOCATORS for r in recipes}
    # --lora checkpoints every second layer as it comes (of the towers' 4 layers, the fusion block's and peft's copy of
    # it, which trains fully); every_n_layers 1, every one
    assert '--activation_checkpointing_kwargs {"every_n_layers": 1}' in every_layer["command"]
    assert every_layer["checkpointed_layers"] == "6 of 6"
    assert trials[released, "lora+ckpt"]["checkpointed_layers"] == "3 of 6"
    assert every_layer["saved_for_backward_mib"] < trials[released, "lora+ckpt"]["saved_for_backward_mib"]
    assert every_layer["saved_for_backward_mib"] < trials[released, "full"]["saved_for_backward_mib"] / 2
    for (allocator, recipe), t in trials.items():
        lora = recipe.startswith("lora")
        assert ("--lora" in t["command"].split()) == lora
        assert t["gradient_checkpointing"] == recipe.endswith("+ckpt")  # --lora turns it on
        assert t["release_freed_memory"] == (benchmark_lora_memory.ALLOCATORS[allocator] == "True")
        assert (t["trainable_parameters"] < t["parameters"]) == lora and (t["peft_original_copies"] > 0) == lora
        assert t["peak_memory_mib"] >= t["built_mib"] > 0 and t["saved_for_backward_mib"] > 0
        # 4 questions; an image they share is encoded once
        assert 1 <= t["pixels_per_batch"][0] <= 4 and t["pixels_per_batch"][1:] == [3, 32, 32]
        assert t["gradients_and_optimizer_mib"] == pytest.approx(12 * t["trainable_parameters"] / 2**20, abs=0.1)
    for allocator in benchmark_lora_memory.ALLOCATORS:  # checkpointing took effect: fewer activations kept
        full, lora = (trials[allocator, r]["saved_for_backward_mib"] for r in ("full", "lora+ckpt"))
        assert lora < full
        # adapters on query / value only: fewer trainable parameters than on every Linear, named in the command
        every, qv = (trials[allocator, r] for r in ("lora+ckpt", "lora_qv+ckpt"))
        assert qv["trainable_parameters"] < every["trainable_parameters"]
        assert "--lora_target_modules query_value" in qv["command"]
        assert "--lora_target_modules all" in every["command"]
        for tower in ("vision_model", "text_model"):  # both towers adapted, at fewer layers
            assert 0 < qv["adapted_layers"][tower] < every["adapted_layers"][tower]
    # The report's lines that are not in the JSON: the ratios a user's comparison gives.
    table = output.with_suffix(".md").read_text()
    full = trials["glibc", "full"]
    for recipe in ("lora+ckpt", "lora_qv+ckpt"):
        lora = trials["glibc, mmap over 64 KiB", recipe]
        memory = lora["peak_memory_mib"] / full["peak_memory_mib"]
        time = lora["seconds_per_step"] / full["seconds_per_step"]
        assert f"**{memory:.2f}x** the memory" in table and f"**{time:.2f}x** the time" in table
