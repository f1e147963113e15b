"""Directories saved by an earlier mm_fusion (`tests/fixtures/saved_before_issue20`, see its SAVED_BY.txt) load with
this one, give the outputs they gave when saved, serve through the pipelines, load with their own code where mm_fusion
is not importable, and save again in the same format."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.remote_code import BLOCK_MM_FUSION
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForPreTraining, AutoModelForVisualQuestionAnswering, AutoProcessor, pipeline

import mm_fusion


SAVED = Path(__file__).resolve().parent / "fixtures" / "saved_before_issue20"
TEXTS = ["what color is the circle?", "is there a blue triangle in the image?"]
HEADS = {"vqa": AutoModelForVisualQuestionAnswering, "pretrain": AutoModelForPreTraining}


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    return load_file(SAVED / "expected.safetensors")


def _inputs(expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("input."): v for k, v in expected.items() if k.startswith("input.")}


def _outputs(expected: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(f"{name}."): v for k, v in expected.items() if k.startswith(f"{name}.")}


@pytest.mark.parametrize("name", sorted(HEADS))
def test_old_directory_loads_with_the_installed_code_and_gives_its_saved_outputs(name, expected):
    model = HEADS[name].from_pretrained(SAVED / name).eval()
    assert type(model).__module__ == "mm_fusion.modeling_mm_fusion"
    processor = AutoProcessor.from_pretrained(SAVED / name)
    image = Image.open(SAVED / "image.png")
    batch = processor(images=[image, image], text=TEXTS, padding=True, return_tensors="pt")
    inputs = _inputs(expected)
    assert batch.keys() == inputs.keys()
    for key in inputs:
        assert torch.equal(batch[key], inputs[key]), key
    with torch.no_grad():
        outputs = model(**inputs)
    saved = _outputs(expected, name)
    assert saved and set(saved) <= set(outputs.keys())
    for key, value in saved.items():
        # Tight, not bit-equal: another torch release or CPU (AVX2 / AVX-512) sums in another order, at ~1e-7.
        torch.testing.assert_close(outputs[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_old_directory_serves_through_the_installed_pipeline(expected):
    pipe = pipeline("image-text-classification", model=str(SAVED / "vqa"))
    assert type(pipe) is mm_fusion.ImageTextClassificationPipeline
    answers = pipe(image=[str(SAVED / "image.png")] * 2, question=TEXTS)
    logits = _outputs(expected, "vqa")["logits"]
    id2label = pipe.model.config.id2label
    assert [a[0]["answer"] for a in answers] == [id2label[int(i)] for i in logits.argmax(-1)]


def _comparable(config: dict) -> dict:
    """A saved config without what transformers itself writes differently: its version, and the `dtype` that loading
    sets on the tower sub-configs."""
    towers = {k: {n: v for n, v in config[k].items() if n != "dtype"} for k in ("vision_config", "text_config")}
    return {**{k: v for k, v in config.items() if k != "transformers_version"}, **towers}


@pytest.mark.parametrize("name", sorted(HEADS))
def test_old_directory_saves_again_in_the_same_format(name, tmp_path):
    model = HEADS[name].from_pretrained(SAVED / name)
    model.save_pretrained(tmp_path)
    old = _comparable(json.loads((SAVED / name / "config.json").read_text()))
    # Settings added since (issue 21's vision towers) are written at the values that give the old model.
    added = {
        "image_pooling": old["pooling_mode"],
        "vision_position_embedding": "sine",
        "vision_conv_stem": None,
        "vision_film": False,
        "vision_text_attention": False,
        "vision_text_attention_from_stage": 1,
        "init_scheme": "normal",
        "feature_map_bridge": True,
        "fusion_layer_order": "self_first",
    }
    assert not added.keys() & old.keys()
    assert _comparable(json.loads((tmp_path / "config.json").read_text())) == {**old, **added}
    model_code = {"configuration_mm_fusion.py", "modeling_mm_fusion.py", "pipeline_mm_fusion.py"}
    assert model_code <= {p.name for p in (SAVED / name).glob("*.py")}  # what the old code saved with the model
    assert model_code <= {p.name for p in tmp_path.glob("*.py")}


REMOTE = BLOCK_MM_FUSION + textwrap.dedent(
    """
    import torch
    import transformers
    from safetensors.torch import load_file

    saved = sys.argv[1]
    expected = load_file(f"{saved}/expected.safetensors")
    inputs = {k[len("input."):]: v for k, v in expected.items() if k.startswith("input.")}
    for name, auto_class in (("vqa", "AutoModelForVisualQuestionAnswering"), ("pretrain", "AutoModelForPreTraining")):
        model = getattr(transformers, auto_class).from_pretrained(f"{saved}/{name}", trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            outputs = model(**inputs)
        for key, value in expected.items():
            if key.startswith(name + "."):
                torch.testing.assert_close(outputs[key[len(name) + 1:]], value, rtol=1e-5, atol=1e-6, msg=key)
    pipe = transformers.pipeline("image-text-classification", model=f"{saved}/vqa", trust_remote_code=True)
    assert type(pipe).__module__.startswith("transformers_modules"), type(pipe).__module__
    answers = pipe(image=[f"{saved}/image.png"] * 2, question=json.loads(sys.argv[2]))
    assert not [m for m in sys.modules if m == "mm_fusion" or m.startswith("mm_fusion.")]
    print(json.dumps([a[0]["answer"] for a in answers]))
    """
)


def test_old_directory_loads_with_its_own_code_where_mm_fusion_is_not_importable(expected, tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", REMOTE, str(SAVED), json.dumps(TEXTS)], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    answers = json.loads(run.stdout.strip().splitlines()[-1])
    id2label = json.loads((SAVED / "vqa" / "config.json").read_text())["id2label"]
    assert answers == [id2label[str(int(i))] for i in _outputs(expected, "vqa")["logits"].argmax(-1)]
