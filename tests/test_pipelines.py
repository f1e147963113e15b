"""The image processor (the training cache's own image function) and the pipelines, against tiny saved models."""

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from helpers.remote_code import BLOCK_MM_FUSION
from helpers.run_scripts import run_in_one_child
from helpers.training import TINY as TINY_RUN
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForPreTraining, AutoProcessor, pipeline

import mm_fusion
from mm_fusion import MMFusionImageProcessor, RetrievalIndex
from mm_fusion.data import load_easy_vqa, load_pairs, prepare_dataset, uint8_pixels
from mm_fusion.training import load_metric, setup_run, train_and_save


ROOT = Path(__file__).resolve().parents[1]
TINY = [*TINY_RUN, "--max_train_samples", "64", "--max_eval_samples", "40", "--num_train_epochs", "2"]


def _mode_images(directory: Path) -> list[str]:
    """One PNG / JPEG / TIFF per image mode the data pipeline accepts, each with content in every channel."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (23, 37, 3), dtype=np.uint8)
    alpha = rng.integers(0, 256, (23, 37), dtype=np.uint8)
    gray = rng.integers(0, 256, (23, 37), dtype=np.uint8)
    palette = Image.fromarray(rgb).quantize(16)
    palette.info["transparency"] = 3
    images = {
        "rgb.png": Image.fromarray(rgb),
        "rgba.png": Image.fromarray(np.dstack([rgb, alpha]), mode="RGBA"),
        "la.png": Image.fromarray(np.dstack([gray, alpha]), mode="LA"),
        "l.png": Image.fromarray(gray),
        "one_bit.png": Image.fromarray(gray > 127),
        "p.png": palette,
        "i16.png": Image.fromarray(rng.integers(0, 4096, (23, 37), dtype=np.uint16)),  # 12-bit data in 16 bits
        "i32.tiff": Image.fromarray(rng.integers(0, 70000, (23, 37), dtype=np.int32), mode="I"),
        "f.tiff": Image.fromarray(rng.random((23, 37), dtype=np.float32), mode="F"),
        "cmyk.jpg": Image.fromarray(rgb).convert("CMYK"),
        "ycbcr.jpg": Image.fromarray(rgb).convert("YCbCr"),
    }
    names = []
    for name, image in images.items():
        image.save(directory / name)
        names.append(name)
    return names


def test_processor_gives_the_cached_pixels_for_every_mode(tmp_path):
    """The saved processor reproduces what training's cache stored, bit for bit, for every accepted image mode."""
    names = _mode_images(tmp_path / "images")
    assert {Image.open(tmp_path / "images" / n).mode for n in names} >= {"RGB", "RGBA", "LA", "L", "1", "P", "CMYK"}
    rows = [{"id": n, "image": n, "text": "what is it?"} for n in names]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = mm_fusion.train_tokenizer(["what is it?"], vocab_size=50)
    prepared = prepare_dataset(
        load_pairs(str(tmp_path / "pairs.jsonl")), tokenizer, id_column="id", image_size=24,
        data_root=str(tmp_path / "images"),
    )  # fmt: skip
    assert not prepared.quarantine and len(prepared.images) == len(names)
    cached = uint8_pixels(prepared.images.data.column("pixel_values"), (3, 24, 24))

    processor = mm_fusion.MMFusionProcessor(MMFusionImageProcessor(size={"height": 24, "width": 24}), tokenizer)
    processor.save_pretrained(tmp_path / "saved")
    reloaded = AutoProcessor.from_pretrained(tmp_path / "saved")
    assert type(reloaded.image_processor) is MMFusionImageProcessor
    paths = [str(tmp_path / "images" / n) for n in names]
    served = reloaded(images=paths, text=["what is it?"] * len(names))["pixel_values"]
    assert served.dtype == torch.uint8
    for i, name in enumerate(names):
        assert np.array_equal(served[i].numpy(), cached[i]), name
    # PIL images, uint8 arrays (HWC, CHW) and tensors of the same pixels give the same input.
    rgb = np.asarray(Image.open(paths[0]))
    same = reloaded.image_processor(
        [Image.open(paths[0]), rgb, rgb.transpose(2, 0, 1).copy(), torch.from_numpy(rgb.copy())]
    )
    for row in same["pixel_values"]:
        assert np.array_equal(row.numpy(), cached[0])


