"""scripts/benchmarks/benchmark_inference.py on random-weight models of the default architecture, a few questions."""

import json

import benchmark_inference as bench  # scripts/benchmarks is on sys.path (conftest.py)


def test_inference_benchmark_times_the_pipelines_and_the_maps(tmp_path):
    stem = tmp_path / "inference"
    flags = ["--model", str(tmp_path / "none"), "--questions", "24", "--naive_questions", "6",
             "--zero_shot_images", "3", "--rounds", "1", "--map_questions", "12", "--single_questions", "2",
             "--output_name", str(stem)]  # fmt: skip
    result = bench.main(flags)
    assert result["vqa"]["answers_agree"] == "6/6" and not result["models"]["trained_vqa"]
    maps = result["maps"]
    assert (maps["batched_questions"], maps["single_questions"]) == (12, 2)
    assert maps["batched_time_ratio"]["median"] > 0 and maps["single_time_ratio"]["median"] > 0
    written = json.loads(stem.with_suffix(".json").read_text())
    assert written["maps"] == maps
