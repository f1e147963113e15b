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
            "--recipes", "full", "lora+ckpt", "--output", str(output)]  # fmt: skip
    benchmark_lora_memory.main(argv)
    report = json.loads(output.with_suffix(".json").read_text())
    trials = {(t["allocator"], t["recipe"]): t for t in report["trials"]}
    assert set(trials) == {(a, r) for a in benchmark_lora_memory.ALLOCATORS for r in ("full", "lora+ckpt")}
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
        assert lora < full / 2
    # The report's one line that is not in the JSON: the ratio a user's comparison gives.
    table = output.with_suffix(".md").read_text()
    as_they_come = (
        trials["glibc, mmap over 64 KiB", "lora+ckpt"]["peak_memory_mib"] / trials["glibc", "full"]["peak_memory_mib"]
    )
    assert "`--lora` as it comes" in table and f"**{as_they_come:.2f}**" in table