def test_image_processor_errors_name_the_input(tmp_path):
    processor = MMFusionImageProcessor(size={"height": 8, "width": 8}, max_pixels=400)
    Image.new("RGB", (10, 10)).save(tmp_path / "ok.png")
    Image.new("RGB", (30, 30)).save(tmp_path / "big.png")
    (tmp_path / "text.png").write_text("not an image")
    ok = str(tmp_path / "ok.png")
    for bad, reason in [
        (str(tmp_path / "missing.png"), "missing_image"),
        (str(tmp_path / "text.png"), "not_an_image"),
        (str(tmp_path / "big.png"), "too_large"),
        (np.zeros((4, 4, 3), dtype=np.float32), "bad_array"),
    ]:
        with pytest.raises(ValueError, match=rf"image 1 of 2 \(.*\): {reason}"):
            processor([ok, bad])
    assert processor(ok)["pixel_values"].shape == (1, 3, 8, 8)


# -- a tiny VQA model trained by scripts/train.py -----------------------------------------------------------------


@pytest.fixture(scope="module")
def vqa_run(tmp_path_factory):
    """A tiny VQA run on easy-VQA; returns its output dir, its final eval accuracy and the eval predictions."""
    out = tmp_path_factory.mktemp("vqa") / "out"
    trainer = setup_run(["--output_dir", str(out), *TINY])
    results = train_and_save(trainer)
    prediction = trainer.predict(trainer.eval_dataset)
    ids = trainer.eval_dataset["id"]
    predicted = dict(zip(ids, (trainer.model.config.id2label[int(p)] for p in prediction.predictions)))
    return out, results["eval_accuracy"], predicted


def _eval_rows(n: int = 40) -> list[dict]:
    """The evaluation questions of the tiny runs, with the original image files (not the cache)."""
    return [dict(row) for row in load_easy_vqa(["test"])["test"].select(range(n))]


def test_vqa_pipeline_gives_the_training_evaluation_exactly(vqa_run):
    out, accuracy, predicted = vqa_run
    config = json.loads((out / "config.json").read_text())
    assert config["problem_type"] == "single_label_classification"
    assert set(config["custom_pipelines"]) == {"image-text-classification"}
    pipe = pipeline("image-text-classification", model=str(out))
    assert type(pipe) is mm_fusion.ImageTextClassificationPipeline  # the installed class, no remote code needed
    rows = _eval_rows()
    names = pipe.model.config.id2label
    answers = pipe(image=[r["image"] for r in rows], question=[r["question"] for r in rows], batch_size=7)
    served = {r["id"]: a[0]["answer"] for r, a in zip(rows, answers)}
    assert served == predicted  # every answer equals the training evaluation's prediction
    served_accuracy = np.mean([served[r["id"]] == names[r["answer"]] for r in rows])
    assert served_accuracy == accuracy


def test_vqa_pipeline_call_forms_and_image_sharing(vqa_run):
    out, _, _ = vqa_run
    pipe = pipeline("image-text-classification", model=str(out))
    rows = _eval_rows(12)
    path, question = rows[0]["image"], rows[0]["question"]
    single = pipe(image=path, question=question, top_k=3)
    assert [set(a) for a in single] == [{"answer", "score"}] * 3
    assert single[0]["score"] >= single[1]["score"] >= single[2]["score"]
    assert sum(a["score"] for a in pipe(image=path, question=question, top_k=100)) == pytest.approx(1.0, abs=1e-5)
    # The same image as a path, PIL image, uint8 array and tensor; dicts; a Dataset: the same answer.
    array = np.asarray(Image.open(path).convert("RGB"))
    for image in (Image.open(path), array, torch.from_numpy(array.copy()).permute(2, 0, 1)):
        assert pipe(image=image, question=question, top_k=3) == single
    assert pipe([{"image": path, "question": question}]) == [single[:1]]
    assert pipe({"image": path, "question": question}) == single[:1]
    dataset = Dataset.from_list([{"image": r["image"], "question": r["question"]} for r in rows])
    assert pipe(dataset) == pipe(image=[r["image"] for r in rows], question=[r["question"] for r in rows])

    # Several questions about one image: the vision tower sees that image once.
    shapes = []
    hook = pipe.model.mm_fusion.vision_model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(kwargs["pixel_values"].shape[0]), with_kwargs=True
    )
    try:
        many = pipe(image=path, question=[r["question"] for r in rows[:5]])
    finally:
        hook.remove()
    assert shapes == [1] and len(many) == 5


