"""Train an MMFusion model with `Trainer`: `accelerate launch scripts/train.py [config.yaml] [--flags]`.

With no arguments it trains a small hierarchical-fusion VQA model from scratch on easy-VQA (bundled, offline) on
whatever is there, a laptop CPU included, evaluates it on the test split and prints the accuracy. Every option is a
flag or a key of a YAML / JSON config file (`scripts/configs/`); `--help` lists them. Tasks: `vqa` (default),
`classify` (image-text classification on your columns), `pretrain` (ITC + ITM, evaluated by retrieval Recall@K).

Each step below is one call into `mm_fusion.training`; copy this file to change a step.
"""

import logging
import time

from torch.distributed.elastic.multiprocessing.errors import record
from transformers.utils import logging as hf_logging

from mm_fusion.data import DataError
from mm_fusion.training import (
    MAIN_METRICS,
    MMFusionArgumentParser,
    build_model_and_processor,
    build_trainer,
    check_data,
    final_metrics,
    load_training_data,
    save_run,
    settle_arguments,
)


@record  # under torchrun / accelerate launch, a failing rank's error is reported with the run's summary
def main(argv: list[str] | None = None) -> dict:
    start = time.perf_counter()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    hf_logging.set_verbosity_warning()

    # 1. Parse: flags, or a YAML / JSON config file with flags after it overriding its values. Then the rules across
    #    the arguments: the launch is checked against this machine, the task's defaults are set, and
    #    `--resume_from_checkpoint last` becomes the newest complete checkpoint.
    #    A wrong option or value (a `--config_overrides` key included) is one `error:` line, before any data is read.
    parser = MMFusionArgumentParser()
    try:
        model_args, data_args, training_args = settle_arguments(*parser.parse_args_and_config(argv))
    except (ValueError, FileNotFoundError) as err:
        parser.fail(err, status=2)

    # 2. Data: the pairs read, their columns, classes and evaluation set checked. A defect of the data (a broken line,
    #    an unknown column, labels the head cannot predict) is one `error:` line naming the file and line, exit 2.
    #    `--check_data` validates every row as the run would, prints a report and stops.
    try:
        data = load_training_data(model_args, data_args, training_args)
        if data_args.check_data:
            check_data(model_args, data_args, training_args, data)
            return {}
    except DataError as err:
        parser.fail(err, status=2)

    # 3. Model: the tokenizer (given, the text tower's, or trained on the texts), the model (from a checkpoint, from
    #    pretrained towers, or from scratch) and the processor saved with it.
    model, processor = build_model_and_processor(model_args, data_args, training_args, data)

    # 4. Trainer: the pairs validated and preprocessed once into the Arrow cache (bad rows quarantined; too many of
    #    them, or none left, stop the run with one `error:` line), collators, the task's metrics, the monitor and the
    #    model card.
    try:
        trainer = build_trainer(model, processor, data, model_args, data_args, training_args, command=argv)
    except DataError as err:
        parser.fail(err, status=2)

    # 5. Train, or resume.
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    # 6. Evaluate the final weights.
    metrics = final_metrics(trainer, train_result)

    # 7. Save model, processor, metrics and model card to --output_dir (and push with --push_to_hub).
    save_run(trainer, metrics)
    if trainer.is_world_process_zero():
        metrics["wall_seconds"] = time.perf_counter() - start
        key = f"eval_{MAIN_METRICS[model_args.task]}"
        if key in metrics:
            pairs = f"{len(trainer.eval_dataset)} pairs"
            print(f"\n{data_args.dataset} evaluation ({pairs}): {key[len('eval_') :]} = {metrics[key]:.4f}")
        print(f"model, processor and model card in {training_args.output_dir} ({metrics['wall_seconds']:.0f} s)")
    return metrics


if __name__ == "__main__":
    main()
