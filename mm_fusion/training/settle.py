"""`scripts/train.py`'s step 1 after parsing: the rules across the three groups of arguments, settled above both the
arguments ([`arguments`]) and the model they are checked against ([`models`])."""

from ..lora import QUERY_VALUE, parse_modules
from .arguments import (
    LORA_ALL_LAYERS_LEARNING_RATE,
    LORA_CHECKPOINT_EVERY_N_LAYERS,
    LORA_LEARNING_RATE,
    MAIN_METRICS,
    DataArguments,
    MMFusionArgumentParser,
    MMFusionTrainingArguments,
    ModelArguments,
    check_streaming,
)
from .callbacks import disable_library_progress_bars
from .checkpoints import resolve_resume_checkpoint
from .launch import check_launch
from .models import check_config_overrides


def settle_arguments(
    model_args: ModelArguments, data_args: DataArguments, training_args: MMFusionTrainingArguments
) -> tuple[ModelArguments, DataArguments, MMFusionTrainingArguments]:
    """
    The rules across the three groups of arguments, in one place, applied after parsing (each dataclass checks its
    own fields in `__post_init__`): the launch checked against this machine; the defaults that follow from the task and
    the data path (`group_by_image`, the retrieval labels of pretraining, the metric early stopping watches); what a
    streaming run needs; `--lora`'s learning rate, gradient checkpointing (`--lora_gradient_checkpointing`) and
    allocator (`--release_freed_memory`); the progress bars of `datasets` and of saving turned off with Trainer's
    (`--disable_tqdm`, for the rest of the process); and
    the checkpoint to resume from, found and checked (`last`: the newest complete one).
    `--config_overrides` checked against MMFusionConfig; changes the arguments in place and returns them.
    """
    check_launch(training_args)
    if training_args.disable_tqdm:
        # Before any data is read: the bars of datasets' maps and of saving follow Trainer's, on or off together.
        disable_library_progress_bars()
    check_config_overrides(model_args, data_args.image_size, data_args.max_length)
    task = model_args.task
    if training_args.group_by_image is None and (data_args.streaming or training_args.batch_size_ramp_max):
        training_args.group_by_image = False
    if training_args.group_by_image is None:
        # Batches of one image's questions encode it once; for pretraining they would be each other's negatives.
        random_order = training_args.train_sampling_strategy == "random"
        training_args.group_by_image = task != "pretrain" and random_order
    if task == "pretrain":
        training_args.label_names = ["image_rows"]  # the labels of retrieval evaluation: each pair's image
    if training_args.early_stopping_patience is not None and training_args.metric_for_best_model_is_default:
        # "Best" is the task's metric (TrainingArguments alone would pick the evaluation loss).
        training_args.metric_for_best_model = MAIN_METRICS[task]
        training_args.greater_is_better = True
    if data_args.streaming:
        check_streaming(model_args, data_args, training_args)
    if model_args.lora and training_args.learning_rate_is_default:
        # Adapters on query and value only learn less per step than on every layer: a higher rate.
        query_value = parse_modules(model_args.lora_target_modules) == QUERY_VALUE
        training_args.learning_rate = LORA_LEARNING_RATE if query_value else LORA_ALL_LAYERS_LEARNING_RATE
    if training_args.release_freed_memory is None:
        training_args.release_freed_memory = model_args.lora
    if model_args.lora and model_args.lora_gradient_checkpointing:
        # Trainer reads `activation_checkpointing` (transformers 5.x; `gradient_checkpointing` is its deprecated alias,
        # resolved once when the arguments are made, so setting the alias now would do nothing).
        training_args.activation_checkpointing = training_args.gradient_checkpointing = True
        # Every second layer: the memory target of LoRA at half the recomputation (the user's choice wins).
        kwargs = dict(training_args.activation_checkpointing_kwargs or {})
        kwargs.setdefault("every_n_layers", LORA_CHECKPOINT_EVERY_N_LAYERS)
        training_args.activation_checkpointing_kwargs = training_args.gradient_checkpointing_kwargs = kwargs
    training_args.resume_from_checkpoint = resolve_resume_checkpoint(
        training_args.resume_from_checkpoint, training_args.output_dir
    )
    return model_args, data_args, training_args


def parse_arguments(
    args: list[str] | None = None,
) -> tuple[ModelArguments, DataArguments, MMFusionTrainingArguments]:
    """`scripts/train.py`'s step 1: its arguments parsed ([`MMFusionArgumentParser`]) and settled
    ([`settle_arguments`])."""
    return settle_arguments(*MMFusionArgumentParser().parse_args_and_config(args))
