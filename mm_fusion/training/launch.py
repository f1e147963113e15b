"""Checks that a launch (accelerate config + arguments) can run on this machine, and the model card's context."""

import os
import platform
import shlex
import sys

import torch

from .arguments import DataArguments, MMFusionTrainingArguments, ModelArguments


TASK_DESCRIPTIONS = {
    "vqa": ("visual question answering", "visual-question-answering", "classifier over the answers"),
    "classify": ("image-text classification", "visual-question-answering", "classifier over the classes"),
    "pretrain": (
        "image-text retrieval / matching",
        "zero-shot-image-classification",
        "contrastive (ITC) and matching (ITM)",
    ),
}
FUSION_DESCRIPTIONS = {
    "hierarchical": "hierarchical cross-attention bridges (fusion layers fed from several tower layers)",
    "cross_attention": "a co-attention stack over the towers' final features",
    "late": "late fusion (pooled, projected tower features only; a dual encoder)",
}


def check_launch(training_args: MMFusionTrainingArguments) -> None:
    """Clear errors for an accelerate launch configuration that cannot run on this machine."""
    has_gpu = torch.cuda.is_available()
    env = os.environ
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not has_gpu:
        raise RuntimeError(
            "This launch asks for FSDP, which needs GPUs, but this machine has none. Use "
            "scripts/accelerate_configs/multi_cpu.yaml (or torchrun --nproc_per_node N) for multi-process CPU runs."
        )
    if env.get("ACCELERATE_MIXED_PRECISION") == "fp16" and not has_gpu:
        raise RuntimeError("The accelerate config asks for fp16, which needs a GPU; use bf16 or no on CPU.")
    world = int(env.get("WORLD_SIZE", "1"))
    state = training_args.distributed_state
    processes = state.num_processes if state is not None else 1
    if world > 1 and not has_gpu and processes != world:
        raise RuntimeError(
            f"WORLD_SIZE is {world} but accelerate set up {processes} process(es); on CPU launch with "
            "torchrun --nproc_per_node N or the multi_cpu accelerate config."
        )
    if has_gpu and world > torch.cuda.device_count() * int(env.get("NNODES", env.get("ACCELERATE_NUM_MACHINES", "1"))):
        raise RuntimeError(f"{world} processes were launched but only {torch.cuda.device_count()} GPUs are visible.")


def hardware() -> str:
    """The devices of this run, in words."""
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def model_card_context(
    trainer,
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: MMFusionTrainingArguments,
    prepared,
    main_metric: str,
    argv: list[str] | None,
) -> dict:
    """Everything the model card template shows, from the finished run."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    config = model.config
    history = trainer.state.log_history
    evals = [h for h in history if "eval_loss" in h]
    metrics = {k[len("eval_") :]: v for k, v in (evals[-1] if evals else {}).items() if k.startswith("eval_")}
    metrics = {k: v for k, v in metrics.items() if isinstance(v, float) and not k.endswith(("runtime", "per_second"))}
    train = next((h for h in reversed(history) if "train_runtime" in h), {})
    task = model_args.task
    description, pipeline_tag, head = TASK_DESCRIPTIONS[task]
    eval_pairs = prepared.pairs["eval"] if "eval" in prepared.pairs else None
    easy = data_args.dataset == "easy_vqa"
    precision = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "fp32"
    args = sys.argv[1:] if argv is None else argv
    auto_class = "AutoModelForPreTraining" if task == "pretrain" else "AutoModelForVisualQuestionAnswering"
    text = config.text_config
    return {
        "model_name": os.path.basename(os.path.normpath(training_args.output_dir)),
        "task": task,
        "task_description": description,
        "pipeline_tag": pipeline_tag,
        "head": head + (f" ({config.num_labels} classes)" if task != "pretrain" else ""),
        "fusion_type": config.fusion_type,
        "fusion_description": FUSION_DESCRIPTIONS[config.fusion_type],
        "num_fusion_layers": config.num_fusion_layers,
        "fusion_direction_description": (
            "text attends to image; image keys / values shared by the texts of an image"
            if config.fusion_direction == "text_to_image"
            else "co-attention, both directions"
        ),
        "fusion_hidden_size": config.fusion_hidden_size,
        "vision": config.vision_config,
        "text": text,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "from_scratch": not (
            model_args.model_name_or_path or model_args.vision_model_name_or_path or model_args.text_model_name_or_path
        ),
        "dataset_name": "easy-VQA" if easy else data_args.dataset,
        "dataset_id": None if easy or os.path.exists(data_args.dataset) else data_args.dataset,
        "dataset_description": (
            "easy-VQA (the `easy-vqa` PyPI package, MIT): 64x64 images of one coloured shape, questions about its "
            "shape, colour and presence, 13 answers."
            if easy
            else f"Pairs from `{data_args.dataset}`."
        ),
        "eval_split": data_args.eval_split if easy or data_args.eval_split else "eval",
        "train_pairs": len(prepared.pairs["train"]),
        "eval_pairs": len(eval_pairs) if eval_pairs is not None else 0,
        "train_images": len(set(prepared.pairs["train"]["image_index"])),
        "quarantined": len(prepared.quarantine),
        "image_mean": [round(x, 3) for x in config.image_mean],
        "image_std": [round(x, 3) for x in config.image_std],
        "metrics": metrics,
        "main_metric": main_metric,
        "log_history": history,
        "command": "scripts/train.py" + ("" if not args else " " + shlex.join(args)),
        "epochs": training_args.num_train_epochs,
        "steps": trainer.state.global_step,
        "global_batch_size": training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        * training_args.world_size,
        "learning_rate": training_args.learning_rate,
        "lr_scheduler": str(training_args.lr_scheduler_type).split(".")[-1].lower(),
        "weight_decay": training_args.weight_decay,
        "precision": precision,
        "batching": "grouped by image" if training_args.group_by_image else str(training_args.train_sampling_strategy),
        "hardware": f"{hardware()}, {training_args.world_size} process(es)",
        "train_runtime": train.get("train_runtime", 0.0),
        "train_loss": train.get("train_loss"),
        "resumed_from_step": getattr(trainer, "resumed_from_step", None),
        "train_samples_per_second": train.get("train_samples_per_second", 0.0),
        "repo_or_path": training_args.hub_model_id or training_args.output_dir,
        "auto_class": auto_class,
        "example_text": "what shape is in the image?" if easy else "a photo",
    }
