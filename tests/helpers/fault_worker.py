"""Run by tests/test_faults.py: a `scripts/train.py` run (`mm_fusion.training.setup_run` and `train_and_save`), with a
fault injected and every training batch recorded.

Usage: python -m helpers.fault_worker RECORD FAULT [scripts/train.py arguments ...]   (also under torchrun; see
helpers.launch)

FAULT is `none` or `ACTION@STEP[:RANK]` (RANK: every rank when left out), ACTION one of
- `kill`: SIGKILL this process at the end of optimizer step STEP (a preempted machine, the OOM killer);
- `stop`: SIGSTOP it there (a stalled rank: alive, but it answers nothing);
- `raise`: raise a RuntimeError there (a crash in one rank).

RECORD gets one json line per training micro-batch, written before its forward pass: `{"step": the optimizer step it
belongs to, "ids": the sample ids the batch carries}`; under torchrun, each rank writes RECORD.rank{r}. The fault's
wall-clock time (`time.time()`) goes to RECORD.fault just before it strikes.
"""

import json
import logging
import os
import signal
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record
from transformers import TrainerCallback

from mm_fusion.training import setup_run, train_and_save


class InjectFault(TrainerCallback):
    def __init__(self, fault: str, rank: int, stamp: str):
        action, _, where = fault.partition("@")
        step, _, on_rank = where.partition(":")
        self.action, self.step = action, int(step)
        self.active = on_rank == "" or int(on_rank) == rank
        self.rank, self.stamp = rank, stamp

    def on_step_end(self, args, state, control, **kwargs):
        if not (self.active and state.global_step == self.step):
            return
        with open(self.stamp, "w") as f:
            f.write(str(time.time()))
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise RuntimeError(f"injected failure at step {self.step} on rank {self.rank}")


@record  # as scripts/train.py: under torchrun a failing rank's error is reported with the run's summary
def main() -> None:
    record_path, fault, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    stamp = f"{record_path}.fault"
    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        record_path = f"{record_path}.rank{rank}"
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)  # as train.py
    trainer = setup_run(argv)
    log = open(record_path, "a")
    compute_loss = trainer.compute_loss

    def recording_compute_loss(model, inputs, *rest, **kwargs):
        if model.training:
            line = {"step": trainer.state.global_step + 1, "ids": list(inputs["sample_ids"])}
            log.write(json.dumps(line) + "\n")
            log.flush()  # in the OS's hands before a SIGKILL
        return compute_loss(model, inputs, *rest, **kwargs)

    trainer.compute_loss = recording_compute_loss
    if fault != "none":
        trainer.add_callback(InjectFault(fault, rank, stamp))
    train_and_save(trainer)


if __name__ == "__main__":
    main()
