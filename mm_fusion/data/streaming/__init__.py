"""
Streaming image-text pairs, for corpora that do not fit one disk's Arrow cache: webdataset tar shards, jsonl files
with image folders, and any `load_dataset(..., streaming=True)` source, each as a `datasets.IterableDataset` whose
shards are the files (or the source's own shards).

Every shard is validated as it is read, by the same `prepare_images` / `prepare_texts` functions as the Arrow path:
bad rows are left out and written to a report per shard (`<quarantine_dir>/<shard>.jsonl`: id, shard, key, source,
reason); a shard that cannot be read (a truncated or corrupt tar or gzip stream, a missing file) is reported there
and skipped as a whole, and the stream goes on with the next shard. Rows are decoded, checked and resized in the
process that reads them: the data loader's workers.

[`ShuffledStream`] splits the pairs between ranks with `datasets.distributed.split_dataset_by_node`, shuffles them
with a buffer and repeats pass after pass, with a `state_dict` that resumes mid-stream exactly.
"""

from .readers import ShardError, StreamSource, read_dataset_shard, read_jsonl_shard, read_tar_shard, stream_source
from .shuffle import ShuffledStream, split_by_rank
from .validation import StreamSettings, prepare_stream, read_quarantine


__all__ = [
    "ShardError",
    "ShuffledStream",
    "StreamSettings",
    "StreamSource",
    "prepare_stream",
    "read_dataset_shard",
    "read_jsonl_shard",
    "read_quarantine",
    "read_tar_shard",
    "split_by_rank",
    "stream_source",
]
