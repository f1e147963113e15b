"""
Step 3 of `scripts/train.py`, the model: its tokenizer (given, the text tower's, the checkpoint's, or trained on the
training texts), the model (from an MMFusion checkpoint, from pretrained towers, or from scratch with a config built
from the size arguments) and the processor saved with it.
"""

import logging
import tempfile
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoTokenizer, set_seed

from ..cli import parse_overrides
from ..configuration_mm_fusion import MMFusionConfig
from ..image_processing_mm_fusion import MMFusionImageProcessor
from ..processing_mm_fusion import MMFusionProcessor
from ..tokenizer_training import train_tokenizer
from ..vision_towers import early_stage_parameters
from .arguments import DataArguments, ModelArguments
from .data import TrainingData
from .model_presets import conv_tower_settings, load_model_preset


logger = logging.getLogger(__name__)


def build_model_and_processor(
    model_args: ModelArguments, data_args: DataArguments, training_args, data: TrainingData
) -> tuple:
    """The run's model and the processor saved with it (which serves exactly the training input: the image processor
    runs the cache's own image function, and texts are truncated to the training length)."""
    tokenizer = build_tokenizer(model_args, data_args, training_args, data)
    set_seed(training_args.seed)  # the initial weights are drawn from the run's seed
    model = build_model(model_args, tokenizer, data.labels, data_args.image_size or 64, data_args.max_length)
    if data.labels is not None:  # class ids: scores are read with a softmax, and the pipelines read this
        model.config.problem_type = "single_label_classification"
    for role in ("vision", "text"):
        if getattr(model_args, f"freeze_{role}_model"):  # and in eval mode while training: MMFusionModel.train
            getattr(model.base_model, f"{role}_model").requires_grad_(False)
            logger.info(f"The {role} tower is frozen (--freeze_{role}_model).")
    if model_args.freeze_vision_stages:  # their batch norms in eval mode while training: MMFusionModel.train
        vision = model.base_model.vision_model
        for parameter in early_stage_parameters(vision, model.config.vision_config, model_args.freeze_vision_stages):
            parameter.requires_grad_(False)
        logger.info(f"The vision tower's first {model_args.freeze_vision_stages} stages are frozen.")
    if model_args.vision_batch_norm_momentum is not None:
        norms = [m for m in model.base_model.vision_model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if not norms:
            raise ValueError("--vision_batch_norm_momentum: this vision tower has no batch norms.")
        for norm in norms:
            norm.momentum = model_args.vision_batch_norm_momentum
    image_size = input_image_size(model.config, data_args.image_size)
    processor = MMFusionProcessor(
        MMFusionImageProcessor(size={"height": image_size, "width": image_size}),
        tokenizer,
        max_length=data_args.max_length,
    )
    if model_args.lora:
        model = with_lora(model, model_args, training_args)
    return model, processor


def with_lora(model, model_args: ModelArguments, training_args):
    """`--lora`: the model the run starts from, saved in `output_dir` by the main process (the adapter is trained
    against it, and is saved beside it), wrapped with LoRA adapters on `--lora_parts` ([`mm_fusion.lora.add_lora`])."""
    from ..lora import add_lora

    if training_args.process_index == 0:
        model.save_pretrained(training_args.output_dir)
    return add_lora(
        model,
        model_args.lora_parts,
        model_args.lora_r,
        model_args.lora_alpha,
        model_args.lora_dropout,
        model_args.lora_target_modules,
    )


def input_image_size(config: MMFusionConfig, requested: int | None) -> int:
    """The side images are resized to: a transformer tower's own `image_size` (its position embeddings are made
    for it); for a convolutional tower, which takes any size, `--image_size`, else its config's, else 64."""
    own = getattr(config.vision_config, "image_size", None)
    if config.vision_tower_type == "transformer" and own is not None:
        return own
    return requested or own or 64


def build_tokenizer(model_args: ModelArguments, data_args: DataArguments, training_args, data: TrainingData):
    """
    The given tokenizer, the text tower's, the one saved in the checkpoint a run resumes from, or one trained on the
    training texts by the main process.
    """
    resume = training_args.resume_from_checkpoint
    source = model_args.tokenizer_name_or_path or model_args.text_model_name_or_path or model_args.model_name_or_path
    if source is None and resume is not None and (Path(resume) / "tokenizer_config.json").is_file():
        source = resume  # the vocabulary the checkpoint's weights were trained with, whatever the data is now
    if source:
        return AutoTokenizer.from_pretrained(source)
    directory = Path(training_args.output_dir) / "tokenizer"
    # Trained once, by the main process, and sent to the others through the process group, not through the disk:
    # on several nodes each may have an output_dir of its own (node-local disks), where the main process's files are
    # not to be found (trl#7223). Every rank must have the same vocabulary.
    files = [None]
    if training_args.process_index == 0:
        texts = data.path.tokenizer_texts(data, data_args)
        bars = not training_args.disable_tqdm
        tokenizer = train_tokenizer(texts, vocab_size=model_args.vocab_size, show_progress=bars)
        tokenizer.save_pretrained(directory)
        files = [{path.name: path.read_bytes() for path in directory.iterdir() if path.is_file()}]
    if training_args.world_size > 1:
        torch.distributed.broadcast_object_list(files, src=0)
    if training_args.process_index != 0:
        with tempfile.TemporaryDirectory() as received:
            for name, content in files[0].items():
                (Path(received) / name).write_bytes(content)
            tokenizer = AutoTokenizer.from_pretrained(received)
    return tokenizer


def build_model(model_args: ModelArguments, tokenizer, labels: list[str] | None, image_size: int, max_length: int):
    """From an MMFusion checkpoint, from pretrained towers, or from scratch."""
    cls = model_class(model_args.task)
    if model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path)
        if labels is not None and "MMFusionForPretraining" in (config.architectures or []):
            # A pretraining checkpoint has no classifier: its towers, fusion and tokenizer start this run, with a new
            # head for these labels (its ITC projections and ITM head are left behind).
            return cls.from_pretrained(
                model_args.model_name_or_path,
                num_labels=len(labels),
                id2label=dict(enumerate(labels)),
                label2id={name: i for i, name in enumerate(labels)},
            )
        model = cls.from_pretrained(model_args.model_name_or_path)
        if labels is not None and model.config.num_labels != len(labels):
            raise ValueError(
                f"{model_args.model_name_or_path} has a head for {model.config.num_labels} labels but the data has "
                f"{len(labels)}: {labels[:10]}."
            )
        return model
    replaced = replaced_tower_settings(model_args)
    config = build_config(model_args, image_size, len(tokenizer), max_length, labels, leave_out=replaced)
    if model_args.vision_model_name_or_path or model_args.text_model_name_or_path:
        vision = model_args.vision_model_name_or_path or AutoModel.from_config(config.vision_config)
        text = model_args.text_model_name_or_path or AutoModel.from_config(config.text_config)
        # What depends on a replaced tower is resolved again from the pretrained one, or taken from --config_overrides
        # as given (checked against that tower, not the scratch one).
        overrides = parse_overrides(model_args.config_overrides)
        fusion = {
            k: v for k, v in config.to_diff_dict().items() if k not in {"vision_config", "text_config", *replaced}
        }
        fusion.update({k: v for k, v in overrides.items() if k in replaced})
        return cls.from_vision_text_pretrained(vision, text, **fusion)
    return cls(config)


