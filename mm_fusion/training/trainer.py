"""`Trainer` for MMFusion: the stock one, with a unit (a mixin in its feature's module) for each thing it adds."""

import contextlib

from transformers import Trainer

from .batch_ramp import BatchRampMixin
from .batch_size import AgreedBatchSizeMixin
from .checkpoints import ExactLoadingMixin, ResumedLossMixin, SaveOnEachNodeMixin, resolve_resume_checkpoint
from .grad_cache import GradCacheMixin
from .pretraining import PretrainingLossMixin
from .sampler import GroupedSamplingMixin
from .streaming import StreamingLoaderMixin


class MMFusionTrainer(
    StreamingLoaderMixin,
    AgreedBatchSizeMixin,
    GradCacheMixin,
    PretrainingLossMixin,
    BatchRampMixin,
    GroupedSamplingMixin,
    ResumedLossMixin,
    ExactLoadingMixin,
    SaveOnEachNodeMixin,
    Trainer,
):
    """
    [`Trainer`] with what the stock one lacks or gets wrong for these models. Each feature is one unit, and each
    override belongs to one unit:

    - [`StreamingLoaderMixin`] (`streaming.py`): a streaming training set, resumed exactly: `train`,
      `get_train_dataloader`, `_save_checkpoint`, `_init_training_state`;
    - [`AgreedBatchSizeMixin`] (`batch_size.py`): `--auto_find_batch_size` that every rank agrees on: `train`,
      `_save_checkpoint`;
    - [`GradCacheMixin`] (`grad_cache.py`): `itc_grad_cache`, every micro-batch's pairs as ITC negatives:
      `get_batch_samples`, `training_step`;
    - [`PretrainingLossMixin`] (`pretraining.py`): pretraining's ITC / ITM terms in the logs, and its evaluation:
      `train`, `compute_loss`, `log`, `evaluation_loop`, `prediction_step`;
    - [`BatchRampMixin`] (`batch_ramp.py`): the batch-size ramp: `get_train_dataloader`, `set_initial_training_values`,
      `create_scheduler`, `_init_training_state`, `_run_epoch`;
    - [`GroupedSamplingMixin`] (`sampler.py`): image-grouped and resumable length-grouped batches:
      `_get_train_sampler`;
    - [`ResumedLossMixin`] (`checkpoints.py`): the whole run's mean `train_loss` after a resume: `train`,
      `_save_checkpoint`, `log`;
    - [`ExactLoadingMixin`] (`checkpoints.py`): exact weight loading on resume and for the best model:
      `_load_from_checkpoint`, `_load_best_model`;
    - [`SaveOnEachNodeMixin`] (`checkpoints.py`): the weights on every node's disk with `save_on_each_node`: `_save`;
    - this class: `resume_from_checkpoint=True` as the newest complete checkpoint (`train`), `eval_data_collator` for
      evaluation and prediction (`get_eval_dataloader`, `get_test_dataloader`), `vision_tower_lr_scale` /
      `text_tower_lr_scale` (`create_optimizer`), and `model_card_writer`, which writes our card, on `push_to_hub` too
      (`create_model_card`).

    A private method is overridden only where Trainer has no public hook at that point; each unit says why. Everything
    else (mixed precision, accumulation, checkpoint writing, `gather_for_metrics`, RNG and data-order restoring) is
    Trainer's.
    """

    def __init__(self, *args, model_card_writer=None, eval_data_collator=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_card_writer = model_card_writer
        self.eval_data_collator = eval_data_collator

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        if resume_from_checkpoint is True:  # Trainer's own "the last one", made the newest complete one here
            resume_from_checkpoint = resolve_resume_checkpoint("last", self.args.output_dir)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

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
