"""
Training with `Trainer` / Accelerate, the library side of `scripts/train.py`, a module a step: `arguments` and
`settle` (1, parse, then the rules across the arguments), `data_path` (2, the pairs, on the Arrow path of `data` or
the streaming one of `streaming`), `models` (3, tokenizer, model, processor), `run` (4 to 7: trainer, evaluation,
saving), with the trainer and its units (one per feature), its monitor and progress lines, metrics, checkpoints,
samplers, gradient cache and model card beside them.

Not imported by `mm_fusion` itself: the library never pulls in the training stack (open_clip's split).
"""

from ..cli import parse_overrides
from .arguments import (
    MAIN_METRICS,
    DataArguments,
    MMFusionArgumentParser,
    MMFusionTrainingArguments,
    ModelArguments,
    training_defaults,
)
from .callbacks import MMFusionMonitorCallback, MMFusionProgressLogCallback, add_monitor
from .checkpoints import (
    CheckpointError,
    checkpoint_problem,
    load_checkpoint_weights,
    resolve_resume_checkpoint,
)
from .data import (
    TrainingData,
    build_collators,
    check_columns,
    check_eval_data,
    check_labels,
    check_usable,
    load_raw_datasets,
    prepare_training_data,
    split_off_eval,
)
from .data_check import check_data, data_report
from .data_path import load_training_data
from .grad_cache import ITCGradCache, build_itc_cache, cached_micro_batch_loss, train_window
from .launch import check_launch
from .metrics import classification_metrics, load_metric, retrieval_metrics
from .model_card import MMFusionModelCard, model_card_context, plot_training_curves, write_model_card
from .models import build_config, build_model, build_model_and_processor, build_tokenizer, model_class
from .run import build_trainer, final_metrics, save_run, setup_run, train_and_save
from .sampler import MMFusionImageGroupedSampler, MMFusionLengthGroupedSampler
from .settle import parse_arguments, settle_arguments
from .trainer import MMFusionTrainer


__all__ = [
    "MAIN_METRICS",
    "CheckpointError",
    "DataArguments",
    "ITCGradCache",
    "MMFusionArgumentParser",
    "MMFusionImageGroupedSampler",
    "MMFusionLengthGroupedSampler",
    "MMFusionModelCard",
    "MMFusionMonitorCallback",
    "MMFusionProgressLogCallback",
    "MMFusionTrainer",
    "MMFusionTrainingArguments",
    "ModelArguments",
    "TrainingData",
    "add_monitor",
    "build_collators",
    "build_config",
    "build_itc_cache",
    "build_model",
    "build_model_and_processor",
    "build_tokenizer",
    "build_trainer",
    "cached_micro_batch_loss",
    "data_report",
    "check_columns",
    "check_eval_data",
    "check_data",
    "check_launch",
    "checkpoint_problem",
    "classification_metrics",
    "check_labels",
    "check_usable",
    "final_metrics",
    "load_checkpoint_weights",
    "load_metric",
    "load_raw_datasets",
    "load_training_data",
    "model_card_context",
    "model_class",
    "parse_arguments",
    "parse_overrides",
    "plot_training_curves",
    "prepare_training_data",
    "resolve_resume_checkpoint",
    "retrieval_metrics",
    "save_run",
    "settle_arguments",
    "setup_run",
    "split_off_eval",
    "train_and_save",
    "training_defaults",
    "train_window",
    "write_model_card",
]
