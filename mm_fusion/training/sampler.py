"""A training sampler that keeps the questions about one image together, so a batch encodes few distinct images."""

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler


class MMFusionImageGroupedSampler(Sampler[int]):
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
        self.epoch = 0
        self._epoch_set = False

    def set_epoch(self, epoch: int) -> None:
        """Called by Trainer / accelerate at the start of each epoch."""
        self.epoch = epoch
        self._epoch_set = True

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if not self._epoch_set:
            self.epoch += 1  # nobody calls set_epoch: still reshuffle every pass
        self._epoch_set = False
        runs = []
        for group in self.groups.values():
            shuffled = [group[j] for j in torch.randperm(len(group), generator=generator).tolist()]
            size = self.group_size or len(shuffled)
            runs += [shuffled[i : i + size] for i in range(0, len(shuffled), size)]
        for r in torch.randperm(len(runs), generator=generator).tolist():
            yield from runs[r]
