"""[`MMFusionTrainer`]'s unit for [`MMFusionForPretraining`]: its loss terms in the logs, and its evaluation."""

import torch

from ..pretraining_loss import MMFusionPretrainingLoss
from .checkpoints import is_peft_model


# The pretraining loss terms logged next to the loss (training) and `eval_loss` (evaluation).
LOSS_COMPONENTS = ("itc_loss", "itm_loss")


class PretrainingLossMixin:
    """
    Trainer mixin for [`MMFusionForPretraining`]:

    - training logs carry `itc_loss` / `itm_loss` next to `loss`, each the mean over the logged steps and the ranks
      (`compute_loss` records a micro-batch's terms, [`record_loss_terms`] sums them, [`log_loss_terms`] reports them);
    - evaluation gives the loss (ITC + ITM, as in training), `eval_itc_loss` / `eval_itm_loss` averaged as Trainer
      averages the loss (`evaluation_loop`), and, as predictions, the image and text embeddings with each pair's image
      row as label, for retrieval Recall@K in `compute_metrics` (`prediction_step`).

    Other models go through Trainer's own methods unchanged.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._train_components = {}  # summed ITC / ITM terms of the steps since the last log, scaled as the loss
        self._components_since_step = 0
        self._eval_components = None  # per-sample ITC / ITM losses of the running evaluation

    @property
    def pretraining_loss(self) -> MMFusionPretrainingLoss:
        """The ITC + ITM loss told this run's ranks: what `compute_loss`, evaluation and the gradient cache pass the
        model (`MMFusionForPretraining.forward`'s `loss_fn`)."""
        return MMFusionPretrainingLoss(rank=self.args.process_index, world_size=self.args.world_size)

    def is_pretraining(self, model) -> bool:
        model = self.accelerator.unwrap_model(model)
        if is_peft_model(model):  # a LoRA run (--lora): the head is the wrapped model's
            model = model.get_base_model()
        return type(model).__name__ == "MMFusionForPretraining"

    def record_loss_terms(self, **terms) -> None:
        """Accumulate a micro-batch's loss terms, each already scaled as its share of the step's loss."""
        if not self._train_components:
            self._components_since_step = self.state.global_step
        for name, value in terms.items():
            if value is not None:
                self._train_components[name] = self._train_components.get(name, 0) + value.detach().float()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        pretraining = self.is_pretraining(model)
        if pretraining and "loss_fn" not in inputs:  # one given (the batch-size probe's, of one rank) is kept
            inputs = {**inputs, "loss_fn": self.pretraining_loss}
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training and pretraining:
            k = self.current_gradient_accumulation_steps  # Trainer divides the loss by it
            terms = {name: getattr(outputs, name, None) for name in LOSS_COMPONENTS}
            self.record_loss_terms(**{name: v / k if v is not None else None for name, v in terms.items()})
        return (loss, outputs) if return_outputs else loss

    def reset_loss_terms(self) -> None:
        """At `train`: terms recorded before (by the batch-size probe of `--auto_find_batch_size`) are not the first
        logged step's."""
        self._train_components = {}

    def log_loss_terms(self, logs: dict[str, float]) -> None:
        """At `log`: the terms recorded since the last log, averaged over the steps and the ranks."""
        if "loss" in logs and self._train_components:
            # Every rank logs here (Trainer gathers the loss just before), so the mean over ranks is safe to take.
            steps = max(self.state.global_step - self._components_since_step, 1)
            for name, total in self._train_components.items():
                logs[name] = self.accelerator.reduce(total.detach().clone(), reduction="mean").item() / steps
            self._train_components = {}

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        """Adds `{prefix}_itc_loss` / `{prefix}_itm_loss` for pretraining, averaged as Trainer averages the loss."""
        pretraining = self.is_pretraining(self.model)
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
        if not self.is_pretraining(model):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            outputs = model(**inputs, return_loss=True, loss_fn=self.pretraining_loss)
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
