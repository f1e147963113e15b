"""Directories saved by earlier mm_fusion versions, in formats this version does not write
(`tests/fixtures/saved_models`, each described by its SAVED_BY.txt), load with this one, give the outputs they gave
when saved, serve through the pipelines, load with their own code where mm_fusion is not importable, and save again
in the same format."""

import functools
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.remote_code import BLOCK_MM_FUSION
from PIL import Image
from safetensors.torch import load_file
from transformers import (
    AutoModel,
    AutoModelForPreTraining,
    AutoModelForVisualQuestionAnswering,
    AutoProcessor,
    pipeline,
)

import mm_fusion
from mm_fusion.lora import merge_lora


STORED = Path(__file__).resolve().parent / "fixtures" / "saved_models"
TEXTS = ["what color is the circle?", "is there a blue triangle in the image?"]
VQA, PRETRAIN = AutoModelForVisualQuestionAnswering, AutoModelForPreTraining
# Each saved format, named for what sets it apart, and the Auto class of each model saved in it.
SAVED = {
    # ViT towers; a config without the vision-tower settings; model code that imports the pipeline code.
    "vit_config_without_tower_settings": {"vqa": VQA, "pretrain": PRETRAIN},
    # ResNet towers named at the bare model's top level, not under its vision encoder: stages that read the question,
    # FiLM, neither; a LoRA adapter that names them so.
    "resnet_tower_at_top_level": {"vqa": VQA, "film": VQA, "pretrain": PRETRAIN, "lora": VQA},
}
MODELS = [(saved, name) for saved, heads in SAVED.items() for name in heads]
ANSWERING = [(saved, name) for saved, name in MODELS if SAVED[saved][name] is VQA]


@pytest.fixture(scope="module")
def saved_dirs(tmp_path_factory) -> Path:
    """The saved directories as the old code wrote them, `FORMAT/HEAD`: each head's own files with its format's
    `shared/` files (code, tokenizer, processor config) beside them, and `FORMAT/image.png`, `expected.safetensors`."""
    root = tmp_path_factory.mktemp("saved_models")
    for saved, heads in SAVED.items():
        (root / saved).mkdir()
        for name in ("image.png", "expected.safetensors"):
            shutil.copy(STORED / saved / name, root / saved / name)
        for name in heads:
            shutil.copytree(STORED / saved / "shared", root / saved / name)
            shutil.copytree(STORED / saved / name, root / saved / name, dirs_exist_ok=True)
    return root


@functools.cache
def expected(saved: str) -> dict[str, torch.Tensor]:
    """The processor's inputs (`input.*`) and each model's outputs (`NAME.*`) when the directory was saved."""
    return load_file(STORED / saved / "expected.safetensors")


def _inputs(saved: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix("input."): v for k, v in expected(saved).items() if k.startswith("input.")}


def _outputs(saved: str, name: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(f"{name}."): v for k, v in expected(saved).items() if k.startswith(f"{name}.")}


