"""
Steps 4 to 7 of `scripts/train.py`: the trainer ([`build_trainer`]), the final evaluation ([`final_metrics`]) and what
a run saves ([`save_run`]). The script spells every step out; [`setup_run`] (steps 1 to 4, from the script's
arguments) and [`train_and_save`] (steps 5 to 7) are the same run in two calls, for tests, benchmarks and notebooks.
"""

import logging

import torch
from transformers import EarlyStoppingCallback

from ..cli import parse_overrides
from .arguments import MAIN_METRICS, DataArguments, MMFusionTrainingArguments, ModelArguments
from .callbacks import (
    LAST_BATCH_MOMENTUM,
    RECALIBRATION_BATCHES,
    BatchNormRecalibrationCallback,
    MMFusionProgressLogCallback,
    add_monitor,
    trainable_batch_norms,
)
from .data import TrainingData
from .data_path import load_training_data
from .launch import release_freed_memory
from .map_checks import map_check
from .metrics import classification_metrics, retrieval_metrics
from .model_card import MMFusionModelCard
from .models import build_model_and_processor
from .settle import parse_arguments
from .trainer import MMFusionTrainer


logger = logging.getLogger("mm_fusion.train")


def build_trainer(
    model,
    processor,
    data: TrainingData,
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: MMFusionTrainingArguments,
    command: list[str] | None = None,
) -> MMFusionTrainer:
    """
    The pairs preprocessed once into the cache, the collators, the task's metrics, the monitor, early stopping, the
    progress lines of a run without bars (`disable_tqdm`) and the model card, in an [`MMFusionTrainer`]. `command`:
    the script's arguments, for the model card.
    """
    task = model_args.task
    tokenizer = processor.tokenizer
    image_size = processor.image_processor.size["height"]  # what the processor serves, the cache holds
    prepared = data.path.prepare(data, tokenizer, image_size, task, data_args, training_args)
    train_collator, eval_collator = data.path.collators(prepared, tokenizer.pad_token_id, image_size, task, data_args)
    train_pairs, eval_pairs = prepared.pairs["train"], prepared.pairs.get("eval")
    if task == "pretrain":
        compute_metrics, preprocess_logits = retrieval_metrics(), None
    else:
        # Evaluation predictions come in the order of the evaluation pairs, so each can be given its group.
        groups = {c: eval_pairs[c] for c in data.group_columns} if eval_pairs is not None else {}
        compute_metrics, preprocess_logits = classification_metrics(groups)
    card = MMFusionModelCard(model_args, data_args, prepared, MAIN_METRICS[task], command)
    trainer = MMFusionTrainer(
        model=model,
        args=training_args,
        train_dataset=train_pairs,
        eval_dataset=eval_pairs,
        data_collator=train_collator,
        eval_data_collator=eval_collator,
        processing_class=processor,
        compute_metrics=compute_metrics if eval_pairs is not None else None,
        preprocess_logits_for_metrics=preprocess_logits if eval_pairs is not None else None,
        model_card_writer=card.write,
    )
    if task != "pretrain":  # where the map points, checked at the end ([`final_metrics`])
        options = parse_overrides(data_args.dataset_options, flag="--dataset_options")
        trainer.map_check = map_check(data_args, data.datasets.get("eval"), eval_pairs, eval_collator, options)
    if training_args.release_freed_memory:
        release_freed_memory()
    add_monitor(trainer, data_wait_warning=training_args.data_wait_warning, peak_tflops=training_args.peak_tflops)
    if training_args.disable_tqdm:  # Trainer then prints the logs' metrics, but no longer where the run stands
        trainer.add_callback(MMFusionProgressLogCallback())
    recalibration = training_args.recalibrate_batch_norms
    if recalibration is None:
        norms = trainable_batch_norms(model)
        drifting = any(m.momentum is not None and m.momentum > LAST_BATCH_MOMENTUM for m in norms)
        recalibration = RECALIBRATION_BATCHES if drifting else 0
    if recalibration:
        trainer.add_callback(BatchNormRecalibrationCallback(recalibration))
    if training_args.early_stopping_patience is not None:
        trainer.add_callback(EarlyStoppingCallback(early_stopping_patience=training_args.early_stopping_patience))
    # Every rank says where it stands, so a launch that started fewer processes than asked for shows at once.
    logger.info(
        "process %d of %d (local %d), device %s",
        training_args.process_index,
        training_args.world_size,
        training_args.local_process_index,
        training_args.device,
    )
    if trainer.is_world_process_zero():
        logger.info(
            "task %s, fusion %s, %.2fM parameters; train %s, eval %s pairs; %s; %d torch threads",
            task,
            model.config.fusion_type,
            sum(p.numel() for p in model.parameters()) / 1e6,
            f"{len(train_pairs)} pairs ({len(prepared.images)} images in all splits)"
            if not data.path.streaming
            else f"streamed from {len(data.datasets['train'].shards)} shards",
            len(eval_pairs) if eval_pairs is not None else 0,
            f"ablation {data_args.ablation}" if data_args.ablation != "none" else "no ablation",
            torch.get_num_threads(),
        )
    return trainer


