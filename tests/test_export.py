"""ONNX export (`python -m mm_fusion.export`): each head and fusion type against PyTorch with onnxruntime, and the
pipelines served by the export (`MMFusionOnnxModel`) against the same pipelines on the PyTorch model."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.models import FUSION_TYPES
from PIL import Image
from transformers import AutoProcessor, pipeline

import mm_fusion
from mm_fusion import MMFusionForImageTextClassification, MMFusionForPretraining, MMFusionOnnxModel
from mm_fusion.export import MANIFEST_NAME, example_inputs, export_model, main


pytestmark = pytest.mark.onnx
onnxruntime = pytest.importorskip("onnxruntime")

ATOL = 1e-4
HEADS = {"classification": MMFusionForImageTextClassification, "pretraining": MMFusionForPretraining}
TEXTS = ["what shape is it", "what color is the shape", "is there a circle", "how many shapes are there"]
_EXPORTS: dict = {}


def _save(directory, tester, head: str, **config) -> None:
    """A tiny model of `head` saved with a processor whose tokenizer fits its 99-token vocabulary."""
    torch.manual_seed(0)
    config = tester.config(**config)
    if head == "classification":
        config.id2label = {i: f"answer {i}" for i in range(config.num_labels)}
        config.label2id = {name: i for i, name in config.id2label.items()}
    HEADS[head](config).save_pretrained(directory)
    tokenizer = mm_fusion.train_tokenizer(TEXTS, vocab_size=60)
    image_processor = mm_fusion.MMFusionImageProcessor(size={"height": tester.image_size, "width": tester.image_size})
    mm_fusion.MMFusionProcessor(image_processor, tokenizer).save_pretrained(directory)


def _exported(tmp_path_factory, tester, head: str, variant: str, **config):
    """(saved PyTorch directory, export directory, manifest), exported once per module."""
    key = (head, variant)
    if key not in _EXPORTS:
        root = tmp_path_factory.mktemp(f"{head}-{variant}")
        _save(root / "model", tester, head, **config)
        manifest = export_model(root / "model", root / "onnx")
        _EXPORTS[key] = (root / "model", root / "onnx", manifest)
    return _EXPORTS[key]


def _expected(model, graph: str, inputs: dict) -> np.ndarray:
    """The PyTorch model's own output for a graph, through its public API."""
    text = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    with torch.no_grad():
        if graph == "model":
            return model(**inputs).logits.numpy()
        if graph == "image_encoder":
            return model.base_model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output.numpy()
        if graph == "text_encoder":
            return model.base_model.get_text_features(**text).pooler_output.numpy()
        return model(**inputs, return_loss=False).itm_logits.numpy()


def _check_against_pytorch(saved, exported, manifest, head: str) -> None:
    model = HEADS[head].from_pretrained(saved).eval()
    expected_graphs = ["model"] if head == "classification" else ["image_encoder", "text_encoder", "matching"]
    assert list(manifest["graphs"]) == expected_graphs
    assert json.loads((exported / MANIFEST_NAME).read_text()) == manifest
    for name, entry in manifest["graphs"].items():
        session = onnxruntime.InferenceSession(str(exported / entry["file"]), providers=["CPUExecutionProvider"])
        assert [i.name for i in session.get_inputs()] == entry["inputs"]
        # Batches and lengths other than the traced one (2 pairs of 5 tokens), batch 1 included.
        for batch, length, seed in ((1, 4, 11), (4, 9, 12)):
            inputs = example_inputs(model, manifest["image_size"], batch=batch, length=length, seed=seed)
            feed = {key: inputs[key].numpy() for key in entry["inputs"]}
            got = session.run(None, feed)[0]
            want = _expected(model, name, inputs)
            assert got.shape == want.shape and got.shape[0] == batch, (name, got.shape, want.shape)
            np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=f"{head} {name} batch {batch}")


# Every fusion type under the classification head; the pretraining head's graphs are its towers (the same for every
# fusion type) and the matching graph, whose cross-attention fusion is the classification head's: its fusion types
# that differ, hierarchical and late.
EXPORTED = [("classification", fusion_type) for fusion_type in FUSION_TYPES]
EXPORTED += [("pretraining", "hierarchical"), ("pretraining", "late")]


@pytest.mark.parametrize("head, fusion_type", EXPORTED)
def test_export_matches_pytorch(tmp_path_factory, tester, head, fusion_type):
    saved, exported, manifest = _exported(tmp_path_factory, tester, head, fusion_type, fusion_type=fusion_type)
    assert manifest["head"] == HEADS[head].__name__
    # The directory holds what serving needs: the config, its code and the processor.
    for name in ("config.json", "configuration_mm_fusion.py", "processor_config.json", "tokenizer.json"):
        assert (exported / name).is_file(), name
    assert not list(exported.glob("*.safetensors"))
    _check_against_pytorch(saved, exported, manifest, head)


