"""`Trainer` for MMFusion: the stock one, with a unit (a class in its feature's module) for each thing it adds."""

import contextlib
import os

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .batch_ramp import BatchRampMixin
from .batch_size import AgreedBatchSizeMixin
from .checkpoints import ExactLoadingMixin, ResumedLossMixin, resolve_resume_checkpoint, save_on_every_node
from .grad_cache import GradCacheMixin
from .pretraining import PretrainingLossMixin
from .sampler import GroupedSamplingMixin
from .streaming import StreamingLoaderMixin


# The only private `Trainer` methods overridden in mm_fusion (tests/test_training.py counts them), each because Trainer
# does there what no public hook reaches:
# - `_init_training_state`: where Trainer places a resumed step in its epochs, as the step divided by one number of
#   steps per epoch. A batch ramp's epochs have different numbers ([`BatchRampMixin.ramp_resume_position`]), and a
#   stream's finished run, resumed, would take step max_steps + 1 (Trainer counts a stream's epochs without end).
# - `_load_from_checkpoint`, `_load_best_model` ([`ExactLoadingMixin`]): Trainer loads the weights inside them with
#   `strict=False` and without `from_pretrained`'s key renaming.
PRIVATE_OVERRIDES = ("_init_training_state", "_load_from_checkpoint", "_load_best_model")


def checkpoint_name(step: int) -> str:
    return f"{PREFIX_CHECKPOINT_DIR}-{step}"


