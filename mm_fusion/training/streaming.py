"""
Step 2 and 4 of `scripts/train.py` for `--streaming` runs: the shards named by `--dataset` read as a stream
([`load_streaming_data`]), validated shard by shard in the data loader's workers, split between ranks and shuffled
by an exactly resumable buffer ([`prepare_streaming_data`]); the evaluation pairs, small, read once into memory.
[`StreamingLoaderMixin`] is [`MMFusionTrainer`]'s unit that trains from the stream and resumes it exactly.
"""

import json
import os
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from datasets import Dataset

from ..data import (
    DataError,
    ShuffledStream,
    StreamingCollator,
    prepare_stream,
    read_quarantine,
    split_by_rank,
    stream_source,
)
from ..data.streaming import StreamSource
from .arguments import DataArguments, ModelArguments
from .data import DataPath, TrainingData, image_transform


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
    train = stream_source(data_args.dataset, data_root=data_args.data_root)
    sources = {"train": train}
    if data_args.eval_dataset:
        sources["eval"] = stream_source(data_args.eval_dataset, data_root=data_args.data_root)
    elif training_args.eval_strategy != "no":
        raise DataError(
            f"--eval_strategy {training_args.eval_strategy.value} needs evaluation pairs: with --streaming, pass "
            "--eval_dataset (shards or a file), or train without evaluation with --eval_strategy no."
        )
    data_args.image_column = data_args.image_column or "image"
    data_args.text_column = data_args.text_column or "text"
    labels = read_class_names(data_args.class_names) if model_args.task != "pretrain" else None
    if labels is not None and data_args.label_column is None:
        data_args.label_column = "cls" if train.kind == "webdataset" else "label"
    return TrainingData(sources, labels, [], path=STREAMING)


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
            raise DataError(f"--eval_dataset {data_args.eval_dataset!r} has no usable pairs; see {quarantine_dir}.")
        pairs["eval"] = Dataset.from_list(rows)
    return PreparedStream(pairs, quarantine_dir)


def build_streaming_collators(pad_token_id: int | None, image_size: int, data_args: DataArguments):
    blank = {"none": None, "image_only": "text", "text_only": "image"}[data_args.ablation]
    kwargs = dict(image_size=image_size, image_format=data_args.image_format, pad_token_id=pad_token_id or 0)
    collator = StreamingCollator(blank=blank, **kwargs)
    transform = image_transform(data_args.augment)
    if transform is None:
        return collator, collator
    return StreamingCollator(blank=blank, image_transform=transform, **kwargs), collator


STREAMING = DataPath(
    streaming=True,
    load=load_streaming_data,
    tokenizer_texts=lambda data, data_args: stream_texts(data.datasets["train"], data_args.text_column),
    prepare=prepare_streaming_data,
    collators=lambda prepared, pad_token_id, image_size, task, data_args: build_streaming_collators(
        pad_token_id, image_size, data_args
    ),
)


# Written into each checkpoint by every rank of a streaming run: its data loader's state (torchdata's
# StatefulDataLoader, with the stream's own), from which the resumed run reads on exactly where this one was.
STREAM_STATE_FILE = "stream_state_rank{rank}.json"


class StreamingLoaderMixin:
    """
    Trainer unit for a training set that is a stream ([`ShuffledStream`]): [`streaming_dataloader`] gives a stateful
    loader over this rank's part of the stream, [`write_stream_state`] writes each rank's loader state into a
    checkpoint, and [`resume_stream`] makes the loader start from it (Trainer's own fast-forward would skip batches
    again). Other training sets go through Trainer's own loader.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._stream_resume = None  # the checkpoint a streaming run resumes from
        self._stream_loader = None

    def is_streaming(self) -> bool:
        return isinstance(self.train_dataset, ShuffledStream)

    def resume_stream(self, resume_from_checkpoint: str | None) -> None:
        """At `train`: the checkpoint the stream resumes from (its saved state puts it where it was)."""
        self._stream_resume = resume_from_checkpoint
        if self.is_streaming():
            self.args.ignore_data_skip = True  # Trainer's own fast-forward would skip batches again

    def write_stream_state(self, folder: str) -> None:
        """Every rank writes its own stream's state into the checkpoint `folder` (ranks read different shards)."""
        if self.is_streaming() and self._stream_loader is not None:
            with open(os.path.join(folder, STREAM_STATE_FILE.format(rank=self.args.process_index)), "w") as f:
                json.dump(self._stream_loader.state_dict(), f)
            self.accelerator.wait_for_everyone()

    def streaming_dataloader(self):
        """
        A streaming run's training loader: torchdata's `StatefulDataLoader` (through accelerate, as
        `use_stateful_dataloader=True` builds it) over this rank's own stream. Accelerate's `prepare` is told there
        is one process: the stream is already this rank's part (`split_by_rank`), and accelerate would otherwise cut
        it again or have rank 0 read and send every batch. On resume the loader takes the rank's saved state.
        """
        from accelerate.data_loader import prepare_data_loader
        from torchdata.stateful_dataloader import StatefulDataLoader

        args = self.args
        workers = args.dataloader_num_workers
        loader = StatefulDataLoader(
            self.train_dataset,
            batch_size=self._train_batch_size,
            collate_fn=self.data_collator,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
        )
        loader = prepare_data_loader(
            loader,
            device=args.device,
            num_processes=1,
            process_index=0,
            put_on_device=True,
            dispatch_batches=False,
            use_stateful_dataloader=True,
        )
        if self._stream_resume is not None:
            path = os.path.join(self._stream_resume, STREAM_STATE_FILE.format(rank=args.process_index))
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{path} is missing: {self._stream_resume} was not written by a streaming run of "
                    f"{args.world_size} process(es), so the stream cannot be put back where it was."
                )
            with open(path) as f:
                loader.load_state_dict(json.load(f))
        self._stream_loader = loader
        return loader
