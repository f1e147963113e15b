"""
Step 2 of `scripts/train.py`, the data, on one of two paths ([`DataPath`]), which
[`mm_fusion.training.data_path.load_training_data`] chooses once from `--streaming`:

- the Arrow path ([`ARROW`], this module): the pairs loaded (easy-VQA, Sort-of-CLEVR, files, hub data sets), their
  columns checked and their labels encoded ([`load_arrow_data`]); after the model is built, validated and
  preprocessed once into the Arrow cache ([`prepare_training_data`]) and batched by the collators
  ([`build_collators`]);
- the streaming path ([`mm_fusion.training.streaming.STREAMING`]): shards read, validated and preprocessed as they
  are read.
"""

import inspect
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from datasets import ClassLabel, Dataset, DatasetDict, Json, Value

from ..data import (
    ImageTextCollator,
    PreparedData,
    load_easy_vqa,
    load_fashion_mnist,
    load_pairs,
    load_sort_of_clevr,
    prepare_dataset,
)
from ..data.fashion_mnist import vocabulary_texts as fashion_mnist_texts
from ..data.sort_of_clevr import vocabulary_texts as sort_of_clevr_texts
from .arguments import DataArguments, ModelArguments


EASY_VQA_COLUMNS = {"image_column": "image", "text_column": "question", "label_column": "answer", "id_column": "id"}
SORT_OF_CLEVR_COLUMNS = {
    "image_column": "image",
    "text_column": "question",
    "label_column": "answer",
    "id_column": "id",
}
SORT_OF_CLEVR_CAPTION_COLUMNS = {"image_column": "image", "text_column": "caption", "id_column": "id"}


@dataclass(frozen=True)
class BuiltInDataset:
    """A data set `--dataset NAME` builds offline: its loader (`splits`, `rows`, then `--dataset_options`), every text
    its generator writes (for a tokenizer trained on one kind of row), and the columns its evaluation is reported per.
    Its rows have Sort-of-CLEVR's columns."""

    load: Callable
    vocabulary: Callable[[], list[str]]
    eval_group_columns: str


GENERATED = {
    "sort_of_clevr": BuiltInDataset(load_sort_of_clevr, sort_of_clevr_texts, "question_type,question_family"),
    "fashion_mnist": BuiltInDataset(load_fashion_mnist, fashion_mnist_texts, "question_type"),
}
TEXT_TYPES = ("string", "large_string")


@dataclass
class TrainingData:
    """
    The pairs of a run, checked, before preprocessing ([`load_training_data`]).

    Attributes:
        datasets (`DatasetDict`): `train`, and `eval` when there are evaluation pairs.
        labels (`list[str]`, *optional*): the class names, in class-index order (vqa / classify); `None` for pretrain.
        group_columns (`list[str]`): columns the evaluation accuracy is also reported per value of.
    """

    datasets: DatasetDict
    labels: list[str] | None
    group_columns: list[str]
    path: "DataPath | None" = None  # the path that loaded them; pairs given as a `DatasetDict` take the Arrow one

    def __post_init__(self):
        if self.path is None:
            self.path = ARROW


@dataclass(frozen=True)
class DataPath:
    """
    How a run's pairs go from the loaded rows to the model: the Arrow path ([`ARROW`]) or the streaming one
    ([`mm_fusion.training.streaming.STREAMING`]).

    Attributes:
        streaming (`bool`): whether the training pairs are a stream (no length, read as they are trained on).
        load: `(model_args, data_args, training_args) -> TrainingData`, the pairs loaded and checked.
        tokenizer_texts: `(data, data_args) -> list[str]`, what a tokenizer trained for the run learns from.
        prepare: `(data, tokenizer, image_size, task, data_args, training_args)`, the pairs validated and
            preprocessed: an object with `pairs` (`train` and maybe `eval`) and `quarantine`.
        collators: `(prepared, pad_token_id, image_size, task, data_args) -> (training, evaluation)` collators.
    """

    streaming: bool
    load: Callable
    tokenizer_texts: Callable
    prepare: Callable
    collators: Callable


