"""`--auto_find_batch_size` that every rank agrees on: [`AgreedBatchSizeMixin`], a unit of [`MMFusionTrainer`]."""

import json
import os

import torch
from transformers.utils import logging

from ..pretraining_loss import MMFusionPretrainingLoss


# Written into each checkpoint of an `--auto_find_batch_size` run: the per-device batch and accumulation the ranks
# agreed on, which a resumed run takes as they are.
AUTO_BATCH_FILE = "auto_batch_size.json"
# `--optim` values whose state is two tensors the size of each trained parameter (AdamW's moments), which the memory
# probe holds while it measures.
ADAM_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused")

logger = logging.get_logger(__name__)


class AgreedBatchSizeMixin:
    """
    Trainer mixin for `--auto_find_batch_size`. Trainer's own search runs in each process, halving the batch after an
    out-of-memory error there, so ranks with less free memory end up with other batch sizes (and a rank that runs out
    of memory inside a collective hangs the others). Here [`settle_batch_size`] (at `train`) finds the batch every
    rank can take ([`agree_on_batch_size`]), or on resume takes the one its checkpoint holds;
    [`write_agreed_batch_size`] writes it into each checkpoint.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.agreed_batch_sizes = None  # every rank's largest batch, when agree_on_batch_size ran

    def settle_batch_size(self, resume_from_checkpoint: str | None) -> None:
        """At `train`, with `--auto_find_batch_size`: the batch the resumed checkpoint holds, or the one every rank
        agrees on ([`agree_on_batch_size`])."""
        if not self.args.auto_find_batch_size:
            return
        saved = os.path.join(resume_from_checkpoint or "", AUTO_BATCH_FILE)
        if resume_from_checkpoint is not None and os.path.isfile(saved):
            with open(saved) as f:  # the batch the interrupted run agreed on, so the resume is exact
                self.apply_batch_size(**json.load(f))
        else:
            self.agree_on_batch_size()

    def try_batch_size(self, batch_size: int) -> bool:
        """
        Whether a training step on `batch_size` pairs of the training data fits in this process's memory: forward
        and backward as training runs them, under its mixed precision (accelerate's autocast, which `prepare` adds
        to the model's forward only when training starts) and with the optimizer's state held: two copies of each
        trained parameter for torch's AdamW (`ADAM_OPTIMIZERS`, Trainer's default; the state of another `--optim` is
        not held, so leave room for it). No optimizer step: the model's gradients and the RNG states are left as they
        were.
        """
        from accelerate.utils.memory import release_memory, should_reduce_batch_size

        rows = [self.train_dataset[i % len(self.train_dataset)] for i in range(batch_size)]
        inputs = self._prepare_inputs(self.data_collator(rows))
        if self.is_pretraining(self.model):  # the other ranks are measuring too: no collective (the ITC gather)
            inputs["loss_fn"] = MMFusionPretrainingLoss()
        cpu_rng = torch.get_rng_state()
        accelerator_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        if not hasattr(self, "current_gradient_accumulation_steps"):
            self.current_gradient_accumulation_steps = 1  # read by compute_loss; Trainer sets it in its loop
        copies = 2 if self.args.optim in ADAM_OPTIMIZERS else 0  # exp_avg and exp_avg_sq
        optimizer_state = []
        try:
            trained = [p for p in self.model.parameters() if p.requires_grad]
            optimizer_state.extend(torch.empty_like(p) for p in trained for _ in range(copies))
            self.model.train()
            with self.accelerator.autocast(), self.compute_loss_context_manager():  # as training_step's forward
                loss = self.compute_loss(self.model, inputs)
            loss.backward()
            return True
        except Exception as err:
            if isinstance(err, torch.OutOfMemoryError) or should_reduce_batch_size(err):
                return False
            raise
        finally:
            self.model.zero_grad(set_to_none=True)
            inputs = loss = None
            optimizer_state.clear()
            release_memory()
            torch.set_rng_state(cpu_rng)
            if accelerator_rng is not None:
                torch.cuda.set_rng_state_all(accelerator_rng)

    def agree_on_batch_size(self) -> int:
        """
        Each rank halves `per_device_train_batch_size` until [`try_batch_size`] fits, before any collective training
        step; the smallest over the ranks wins, and gradient accumulation grows to keep the global batch (per-device x
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
        self.apply_batch_size(agreed, accumulation, every)
        return agreed

    def apply_batch_size(self, per_device: int, accumulation: int, found: list[int]) -> None:
        args = self.args
        args.per_device_train_batch_size = per_device
        args.gradient_accumulation_steps = accumulation
        self.accelerator.gradient_accumulation_steps = accumulation
        self._train_batch_size = args.train_batch_size  # Trainer's loader reads it; it has no public setter
        args.auto_find_batch_size = False  # Trainer's own per-process search would let the ranks drift apart again
        self.agreed_batch_sizes = found

    def write_agreed_batch_size(self, folder: str) -> None:
        """The agreed batch, into the checkpoint `folder`, for a resumed run to take as it is."""
        if self.args.should_save and self.agreed_batch_sizes is not None:
            batch = {"per_device": self.args.per_device_train_batch_size,
                     "accumulation": self.args.gradient_accumulation_steps}  # fmt: skip
            with open(os.path.join(folder, AUTO_BATCH_FILE), "w") as f:
                json.dump({**batch, "found": self.agreed_batch_sizes}, f)
