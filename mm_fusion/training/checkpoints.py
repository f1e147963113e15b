"""Trainer checkpoints: which one to resume from (complete ones only), and loading a model's weights from one exactly.

Trainer writes a checkpoint's files one after the other and `trainer_state.json` last, so a run killed while saving
leaves a directory without it; a copy that was cut short, or a full disk, leaves truncated files. `get_last_checkpoint`
would pick such a directory anyway, and resuming from it fails with a traceback that does not name the file.
"""

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PreTrainedModel
from transformers.trainer_pt_utils import safe_globals
from transformers.trainer_utils import sort_checkpoints


logger = logging.getLogger(__name__)

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# Files Trainer loads with `torch.load(weights_only=True)` on resume; `training_args.bin` is never loaded.
TORCH_FILE_PATTERNS = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state*.pth", "pytorch_model*.bin")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from or loaded; the message names the file and what is wrong with it."""


def checkpoint_problem(checkpoint: str | os.PathLike) -> str | None:
    """
    What makes a Trainer checkpoint directory unusable, naming the file: a missing `trainer_state.json` (the save did
    not finish) or model weights, a truncated or unreadable weights file, or a `torch.load` file that is truncated
    or holds more than tensors (a pickle payload, refused as `weights_only` loading refuses it). `None` when every
    file checks out. Reads headers, not tensor data, so it is cheap even for large checkpoints.
    """
    path = Path(checkpoint)
    if not path.is_dir():
        return f"{path} is not a directory"
    state = path / "trainer_state.json"
    if not state.is_file():
        return f"{state} is missing (the save did not finish)"
    try:
        step = json.loads(state.read_text())["global_step"]
        if not isinstance(step, int):
            raise TypeError(f"global_step is {step!r}")
    except (ValueError, KeyError, TypeError) as err:
        return f"{state} is not a complete trainer state ({type(err).__name__}: {err})"
    sharded = any(path.glob("pytorch_model_fsdp*")) or any(path.glob("global_step*"))  # FSDP / DeepSpeed layouts
    adapter = all((path / name).is_file() for name in ADAPTER_FILES)  # a --lora run's: Trainer's peft loader reads it
    if not sharded and not adapter and not any((path / name).is_file() for name in WEIGHT_FILES):
        files = " or ".join(WEIGHT_FILES[::2])
        return f"{path} has no model weights ({files}, or a LoRA adapter: {' and '.join(ADAPTER_FILES)})"
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt") as weights:
                weights.keys()
        except Exception as err:  # safetensors raises its own error type for every kind of damage
            return f"{file} is truncated or not a safetensors file ({err})"
    for pattern in TORCH_FILE_PATTERNS:
        for file in sorted(path.glob(pattern)):
            try:
                with safe_globals():  # the allowlist Trainer itself loads RNG states with
                    torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:
                return f"{file} cannot be loaded safely: truncated, or not only tensors ({type(err).__name__}: {err})"
    return None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _complete_on_every_rank(steps: set[int]) -> set[int]:
    """The checkpoint steps complete on every rank of the process group (`steps` alone in one process). Each node may
    keep its checkpoints on a disk of its own (`--save_on_each_node`), and a node that died while saving has one
    checkpoint fewer: every rank must resume from the same step."""
    if not _distributed():
        return steps
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, sorted(steps))
    return set.intersection(*(set(s) for s in every))


def resolve_resume_checkpoint(value: str | None, output_dir: str) -> str | None:
    """
    A `--resume_from_checkpoint` value made a checked checkpoint directory: `last` (or `true`) is the newest checkpoint
    in `output_dir` that [`checkpoint_problem`] finds nothing wrong with, each newer one skipped with a warning that
    says why, and, in a run of several processes, complete for every one of them (node-local output directories may
    differ); a path must itself be complete. Raises [`CheckpointError`] naming what is wrong.
    """
    if value is None:
        return None
    if value in ("last", "true", "True"):
        complete, skipped = {}, []
        for checkpoint in reversed(sort_checkpoints(output_dir) if os.path.isdir(output_dir) else []):
            problem = checkpoint_problem(checkpoint)
            if problem is None:
                complete[int(checkpoint.rsplit("-", 1)[-1])] = checkpoint
                if not _distributed():
                    break  # one process: the newest complete checkpoint is the one
                continue
            logger.warning("Skipping %s, which cannot be resumed from: %s.", os.path.basename(checkpoint), problem)
            skipped.append(f"{os.path.basename(checkpoint)}: {problem}")
        steps = _complete_on_every_rank(set(complete))
        if steps:
            newest = max(steps)
            if newest != max(complete):
                logger.warning(
                    "Resuming from step %d, the newest checkpoint complete on every rank (this rank's newest is %d).",
                    newest,
                    max(complete),
                )
            return complete[newest]
        detail = "; the ones there are incomplete: " + "; ".join(skipped) if skipped else ""
        if complete:
            detail = f"; this rank has {sorted(complete)}, but no step is complete on every rank"
        raise CheckpointError(
            f"--resume_from_checkpoint {value}: there is no complete checkpoint-* directory in {output_dir}{detail}."
        )
    if not os.path.isdir(value):
        raise CheckpointError(
            f"--resume_from_checkpoint {value!r} is not a Trainer checkpoint directory (such as "
            f"{output_dir}/checkpoint-500); use `last` for the newest complete one in --output_dir."
        )
    problem = checkpoint_problem(value)
    if problem is not None:
        raise CheckpointError(
            f"--resume_from_checkpoint {value!r} is not a complete Trainer checkpoint: {problem}. Use `last` to "
            f"resume from the newest complete one in {output_dir}."
        )
    return value


