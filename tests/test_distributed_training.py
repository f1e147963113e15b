"""Training across 2 processes (torchrun, gloo on CPU) equals training in one process with the same global batch."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from helpers.launch import run_worker, start_nodes


pytestmark = pytest.mark.distributed


def launch(out_dir: Path, task: str, processes: int, batch_size: int) -> list[dict]:
    run_worker("distributed_train_worker", out_dir, task, batch_size, processes=processes)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(processes)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """`launched(task, processes, batch_size)`: the run's records, launched once per module for the tests that compare
    against the same run."""
    done = {}

    def get(task: str, processes: int, batch_size: int) -> list[dict]:
        key = (task, processes, batch_size)
        if key not in done:
            done[key] = launch(tmp_path_factory.mktemp(f"{task}-{processes}proc"), task, processes, batch_size)
        return done[key]

    return get


@pytest.fixture(scope="module", params=["pretrain", "vqa"])
def runs(request, launched):
    """The same tiny run twice: 2 processes x batch 8, and 1 process x batch 16."""
    task = request.param
    return task, launched(task, processes=2, batch_size=8), launched(task, processes=1, batch_size=16)


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


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")
def test_lora_on_two_ranks_trains_like_one_process_with_twice_the_batch(tmp_path):
    """`--lora` across 2 processes: the adapters and what trains fully end as one process with the global batch leaves
    them, identical on both ranks, and the frozen weights do not move."""
    two = launch(tmp_path / "two", "vqa-lora", processes=2, batch_size=8)
    one = launch(tmp_path / "one", "vqa-lora", processes=1, batch_size=16)
    assert two[0]["world_size"] == 2 and len(one[0]["losses"]) == len(two[0]["losses"]) == 4
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one[0]["losses"]), rtol=1e-5, atol=1e-6)
    initial, final = one[0]["initial_state_dict"], one[0]["state_dict"]
    adapters = [k for k in final if "lora_" in k]
    assert adapters and max((final[k] - initial[k]).abs().max().item() for k in adapters) > 1e-3
    frozen = [k for k in final if "lora_" not in k and "modules_to_save" not in k]
    assert frozen and all(torch.equal(final[k], initial[k]) for k in frozen)
    for name, value in final.items():
        torch.testing.assert_close(two[0]["state_dict"][name], value, rtol=0, atol=2e-5, msg=name)
        assert torch.equal(two[1]["state_dict"][name], two[0]["state_dict"][name]), name


def test_without_the_gather_two_ranks_train_differently(tmp_path, launched):
    """The control: contrastive features not gathered across ranks, each rank contrasts 8 pairs instead of 16."""
    two = launch(tmp_path / "local", "pretrain-local", processes=2, batch_size=8)
    one = launched("pretrain", processes=1, batch_size=16)
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


def launch_two_nodes(root: Path, task: str, per_node: int, batch_size: int) -> list[dict]:
    """Two "nodes" on this machine (helpers.launch.start_nodes), `per_node` processes each, each node with its own
    datasets cache and output directory (node-local disks). Returns every rank's record and each node's image-decode
    log."""
    for node in range(2):
        (root / f"node{node}" / "cache").mkdir(parents=True)
    processes = start_nodes(
        "distributed_train_worker",
        lambda node: [root / f"node{node}", task, batch_size],
        lambda node: {
            "HF_DATASETS_CACHE": str(root / f"node{node}" / "cache"),
            "MM_FUSION_DECODE_LOG": str(root / f"node{node}" / "decodes.txt"),
        },
        per_node=per_node,
    )
    outputs = [p.communicate(timeout=600)[0] for p in processes]
    for p, output in zip(processes, outputs):
        assert p.returncode == 0, output[-5000:]
    records = []
    for rank in range(2 * per_node):
        node = rank // per_node
        records.append(torch.load(root / f"node{node}" / f"rank{rank}.pt"))
    decodes = [(root / f"node{node}" / "decodes.txt").read_text().split() for node in range(2)]
    return records, decodes


@pytest.mark.scale
def test_two_simulated_nodes_preprocess_once_each_and_train_like_one_node(tmp_path, launched):
    """Pretraining (its contrastive loss gathers every rank's features) on 2 nodes x 1 process against one node x 2
    processes, the same global batch 16: each node's cache is filled once, by its local main process; both ranks end
    with equal weights, equal to the one-node run's. The tokenizer is trained on rank 0 and sent to node 1, which has
    no access to node 0's output directory."""
    two = launched("pretrain", processes=2, batch_size=8)
    nodes, decodes = launch_two_nodes(tmp_path / "two_nodes", "pretrain", per_node=1, batch_size=8)
    # 32 training pairs + 13 evaluation pairs of easy-VQA: the distinct images among them, decoded once per node.
    assert len(decodes[0]) == len(decodes[1]) > 0
    assert decodes == [["0"] * len(decodes[0]), ["1"] * len(decodes[1])]
    assert not (tmp_path / "two_nodes" / "node1" / "run" / "tokenizer").exists()  # node 1 never read node 0's disk
    for name, value in nodes[0]["state_dict"].items():
        assert torch.equal(nodes[1]["state_dict"][name], value), name
        torch.testing.assert_close(value, two[0]["state_dict"][name], rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(torch.tensor(nodes[0]["losses"]), torch.tensor(two[0]["losses"]), rtol=1e-6, atol=0)


@pytest.mark.scale
def test_two_nodes_of_two_processes_each_node_preprocesses_once(tmp_path):
    """2 nodes x 2 processes: on each node the local main process decodes every image once and its other process
    waits and reads that node's cache; all four ranks end with the same weights."""
    nodes, decodes = launch_two_nodes(tmp_path, "vqa", per_node=2, batch_size=4)
    assert len(decodes[0]) == len(decodes[1]) > 0
    assert decodes == [["0"] * len(decodes[0]), ["2"] * len(decodes[1])]  # node 1's local main is global rank 2
    for rank in nodes[1:]:
        for name, value in nodes[0]["state_dict"].items():
            assert torch.equal(rank["state_dict"][name], value), name
    assert nodes[0]["world_size"] == 4


@pytest.mark.scale
def test_auto_batch_size_is_the_smallest_over_ranks_and_accumulation_keeps_the_global_batch(tmp_path):
    """Per-device batch 16 on 2 ranks (global 32, 32 pairs, 2 epochs). Rank 1 has room for 4 pairs (simulated), rank 0
    for 16: both train with 4 pairs a step and 4 accumulation steps, so the global batch stays 32 (2 optimizer steps an
    epoch), and they end with the same weights. With the gradient cache every ITC loss still contrasts all 32 pairs:
    the losses equal those of the run where both ranks have room for 16 (one micro-batch of 16 a step)."""
    run_worker("auto_batch_worker", tmp_path / "limited", "pretrain", 4, processes=2)
    run_worker("auto_batch_worker", tmp_path / "roomy", "pretrain", 16, processes=2)
    ranks = [json.loads((tmp_path / "limited" / f"rank{r}.json").read_text()) for r in range(2)]
    roomy = json.loads((tmp_path / "roomy" / "rank0.json").read_text())
    assert (roomy["found"], roomy["per_device"], roomy["accumulation"]) == ([16, 16], 16, 1)
    assert [r["found"] for r in ranks] == [[16, 4], [16, 4]]
    assert [(r["per_device"], r["accumulation"]) for r in ranks] == [(4, 4), (4, 4)]
    assert ranks[0]["steps"] == ranks[1]["steps"] == 2  # 32 pairs x 2 epochs / global batch 32
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(roomy["losses"]), rtol=1e-5, atol=1e-6)
