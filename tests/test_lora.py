"""LoRA adapters (`scripts/train.py --lora`, mm_fusion/lora.py): what trains, what is saved, and that the adapter
served by `from_pretrained`, `pipeline(...)`, remote code and the merged model gives the trained model's outputs."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from helpers.remote_code import BLOCK_MM_FUSION
from helpers.training import TINY
from PIL import Image
from safetensors import safe_open
from transformers import AutoModelForVisualQuestionAnswering, AutoProcessor, pipeline
from transformers.modeling_layers import GradientCheckpointingLayer

from mm_fusion.lora import lora_config, merge_lora, starting_model
from mm_fusion.lora import main as lora_main
from mm_fusion.training import parse_arguments, setup_run, train_and_save


pytest.importorskip("peft")

# A ResNet tower (BatchNorm layers) with its stages reading the question, from scratch; a learning rate high enough
# for the adapters to move the outputs well away from the starting model's in a few steps.
LORA_RUN = [*TINY, "--vision_tower", "resnet", "--vision_widths", "8,16", "--lora", "--lora_parts",
            "vision,text,fusion", "--lora_r", "4", "--learning_rate", "0.01", "--num_train_epochs", "1",
            "--save_strategy", "no", "--max_train_samples", "48", "--max_eval_samples", "16"]  # fmt: skip
QUESTIONS = ["what shape is in the image?", "is there a red shape?", "what color is the shape?"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "out"
    trainer = setup_run(["--output_dir", str(out), *LORA_RUN])
    train_and_save(trainer)
    return trainer, out


def images() -> list[Image.Image]:
    return [Image.new("RGB", (40, 40), c) for c in ("red", "green", "blue")]


def inputs(out) -> dict:
    return dict(AutoProcessor.from_pretrained(out)(images=images(), text=QUESTIONS, return_tensors="pt"))


@torch.no_grad()
def logits(model, batch: dict) -> torch.Tensor:
    return model.eval()(**batch).logits


def test_only_adapters_heads_and_batchnorm_train(lora_run):
    trainer, out = lora_run
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    frozen = [n for n, p in trainer.model.named_parameters() if not p.requires_grad]
    assert all("lora_" in n or ".modules_to_save." in n for n in trainable)
    assert any(".classifier.modules_to_save." in n for n in trainable)  # the new head trains fully
    assert any("vision_model" in n and "normalization.modules_to_save" in n for n in trainable)  # BatchNorm
    assert any("text_model" in n and "lora_A" in n for n in trainable)
    assert any("encoder.layers" in n and "lora_B" in n for n in trainable)
    assert any("text_model" in n and "base_layer.weight" in n for n in frozen)
    assert not any("word_embeddings" in n for n in trainable)
    # The adapter file holds the adapters and what trained fully, none of the frozen towers' weights.
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        saved = list(f.keys())
    towers = [k for k in saved if "vision_model." in k or "text_model." in k]
    assert saved and all("lora_" in k or "normalization" in k for k in towers), towers
    # The tower's stages read the question through layers called by hooks: each of those layers is copied and trained.
    assert any("vision_text_attention.reads.0.query.modules_to_save" in n for n in trainable)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and "classifier" in config["modules_to_save"]


def checkpointed(model) -> list[bool]:
    """Whether each of the model's layers recomputes its activations in the backward."""
    return [bool(m.gradient_checkpointing) for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def test_lora_trains_with_activation_checkpointing_unless_told_not_to(lora_run, tmp_path, allocator_requests):
    trainer, _ = lora_run
    assert trainer.args.activation_checkpointing and trainer.model.get_base_model().is_gradient_checkpointing
    # every second layer as it comes (of the text tower's and the fusion block's), every one when told
    assert trainer.args.activation_checkpointing_kwargs == {"every_n_layers": 2}
    assert checkpointed(trainer.model) == [True, False]
    flags = [*LORA_RUN, "--activation_checkpointing_kwargs", '{"every_n_layers": 1}', "--max_train_samples", "16"]
    trainer = setup_run(["--output_dir", str(tmp_path / "every"), *flags])
    trainer.train()
    assert trainer.args.activation_checkpointing_kwargs == {"every_n_layers": 1}
    assert checkpointed(trainer.model) == [True, True]
    flags = [*LORA_RUN, "--lora_gradient_checkpointing", "False", "--max_train_samples", "16"]
    requests = len(allocator_requests)
    trainer = setup_run(["--output_dir", str(tmp_path / "out"), *flags])
    # --lora also gives freed memory back (--release_freed_memory): the request, recorded by conftest's stand-in
    assert trainer.args.release_freed_memory and len(allocator_requests) == requests + 1
    trainer.train()
    assert not trainer.args.activation_checkpointing and not trainer.model.get_base_model().is_gradient_checkpointing


def test_served_adapter_gives_the_trained_models_outputs(lora_run):
    trainer, out = lora_run
    batch = inputs(out)
    trained = logits(trainer.model, batch)
    loaded = AutoModelForVisualQuestionAnswering.from_pretrained(out)
    torch.testing.assert_close(logits(loaded, batch), trained, rtol=0, atol=1e-6)
    # The starting model alone (its weights as saved) answers differently: the adapter is what was loaded above.
    assert (logits(starting_model(out), batch) - trained).abs().max() > 1e-2
    served = pipeline("image-text-classification", model=str(out))
    torch.testing.assert_close(logits(served.model, batch), trained, rtol=0, atol=1e-6)
    answers = served(image=images()[0], question=QUESTIONS[0], top_k=1)
    assert answers[0]["answer"] == trainer.model.config.id2label[int(trained[0].argmax())]


def test_merged_model_equals_the_adapted_one(lora_run, tmp_path, capsys):
    trainer, out = lora_run
    batch = inputs(out)
    trained = logits(trainer.model, batch)
    merged = merge_lora(out)
    assert not any("lora_" in n or "modules_to_save" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, batch), trained, rtol=0, atol=1e-5)
    assert lora_main([str(out), str(tmp_path / "merged")]) == 0
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    served = pipeline("image-text-classification", model=str(tmp_path / "merged"))
    torch.testing.assert_close(logits(served.model, batch), trained, rtol=0, atol=1e-5)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:  # no adapter there: one-line error, exit status 1
        lora_main([str(tmp_path / "merged"), str(tmp_path / "again")])
    error = capsys.readouterr().err
    assert exited.value.code == 1 and error.count("\n") == 1 and "merged has no LoRA adapter" in error, error


