"""scripts/benchmarks/benchmark_grad_cache.py: the cached step's peak saved activations are those of one micro-batch;
a setting measured in a fresh process gives what the results file holds."""

import json

import pytest
from benchmarking import RESULTS, run_in_new_interpreter
from helpers.grad_cache_worker import tiny_config


@pytest.fixture(scope="module")
def bench():
    import benchmark_grad_cache  # scripts/benchmarks is on sys.path (conftest.py)

    return benchmark_grad_cache


def test_cached_step_keeps_one_micro_batch_of_activations(bench):
    config = tiny_config()
    plain_16 = bench.measure(config, "plain", batch_size=16, accumulation=1, repeats=1)
    plain_4 = bench.measure(config, "plain", batch_size=4, accumulation=1, repeats=1)
    cached = bench.measure(config, "grad_cache", batch_size=4, accumulation=4, repeats=1)
    assert cached["peak_saved_bytes"] <= 1.1 * plain_4["peak_saved_bytes"]
    assert cached["peak_saved_bytes"] < 0.4 * plain_16["peak_saved_bytes"]


def test_measure_trial_in_a_new_interpreter_gives_the_keys_of_the_results():
    payload = {"mode": "grad_cache", "batch_size": 2, "accumulation": 2, "itm_loss_weight": 1.0, "repeats": 0}
    payload |= {"text_length": 4, "threads": 1}
    result = run_in_new_interpreter("benchmark_grad_cache:measure_trial", payload)
    assert (result["mode"], result["pairs_per_step"], result["itc_negatives"]) == ("grad_cache", 4, 4)
    assert result["itm_loss_weight"] == 1.0 and result["torch_threads"] == 1
    assert result["peak_saved_bytes"] > 0 and result["step_s"] == result["first_step_s"]
    shipped = json.loads((RESULTS / "grad_cache.json").read_text())["rows"][0]
    per_round = {"step_s_per_round", "peak_rss_growth_mib_per_round"}  # added by main over the rounds
    assert set(result) == set(shipped) - per_round