def load_checkpoint_weights(model: PreTrainedModel, checkpoint: str | os.PathLike) -> None:
    """
    Load the weights saved in `checkpoint` into `model`, exactly, or raise [`CheckpointError`] listing every missing,
    unexpected or mismatched tensor.

    The weights are read with `from_pretrained`, which maps the key names a tower was saved under to the names its
    class uses now (transformers 5 saves ViT layers under their legacy names), and then copied with a strict
    `load_state_dict`. Trainer's own loading reads the file with `strict=False` and no renaming, which leaves such a
    tower at its random initialisation and only logs a warning.
    """
    loaded, info = type(model).from_pretrained(checkpoint, output_loading_info=True)
    problems = {kind: keys for kind, keys in info.items() if keys}
    if problems:
        listed = "; ".join(f"{kind}: {list(keys)[:10]}" for kind, keys in problems.items())
        raise CheckpointError(f"The weights in {checkpoint} do not fit the model ({listed}).")
    try:
        model.load_state_dict(loaded.state_dict(), strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"The weights in {checkpoint} do not fit the model: {err}") from None


# Written into each checkpoint: the sum of every optimizer step's training loss up to it, so that a resumed run
# reports the mean over the whole run (Trainer's `train_loss` averages only the steps of the current `train()` call).
LOSS_TOTAL_FILE = "train_loss_total.json"


def is_peft_model(model) -> bool:
    """A LoRA run's model (`--lora`): its checkpoints hold the adapter only, which Trainer's own loader reads."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


class ExactLoadingMixin:
    """
    Trainer mixin: exact weight loading on resume and for `load_best_model_at_end` ([`load_checkpoint_weights`]).
    Trainer loads with `strict=False` and without the key renaming of `from_pretrained`, so a ViT tower saved under its
    legacy key names would silently keep its random initialisation; here a missing or unexpected key is an error. The
    private `_load_from_checkpoint` / `_load_best_model` are overridden because Trainer's loading happens inside them;
    FSDP and DeepSpeed keep their own loaders of sharded states.
    """

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if (
            self.is_fsdp_enabled
            or self.is_deepspeed_enabled
            or is_peft_model(model if model is not None else self.model)
        ):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_checkpoint_weights(model if model is not None else self.model, resume_from_checkpoint)

    def _load_best_model(self):
        if self.is_fsdp_enabled or self.is_deepspeed_enabled or is_peft_model(self.model):
            return super()._load_best_model()
        load_checkpoint_weights(self.model, self.state.best_model_checkpoint)


class ResumedLossMixin:
    """
    Trainer unit: after a resume, `train_loss` is the mean over every step of the run, not only the resumed ones.
    [`write_loss_total`] writes the run's loss total so far into each checkpoint, [`read_resumed_loss`] (at `train`)
    reads it back, and [`correct_train_loss`] (at `log`) corrects the final `train_loss`. The total is read from
    Trainer's running sums (`_total_loss_scalar`, `_tr_loss`), which no public attribute exposes.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.resumed_from_step = None  # the global step of the checkpoint a run resumed from
        self._resumed_loss_sum = None  # and its summed step losses

    def read_resumed_loss(self, resume_from_checkpoint: str | None) -> None:
        self.resumed_from_step = self._resumed_loss_sum = None
        if resume_from_checkpoint is None:
            return
        with open(os.path.join(resume_from_checkpoint, "trainer_state.json")) as f:
            self.resumed_from_step = json.load(f)["global_step"]
        path = os.path.join(resume_from_checkpoint, LOSS_TOTAL_FILE)
        if os.path.isfile(path):  # absent from checkpoints of other trainers: Trainer's figure then
            with open(path) as f:
                self._resumed_loss_sum = float(json.load(f)["train_loss_sum"])

    def write_loss_total(self, folder: str) -> None:
        if self.args.should_save:
            # Trainer drains the losses of logged steps into `_total_loss_scalar`; `_tr_loss` holds the rest.
            total = (self._resumed_loss_sum or 0.0) + self._total_loss_scalar + self._tr_loss.item()
            with open(os.path.join(folder, LOSS_TOTAL_FILE), "w") as f:
                json.dump({"train_loss_sum": total, "global_step": self.state.global_step}, f)

    def correct_train_loss(self, logs: dict[str, float]) -> None:
        if "train_loss" in logs and self._resumed_loss_sum is not None:
            # In place: the same dict is `train()`'s returned metrics.
            steps = self.state.global_step - self.resumed_from_step  # this session's, which Trainer averaged over
            logs["train_loss"] = (self._resumed_loss_sum + logs["train_loss"] * steps) / max(self.state.global_step, 1)


def save_on_every_node(model) -> None:
    """
    For `save_on_each_node`: the local main process of every node writes the weights and config too. transformers
    5.23's `save_pretrained` writes them on global rank 0 only, whatever `is_main_process` says, which would leave the
    checkpoints on the other nodes' disks without weights to resume from: the model's public `should_save_on_this_rank`
    is made to follow `is_main_process` (Trainer passes its `should_save`, true on each node's local main process).
    """
    model.should_save_on_this_rank = _follow_is_main_process


def _follow_is_main_process(is_main_process: bool) -> bool:
    return is_main_process
