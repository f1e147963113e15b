"""Training across 2 processes (torchrun, gloo on CPU) equals training in one process with the same global batch."""

from pathlib import Path

import pytest
import torch
from helpers.launch import run_worker


pytestmark = pytest.mark.distributed


def launch(out_dir: Path, task: str, processes: int, batch_size: int) -> list[dict]:
    run_worker("distributed_train_worker", out_dir, task, batch_size, processes=processes)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(processes)]


@pytest.fixture(scope="module", params=["pretrain", "vqa"])
def runs(request, tmp_path_factory):
    """The same tiny run twice: 2 processes x batch 8, and 1 process x batch 16."""
    task = request.param
    two = launch(tmp_path_factory.mktemp(f"{task}-2proc"), task, processes=2, batch_size=8)
    one = launch(tmp_path_factory.mktemp(f"{task}-1proc"), task, processes=1, batch_size=16)
    return task, two, one


def test_two_ranks_train_like_one_process_with_twice_the_batch(runs):
    task, two, one = runs
    assert two[0]["world_size"] == 2 and one[0]["world_size"] == 1
    # 32 pairs, global batch 16, 2 epochs: 4 optimizer steps, each logged.
    assert len(one[0]["losses"]) == len(two[0]["losses"]) == 4
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one[0]["losses"]), rtol=1e-5, atol=1e-6)
    # AdamW moves weights by up to ~lr = 1e-3 per step; the two runs end within 2e-5 of each other (Adam's
    # normalisation magnifies float rounding differences on weights whose gradients are near zero).
    moved = max((one[0]["state_dict"][k] - v).abs().max().item() for k, v in one[0]["initial_state_dict"].items())
    assert moved > 1e-3
    for name, value in one[0]["state_dict"].items():
        torch.testing.assert_close(two[0]["state_dict"][name], value, rtol=0, atol=2e-5, msg=f"{task}: {name}")


def test_without_the_gather_two_ranks_train_differently(tmp_path):
    """The control: contrastive features not gathered across ranks, each rank contrasts 8 pairs instead of 16."""
    two = launch(tmp_path / "local", "pretrain-local", processes=2, batch_size=8)
    one = launch(tmp_path / "one", "pretrain", processes=1, batch_size=16)
    assert not torch.allclose(torch.tensor(two[0]["losses"]), torch.tensor(one[0]["losses"]), rtol=1e-3)


def test_every_rank_ends_with_identical_weights(runs):
    _, two, _ = runs
    for name, value in two[0]["state_dict"].items():
        assert torch.equal(two[1]["state_dict"][name], value), name


def test_metrics_see_each_evaluation_pair_once(runs):
    task, two, one = runs
    # 13 evaluation pairs over 2 ranks x batch 4: the last batch is padded with duplicates, which
    # `gather_for_metrics` drops, so compute_metrics sees exactly 13 on every rank.
    assert [r["eval_predictions"] for r in two] == [[13], [13]]
    assert one[0]["eval_predictions"] == [13]
    metric = "eval_mean_recall" if task == "pretrain" else "eval_accuracy"
    assert two[0]["results"][metric] == pytest.approx(one[0]["results"][metric], abs=1e-6)
