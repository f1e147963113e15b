"""`Trainer` for MMFusion: the stock one, with image-grouped batches, retrieval evaluation and exact resumption."""

import json
import os

import torch
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .checkpoints import load_checkpoint_weights
from .sampler import MMFusionImageGroupedSampler, MMFusionLengthGroupedSampler


# Written into each checkpoint: the sum of every optimizer step's training loss up to it, so that a resumed run
# reports the mean over the whole run (Trainer's `train_loss` averages only the steps of the current `train()` call).
LOSS_TOTAL_FILE = "train_loss_total.json"


class MMFusionTrainer(Trainer):
    """
    [`Trainer`] with what the stock one lacks or gets wrong for these models:

    - `group_by_image` (from [`MMFusionTrainingArguments`]): batches hold the pairs of a few images
      ([`MMFusionImageGroupedSampler`]), which the collator delivers once each;
    - `train_sampling_strategy="group_by_length"` with an order seeded by the epoch
      ([`MMFusionLengthGroupedSampler`]), so that a resumed run draws the interrupted run's batches;
    - `eval_data_collator`: a collator for evaluation and prediction (the training one may augment);
    - evaluation of [`MMFusionForPretraining`]: the loss (ITC + ITM) and, as predictions, the image and text
      embeddings with each pair's image row as label, for retrieval Recall@K in `compute_metrics`;
    - exact weight loading on resume and for `load_best_model_at_end` ([`load_checkpoint_weights`]): Trainer loads
      with `strict=False` and without the key renaming of `from_pretrained`, so a ViT tower saved under its legacy
      key names silently stayed at its random initialisation; a missing or unexpected key is now an error;
    - after a resume, `train_loss` is the mean over every step of the run, not only the resumed ones.

    Everything else (mixed precision, accumulation, checkpoint writing, `gather_for_metrics`, RNG and data-order
    restoring) is Trainer's.
    The model card is written by `mm_fusion.training.write_model_card` (`model_card_writer`), also on `push_to_hub`.
    """

    def __init__(self, *args, model_card_writer=None, eval_data_collator=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_card_writer = model_card_writer
        self.eval_data_collator = eval_data_collator
        self.resumed_from_step = None  # the global step of the checkpoint a run resumed from
        self._resumed_loss_sum = None  # and its summed step losses

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        self.resumed_from_step = self._resumed_loss_sum = None
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
        if self.args.should_save:
            # Trainer drains the losses of logged steps into `_total_loss_scalar`; `_tr_loss` holds the rest.
            total = (self._resumed_loss_sum or 0.0) + self._total_loss_scalar + self._tr_loss.item()
            folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder = os.path.join(self._get_output_dir(trial=trial), folder)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, LOSS_TOTAL_FILE), "w") as f:
                json.dump({"train_loss_sum": total, "global_step": self.state.global_step}, f)
        super()._save_checkpoint(model, trial)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "train_loss" in logs and self._resumed_loss_sum is not None:
            # In place: the same dict is `train()`'s returned metrics.
            steps = self.state.global_step - self.resumed_from_step  # this session's, which Trainer averaged over
            logs["train_loss"] = (self._resumed_loss_sum + logs["train_loss"] * steps) / max(self.state.global_step, 1)
        super().log(logs, start_time)

    def _get_dataloader(self, dataset, description, batch_size, sampler_fn=None, is_training=False, **kwargs):
        """Evaluation and prediction use `eval_data_collator` when given (e.g. the training one augments)."""
        if is_training or self.eval_data_collator is None:
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, **kwargs)
        train_collator, self.data_collator = self.data_collator, self.eval_data_collator
        try:
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, **kwargs)
        finally:
            self.data_collator = train_collator

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        seed = self.args.data_seed or self.args.seed

        def column(name):  # read at once: iterating `dataset[name]` formats row by row (~0.9 s for easy-VQA)
            return dataset.with_format("numpy", columns=[name])[:][name].tolist()

        if getattr(self.args, "group_by_image", False):
            group_size = getattr(self.args, "image_group_size", None)
            return MMFusionImageGroupedSampler(column("image_index"), seed=seed, group_size=group_size)
        length_column = self.args.length_column_name
        if self.args.train_sampling_strategy == "group_by_length" and length_column in dataset.column_names:
            batch_size = self.args.train_batch_size * self.args.gradient_accumulation_steps
            return MMFusionLengthGroupedSampler(batch_size, column(length_column), seed=seed)
        return super()._get_train_sampler(train_dataset)

    def _is_pretraining(self, model) -> bool:
        return type(self.accelerator.unwrap_model(model)).__name__ == "MMFusionForPretraining"

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if not self._is_pretraining(model):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            outputs = model(**inputs, return_loss=True)
        loss = outputs.loss.detach()
        if prediction_loss_only:
            return loss, None, None
        return loss, (outputs.image_embeds.detach(), outputs.text_embeds.detach()), inputs["image_rows"]

    def create_model_card(self, *args, **kwargs):
        """Trainer's own card would replace ours on `push_to_hub`; write ours instead."""
        if self.model_card_writer is not None and self.is_world_process_zero():
            self.model_card_writer(self)
        elif self.model_card_writer is None:
            super().create_model_card(*args, **kwargs)