def test_adapter_loads_with_remote_code_without_mm_fusion(lora_run, tmp_path):
    trainer, out = lora_run
    batch = inputs(out)
    torch.save(batch, tmp_path / "inputs.pt")
    script = BLOCK_MM_FUSION + textwrap.dedent(
        f"""
        import torch, transformers
        model = transformers.AutoModelForVisualQuestionAnswering.from_pretrained({str(out)!r}, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            got = model.eval()(**torch.load({str(tmp_path / "inputs.pt")!r})).logits
        torch.save(got, {str(tmp_path / "out.pt")!r})
        assert not [m for m in sys.modules if m == "mm_fusion" or m.startswith("mm_fusion.")]
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), logits(trainer.model, batch), rtol=0, atol=1e-6)


def test_lora_has_its_own_default_learning_rate():
    """`--lora` without `--learning_rate` trains at LoRA's rate for its layers (2e-3 on query and value, the default;
    1e-3 on every layer or layers named); a rate given on the command line is kept, and a run without `--lora` keeps
    the default."""
    from mm_fusion.training.arguments import (
        DEFAULT_LEARNING_RATE,
        LORA_ALL_LAYERS_LEARNING_RATE,
        LORA_LEARNING_RATE,
    )

    assert len({LORA_LEARNING_RATE, LORA_ALL_LAYERS_LEARNING_RATE, DEFAULT_LEARNING_RATE}) == 3
    _, _, lora = parse_arguments(["--output_dir", "x", "--lora", "True"])
    assert lora.learning_rate == LORA_LEARNING_RATE
    for modules in ("all", "query,value"):
        _, _, every = parse_arguments(["--output_dir", "x", "--lora", "--lora_target_modules", modules])
        assert every.learning_rate == LORA_ALL_LAYERS_LEARNING_RATE
    _, _, given = parse_arguments(
        ["--output_dir", "x", "--lora", "True", "--learning_rate", str(DEFAULT_LEARNING_RATE)]
    )
    assert given.learning_rate == DEFAULT_LEARNING_RATE
    _, _, full = parse_arguments(["--output_dir", "x"])
    assert full.learning_rate == DEFAULT_LEARNING_RATE


def test_lora_arguments_are_checked(tester):
    with pytest.raises(ValueError, match="--lora_parts takes some of vision, text, fusion"):
        parse_arguments(["--output_dir", "x", "--lora", "--lora_parts", "vision,audio"])
    with pytest.raises(ValueError, match="--lora_r must be 1 or more"):
        parse_arguments(["--output_dir", "x", "--lora", "--lora_r", "0"])
    # Late fusion has no fusion block to adapt; the default parts work for it.
    from mm_fusion import MMFusionForImageTextClassification

    model = MMFusionForImageTextClassification(tester.config("late"))
    with pytest.raises(ValueError, match="no encoder to adapt"):
        lora_config(model, "fusion")
    config = lora_config(model, "vision,text")
    assert "classifier" in config.modules_to_save and "mm_fusion.encoder" not in config.modules_to_save
    # A MobileNetV2's 1x1 convolutions are adapted, its depthwise ones not; with TensorFlow padding (its forward reads
    # each convolution's stride, which peft's wrapper hides) none are.
    for tf_padding, adapted in ((False, True), (True, False)):
        vision = tester.mobilenet_config(tf_padding=tf_padding)
        model = MMFusionForImageTextClassification(tester.config("late", vision_config=vision))
        convs = [n for n in lora_config(model, "vision,text").target_modules if "vision_model" in n]
        assert bool(convs) == adapted and not any(".conv_3x3." in n for n in convs)
        assert any("vision_model" in n and "normalization" in n for n in lora_config(model).modules_to_save)


def test_card_names_the_adapter_and_its_commands_run(lora_run, tmp_path):
    """The run's model card: no pipeline_tag for a head transformers 5 has no task for (a comment says why), the
    adapter named with its size, and its "How to use" code, run as written on a real image, answers."""
    trainer, out = lora_run
    card = (out / "README.md").read_text()
    assert "pipeline_tag" not in yaml.safe_load(card.split("---")[1]) and "# No pipeline_tag:" in card
    assert "## LoRA adapter" in card and "`adapter_model.safetensors`" not in card.split("## LoRA adapter")[0]
    size = (out / "adapter_model.safetensors").stat().st_size / 2**20
    assert f"`adapter_model.safetensors`, {size:.2f} MiB): rank 4" in card
    assert "the fusion block" not in card.split("## LoRA adapter")[1].split("\n\n")[1]  # adapted, not fully trained
    assert "`classifier`" in card and "BatchNorm" in card and f"python scripts/demo.py {out}" in card
    trained = card.split("## LoRA adapter")[1].split("trained fully")[0]  # the layers beside the towers, by name
    assert "`mm_fusion.vision_text_attention`" in trained and "`mm_fusion.encoder`" not in trained
    code = card.split("```python\n")[1].split("```")[0]
    images()[0].save(tmp_path / "image.png")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'answer':" in done.stdout and "'score':" in done.stdout


@pytest.mark.onnx
def test_export_of_a_lora_run_folds_the_adapter_in_and_names_its_graphs(lora_run, tmp_path):
    pytest.importorskip("onnxruntime")
    from mm_fusion import MMFusionOnnxModel
    from mm_fusion.export import export_model

    trainer, out = lora_run
    export_model(out, tmp_path / "onnx")
    batch = inputs(out)
    onnx = MMFusionOnnxModel.from_pretrained(tmp_path / "onnx")
    got = torch.as_tensor(onnx(**batch).logits)
    torch.testing.assert_close(got, logits(trainer.model, batch), rtol=0, atol=1e-4)
    card = (tmp_path / "onnx" / "README.md").read_text()
    assert "## ONNX" in card and "| `model.onnx` | input_ids, attention_mask, pixel_values | logits |" in card


def test_pretraining_adapter_serves_the_trained_embeddings(tmp_path):
    """`--task pretrain --lora`: the heads (projections, ITM) train fully; the loaded and the merged model embed as the
    trained one does, and transformers' zero-shot pipeline serves the directory."""
    from transformers import AutoModelForPreTraining

    out = tmp_path / "out"
    flags = [*TINY, "--task", "pretrain", "--lora", "--learning_rate", "0.01", "--num_train_epochs", "1",
             "--save_strategy", "no", "--max_train_samples", "32", "--max_eval_samples", "16"]  # fmt: skip
    trainer = setup_run(["--output_dir", str(out), *flags])
    train_and_save(trainer)
    config = json.loads((out / "adapter_config.json").read_text())
    trained = {"mm_fusion.visual_projection", "mm_fusion.text_projection", "itm_head", "mm_fusion.encoder"}
    assert trained <= set(config["modules_to_save"])
    batch = inputs(out)
    with torch.no_grad():
        trained = trainer.model.eval()(**batch, return_loss=False).image_embeds
        loaded = AutoModelForPreTraining.from_pretrained(out).eval()
        torch.testing.assert_close(loaded(**batch, return_loss=False).image_embeds, trained)
        merged = merge_lora(out)
        torch.testing.assert_close(merged(**batch, return_loss=False).image_embeds, trained, atol=1e-5, rtol=0)
    scores = pipeline("zero-shot-image-classification", model=str(out))(images()[0], candidate_labels=["a", "b"])
    assert len(scores) == 2


