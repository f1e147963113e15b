"""scripts/benchmarks/benchmark_gpu.py: a tiny run on the CPU (tiny towers, 32 px, a few steps), its rows, report and
table, so that the GPU benchmark runs when a GPU is there."""

import json

import pytest
import torch


TINY = ["--tiny", "--warmup_steps", "2", "--timed_steps", "2", "--log_every", "1", "--batch_size", "8"]
TINY += ["--probe_batch_size", "16", "--auto_steps", "2"]


@pytest.fixture(scope="module")
def bench():
    import benchmark_gpu  # scripts/benchmarks is on sys.path (conftest.py)

    return benchmark_gpu


def test_tiny_run_has_a_row_per_model_contender_and_precision(bench, tmp_path):
    output = tmp_path / "gpu"
    returned = bench.main([*TINY, "--output", str(output)])
    report = json.loads(output.with_name("gpu.json").read_text())
    assert report["rows"] == json.loads(json.dumps(returned["rows"]))
    assert report["machine"]["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    run_clip = "bf16" if torch.cuda.is_available() else "fp32"  # run_clip_arguments' own precision
    per_model = {
        ("mm_fusion", "fp32"),
        ("mm_fusion", "bf16"),
        ("mm_fusion_auto_batch", "bf16"),
        ("run_clip", run_clip),
    }
    expected = {(model, *contender) for model in bench.MODELS for contender in per_model}
    rows = {(r["model"], r["contender"], r["precision"]): r for r in report["rows"]}
    assert set(rows) == expected and len(report["rows"]) == len(expected)
    assert len(report["trials"]) == len(expected)

    for key, row in rows.items():
        assert row["errors"] == [], key
        assert row["samples_per_s"]["min"] > 0, key
        assert 0 <= row["data_wait_fraction"]["min"] <= row["data_wait_fraction"]["max"] <= 1, key
        assert row["peak_memory_gb"] > 0, key
        assert row["timed_windows"] == (1 if key[1] == "mm_fusion_auto_batch" else 2), key  # the warm-up left out
        if not torch.cuda.is_available():
            assert row["mfu"] is None and row["loader_workers"] == 0  # no known peak; no workers without a GPU
    for model in bench.MODELS:
        probe = rows[(model, "mm_fusion_auto_batch", "bf16")]
        picked = probe["picked_batch_size"]
        assert isinstance(picked, int) and 0 < picked <= 16 and probe["probe_start_batch_size"] == 16
        assert probe["per_device_batch_size"] * probe["gradient_accumulation_steps"] >= 16  # the global batch kept
        ours, theirs = rows[(model, "mm_fusion", run_clip)], rows[(model, "run_clip", run_clip)]
        assert ours["parameters"] == theirs["parameters"]  # the same model in both recipes
        assert rows[(model, "mm_fusion", "fp32")]["per_device_batch_size"] == 8
    trials = {(t["model"], t["contender"], t["precision"]): t for t in report["trials"]}
    vit = trials[("vit_b16_bert_base", "mm_fusion", "bf16")]
    assert "--hidden_size 32" in vit["command"] and "--fusion_type hierarchical" in vit["command"]
    assert "--image_size 32" in vit["command"] and "--bf16 True" in vit["command"]
    resnet = trials[("resnet_default", "mm_fusion", "fp32")]
    assert "--vision_tower" not in resnet["command"]  # scripts/train.py's default model
    assert {r["model"] for r in report["ratios"]} == set(bench.MODELS)
    assert all(r["bf16_over_fp32"] > 0 and r["same_model_as_run_clip"] for r in report["ratios"])
    # The tiny models fit the batch the probe starts from: it keeps it, without accumulation.
    probes = [rows[(model, "mm_fusion_auto_batch", "bf16")] for model in bench.MODELS]
    assert any((p["per_device_batch_size"], p["gradient_accumulation_steps"]) == (16, 1) for p in probes)


def test_step_counts_must_fill_the_monitor_windows(bench):
    with pytest.raises(ValueError, match="multiple of --log_every"):
        bench.main(["--warmup_steps", "5", "--log_every", "10"])
    with pytest.raises(ValueError, match="auto_steps"):
        bench.main(["--auto_steps", "3"])
    with pytest.raises(ValueError, match="Unknown --models"):
        bench.main(["--models", "vit_l14"])


def test_a_failed_trial_is_reported_and_the_others_still_summarised(bench):
    args = bench.GpuBenchmarkArguments(models=["resnet_default"], tiny=True)
    common = {"batch_size": 8, "recipe": {}, "tokenizer": "t", "labels": [], "train_samples": 32}
    plan = bench.plan_trials(args, common | {"image_size": 32, "loader_workers": 0, "cpu_threads": None})
    trials = []
    for p in plan:
        if p["contender"] == "mm_fusion" and p["precision"] == "bf16":
            trials.append({**p, "error": "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory.\n"})
            continue
        speed = 100.0 if p["precision"] == "fp32" else 150.0
        trials.append(
            {**p, "parameters": 10, "per_device_batch_size": 4 if p["batch_size"] == 1024 else p["batch_size"],
             "gradient_accumulation_steps": 256 if p["batch_size"] == 1024 else 1,
             "loader_workers": 0, "samples_per_s": [speed, speed + 10], "data_wait_fraction": [0.01, 0.03],
             "mfu": [], "peak_memory_gb": 1.5, "picked_batch_size": 4, "probe_found": [4]}
        )  # fmt: skip
    rows, ratios = bench.summarise(trials, plan)
    failed = next(r for r in rows if r["contender"] == "mm_fusion" and r["precision"] == "bf16")
    assert "samples_per_s" not in failed and "out of memory" in failed["errors"][0]
    fp32 = next(r for r in rows if r["contender"] == "mm_fusion" and r["precision"] == "fp32")
    assert fp32["samples_per_s"] == {"median": 105.0, "min": 100.0, "max": 110.0} and fp32["mfu"] is None
    assert ratios[0]["bf16_over_fp32"] is None and ratios[0]["mm_fusion_over_run_clip"] == pytest.approx(1.0)
    info = {"gpu": None, "cores": 2, "cpu": "x", "torch": "t", "transformers": "t"}
    table = bench.markdown(rows, ratios, args, info, {"train_samples": 32, "loader_workers": 0})
    assert "| resnet_default | mm_fusion | bf16 | failed: torch.OutOfMemoryError: CUDA out of memory. |" in table
    assert "| 4 x 256 (probe from 1024) |" in table and "| 4 per device |" in table
    assert ratios[0]["same_model_as_run_clip"] and "NOT the same" not in table
