"""`Trainer` for MMFusion: the stock one, with image-grouped batches and retrieval evaluation for pretraining."""

import torch
from transformers import Trainer

from .sampler import MMFusionImageGroupedSampler


class MMFusionTrainer(Trainer):
    """
    [`Trainer`] with three additions the stock one lacks:

    - `group_by_image` (from [`MMFusionTrainingArguments`]): batches hold the pairs of a few images
      ([`MMFusionImageGroupedSampler`]), which the collator delivers once each;
    - `eval_data_collator`: a collator for evaluation and prediction (the training one may augment);
    - evaluation of [`MMFusionForPretraining`]: the loss (ITC + ITM) and, as predictions, the image and text
      embeddings with each pair's image row as label, for retrieval Recall@K in `compute_metrics`.

    Everything else (mixed precision, accumulation, checkpointing, `gather_for_metrics`, resuming) is Trainer's.
    The model card is written by `mm_fusion.training.write_model_card` (`model_card_writer`), also on `push_to_hub`.
    """

    def __init__(self, *args, model_card_writer=None, eval_data_collator=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_card_writer = model_card_writer
        self.eval_data_collator = eval_data_collator

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
        if getattr(self.args, "group_by_image", False):
            dataset = train_dataset if train_dataset is not None else self.train_dataset
            seed = self.args.data_seed or self.args.seed
            group_size = getattr(self.args, "image_group_size", None)
            return MMFusionImageGroupedSampler(dataset["image_index"], seed=seed, group_size=group_size)
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