def trained_state(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_a_lora_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_run(tmp_path):
    """`--lora --resume_from_checkpoint`: the checkpoint holds the adapter and what trains fully, not the frozen
    weights; the resumed run rebuilds the same starting model, loads them and its optimizer, and ends with the
    uninterrupted run's weights and losses."""
    flags = [*TINY, "--lora", "--lora_r", "4", "--learning_rate", "0.01", "--max_steps", "4", "--save_steps", "2",
             "--save_strategy", "steps", "--max_train_samples", "64", "--eval_strategy", "no", "--dropout", "0",
             "--seed", "3"]  # fmt: skip
    whole = setup_run(["--output_dir", str(tmp_path / "whole"), *flags])
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    with safe_open(checkpoint / "adapter_model.safetensors", "pt") as saved:
        keys = list(saved.keys())
    assert any("lora_A" in k for k in keys) and not any("original_module" in k for k in keys)
    resumed = setup_run(
        ["--output_dir", str(tmp_path / "resumed"), *flags, "--resume_from_checkpoint", str(checkpoint)]
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == whole.state.global_step == 4
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h and h["step"] > 2] for t in (whole, resumed)]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    end, again = trained_state(whole), trained_state(resumed)
    assert end.keys() == again.keys()
    for name, value in end.items():
        torch.testing.assert_close(again[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_lora_target_modules_pick_the_layers_by_name(tester):
    """By default (`query_value`) the attention's query and value are adapted where a part has them (a ViT or BERT
    tower, the fusion block), every layer of a part without them (a convolutional tower); `all` every layer LoRA can
    adapt; names given adapt those, and a name no layer has, or a part none of whose layers has one, is refused."""
    from mm_fusion import MMFusionForImageTextClassification

    model = MMFusionForImageTextClassification(tester.config("hierarchical"))

    def own_names(targets, part):
        return {name.rsplit(".", 1)[-1] for name in targets if name.startswith(f"mm_fusion.{part}.")}

    every = lora_config(model, "vision,text,fusion", modules="all").target_modules
    assert set(lora_config(model, "vision,text,fusion", modules=None).target_modules) == set(every)
    assert own_names(every, "text_model") == {"query", "value", "key", "dense"} and "k_proj" in own_names(
        every, "encoder"
    )
    query_value = lora_config(model, "vision,text,fusion").target_modules  # the default
    assert set(lora_config(model, "vision,text,fusion", modules="query_value").target_modules) == set(query_value)
    assert own_names(query_value, "text_model") == {"query", "value"}
    assert (
        own_names(query_value, "encoder")
        == own_names(query_value, "vision_encoder.vision_model")
        == {
            "q_proj",
            "v_proj",
        }
    )  # the fusion block and a ViT tower
    # A convolutional tower has no attention: query_value adapts every layer LoRA can adapt there.
    convolutional = tester.config("late", vision_config=tester.mobilenet_config(tf_padding=False))
    convolutional = MMFusionForImageTextClassification(convolutional)
    vision = lora_config(convolutional, "vision", modules="all").target_modules
    assert vision and set(vision) == set(lora_config(convolutional, "vision").target_modules)
    chosen = lora_config(model, "text", modules="query, value").target_modules
    assert set(chosen) == {n for n in query_value if n.startswith("mm_fusion.text_model.")}
    with pytest.raises(ValueError, match=r"--lora_target_modules query,qv: no Linear or Conv2d layer named qv in "):
        lora_config(model, "text", modules="query,qv")
    # A part none of whose layers has one of the names would train nothing: refused, with the names it has.
    with pytest.raises(ValueError, match=r"the vision part \(--lora_parts\) has no layer of these names; its"):
        lora_config(model, "vision,text", modules="query,value")
    model_args, _, _ = parse_arguments(["--output_dir", "x", "--lora"])
    assert model_args.lora_target_modules == "query_value"
    model_args, _, _ = parse_arguments(["--output_dir", "x", "--lora", "--lora_target_modules", "all"])
    assert model_args.lora_target_modules == "all"
