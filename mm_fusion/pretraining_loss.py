"""
The ITC + ITM loss of `MMFusionForPretraining` over the ranks of a run, as open_clip's `ClipLoss`: told the rank and
the world size, it gathers every rank's features with their gradient. Imported by `modeling_mm_fusion.py` with a
relative import, so a saved directory carries it for `trust_remote_code` loading.
"""

import torch

from .distributed import all_gather_with_grad, gather_sizes, world


class MMFusionPretrainingLoss:
    r"""
    The ITC + ITM loss of [`MMFusionForPretraining`] and what it sees of the run, as open_clip's `ClipLoss`: told the
    process's `rank` and the `world_size`, it scores each rank's pairs against every rank's (features all-gathered
    with their gradient) and draws the ITM negatives from the global batch with a seed shared by the ranks. The
    default, `world_size=1`, is this process's batch alone: no collective, whatever process group exists.
    `MMFusionTrainer` passes one told the run's ranks; a model called without one never touches a process group.

    Example (in each process of a `torch.distributed` run):

    ```python
    >>> rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    >>> loss_fn = MMFusionPretrainingLoss(rank=rank, world_size=world_size)
    >>> out = model(**batch, return_loss=True, loss_fn=loss_fn)
    ```
    """

    def __init__(self, rank: int = 0, world_size: int = 1):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"MMFusionPretrainingLoss needs 0 <= rank < world_size, got rank {rank}, world_size {world_size}."
            )
        self.rank, self.world_size = rank, world_size

    @classmethod
    def from_process_group(cls) -> "MMFusionPretrainingLoss":
        """Told the rank and size of the default process group (a single process without one)."""
        world_size, rank = world()
        return cls(rank=rank, world_size=world_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    def __call__(self, model, encoded, attention_mask, image_embeds, text_embeds, fusion_kwargs) -> tuple:
        """`model`'s loss on this rank's pairs: `(loss, itc_loss, itm_loss, logits_per_image, logits_per_text,
        itm_logits, fused)` (the ITM fields `None` with `itm_loss_weight=0`)."""
        config = model.config
        itc_loss, logits_per_image, logits_per_text = model.contrastive_loss(image_embeds, text_embeds, loss_fn=self)
        loss = config.itc_loss_weight * itc_loss
        itm_loss = itm_logits = fused = None
        if config.itm_loss_weight > 0:
            itm_loss, itm_logits, fused = model._itm(
                encoded, attention_mask, image_embeds, text_embeds, fusion_kwargs, loss_fn=self
            )
            loss = loss + config.itm_loss_weight * itm_loss
        return loss, itc_loss, itm_loss, logits_per_image, logits_per_text, itm_logits, fused

    def gather(self, x: torch.Tensor, rows: list[int] | None = None, length: int | None = None) -> torch.Tensor:
        """Every rank's `x` along dim 0, in rank order, with its gradient ([`all_gather_with_grad`]); `x` alone in a
        world of one."""
        return x if self.world_size == 1 else all_gather_with_grad(x, rows, length)

    def sizes(self, x: torch.Tensor, dims: int = 1) -> list[tuple[int, ...]]:
        """Every rank's `x.shape[:dims]`, in rank order."""
        return [tuple(x.shape[:dims])] if self.world_size == 1 else gather_sizes(x, dims)

    def shared_seed(self, device: torch.device) -> int:
        """A seed drawn from the global torch RNG, rank 0's on every rank."""
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        if self.world_size > 1:
            seed = seed.to(device)
            torch.distributed.broadcast(seed, src=0)
        return int(seed.item())

    def itm_inputs(
        self,
        image_features: list[torch.Tensor],
        text_features: list[torch.Tensor],
        attention_mask: torch.Tensor | None,
        image_embeds: torch.Tensor,
        text_embeds: torch.Tensor,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None, torch.Tensor, torch.Tensor, int]:
        """
        The global batch ITM draws negatives from: every rank's tower features and text masks, all-gathered with
        their gradient (texts zero-padded to the longest length of any rank, batches of any size), the normalised
        embeddings (without gradient), and this rank's offset into them. The inputs themselves in a world of one.
        """
        if self.world_size == 1:
            return image_features, text_features, attention_mask, image_embeds, text_embeds, 0
        sizes = self.sizes(text_features[0], dims=2)  # (B, T) of every rank
        rows, length = [B for B, _ in sizes], max(T for _, T in sizes)
        if attention_mask is None:
            B, T = text_features[0].shape[:2]
            attention_mask = torch.ones(B, T, dtype=torch.long, device=text_features[0].device)
        with torch.no_grad():
            all_image_embeds = self.gather(image_embeds, rows)
            all_text_embeds = self.gather(text_embeds, rows)
        return (
            [self.gather(f, rows) for f in image_features],
            [self.gather(f, rows, length) for f in text_features],
            self.gather(attention_mask, rows, length),
            all_image_embeds,
            all_text_embeds,
            sum(rows[: self.rank]),
        )


__all__ = ["MMFusionPretrainingLoss"]
