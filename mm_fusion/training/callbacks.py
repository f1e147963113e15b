"""
The callbacks of a training run: the monitor (throughput, time spent waiting for data, peak memory and MFU, logged with
Trainer's logs) and, where the output is a file rather than a terminal, progress as log lines instead of bars.
"""

import logging
import math
import resource
import sys
import time
from typing import TextIO

import datasets
import torch
from accelerate.utils import send_to_device
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.utils import is_in_notebook
from transformers.utils import logging as hf_logging


logger = logging.getLogger(__name__)
# The progress lines are part of the story of the run, which scripts/train.py and run.py tell under this name.
progress_logger = logging.getLogger("mm_fusion.train")

# Dense bf16/fp16 tensor-core peaks (TFLOP/s, no sparsity), from the vendors' data sheets; matched by device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0, "V100": 125.0}


def peak_tflops(device_name: str) -> float | None:
    """Peak dense half-precision TFLOP/s of a known accelerator, from its name; `None` when unknown."""
    for key, value in PEAK_TFLOPS.items():
        if key in device_name:
            return value
    return None


class MMFusionMonitorCallback(TrainerCallback):
    """
    Adds to every log, for the steps since the previous log: `samples_per_second`, `data_wait_fraction` (the share
    of wall time the training loop spent waiting for its next batch: between the end of one optimizer step and the
    start of the next, minus logging, evaluation and checkpointing), `peak_memory_gb` (the CUDA allocator's peak on
    GPU, the process's peak RSS on CPU) and, on a GPU whose peak FLOP/s is known, `mfu` (model FLOPs utilisation
    from Trainer's FLOP count, see `MMFusionPreTrainedModel.floating_point_ops`). Warns when the data wait exceeds
    `data_wait_warning` (the input pipeline, not the model, is then the bottleneck). Every evaluation's log gets
    `elapsed_seconds`: wall time since this `train()` call began, evaluations included (time-to-accuracy curves).

    The numbers go into the `logs` dict, so every `report_to` backend and the console see them, provided this
    callback runs before the reporting ones: add it with [`add_monitor`].

    Args:
        data_wait_warning (`float`, *optional*, defaults to 0.2):
            Warn when the data wait fraction of a logging interval is above this.
        peak_tflops (`float`, *optional*):
            Peak TFLOP/s of one device for the MFU; by default looked up from the CUDA device name.
    """

    def __init__(self, data_wait_warning: float = 0.2, peak_tflops: float | None = None):
        self.data_wait_warning = data_wait_warning
        self.peak = peak_tflops
        self._reset(time.perf_counter(), 0, 0.0)
        self._last_event = None
        self._train_start = None

    def _reset(self, now: float, step: int, flos: float) -> None:
        self._window_start, self._window_step, self._window_flos = now, step, flos
        self._wait = 0.0
        self._excluded = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            if self.peak is None:
                self.peak = peak_tflops(torch.cuda.get_device_name())
        self._reset(time.perf_counter(), state.global_step, state.total_flos)
        self._last_event = self._train_start = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        # The batches of this optimizer step were fetched just before this call, after the previous step ended.
        now = time.perf_counter()
        if self._last_event is not None:
            self._wait += now - self._last_event
        self._last_event = None

    def on_step_end(self, args, state, control, **kwargs):
        self._last_event = time.perf_counter()

    def _pause(self) -> None:
        """Evaluation, saving: not data wait, and not part of the training throughput."""
        now = time.perf_counter()
        if self._last_event is not None:
            self._excluded += now - self._last_event
            self._last_event = now

    on_evaluate = on_save = lambda self, *args, **kwargs: self._pause()  # noqa: E731

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if logs is not None and self._train_start is not None and any(k.startswith("eval_") for k in logs):
            logs["elapsed_seconds"] = round(time.perf_counter() - self._train_start, 1)
            self._keep_in_history(state, logs)
        if logs is None or "loss" not in logs:  # only training logs; evaluation logs have their own timings
            return
        now = time.perf_counter()
        steps = state.global_step - self._window_step
        elapsed = now - self._window_start - self._excluded
        if steps <= 0 or elapsed <= 0:
            return
        batch = (state.train_batch_size or args.per_device_train_batch_size) * args.gradient_accumulation_steps
        logs["samples_per_second"] = round(steps * batch * args.world_size / elapsed, 2)
        wait = self._wait / elapsed
        logs["data_wait_fraction"] = round(wait, 4)
        if torch.cuda.is_available():
            logs["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        else:
            logs["peak_memory_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
        if self.peak and state.total_flos > self._window_flos and torch.cuda.is_available():
            achieved = (state.total_flos - self._window_flos) / elapsed  # summed over ranks by Trainer
            logs["mfu"] = round(achieved / (self.peak * 1e12 * args.world_size), 4)
        if wait > self.data_wait_warning and state.is_world_process_zero:
            logger.warning(
                "%.0f%% of the last %d steps was spent waiting for data (> %.0f%%): the input pipeline is the "
                "bottleneck. Try more dataloader_num_workers, group_by_image, or a smaller image_size.",
                100 * wait,
                steps,
                100 * self.data_wait_warning,
            )
        self._keep_in_history(state, logs)
        self._reset(now, state.global_step, state.total_flos)
        # Logging happens between step end and the next fetch: do not count it as data wait.
        self._last_event = time.perf_counter()

    @staticmethod
    def _keep_in_history(state: TrainerState, logs: dict) -> None:
        # Trainer appended a copy of `logs` to the history before calling back; keep the history complete too.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update({k: logs[k] for k in logs if k not in state.log_history[-1]})


def add_monitor(trainer, **kwargs) -> MMFusionMonitorCallback:
    """Add a [`MMFusionMonitorCallback`] ahead of the reporting callbacks, so they and the console see its numbers."""
    monitor = MMFusionMonitorCallback(**kwargs)
    trainer.callback_handler.callbacks.insert(0, monitor)
    return monitor


def progress_bars_shown(stream: TextIO | None = None) -> bool:
    """
    Whether progress bars drawn on `stream` (default `sys.stderr`) are seen as bars: on a terminal, or in a notebook
    (which draws them as widgets). A file, a pipe or a Slurm log keeps every redraw of a bar, carriage return included.
    """
    stream = sys.stderr if stream is None else stream
    return is_in_notebook() or bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())


def disable_library_progress_bars() -> None:
    """Turn off, for the rest of the process, the progress bars that Trainer's `disable_tqdm` does not reach: those of
    `datasets` (loading, the preprocessing maps) and of transformers / huggingface_hub (saving, downloads)."""
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()


def format_duration(seconds: float) -> str:
    """`41 s`, `12 min`, `3 h 05 min`: as precise as an estimate of time left deserves."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    if minutes < 90:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


class MMFusionProgressLogCallback(TrainerCallback):
    """
    Progress as log lines, for a run whose output goes to a file (CI, nohup, Slurm), where tqdm's bar would write a
    carriage-return redraw per step. With `disable_tqdm`, Trainer swaps its bar for `PrinterCallback`, which prints
    each log's metrics but not where the run stands; this callback adds one line every `every` of the optimizer steps:

        step 106 of 2110 (5%), epoch 0.18, 42 s elapsed, about 13 min left

    and one when an evaluation starts (its metrics are `PrinterCallback`'s). The time left is the pace of the steps
    this `train()` call has made so far, evaluations and checkpoints included. Only the main process logs.

    Args:
        every (`float`, *optional*, defaults to 0.05):
            The share of `state.max_steps` between two lines.

    Example:

    ```python
    >>> from mm_fusion.training import MMFusionProgressLogCallback

    >>> trainer.add_callback(MMFusionProgressLogCallback(every=0.1))  # doctest: +SKIP
    ```
    """

    def __init__(self, every: float = 0.05):
        if not 0 < every <= 1:
            raise ValueError(f"every must be a share of the run in (0, 1], got {every}.")
        self.every = every
        self._start_time = self._start_step = None
        self._next = 0  # the step at which the next line is due
        self._evaluating = False

    def _mark_after(self, step: int, max_steps: int) -> int:
        """The first step past `step` that ends a share of the run (max_steps when fewer steps than shares)."""
        share = math.floor(step / max_steps / self.every + 1e-9) + 1
        return min(max_steps, max(step + 1, math.ceil(share * self.every * max_steps - 1e-9)))

    def on_train_begin(self, args, state, control, **kwargs):
        self._start_time, self._start_step = time.perf_counter(), state.global_step
        self._next = self._mark_after(state.global_step, state.max_steps) if state.max_steps > 0 else math.inf
        if state.is_world_process_zero and state.max_steps > 0:
            progress_logger.info(
                "training %d optimizer steps%s, a line every %g%%",
                state.max_steps,
                f" from step {state.global_step}" if state.global_step else "",
                100 * self.every,
            )

    def on_step_end(self, args, state, control, **kwargs):
        step, total = state.global_step, state.max_steps
        if self._start_time is None or step < self._next:
            return
        self._next = self._mark_after(step, total)
        if not state.is_world_process_zero:
            return
        elapsed = time.perf_counter() - self._start_time
        line = f"step {step} of {total} ({100 * step / total:.0f}%), epoch {state.epoch or 0:.2f}, "
        line += f"{format_duration(elapsed)} elapsed"
        if self._start_step < step < total:
            left = elapsed / (step - self._start_step) * (total - step)
            line += f", about {format_duration(left)} left"
        progress_logger.info(line)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if self._evaluating or not state.is_world_process_zero:
            return
        self._evaluating = True
        try:
            count = len(eval_dataloader)
            batches = f" {count} batch{'es' if count != 1 else ''}"
        except TypeError:  # a stream, or no loader given
            batches = ""
        progress_logger.info("evaluating%s at step %d", batches, state.global_step)

    def on_evaluate(self, args, state, control, **kwargs):
        self._evaluating = False

    on_predict = on_evaluate


# A batch norm whose momentum is above this keeps, in PyTorch's convention (the weight of each new batch), nearly only
# the last batch's statistics: TensorFlow's decay (the weight of the old statistics) passed as PyTorch's momentum, as
# transformers' MobileNetV2 (0.997), MobileNetV1 (0.9997) and EfficientNet (its config's 0.99) do.
LAST_BATCH_MOMENTUM = 0.5
# Training batches a recalibration averages over: 30 of 64 pairs gave a Fashion-MNIST model the same accuracy as 100.
RECALIBRATION_BATCHES = 30


def trainable_batch_norms(model: torch.nn.Module) -> list[torch.nn.modules.batchnorm._BatchNorm]:
    """The batch norms whose weights train and that keep running statistics (those evaluation normalises with)."""
    return [
        module
        for module in model.modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
        and module.track_running_stats
        and any(p.requires_grad for p in module.parameters(recurse=False))
    ]


def recalibrate_batch_norms(model: torch.nn.Module, batches, num_batches: int) -> int:
    """
    Set the running statistics of the model's training batch norms to their plain average over the next `num_batches`
    of `batches` (dicts of model inputs on the model's device), the weights as they are now: forward passes in
    training mode, without gradients. Returns the number of batches averaged over; with none (an empty loader) the
    statistics stay as they were.
    """
    was_training = model.training
    model.train()  # the model's own `train` keeps frozen towers and frozen batch norms in eval mode
    norms = [m for m in trainable_batch_norms(model) if m.training]
    seen = 0
    try:
        with torch.no_grad():
            for batch in batches:
                if seen == num_batches:
                    break
                if seen == 0:
                    momenta = [m.momentum for m in norms]
                    for m in norms:
                        m.reset_running_stats()
                        m.momentum = None  # a cumulative average
                model(**batch)
                seen += 1
    finally:
        if seen:
            for m, momentum in zip(norms, momenta):
                m.momentum = momentum
        model.train(was_training)
    return seen


class BatchNormRecalibrationCallback(TrainerCallback):
    """
    At the last optimizer step, before its evaluation and checkpoint, re-estimates the running statistics of the
    batch norms that train ([`recalibrate_batch_norms`]) over `num_batches` training batches, drawn from a fresh pass
    of the training loader. A tower whose batch norms keep nearly only the last batch's statistics
    ([`LAST_BATCH_MOMENTUM`]) is otherwise evaluated, saved and served with the statistics of one batch. A streamed
    training set is not re-read: its position is part of the run's state.
    """

    def __init__(self, num_batches: int = RECALIBRATION_BATCHES):
        self.num_batches = num_batches
        self.done = False

    def on_step_end(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if self.done or state.global_step < state.max_steps or model is None or train_dataloader is None:
            return
        self.done = True
        loader = getattr(train_dataloader, "base_dataloader", train_dataloader)  # not accelerate's stateful wrapper
        if isinstance(loader.dataset, torch.utils.data.IterableDataset):
            logger.info("batch norms not recalibrated: the training set is streamed")
            return
        device = next(model.parameters()).device
        start = time.perf_counter()
        seen = recalibrate_batch_norms(model, (send_to_device(b, device) for b in loader), self.num_batches)
        if state.is_world_process_zero:
            progress_logger.info(
                "batch norms' running statistics re-estimated over %d training batches at the final weights (%.1f s)",
                seen,
                time.perf_counter() - start,
            )
