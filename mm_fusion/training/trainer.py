"""`Trainer` for MMFusion: the stock one, with image-grouped batches, retrieval evaluation and exact resumption."""

import contextlib
import json
import math
import os

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from ..distributed import local_only
from .checkpoints import load_checkpoint_weights, resolve_resume_checkpoint
from .grad_cache import build_itc_cache, cached_micro_batch_loss
from .sampler import (
    BatchRamp,
    MMFusionImageGroupedSampler,
    MMFusionLengthGroupedSampler,
    RampBatchSampler,
    _EpochSeeded,
)


# Written into each checkpoint: the sum of every optimizer step's training loss up to it, so that a resumed run
# reports the mean over the whole run (Trainer's `train_loss` averages only the steps of the current `train()` call).
LOSS_TOTAL_FILE = "train_loss_total.json"
# The pretraining loss terms logged next to the loss (training) and `eval_loss` (evaluation).
LOSS_COMPONENTS = ("itc_loss", "itm_loss")
# Written into each checkpoint by every rank of a streaming run: its data loader's state (torchdata's
# StatefulDataLoader, with the stream's own), from which the resumed run reads on exactly where this one was.
STREAM_STATE_FILE = "stream_state_rank{rank}.json"
# Written into each checkpoint of an `--auto_find_batch_size` run: the per-device batch and accumulation the ranks
# agreed on, which a resumed run takes as they are.
AUTO_BATCH_FILE = "auto_batch_size.json"

logger = logging.get_logger(__name__)


def _samplers(loader, depth: int = 5) -> list:
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
        for sampler in _samplers(train_dataloader):
            sampler.set_epoch(math.floor(state.epoch or 0))