def test_export_of_a_convolutional_tower_that_reads_the_text(tmp_path, tester):
    """A ResNet whose stages read the question by cross-attention (scripts/train.py's default for such a tower)."""
    config = dict(
        vision_config=tester.resnet_config(),
        vision_text_attention=True,
        init_scheme="pytorch",
        feature_map_bridge=False,
        vision_bridge_layers=[1, 2],
    )
    _save(tmp_path / "model", tester, "classification", **config)
    manifest = export_model(tmp_path / "model", tmp_path / "onnx")
    _check_against_pytorch(tmp_path / "model", tmp_path / "onnx", manifest, "classification")


def _images(n: int) -> list:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)) for _ in range(n)]


def _assert_same_results(got, want) -> None:
    """Equal answers / labels and unknown words, scores to within 1e-5."""
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            if key == "score":
                assert got[key] == pytest.approx(want[key], abs=1e-5)
            else:
                assert got[key] == want[key], key
    else:
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same_results(g, w)


def test_pipelines_serve_the_export_as_they_serve_the_model(tmp_path_factory, tester):
    images, questions = _images(3), TEXTS[:3]
    saved, exported, _ = _exported(tmp_path_factory, tester, "classification", "hierarchical")
    onnx = MMFusionOnnxModel.from_pretrained(exported)
    vqa = pipeline("image-text-classification", model=onnx, processor=AutoProcessor.from_pretrained(exported))
    reference = pipeline("image-text-classification", model=str(saved))
    # Two questions about one image, as the pipeline batches them (the image read once, given to both).
    pairs = dict(image=[images[0], images[0], images[1]], question=questions, top_k=3)
    _assert_same_results(vqa(**pairs), reference(**pairs))
    with pytest.raises(ValueError, match="return_map=True.*ONNX graphs do not give"):
        vqa(image=images[0], question=questions[0], return_map=True)

    saved, exported, _ = _exported(tmp_path_factory, tester, "pretraining", "hierarchical")
    onnx = MMFusionOnnxModel.from_pretrained(exported)
    processor = AutoProcessor.from_pretrained(exported)
    for task, call in [
        ("image-text-matching", lambda pipe: pipe(image=images, text=questions)),
        ("cached-zero-shot-image-classification", lambda pipe: pipe(images, candidate_labels=["circle", "square"])),
    ]:
        served = call(pipeline(task, model=onnx, processor=processor))
        _assert_same_results(served, call(pipeline(task, model=str(saved))))
    retrieval = pipeline("image-text-retrieval", model=onnx, processor=processor)
    index = retrieval.build_index(images=images)
    reference = pipeline("image-text-retrieval", model=str(saved))
    reference_index = reference.build_index(images=images)
    np.testing.assert_allclose(index.embeddings.numpy(), reference_index.embeddings.numpy(), atol=1e-5)
    _assert_same_results(
        retrieval(questions[0], index=index, top_k=3), reference(questions[0], index=reference_index, top_k=3)
    )


def test_onnx_model_refuses_what_the_graphs_cannot_do(tmp_path_factory, tester):
    _, exported, _ = _exported(tmp_path_factory, tester, "classification", "hierarchical")
    onnx = MMFusionOnnxModel.from_pretrained(exported)
    inputs = example_inputs(onnx, tester.image_size, batch=2, length=4)
    with pytest.raises(ValueError, match="token_type_ids must be all 0"):
        onnx(**inputs, token_type_ids=torch.ones_like(inputs["input_ids"]))
    with pytest.raises(ValueError, match="has no image_encoder graph; it has model"):
        onnx.get_image_features(pixel_values=inputs["pixel_values"])
    with pytest.raises(ValueError, match="not on torch devices"):
        onnx.to("cuda")
    with pytest.raises(FileNotFoundError, match="has no onnx_export.json"):
        MMFusionOnnxModel.from_pretrained(exported.parent / "model")


def test_cli_exports_and_names_bad_input(tmp_path_factory, tmp_path, tester, capsys):
    """The README's command, `mm-fusion-export MODEL_DIR OUT_DIR` (the console script of `python -m mm_fusion.export`);
    its errors are one line, status 1."""
    saved, _, _ = _exported(tmp_path_factory, tester, "classification", "late")
    command = [str(Path(sys.executable).with_name("mm-fusion-export")), str(saved), str(tmp_path / "cli")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model.onnx: input_ids, attention_mask, pixel_values -> logits" in done.stdout
    manifest = json.loads((tmp_path / "cli" / MANIFEST_NAME).read_text())
    assert (tmp_path / "cli" / "model.onnx").is_file() and manifest["graphs"]["model"]["max_abs_difference"] < ATOL
    capsys.readouterr()  # the saving of the model above, when this test runs first, shows progress bars
    for argv, message in [
        ([str(tmp_path / "missing"), str(tmp_path / "out")], "missing"),
        ([str(saved), str(tmp_path / "out"), "--atol", "-1"], "differs from PyTorch by up to"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        error = capsys.readouterr().err
        assert exit_info.value.code == 1 and message in error and len(error.strip().splitlines()) == 1, error