def load_arrow_data(model_args: ModelArguments, data_args: DataArguments, training_args) -> TrainingData:
    """Load the pairs the arguments name, check their columns and evaluation set, and encode their labels."""
    task = model_args.task
    data = load_raw_datasets(data_args, seed=training_args.seed, task=task)
    check_columns(data, data_args, task)
    check_eval_data(data, data_args, training_args)
    labels = None
    if task != "pretrain":
        data, labels = encode_labels(data, data_args.label_column)
    group_columns = [c.strip() for c in (data_args.eval_group_columns or "").split(",") if c.strip()]
    if group_columns and task == "pretrain":
        raise ValueError("--eval_group_columns reports accuracy per group, for vqa / classify; not for pretrain.")
    return TrainingData(data, labels, group_columns, path=ARROW)


def arrow_tokenizer_texts(data: TrainingData, data_args: DataArguments) -> list[str]:
    """The texts a tokenizer trained for this run learns its vocabulary from: the training texts."""
    texts = list(data.datasets["train"][data_args.text_column])
    if data_args.dataset in GENERATED:
        # Its vocabulary is fixed by the generator: a tokenizer trained on captions then covers the questions it is
        # fine-tuned on, and the other way round.
        texts += GENERATED[data_args.dataset].vocabulary()
    return texts


def prepare_training_data(
    data: TrainingData, tokenizer, image_size: int, task: str, data_args: DataArguments, training_args
) -> PreparedData:
    """The pairs validated, tokenized and their images resized once into the Arrow cache ([`prepare_dataset`]); bad
    rows go to `output_dir/quarantine.jsonl`."""
    return prepare_dataset(
        data.datasets,
        tokenizer,
        image_column=data_args.image_column,
        text_column=data_args.text_column,
        id_column=data_args.id_column,
        label_column=data_args.label_column if task != "pretrain" else None,
        keep_columns=tuple(data.group_columns),
        image_size=image_size,
        data_root=data_args.data_root,
        max_length=data_args.max_length,
        on_bad_sample=data_args.on_bad_sample,
        quarantine_path=Path(training_args.output_dir) / "quarantine.jsonl",
        num_proc=data_args.preprocessing_num_workers,
        image_format=data_args.image_format,
    )


def build_collators(
    prepared: PreparedData, pad_token_id: int | None, task: str, data_args: DataArguments
) -> tuple[ImageTextCollator, ImageTextCollator]:
    """The training collator (with the augmentation, when asked for) and the evaluation one (the images as they are);
    both blank a modality for `--ablation`."""
    blank = {"none": None, "image_only": "text", "text_only": "image"}[data_args.ablation]
    kwargs = dict(pad_token_id=pad_token_id or 0, share_images=task != "pretrain", blank=blank)
    collator = ImageTextCollator(prepared.images, **kwargs)
    if not data_args.augment:
        return collator, collator
    from torchvision.transforms import v2

    flips = v2.Compose([v2.RandomHorizontalFlip(), v2.RandomVerticalFlip()])
    return ImageTextCollator(prepared.images, image_transform=flips, **kwargs), collator


ARROW = DataPath(
    streaming=False,
    load=load_arrow_data,
    tokenizer_texts=arrow_tokenizer_texts,
    prepare=prepare_training_data,
    collators=lambda prepared, pad_token_id, image_size, task, data_args: build_collators(
        prepared, pad_token_id, task, data_args
    ),
)


