"""Run by tests/test_distributed_training.py under `torchrun --nproc_per_node N`: a tiny `scripts/train.py` run.

Usage: torchrun --nproc_per_node N -m helpers.distributed_train_worker OUT_DIR TASK PER_DEVICE_BATCH (helpers.launch)

TASK `pretrain-local` is `pretrain` with the cross-rank gather of the contrastive features switched off (each rank's
loss only sees its own batch): the control that shows the comparison can fail. TASK `vqa-lora` is `vqa` with LoRA
adapters (`--lora`, on both towers and the fusion block, gradient checkpointing on as `--lora` sets it).

With MM_FUSION_DECODE_LOG set, every image decode appends the decoding rank to that file.

Every rank writes OUT_DIR/rank{r}.pt with its final weights, the training losses Trainer logged (averaged over the
ranks) and the number of evaluation predictions `compute_metrics` saw, with the metrics.
"""

import os
import sys
from pathlib import Path

import torch

from mm_fusion.training import setup_run, train_and_save


def tiny_run_args(output_dir: str, task: str, batch_size: int) -> list[str]:
    """A few optimizer steps of a tiny, dropout-free model on 32 easy-VQA pairs, in a fixed (sequential) order."""
    return [
        "--task", task,
        "--output_dir", output_dir,
        "--max_train_samples", "32",
        "--max_eval_samples", "13",  # not a multiple of ranks x batch: the last batch gets padded duplicates
        "--per_device_train_batch_size", str(batch_size),
        "--per_device_eval_batch_size", "4",
        "--num_train_epochs", "2",
        "--train_sampling_strategy", "sequential",
        "--vision_tower", "vit",  # no BatchNorm: each rank's statistics would differ from one process's
        "--image_size", "32",
        "--patch_size", "16",
        "--hidden_size", "32",
        "--num_attention_heads", "2",
        "--vision_layers", "1",
        "--text_layers", "1",
        "--fusion_layers", "1",
        "--fusion_type", "cross_attention" if task != "pretrain" else "late",
        "--itm_loss_weight", "0",  # ITM negatives are drawn within each rank's batch; ITC is the gathered loss
        "--dropout", "0",
        "--learning_rate", "1e-3",
        "--warmup_steps", "0",
        "--lr_scheduler_type", "constant",
        "--logging_steps", "1",
        "--eval_strategy", "no",
        "--save_strategy", "no",
        "--seed", "0",
        "--disable_tqdm", "True",
    ]  # fmt: skip


def count_decodes(log: str) -> None:
    """Append this process's rank to `log` on every image decode (the cache's and the processor's function)."""
    import mm_fusion.data.preprocessing as preprocessing
    import mm_fusion.image_processing_mm_fusion as image_processing

    load_image = image_processing.load_image

    def counting_load_image(*args, **kwargs):
        with open(log, "a") as f:
            f.write(os.environ["RANK"] + "\n")
        return load_image(*args, **kwargs)

    image_processing.load_image = counting_load_image
    preprocessing.load_image = counting_load_image  # what the cache's image map calls


def main() -> None:
    out_dir, task, batch_size = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    if os.environ.get("MM_FUSION_DECODE_LOG"):
        count_decodes(os.environ["MM_FUSION_DECODE_LOG"])
    if task == "pretrain-local":
        from mm_fusion import MMFusionForPretraining, MMFusionPretrainingLoss

        # The control: ITC scores each rank's own pairs only (its features are not gathered).
        contrastive_logits = MMFusionForPretraining._contrastive_logits
        MMFusionForPretraining._contrastive_logits = lambda self, image, text, loss_fn: contrastive_logits(
            self, image, text, MMFusionPretrainingLoss()
        )
        task = "pretrain"
    lora = ["--lora", "--lora_parts", "vision,text,fusion", "--lora_r", "4"] if task == "vqa-lora" else []
    task = task.removesuffix("-lora")
    trainer = setup_run(tiny_run_args(str(out_dir / "run"), task, batch_size) + lora)
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    seen = []
    compute_metrics = trainer.compute_metrics

    def counting_compute_metrics(prediction):
        seen.append(len(prediction.label_ids))
        return compute_metrics(prediction)

    trainer.compute_metrics = counting_compute_metrics
    results = train_and_save(trainer)
    rank = int(os.environ.get("RANK", "0"))
    model = trainer.accelerator.unwrap_model(trainer.model)
    torch.save(
        {
            "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "initial_state_dict": initial,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "eval_predictions": seen,
            "results": {k: v for k, v in results.items() if isinstance(v, (int, float))},
            "world_size": trainer.args.world_size,
        },
        out_dir / f"rank{rank}.pt",
    )


if __name__ == "__main__":
    main()
