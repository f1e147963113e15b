"""scripts/benchmarks/benchmark_costs.py: its settings, the two fusion blocks, tiny trials and the report."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
from baselines import tower_shapes  # scripts/benchmarks is on sys.path (conftest.py)

from mm_fusion.training import ModelArguments


SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmarks" / "benchmark_costs.py"
LABELS = [str(i) for i in range(13)]


@pytest.fixture(scope="module")
def bench():
    import benchmark_costs  # scripts/benchmarks is on sys.path (conftest.py)

    return benchmark_costs


def test_help_runs():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--attention_lengths" in done.stdout and "--num_proc" in done.stdout


def test_settings_and_plan(bench):
    args = bench.BenchmarkArguments()
    assert bench.training_settings(args) == [(64, 16), (128, 16), (224, 16), (64, 64), (64, 256)]
    assert bench._rotated([1, 2, 3], 1) == [2, 3, 1]
    plan = bench.plan_trials(args, bench.recipe(), 74, LABELS, "tokenizer")
    assert len(plan) == 3 * (5 + 2 + 9)
    for r in range(3):  # every round covers every setting of every table
        mine = [p for p in plan if p["round"] == r]
        assert {(p["image_size"], p["text_length"]) for p in mine if p["table"] == "training"} == set(
            bench.training_settings(args)
        )
        assert sorted(p["num_proc"] for p in mine if p["table"] == "preprocessing") == [1, 2]
        assert len({(p["contender"], p["text_length"]) for p in mine if p["table"] == "attention"}) == 9
    first = [p["contender"] for p in plan if p["table"] == "attention" and p["round"] == 0]
    second = [p["contender"] for p in plan if p["table"] == "attention" and p["round"] == 1]
    assert first != second  # the order rotates
    # Every block runs the same number of iterations at a given length.
    for length in args.attention_lengths:
        assert len({p["iterations"] for p in plan if p["table"] == "attention" and p["text_length"] == length}) == 1


def test_default_and_given_numbers_of_timed_repeats(bench):
    """10 timed steps / iterations, fewer for the slowest default settings; --steps / --iterations set every one."""
    plan = bench.plan_trials(bench.BenchmarkArguments(), bench.recipe(), 74, LABELS, "tokenizer")
    steps = {(p["image_size"], p["text_length"]): p["steps"] for p in plan if p["table"] == "training"}
    assert steps == {(64, 16): 10, (128, 16): 10, (224, 16): 6, (64, 64): 10, (64, 256): 5}
    assert {p["text_length"]: p["iterations"] for p in plan if p["table"] == "attention"} == {64: 10, 128: 10, 512: 5}
    other = bench.BenchmarkArguments(rounds=1, image_sizes=[96], text_lengths=[], attention_lengths=[32])
    plan = bench.plan_trials(other, bench.recipe(), 74, LABELS, "tokenizer")
    assert [p["steps"] for p in plan if p["table"] == "training"] == [10]
    assert {p["iterations"] for p in plan if p["table"] == "attention"} == {10}
    given = bench.BenchmarkArguments(rounds=1, steps=3, iterations=4)
    plan = bench.plan_trials(given, bench.recipe(), 74, LABELS, "tokenizer")
    assert {p["steps"] for p in plan if p["table"] == "training"} == {3}
    assert {p["iterations"] for p in plan if p["table"] == "attention"} == {4}


def test_blocks_match(bench):
    config = bench.build_fusion_config(64, 74, 64, LABELS, None)
    counts = bench.block_parameters(config)
    assert abs(counts["mm_fusion"] / counts["seed"] - 1) < 0.01
    assert bench.attention_block("sdpa", config).self_attn.config._attn_implementation == "sdpa"
    assert bench.attention_block("eager", config).cross_attn.config._attn_implementation == "eager"
    assert type(bench.attention_block("multihead_attention", config)).__name__ == "SeedFusionLayer"


@pytest.mark.parametrize("contender", ["sdpa", "eager", "multihead_attention", "sdpa_shared"])
def test_attention_trial(bench, contender):
    payload = {"contender": contender, "text_length": 8, "texts": 8, "warmup": 1, "iterations": 2, "round": 0}
    t = bench.run_attention_trial({**payload, "vocab_size": 74, "labels": LABELS, "seed": 0})
    recipe = ModelArguments()
    assert t["image_tokens"] == 65
    assert (t["hidden_size"], t["heads"]) == (recipe.hidden_size, recipe.num_attention_heads)
    assert t["images"] == (7 if contender == "sdpa_shared" else 8)
    assert len(t["iteration_s"]) == 3 and t["median_s"] > 0
    assert math.isfinite(t["memory_growth_mib"]) and t["memory_growth_mib"] >= t["first_iteration_memory_growth_mib"]


def test_training_trial(bench):
    payload = {"image_size": 16, "text_length": 6, "texts": 8, "images": 2, "warmup": 1, "steps": 2, "round": 0}
    t = bench.run_training_trial({**payload, "recipe": bench.recipe(), "vocab_size": 74, "labels": LABELS, "seed": 0})
    assert t["patches"] == 4 and t["timed_steps"] == 2 and len(t["step_s"]) == 3
    assert t["model"]["vision"]["image_size"] == 16 and t["attn_implementation"] == "sdpa"
    assert t["samples_per_s"] == pytest.approx(8 / t["median_step_s"])
    assert sum(t["split"].values()) == pytest.approx(1.0) and math.isfinite(t["final_loss"])


def test_report(bench):
    args = bench.BenchmarkArguments(rounds=2, image_sizes=[64], text_lengths=[16, 64], attention_lengths=[64])
    config = bench.build_fusion_config(64, 74, 64, LABELS, None)
    model = {
        "fusion_type": "hierarchical",
        "fusion_direction": "text_to_image",
        **tower_shapes(config),
    }
    trials = []
    for r in range(2):
        for size, length in bench.training_settings(args):
            step = 0.1 * length / 16
            trials.append(
                {
                    "table": "training",
                    "round": r,
                    "image_size": size,
                    "text_length": length,
                    "patches": 64,
                    "image_tokens": 65,
                    "parameters": 1000,
                    "timed_steps": 10,
                    "median_step_s": step,
                    "samples_per_s": 64 / step,
                    "split": {"forward": 0.4, "backward": 0.5, "optimizer": 0.1},
                    "peak_memory_mib": 900.0,
                    "torch_threads": 2,
                    "model": model,
                    "labels": LABELS,
                }
            )
        for num_proc in args.num_proc:
            trials.append(
                {
                    "table": "preprocessing",
                    "round": r,
                    "num_proc": num_proc,
                    "images": 5000,
                    "pairs": 48248,
                    "images_per_s": 1000.0 * num_proc,
                    "pairs_per_s": 9650.0 * num_proc,
                    "prepare_s": 5.0 / num_proc,
                    "load_s": 1.0,
                    "peak_memory_mib": 800.0,
                    "cache_was_empty": True,
                }
            )
        for contender in args.attention_contenders:
            trials.append(
                {
                    "table": "attention",
                    "round": r,
                    "contender": contender,
                    "text_length": 64,
                    "parameters": 264832,
                    "images": 64,
                    "timed_iterations": 10,
                    "median_s": 0.2 if contender == "sdpa" else 0.3,
                    "forward_s": 0.1,
                    "backward_s": 0.1,
                    "memory_growth_mib": 120.0,
                    "first_iteration_memory_growth_mib": 100.0,
                    "memory_method": "VmHWM (reset) - VmRSS",
                    "torch_threads": 2,
                    "hidden_size": 96,
                    "heads": 4,
                }
            )
    tables = bench.summarise(trials, args)
    assert tables["training"][1]["relative_step_time"] == pytest.approx(4.0)
    assert [r["time_vs_sdpa"] for r in tables["attention"]] == pytest.approx([1.0, 1.5, 1.5])
    info = {"cores": 2, "cpu": "cpu", "gpu": None, "torch": "2", "transformers": "5", "trial_torch_threads": [2]}
    text = bench.markdown(tables, args, info, bench.recipe(), 74, {"mm_fusion": 264832, "seed": 264576})
    assert text.startswith("Machine: 2 cores (cpu), no GPU")
    assert "cross-attention + MLP, width 96, 4 heads" in text
    m = ModelArguments()
    layers = f"{m.vision_layers} vision + {m.text_layers} text + {m.fusion_layers} fusion layers"
    width = f"hidden {m.hidden_size}, {m.num_attention_heads} heads"
    assert f"hierarchical fusion (text_to_image), {width}, {layers}" in text
    for header in ("**1. Training cost", "**2. Preprocessing", "**3. One fusion block"):
        assert header in text
    assert "| 64 | 64 | 64 | 4,096 + 455 | 10 | 160 |" in text