def load_raw_datasets(data_args: DataArguments, seed: int = 42, task: str = "vqa") -> DatasetDict:
    """
    The training pairs and, when there are any, the evaluation pairs, as a `DatasetDict` with `train` / `eval`.
    `sort_of_clevr` and `fashion_mnist` give their questions for vqa / classify and their captions (one per image) for
    pretrain.
    """
    if data_args.dataset_options and data_args.dataset not in GENERATED:
        raise ValueError(f"--dataset_options is for --dataset {' / '.join(GENERATED)}, not {data_args.dataset!r}.")
    if data_args.dataset in ("easy_vqa", *GENERATED):
        splits = [data_args.train_split] + ([data_args.eval_split] if data_args.eval_split else [])
        if data_args.dataset == "easy_vqa":
            raw, columns = load_easy_vqa(splits), EASY_VQA_COLUMNS
            if task != "pretrain" and data_args.eval_group_columns is None:
                data_args.eval_group_columns = "question_type"
        else:
            options = parse_overrides(data_args.dataset_options, flag="--dataset_options")
            captions = task == "pretrain"
            load = GENERATED[data_args.dataset].load
            known = set(inspect.signature(load).parameters) - {"splits", "rows"}
            unknown = sorted(set(options) - known)
            if unknown:
                raise ValueError(f"--dataset_options: unknown option(s) {unknown}; the options are {sorted(known)}.")
            raw = load(splits, rows="captions" if captions else "questions", **options)
            columns = SORT_OF_CLEVR_CAPTION_COLUMNS if captions else SORT_OF_CLEVR_COLUMNS
            if not captions and data_args.eval_group_columns is None:
                data_args.eval_group_columns = GENERATED[data_args.dataset].eval_group_columns
        for key, value in columns.items():
            if getattr(data_args, key) is None:
                setattr(data_args, key, value)
        data = {"train": raw[data_args.train_split]}
        if data_args.eval_split:
            data["eval"] = raw[data_args.eval_split]
    else:
        local = os.path.exists(data_args.dataset)
        data = {"train": load_pairs(data_args.dataset, split=data_args.train_split if not local else "train")}
        if data_args.eval_dataset:
            data["eval"] = load_pairs(data_args.eval_dataset, split="train")
        elif not local and data_args.eval_split:
            data["eval"] = load_pairs(data_args.dataset, split=data_args.eval_split)
    if "eval" not in data and data_args.validation_split_percentage:
        fraction = data_args.validation_split_percentage / 100
        data = split_off_eval(data["train"], fraction, seed=seed, id_column=data_args.id_column)
    if data_args.max_train_samples is not None:
        data["train"] = data["train"].select(range(min(data_args.max_train_samples, len(data["train"]))))
    if "eval" in data and data_args.max_eval_samples is not None:
        data["eval"] = data["eval"].select(range(min(data_args.max_eval_samples, len(data["eval"]))))
    return DatasetDict(data)


def split_off_eval(dataset: Dataset, fraction: float, seed: int, id_column: str | None = None) -> dict[str, Dataset]:
    """
    Hold out `fraction` of the pairs for evaluation (`datasets`' `train_test_split`). With an id column the held-out
    part is drawn among the distinct ids, so every row of an id lands on the same side: a repeated id never puts one
    copy in training and the other in evaluation, and `prepare_dataset` keeps its first row and quarantines the
    repeats. Without repeated ids this holds out the same pairs as a split of the rows.
    """
    if id_column is None:
        parts = dataset.train_test_split(test_size=fraction, seed=seed)
        return {"train": parts["train"], "eval": parts["test"]}
    ids = [str(x) for x in dataset[id_column]]  # as prepare_dataset reads them
    distinct = Dataset.from_dict({"id": list(dict.fromkeys(ids))})
    held_out = set(distinct.train_test_split(test_size=fraction, seed=seed)["test"]["id"])
    rows = {False: [], True: []}
    for row, sample_id in enumerate(ids):
        rows[sample_id in held_out].append(row)
    return {"train": dataset.select(rows[False]), "eval": dataset.select(rows[True])}


def check_eval_data(data: DatasetDict, data_args: DataArguments, training_args) -> None:
    """An evaluation strategy without evaluation pairs is an error now, not after the preprocessing."""
    if "eval" not in data and training_args.eval_strategy != "no":
        raise ValueError(
            f"--eval_strategy {training_args.eval_strategy.value} needs evaluation pairs, and {data_args.dataset!r} "
            "gives none. Pass --eval_dataset FILE or --validation_split_percentage N, or train without evaluation "
            "with --eval_strategy no."
        )


