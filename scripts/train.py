"""Train an MMFusion model with `Trainer`: `accelerate launch scripts/train.py [config.yaml] [--flags]`.

With no arguments it trains a small hierarchical-fusion VQA model from scratch on easy-VQA (bundled, offline) on
whatever is there, a laptop CPU included, evaluates it on the test split and prints the accuracy. Every option is a
flag or a key of a YAML / JSON config file (`scripts/configs/`); `--help` lists them. Tasks: `vqa` (default),
`classify` (image-text classification on your columns), `pretrain` (ITC + ITM, evaluated by retrieval Recall@K).
"""

import dataclasses
import difflib
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from torch.distributed.elastic.multiprocessing.errors import record
from transformers import AutoTokenizer, EarlyStoppingCallback, HfArgumentParser, set_seed
from transformers.utils import logging as hf_logging

from mm_fusion import MMFusionImageProcessor, MMFusionProcessor, train_tokenizer
from mm_fusion.data import ImageTextCollator, PreparedData, prepare_dataset
from mm_fusion.data.sort_of_clevr import vocabulary_texts as sort_of_clevr_texts
from mm_fusion.training import (
    DataArguments,
    MMFusionTrainer,
    MMFusionTrainingArguments,
    ModelArguments,
    add_monitor,
    build_config,
    check_columns,
    check_eval_data,
    check_launch,
    encode_labels,
    load_metric,
    load_raw_datasets,
    model_card_context,
    model_class,
    resolve_resume_checkpoint,
    write_model_card,
)


logger = logging.getLogger("mm_fusion.train")
MODEL_CARD_TEMPLATE = Path(__file__).resolve().parent.parent / "model_cards" / "mm_fusion_model_card.md.j2"


