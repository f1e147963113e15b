"""Training samplers whose order depends only on a seed and the epoch, so a resumed run draws the same batches, and
[`GroupedSamplingMixin`], the unit of [`MMFusionTrainer`] that trains with them."""

import math
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler
from transformers import TrainerCallback
from transformers.trainer_pt_utils import LengthGroupedSampler


class _EpochSeeded:
    """`set_epoch` (called by Trainer / accelerate at every epoch) and a generator seeded with `seed + epoch`."""

    seed: int = 0
    epoch: int = 0
    _epoch_set: bool = False

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._epoch_set = True

    def _epoch_generator(self) -> torch.Generator:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if not self._epoch_set:
            self.epoch += 1  # nobody calls set_epoch: still reshuffle every pass
        self._epoch_set = False
        return generator


class MMFusionImageGroupedSampler(_EpochSeeded, Sampler[int]):
    """
    Yields the dataset's indices image by image: images in a random order, and the pairs of each image (shuffled)
    one after the other. Cut into batches, each batch then holds the pairs of a few images, which the collator
    (`share_images=True`) delivers once and the vision tower encodes once. On easy-VQA (~9.6 questions per image) a
    batch of 64 pairs holds ~7 images instead of ~64, so the vision tower does ~9x less work.

    The order depends only on `seed` and the epoch, so every rank of a distributed run draws the same order and
    accelerate hands each rank its own batches of it.

    Args:
        image_index (`Sequence[int]`):
            For each pair of the dataset, the row of its image (the `image_index` column of `prepare_dataset`).
        seed (`int`, *optional*, defaults to 0):
            Seed of the shuffling; epoch `e` uses `seed + e`.
        group_size (`int`, *optional*):
            At most this many pairs of one image in a row: each image's (shuffled) pairs are cut into runs of this
            length and the runs are shuffled. Trades the vision work saved against how many distinct images a batch
            holds (more distinct images per step: a more varied gradient for the vision tower). Default: no limit.
    """

    def __init__(self, image_index: Sequence[int], seed: int = 0, group_size: int | None = None):
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be >= 1 or None, got {group_size}.")
        self.group_size = group_size
        self.groups: dict[int, list[int]] = {}
        for i, row in enumerate(image_index):
            self.groups.setdefault(int(row), []).append(i)
        self.num_samples = len(image_index)
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        generator = self._epoch_generator()
        runs = []
        for group in self.groups.values():
            shuffled = [group[j] for j in torch.randperm(len(group), generator=generator).tolist()]
            size = self.group_size or len(shuffled)
            runs += [shuffled[i : i + size] for i in range(0, len(shuffled), size)]
        for r in torch.randperm(len(runs), generator=generator).tolist():
            yield from runs[r]


class MMFusionLengthGroupedSampler(_EpochSeeded, LengthGroupedSampler):
    """
    Trainer's `group_by_length` sampler (batches of similar text lengths), made resumable: its shuffle is drawn from
    a generator seeded with `seed` and the epoch instead of the global RNG. A run resumed mid-epoch starts from a
    global RNG state that differs from the one the interrupted run had at that epoch's start, so the stock sampler
    draws another order and the resumed epoch repeats some samples and skips others.

    Args:
        batch_size (`int`):
            Samples per optimizer step (per-device batch size x gradient accumulation steps), as Trainer passes it.
        lengths (`Sequence[int]`):
            The length of each sample (the `length` column of `prepare_dataset`).
        seed (`int`, *optional*, defaults to 0):
            Seed of the shuffling; epoch `e` uses `seed + e`.
    """

    def __init__(self, batch_size: int, lengths: Sequence[int], seed: int = 0):
        super().__init__(batch_size, lengths=list(lengths))
        self.seed = seed

    def __iter__(self) -> Iterator[int]:
        self.generator = self._epoch_generator()
        return super().__iter__()


def epoch_seeded_samplers(loader, depth: int = 5) -> list:
    """The epoch-seeded samplers ([`MMFusionImageGroupedSampler`], [`MMFusionLengthGroupedSampler`],
    [`RampBatchSampler`]) inside a data loader, through accelerate's and torch's batch-sampler wrappers."""
    found, layer = [], [loader]
    for _ in range(depth):
        following = []
        for item in layer:
            if isinstance(item, _EpochSeeded):
                found.append(item)
                continue
            for name in ("batch_sampler", "sampler"):
                inner = getattr(item, name, None)
                if inner is not None and inner is not item:
                    following.append(inner)
        layer = following
    return list({id(s): s for s in found}.values())


class SamplerEpochCallback(TrainerCallback):
    """
    Gives the epoch-seeded samplers their epoch at the start of every epoch, resumed ones included, so that a resumed
    run draws the interrupted run's batches. In a run of several processes accelerate wraps the batch sampler in a
    `BatchSamplerShard`, and Trainer's own `set_epoch` stops one level short of a sampler inside a batch sampler.
    """

    def on_epoch_begin(self, args, state, control, train_dataloader=None, **kwargs):
        # `state.epoch` is the epoch's start (a float): its whole part, also on a resume in the middle of an epoch.
        for sampler in epoch_seeded_samplers(train_dataloader):
            sampler.set_epoch(math.floor(state.epoch or 0))


class GroupedSamplingMixin:
    """
    Trainer mixin for the training order: `group_by_image` (from [`MMFusionTrainingArguments`]) gives batches that
    hold the pairs of a few images ([`MMFusionImageGroupedSampler`]), which the collator delivers once each, and
    `train_sampling_strategy="group_by_length"` an order seeded by the epoch ([`MMFusionLengthGroupedSampler`]); the
    epochs reach them through [`SamplerEpochCallback`]. [`grouped_train_sampler`] is the sampler Trainer's training
    loader takes (see [`MMFusionTrainer.get_train_dataloader`]), or `None` for Trainer's own.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(SamplerEpochCallback())

    def grouped_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        seed = self.args.data_seed or self.args.seed

        def column(name):  # read at once: iterating `dataset[name]` would format it row by row
            return dataset.with_format("numpy", columns=[name])[:][name].tolist()

        if getattr(self.args, "group_by_image", False):
            group_size = getattr(self.args, "image_group_size", None) or None  # 0: no limit
            return MMFusionImageGroupedSampler(column("image_index"), seed=seed, group_size=group_size)
        length_column = self.args.length_column_name
        if self.args.train_sampling_strategy == "group_by_length" and length_column in dataset.column_names:
            batch_size = self.args.train_batch_size * self.args.gradient_accumulation_steps
            return MMFusionLengthGroupedSampler(batch_size, column(length_column), seed=seed)
        return None
