"""The arguments of `scripts/train.py`: three dataclasses, and [`MMFusionArgumentParser`] that reads them from flags
and / or a YAML / JSON config file."""

import dataclasses
import difflib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from pathlib import Path

import torch
from transformers import TrainingArguments

from ..cli import ScriptArgumentParser
from ..lora import QUERY_VALUE
from .callbacks import progress_bars_shown
from .model_presets import DEFAULT_PRESET, load_model_preset, preset_names


TASKS = ("vqa", "classify", "pretrain")
VISION_TOWERS = ("vit", "resnet", "convnext")
# The evaluation metric each task is judged by (`metric_for_best_model` of early stopping, the printed result).
MAIN_METRICS = {"vqa": "accuracy", "classify": "accuracy", "pretrain": "mean_recall"}
ABLATIONS = ("none", "image_only", "text_only")
AUGMENTATIONS = ("none", "photo", "flips")
DEFAULT_LEARNING_RATE = 5e-4
# --lora's learning rate when --learning_rate is not given, by --lora_target_modules: the rates that came within 0.01
# of full fine-tuning on the MobileNetV2 + MiniLM composition (scripts/benchmarks/results/lora*.md); fewer adapted
# layers learn less per step and take a higher rate.
LORA_LEARNING_RATE = 2e-3
LORA_ALL_LAYERS_LEARNING_RATE = 1e-3
# --lora's checkpointing: every N-th layer recomputes its activations in the backward (Trainer's
# `activation_checkpointing_kwargs` `every_n_layers`), the others keep theirs.
LORA_CHECKPOINT_EVERY_N_LAYERS = 2
# The default run's model: `ModelArguments`' defaults for the options it sets (mm_fusion/training/model_configs/).
DEFAULT_MODEL = load_model_preset(DEFAULT_PRESET)["model"]