def parse_args(argv: list[str] | None):
    """Flags, or a YAML / JSON file as the first argument with flags after it overriding its values."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # No abbreviations: `--learning_rat` (or a config key `learning_rat`) is an error, not `--learning_rate`.
    parser = HfArgumentParser((ModelArguments, DataArguments, MMFusionTrainingArguments), allow_abbrev=False)
    if argv and argv[0].endswith((".yaml", ".yml", ".json")):
        path = Path(argv.pop(0))
        if not path.is_file():
            raise FileNotFoundError(f"Config file {path} does not exist.")
        values = yaml.safe_load(path.read_text()) if path.suffix != ".json" else json.loads(path.read_text())
        if not isinstance(values, dict):
            raise ValueError(f"Config file {path} must hold a mapping of option: value, got {type(values).__name__}.")
        known = {f.name for cls in parser.dataclass_types for f in dataclasses.fields(cls) if f.init}
        for key in values:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else " `--help` lists the options."
                raise ValueError(f"Config file {path}: {key!r} is not an option of scripts/train.py.{hint}")
        flags = []
        for key, value in values.items():
            flags += [f"--{key}", *(map(str, value) if isinstance(value, list) else [str(value)])]
        argv = flags + argv
    return parser.parse_args_into_dataclasses(args=argv)


def build_tokenizer(model_args, texts, training_args, resume: str | None = None):
    """
    The given tokenizer, the text tower's, the one saved in the checkpoint a run resumes from, or one trained on the
    training texts by the main process.
    """
    source = model_args.tokenizer_name_or_path or model_args.text_model_name_or_path or model_args.model_name_or_path
    if source is None and resume is not None and (Path(resume) / "tokenizer_config.json").is_file():
        source = resume  # the vocabulary the checkpoint's weights were trained with, whatever the data is now
    if source:
        return AutoTokenizer.from_pretrained(source)
    directory = Path(training_args.output_dir) / "tokenizer"
    # Trained once, by the main process, and loaded by the others: every rank must have the same vocabulary.
    with training_args.main_process_first(desc="tokenizer", local=False):
        if training_args.process_index == 0:
            tokenizer = train_tokenizer(texts, vocab_size=model_args.vocab_size)
            tokenizer.save_pretrained(directory)
        else:
            tokenizer = AutoTokenizer.from_pretrained(directory)
    return tokenizer


def build_model(model_args, data_args, tokenizer, labels, image_size):
    """From an MMFusion checkpoint, from pretrained towers, or from scratch."""
    cls = model_class(model_args.task)
    if model_args.model_name_or_path:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_args.model_name_or_path)
        if labels is not None and "MMFusionForPretraining" in (config.architectures or []):
            # A pretraining checkpoint has no classifier: its towers, fusion and tokenizer start this run, with a new
            # head for these labels (its ITC projections and ITM head are left behind).
            label2id = {name: i for i, name in enumerate(labels)}
            return cls.from_pretrained(
                model_args.model_name_or_path,
                num_labels=len(labels),
                id2label=dict(enumerate(labels)),
                label2id=label2id,
            )
        model = cls.from_pretrained(model_args.model_name_or_path)
        if labels is not None and model.config.num_labels != len(labels):
            raise ValueError(
                f"{model_args.model_name_or_path} has a head for {model.config.num_labels} labels but the data has "
                f"{len(labels)}: {labels[:10]}."
            )
        return model
    config = build_config(model_args, image_size, len(tokenizer), data_args.max_length, labels)
    if model_args.vision_model_name_or_path or model_args.text_model_name_or_path:
        from transformers import AutoModel

        vision = model_args.vision_model_name_or_path or AutoModel.from_config(config.vision_config)
        text = model_args.text_model_name_or_path or AutoModel.from_config(config.text_config)
        fusion = {k: v for k, v in config.to_diff_dict().items() if k not in ("vision_config", "text_config")}
        return cls.from_vision_text_pretrained(vision, text, **fusion)
    return cls(config)


@dataclass
class Run:
    """What `build_trainer` set up, for `train_and_save`."""

    model_args: ModelArguments
    data_args: DataArguments
    training_args: MMFusionTrainingArguments
    prepared: PreparedData
    main_metric: str
    write_card: Callable
    start: float
    resume: str | None


def build_trainer(argv: list[str] | None = None) -> tuple[MMFusionTrainer, Run]:
    """Parse the arguments, load and prepare the data, build tokenizer, model, processor, collator and trainer."""
    model_args, data_args, training_args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    hf_logging.set_verbosity_warning()
    check_launch(training_args)
    resume = resolve_resume_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
    if training_args.group_by_image is None:
        random_order = training_args.train_sampling_strategy == "random"
        training_args.group_by_image = model_args.task != "pretrain" and random_order
    set_seed(training_args.seed)
    start = time.perf_counter()
    task = model_args.task

    data = load_raw_datasets(data_args, seed=training_args.seed, task=task)
    check_columns(data, data_args, task)
    check_eval_data(data, data_args, training_args)
    labels = None
    if task != "pretrain":
        data, labels = encode_labels(data, data_args.label_column)
    group_columns = [c.strip() for c in (data_args.eval_group_columns or "").split(",") if c.strip()]
    if group_columns and task == "pretrain":
        raise ValueError("--eval_group_columns reports accuracy per group, for vqa / classify; not for pretrain.")
    texts = list(data["train"][data_args.text_column])
    if data_args.dataset == "sort_of_clevr":
        # Its vocabulary is fixed by the generator: a tokenizer trained on captions then covers the questions it is
        # fine-tuned on, and the other way round.
        texts += sort_of_clevr_texts()
    tokenizer = build_tokenizer(model_args, texts, training_args, resume)
    image_size = data_args.image_size or 64
    model = build_model(model_args, data_args, tokenizer, labels, image_size)
    if labels is not None:  # class ids: scores are read with a softmax, and the pipelines read this from the config
        model.config.problem_type = "single_label_classification"
    image_size = model.config.vision_config.image_size
    prepared = prepare_dataset(
        data,
        tokenizer,
        image_column=data_args.image_column,
        text_column=data_args.text_column,
        id_column=data_args.id_column,
        label_column=data_args.label_column if task != "pretrain" else None,
        keep_columns=tuple(group_columns),
        image_size=image_size,
        data_root=data_args.data_root,
        max_length=data_args.max_length,
        on_bad_sample=data_args.on_bad_sample,
        quarantine_path=Path(training_args.output_dir) / "quarantine.jsonl",
        num_proc=data_args.preprocessing_num_workers,
    )
    train_pairs, eval_pairs = prepared.pairs["train"], prepared.pairs.get("eval")
    blank = {"none": None, "image_only": "text", "text_only": "image"}[data_args.ablation]
    collator_kwargs = dict(pad_token_id=tokenizer.pad_token_id or 0, share_images=task != "pretrain", blank=blank)
    collator = ImageTextCollator(prepared.images, **collator_kwargs)
    train_collator = collator
    if data_args.augment:  # training batches only; evaluation sees the images as they are
        from torchvision.transforms import v2

        flips = v2.Compose([v2.RandomHorizontalFlip(), v2.RandomVerticalFlip()])
        train_collator = ImageTextCollator(prepared.images, image_transform=flips, **collator_kwargs)
    # Saved with the model: the image processor runs the cache's own image function and the texts are truncated to
    # the training length, so serving reproduces the training input exactly (the model normalises the pixels).
    processor = MMFusionProcessor(
        MMFusionImageProcessor(size={"height": image_size, "width": image_size}),
        tokenizer,
        max_length=data_args.max_length,
    )

    if task == "pretrain":
        metric, main_metric = load_metric("retrieval"), "mean_recall"

        def compute_metrics(prediction):
            image_embeds, text_embeds = prediction.predictions
            return metric.compute(image_embeds=image_embeds, text_embeds=text_embeds, image_ids=prediction.label_ids)

        training_args.label_names = ["image_rows"]
        preprocess_logits = None
    else:
        metric, main_metric = load_metric("accuracy"), "accuracy"

        # Evaluation predictions come in the order of the evaluation pairs, so each can be given its group.
        groups = {c: np.asarray(eval_pairs[c]) for c in group_columns} if eval_pairs is not None else {}

        def compute_metrics(prediction):
            predictions, references = prediction.predictions, prediction.label_ids
            results = metric.compute(predictions=predictions, references=references)
            for column, values in groups.items():
                if len(values) != len(predictions):
                    raise ValueError(f"{len(predictions)} predictions for {len(values)} evaluation pairs.")
                for value in sorted(set(values.tolist())):
                    rows = values == value
                    accuracy = metric.compute(predictions=predictions[rows], references=references[rows])
                    results[f"accuracy_{value}"] = accuracy["accuracy"]
            return results

        def preprocess_logits(logits, labels):
            return (logits[0] if isinstance(logits, tuple) else logits).argmax(-1)

    if training_args.early_stopping_patience is not None and training_args.metric_for_best_model_is_default:
        # "Best" is the task's metric (TrainingArguments alone would pick the evaluation loss).
        training_args.metric_for_best_model = main_metric
        training_args.greater_is_better = True

    def card_writer(trainer):
        context = model_card_context(trainer, model_args, data_args, training_args, prepared, main_metric, argv)
        return write_model_card(MODEL_CARD_TEMPLATE, training_args.output_dir, context)

    trainer = MMFusionTrainer(
        model=model,
        args=training_args,
        train_dataset=train_pairs,
        eval_dataset=eval_pairs,
        data_collator=train_collator,
        eval_data_collator=collator,
        processing_class=processor,
        compute_metrics=compute_metrics if eval_pairs is not None else None,
        preprocess_logits_for_metrics=preprocess_logits if eval_pairs is not None else None,
        model_card_writer=card_writer,
    )
    add_monitor(trainer, data_wait_warning=training_args.data_wait_warning, peak_tflops=training_args.peak_tflops)
    if training_args.early_stopping_patience is not None:
        trainer.add_callback(EarlyStoppingCallback(early_stopping_patience=training_args.early_stopping_patience))
    if trainer.is_world_process_zero():
        parameters = sum(p.numel() for p in model.parameters())
        logger.info(
            "task %s, fusion %s, %.2fM parameters; train %d pairs / %d images, eval %s pairs; %s; %d torch threads",
            task,
            model.config.fusion_type,
            parameters / 1e6,
            len(train_pairs),
            len(prepared.images),
            len(eval_pairs) if eval_pairs is not None else 0,
            f"ablation {data_args.ablation}" if data_args.ablation != "none" else "no ablation",
            torch.get_num_threads(),
        )

    return trainer, Run(model_args, data_args, training_args, prepared, main_metric, card_writer, start, resume)


def train_and_save(trainer: MMFusionTrainer, run: Run) -> dict:
    """Train (or resume), evaluate, save model + processor + model card; returns the metrics."""
    training_args, eval_pairs = run.training_args, trainer.eval_dataset
    train_result = trainer.train(resume_from_checkpoint=run.resume)
    results = {"train_" + k if not k.startswith("train_") else k: v for k, v in train_result.metrics.items()}
    if eval_pairs is not None:
        # The scheduled evaluation at the last step already scored these weights, unless the best checkpoint was
        # loaded back since: reuse it rather than run the same evaluation twice.
        last = next((h for h in reversed(trainer.state.log_history) if "eval_loss" in h), None)
        if last is not None and last["step"] == trainer.state.global_step and not training_args.load_best_model_at_end:
            results.update({k: v for k, v in last.items() if k.startswith("eval_") or k == "epoch"})
        else:
            results.update(trainer.evaluate())
    trainer.save_model()
    trainer.save_state()
    trainer.log_metrics("all", results)
    trainer.save_metrics("all", results)
    if trainer.is_world_process_zero():
        run.write_card(trainer)
        results["wall_seconds"] = time.perf_counter() - run.start
        key = f"eval_{run.main_metric}"
        if key in results:
            name = f"{run.data_args.dataset} evaluation ({len(eval_pairs)} pairs)"
            print(f"\n{name}: {run.main_metric} = {results[key]:.4f}")
        print(f"model, processor and model card in {training_args.output_dir} ({results['wall_seconds']:.0f} s)")
    if training_args.push_to_hub:
        trainer.push_to_hub()
    return results


@record  # under torchrun / accelerate launch, a failing rank's error is reported with the run's summary
def main(argv: list[str] | None = None) -> dict:
    """Everything: `accelerate launch scripts/train.py [config.yaml] [--flags]`."""
    trainer, run = build_trainer(argv)
    return train_and_save(trainer, run)


if __name__ == "__main__":
    main()
