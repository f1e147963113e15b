"""Training samplers whose order depends only on a seed and the epoch, so a resumed run draws the same batches."""

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler
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


class BatchRamp:
    """
    A batch size that grows during training, as `min(start * (k + 1), maximum)` per device, `k` being the epoch
    (`every_steps=0`) or the number of `every_steps` optimizer steps done, with the learning rate scaled with it:
    `"linear"` (lr x size / maximum), `"sqrt"` (lr x sqrt(size / maximum)) or `"none"`. The learning rate given is
    the one of the maximum batch.

    [`plan`] lays out every epoch's per-step batch sizes in advance (they depend only on the data size, the ramp and
    the number of processes), so the number of steps, the epoch of a step and the learning rate of a step are known
    from the start and a resumed run finds its place again.
    """

    def __init__(self, start: int, maximum: int, every_steps: int = 0, lr_scaling: str = "linear"):
        if not 1 <= start <= maximum:
            raise ValueError(f"The batch ramp needs 1 <= start <= maximum, got start {start}, maximum {maximum}.")
        if lr_scaling not in ("linear", "sqrt", "none"):
            raise ValueError(f"lr_scaling must be linear, sqrt or none, got {lr_scaling!r}.")
        self.start, self.maximum, self.every_steps, self.lr_scaling = start, maximum, every_steps, lr_scaling

    def size(self, epoch: int, step: int) -> int:
        """The per-device batch size of the optimizer step `step` (global, 0-based), in epoch `epoch`."""
        k = epoch if self.every_steps <= 0 else step // self.every_steps
        return min(self.start * (k + 1), self.maximum)

    def plan(
        self, num_samples: int, num_processes: int, epochs: int | None, max_steps: int | None = None
    ) -> list[list[int]]:
        """Each epoch's per-step, per-device batch sizes, for `epochs` epochs or as many as `max_steps` (> 0) need.
        Every step takes `size x num_processes` pairs; the last step of an epoch takes what is left, split between
        the processes, and fewer than `num_processes` pairs left over are not trained on in that epoch (the next
        epoch is reshuffled)."""
        if num_samples < num_processes:
            raise ValueError(f"The batch ramp needs at least one pair per process: {num_samples} pairs.")
        plan, step, epoch = [], 0, 0
        while (epochs is not None and epoch < epochs) or (epochs is None and step < (max_steps or 0)):
            sizes, left = [], num_samples
            while left >= num_processes:
                size = min(self.size(epoch, step), left // num_processes)
                sizes.append(size)
                left -= size * num_processes
                step += 1
            plan.append(sizes)
            epoch += 1
        return plan

    def lr_factor(self, size: int) -> float:
        if self.lr_scaling == "none":
            return 1.0
        ratio = size / self.maximum
        return ratio if self.lr_scaling == "linear" else ratio**0.5


class RampBatchSampler(_EpochSeeded, Sampler[list[int]]):
    """
    Batches of a [`BatchRamp`]'s sizes over a random order seeded by `seed + epoch`. Each optimizer step yields one
    batch per process, one after the other, so accelerate's `BatchSamplerShard` gives each process its own batch of
    the step's size.
    """

    def __init__(self, num_samples: int, plan: list[list[int]], num_processes: int = 1, seed: int = 0):
        self.num_samples, self.plan, self.num_processes, self.seed = num_samples, plan, num_processes, seed

    def __len__(self) -> int:
        return len(self.plan[min(self.epoch, len(self.plan) - 1)]) * self.num_processes

    def __iter__(self) -> Iterator[list[int]]:
        sizes = self.plan[min(self.epoch, len(self.plan) - 1)]
        order = torch.randperm(self.num_samples, generator=self._epoch_generator()).tolist()
        position = 0
        for size in sizes:
            for _ in range(self.num_processes):
                yield order[position : position + size]
                position += size
