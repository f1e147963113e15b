"""Training with `Trainer` / Accelerate: arguments, trainer, monitor, metrics and model card of `scripts/train.py`.

Not imported by `mm_fusion` itself: the library never pulls in the training stack (open_clip's split).
"""

from .arguments import DataArguments, MMFusionTrainingArguments, ModelArguments
from .builders import (
    build_config,
    check_columns,
    check_eval_data,
    encode_labels,
    load_raw_datasets,
    model_class,
    parse_overrides,
    split_off_eval,
)
from .callbacks import MMFusionMonitorCallback, add_monitor
from .checkpoints import (
    CheckpointError,
    checkpoint_problem,
    load_checkpoint_weights,
    resolve_resume_checkpoint,
)
from .grad_cache import ITCGradCache, build_itc_cache, cached_micro_batch_loss, train_window
from .launch import check_launch, model_card_context
from .metrics import load_metric
from .model_card import plot_training_curves, write_model_card
from .sampler import MMFusionImageGroupedSampler, MMFusionLengthGroupedSampler
from .trainer import MMFusionTrainer


__all__ = [
    "CheckpointError",
    "DataArguments",
    "ITCGradCache",
    "MMFusionImageGroupedSampler",
    "MMFusionLengthGroupedSampler",
    "MMFusionMonitorCallback",
    "MMFusionTrainer",
    "MMFusionTrainingArguments",
    "ModelArguments",
    "add_monitor",
    "build_config",
    "build_itc_cache",
    "cached_micro_batch_loss",
    "check_columns",
    "check_eval_data",
    "check_launch",
    "checkpoint_problem",
    "encode_labels",
    "load_checkpoint_weights",
    "load_metric",
    "load_raw_datasets",
    "model_card_context",
    "model_class",
    "parse_overrides",
    "plot_training_curves",
    "resolve_resume_checkpoint",
    "split_off_eval",
    "train_window",
    "write_model_card",
]