def test_vqa_pipeline_returns_where_the_model_looked(vqa_run):
    """`return_map=True`: every answer carries the model's default map for its pair and that answer (input x
    gradient weighted by the attention: each answer its own), from the pass that gives the answers, which are
    unchanged."""
    out, _, _ = vqa_run
    pipe = pipeline("image-text-classification", model=str(out))
    rows = _eval_rows(3)
    images, questions = [rows[0]["image"]] * 2 + [rows[2]["image"]], [r["question"] for r in rows]
    plain = pipe(image=images, question=questions, top_k=2)
    calls = []
    hook = pipe.model.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        mapped = pipe(image=images, question=questions, top_k=2, return_map=True)
    finally:
        hook.remove()
    assert len(calls) == 2  # one pass per answer rank, the answers from the first
    assert [[{k: a[k] for k in ("answer", "score")} for a in row] for row in mapped] == plain
    batch = AutoProcessor.from_pretrained(out)(images=images, text=questions)
    name = "input x gradient x fusion layer 1's attention"
    label2id = {label: int(i) for i, label in pipe.model.config.id2label.items()}
    for rank in range(2):
        targets = torch.tensor([label2id[row[rank]["answer"]] for row in mapped])
        expected = pipe.model.image_maps(**batch, targets=targets)
        assert expected.layers == [name]
        for k, row in enumerate(mapped):
            assert list(row[rank]["maps"]) == [name] and row[rank]["maps"][name].shape == (32, 32)  # the pixels
            np.testing.assert_allclose(row[rank]["maps"][name], expected.maps[k, 0].numpy(), atol=1e-6)
    assert not np.allclose(mapped[0][0]["maps"][name], mapped[0][1]["maps"][name])
    with pytest.raises(ValueError, match="return_map must be True or False"):
        pipe(image=images[0], question=questions[0], return_map="yes")


def test_vqa_pipeline_takes_dtype_and_device(vqa_run):
    out, _, _ = vqa_run
    rows = _eval_rows(8)
    inputs = dict(image=[r["image"] for r in rows], question=[r["question"] for r in rows], top_k=2)
    full = pipeline("image-text-classification", model=str(out), device="cpu")(**inputs)
    half = pipeline("image-text-classification", model=str(out), device="cpu", dtype=torch.bfloat16)
    assert half.model.dtype == torch.bfloat16 and half.device.type == "cpu"
    served = half(**inputs)
    for a, b in zip(full, served):  # bf16 scores are close to the float32 ones (the uint8 pixels are cast on device)
        assert [x["score"] for x in b] == pytest.approx([x["score"] for x in a], abs=0.05)


def test_vqa_pipeline_names_the_bad_input(vqa_run, tmp_path):
    out, _, _ = vqa_run
    pipe = pipeline("image-text-classification", model=str(out))
    good = _eval_rows(1)[0]["image"]
    (tmp_path / "notes.png").write_text("text")
    Image.new("RGB", (2000, 2000)).save(tmp_path / "huge.png")
    cases = [
        (str(tmp_path / "nope.png"), "missing_image"),
        (str(tmp_path / "notes.png"), "not_an_image"),
        (str(tmp_path / "huge.png"), "too_large"),
    ]
    pipe.image_processor.max_pixels = 1_000_000
    for bad, reason in cases:
        with pytest.raises(ValueError, match=rf"Input 2 \(.*\): {reason}"):
            pipe(image=[good, good, bad], question=["what shape?"] * 3)
    with pytest.raises(ValueError, match="Input 1: a text must be a non-empty string"):
        pipe(image=[good, good], question=["what shape?", " "])
    with pytest.raises(ValueError, match="3 images and 2 texts"):
        pipe(image=[good] * 3, question=["a", "b"])


def test_a_task_whose_head_the_model_lacks_is_refused_before_any_weight_is_read(vqa_run, pretrain_run, monkeypatch):
    """A pipeline task the saved head does not serve (transformers' zero-shot pipeline on a VQA model would serve it
    from fresh layers, near-uniform scores, silently) is refused before `from_pretrained` runs, with what was saved
    and what serves it; loading across heads outside a pipeline (fine-tuning) works."""
    vqa, pretrain = str(vqa_run[0]), str(pretrain_run[0])
    cases = [
        (task, vqa, "MMFusionForImageTextClassification", "It serves image-text-classification.")
        for task in (
            "zero-shot-image-classification",
            "image-text-matching",
            "image-text-retrieval",
            "cached-zero-shot-image-classification",
        )
    ] + [("image-text-classification", pretrain, "MMFusionForPretraining", f"--model_name_or_path {pretrain}.")]
    with monkeypatch.context() as patch:
        loads = []
        real = mm_fusion.MMFusionPreTrainedModel.from_pretrained.__func__
        patch.setattr(
            mm_fusion.MMFusionPreTrainedModel,
            "from_pretrained",
            classmethod(lambda cls, *args, **kwargs: loads.append(cls) or real(cls, *args, **kwargs)),
        )
        for task, path, saved, instead in cases:
            with pytest.raises(mm_fusion.MissingHeadError) as refused:
                pipeline(task, model=path)
            message = str(refused.value)
            assert task in message and f"{path} was saved as {saved}" in message and instead in message, message
        assert loads == []  # refused before any model class was asked to read weights
        assert (
            type(pipeline("zero-shot-image-classification", model=pretrain).model).__name__ == "MMFusionForPretraining"
        )
        assert loads  # the same hook sees a load that goes through
    # Outside a pipeline a checkpoint still starts another head, as fine-tuning does (scripts/train.py
    # --model_name_or_path): its towers and fusion load, the new head starts fresh.
    tuned = mm_fusion.MMFusionForImageTextClassification.from_pretrained(pretrain, num_labels=3)
    assert torch.equal(
        tuned.mm_fusion.text_model.embeddings.word_embeddings.weight,
        mm_fusion.MMFusionForPretraining.from_pretrained(
            pretrain
        ).mm_fusion.text_model.embeddings.word_embeddings.weight,
    )
    assert type(AutoModelForPreTraining.from_pretrained(vqa)).__name__ == "MMFusionForPretraining"