# The config's settings that are resolved from a tower, or sized from the arguments for towers built from scratch: a
# pretrained tower replaces the scratch one, so they are resolved again from it. Passed on, a 12-layer pretrained
# tower would be read at the scratch tower's last layer (its later layers computed and never trained) and a 768-wide
# one through a 96-wide fusion block.
FROM_VISION_TOWER = ("vision_bridge_layers",)
FROM_TEXT_TOWER = (
    "text_bridge_layers",
    "fusion_hidden_size",
    "fusion_num_attention_heads",
    "fusion_intermediate_size",
)


def replaced_tower_settings(model_args: ModelArguments) -> tuple[str, ...]:
    """The settings of [`FROM_VISION_TOWER`] / [`FROM_TEXT_TOWER`] whose tower `--vision_model_name_or_path` /
    `--text_model_name_or_path` replace."""
    return (FROM_VISION_TOWER if model_args.vision_model_name_or_path else ()) + (
        FROM_TEXT_TOWER if model_args.text_model_name_or_path else ()
    )


def build_config(
    model_args: ModelArguments,
    image_size: int,
    vocab_size: int,
    max_length: int,
    labels: list[str] | None,
    leave_out: tuple[str, ...] = (),
) -> MMFusionConfig:
    """An MMFusionConfig for towers built from scratch (ResNet / ConvNeXt / small ViT + BERT) from the size arguments,
    with the model preset's settings ([`preset_settings`]) and then `--config_overrides` (but for the keys of
    `leave_out`) on top."""
    from transformers import BertConfig, ConvNextConfig, ResNetConfig, ViTConfig

    h, p = model_args.hidden_size, model_args.dropout
    tower = dict(
        hidden_size=h,
        num_attention_heads=model_args.num_attention_heads,
        intermediate_size=model_args.mlp_ratio * h,
        hidden_dropout_prob=p,
        attention_probs_dropout_prob=0.0,
    )
    widths = [int(w) for w in model_args.vision_widths.split(",")]
    depths = [model_args.vision_depth] * len(widths)
    if model_args.vision_tower == "resnet":  # basic blocks; stem 7x7 stride 2 + max-pool, then stride 2 per stage
        vision = ResNetConfig(
            image_size=image_size, embedding_size=widths[0], hidden_sizes=widths, depths=depths, layer_type="basic"
        )
    elif model_args.vision_tower == "convnext":  # 4x4 patchify stem, then stride 2 per stage
        vision = ConvNextConfig(
            image_size=image_size, num_stages=len(widths), hidden_sizes=widths, depths=depths, drop_path_rate=0.0
        )
    else:
        vision = ViTConfig(
            image_size=image_size,
            patch_size=model_args.patch_size,
            num_hidden_layers=model_args.vision_layers,
            **tower,
        )
    text = BertConfig(
        vocab_size=vocab_size,
        num_hidden_layers=model_args.text_layers,
        max_position_embeddings=max(max_length, 8),
        **tower,
    )
    kwargs = dict(
        vision_config=vision,
        text_config=text,
        fusion_type=model_args.fusion_type,
        fusion_direction=model_args.fusion_direction,
        num_fusion_layers=model_args.fusion_layers,
        fusion_intermediate_size=model_args.mlp_ratio * h,
        joint_pooling=model_args.joint_pooling,
        fusion_dropout=p,
        classifier_dropout=p,
        projection_dim=h,
        itm_loss_weight=model_args.itm_loss_weight,
    )
    if labels is not None:
        kwargs.update(id2label=dict(enumerate(labels)), label2id={name: i for i, name in enumerate(labels)})
    overrides = {k: v for k, v in parse_overrides(model_args.config_overrides).items() if k not in leave_out}
    kwargs.update({k: v for k, v in preset_settings(model_args, overrides).items() if k not in leave_out})
    kwargs.update(overrides)
    return MMFusionConfig(**kwargs)


