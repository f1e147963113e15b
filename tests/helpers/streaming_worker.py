"""Run by tests/test_streaming.py under `torchrun --nproc_per_node 2 -m helpers.streaming_worker SHARDS OUTPUT
BUFFER` (two CPU processes).

Each rank takes its part of the validated stream of webdataset shards (`split_by_rank`), shuffles it with a buffer
(`ShuffledStream`), reads one pass through a stateful DataLoader with a worker and the streaming collator, and writes
the ids it saw, its split strategy and the pass of the next row to `OUTPUT/rank<r>.json`.
"""

import glob
import json
import os
import sys

from torchdata.stateful_dataloader import StatefulDataLoader

from helpers.shards import tokenizer
from mm_fusion.data import ShuffledStream, StreamingCollator, prepare_stream, split_by_rank


def main(shards: str, output: str, buffer_size: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    paths = sorted(glob.glob(os.path.join(shards, "*.tar")))
    report = os.path.join(output, "q")
    stream = prepare_stream(paths, tokenizer(), id_column="uid", image_size=8, quarantine_dir=report)
    part, strategy = split_by_rank(stream, rank, world)
    loader = StatefulDataLoader(
        ShuffledStream(part, buffer_size=int(buffer_size), seed=5, passes=1),
        batch_size=3,
        num_workers=1,
        collate_fn=StreamingCollator(image_size=8),
    )
    ids = [sample for batch in loader for sample in batch["sample_ids"]]
    with open(os.path.join(output, f"rank{rank}.json"), "w") as f:
        json.dump({"ids": ids, "strategy": strategy}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