def final_metrics(trainer: MMFusionTrainer, train_result) -> dict:
    """The training metrics (`train_*`) and the evaluation of the final weights (`eval_*`), when there are
    evaluation pairs; for built-in data whose objects' places are known, the map checks (`eval_map_*`,
    [`~map_checks`]), on the main process, also written into the last evaluation's record for the model card."""
    metrics = {"train_" + k if not k.startswith("train_") else k: v for k, v in train_result.metrics.items()}
    if trainer.eval_dataset is not None:
        # The scheduled evaluation at the last step already scored these weights, unless the best checkpoint was
        # loaded back since: reuse it rather than run the same evaluation twice.
        last = next((h for h in reversed(trainer.state.log_history) if "eval_loss" in h), None)
        if last is not None and last["step"] == trainer.state.global_step and not trainer.args.load_best_model_at_end:
            metrics.update({k: v for k, v in last.items() if k.startswith("eval_") or k == "epoch"})
        else:
            metrics.update(trainer.evaluate())
    check = getattr(trainer, "map_check", None)
    if check is not None and trainer.is_world_process_zero():
        model = trainer.accelerator.unwrap_model(trainer.model)
        figures = check(model)
        metrics.update(figures)
        last = next((h for h in reversed(trainer.state.log_history) if "eval_loss" in h), None)
        if last is not None:
            last.update(figures)
    return metrics


def save_run(trainer: MMFusionTrainer, metrics: dict) -> None:
    """Model, processor (with their code and pipelines), trainer state, `all_results.json` and the model card into
    `output_dir`; pushed to the hub with `--push_to_hub`. Ends the run: the process group of a multi-process run is
    released."""
    trainer.save_model()
    trainer.save_state()
    trainer.log_metrics("all", metrics)
    trainer.save_metrics("all", metrics)
    trainer.create_model_card()
    if trainer.args.push_to_hub:
        trainer.push_to_hub()
    # The run is over on every rank: release the process group. Left to the interpreter's exit, gloo's threads can
    # abort a rank (SIGABRT, "terminate called without an active exception") after a successful run.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


def setup_run(args: list[str] | None = None) -> MMFusionTrainer:
    """Steps 1 to 4 of `scripts/train.py` for its arguments (flags and / or a config file; default `sys.argv[1:]`):
    the trainer, ready to train (from `args.resume_from_checkpoint` when resuming)."""
    model_args, data_args, training_args = parse_arguments(args)
    data = load_training_data(model_args, data_args, training_args)
    model, processor = build_model_and_processor(model_args, data_args, training_args, data)
    return build_trainer(model, processor, data, model_args, data_args, training_args, command=args)


def train_and_save(trainer: MMFusionTrainer) -> dict:
    """Steps 5 to 7 of `scripts/train.py`: train (or resume), evaluate and save; returns the metrics."""
    train_result = trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    metrics = final_metrics(trainer, train_result)
    save_run(trainer, metrics)
    return metrics