def preset_settings(model_args: ModelArguments, overrides: dict) -> dict:
    """The MMFusionConfig settings of the run's model preset (`--model_config`) that `--config_overrides` does not
    name: its `config`, and its `conv_tower_config` where the run's tower takes it ([`conv_tower_settings`])."""
    preset = load_model_preset(model_args.model_config)
    settings = {k: v for k, v in preset.get("config", {}).items() if k not in overrides}
    return settings | conv_tower_settings(preset, model_args, overrides)


# The keys `--config_overrides` may set: MMFusionConfig's fields, and the two settings `init_scheme` replaced, which it
# still reads (its `__init__` takes any other keyword silently, as every `PreTrainedConfig` does).
EARLIER_CONFIG_KEYS = ("fusion_init", "vision_film_init")


def check_config_overrides(model_args: ModelArguments, image_size: int | None, max_length: int) -> dict:
    """
    `--config_overrides` and the model preset's settings (`--model_config`) checked with the other arguments, before
    any data is read: every key must be an MMFusionConfig setting (the closest one is suggested), and the config of
    towers built from scratch must accept the values (with a pretrained tower, the values are checked against it
    when it is loaded). Raises a one-line `ValueError`; returns the overrides.
    """
    import dataclasses
    import difflib

    overrides = parse_overrides(model_args.config_overrides)
    if model_args.model_name_or_path:
        if overrides:
            raise ValueError(
                f"--config_overrides sets the config of a new model, but --model_name_or_path "
                f"{model_args.model_name_or_path} brings its own: drop --config_overrides "
                f"{model_args.config_overrides!r}."
            )
        return overrides
    preset = load_model_preset(model_args.model_config)
    known = sorted({f.name for f in dataclasses.fields(MMFusionConfig)} | set(EARLIER_CONFIG_KEYS))
    given = [("--config_overrides", overrides)] + [
        (f"--model_config {preset['path']} ({part})", preset.get(part, {})) for part in ("config", "conv_tower_config")
    ]
    for where, settings in given:
        for key in settings:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else "MMFusionConfig's docstring lists them."
                raise ValueError(f"{where}: {key!r} is not an MMFusionConfig setting; {hint}")
    if model_args.vision_model_name_or_path or model_args.text_model_name_or_path:
        return overrides  # the values are checked against the pretrained tower when it is loaded
    labels = None if model_args.task == "pretrain" else ["a", "b"]
    try:
        build_config(model_args, image_size or 64, model_args.vocab_size, max_length, labels,
                     leave_out=replaced_tower_settings(model_args))  # fmt: skip
    except Exception as err:  # the config's own validation: a strict field's type, a value out of its range
        given = f"--config_overrides {model_args.config_overrides!r}" if overrides else "the model settings"
        message = " ".join(str(err).split())
        raise ValueError(f"{given} (--model_config {model_args.model_config}): {message}") from None
    return overrides


# Why the default preset's `conv_tower_config` sets what it does (model_configs/default.json): a convolutional tower's
# stages read the question by cross-attention, the layers outside the towers are drawn as PyTorch draws them, and the
# tower's tokens enter the fusion without a second Linear: without all three the cross-attention fusion learns which
# shapes and how many, but not where an object named by its colour is (results:
# scripts/research/results/sort_of_clevr_ladder.md).


def model_class(task: str):
    """The head for a task."""
    from ..modeling_mm_fusion import MMFusionForImageTextClassification, MMFusionForPretraining

    return MMFusionForPretraining if task == "pretrain" else MMFusionForImageTextClassification