def test_words_the_tokenizer_never_saw_are_warned_about_and_named(vqa_run, pretrain_run):
    """'hexagon' has a letter no training question has (it becomes [UNK]); 'asdf' and 'qwerty' are split into letters
    whose embeddings training never used (every training word is one token): answers came back confident, silently."""
    vqa, _, _ = vqa_run
    pipe = pipeline("image-text-classification", model=str(vqa))
    image = _eval_rows(1)[0]["image"]
    assert pipe.unknown_words(["what shape is the hexagon?", "asdf qwerty", "What COLOR is the shape?"]) == [
        ["hexagon"],
        ["asdf", "qwerty"],
        [],
    ]
    with pytest.warns(mm_fusion.UnknownWordsWarning, match=r"in 2 of 3 questions \(input 0: 'hexagon'; input 2: "):
        answers = pipe(
            image=image, question=["what shape is the hexagon?", "what shape is in the image?", "asdf qwerty"]
        )
    assert [answer.get("unknown_words") for answer in (a[0] for a in answers)] == [
        ["hexagon"],
        None,
        ["asdf", "qwerty"],
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a question of known words: no warning, the usual fields
        assert set(pipe(image=image, question="what shape is in the image?")[0]) == {"answer", "score"}
    matcher = pipeline("image-text-matching", model=str(pretrain_run[0]))
    with pytest.warns(mm_fusion.UnknownWordsWarning, match="'hexagon'"):
        assert matcher(image=image, text="a hexagon")["unknown_words"] == ["hexagon"]


def test_pipeline_save_pretrained_keeps_the_processor(vqa_run, tmp_path):
    out, _, _ = vqa_run
    pipe = pipeline("image-text-classification", model=str(out))
    pipe.save_pretrained(tmp_path / "copy")
    copy = pipeline("image-text-classification", model=str(tmp_path / "copy"))
    rows = _eval_rows(6)
    inputs = dict(image=[r["image"] for r in rows], question=[r["question"] for r in rows], top_k=2)
    assert copy(**inputs) == pipe(**inputs)
    assert AutoProcessor.from_pretrained(tmp_path / "copy").max_length == 64


# -- a tiny pretraining model ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pretrain_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrain") / "out"
    results = train_and_save(setup_run(["--output_dir", str(out), "--task", "pretrain", *TINY]))
    return out, results


def test_retrieval_pipeline_recall_equals_the_training_evaluation(pretrain_run, tmp_path):
    """Recall@K computed from the pipeline's rankings on the evaluation pairs equals what training reported."""
    out, results = pretrain_run
    retriever = pipeline("image-text-retrieval", model=str(out))
    rows = _eval_rows()
    images = list(dict.fromkeys(r["image"] for r in rows))
    image_index = retriever.build_index(images=images, ids=images, batch_size=5)
    image_index.save(tmp_path / "gallery")
    loaded = RetrievalIndex.load(tmp_path / "gallery")
    assert torch.equal(loaded.embeddings, image_index.embeddings) and loaded.ids == image_index.ids
    texts = [r["question"] for r in rows]
    text_index = retriever.build_index(texts=texts, batch_size=16)

    # A rank counts the candidates scored strictly higher than the right one, as the training metric does: easy-VQA
    # repeats questions word for word, so tied scores are common and their order in a ranking is arbitrary.
    def rank(hits, right):
        best = max(h["score"] for h in hits if right(h))
        return sum(h["score"] > best for h in hits)

    text_hits = retriever(texts, index=loaded, top_k=len(images))
    text_rank = np.array([rank(hits, lambda h, r=r: h["id"] == r["image"]) for r, hits in zip(rows, text_hits)])
    image_hits = retriever(images, index=text_index, top_k=len(texts))
    image_rank = np.array(
        [rank(hits, lambda h, i=i: rows[int(h["id"])]["image"] == i) for i, hits in zip(images, image_hits)]
    )
    for k in (1, 5, 10):
        assert np.mean(text_rank < k) == pytest.approx(results[f"eval_text_to_image_R@{k}"], abs=1e-12), k
        assert np.mean(image_rank < k) == pytest.approx(results[f"eval_image_to_text_R@{k}"], abs=1e-12), k

    # Re-ranking scores the top 4 candidates with the matching head, as a direct model call on each pair does, and
    # re-orders them by it.
    top = retriever(texts[0], index=loaded, top_k=4)
    reranked = retriever(texts[0], index=loaded, top_k=3, rerank=4)
    processor = AutoProcessor.from_pretrained(out)
    batch = processor(images=[h["id"] for h in top], text=[texts[0]] * 4)
    with torch.no_grad():
        matching = retriever.model(**batch, return_loss=False).itm_logits.softmax(-1)[:, 1].tolist()
    expected = sorted(zip(matching, (h["id"] for h in top)), key=lambda pair: -pair[0])[:3]
    assert [(h["itm_score"], h["id"]) for h in reranked] == [(pytest.approx(p, abs=1e-6), i) for p, i in expected]


def test_matching_pipeline_gives_the_matching_heads_probability(pretrain_run):
    out, _ = pretrain_run
    matcher = pipeline("image-text-matching", model=str(out))
    rows = _eval_rows(4)
    scores = matcher(image=[r["image"] for r in rows], text=[r["question"] for r in rows])
    processor = AutoProcessor.from_pretrained(out)
    batch = processor(images=[r["image"] for r in rows], text=[r["question"] for r in rows])
    with torch.no_grad():
        expected = matcher.model(**batch, return_loss=False).itm_logits.softmax(-1)[:, 1]
    assert [s["score"] for s in scores] == pytest.approx(expected.tolist(), abs=1e-6)
    assert matcher(image=rows[0]["image"], text=rows[0]["question"])["score"] == pytest.approx(
        scores[0]["score"], abs=1e-6
    )


def test_zero_shot_stock_pipeline_and_the_cached_one_agree(pretrain_run):
    out, _ = pretrain_run
    labels = ["circle", "rectangle", "triangle"]
    images = [r["image"] for r in _eval_rows(5)]
    stock = pipeline("zero-shot-image-classification", model=str(out))
    cached = pipeline("cached-zero-shot-image-classification", model=str(out))
    expected = [stock(image, candidate_labels=labels, hypothesis_template="a {}") for image in images]
    calls = []
    hook = cached.model.mm_fusion.text_model.register_forward_hook(lambda *args: calls.append(1))
    try:
        got = cached(images, candidate_labels=labels, hypothesis_template="a {}", batch_size=2)
        again = cached(images[0], candidate_labels=labels, hypothesis_template="a {}")
    finally:
        hook.remove()
    assert len(calls) == 1  # the prompts were embedded once, for both calls
    for e, g in zip(expected, got):
        assert [x["label"] for x in e] == [x["label"] for x in g]
        assert [x["score"] for x in e] == pytest.approx([x["score"] for x in g], abs=1e-5)
    assert [x["label"] for x in again] == [x["label"] for x in got[0]]
    assert [x["score"] for x in again] == pytest.approx([x["score"] for x in got[0]], abs=1e-6)


# -- remote code --------------------------------------------------------------------------------------------------

REMOTE_PIPELINES = BLOCK_MM_FUSION + textwrap.dedent(
    """
    from transformers import pipeline

    vqa, pretrain, rows = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    images, texts = [r["image"] for r in rows], [r["question"] for r in rows]
    results = {}
    pipe = pipeline("image-text-classification", model=vqa, trust_remote_code=True)
    assert type(pipe).__module__.startswith("transformers_modules"), type(pipe).__module__
    results["vqa"] = pipe(image=images, question=texts, top_k=2)
    results["vqa_maps"] = [
        {k: v.tolist() for k, v in answers[0]["maps"].items()}
        for answers in pipe(image=images, question=texts, return_map=True)
    ]
    matcher = pipeline("image-text-matching", model=pretrain, trust_remote_code=True)
    results["matching"] = matcher(image=images, text=texts)
    retriever = pipeline("image-text-retrieval", model=pretrain, trust_remote_code=True)
    index = retriever.build_index(images=images)
    results["retrieval"] = retriever(texts, index=index, top_k=3)
    zero_shot = pipeline("cached-zero-shot-image-classification", model=pretrain, trust_remote_code=True)
    results["zero_shot"] = zero_shot(images, candidate_labels=["circle", "triangle"])
    results["stock_zero_shot"] = pipeline("zero-shot-image-classification", model=pretrain, trust_remote_code=True)(
        images[0], candidate_labels=["circle", "triangle"]
    )
    assert not [m for m in sys.modules if m == "mm_fusion" or m.startswith("mm_fusion.")]
    print(json.dumps(results))
    """
)


def test_pipelines_load_with_remote_code_where_mm_fusion_is_not_importable(vqa_run, pretrain_run, tmp_path):
    """The pipelines travel with the model (config `custom_pipelines` + code): a process that cannot import mm_fusion
    gets the same outputs, for every pipeline, and transformers' zero-shot pipeline too."""
    vqa, _, _ = vqa_run
    pretrain, _ = pretrain_run
    rows = [{"image": r["image"], "question": r["question"]} for r in _eval_rows(4)]
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-c", REMOTE_PIPELINES, str(vqa), str(pretrain), json.dumps(rows)],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    remote = json.loads(run.stdout.strip().splitlines()[-1])
    images, texts = [r["image"] for r in rows], [r["question"] for r in rows]
    local_vqa = pipeline("image-text-classification", model=str(vqa))
    local = {
        "vqa": local_vqa(image=images, question=texts, top_k=2),
        "vqa_maps": [
            {k: v.tolist() for k, v in answers[0]["maps"].items()}
            for answers in local_vqa(image=images, question=texts, return_map=True)
        ],
        "matching": pipeline("image-text-matching", model=str(pretrain))(image=images, text=texts),
    }
    retriever = pipeline("image-text-retrieval", model=str(pretrain))
    local["retrieval"] = retriever(texts, index=retriever.build_index(images=images), top_k=3)
    local["zero_shot"] = pipeline("cached-zero-shot-image-classification", model=str(pretrain))(
        images, candidate_labels=["circle", "triangle"]
    )
    local["stock_zero_shot"] = pipeline("zero-shot-image-classification", model=str(pretrain))(
        images[0], candidate_labels=["circle", "triangle"]
    )
    assert remote == json.loads(json.dumps(local))


def test_auto_image_processor_loads_ours(vqa_run):
    out, _, _ = vqa_run
    assert type(AutoImageProcessor.from_pretrained(out)) is MMFusionImageProcessor


def test_shipped_recall_metric_matches_ranks():
    """The retrieval test above compares against this metric; check it on a case computed by hand."""
    metric = load_metric("retrieval")
    image_embeds = [[1, 0], [1, 0], [0, 1]]
    text_embeds = [[1, 0], [0.6, 0.8], [0.8, 0.6]]
    result = metric.compute(image_embeds=image_embeds, text_embeds=text_embeds, image_ids=[0, 0, 1], k_values=[1])
    # texts 0 and 1 belong to image 0 (text 1 ranks image 1 first), text 2 to image 1 (ranks image 0 first).
    assert result["text_to_image_R@1"] == pytest.approx(1 / 3)
    assert result["image_to_text_R@1"] == pytest.approx(1 / 2)


# -- tools: predict, attention maps, push_to_hub -------------------------------------------------------------------


def _run_scripts(work: Path, *runs: tuple) -> list[subprocess.CompletedProcess]:
    """Each run `(name, args, status)`: `python scripts/<name>.py args` as a user runs it, all in one child interpreter
    (tests/helpers/run_scripts.py: one start and one import of torch for all); each must end with its status."""
    argvs = [{"argv": [str(ROOT / "scripts" / f"{name}.py"), *args]} for name, args, _ in runs]
    done = run_in_one_child(argvs, work)
    for (name, _, status), result in zip(runs, done):
        assert result.returncode == status, (name, result.stderr[-3000:])
    return done


def _one_line_error(done: subprocess.CompletedProcess, prog: str) -> str:
    """The error a script ended with: one `prog: error:` line on stderr, no traceback, nothing about the hub."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "huggingface.co" not in done.stderr
    return lines[0]


def test_predict_cli_answers_one_question_and_a_file_keeping_every_row(vqa_run, tmp_path):
    out, _, _ = vqa_run
    rows = _eval_rows(5)
    expected = pipeline("image-text-classification", model=str(out))(
        image=[r["image"] for r in rows[:3]], question=[r["question"] for r in rows[:3]], top_k=2
    )
    (tmp_path / "notes.png").write_text("text")
    lines = [json.dumps({"image": r["image"], "question": r["question"], "id": r["id"]}) for r in rows[:3]]
    lines.insert(1, json.dumps({"image": "missing.png", "question": "what shape?"}))
    lines.insert(3, json.dumps({"image": "notes.png", "question": "what shape?"}))
    lines.insert(4, json.dumps({"image": rows[0]["image"]}))
    lines.insert(5, "{not json")
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    one, done = _run_scripts(
        tmp_path,
        ("predict", ["--model", str(out), "--image", rows[0]["image"], "--question", rows[0]["question"]], 0),
        # Rows that cannot be answered make the exit status 3; every row is still written.
        ("predict", ["--model", str(out), "--input", str(tmp_path / "in.jsonl"), "--output",
                     str(tmp_path / "out.jsonl"), "--top_k", "2", "--batch_size", "3"], 3),
    )  # fmt: skip
    assert one.stdout.startswith(expected[0][0]["answer"] + "\t")
    assert "3 of 7 rows answered, 4 could not be" in done.stderr
    written = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["row"] for r in written] == list(range(7))
    errors = {r["row"]: r["error"] for r in written if "error" in r}
    assert set(errors) == {1, 3, 4, 5}
    assert "missing_image" in errors[1] and "not_an_image" in errors[3]
    assert "missing_column" in errors[4] and "bad_json" in errors[5]
    answered = [r for r in written if "answers" in r]
    assert [r["id"] for r in answered] == [r["id"] for r in rows[:3]]
    for got, want in zip(answered, expected):
        assert [a["answer"] for a in got["answers"]] == [a["answer"] for a in want]
        assert [a["score"] for a in got["answers"]] == pytest.approx([a["score"] for a in want], abs=1e-6)


def test_predict_and_attention_errors_are_one_line_before_any_model_is_loaded(vqa_run, pretrain_run, tmp_path):
    """A missing model directory (not taken for a hub repo id: no retries), a repeated --question, a missing image, a
    mistyped flag and a model of the wrong head are each one `error:` line, exit status 2, and no model's weights are
    loaded. The command lines run in one child interpreter (tests/helpers/run_scripts.py), each as `python SCRIPT`."""
    out, _, _ = vqa_run
    (tmp_path / "outputs" / "easy_vqa").mkdir(parents=True)
    (tmp_path / "outputs" / "easy_vqa" / "config.json").write_text("{}")
    image = _eval_rows(1)[0]["image"]
    ask = ["--image", image, "--question", "what shape is in the image?"]
    missing = tmp_path / "nope.png"
    runs = {  # (script, arguments, working directory) -> what its one line says
        ("predict", ("--model", "outputs/easy_vqa2", *ask), tmp_path): (
            "no model directory at outputs/easy_vqa2", "Did you mean outputs/easy_vqa?"),
        ("visualize_attention", ("--model", "outputs/easy_vqa2", *ask), tmp_path): (
            "no model directory at outputs/easy_vqa2", "Did you mean outputs/easy_vqa?"),
        ("predict", ("--model", str(out), *ask, "--question", "why?"), None): (
            "--question was given 2 times ('what shape is in the image?', 'why?')", "--input"),
        ("predict", ("--model", str(out), "--image", str(missing), "--question", "what?"), None): (
            f"--image {missing}: no file at {missing}",),
        ("visualize_attention", ("--model", str(out), "--image", str(missing), "--question", "what?"), None): (
            f"--image {missing}: no file at {missing}",),
        ("predict", ("--model", str(out), "--imag", image), None): (
            "unrecognized arguments: --imag", "Did you mean --image?"),
        ("visualize_attention", ("--model", str(pretrain_run[0]), *ask), None): ("saved as MMFusionForPretraining",),
    }  # fmt: skip
    listed = [
        {"argv": [str(ROOT / "scripts" / f"{script}.py"), *args], "cwd": cwd, "no_model": True}
        for script, args, cwd in runs
    ]
    for (script, _, _), expected, result in zip(runs, runs.values(), run_in_one_child(listed, tmp_path)):
        assert result.returncode == 2, result.stderr
        line = _one_line_error(result, f"{script}.py")
        assert all(part in line for part in expected), line


def test_predict_names_the_words_the_tokenizer_never_saw(vqa_run, tmp_path):
    out, _, _ = vqa_run
    image = _eval_rows(1)[0]["image"]
    rows = [{"image": image, "question": q} for q in ("asdf qwerty", "what shape is in the image?")]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    one, done = _run_scripts(
        tmp_path,
        ("predict", ["--model", str(out), "--image", image, "--question", "what shape is the hexagon?"], 0),
        ("predict", ["--model", str(out), "--input", str(tmp_path / "in.jsonl")], 0),
    )
    assert "predict.py: warning: the model's tokenizer never saw 'hexagon'" in one.stderr
    assert "Traceback" not in one.stderr and one.stdout.count("\t") == 1
    written = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r.get("unknown_words") for r in written] == [["asdf", "qwerty"], None]
    assert all(set(answer) == {"answer", "score"} for r in written for answer in r["answers"])
    assert "1 have words the tokenizer never saw" in done.stderr and "UnknownWordsWarning" not in done.stderr


def test_visualize_attention_draws_the_default_map_or_the_attention(vqa_run, tmp_path):
    out, _, _ = vqa_run
    row = _eval_rows(1)[0]
    ask = ["--model", str(out), "--image", row["image"], "--question", row["question"]]
    # the default map; --method attention: per fusion layer, the question's attention over the 2 x 2 patches (32 px /
    # patch 16) and the class token; --token without --method attention: an error
    done, attention, token = _run_scripts(
        tmp_path,
        ("visualize_attention", [*ask, "--output", str(tmp_path / "map.png")], 0),
        ("visualize_attention", [*ask, "--output", str(tmp_path / "attention.png"), "--method", "attention",
                                 "--token", "1"], 0),
        ("visualize_attention", [*ask, "--token", "1"], 2),
    )  # fmt: skip
    assert Image.open(tmp_path / "map.png").size[0] > 300 and Image.open(tmp_path / "attention.png").size[0] > 300
    model = mm_fusion.MMFusionForImageTextClassification.from_pretrained(out, attn_implementation="eager").eval()
    batch = AutoProcessor.from_pretrained(out)(images=[row["image"]], text=[row["question"]])
    with torch.no_grad():
        outputs = model(**batch, output_attentions=True)
    answer = model.config.id2label[int(outputs.logits.argmax())]
    kind = "input x gradient weighted by the model's coarse map"  # the default map's method, named
    assert done.stderr.splitlines()[-1].startswith(f"{answer} (") and kind in done.stderr.splitlines()[-1]
    assert attention.stderr.splitlines()[-1].startswith(f"{answer} (") and "cross-attention" in attention.stderr
    layers = outputs.text_to_image_attentions
    assert len(layers) == model.config.num_fusion_layers == 1 and layers[0].shape[-1] == 2 * 2 + 1
    for probabilities in layers:  # which sums to one
        assert torch.allclose(probabilities.sum(-1), torch.ones(()), atol=1e-5)
    assert "--token picks one token's attention; the default map has no tokens" in _one_line_error(
        token, "visualize_attention.py"
    )


def test_push_to_hub_sends_model_processor_code_pipelines_and_card(tmp_path, monkeypatch):
    """No hub is reachable here: the upload is captured at transformers' hub client (create_repo / upload_folder),
    and the test checks what would have been sent."""
    import transformers.trainer

    sent = {}

    class FakeHub:
        def create_repo(self, repo_id, **kwargs):
            return type("Repo", (), {"repo_id": repo_id})()

        def upload_folder(self, repo_id, folder_path, ignore_patterns=(), **kwargs):
            import fnmatch

            files = [p.name for p in Path(folder_path).iterdir() if p.is_file()]
            sent["files"] = sorted(f for f in files if not any(fnmatch.fnmatch(f, p) for p in ignore_patterns))
            sent["card"] = (Path(folder_path) / "README.md").read_text()
            sent["config"] = json.loads((Path(folder_path) / "config.json").read_text())
            sent["repo_id"] = repo_id

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: FakeHub())
    flags = ["--output_dir", str(tmp_path / "out"), *TINY, "--push_to_hub", "True", "--hub_model_id", "me/tiny",
             "--save_strategy", "no", "--num_train_epochs", "1"]  # fmt: skip
    train_and_save(setup_run(flags))
    assert sent["repo_id"] == "me/tiny"
    expected = {
        "config.json", "model.safetensors", "processor_config.json", "tokenizer.json", "tokenizer_config.json",
        "configuration_mm_fusion.py", "modeling_mm_fusion.py", "processing_mm_fusion.py",
        "image_processing_mm_fusion.py", "pipeline_mm_fusion.py", "README.md", "training_curves.png",
    }  # fmt: skip
    assert expected <= set(sent["files"]), expected - set(sent["files"])
    assert "image-text-classification" in sent["config"]["custom_pipelines"]
    assert 'pipeline(\n    "image-text-classification",\n    model="me/tiny",\n' in sent["card"]