def cpu_threads(requested: int | None, env=os.environ) -> int | None:
    """
    The torch threads a CPU training process should use, or `None` to leave torch's own setting.

    `accelerate launch` without `--num_cpu_threads_per_process` (and without a config that sets it) exports
    `OMP_NUM_THREADS=1` to a single CPU process, which leaves torch one core: on a two-core machine, about 2/3 of the
    speed of the same run under `python`. Where that launcher default is seen, the physical cores are shared out
    between the processes of this machine instead. An explicit `requested` count always wins; `OMP_NUM_THREADS` set
    to anything else, or not by accelerate, is the user's choice and is kept.
    """
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--cpu_threads must be at least 1, got {requested}.")
        return requested
    if env.get("OMP_NUM_THREADS") != "1" or "ACCELERATE_DYNAMO_BACKEND" not in env:  # not accelerate's default
        return None
    import psutil  # a dependency of accelerate

    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return max(1, cores // int(env.get("LOCAL_WORLD_SIZE", "1")))


@dataclass
class ModelArguments:
    task: str = field(
        default="vqa",
        metadata={
            "help": "vqa: answer classification (default); classify: any image-text classification; pretrain: "
            "contrastive (ITC) + matching (ITM) pretraining, evaluated by retrieval Recall@K."
        },
    )
    model_config: str = field(
        default=DEFAULT_PRESET,
        metadata={
            "help": f"A model preset: {', '.join(preset_names())} (mm_fusion/training/model_configs/), or a JSON / "
            "YAML file of the same form. Its `model` values are the defaults of the options of those names (flags "
            "win), its `config` / `conv_tower_config` MMFusionConfig settings (--config_overrides win). The defaults "
            f"shown below are {DEFAULT_PRESET!r}'s, the default run's model."
        },
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "An MMFusion checkpoint (directory or hub id) to start from."}
    )
    vision_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A pretrained vision tower (e.g. a ViT / CLIP vision / SigLIP checkpoint)."}
    )
    text_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A pretrained text tower (e.g. a BERT checkpoint); its tokenizer is used."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Tokenizer to use. By default: the text tower's, or one trained on the training texts."},
    )
    vocab_size: int = field(default=8000, metadata={"help": "Upper bound of a tokenizer trained on the texts."})
    fusion_type: str = field(
        default=DEFAULT_MODEL["fusion_type"], metadata={"help": "hierarchical, cross_attention or late."}
    )
    fusion_direction: str = field(
        default=DEFAULT_MODEL["fusion_direction"],
        metadata={
            "help": "text_to_image (image keys / values computed once per image and shared by its texts: with "
            "batches grouped by image, the fusion then costs a fraction) or bidirectional (co-attention)."
        },
    )
    vision_tower: str = field(
        default=DEFAULT_MODEL["vision_tower"],
        metadata={
            "help": (
                "The vision tower built from scratch: resnet or convnext (a backbone of --vision_widths stages whose "
                "feature maps become tokens; with cross-attention fusion and vqa / classify, its stages read the "
                "question), or vit (--vision_layers layers of --patch_size patches)."
            ),
        },
    )
    vision_widths: str = field(
        default=DEFAULT_MODEL["vision_widths"],
        metadata={"help": "resnet / convnext: the channels of each stage, comma-separated (one stage each)."},
    )
    vision_depth: int = field(
        default=DEFAULT_MODEL["vision_depth"], metadata={"help": "resnet / convnext: blocks per stage."}
    )
    hidden_size: int = field(
        default=DEFAULT_MODEL["hidden_size"],
        metadata={"help": "Width of towers built from scratch and of the fusion."},
    )
    num_attention_heads: int = field(
        default=DEFAULT_MODEL["num_attention_heads"],
        metadata={"help": "Attention heads of towers built from scratch."},
    )
    vision_layers: int = field(
        default=DEFAULT_MODEL["vision_layers"], metadata={"help": "Layers of a vision tower built from scratch."}
    )
    text_layers: int = field(
        default=DEFAULT_MODEL["text_layers"], metadata={"help": "Layers of a text tower built from scratch."}
    )
    fusion_layers: int = field(
        default=DEFAULT_MODEL["fusion_layers"],
        metadata={
            "help": "Co-attention layers (ignored by late fusion). The default model's one layer reads the tower's "
            "last stage: its steps took 0.84x the time of two layers', and on easy-VQA its yes / no colour questions "
            "were at 0.978 or more by epoch 2 on seeds 0-4 and 42 "
            "(scripts/benchmarks/results/easy_vqa_schedule_ladder.md)."
        },
    )
    joint_pooling: str = field(
        default=DEFAULT_MODEL["joint_pooling"],
        metadata={
            "help": "What the head reads after cross-attention fusion: concat_product (pooled text, pooled image and "
            "their product, a direct interaction term for the head), concat, or text (the pooled text stream alone: "
            "the image reaches the head only through the cross-attention)."
        },
    )
    mlp_ratio: int = field(
        default=DEFAULT_MODEL["mlp_ratio"],
        metadata={"help": "Feed-forward width of towers built from scratch and of the fusion, x hidden_size."},
    )
    patch_size: int = field(
        default=DEFAULT_MODEL["patch_size"], metadata={"help": "Patch size of a vision tower built from scratch."}
    )
    dropout: float = field(
        default=DEFAULT_MODEL["dropout"], metadata={"help": "Dropout of towers built from scratch and of the fusion."}
    )
    itm_loss_weight: float = field(default=1.0, metadata={"help": "pretrain: weight of the ITM loss (0 = ITC only)."})
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "Extra MMFusionConfig settings, as `key=value,key=value` (e.g. `projection_dim=64`)."},
    )
    freeze_vision_model: bool = field(
        default=False,
        metadata={
            "help": "Keep the vision tower's weights as they are (no gradients, no optimizer states); a tower with "
            "nothing to train runs in eval mode (no dropout, batch-norm statistics kept)."
        },
    )
    freeze_vision_stages: int = field(
        default=0,
        metadata={
            "help": "Keep the weights that compute a backbone / convolutional vision tower's first N stages (the stem "
            "and stages 0 to N-1, as --vision_stages counts them) as they are, their batch norms in eval mode; the "
            "backward stops before them. 0: none."
        },
    )
    vision_batch_norm_momentum: float | None = field(
        default=None,
        metadata={
            "help": "The momentum of the vision tower's batch-norm running statistics while it trains (PyTorch's "
            "convention: the weight of each batch). Default: the tower's own (transformers' MobileNetV2 hard-codes "
            "0.997, so its statistics are nearly the last batch's)."
        },
    )
    freeze_text_model: bool | None = field(
        default=None,
        metadata={
            "help": "Keep the text tower's weights as they are, as --freeze_vision_model; a frozen text tower also "
            "encodes each distinct text once, and keeps the encodings for later batches (the model's text_cache). "
            "Default: frozen when it is a pretrained tower (--text_model_name_or_path) and --lora is off: with 1,000 "
            "Fashion-MNIST photos it took MiniLM's composition from 0.899 to 0.908 in the same time (one seed), each "
            "step 2.4x faster "
            "(scripts/benchmarks/RESULTS.md, benchmark_composition.py); --freeze_text_model False trains it."
        },
    )
    lora: bool = field(
        default=False,
        metadata={
            "help": "Train LoRA adapters (peft, the [lora] extra) on --lora_parts and freeze the rest of the model it "
            "starts from, but for the heads and a fusion block not in --lora_parts, which train fully. output_dir "
            "holds that model with the adapter beside it (see mm_fusion/lora.py)."
        },
    )
    lora_parts: str = field(
        default="vision,text",
        metadata={"help": "--lora: the parts given adapters, comma-separated: vision, text, fusion."},
    )
    lora_target_modules: str = field(
        default=QUERY_VALUE,
        metadata={
            "help": "--lora: the layers of --lora_parts adapted. Default: query_value, the attention's query and "
            "value where a part has them (as peft does for these models), every layer of a convolutional tower. all: "
            "every Linear and ungrouped Conv2d layer, which learns more per step but at ViT-B/16 + BERT-base size "
            "made a step 1.13-1.32x full fine-tuning's against 0.94-1.05x (scripts/benchmarks/RESULTS.md). Or "
            "names, comma-separated (the last part of a layer's path), each part holding one of them: query,value for "
            "a BERT tower, q_proj,v_proj for a ViT tower and the fusion block."
        },
    )
    lora_r: int = field(default=8, metadata={"help": "--lora: the adapters' rank."})
    lora_alpha: int = field(default=16, metadata={"help": "--lora: the adapters' scale numerator (scale alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "--lora: dropout on the adapters' input."})
    lora_gradient_checkpointing: bool = field(
        default=True,
        metadata={
            "help": "--lora: turn on --activation_checkpointing on every second layer of the towers and the fusion "
            "block (their activations recomputed in the backward instead of kept; --activation_checkpointing_kwargs "
            "'{\"every_n_layers\": 1}' checkpoints every layer). The frozen towers keep as many activations as full "
            "fine-tuning does, so without it LoRA saves only the optimizer states and gradients of the frozen "
            "weights. At ViT-B/16 + BERT-base size, adapters on query and value (the default), every second layer "
            "took LoRA's peak memory to 0.49x full fine-tuning's at 0.94-1.05x its step time over four runs, every "
            "layer to 0.41x at 1.14x; adapters on every layer, every second layer, 0.54-0.55x at 1.13-1.32x "
            "(scripts/benchmarks/results/lora_memory.md). False: faster steps, more memory."
        },
    )

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}.")
        if self.vision_tower not in VISION_TOWERS:
            raise ValueError(f"--vision_tower must be one of {', '.join(VISION_TOWERS)}, got {self.vision_tower!r}.")
        try:
            widths = [int(w) for w in self.vision_widths.split(",")]
        except ValueError:
            widths = []
        if not widths or min(widths) < 1:
            raise ValueError(
                f"--vision_widths must be positive integers, comma-separated; got {self.vision_widths!r}."
            )
        if self.lora and (self.freeze_vision_model or self.freeze_text_model):
            # An explicit freeze; left at its default, the text tower is LoRA's to adapt or freeze (below).
            raise ValueError(
                "--lora already freezes every tower (those outside --lora_parts stay as they are): drop "
                "--freeze_vision_model / --freeze_text_model, and choose the adapted towers with --lora_parts."
            )
        if self.vision_batch_norm_momentum is not None and not 0 < self.vision_batch_norm_momentum <= 1:
            raise ValueError(f"--vision_batch_norm_momentum must be in (0, 1], got {self.vision_batch_norm_momentum}.")
        if self.freeze_vision_stages < 0:
            raise ValueError(f"--freeze_vision_stages must be 0 or more, got {self.freeze_vision_stages}.")
        if self.freeze_vision_stages and (self.freeze_vision_model or self.lora):
            raise ValueError(
                "--freeze_vision_stages freezes part of a trained vision tower: drop it with --freeze_vision_model "
                "(the whole tower is frozen) or --lora (every tower is)."
            )
        if self.freeze_text_model is None:
            self.freeze_text_model = self.text_model_name_or_path is not None and not self.lora
        if self.lora:
            from ..lora import parse_parts

            parse_parts(self.lora_parts)
            if importlib.util.find_spec("peft") is None:
                raise ValueError('--lora needs peft: pip install "mm-fusion[lora]" (or pip install peft).')
            if self.lora_r < 1:
                raise ValueError(f"--lora_r must be 1 or more, got {self.lora_r}.")


@dataclass
class DataArguments:
    dataset: str = field(
        default="easy_vqa",
        metadata={
            "help": "easy_vqa (bundled, offline), sort_of_clevr (relational VQA and captions, generated offline; "
            "see mm_fusion.data.load_sort_of_clevr), fashion_mnist (real product photos with questions or captions, "
            "from Debian's dataset-fashion-mnist; mm_fusion.data.load_fashion_mnist), a json/jsonl/csv file of pairs, "
            "an imagefolder directory with metadata.jsonl, or a hub dataset name."
        },
    )
    dataset_options: str | None = field(
        default=None,
        metadata={
            "help": "sort_of_clevr / fashion_mnist: options as key=value,key=value (num_train_images=5000,seed=1; "
            "root=DIR,max_images=1000): the arguments of mm_fusion.data.load_sort_of_clevr / load_fashion_mnist."
        },
    )
    eval_group_columns: str | None = field(
        default=None,
        metadata={
            "help": "vqa / classify: also report evaluation accuracy per value of these columns (comma-separated), "
            "as eval_accuracy_<value>. sort_of_clevr default: question_type,question_family."
        },
    )
    eval_dataset: str | None = field(
        default=None, metadata={"help": "A separate file / directory of evaluation pairs (same columns)."}
    )
    train_split: str = field(default="train", metadata={"help": "Training split of a hub / easy_vqa dataset."})
    eval_split: str | None = field(
        default="test", metadata={"help": "Evaluation split of a hub / easy_vqa dataset (empty: none)."}
    )
    validation_split_percentage: int | None = field(
        default=None, metadata={"help": "Without an evaluation set: hold out this percentage of the training pairs."}
    )
    image_column: str | None = field(default=None, metadata={"help": "Image column (easy_vqa: image)."})
    text_column: str | None = field(default=None, metadata={"help": "Text column (easy_vqa: question)."})
    label_column: str | None = field(default=None, metadata={"help": "Label column for vqa / classify."})
    id_column: str | None = field(default=None, metadata={"help": "Unique id column (default: the row number)."})
    data_root: str | None = field(default=None, metadata={"help": "Directory relative image paths are under."})
    image_size: int | None = field(
        default=None, metadata={"help": "Images are resized to this (default: the vision tower's image_size, 64)."}
    )
    max_length: int = field(default=64, metadata={"help": "Texts are truncated to this many tokens."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training pairs."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N evaluation pairs."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "num_proc of the cached maps."})
    on_bad_sample: str = field(default="skip", metadata={"help": "skip (quarantine report) or error."})
    max_bad_fraction: float = field(
        default=0.1,
        metadata={
            "help": "Stop before training when more than this fraction of the training or evaluation rows is "
            "unusable (a missing image, a null label...: output_dir/quarantine.jsonl lists them), with one line that "
            "names the most common reason and its likely cause. 1: train on whatever is left (never on nothing)."
        },
    )
    check_data: bool = field(
        default=False,
        metadata={
            "help": "Check the data without training: load and validate it exactly as this command would train on "
            "it, print a report (rows, classes and their counts, rows left out by reason with examples, image "
            "sizes), write output_dir/quarantine.jsonl and exit: 0 when it would train, 2 when it would refuse."
        },
    )
    augment: str = field(
        default="none",
        metadata={
            "help": "Random changes of the training images, drawn anew every batch: none; photo (photographs: a "
            "horizontal flip half the time and a shift of up to an eighth of the side, the edge pixels repeated); "
            "flips (pictures without an up or a left: horizontal and vertical flips). Not for questions about left "
            "and right or top and bottom, whose answers a flip changes."
        },
    )
    ablation: str = field(
        default="none",
        metadata={"help": "none; image_only (texts blanked to [CLS] [SEP]); text_only (images blanked to black)."},
    )

    streaming: bool = field(
        default=False,
        metadata={
            "help": (
                "Stream --dataset (webdataset .tar shards, .jsonl files or a load_dataset source) instead of caching "
                "it: each shard is validated as it is read (report in output_dir/quarantine/), each rank reads its "
                "own shards, and --max_steps sets the run's length."
            ),
        },
    )
    shuffle_buffer_size: int = field(
        default=1000,
        metadata={
            "help": "--streaming: rows in each process's shuffle buffer (exactly resumable); 0 or 1: rows in shard "
            "order (the order of the shards is still shuffled each pass)."
        },
    )
    class_names: str | None = field(
        default=None,
        metadata={
            "help": "--streaming with vqa / classify: the class names, comma-separated, or a file with one per line "
            "(a stream cannot be scanned for them up front). Labels in the data are names or class indices."
        },
    )
    image_format: str = field(
        default="auto",
        metadata={
            "help": "How the preprocessed images are stored: uint8 (raw), jpeg (quality 90, 4:4:4; lossy, much "
            "smaller), webp (lossless) or auto: uint8 up to 8 GiB of raw images, JPEG above. With --streaming, how "
            "images travel from the loader's workers (auto: uint8)."
        },
    )

    def __post_init__(self):
        if self.image_format not in ("auto", "uint8", "jpeg", "webp"):
            raise ValueError(f"--image_format must be auto, uint8, jpeg or webp, got {self.image_format!r}.")
        if self.augment not in AUGMENTATIONS:
            raise ValueError(f"--augment must be one of {', '.join(AUGMENTATIONS)}, got {self.augment!r}.")
        if self.ablation not in ABLATIONS:
            raise ValueError(f"--ablation must be one of {', '.join(ABLATIONS)}, got {self.ablation!r}.")
        if self.eval_split == "":
            self.eval_split = None
        if not 0 <= self.max_bad_fraction <= 1:
            raise ValueError(f"--max_bad_fraction must be a fraction from 0 to 1, got {self.max_bad_fraction}.")
        if self.shuffle_buffer_size < 0:
            raise ValueError(
                f"--shuffle_buffer_size must be a number of rows, 0 or more (0: no shuffle buffer), got "
                f"{self.shuffle_buffer_size}."
            )


@dataclass
class MMFusionTrainingArguments(TrainingArguments):
    """`TrainingArguments` with defaults for this task and a few additions (marked below)."""

    output_dir: str | None = field(
        default="outputs/easy_vqa", metadata={"help": "Where checkpoints and the model go."}
    )
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Must stay False: the collator reads the image rows and keys of each pair."}
    )
    learning_rate: float | None = field(
        default=None,
        metadata={
            "help": f"Peak AdamW learning rate. Default: {DEFAULT_LEARNING_RATE:g}; with --lora "
            f"{LORA_LEARNING_RATE:g} ({LORA_ALL_LAYERS_LEARNING_RATE:g} with --lora_target_modules other than "
            "query_value): the rates at which LoRA came within 0.01 of full fine-tuning on the MobileNetV2 + MiniLM "
            "easy-VQA composition (scripts/benchmarks/RESULTS.md, benchmark_lora.py)."
        },
    )
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay."})
    warmup_steps: float = field(default=0.05, metadata={"help": "Warm-up steps (a float < 1: a fraction)."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule."})
    num_train_epochs: float = field(
        default=3.0,
        metadata={
            "help": "Training epochs. The default model (one fusion layer) passed 0.995 on seeds 0-4 and 42 at 3 "
            "epochs (worst 0.9972), at 3.5 (worst 0.9980, 1.17x the time) and at 4 (worst 0.9992) "
            "(scripts/benchmarks/results/benchmark_training.md)."
        },
    )
    max_grad_norm: float = field(
        default=1.0,
        metadata={
            "help": "Gradient clipping norm (0: none). With two fusion layers, 3.5 epochs at 7e-4 clipped at 5 left "
            "the README's command (seed 42) at 0.988 (scripts/benchmarks/results/easy_vqa_schedule_ladder.md)."
        },
    )
    per_device_train_batch_size: int = field(default=64, metadata={"help": "Pairs per device per step."})
    per_device_eval_batch_size: int = field(default=256, metadata={"help": "Pairs per device per evaluation step."})
    eval_strategy: str = field(default="steps", metadata={"help": "When to evaluate: no, steps or epoch."})
    eval_steps: float | None = field(
        default=0.5, metadata={"help": "Evaluate every N steps (a float < 1: a fraction of the run)."}
    )
    save_strategy: str = field(default="steps", metadata={"help": "When to checkpoint: no, steps or epoch."})
    save_steps: float = field(default=0.5, metadata={"help": "Checkpoint every N steps (< 1: a fraction)."})
    save_total_limit: int | None = field(default=2, metadata={"help": "Checkpoints kept."})
    logging_steps: float = field(default=50, metadata={"help": "Log every N steps."})
    disable_tqdm: bool | None = field(
        default=None,
        metadata={
            "help": "No progress bars (Trainer's, datasets' and saving's): the logs' metrics are printed as they "
            "come, and a line every 5%% of the steps says where the run stands. Default: bars on a terminal or in a "
            "notebook, lines when the output goes to a file (CI, nohup, Slurm), where each redraw would stay."
        },
    )
    report_to: None | str | list[str] = field(default="none", metadata={"help": "tensorboard, wandb, ... or none."})
    dataloader_num_workers: int = field(
        default=-1,
        metadata={
            "help": "DataLoader workers; -1 sizes it to the machine: 0 without an accelerator (the collator only "
            "copies from the memory-mapped cache, which worker hand-off would slow down), else up to 4 per device."
        },
    )
    # Additions.
    group_by_image: bool | None = field(
        default=None,
        metadata={
            "help": "Order the pairs image by image in runs of --image_group_size, so that the pairs of an image "
            "share a batch and its image is encoded once (when the tower reads the text, vision_text_attention or "
            "vision_film: its stem and first stage). Default: on for vqa / classify, off for pretrain (the pairs of "
            "one image would be each other's contrastive negatives)."
        },
    )
    image_group_size: int = field(
        default=1,
        metadata={
            "help": "With group_by_image: at most this many pairs of one image in a row (0: all of them; 1, the "
            "default: a random order). Larger values share more image encoding; smaller put more distinct images in "
            "each batch, which the default easy-VQA recipe learns faster from (scripts/benchmarks/results/"
            "easy_vqa_schedule_ladder.md)."
        },
    )
    early_stopping_patience: int | None = field(
        default=None, metadata={"help": "Stop after this many evaluations without improvement (keeps the best)."}
    )
    recalibrate_batch_norms: int | None = field(
        default=None,
        metadata={
            "help": "At the last step, before its evaluation and checkpoint, set the running statistics of the batch "
            "norms that train to their average over this many training batches at the final weights (0: never). "
            "Default: 30 when a tower's batch norms keep nearly only the last batch's statistics (a momentum above "
            "0.5: transformers' MobileNetV2 hard-codes 0.997, EfficientNet's config 0.99), else 0."
        },
    )
    data_wait_warning: float = field(
        default=0.2, metadata={"help": "Warn when more than this fraction of step time waits for data."}
    )
    peak_tflops: float | None = field(
        default=None, metadata={"help": "Peak TFLOP/s of one device for the MFU (default: looked up by GPU name)."}
    )
    itc_grad_cache: bool = field(
        default=True,
        metadata={
            "help": "pretrain with gradient_accumulation_steps > 1: the contrastive (ITC) loss of each optimizer "
            "step contrasts the pairs of all its micro-batches on all processes, with the gradients of one big batch "
            "and the activation memory of one micro-batch (one extra forward pass per micro-batch); off: each "
            "micro-batch's pairs only."
        },
    )
    vision_tower_lr_scale: float = field(
        default=1.0,
        metadata={
            "help": "The vision tower's learning rate as a fraction of --learning_rate, on the same schedule (for a "
            "pretrained tower, --vision_model_name_or_path; 1 trains every part alike)."
        },
    )
    text_tower_lr_scale: float = field(
        default=1.0,
        metadata={
            "help": "The text tower's learning rate as a fraction of --learning_rate, on the same schedule "
            "(sort_of_clevr.yaml and sort_of_clevr_hierarchical.yaml set 0.1 for a text tower trained from scratch; "
            "1 trains every part alike)."
        },
    )
    batch_size_ramp_max: int | None = field(
        default=None,
        metadata={
            "help": (
                "Grow the per-device batch by per_device_train_batch_size every epoch (or --batch_size_ramp_steps "
                "steps) up to this; --learning_rate is the largest batch's, scaled by --batch_size_ramp_lr."
            ),
        },
    )
    batch_size_ramp_steps: int = field(
        default=0, metadata={"help": "With --batch_size_ramp_max: grow every N optimizer steps (0: every epoch)."}
    )
    batch_size_ramp_lr: str = field(
        default="linear", metadata={"help": "With --batch_size_ramp_max: lr x size/max (linear), its sqrt, or none."}
    )
    cpu_threads: int | None = field(
        default=None,
        metadata={
            "help": "torch threads per process when training on CPU. Default: torch's own (OMP_NUM_THREADS), except "
            "that the OMP_NUM_THREADS=1 which `accelerate launch` sets when not told otherwise is replaced by the "
            "physical cores divided by the processes on this machine."
        },
    )
    release_freed_memory: bool | None = field(
        default=None,
        metadata={
            "help": "Linux (glibc): give each block over 64 KiB that training frees back to the system at once "
            "(mallopt's M_MMAP_THRESHOLD, as MALLOC_MMAP_THRESHOLD_=65536 does), so the process's memory follows the "
            "tensors alive instead of keeping what each step freed. Default: on with --lora, whose memory it is "
            "for (its peak 0.66 of full fine-tuning's without, 0.44 with: scripts/benchmarks/results/lora_memory.md), "
            "off otherwise."
        },
    )

    def __post_init__(self):
        if self.disable_tqdm is None and not progress_bars_shown():
            # A file, not a terminal: each redraw of a bar would stay in it. Progress is logged as lines instead
            # (MMFusionProgressLogCallback); a `--disable_tqdm` given either way is kept.
            self.disable_tqdm = True
        # None: the default, which `--lora` changes (settle_arguments); TrainingArguments needs a number meanwhile.
        self.learning_rate_is_default = self.learning_rate is None
        if self.learning_rate is None:
            self.learning_rate = DEFAULT_LEARNING_RATE
        has_accelerator = torch.accelerator.is_available() and not self.use_cpu
        if self.dataloader_num_workers == -1:
            if has_accelerator:
                devices = max(1, torch.accelerator.device_count())
                self.dataloader_num_workers = min(4, max(1, (os.cpu_count() or 1) // devices - 1))
                self.dataloader_persistent_workers = True
            else:
                self.dataloader_num_workers = 0
        if not has_accelerator:
            self.dataloader_pin_memory = False  # pinned host memory only helps copies to an accelerator
        for role in ("vision", "text"):
            scale = getattr(self, f"{role}_tower_lr_scale")
            if not scale > 0:
                raise ValueError(
                    f"{role}_tower_lr_scale must be > 0 (a fraction of learning_rate), got {scale}; to keep the "
                    f"{role} tower as it is, freeze it instead (--freeze_{role}_model)."
                )
        if self.batch_size_ramp_max is not None:
            if self.gradient_accumulation_steps != 1:
                raise ValueError("--batch_size_ramp_max grows the batch itself: use gradient_accumulation_steps 1.")
            if self.group_by_image or self.train_sampling_strategy != "random" or self.auto_find_batch_size:
                raise ValueError(
                    "--batch_size_ramp_max draws its own random batches: no group_by_image, train_sampling_strategy "
                    "other than random, or auto_find_batch_size."
                )
            from .batch_ramp import BatchRamp

            BatchRamp(
                self.per_device_train_batch_size,
                self.batch_size_ramp_max,
                self.batch_size_ramp_steps,
                self.batch_size_ramp_lr,
            )  # fmt: skip  (checks the values)
        if self.image_group_size < 0:
            raise ValueError(f"--image_group_size must be 0 (no limit) or more, got {self.image_group_size}.")
        if self.group_by_image and self.train_sampling_strategy == "group_by_length":
            raise ValueError("group_by_image and train_sampling_strategy=group_by_length exclude each other.")
        # TrainingArguments would fill in the evaluation loss; scripts/train.py puts the task's metric there instead.
        self.metric_for_best_model_is_default = self.metric_for_best_model is None
        if self.recalibrate_batch_norms is not None and self.recalibrate_batch_norms < 0:
            count = self.recalibrate_batch_norms
            raise ValueError(f"--recalibrate_batch_norms must be 0 (never) or more, got {count}.")
        if self.early_stopping_patience is not None:
            self.load_best_model_at_end = True
            if self.save_strategy != self.eval_strategy:
                self.save_strategy = self.eval_strategy
        if self.fp16 and not has_accelerator:
            raise ValueError("fp16 needs a GPU; on CPU use --bf16 (autocast where the CPU supports it) or fp32.")
        if not has_accelerator:
            threads = cpu_threads(self.cpu_threads)
            if threads is not None:
                torch.set_num_threads(threads)
        if not torch.accelerator.is_available():
            # Needed for bf16 autocast on a CPU, and for a torchrun launch on CPUs to form one multi-CPU group
            # (otherwise each rank sets itself up as a lone process).
            self.use_cpu = True
        super().__post_init__()

    @cached_property
    def _setup_devices(self) -> torch.device:
        # TrainingArguments hands `ddp_timeout` to the process group only when not `use_cpu`; a multi-CPU run would
        # get gloo's 30-minute default, and a stalled rank would hang the others that long. The group is set up with
        # `ddp_timeout` here, and accelerate uses it as it is.
        distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if self.use_cpu and distributed and not torch.distributed.is_initialized():
            torch.distributed.init_process_group(
                backend=self.ddp_backend or "gloo", timeout=timedelta(seconds=self.ddp_timeout)
            )
        return TrainingArguments._setup_devices.func(self)


def check_streaming(model_args, data_args, training_args) -> None:
    """What a streaming run needs, as clear errors before any work: a length in steps, evaluation and checkpoints by
    steps (ranks end their passes at different times), and the class names of a classification task."""
    if training_args.max_steps is None or training_args.max_steps <= 0:
        raise ValueError(
            "--streaming needs --max_steps: a stream has no length to count epochs by, and ranks end their passes at "
            "different times."
        )
    for name in ("eval_strategy", "save_strategy"):
        if str(getattr(getattr(training_args, name), "value", getattr(training_args, name))) == "epoch":
            raise ValueError(f"--streaming: --{name} epoch has no meaning for a stream; use steps.")
    if model_args.task != "pretrain" and not data_args.class_names:
        raise ValueError(f"--streaming with task {model_args.task!r} needs --class_names (the class names).")
    if data_args.validation_split_percentage or data_args.max_train_samples:
        raise ValueError(
            "--validation_split_percentage / --max_train_samples need the whole data; with --streaming, "
            "give --eval_dataset and --max_steps."
        )
    if data_args.image_format == "auto":
        data_args.image_format = "uint8"  # a stream's images are in memory only (the shuffle buffer)
    if training_args.auto_find_batch_size or training_args.batch_size_ramp_max is not None:
        raise ValueError("--streaming does not take --auto_find_batch_size or --batch_size_ramp_max yet.")
    if training_args.group_by_image or training_args.train_sampling_strategy != "random":
        raise ValueError(
            "--streaming reads pairs in stream order (shuffled by a buffer): no group_by_image or "
            "train_sampling_strategy other than random."
        )


def training_defaults() -> dict:
    """`MMFusionTrainingArguments`' defaults by field name, as a run without arguments gets them: `learning_rate`'s
    None (the default, or `--lora`'s) resolved to `DEFAULT_LEARNING_RATE`."""
    defaults = {f.name: f.default for f in dataclasses.fields(MMFusionTrainingArguments)}
    return defaults | {"learning_rate": DEFAULT_LEARNING_RATE}


class MMFusionArgumentParser(ScriptArgumentParser):
    """
    `HfArgumentParser` over [`ModelArguments`], [`DataArguments`] and [`MMFusionTrainingArguments`] that also reads a
    config file, as trl's `TrlParser.parse_args_and_config` does. Abbreviations are refused: `--learning_rat` (or a
    config key `learning_rat`) is a one-line error that suggests `--learning_rate` (exit status 2, as argparse's).

    Example:

    ```python
    >>> from mm_fusion.training import MMFusionArgumentParser

    >>> model_args, data_args, training_args = MMFusionArgumentParser().parse_args_and_config(
    ...     ["scripts/configs/easy_vqa_full.yaml", "--num_train_epochs", "1"]
    ... )
    ```
    """

    def __init__(self, **kwargs):
        kwargs.setdefault("usage", "%(prog)s [CONFIG.yaml | CONFIG.json] [--option VALUE ...]")
        kwargs.setdefault(
            "description",
            "CONFIG.yaml / CONFIG.json, when given, comes first: its keys are the options below without their dashes "
            "(scripts/configs/ has examples), and flags after it override its values.",
        )
        super().__init__((ModelArguments, DataArguments, MMFusionTrainingArguments), **kwargs)

    def fail(self, error: BaseException | str, status: int = 1):
        """[`ScriptArgumentParser.fail`]; a usage or data error (status 2) is printed by the first process of a
        multi-process launch only: every rank meets the same one, and the user reads it once. A failure of the run
        itself is printed by the rank it happened on."""
        if status == 2 and int(os.environ.get("RANK", "0")) != 0:  # bad arguments or data: every rank meets them
            self.exit(status)
        super().fail(error, status)

    def parse_args_and_config(
        self, args: list[str] | None = None
    ) -> tuple[ModelArguments, DataArguments, MMFusionTrainingArguments]:
        """
        Flags, or a YAML / JSON file as the first argument with flags after it overriding its values (`args`: the
        command line without the program, `sys.argv[1:]` by default), parsed into the three dataclasses. Only parsed:
        [`settle_arguments`] then applies the rules across them ([`parse_arguments`] does both).
        """
        argv = list(sys.argv[1:] if args is None else args)
        if argv and argv[0].endswith((".yaml", ".yml", ".json")):
            argv = self._config_flags(Path(argv.pop(0))) + argv
        return self.parse_args_into_dataclasses(args=self._preset_flags(argv) + argv)

    def _preset_flags(self, argv: list[str]) -> list[str]:
        """The `model` values of the `--model_config` preset (the last one given) as flags, to go before `argv`'s:
        `argv`'s own win."""
        name = DEFAULT_PRESET
        for i, word in enumerate(argv):
            if word == "--model_config" and i + 1 < len(argv):
                name = argv[i + 1]
            elif word.startswith("--model_config="):
                name = word.split("=", 1)[1]
        try:
            preset = load_model_preset(name)
        except ValueError as err:
            self.error(str(err))
        known = {f.name for f in dataclasses.fields(ModelArguments) if f.init}
        flags = []
        for key, value in preset.get("model", {}).items():
            if key not in known or key in ("model_config", "config_overrides"):
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                self.error(
                    f"--model_config {preset['path']}: {key!r} is not a model option of scripts/train.py.{hint}"
                )
            flags += [f"--{key}", str(value)]
        return flags

    def _config_flags(self, path: Path) -> list[str]:
        """The options of a config file as flags; an unknown key is an error that suggests the closest option."""
        if not path.is_file():
            raise FileNotFoundError(f"Config file {path} does not exist.")
        if path.suffix == ".json":
            values = json.loads(path.read_text())
        else:
            import yaml

            values = yaml.safe_load(path.read_text())
        if not isinstance(values, dict):
            raise ValueError(f"Config file {path} must hold a mapping of option: value, got {type(values).__name__}.")
        known = {f.name for cls in self.dataclass_types for f in dataclasses.fields(cls) if f.init}
        flags = []
        for key, value in values.items():
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else " `--help` lists the options."
                self.error(f"config file {path}: {key!r} is not an option of scripts/train.py.{hint}")
            flags += [f"--{key}", *(map(str, value) if isinstance(value, list) else [str(value)])]
        return flags
