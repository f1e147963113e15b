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

import difflib
import inspect
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import ClassLabel, Dataset, DatasetDict, Json, Value

from ..cli import parse_overrides
from ..data import (
    LINE_COLUMN,
    BadSample,
    DataError,
    ImageTextCollator,
    PreparedData,
    class_names,
    label_name,
    load_easy_vqa,
    load_fashion_mnist,
    load_pairs,
    load_sort_of_clevr,
    prepare_dataset,
    saved_splits,
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
    labels = check_labels(data, data_args) if task != "pretrain" else None
    group_columns = [c.strip() for c in (data_args.eval_group_columns or "").split(",") if c.strip()]
    if group_columns and task == "pretrain":
        raise DataError("--eval_group_columns reports accuracy per group, for vqa / classify; not for pretrain.")
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
    """The pairs validated, tokenized and their images resized once into the Arrow cache ([`prepare_pairs`]); bad
    rows go to `output_dir/quarantine.jsonl`, and too many of them stop the run ([`check_usable`])."""
    prepared = prepare_pairs(data, tokenizer, image_size, task, data_args, training_args)
    check_usable(prepared, data_args, quarantine_file(training_args))
    return prepared


def quarantine_file(training_args) -> Path:
    """Where a run lists the rows it left out, with their reasons."""
    return Path(training_args.output_dir) / "quarantine.jsonl"


def prepare_pairs(
    data: TrainingData, tokenizer, image_size: int, task: str, data_args: DataArguments, training_args
) -> PreparedData:
    """[`prepare_dataset`] with the run's columns, classes and settings; the quarantine report in
    [`quarantine_file`]."""
    return prepare_dataset(
        data.datasets,
        tokenizer,
        image_column=data_args.image_column,
        text_column=data_args.text_column,
        id_column=data_args.id_column,
        label_column=data_args.label_column if task != "pretrain" else None,
        label_names=data.labels,
        keep_columns=tuple(data.group_columns),
        image_size=image_size,
        data_root=data_args.data_root,
        max_length=data_args.max_length,
        on_bad_sample=data_args.on_bad_sample,
        quarantine_path=quarantine_file(training_args),
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
    transform = image_transform(data_args.augment)
    if transform is None:
        return collator, collator
    return ImageTextCollator(prepared.images, image_transform=transform, **kwargs), collator


def image_transform(augment: str):
    """The random transform of `--augment` for the collator (per uint8 `(3, S, S)` image, or `batched` on the
    batch's images), or None for `"none"`."""
    if augment == "none":
        return None
    from torchvision.transforms import v2

    if augment == "flips":
        return v2.Compose([v2.RandomHorizontalFlip(), v2.RandomVerticalFlip()])
    return PhotoAugment()


class PhotoAugment:
    """`--augment photo` on a batch of uint8 images `(N, 3, H, W)`: each flipped left to right half the time, then
    shifted by up to an eighth of its shorter side in each direction, its edge pixels repeated into what the shift
    uncovers (as CIFAR and Fashion-MNIST recipes pad and crop). One indexing op for the batch: a torchvision transform
    per image cost 0.3 ms an image."""

    batched = True

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        n, _, height, width = images.shape
        pad = max(1, min(height, width) // 8)
        shift = torch.randint(-pad, pad + 1, (2, n, 1))
        rows = (torch.arange(height) - shift[0]).clamp(0, height - 1)  # (N, H): the source row of each row
        cols = torch.arange(width).expand(n, width)
        cols = torch.where(torch.rand(n, 1) < 0.5, cols.flip(-1), cols)  # a flip reads the columns backwards
        cols = (cols - shift[1]).clamp(0, width - 1)
        index = torch.arange(n)[:, None, None]
        return images.permute(0, 2, 3, 1)[index, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()


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
        raise DataError(f"--dataset_options is for --dataset {' / '.join(GENERATED)}, not {data_args.dataset!r}.")
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
                raise DataError(f"--dataset_options: unknown option(s) {unknown}; the options are {sorted(known)}.")
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
        # A file is one split; a save_to_disk DatasetDict or a hub data set has several.
        splits = saved_splits(data_args.dataset) if os.path.exists(data_args.dataset) else None
        several = not os.path.exists(data_args.dataset) or bool(splits)
        data = {"train": load_pairs(data_args.dataset, split=data_args.train_split if several else "train")}
        if data_args.eval_dataset:
            data["eval"] = load_pairs(
                data_args.eval_dataset, split=evaluation_split(data_args.eval_dataset, data_args)
            )
        elif several and data_args.eval_split and not data_args.validation_split_percentage:
            split = evaluation_split(data_args.dataset, data_args) if splits else data_args.eval_split
            if split is not None:
                data["eval"] = load_pairs(data_args.dataset, split=split)
    if "eval" not in data and data_args.validation_split_percentage:
        fraction = data_args.validation_split_percentage / 100
        data = split_off_eval(data["train"], fraction, seed=seed, id_column=data_args.id_column)
    if data_args.max_train_samples is not None:
        data["train"] = data["train"].select(range(min(data_args.max_train_samples, len(data["train"]))))
    if "eval" in data and data_args.max_eval_samples is not None:
        data["eval"] = data["eval"].select(range(min(data_args.max_eval_samples, len(data["eval"]))))
    return DatasetDict(data)


def evaluation_split(path: str, data_args: DataArguments) -> str | None:
    """The split of a save_to_disk `DatasetDict` at `path` that evaluates: `--eval_split` when it has one, else its
    `validation` or `test` split, else its only split; `"train"` for a path of one split; `None` when there is none
    (for `--dataset`, whose `train` split is the training one)."""
    splits = saved_splits(path) if os.path.exists(path) else None
    if not splits:
        return "train" if path == data_args.eval_dataset else data_args.eval_split
    candidates = [data_args.eval_split, "validation", "test"]
    if path == data_args.eval_dataset and len(splits) == 1:
        candidates.append(splits[0])
    found = next((split for split in candidates if split in splits), None)
    if found is None and path == data_args.eval_dataset:
        raise DataError(
            f"--eval_dataset {path}: a DatasetDict without a {data_args.eval_split!r} split (--eval_split); its "
            f"splits are {splits}."
        )
    return found


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
        raise DataError(
            f"--eval_strategy {training_args.eval_strategy.value} needs evaluation pairs, and {data_args.dataset!r} "
            "gives none. Pass --eval_dataset FILE or --validation_split_percentage N, or train without evaluation "
            "with --eval_strategy no."
        )


def source_of(data_args: DataArguments, split: str) -> str:
    """The file or data set a split's rows come from, as the user named it."""
    if split == "eval" and data_args.eval_dataset:
        return data_args.eval_dataset
    if split == "eval" and data_args.validation_split_percentage and data_args.dataset not in GENERATED:
        return f"{data_args.dataset} (held out by --validation_split_percentage)"
    return data_args.dataset


def check_columns(data: DatasetDict, data_args: DataArguments, task: str) -> None:
    """Clear errors for missing, unknown or mistyped columns, before any work is done."""
    needed = {"image_column": data_args.image_column, "text_column": data_args.text_column}
    if task != "pretrain":
        needed["label_column"] = data_args.label_column
    for name, column in needed.items():
        if column is None:
            raise DataError(
                f"--{name} is required for task {task!r}; the columns of {source_of(data_args, 'train')} are "
                f"{', '.join(table_columns(data['train']))}."
            )
    for split, dataset in data.items():
        columns = table_columns(dataset)
        for name, column in [*needed.items(), ("id_column", data_args.id_column)]:
            if column is not None and column not in columns:
                close = difflib.get_close_matches(column, columns, n=1, cutoff=0.6) or [
                    c for c in columns if c.lower() == column.lower()
                ]
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise DataError(
                    f"--{name} {column!r} is not a column of {source_of(data_args, split)}; its columns are "
                    f"{', '.join(columns)}.{hint}"
                )
        feature = dataset.features[data_args.text_column]
        # A column of mixed types (a few numbers among the strings of a jsonl) is read as `Json`; its rows are
        # checked one by one and the non-strings quarantined, rather than the whole column refused.
        if not (isinstance(feature, Value) and feature.dtype in TEXT_TYPES or isinstance(feature, Json)):
            raise DataError(
                f"--text_column {data_args.text_column!r} of {source_of(data_args, split)} must hold text, but holds "
                f"{feature}. Is it the right column? The columns are {', '.join(columns)}."
            )


def table_columns(dataset: Dataset) -> list[str]:
    """The columns a user named in their table (not the line numbers [`read_table`] adds)."""
    return [column for column in dataset.column_names if column != LINE_COLUMN]


def check_labels(data: DatasetDict, data_args: DataArguments) -> list[str]:
    """
    The classes of a vqa / classify run, in class-index order: a `ClassLabel` column's names, else the classes the
    training labels name ([`class_names`]: `1` and `"1"` are one class). Fewer than two classes, or evaluation labels
    that the training data lacks (the head could not predict them), are a [`DataError`] naming the rows; a row whose
    label names no class is quarantined later, with the other bad rows.
    """
    column, train = data_args.label_column, data["train"]
    feature = train.features[column]
    names = list(feature.names) if isinstance(feature, ClassLabel) else class_names(train[column])
    if len(names) < 2:
        found = f"only the class {names[0]!r}" if names else "no usable label (each is null, empty or a list)"
        raise DataError(
            f"{source_of(data_args, 'train')}: --label_column {column!r} holds {found} in {len(train)} rows; a "
            "classifier needs at least two classes. Is it the right column?"
        )
    if "eval" not in data:
        return names
    evaluation, known = data["eval"], set(names)
    eval_feature = evaluation.features[column]
    values = evaluation[column]
    lines = evaluation[LINE_COLUMN] if LINE_COLUMN in evaluation.column_names else [None] * len(values)
    unknown, first = Counter(), {}
    for row, (value, line) in enumerate(zip(values, lines)):
        if isinstance(eval_feature, ClassLabel):
            value = eval_feature.names[value] if 0 <= value < len(eval_feature.names) else None
        try:
            name = label_name(value)
        except BadSample:
            continue  # no label at all: quarantined with the other bad rows
        if name not in known:
            unknown[name] += 1
            first.setdefault(name, f"line {line}" if line is not None else f"row {row + 1}")
    if unknown:
        rows, labels = sum(unknown.values()), len(unknown)
        listed = ", ".join(f"{name!r} ({count}, first at {first[name]})" for name, count in unknown.most_common(5))
        more = f" and {labels - 5} more" if labels > 5 else ""
        raise DataError(
            f"{source_of(data_args, 'eval')}: {rows} evaluation row{'s have' if rows > 1 else ' has'} "
            f"{'a label' if labels == 1 else f'{labels} labels'} that the training data "
            f"({source_of(data_args, 'train')}) lacks, so the head cannot predict them: {listed}{more}. Add those "
            "classes to the training data or drop those rows."
        )
    return names


def file_order(entry: dict) -> tuple:
    """A quarantine entry's place in its file, for showing the first ones: its line, else its order (a held-out
    split is drawn at random, so the rows of a split are not in file order)."""
    return (entry.get("line") is None, entry.get("line") or 0)


# What a reason for leaving rows out most likely means, for the line that stops a run with too many of them.
LIKELY_CAUSES = {
    "missing_image": "is --data_root right?",
    "path_outside_root": "image paths must lead to files under --data_root",
    "url_image": "URLs are not fetched: download the images and give their paths",
    "not_an_image": "is --image_column the column of image files?",
    "empty_file": "are the image files complete?",
    "truncated": "are the image files complete?",
    "too_large": "images above 50 megapixels are refused",
    "bad_array": "is --image_column the column of images?",
    "bad_text": "is --text_column right?",
    "bad_label": "is --label_column right?",
    "duplicate_id": "is --id_column unique? Without it, rows are numbered",
}


def check_usable(prepared: PreparedData, data_args: DataArguments, quarantine_path: str | os.PathLike) -> None:
    """
    Stop a run that would learn from garbage: when a split has no usable pair left, or more than `--max_bad_fraction`
    of its rows were left out, a [`DataError`] names the most common reason, its first example and its likely cause
    (every image missing: is `--data_root` right? with the first path looked for).
    """
    pairs = prepared.pairs if isinstance(prepared.pairs, DatasetDict) else {"train": prepared.pairs}
    for split, kept in pairs.items():
        bad = [q for q in prepared.quarantine if q.get("split", "train") == split]
        total = len(bad) + len(kept)
        if not bad or (len(kept) and len(bad) <= data_args.max_bad_fraction * total):
            continue
        reasons = Counter(q["reason"].split(":", 1)[0] for q in bad)
        reason, _ = reasons.most_common(1)[0]
        example = min((q for q in bad if q["reason"].startswith(reason)), key=file_order)
        place = f"line {example['line']}" if "line" in example else f"id {example['id']!r}"
        cause = LIKELY_CAUSES.get(reason, "")
        if reason == "missing_image":
            root = data_args.data_root
            cause += f" It is {root!r}." if root else f" It is not set, so paths are read from {os.getcwd()}."
        why = (
            f"so no {split} pair is left"
            if not len(kept)
            else f"more than --max_bad_fraction {data_args.max_bad_fraction:g} allows"
        )
        counts = ", ".join(f"{r} {c}" for r, c in reasons.most_common())
        raise DataError(
            f"{source_of(data_args, split)}: {len(bad)} of {total} {split} rows are unusable ({counts}), {why}. The "
            f"first {reason} is at {place}: {example['reason'].split(':', 1)[-1].strip()}; {cause} Every row left "
            f"out, with its reason: {quarantine_path}."
        )