def assert_saved_outputs(outputs, saved: str, name: str) -> None:
    wanted = _outputs(saved, name)
    assert wanted and set(wanted) <= set(outputs.keys())
    for key, value in wanted.items():
        # Tight, not bit-equal: another torch release or CPU (AVX2 / AVX-512) sums in another order, at ~1e-7.
        torch.testing.assert_close(outputs[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _answers(saved: str, name: str) -> list[str]:
    id2label = json.loads((STORED / saved / name / "config.json").read_text())["id2label"]
    return [id2label[str(int(i))] for i in _outputs(saved, name)["logits"].argmax(-1)]


@pytest.mark.parametrize("saved,name", MODELS)
def test_old_directory_loads_with_the_installed_code_and_gives_its_saved_outputs(saved_dirs, saved, name):
    path = saved_dirs / saved / name
    model = SAVED[saved][name].from_pretrained(path).eval()
    assert type(model).__module__ == "mm_fusion.modeling_mm_fusion"
    if name == "lora":  # from_pretrained serves the adapter beside the model it started from
        assert any(".lora_A." in n for n, _ in model.named_parameters())
    processor = AutoProcessor.from_pretrained(path)
    image = Image.open(saved_dirs / saved / "image.png")
    batch = processor(images=[image, image], text=TEXTS, padding=True, return_tensors="pt")
    inputs = _inputs(saved)
    assert batch.keys() == inputs.keys()
    for key in inputs:
        assert torch.equal(batch[key], inputs[key]), key
    with torch.no_grad():
        assert_saved_outputs(model(**inputs), saved, name)


@pytest.mark.parametrize("saved,name", [(saved, name) for saved, name in ANSWERING if name != "lora"])
def test_old_head_directory_loads_as_the_bare_model(saved_dirs, saved, name):
    """`AutoModel` on a head's directory: the bare model, the head's own fused output (the head's weights left out)."""
    model = AutoModel.from_pretrained(saved_dirs / saved / name).eval()
    assert type(model) is mm_fusion.MMFusionModel
    with torch.no_grad():
        pooled = model(**_inputs(saved)).pooler_output
    torch.testing.assert_close(pooled, _outputs(saved, name)["pooler_output"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("saved,name", ANSWERING)
def test_old_directory_serves_through_the_installed_pipeline(saved_dirs, saved, name):
    pipe = pipeline("image-text-classification", model=str(saved_dirs / saved / name))
    assert type(pipe) is mm_fusion.ImageTextClassificationPipeline
    answers = pipe(image=[str(saved_dirs / saved / "image.png")] * 2, question=TEXTS)
    assert [a[0]["answer"] for a in answers] == _answers(saved, name)


def test_old_lora_directory_merges_into_a_model_with_its_outputs(saved_dirs):
    """An adapter that names the vision tower and its parts at the bare model's top level, not under its vision
    encoder (its `modules_to_save` among them), is folded in whole: the merged model gives the adapted model's
    outputs."""
    saved = "resnet_tower_at_top_level"
    merged = merge_lora(saved_dirs / saved / "lora").eval()
    with torch.no_grad():
        assert_saved_outputs(merged(**_inputs(saved)), saved, "lora")


def _comparable(config: dict) -> dict:
    """A saved config without what transformers itself writes differently: its version, the `dtype` that loading
    sets on the tower sub-configs, and the `use_cache=False` that Trainer sets on a model it trains (a config loaded
    with it drops it, in every version)."""
    towers = {k: {n: v for n, v in config[k].items() if n != "dtype"} for k in ("vision_config", "text_config")}
    return {**{k: v for k, v in config.items() if k not in ("transformers_version", "use_cache")}, **towers}


# Settings a format's config lacks, which saving it again writes at the values that give the old model.
ADDED = {
    "vit_config_without_tower_settings": lambda old: {  # the vision-tower settings, init_scheme, fusion_layer_order
        "image_pooling": old["pooling_mode"],
        "vision_position_embedding": "sine",
        "vision_conv_stem": None,
        "vision_film": False,
        "vision_text_attention": False,
        "vision_text_attention_from_stage": 1,
        "init_scheme": "normal",
        "feature_map_bridge": True,
        "fusion_layer_order": "self_first",
    },
    "resnet_tower_at_top_level": lambda old: {},
}


@pytest.mark.parametrize("saved,name", [(saved, name) for saved, name in MODELS if name != "lora"])
def test_old_directory_saves_again_in_the_same_format(saved_dirs, saved, name, tmp_path):
    """The same config (and the settings it lacked), the weights under the names they were saved with, and the model
    code beside them."""
    model = SAVED[saved][name].from_pretrained(saved_dirs / saved / name)
    model.save_pretrained(tmp_path)
    old = _comparable(json.loads((saved_dirs / saved / name / "config.json").read_text()))
    added = ADDED[saved](old)
    assert not added.keys() & old.keys()
    assert _comparable(json.loads((tmp_path / "config.json").read_text())) == {**old, **added}
    saved_weights = load_file(saved_dirs / saved / name / "model.safetensors")
    assert load_file(tmp_path / "model.safetensors").keys() == saved_weights.keys()
    model_code = {"configuration_mm_fusion.py", "modeling_mm_fusion.py", "pipeline_mm_fusion.py"}
    assert model_code <= {p.name for p in (saved_dirs / saved / name).glob("*.py")}  # what the old code saved with it
    assert model_code <= {p.name for p in tmp_path.glob("*.py")}


REMOTE = BLOCK_MM_FUSION + textwrap.dedent(
    """
    import torch
    import transformers
    from safetensors.torch import load_file

    saved_dirs, models, texts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    answers = {}
    for saved, name, auto_class in models:
        expected = load_file(f"{saved_dirs}/{saved}/expected.safetensors")
        inputs = {k[len("input."):]: v for k, v in expected.items() if k.startswith("input.")}
        path = f"{saved_dirs}/{saved}/{name}"
        model = getattr(transformers, auto_class).from_pretrained(path, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            outputs = model(**inputs)
        for key, value in expected.items():
            if key.startswith(name + "."):
                torch.testing.assert_close(outputs[key[len(name) + 1:]], value, rtol=1e-5, atol=1e-6, msg=key)
        if auto_class == "AutoModelForVisualQuestionAnswering":
            pipe = transformers.pipeline("image-text-classification", model=path, trust_remote_code=True)
            assert type(pipe).__module__.startswith("transformers_modules"), type(pipe).__module__
            found = pipe(image=[f"{saved_dirs}/{saved}/image.png"] * 2, question=texts)
            answers[f"{saved}/{name}"] = [a[0]["answer"] for a in found]
    assert not [m for m in sys.modules if m == "mm_fusion" or m.startswith("mm_fusion.")]
    print(json.dumps(answers))
    """
)


def test_old_directory_loads_with_its_own_code_where_mm_fusion_is_not_importable(saved_dirs, tmp_path):
    """Every saved model, in one interpreter that cannot import mm_fusion: its outputs, and its pipeline's answers."""
    models = [(saved, name, SAVED[saved][name].__name__) for saved, name in MODELS]
    run = subprocess.run(
        [sys.executable, "-c", REMOTE, str(saved_dirs), json.dumps(models), json.dumps(TEXTS)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    answers = json.loads(run.stdout.strip().splitlines()[-1])
    assert answers == {f"{saved}/{name}": _answers(saved, name) for saved, name in ANSWERING}
