"""The batch-size ramp (`--batch_size_ramp_max`): its plan ([`BatchRamp`]), its batches ([`RampBatchSampler`]) and
[`BatchRampMixin`], the unit of [`MMFusionTrainer`] that trains with it."""

import bisect
import itertools
import math
from collections.abc import Callable, Iterator

import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Sampler
from transformers import TrainerCallback

from .sampler import _EpochSeeded


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


class RampEpochCallback(TrainerCallback):
    """
    The epoch fraction of a ramp's step. Trainer runs every epoch for the plan's longest epoch's number of steps (the
    first: the batch only grows); a later, shorter epoch's loader simply ends sooner, and the steps left are empty.
    Trainer's `state.epoch` (`epoch + steps done / steps of the longest epoch`) is corrected here to the epoch's own
    number of steps, before any log, evaluation or checkpoint reads it.
    """

    def __init__(self, plan: Callable[[], list[list[int]]]):
        self.plan = plan  # the trainer's `ramp_plan`

    def on_step_end(self, args, state, control, **kwargs):
        ends = list(itertools.accumulate(len(sizes) for sizes in self.plan()))  # each epoch's last global step
        epoch = bisect.bisect_left(ends, state.global_step)
        if epoch < len(ends):
            start = ends[epoch - 1] if epoch else 0
            state.epoch = epoch + (state.global_step - start) / (ends[epoch] - start)


class BatchRampMixin:
    """
    Trainer unit for `--batch_size_ramp_max`: epochs of different numbers of steps, planned in advance
    ([`ramp_plan`]). [`ramp_dataloader`] draws the ramp's batches, [`ramp_training_values`] gives Trainer the planned
    steps and samples, `create_scheduler` scales each step's learning rate with its batch size, [`RampEpochCallback`]
    gives each step its epoch fraction, and [`ramp_resume_position`] finds a resumed step's epoch in the plan (for
    [`MMFusionTrainer`]'s `_init_training_state`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ramp_plan = (None, None)  # (what the plan was made for, the plan)
        self._ramp_scheduler = None  # the scheduler whose rates were scaled
        if self.batch_ramp() is not None:  # first among the callbacks added here: the others read its epoch
            self.add_callback(RampEpochCallback(self.ramp_plan))

    def batch_ramp(self) -> BatchRamp | None:
        args = self.args
        if getattr(args, "batch_size_ramp_max", None) is None:
            return None
        ramp = BatchRamp(args.per_device_train_batch_size, args.batch_size_ramp_max, args.batch_size_ramp_steps,
                         args.batch_size_ramp_lr)  # fmt: skip
        return ramp

    def ramp_plan(self) -> list[list[int]]:
        """Every epoch's per-step, per-device batch sizes ([`BatchRamp.plan`]), made once."""
        args = self.args
        key = (len(self.train_dataset), args.world_size, args.num_train_epochs, args.max_steps)
        if self._ramp_plan[0] != key:
            epochs = math.ceil(args.num_train_epochs) if args.max_steps <= 0 else None
            plan = self.batch_ramp().plan(len(self.train_dataset), args.world_size, epochs, max_steps=args.max_steps)
            self._ramp_plan = (key, plan)
        return self._ramp_plan[1]

    def ramp_dataloader(self):
        """The training loader of a ramp: [`RampBatchSampler`]'s batches."""
        args = self.args
        plan = self.ramp_plan()
        sampler = RampBatchSampler(len(self.train_dataset), plan, args.world_size, seed=args.data_seed or args.seed)
        workers = args.dataloader_num_workers
        loader = DataLoader(
            self.train_dataset,
            batch_sampler=sampler,
            collate_fn=self.data_collator,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
        )
        return self.accelerator.prepare(loader)

    def ramp_training_values(self, args):
        """`set_initial_training_values` for a ramp: the longest epoch's steps (Trainer's steps per epoch), the planned
        total, and the samples the plan draws."""
        plan = self.ramp_plan()
        steps = [len(sizes) for sizes in plan]
        max_steps = args.max_steps if args.max_steps > 0 else sum(steps)
        samples = sum(sum(sizes) for sizes in plan) * args.world_size
        largest = self.batch_ramp().maximum * args.world_size
        return len(plan), max(steps), len(self.train_dataset), samples, largest, max(steps), max_steps

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """Trainer's schedule times each step's [`BatchRamp.lr_factor`], as a new `LambdaLR` on the same optimizer."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        ramp = self.batch_ramp()
        if ramp is None or ramp.lr_scaling == "none" or scheduler is self._ramp_scheduler:
            return scheduler
        if not isinstance(scheduler, LambdaLR):
            raise ValueError(f"--batch_size_ramp_lr {ramp.lr_scaling} scales a LambdaLR schedule, not {scheduler}.")
        factors = [ramp.lr_factor(size) for sizes in self.ramp_plan() for size in sizes]

        def scaled(schedule):
            return lambda step: schedule(step) * factors[min(step, len(factors) - 1)]

        # The optimizer's groups keep their `initial_lr`, so the new schedule starts from the same base rates.
        self.lr_scheduler = LambdaLR(scheduler.optimizer, [scaled(schedule) for schedule in scheduler.lr_lambdas])
        self._ramp_scheduler = self.lr_scheduler
        return self.lr_scheduler

    def ramp_resume_position(self) -> tuple[int, int]:
        """The epoch of the resumed step (`state.global_step`) in the plan, and the batches of it already trained (0
        with `ignore_data_skip`): Trainer divides the step by one number of steps per epoch."""
        done = self.state.global_step
        for epoch, sizes in enumerate(self.ramp_plan()):
            if done < len(sizes):
                return epoch, 0 if self.args.ignore_data_skip else done
            done -= len(sizes)
        return len(self.ramp_plan()), 0
