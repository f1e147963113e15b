"""
Gradient-cached image-text contrastive loss (the GradCache idea) for [`MMFusionForPretraining`] under gradient
accumulation: the ITC loss of one optimizer step sees every pair of its k micro-batches on all W ranks as negatives,
with the activation memory of one micro-batch.

1. [`build_itc_cache`]: embed the k micro-batches without gradient (recording the RNG state before each, so dropout
   can be replayed), gather the embeddings across ranks, compute the full-batch ITC loss on detached leaf copies and
   keep its gradient with respect to this rank's embeddings (and the temperature).
2. [`cached_micro_batch_loss`]: after re-running micro-batch j with gradient under its recorded RNG state
   ([`ITCGradCache.restore_rng`]), a surrogate whose backward adds that micro-batch's share of the full-batch gradient,
   plus its ITM loss / k.

ITC is exact: the summed parameter gradients equal those of one step over all k·B·W pairs. ITM is not: micro-batch
j's hard negatives come from micro-batch j across ranks (B·W candidates, by the similarity of the re-run's embeddings,
which equal the cached ones), and its loss is averaged over micro-batches. Cost: one extra forward of the towers per
micro-batch, without gradient. [`GradCacheMixin`] runs this inside Trainer's accumulation loop for
[`MMFusionTrainer`]; [`train_window`] is the same without a Trainer.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.utils import logging

from ..pretraining_loss import MMFusionPretrainingLoss
from .pretraining import PretrainingLossMixin


logger = logging.get_logger(__name__)


ENCODE_KEYS = ("pixel_values", "input_ids", "attention_mask", "token_type_ids")


@dataclass
class RNGState:
    """The torch RNG state a micro-batch's forward starts from: the CPU generator, and the CUDA one when in use."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None = None
    cuda_device: int | None = None

    @classmethod
    def capture(cls, device: torch.device | None = None) -> "RNGState":
        if device is not None and device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            return cls(torch.get_rng_state(), torch.cuda.get_rng_state(index), index)
        return cls(torch.get_rng_state())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.cuda_device)


@dataclass
class ITCGradCache:
    """
    What one optimizer step's micro-batches need for their backward: the gradient of the full-batch ITC loss (times
    `itc_loss_weight`) with respect to each micro-batch's normalised image / text embeddings and to the model's
    `logit_scale`, the RNG state before each micro-batch, and the loss itself.
    """

    image_grads: list[torch.Tensor]
    text_grads: list[torch.Tensor]
    logit_scale_grad: torch.Tensor | None
    rng_states: list[RNGState]
    itc_loss: torch.Tensor
    world_size: int

    @property
    def num_micro_batches(self) -> int:
        return len(self.image_grads)

    def restore_rng(self, index: int) -> None:
        """Put the RNG back where micro-batch `index`'s embedding pass started, so its dropout masks repeat."""
        self.rng_states[index].restore()


def gather_embeddings(x: torch.Tensor, loss_fn: MMFusionPretrainingLoss) -> tuple[torch.Tensor, int]:
    """Every rank's rows of `x` (numbers of rows may differ), without gradient, and this rank's offset into them."""
    rows = [n for (n,) in loss_fn.sizes(x)]
    with torch.no_grad():
        return loss_fn.gather(x, rows), sum(rows[: loss_fn.rank])


