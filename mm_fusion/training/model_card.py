"""The model card of a training run: a Jinja template filled with the run's model, data, metrics and curves."""

import datetime
import json
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..lora import parse_parts


# The template of `model_cards/`, beside the package in a checkout (an editable install).
MODEL_CARD_TEMPLATE = Path(__file__).resolve().parents[2] / "model_cards" / "mm_fusion_model_card.md.j2"

CURVES_FILE = "training_curves.png"


def plot_training_curves(log_history: list[dict[str, Any]], path: str | Path, metric: str | None = None) -> bool:
    """
    Plot training loss (and evaluation loss) against steps, and the evaluation `metric` against steps, from
    `trainer.state.log_history`, into a PNG at `path`. Returns False (and writes nothing) when nothing was logged.
    """
    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    evals = [h for h in log_history if "eval_loss" in h and "step" in h]
    if not train and not evals:
        return False
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    key = f"eval_{metric}" if metric else None
    with_metric = key is not None and any(key in h for h in evals)
    fig, axes = plt.subplots(1, 2 if with_metric else 1, figsize=(11 if with_metric else 6, 4), squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot([h["step"] for h in evals], [h["eval_loss"] for h in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    if with_metric:
        ax = axes[0][1]
        points = [(h["step"], h[key]) for h in evals if key in h]
        ax.plot(*zip(*points), "o-", color="tab:green")
        ax.set_xlabel("step")
        ax.set_ylabel(f"eval {metric}")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def framework_versions() -> dict[str, str]:
    """Versions of the libraries a run used, for the card."""
    import accelerate
    import datasets
    import tokenizers
    import torch
    import transformers

    import mm_fusion

    return {
        "mm_fusion": mm_fusion.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets.__version__,
        "tokenizers": tokenizers.__version__,
        "python": platform.python_version(),
    }


def write_model_card(template_path: str | Path, output_dir: str | Path, context: dict[str, Any]) -> Path:
    """
    Render the Jinja template at `template_path` with `context` into `output_dir/README.md`, after plotting
    `context["log_history"]` into `output_dir/training_curves.png` (the card links it when it exists).
    """
    from jinja2 import Environment, FileSystemLoader, StrictUndefined

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    context = dict(context)
    context["curves"] = (
        CURVES_FILE
        if plot_training_curves(context.get("log_history", []), output_dir / CURVES_FILE, context.get("main_metric"))
        else None
    )
    context.setdefault("versions", framework_versions())
    template_path = Path(template_path)
    environment = Environment(
        loader=FileSystemLoader(template_path.parent), undefined=StrictUndefined, keep_trailing_newline=True
    )
    environment.filters["tojson"] = json.dumps
    card = environment.get_template(template_path.name).render(**context)
    path = output_dir / "README.md"
    path.write_text(card)
    return path


# Per task: its description, the hub's pipeline tag, the hub task of the evaluation results, the pipeline that serves
# it and the card's head. transformers 5 removed the `visual-question-answering` pipeline: a card with that tag makes
# `pipeline(model=repo)` fail on it, and the hub refuses tags outside its own list, so a classifier is tagged `other`
# and its pipeline task (`image-text-classification`, mm_fusion's own) is named in `tags` and in the card.
TASK_DESCRIPTIONS = {
    "vqa": (
        "visual question answering",
        None,
        "visual-question-answering",
        "image-text-classification",
        "classifier over the answers",
    ),
    "classify": (
        "image-text classification",
        None,
        "other",
        "image-text-classification",
        "classifier over the classes",
    ),
    "pretrain": (
        "image-text retrieval / matching",
        "zero-shot-image-classification",
        "zero-shot-image-classification",
        "image-text-retrieval",
        "contrastive (ITC) and matching (ITM)",
    ),
}
# Example texts of a card when the data gives none to decode.
FALLBACK_EXAMPLES = ("a photo", "a drawing")

FUSION_DESCRIPTIONS = {
    "hierarchical": "hierarchical cross-attention bridges (each fusion layer fed from its own tower layers)",
    "cross_attention": "a co-attention stack over the towers' final features",
    "late": "late fusion (pooled, projected tower features only; a dual encoder)",
}


def cpu_name() -> str:
    """The CPU's model as the kernel names it (/proc/cpuinfo's "model name"), else the platform's processor or
    architecture: figures of two machines of one architecture differ, so a card names the model."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> str:
    """The devices of this run, in words."""
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    return f"CPU ({cpu_name()}, {os.cpu_count()} cores)"


@dataclass
class MMFusionModelCard:
    """
    The card of a `scripts/train.py` run, which [`MMFusionTrainer`] writes (`model_card_writer=card.write`) at the end
    of training and on `push_to_hub`: the template filled from the run's arguments, its data and the trainer's final
    state ([`model_card_context`]).

    Args:
        model_args ([`ModelArguments`]), data_args ([`DataArguments`]): the run's arguments.
        prepared ([`PreparedData`]): the run's preprocessed pairs and quarantine.
        main_metric (`str`): the evaluation metric the card leads with.
        command (`list[str]`, *optional*): the arguments the run was started with (default: `sys.argv[1:]`).
        template (`str` or `Path`): the Jinja template.
    """

    model_args: Any
    data_args: Any
    prepared: Any
    main_metric: str
    command: list[str] | None = None
    template: str | Path = MODEL_CARD_TEMPLATE

    def write(self, trainer) -> Path:
        """Write `README.md` (and `training_curves.png`) into the trainer's `output_dir`; returns the card's path."""
        context = model_card_context(
            trainer, self.model_args, self.data_args, trainer.args, self.prepared, self.main_metric, self.command
        )
        return write_model_card(self.template, trainer.args.output_dir, context)


def model_card_context(
    trainer, model_args, data_args, training_args, prepared, main_metric: str, argv: list[str] | None
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
    description, pipeline_tag, index_task, pipeline_task, head = TASK_DESCRIPTIONS[task]
    train_pairs = prepared.pairs["train"]
    eval_pairs = prepared.pairs["eval"] if "eval" in prepared.pairs else None
    per_step = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
    global_batch = per_step * training_args.world_size
    # A stream has no length to count in advance: what training read of it, steps x global batch, is what is known.
    streamed = trainer.state.global_step * global_batch if data_args.streaming else None
    easy = data_args.dataset == "easy_vqa"
    precision = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "fp32"
    args = sys.argv[1:] if argv is None else argv
    auto_class = "AutoModelForPreTraining" if task == "pretrain" else "AutoModelForVisualQuestionAnswering"
    image_size = trainer.processing_class.image_processor.size["height"]  # what the model was trained on
    return {
        "model_name": os.path.basename(os.path.normpath(training_args.output_dir)),
        "task": task,
        "task_description": description,
        "pipeline_tag": pipeline_tag,
        "index_task": index_task,
        "pipeline_task": pipeline_task,
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
        "vision_description": describe_vision_tower(config, image_size),
        "image_size": image_size,
        "text": config.text_config,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "model_preset": None if model_args.model_name_or_path else model_args.model_config,
        "from_scratch": not (
            model_args.model_name_or_path or model_args.vision_model_name_or_path or model_args.text_model_name_or_path
        ),
        "tokenizer_trained": not (
            model_args.tokenizer_name_or_path or model_args.text_model_name_or_path or model_args.model_name_or_path
        ),
        "dataset_name": "easy-VQA" if easy else data_args.dataset,
        "dataset_id": None if easy or os.path.exists(data_args.dataset) else data_args.dataset,
        "dataset_description": (
            "easy-VQA (the `easy-vqa` PyPI package, MIT): 64x64 images of one coloured shape, questions about "
            "its shape, colour and presence, 13 answers."
            if easy
            else f"Pairs from `{data_args.dataset}`."
        ),
        "eval_split": data_args.eval_split if easy or data_args.eval_split else "eval",
        "streamed_pairs": streamed,
        "train_pairs": len(train_pairs) if streamed is None else None,
        "eval_pairs": len(eval_pairs) if eval_pairs is not None else 0,
        "train_images": len(set(train_pairs["image_index"])) if streamed is None else None,
        "quarantined": len(prepared.quarantine),
        "image_mean": [round(x, 3) for x in config.image_mean],
        "image_std": [round(x, 3) for x in config.image_std],
        "metrics": metrics,
        "main_metric": main_metric,
        "log_history": history,
        # The script as this process was started (by its launcher), or its equivalent for a run set up in code.
        "command": launch_command(args, script=sys.argv[0] if argv is None else "scripts/train.py"),
        "epochs": training_args.num_train_epochs,
        "steps": trainer.state.global_step,
        "global_batch_size": training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        * training_args.world_size,
        "learning_rate": training_args.learning_rate,
        "lr_scheduler": str(training_args.lr_scheduler_type).split(".")[-1].lower(),
        "weight_decay": training_args.weight_decay,
        "precision": precision,
        "batching": batching(training_args),
        "hardware": f"{hardware()}, {training_args.world_size} process(es)",
        "date": datetime.date.today().isoformat(),
        "train_runtime": train.get("train_runtime", 0.0),
        "train_loss": train.get("train_loss"),
        "resumed_from_step": getattr(trainer, "resumed_from_step", None),
        "train_samples_per_second": train.get("train_samples_per_second", 0.0),
        "repo_or_path": training_args.hub_model_id or training_args.output_dir,
        "auto_class": auto_class,
        "example_texts": example_texts(prepared.pairs, trainer.processing_class.tokenizer),
        "lora": lora_summary(trainer.model, model_args, training_args.output_dir) if model_args.lora else None,
    }


def lora_summary(model, model_args, output_dir: str) -> dict:
    """What the card says of a `--lora` run's adapter: its settings, what trained fully, the parameters trained and
    the adapter file's size (written by `save_model`, before the card)."""
    config = model.peft_config["default"]
    adapter = Path(output_dir) / "adapter_model.safetensors"
    trained, batch_norm = [], False
    for name in config.modules_to_save or []:
        if ".vision_model." in name:  # the adapted tower's BatchNorm layers
            batch_norm = True
            continue
        # A head, or a module beside the towers (its layers, one each), named without the vision encoder's prefix.
        shown = ".".join(name.replace(".vision_encoder.", ".").split(".")[:2])
        if f"`{shown}`" not in trained:
            trained.append(f"`{shown}`")
    if batch_norm:
        trained.append("the vision tower's BatchNorm layers")
    return {
        "r": config.r,
        "alpha": config.lora_alpha,
        "parts": parse_parts(model_args.lora_parts),
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in config.target_modules}),
        "trained": trained,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "parameters": sum(p.numel() for p in model.parameters()),
        "adapter_mib": adapter.stat().st_size / 2**20 if adapter.is_file() else 0.0,
    }


def example_texts(pairs, tokenizer, count: int = 2) -> list[str]:
    """`count` distinct texts of the run's evaluation (else training) pairs, decoded, for the card's examples."""
    texts: list[str] = []
    for split in ("eval", "train"):
        part = pairs.get(split)
        if part is None or not hasattr(part, "select") or "input_ids" not in (part.column_names or ()):
            continue  # a stream is not read for this
        for ids in part.select(range(min(len(part), 500)))["input_ids"]:
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            if text and text not in texts:
                texts.append(text)
            if len(texts) == count:
                return texts
    return [*texts, *FALLBACK_EXAMPLES[len(texts) :]][:count]


def parent_command_line() -> list[str] | None:
    """The command line of the process that started this one (Linux `/proc`), or `None` where it cannot be read."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def launch_command(args: list[str], script: str = "scripts/train.py", parent: list[str] | None = None) -> str:
    """
    The command that started this run, as it would be typed again: the launcher that started this process with its
    own options (`accelerate launch --config_file ...`, `torchrun --nproc_per_node 2`, `python -m
    torch.distributed.run ...`, read from `parent`, by default the parent process's command line), then `script` and
    `args`. Started by anything else (a shell, a notebook): `python script args`.
    """
    words = parent_command_line() if parent is None else list(parent)
    launcher = _launcher(words or [])
    if launcher is None:
        return shlex.join(["python", script, *args])
    return shlex.join([*launcher, script, *args])


def _launcher(words: list[str]) -> list[str] | None:
    """The launcher part of a command line (up to the script it starts), or `None` if it is no launcher's."""
    if words and os.path.basename(words[0]).startswith("python"):
        if words[1:2] == ["-m"] and words[2:3] and words[2].startswith("torch.distributed."):
            words, prefix = words[3:], ["python", "-m", words[2]]
        else:  # the interpreter running a console script: `python .../bin/accelerate launch ...`
            words, prefix = words[1:], None
    else:
        prefix = None
    if prefix is None:
        name = os.path.basename(words[0]) if words else ""
        if name == "accelerate" and words[1:2] == ["launch"]:
            words, prefix = words[2:], ["accelerate", "launch"]
        elif name == "torchrun":
            words, prefix = words[1:], ["torchrun"]
        else:
            return None
    script = next((i for i, word in enumerate(words) if word.endswith(".py")), len(words))
    return [*prefix, *words[:script]]


def describe_vision_tower(config, image_size: int) -> str:
    """One line for the card: the tower's type and size, and what the fusion reads of it."""
    vision = config.vision_config
    if config.vision_tower_type == "transformer":
        patch = f"patch {vision.patch_size}" if getattr(vision, "patch_size", None) else "no patches"
        if config.vision_conv_stem:
            patch += f" from a convolutional stem ({', '.join(map(str, config.vision_conv_stem))} channels)"
        layers = getattr(vision, "num_hidden_layers", "?")
        return f"{vision.model_type}, {layers} layers, width {vision.hidden_size}, {image_size}px images, {patch}"
    from ..vision_towers import stage_channels

    stages = config.vision_stages
    channels = ", ".join(map(str, stage_channels(vision, stages)))
    return (
        f"{vision.model_type} ({config.vision_tower_type}), {image_size}px images; stages {stages} ({channels} "
        f"channels) read as tokens of width {config.vision_hidden_size}, "
        f"`{config.vision_position_embedding}` positions"
        + ("; every stage FiLM-conditioned on the text" if config.vision_film else "")
        + ("; every stage's cells read the text by cross-attention" if config.vision_text_attention else "")
    )


def batching(training_args) -> str:
    """How the training pairs were ordered into batches, in words."""
    if not training_args.group_by_image:
        return str(training_args.train_sampling_strategy)
    size = training_args.image_group_size
    if size == 1:
        return "random order (an image's pairs never in a row)"
    return f"grouped by image ({'all' if size == 0 else f'at most {size}'} pairs of an image in a row)"