class MMFusionTrainer(Trainer):
    """
    [`Trainer`] with what the stock one lacks or gets wrong for these models:

    - `group_by_image` (from [`MMFusionTrainingArguments`]): batches hold the pairs of a few images
      ([`MMFusionImageGroupedSampler`]), which the collator delivers once each;
    - `train_sampling_strategy="group_by_length"` with an order seeded by the epoch
      ([`MMFusionLengthGroupedSampler`]), so that a resumed run draws the interrupted run's batches;
    - `eval_data_collator`: a collator for evaluation and prediction (the training one may augment);
    - evaluation of [`MMFusionForPretraining`]: the loss (ITC + ITM, as in training; `eval_itc_loss` and
      `eval_itm_loss` too) and, as predictions, the image and text embeddings with each pair's image row as label,
      for retrieval Recall@K in `compute_metrics`; training logs carry `itc_loss` / `itm_loss` next to `loss`;
    - `itc_grad_cache` (pretraining with gradient accumulation): a gradient cache ([`mm_fusion.training.grad_cache`])
      makes the ITC loss of each optimizer step contrast all k·B·W pairs of its micro-batches on every rank, with
      exact gradients and one micro-batch's activation memory, inside Trainer's own accumulation loop;
    - exact weight loading on resume and for `load_best_model_at_end` ([`load_checkpoint_weights`]): Trainer loads
      with `strict=False` and without the key renaming of `from_pretrained`, so a ViT tower saved under its legacy
      key names silently stayed at its random initialisation; a missing or unexpected key is now an error;
    - `text_tower_lr_scale`: the text tower's parameters at a fraction of the learning rate (`create_optimizer`);
    - after a resume, `train_loss` is the mean over every step of the run, not only the resumed ones.

    Everything else (mixed precision, accumulation, checkpoint writing, `gather_for_metrics`, RNG and data-order
    restoring) is Trainer's.
    `model_card_writer` (e.g. [`MMFusionModelCard`]'s `write`) writes the model card, on `push_to_hub` too.

    Public hooks do what they can: the samplers get their epoch in [`SamplerEpochCallback`]'s `on_epoch_begin`, the
    evaluation collator comes in through `get_eval_dataloader` / `get_test_dataloader`, and `train`, `log`,
    `create_optimizer`, `create_scheduler`, `training_step`, `compute_loss`, `get_batch_samples`, `evaluation_loop`,
    `prediction_step`, `set_initial_training_values` and `create_model_card` are public. These private methods are
    overridden because Trainer has no public hook at that point:

    - `_get_train_sampler` (image-grouped and resumable length-grouped batches): the one place Trainer picks the
      training sampler;
    - `_load_from_checkpoint`, `_load_best_model` (exact weight loading): Trainer's own `strict=False` loading
      happens inside them;
    - `_save_checkpoint` (the loss total, the agreed batch size, each rank's stream state): these files must be
      written before `trainer_state.json`, whose presence marks a complete checkpoint; `on_save` runs after it;
    - `_save` (`save_on_each_node`): transformers 5.23's `save_pretrained` writes the weights on global rank 0 only;
    - `_init_training_state`, `_run_epoch` (batch ramp): epochs of different lengths; the resumed epoch and each
      epoch's step count are computed inside them.
    """

    def __init__(self, *args, model_card_writer=None, eval_data_collator=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(SamplerEpochCallback())
        self.model_card_writer = model_card_writer
        self.eval_data_collator = eval_data_collator
        self.resumed_from_step = None  # the global step of the checkpoint a run resumed from
        self._resumed_loss_sum = None  # and its summed step losses
        self._window = None  # the micro-batches of the current optimizer step (pretraining with the ITC cache)
        self._itc_cache = None
        self._grad_cache_warned = False
        self._train_components = {}  # summed ITC / ITM terms of the steps since the last log, scaled as the loss
        self._components_since_step = 0
        self._eval_components = None  # per-sample ITC / ITM losses of the running evaluation
        self._stream_resume = None  # the checkpoint a streaming run resumes from
        self._stream_loader = None
        self.agreed_batch_sizes = None  # every rank's largest batch, when agree_on_batch_size ran

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        self.resumed_from_step = self._resumed_loss_sum = None
        if resume_from_checkpoint is True:  # Trainer's own "the last one", made the newest complete one here
            resume_from_checkpoint = resolve_resume_checkpoint("last", self.args.output_dir)
        self._stream_resume = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        if self.args.auto_find_batch_size:
            saved = os.path.join(resume_from_checkpoint or "", AUTO_BATCH_FILE)
            if isinstance(resume_from_checkpoint, str) and os.path.isfile(saved):
                with open(saved) as f:  # the batch the interrupted run agreed on, so the resume is exact
                    self._apply_batch_size(**json.load(f))
            else:
                self.agree_on_batch_size()
        if self._is_streaming():
            # The stream's saved state puts it where it was; Trainer's own fast-forward would skip batches again.
            self.args.ignore_data_skip = True
        if isinstance(resume_from_checkpoint, str):
            with open(os.path.join(resume_from_checkpoint, "trainer_state.json")) as f:
                self.resumed_from_step = json.load(f)["global_step"]
            path = os.path.join(resume_from_checkpoint, LOSS_TOTAL_FILE)
            if os.path.isfile(path):  # absent from checkpoints of other trainers: Trainer's figure then
                with open(path) as f:
                    self._resumed_loss_sum = float(json.load(f)["train_loss_sum"])
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:  # sharded states: their own loaders
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_checkpoint_weights(model if model is not None else self.model, resume_from_checkpoint)

    def _load_best_model(self):
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return super()._load_best_model()
        load_checkpoint_weights(self.model, self.state.best_model_checkpoint)

    def _save_checkpoint(self, model, trial):
        # Before Trainer's own files, so that `trainer_state.json` stays the last file written (the sign of a
        # finished save that `checkpoint_problem` looks for).
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self._is_streaming() and getattr(self, "_stream_loader", None) is not None:
            # Every rank writes its own stream's state (ranks read different shards); then the main process goes on.
            os.makedirs(folder, exist_ok=True)
            state = self._stream_loader.state_dict()
            with open(os.path.join(folder, STREAM_STATE_FILE.format(rank=self.args.process_index)), "w") as f:
                json.dump(state, f)
            self.accelerator.wait_for_everyone()
        if self.args.should_save:
            # Trainer drains the losses of logged steps into `_total_loss_scalar`; `_tr_loss` holds the rest.
            total = (self._resumed_loss_sum or 0.0) + self._total_loss_scalar + self._tr_loss.item()
            folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder = os.path.join(self._get_output_dir(trial=trial), folder)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, LOSS_TOTAL_FILE), "w") as f:
                json.dump({"train_loss_sum": total, "global_step": self.state.global_step}, f)
            if self.agreed_batch_sizes is not None:
                with open(os.path.join(folder, AUTO_BATCH_FILE), "w") as f:
                    batch = {"per_device": self.args.per_device_train_batch_size,
                             "accumulation": self.args.gradient_accumulation_steps}  # fmt: skip
                    json.dump({**batch, "found": self.agreed_batch_sizes}, f)
        super()._save_checkpoint(model, trial)

    def _save(self, output_dir: str | None = None, state_dict=None):
        """Trainer's save; with `save_on_each_node`, the local main process of every node writes the weights and
        config too. transformers 5.23's `save_pretrained` writes them on global rank 0 only, whatever
        `is_main_process` says, so the checkpoints on the other nodes' disks had no weights and could not be resumed
        from (found by the two-node failure test)."""
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if not (self.args.save_on_each_node and self.args.should_save and self.args.process_index != 0):
            return super()._save(output_dir, state_dict)
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
        try:
            return super()._save(output_dir, state_dict)
        finally:
            del model.should_save_on_this_rank

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._train_components:
            # Every rank logs here (Trainer gathers the loss just before), so the mean over ranks is safe to take.
            steps = max(self.state.global_step - self._components_since_step, 1)
            for name, total in self._train_components.items():
                logs[name] = self.accelerator.reduce(total.detach().clone(), reduction="mean").item() / steps
            self._train_components = {}
        if "train_loss" in logs and self._resumed_loss_sum is not None:
            # In place: the same dict is `train()`'s returned metrics.
            steps = self.state.global_step - self.resumed_from_step  # this session's, which Trainer averaged over
            logs["train_loss"] = (self._resumed_loss_sum + logs["train_loss"] * steps) / max(self.state.global_step, 1)
        super().log(logs, start_time)

    def create_optimizer(self, model=None):
        """Trainer's optimizer, with the text tower's parameters in groups of their own at `text_tower_lr_scale` times
        the learning rate (Trainer has one rate for every parameter; its scheduler then scales each group's own)."""
        made_here = self.optimizer is None  # not one passed in through `optimizers`, nor one already split
        optimizer = super().create_optimizer(model)
        scale = getattr(self.args, "text_tower_lr_scale", 1.0)
        if scale == 1.0 or not made_here:
            return optimizer
        model = self.model if model is None else model
        tower = getattr(getattr(model, model.base_model_prefix, model), "text_model", None)
        if tower is None:
            raise ValueError(
                f"text_tower_lr_scale={scale} sets the learning rate of a text tower, but {type(model).__name__} has "
                "no `text_model`."
            )
        text_ids = {id(p) for p in tower.parameters()}
        for group in list(optimizer.param_groups):
            text = [p for p in group["params"] if id(p) in text_ids]
            if text:
                group["params"] = [p for p in group["params"] if id(p) not in text_ids]
                optimizer.add_param_group({**group, "params": text, "lr": group["lr"] * scale})
        return optimizer

    def try_batch_size(self, batch_size: int) -> bool:
        """Whether a training step (forward and backward, no optimizer step) on `batch_size` pairs of the training
        data fits in this process's memory; the model's gradients and the RNG states are left as they were."""
        from accelerate.utils.memory import release_memory, should_reduce_batch_size

        rows = [self.train_dataset[i % len(self.train_dataset)] for i in range(batch_size)]
        inputs = self._prepare_inputs(self.data_collator(rows))
        cpu_rng = torch.get_rng_state()
        accelerator_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        if not hasattr(self, "current_gradient_accumulation_steps"):
            self.current_gradient_accumulation_steps = 1  # read by compute_loss; Trainer sets it in its loop
        try:
            self.model.train()
            with local_only():  # the other ranks are measuring too: no collective (the contrastive gather)
                loss = self.compute_loss(self.model, inputs)
                loss.backward()
            return True
        except Exception as err:
            if isinstance(err, torch.OutOfMemoryError) or should_reduce_batch_size(err):
                return False
            raise
        finally:
            self.model.zero_grad(set_to_none=True)
            self._train_components = {}  # the probe's ITC / ITM terms are not the first logged step's
            inputs = loss = None
            release_memory()
            torch.set_rng_state(cpu_rng)
            if accelerator_rng is not None:
                torch.cuda.set_rng_state_all(accelerator_rng)

    def agree_on_batch_size(self) -> int:
        """
        `--auto_find_batch_size` that every rank agrees on. Trainer's own search runs in each process, halving the
        batch after an out-of-memory error there, so ranks with less free memory end up with other batch sizes (and a
        rank that runs out of memory inside a collective hangs the others). Here each rank halves
        `per_device_train_batch_size` until [`try_batch_size`] fits, before any collective training step; the
        smallest over the ranks wins, and gradient accumulation grows to keep the global batch (per-device x
        accumulation x processes), so the contrastive loss of pretraining with `itc_grad_cache` keeps its number of
        negatives. Returns the agreed per-device batch size.
        """
        args = self.args
        start, world = args.per_device_train_batch_size, args.world_size
        global_batch = start * args.gradient_accumulation_steps * world
        size = start
        while size >= 1 and not self.try_batch_size(size):
            size //= 2
        found = torch.tensor([size], device=args.device)
        every = [int(x) for x in self.accelerator.gather(found).tolist()] if world > 1 else [size]
        agreed = min(every)
        if agreed < 1:
            raise RuntimeError(f"Not even one pair per step fits in memory (per rank: {every}).")
        accumulation = -(-global_batch // (agreed * world))
        if accumulation * agreed * world != global_batch:
            logger.warning(
                "The global batch %d is not a multiple of %d x %d processes: it becomes %d.",
                global_batch, agreed, world, accumulation * agreed * world,
            )  # fmt: skip
        logger.info(
            "auto_find_batch_size: each rank's largest batch (of %d tried first) %s; all use %d with %d accumulation "
            "steps (global batch %d).", start, every, agreed, accumulation, accumulation * agreed * world,
        )  # fmt: skip
        self._apply_batch_size(agreed, accumulation, every)
        return agreed

    def _apply_batch_size(self, per_device: int, accumulation: int, found: list[int]) -> None:
        args = self.args
        args.per_device_train_batch_size = per_device
        args.gradient_accumulation_steps = accumulation
        self.accelerator.gradient_accumulation_steps = accumulation
        self._train_batch_size = args.train_batch_size
        args.auto_find_batch_size = False  # Trainer's own per-process search would let the ranks drift apart again
        self.agreed_batch_sizes = found

    # --- the batch-size ramp (`batch_size_ramp_max`) -------------------------------------------------------------

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
        if getattr(self, "_ramp_plan", (None, None))[0] != key:
            epochs = math.ceil(args.num_train_epochs) if args.max_steps <= 0 else None
            plan = self.batch_ramp().plan(len(self.train_dataset), args.world_size, epochs, max_steps=args.max_steps)
            self._ramp_plan = (key, plan)
        return self._ramp_plan[1]

    def get_train_dataloader(self):
        if self._is_streaming():
            return self._streaming_dataloader()
        if self.batch_ramp() is None:
            return super().get_train_dataloader()
        from torch.utils.data import DataLoader

        args = self.args
        sampler = RampBatchSampler(len(self.train_dataset), self.ramp_plan(), args.world_size,
                                   seed=args.data_seed or args.seed)  # fmt: skip
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

    def set_initial_training_values(self, args, dataloader):
        values = super().set_initial_training_values(args, dataloader)
        if self.batch_ramp() is None:
            return values
        plan = self.ramp_plan()
        steps = [len(sizes) for sizes in plan]
        max_steps = args.max_steps if args.max_steps > 0 else sum(steps)
        samples = sum(sum(sizes) for sizes in plan) * args.world_size
        largest = self.batch_ramp().maximum * args.world_size
        return len(plan), max(steps), len(self.train_dataset), samples, largest, steps[0], max_steps

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
                             trial):  # fmt: skip
        epochs_trained, skipped = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if self._is_streaming() and resume_from_checkpoint is not None and self.state.global_step >= max_steps:
            # A finished run resumed: Trainer finds no epoch left for data with a length, but counts a stream's
            # epochs without end and would take step max_steps + 1. No epoch left here either.
            return num_train_epochs, 0
        if self.batch_ramp() is None or resume_from_checkpoint is None:
            return epochs_trained, skipped
        # Epochs have different numbers of steps: find the resumed step's epoch in the plan.
        done = self.state.global_step
        for epoch, sizes in enumerate(self.ramp_plan()):
            if done < len(sizes):
                return epoch, 0 if self.args.ignore_data_skip else done
            done -= len(sizes)
        return len(self.ramp_plan()), 0

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        ramp = self.batch_ramp()
        if ramp is None or ramp.lr_scaling == "none" or getattr(scheduler, "_mm_fusion_ramp", False):
            return scheduler
        if not hasattr(scheduler, "lr_lambdas"):
            raise ValueError(f"--batch_size_ramp_lr {ramp.lr_scaling} scales a LambdaLR schedule, not {scheduler}.")
        factors = [ramp.lr_factor(size) for sizes in self.ramp_plan() for size in sizes]

        def scaled(schedule):
            return lambda step: schedule(step) * factors[min(step, len(factors) - 1)]

        scheduler.lr_lambdas = [scaled(schedule) for schedule in scheduler.lr_lambdas]
        scheduler._mm_fusion_ramp = True
        # The first step's rate was set when the scheduler was made: scale it too.
        for group, base, schedule in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * schedule(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
        return scheduler

    def _run_epoch(self, model, epoch, train_dataloader, *args, **kwargs):
        if self.batch_ramp() is not None:  # this epoch's own number of steps
            steps = len(self.ramp_plan()[min(epoch, len(self.ramp_plan()) - 1)])
            kwargs["steps_in_epoch"] = kwargs["num_update_steps_per_epoch"] = steps
        return super()._run_epoch(model, epoch, train_dataloader, *args, **kwargs)

    def _is_streaming(self) -> bool:
        from ..data import ShuffledStream

        return isinstance(self.train_dataset, ShuffledStream)

    def _streaming_dataloader(self):
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

    def get_eval_dataloader(self, eval_dataset=None):
        with self._evaluation_collator():
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        with self._evaluation_collator():
            return super().get_test_dataloader(test_dataset)

    @contextlib.contextmanager
    def _evaluation_collator(self):
        """Evaluation and prediction use `eval_data_collator` when given (e.g. the training one augments)."""
        if self.eval_data_collator is None:
            yield
            return
        train_collator, self.data_collator = self.data_collator, self.eval_data_collator
        try:
            yield
        finally:
            self.data_collator = train_collator

    def _get_train_sampler(self, train_dataset=None):
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
        return super()._get_train_sampler(train_dataset)

    def _is_pretraining(self, model) -> bool:
        return type(self.accelerator.unwrap_model(model)).__name__ == "MMFusionForPretraining"

    # ---- Pretraining: gradient-cached ITC within Trainer's accumulation loop ----

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Trainer fetches the micro-batches of each optimizer step up front; keep them for the ITC cache."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._window, self._itc_cache = batch_samples, None
        return batch_samples, num_items_in_batch

    def _uses_grad_cache(self, model) -> bool:
        """`itc_grad_cache` acts for pretraining with gradient accumulation (k = 1 already gathers B·W negatives)."""
        if not (
            getattr(self.args, "itc_grad_cache", True)
            and self.args.gradient_accumulation_steps > 1
            and self._window is not None
            and len(self._window) > 1
            and self._is_pretraining(model)
        ):
            return False
        if self.is_fsdp_enabled or self.is_deepspeed_enabled or self.args.n_gpu > 1:
            if not self._grad_cache_warned:
                logger.warning(
                    "itc_grad_cache is not supported with FSDP, DeepSpeed or DataParallel: ITC sees one micro-batch's "
                    "negatives per loss. Pass --itc_grad_cache False to silence this."
                )
                self._grad_cache_warned = True
            return False
        return True

    def training_step(self, model, inputs, num_items_in_batch=None):
        use_cache = self._uses_grad_cache(model)
        index = next((i for i, batch in enumerate(self._window or ()) if batch is inputs), None)
        if not use_cache or index is None:
            if use_cache and not self._grad_cache_warned:  # Trainer no longer hands over the batches it fetched
                logger.warning("itc_grad_cache: a micro-batch not among those Trainer fetched; trained without it.")
                self._grad_cache_warned = True
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        unwrapped = self.accelerator.unwrap_model(model)
        if self._itc_cache is None:  # the step's first micro-batch: embed them all without gradient
            batches = [self._prepare_inputs(batch) for batch in self._window]
            with self.compute_loss_context_manager():
                self._itc_cache = build_itc_cache(unwrapped, batches, autocast=self.accelerator.autocast)
        cache = self._itc_cache
        inputs = self._prepare_inputs(inputs)
        cache.restore_rng(index)  # the same dropout masks as in the embedding pass
        with self.compute_loss_context_manager():
            outputs = model(**inputs, return_loss=True)
        surrogate, logged = cached_micro_batch_loss(unwrapped, outputs, cache, index)
        k = cache.num_micro_batches
        itm_loss = outputs.itm_loss / k if outputs.itm_loss is not None else None
        self._add_train_components(itc_loss=cache.itc_loss / k, itm_loss=itm_loss)
        del outputs, inputs
        # Scaled already (see `cached_micro_batch_loss`); undo the division by an accelerate accumulation plugin.
        self.accelerator.backward(surrogate * self.accelerator.gradient_accumulation_steps)
        if index == len(self._window) - 1:
            self._window = self._itc_cache = None
        return logged.detach()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training and self._is_pretraining(model):
            k = self.current_gradient_accumulation_steps  # Trainer divides the loss by it
            terms = {name: getattr(outputs, name, None) for name in LOSS_COMPONENTS}
            self._add_train_components(**{name: v / k if v is not None else None for name, v in terms.items()})
        return (loss, outputs) if return_outputs else loss

    def _add_train_components(self, **terms) -> None:
        """Accumulate a micro-batch's loss terms, each already scaled as its share of the step's loss."""
        if not self._train_components:
            self._components_since_step = self.state.global_step
        for name, value in terms.items():
            if value is not None:
                self._train_components[name] = self._train_components.get(name, 0) + value.detach().float()

    # ---- Evaluation ----

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        """Adds `{prefix}_itc_loss` / `{prefix}_itm_loss` for pretraining, averaged as Trainer averages the loss."""
        pretraining = self._is_pretraining(self.model)
        self._eval_components = {name: [] for name in LOSS_COMPONENTS} if pretraining else None
        try:
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix=metric_key_prefix
            )
        finally:
            components, self._eval_components = self._eval_components, None
        for name, values in (components or {}).items():
            if values:
                output.metrics[f"{metric_key_prefix}_{name}"] = torch.cat(values).mean().item()
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if not self._is_pretraining(model):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            outputs = model(**inputs, return_loss=True)
        loss = outputs.loss.detach()
        if self._eval_components is not None:
            # As `evaluation_loop` treats the loss: repeated per sample and gathered, padded duplicates dropped.
            repeats = self.args.eval_batch_size or inputs["input_ids"].shape[0]
            for name in LOSS_COMPONENTS:
                value = getattr(outputs, name)
                if value is not None:
                    gathered = self.accelerator.gather_for_metrics(value.detach().float().repeat(repeats))
                    self._eval_components[name].append(gathered.cpu())
        if prediction_loss_only:
            return loss, None, None
        return loss, (outputs.image_embeds.detach(), outputs.text_embeds.detach()), inputs["image_rows"]

    def create_model_card(self, *args, **kwargs):
        """Trainer's own card would replace ours on `push_to_hub`; write ours instead."""
        if self.model_card_writer is not None and self.is_world_process_zero():
            self.model_card_writer(self)
        elif self.model_card_writer is None:
            super().create_model_card(*args, **kwargs)