@torch.no_grad()
def embed(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2-normalised image and text embeddings of a batch, as `MMFusionForPretraining.forward` computes them."""
    encoded = model.mm_fusion.encode(**{k: batch[k] for k in ENCODE_KEYS if batch.get(k) is not None})
    return F.normalize(encoded.image_embeds, dim=-1), F.normalize(encoded.text_embeds, dim=-1)


def build_itc_cache(
    model, batches: Sequence[dict], autocast: Callable | None = None, loss_fn: MMFusionPretrainingLoss | None = None
) -> ITCGradCache:
    """
    Step 1 for the micro-batches of one optimizer step on this rank (`model`: the unwrapped `MMFusionForPretraining`,
    in the mode it trains in): their embeddings without gradient, the full-batch ITC loss over every rank's, and its
    gradients. Every rank must call it with the same number of micro-batches. `autocast`: a context-manager factory
    for the no-grad passes (the one the training forward runs under). `loss_fn`: the ranks to contrast across
    (default: those of the default process group).
    """
    loss_fn = MMFusionPretrainingLoss.from_process_group() if loss_fn is None else loss_fn
    device = next(model.parameters()).device
    rng_states, image_embeds, text_embeds = [], [], []
    for batch in batches:
        rng_states.append(RNGState.capture(device))
        if autocast is not None:
            with autocast():
                image, text = embed(model, batch)
        else:
            image, text = embed(model, batch)
        image_embeds.append(image.float())
        text_embeds.append(text.float())
    sizes = [len(x) for x in image_embeds]
    all_images, offset = gather_embeddings(torch.cat(image_embeds), loss_fn)
    all_texts, _ = gather_embeddings(torch.cat(text_embeds), loss_fn)
    all_images.requires_grad_(True)
    all_texts.requires_grad_(True)
    inputs = [all_images, all_texts]
    scale = model.logit_scale if model.logit_scale.requires_grad else None
    if scale is not None:
        inputs.append(scale)
    with torch.enable_grad():
        loss, _, _ = model.contrastive_loss(all_images, all_texts, gather=False)
        grads = torch.autograd.grad(model.config.itc_loss_weight * loss, inputs)
    mine = slice(offset, offset + sum(sizes))
    return ITCGradCache(
        image_grads=list(grads[0][mine].split(sizes)),
        text_grads=list(grads[1][mine].split(sizes)),
        logit_scale_grad=grads[2] if scale is not None else None,
        rng_states=rng_states,
        itc_loss=loss.detach(),
        world_size=loss_fn.world_size,
    )


def cached_micro_batch_loss(model, outputs, cache: ITCGradCache, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Step 2 for micro-batch `index`, given `outputs` of `model(**batch, return_loss=True)` run with gradient after
    `cache.restore_rng(index)` (their own `itc_loss`, over this micro-batch only, is ignored).

    Returns the surrogate to back-propagate (once per micro-batch, as is: gradients summed over the micro-batches and
    averaged over ranks, as DDP does, are those of `itc_loss_weight * ITC(all k·B·W pairs) + itm_loss_weight *
    mean_j ITM_j`) and the loss to log, whose sum over the micro-batches (averaged over ranks) is that loss.
    """
    config = model.config
    k = cache.num_micro_batches
    image_grad, text_grad = cache.image_grads[index], cache.text_grads[index]
    # DDP averages over ranks what is a sum over ranks of the embeddings' contributions: hence x world size.
    surrogate = cache.world_size * (
        (outputs.image_embeds.float() * image_grad).sum() + (outputs.text_embeds.float() * text_grad).sum()
    )
    if cache.logit_scale_grad is not None:  # the same full-batch gradient on every rank, a k-th per micro-batch
        surrogate = surrogate + (model.logit_scale * cache.logit_scale_grad).sum() / k
    logged = config.itc_loss_weight * cache.itc_loss / k
    if outputs.itm_loss is not None:
        surrogate = surrogate + config.itm_loss_weight * outputs.itm_loss / k
        logged = logged + config.itm_loss_weight * outputs.itm_loss.detach() / k
    return surrogate, logged


def train_window(
    model, batches: Sequence[dict], backward: Callable | None = None, loss_fn: MMFusionPretrainingLoss | None = None
) -> torch.Tensor:
    """
    Without a Trainer: accumulate into `.grad` the gradients of one optimizer step over `batches` (this rank's
    micro-batches) with the gradient cache, back-propagating each micro-batch in turn. `model` is the (unwrapped)
    `MMFusionForPretraining`; `backward` defaults to `Tensor.backward`. Returns the loss to log (summed over
    micro-batches). Across ranks, average the gradients afterwards (or run it on a DDP-wrapped model's module under
    the usual `no_sync`). `loss_fn`: the ranks to contrast across (default: those of the default process group).
    """
    backward = backward or torch.Tensor.backward
    loss_fn = MMFusionPretrainingLoss.from_process_group() if loss_fn is None else loss_fn
    cache = build_itc_cache(model, batches, loss_fn=loss_fn)
    total = torch.zeros((), device=cache.itc_loss.device)
    for index, batch in enumerate(batches):
        cache.restore_rng(index)
        outputs = model(**batch, return_loss=True, loss_fn=loss_fn)
        surrogate, logged = cached_micro_batch_loss(model, outputs, cache, index)
        del outputs
        backward(surrogate)
        total += logged
    return total


class GradCacheMixin(PretrainingLossMixin):
    """
    Trainer mixin for `itc_grad_cache` (pretraining with gradient accumulation): the ITC loss of each optimizer step
    contrasts all k·B·W pairs of its micro-batches on every rank, with exact gradients and one micro-batch's
    activation memory, inside Trainer's own accumulation loop. `get_batch_samples` keeps the micro-batches Trainer
    fetches for a step; `training_step` embeds them all without gradient at the step's first micro-batch
    ([`build_itc_cache`]), then trains each with its share of the full-batch gradient ([`cached_micro_batch_loss`]).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._window = None  # the micro-batches of the current optimizer step
        self._itc_cache = None
        self._grad_cache_warned = False

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Trainer fetches the micro-batches of each optimizer step up front; keep them for the ITC cache."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._window, self._itc_cache = batch_samples, None
        return batch_samples, num_items_in_batch

    def uses_grad_cache(self, model) -> bool:
        """`itc_grad_cache` acts for pretraining with gradient accumulation (k = 1 already gathers B·W negatives)."""
        if not (
            getattr(self.args, "itc_grad_cache", True)
            and self.args.gradient_accumulation_steps > 1
            and self._window is not None
            and len(self._window) > 1
            and self.is_pretraining(model)
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
        use_cache = self.uses_grad_cache(model)
        index = next((i for i, batch in enumerate(self._window or ()) if batch is inputs), None)
        if not use_cache or index is None:
            if use_cache and not self._grad_cache_warned:  # a Trainer that does not hand over the batches it fetched
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
                self._itc_cache = build_itc_cache(
                    unwrapped, batches, autocast=self.accelerator.autocast, loss_fn=self.pretraining_loss
                )
        cache = self._itc_cache
        inputs = self._prepare_inputs(inputs)
        cache.restore_rng(index)  # the same dropout masks as in the embedding pass
        with self.compute_loss_context_manager():
            outputs = model(**inputs, return_loss=True, loss_fn=self.pretraining_loss)
        surrogate, logged = cached_micro_batch_loss(unwrapped, outputs, cache, index)
        k = cache.num_micro_batches
        itm_loss = outputs.itm_loss / k if outputs.itm_loss is not None else None
        self.record_loss_terms(itc_loss=cache.itc_loss / k, itm_loss=itm_loss)
        del outputs, inputs
        # Scaled already (see `cached_micro_batch_loss`); undo the division by an accelerate accumulation plugin.
        self.accelerator.backward(surrogate * self.accelerator.gradient_accumulation_steps)
        if index == len(self._window) - 1:
            self._window = self._itc_cache = None
        return logged.detach()


__all__ = [
    "GradCacheMixin",
    "ITCGradCache",
    "RNGState",
    "build_itc_cache",
    "cached_micro_batch_loss",
    "embed",
    "gather_embeddings",
    "train_window",
]