def check_columns(data: DatasetDict, data_args: DataArguments, task: str) -> None:
    """Clear errors for missing, unknown or mistyped columns, before any work is done."""
    needed = {"image_column": data_args.image_column, "text_column": data_args.text_column}
    if task != "pretrain":
        needed["label_column"] = data_args.label_column
    for name, column in needed.items():
        if column is None:
            raise ValueError(
                f"--{name} is required for task {task!r}; the columns of the training data are "
                f"{data['train'].column_names}."
            )
    for split, dataset in data.items():
        for name, column in [*needed.items(), ("id_column", data_args.id_column)]:
            if column is not None and column not in dataset.column_names:
                raise ValueError(
                    f"--{name} {column!r} is not a column of the {split} data; available columns: "
                    f"{dataset.column_names}."
                )
        feature = dataset.features[data_args.text_column]
        # A column of mixed types (e.g. a few numbers among the strings of a jsonl) is read as `Json`; its rows are
        # checked one by one and the non-strings quarantined, rather than the whole column refused.
        if not (isinstance(feature, Value) and feature.dtype in TEXT_TYPES or isinstance(feature, Json)):
            raise ValueError(
                f"--text_column {data_args.text_column!r} must hold text, but its type in the {split} data is "
                f"{feature}. Columns: {dataset.features}."
            )


def encode_labels(data: DatasetDict, label_column: str) -> tuple[DatasetDict, list[str]]:
    """
    Class indices for the label column of every split, with the label names. A `ClassLabel` column is kept; string
    labels become a `ClassLabel` over the training labels (sorted), integer labels are taken as indices. Evaluation
    labels the training data does not have are an error, since the head cannot predict them.
    """
    feature = data["train"].features[label_column]
    if isinstance(feature, ClassLabel):
        names = list(feature.names)
    elif isinstance(feature, Value) and feature.dtype in TEXT_TYPES:
        names = sorted(set(data["train"][label_column]))
    elif isinstance(feature, Value) and feature.dtype.startswith(("int", "uint")):
        labels = data["train"][label_column]
        if min(labels) < 0:
            raise ValueError(f"--label_column {label_column!r} has negative class indices ({min(labels)}).")
        names = [str(i) for i in range(max(labels) + 1)]
    else:
        raise ValueError(
            f"--label_column {label_column!r} must hold class names (text) or class indices (int), got {feature}."
        )
    class_label = ClassLabel(names=names)
    encoded = {}
    for split, dataset in data.items():
        split_feature = dataset.features[label_column]
        if isinstance(split_feature, ClassLabel):
            if list(split_feature.names) != names:
                raise ValueError(
                    f"The {split} data's label names {split_feature.names} differ from the training data's {names}."
                )
            encoded[split] = dataset
            continue
        values = set(dataset[label_column])
        known = set(names) if isinstance(split_feature, Value) and split_feature.dtype in TEXT_TYPES else None
        unknown = sorted(values - known) if known is not None else sorted(v for v in values if v >= len(names))
        if unknown:
            raise ValueError(
                f"The {split} data has {len(unknown)} labels that the training data does not, so the head cannot "
                f"predict them: {unknown[:10]}. Add them to the training data or drop those rows."
            )
        encoded[split] = dataset.cast_column(label_column, class_label)
    return DatasetDict(encoded), names


def parse_overrides(overrides: str | None, flag: str = "--config_overrides") -> dict:
    """`key=value,key=value` into a dict, values read as JSON when they parse (numbers, booleans, lists)."""
    result = {}
    # Commas inside brackets belong to a list value: `text_bridge_layers=[0,1],projection_dim=64`.
    for item in filter(None, re.split(r",(?![^\[]*\])", overrides or "")):
        if "=" not in item:
            raise ValueError(f"{flag} expects key=value pairs, got {item!r}.")
        key, value = item.split("=", 1)
        try:
            result[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            result[key.strip()] = value
    return result
