"""Two ranks (`torchrun --nproc_per_node 2`, gloo, CPU): preprocessing runs once per node, and in every epoch the
ranks' shards are disjoint and together cover the dataset."""

import json

import numpy as np
import pytest
from helpers.launch import run_worker
from PIL import Image


pytestmark = pytest.mark.distributed


def test_two_ranks_preprocess_once_and_get_disjoint_covering_shards(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(10):
        Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(data / f"{i}.png")
    (data / "broken.png").write_bytes(b"not a png")
    rows = [{"id": f"p{j}", "image": f"{j % 10}.png", "text": f"question {j} about {j % 10}", "label": j % 3}
            for j in range(48)]  # fmt: skip
    rows += [{"id": "bad-image", "image": "broken.png", "text": "q", "label": 0}]
    rows += [{"id": "bad-text", "image": "1.png", "text": "", "label": 0}]
    (data / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    decode_log, output = tmp_path / "decodes.txt", tmp_path / "seen.json"
    run_worker("distributed_data_worker", data, output, processes=2, timeout=300, MM_FUSION_DECODE_LOG=str(decode_log))

    # 11 distinct images, each decoded exactly once, by rank 0: rank 1 loaded the result from the Arrow cache.
    assert decode_log.read_text().split() == ["0"] * 11

    ranks = json.loads(output.read_text())
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["world_size"] == 2
    assert ranks[0]["pairs_fingerprint"] == ranks[1]["pairs_fingerprint"]
    assert ranks[0]["quarantine"] == ranks[1]["quarantine"] == ["bad-image", "bad-text"]
    all_ids = ranks[0]["clean_ids"]
    assert len(all_ids) == 48
    orders = []
    for epoch in range(2):
        shards = [[i for batch in r["epochs"][epoch] for i in batch] for r in ranks]
        assert all(len(s) == len(set(s)) == 24 for s in shards)
        assert set(shards[0]).isdisjoint(shards[1])
        assert set(shards[0]) | set(shards[1]) == set(all_ids)
        orders.append(shards[0])
    assert orders[0] != orders[1]  # reshuffled per epoch
