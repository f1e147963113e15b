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
micro-batch, without gradient. [`MMFusionTrainer`] runs this inside Trainer's accumulation loop; [`train_window`] is
the same without a Trainer.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..distributed import all_gather_with_grad, gather_sizes, world


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


def gather_embeddings(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every rank's rows of `x` (numbers of rows may differ), without gradient, and this rank's offset into them."""
    rows = [n for (n,) in gather_sizes(x)]
    with torch.no_grad():
        return all_gather_with_grad(x, rows), sum(rows[: world()[1]])


@torch.no_grad()
def embed(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2-normalised image and text embeddings of a batch, as `MMFusionForPretraining.forward` computes them."""
    encoded = model.mm_fusion.encode(**{k: batch[k] for k in ENCODE_KEYS if batch.get(k) is not None})
    return F.normalize(encoded.image_embeds, dim=-1), F.normalize(encoded.text_embeds, dim=-1)


def build_itc_cache(model, batches: Sequence[dict], autocast: Callable | None = None) -> ITCGradCache:
    """
    Step 1 for the micro-batches of one optimizer step on this rank (`model`: the unwrapped `MMFusionForPretraining`,
    in the mode it trains in): their embeddings without gradient, the full-batch ITC loss over every rank's, and its
    gradients. Every rank must call it with the same number of micro-batches. `autocast`: a context-manager factory
    for the no-grad passes (the one the training forward runs under).
    """
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
    all_images, offset = gather_embeddings(torch.cat(image_embeds))
    all_texts, _ = gather_embeddings(torch.cat(text_embeds))
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
        world_size=world()[0],
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


def train_window(model, batches: Sequence[dict], backward: Callable | None = None) -> torch.Tensor:
    """
    Without a Trainer: accumulate into `.grad` the gradients of one optimizer step over `batches` (this rank's
    micro-batches) with the gradient cache, back-propagating each micro-batch in turn. `model` is the (unwrapped)
    `MMFusionForPretraining`; `backward` defaults to `Tensor.backward`. Returns the loss to log (summed over
    micro-batches). Across ranks, average the gradients afterwards (or run it on a DDP-wrapped model's module under
    the usual `no_sync`).
    """
    backward = backward or torch.Tensor.backward
    cache = build_itc_cache(model, batches)
    total = torch.zeros((), device=cache.itc_loss.device)
    for index, batch in enumerate(batches):
        cache.restore_rng(index)
        outputs = model(**batch, return_loss=True)
        surrogate, logged = cached_micro_batch_loss(model, outputs, cache, index)
        del outputs
        backward(surrogate)
        total += logged
    return total


__all__ = [
    "ITCGradCache",
    "RNGState",
    "build_itc_cache",
    "cached_micro_batch_loss",
    "embed",
    "gather_embeddings",
    "train_window",
]