class MMFusionTrainer(
    StreamingLoaderMixin,
    AgreedBatchSizeMixin,
    GradCacheMixin,
    PretrainingLossMixin,
    BatchRampMixin,
    GroupedSamplingMixin,
    ResumedLossMixin,
    ExactLoadingMixin,
    Trainer,
):
    """
    [`Trainer`] with what the stock one lacks or gets wrong for these models. Each feature is one unit (a class in its
    feature's module), and each `Trainer` method is overridden in one place only: where several units act at one
    point (`train`, `save_model`, `log`, `get_train_dataloader`, `set_initial_training_values`), this class calls
    them in one explicit sequence.

    - [`StreamingLoaderMixin`] (`streaming.py`): a streaming training set, resumed exactly;
    - [`AgreedBatchSizeMixin`] (`batch_size.py`): `--auto_find_batch_size` that every rank agrees on;
    - [`GradCacheMixin`] (`grad_cache.py`): `itc_grad_cache`, every micro-batch's pairs as ITC negatives:
      `get_batch_samples`, `training_step`;
    - [`PretrainingLossMixin`] (`pretraining.py`): pretraining's ITC / ITM terms in the logs, and its evaluation:
      `compute_loss`, `evaluation_loop`, `prediction_step`;
    - [`BatchRampMixin`] (`batch_ramp.py`): the batch-size ramp: `create_scheduler`, and [`RampEpochCallback`];
    - [`GroupedSamplingMixin`] (`sampler.py`): image-grouped and resumable length-grouped batches;
    - [`ResumedLossMixin`] (`checkpoints.py`): the whole run's mean `train_loss` after a resume;
    - [`ExactLoadingMixin`] (`checkpoints.py`): exact weight loading on resume and for the best model;
    - [`save_on_every_node`] (`checkpoints.py`): the weights on every node's disk with `save_on_each_node`;
    - this class: `resume_from_checkpoint=True` as the newest complete checkpoint, `eval_data_collator` for
      evaluation and prediction (`get_eval_dataloader`, `get_test_dataloader`), `vision_tower_lr_scale` /
      `text_tower_lr_scale` (`create_optimizer`), and `model_card_writer`, which writes our card, on `push_to_hub` too
      (`create_model_card`).

    Three private methods are overridden ([`PRIVATE_OVERRIDES`], with the reasons). Everything else (mixed
    precision, accumulation, checkpoint writing, `gather_for_metrics`, RNG and data-order restoring) is Trainer's.
    """

    def __init__(self, *args, model_card_writer=None, eval_data_collator=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_card_writer = model_card_writer
        self.eval_data_collator = eval_data_collator
        if self.args.save_on_each_node:
            save_on_every_node(self.accelerator.unwrap_model(self.model, keep_torch_compile=False))

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """Trainer's `train`, after each unit's preparation, in this order."""
        if resume_from_checkpoint is True:  # Trainer's own "the last one", made the newest complete one here
            resume_from_checkpoint = resolve_resume_checkpoint("last", self.args.output_dir)
        resume = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        self.resume_stream(resume)
        self.settle_batch_size(resume)  # may run training steps to measure memory: before the loss terms are reset
        self.reset_loss_terms()
        self.read_resumed_loss(resume)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def get_train_dataloader(self):
        """A stream's stateful loader, a batch ramp's, or Trainer's own with the grouped sampler when one is set."""
        if self.is_streaming():
            return self.streaming_dataloader()
        if self.batch_ramp() is not None:
            return self.ramp_dataloader()
        if self.train_dataset is None:
            return super().get_train_dataloader()  # Trainer's error

        def sampler(dataset):
            grouped = self.grouped_train_sampler(dataset)
            return grouped if grouped is not None else self._get_train_sampler(dataset)

        return self._get_dataloader(self.train_dataset, "Training", self._train_batch_size, sampler, is_training=True)

    def set_initial_training_values(self, args, dataloader):
        if self.batch_ramp() is not None:
            return self.ramp_training_values(args)
        return super().set_initial_training_values(args, dataloader)

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
                             trial):  # fmt: skip
        """Trainer's, with the resumed step's epoch placed by the ramp's plan, and a stream's finished run ended (see
        [`PRIVATE_OVERRIDES`])."""
        values = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if resume_from_checkpoint is None:
            return values
        if self.is_streaming() and self.state.global_step >= max_steps:
            return num_train_epochs, 0  # a finished run resumed: no epoch left
        if self.batch_ramp() is not None:
            return self.ramp_resume_position()
        return values

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """A checkpoint's own files (each rank's stream state, the agreed batch, the loss total) go in before Trainer's
        weights, so that `trainer_state.json` stays the last file written, the sign of a complete checkpoint (see
        [`checkpoint_problem`]); Trainer calls this on every rank."""
        folder = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call and os.path.basename(os.path.normpath(folder)) == checkpoint_name(self.state.global_step):
            os.makedirs(folder, exist_ok=True)
            self.write_stream_state(folder)
            self.write_agreed_batch_size(folder)
            self.write_loss_total(folder)
        return super().save_model(output_dir, _internal_call=_internal_call)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self.log_loss_terms(logs)
        self.correct_train_loss(logs)
        super().log(logs, start_time)

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

    def create_optimizer(self, model=None):
        """Trainer's optimizer, with each tower's parameters in groups of their own at `vision_tower_lr_scale` /
        `text_tower_lr_scale` times the learning rate (Trainer has one rate for every parameter; its scheduler then
        scales each group's own)."""
        made_here = self.optimizer is None  # not one passed in through `optimizers`, nor one already split
        optimizer = super().create_optimizer(model)
        scales = {role: getattr(self.args, f"{role}_tower_lr_scale", 1.0) for role in ("vision", "text")}
        scales = {role: scale for role, scale in scales.items() if scale != 1.0}
        if not scales or not made_here:
            return optimizer
        model = self.model if model is None else model
        base = getattr(model, model.base_model_prefix, model)
        for role, scale in scales.items():
            tower = getattr(base, f"{role}_model", None)
            if tower is None:
                raise ValueError(
                    f"{role}_tower_lr_scale={scale} sets the learning rate of a {role} tower, but "
                    f"{type(model).__name__} has no `{role}_model`."
                )
            ids = {id(p) for p in tower.parameters()}
            for group in list(optimizer.param_groups):
                own = [p for p in group["params"] if id(p) in ids]
                if own:
                    group["params"] = [p for p in group["params"] if id(p) not in ids]
                    optimizer.add_param_group({**group, "params": own, "lr": group["lr"] * scale})
        return optimizer

    def create_model_card(self, *args, **kwargs):
        """Trainer's own card would replace ours on `push_to_hub`; write ours instead."""
        if self.model_card_writer is not None and self.is_world_process_zero():
            self.model_card_writer(self)
        elif self.model_card_writer is None:
            super().create_model_card(*args, **kwargs)
