"""Run by tests/test_distributed_training.py under `torchrun --nproc_per_node 2 -m helpers.auto_batch_worker OUT TASK
LIMIT`: a tiny `scripts/train.py` run with `--auto_find_batch_size`, where rank 1 is given a simulated memory limit
(a training step on more than LIMIT pairs raises torch's out-of-memory error there). Every rank writes
OUT/rank{r}.json with the batch settings it trained with, the steps, the losses and a checksum of its final weights.
"""

import json
import os
import sys
from pathlib import Path

import torch

from helpers.distributed_train_worker import tiny_run_args
from mm_fusion.training import MMFusionTrainer, setup_run, train_and_save


def main() -> None:
    out_dir, task, limit = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    out_dir.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    compute_loss = MMFusionTrainer.compute_loss

    def limited_compute_loss(self, model, inputs, *args, **kwargs):
        if rank == 1 and len(inputs["input_ids"]) > limit:
            raise torch.OutOfMemoryError(f"simulated: more than {limit} pairs do not fit on rank 1")
        return compute_loss(self, model, inputs, *args, **kwargs)

    MMFusionTrainer.compute_loss = limited_compute_loss
    argv = tiny_run_args(str(out_dir / "run"), task, 16) + ["--auto_find_batch_size", "True"]
    trainer = setup_run(argv)
    train_and_save(trainer)
    model = trainer.accelerator.unwrap_model(trainer.model)
    record = {
        "found": trainer.agreed_batch_sizes,
        "per_device": trainer.args.per_device_train_batch_size,
        "accumulation": trainer.args.gradient_accumulation_steps,
        "steps": trainer.state.global_step,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "checksum": float(sum(p.double().sum() for p in model.state_dict().values())),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
