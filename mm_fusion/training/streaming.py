"""
Step 2 and 4 of `scripts/train.py` for `--streaming` runs: the shards named by `--dataset` read as a stream
([`load_streaming_data`]), validated shard by shard in the data loader's workers, split between ranks and shuffled
by an exactly resumable buffer ([`prepare_streaming_data`]); the evaluation pairs, small, read once into memory.
"""

import os
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from datasets import Dataset

from ..data import ShuffledStream, StreamingCollator, prepare_stream, read_quarantine, split_by_rank, stream_source
from ..data.streaming import StreamSource
from .arguments import DataArguments, ModelArguments


TOKENIZER_TEXTS = 20_000  # a tokenizer trained for a streaming run learns from the first this many texts


def read_class_names(value: str) -> list[str]:
    """`--class_names`: comma-separated names, or a file with one name per line."""
    if os.path.isfile(value):
        names = [line.strip() for line in Path(value).read_text().splitlines() if line.strip()]
    else:
        names = [name.strip() for name in value.split(",") if name.strip()]
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"--class_names must list distinct class names, got {names[:20]}.")
    return names


def load_streaming_data(model_args: ModelArguments, data_args: DataArguments, training_args):
    """The streams of a `--streaming` run (nothing is read yet), as a `TrainingData` whose `datasets` hold
    [`StreamSource`]s; webdataset shards default to the columns `image` / `text`."""
    from .data import TrainingData

    train = stream_source(data_args.dataset, data_root=data_args.data_root)
    sources = {"train": train}
    if data_args.eval_dataset:
        sources["eval"] = stream_source(data_args.eval_dataset, data_root=data_args.data_root)
    elif training_args.eval_strategy != "no":
        raise ValueError(
            f"--eval_strategy {training_args.eval_strategy.value} needs evaluation pairs: with --streaming, pass "
            "--eval_dataset (shards or a file), or train without evaluation with --eval_strategy no."
        )
    data_args.image_column = data_args.image_column or "image"
    data_args.text_column = data_args.text_column or "text"
    labels = read_class_names(data_args.class_names) if model_args.task != "pretrain" else None
    if labels is not None and data_args.label_column is None:
        data_args.label_column = "cls" if train.kind == "webdataset" else "label"
    return TrainingData(sources, labels, [])


def stream_texts(source: StreamSource, text_column: str, limit: int = TOKENIZER_TEXTS) -> list[str]:
    """The first `limit` texts of a stream, read raw (for training a tokenizer)."""

    def texts():
        for position in range(len(source.shards)):
            try:
                for row in source.read(position):
                    good = "__error__" not in row  # a duplicate or undecodable sample: quarantined, not learnt
                    if good and isinstance(row.get(text_column), str) and row[text_column].strip():
                        yield row[text_column]
            except Exception:  # an unreadable shard: the validated stream reports it
                continue

    return list(islice(texts(), limit))


@dataclass
class PreparedStream:
    """The data of a streaming run, in the shape `build_trainer` and the model card read (`pairs`, `quarantine`)."""

    pairs: dict
    quarantine_dir: str

    @property
    def quarantine(self) -> list[dict]:
        return read_quarantine(self.quarantine_dir) if os.path.isdir(self.quarantine_dir) else []


def prepare_streaming_data(
    data, tokenizer, image_size: int, task: str, data_args: DataArguments, training_args
) -> PreparedStream:
    """This rank's training stream ([`split_by_rank`], [`ShuffledStream`] seeded by `--seed`, repeating) and the
    evaluation pairs read once into memory; reports in `output_dir/quarantine/`."""
    quarantine_dir = os.path.join(training_args.output_dir, "quarantine")
    size, rank = training_args.world_size, training_args.process_index
    settings = dict(
        image_column=data_args.image_column,
        text_column=data_args.text_column,
        id_column=data_args.id_column,
        label_column=data_args.label_column if task != "pretrain" else None,
        label_names=data.labels,
        image_size=image_size,
        image_format=data_args.image_format,
        data_root=data_args.data_root,
        max_length=data_args.max_length,
        quarantine_dir=quarantine_dir,
    )
    # One report file per shard and rank: a rank whose passes run ahead may read a shard another rank is reading.
    stream = prepare_stream(data.datasets["train"], tokenizer, **settings, report_tag=f"rank{rank}")
    part, _ = split_by_rank(stream, rank, size)
    pairs = {"train": ShuffledStream(part, buffer_size=data_args.shuffle_buffer_size, seed=training_args.seed)}
    if "eval" in data.datasets:
        eval_settings = {**settings, "quarantine_dir": os.path.join(quarantine_dir, "eval")}
        rows = list(prepare_stream(data.datasets["eval"], tokenizer, **eval_settings, write_reports=rank == 0))
        if not rows:
            raise ValueError(f"--eval_dataset {data_args.eval_dataset!r} has no usable pairs; see {quarantine_dir}.")
        pairs["eval"] = Dataset.from_list(rows)
    return PreparedStream(pairs, quarantine_dir)


def build_streaming_collators(pad_token_id: int | None, image_size: int, data_args: DataArguments):
    blank = {"none": None, "image_only": "text", "text_only": "image"}[data_args.ablation]
    kwargs = dict(image_size=image_size, image_format=data_args.image_format, pad_token_id=pad_token_id or 0)
    collator = StreamingCollator(blank=blank, **kwargs)
    if not data_args.augment:
        return collator, collator
    from torchvision.transforms import v2

    flips = v2.Compose([v2.RandomHorizontalFlip(), v2.RandomVerticalFlip()])
    return StreamingCollator(blank=blank, image_transform=flips, **kwargs), collator
