"""
Run by tests/test_grad_cache.py under `torchrun --nproc_per_node 2` (gloo, CPU); its helpers are shared with the test.

Usage: torchrun --nproc_per_node 2 -m helpers.grad_cache_worker OUT_DIR (helpers.launch)

Every rank writes OUT_DIR/rank{r}.pt with:
- `itm`: per fusion direction, ITM on a global batch of 8 pairs, 4 per rank (the ranks' texts padded to different
  lengths): the hard negatives this rank's rows drew (global indices), the ITM loss averaged over ranks and its
  gradients averaged over ranks (as DDP would);
- `itc`: one `MMFusionTrainer` step with the ITC gradient cache, 2 micro-batches of 4 per rank (16 pairs), ITM off,
  no dropout: the logged loss and the (synchronised) gradients before the optimizer step;
- `itm_cache`: the same with ITM and dropout on (only checked to run and to agree across ranks).
"""

import os
import sys
import tempfile
from pathlib import Path

import torch
from transformers import TrainerCallback

from helpers.models import MMFusionModelTester
from mm_fusion import MMFusionForPretraining, MMFusionPretrainingLoss
from mm_fusion.training import MMFusionTrainer, MMFusionTrainingArguments


IMAGE_SIZE = 16


def tiny_config(dropout: float = 0.0, itm_loss_weight: float = 0.0, **kwargs):
    """hidden 32, 2-layer towers and fusion, 16 px images in 4 px patches (17 image tokens), 7 text tokens."""
    tester = MMFusionModelTester()
    tester.image_size = IMAGE_SIZE
    drop = {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    return tester.config(
        vision_config=tester.vision_config(patch_size=4, **drop),
        text_config=tester.text_config(**drop),
        fusion_dropout=dropout,
        classifier_dropout=dropout,
        itm_loss_weight=itm_loss_weight,
        **kwargs,
    )


def pairs(n: int, seed: int = 0) -> list[dict]:
    """n image-text pairs as a dataset of dicts (texts of different lengths, right-padded to 7 tokens)."""
    tester = MMFusionModelTester()
    tester.image_size = IMAGE_SIZE
    batch = tester.inputs(batch_size=n, seed=seed)
    return [{**{k: v[i] for k, v in batch.items()}, "image_rows": torch.tensor(i)} for i in range(n)]


def collate(samples: list[dict]) -> dict:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "image_rows"}


class Capture(TrainerCallback):
    """The RNG state at the first optimizer step's start and the gradients just before its update."""

    def __init__(self):
        self.rng_state = self.grads = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.rng_state is None:
            self.rng_state = torch.get_rng_state()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def train_one_step(model, samples, output_dir, batch_size: int, accumulation: int, grad_cache: bool, **extra):
    """One optimizer step of `MMFusionTrainer` over `samples` in order; returns (logs, capture, trainer)."""
    args = MMFusionTrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        learning_rate=0.0,
        warmup_steps=0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # no clipping: the gradients are compared as computed
        train_sampling_strategy="sequential",
        logging_steps=1,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        itc_grad_cache=grad_cache,
        **extra,
    )
    capture = Capture()
    trainer = MMFusionTrainer(
        model=model, args=args, train_dataset=samples, data_collator=collate, callbacks=[capture]
    )
    trainer.train()
    logs = next(h for h in trainer.state.log_history if "loss" in h)
    return logs, capture, trainer


def itm_batch() -> dict:
    """8 pairs; the last 4 texts at most 5 tokens long, so a rank holding only them pads to a shorter length."""
    batch = model_inputs(collate(pairs(8, seed=3)))
    batch["input_ids"][4:, 5:] = 0
    batch["attention_mask"][4:, 5:] = 0
    return batch


def itm_global_negatives(direction: str, world: int, rank: int) -> dict:
    config = tiny_config(dropout=0.0, itm_loss_weight=1.0, fusion_direction=direction)
    torch.manual_seed(0)
    model = MMFusionForPretraining(config).train()
    batch = itm_batch()
    per_rank = 8 // world
    shard = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in batch.items()}
    length = int(shard["attention_mask"].sum(1).max())  # each rank pads to its own longest text
    shard["input_ids"], shard["attention_mask"] = shard["input_ids"][:, :length], shard["attention_mask"][:, :length]
    drawn = []
    sample = model._hard_negatives

    def recording(*args, **kwargs):
        drawn.append(sample(*args, **kwargs))
        return drawn[-1]

    model._hard_negatives = recording
    torch.manual_seed(123)
    out = model(**shard, return_loss=True, loss_fn=MMFusionPretrainingLoss(rank=rank, world_size=world))
    out.itm_loss.backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    loss = out.itm_loss.detach().clone()
    for value in [loss, *grads.values()]:
        torch.distributed.all_reduce(value)
        value /= world
    return {"negatives": drawn[0], "itm_loss": loss, "grads": grads, "text_length": length}


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.distributed.init_process_group("gloo")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    result = {"world_size": world}
    result["itm"] = {d: itm_global_negatives(d, world, rank) for d in ("bidirectional", "text_to_image")}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = MMFusionForPretraining(tiny_config())
        result["initial"] = {k: v.clone() for k, v in model.state_dict().items()}
        cache = os.environ.get("MM_FUSION_DISABLE_GRAD_CACHE") != "1"  # see tests/test_grad_cache.py
        logs, capture, _ = train_one_step(model, pairs(16), tmp, batch_size=4, accumulation=2, grad_cache=cache)
        result["itc"] = {"logs": logs, "grads": capture.grads}
        torch.manual_seed(0)
        model = MMFusionForPretraining(tiny_config(dropout=0.1, itm_loss_weight=1.0))
        logs, capture, _ = train_one_step(model, pairs(16), tmp, batch_size=4, accumulation=2, grad_cache=True)
        result["itm_cache"] = {"logs": logs, "grads": capture.grads}
    torch.save(result, out_dir / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
