"""scripts/demo.py: its answers against pipeline(...)'s, through Python, gradio_client and a real browser (Debian's
chromium driven by Playwright, `-m browser`)."""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.training import TINY as TINY_RUN
from PIL import Image
from transformers import pipeline

from mm_fusion.training import setup_run, train_and_save


pytest.importorskip("gradio")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "demo.py"
QUESTION = "what shape is in the image?"


def _pipeline_answers(model_dir: Path, image: str) -> list[dict]:
    """What pipeline(...) answers for the demo's question, top 5."""
    return pipeline("image-text-classification", model=str(model_dir))(image=image, question=QUESTION, top_k=5)


def _demo_module():
    spec = importlib.util.spec_from_file_location("demo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def vqa_model(tmp_path_factory) -> Path:
    """A tiny VQA model trained on easy-VQA by scripts/train.py's code (its card names the dataset), or the model in
    `MM_FUSION_DEMO_TEST_MODEL` (the README's screenshot: the default run's, with `MM_FUSION_DEMO_SCREENSHOT`)."""
    if os.environ.get("MM_FUSION_DEMO_TEST_MODEL"):
        return Path(os.environ["MM_FUSION_DEMO_TEST_MODEL"])
    out = tmp_path_factory.mktemp("demo") / "vqa"
    flags = [*TINY_RUN, "--max_train_samples", "64", "--max_eval_samples", "32", "--num_train_epochs", "1"]
    train_and_save(setup_run([*flags, "--output_dir", str(out)]))
    return out


@pytest.fixture(scope="module")
def test_image() -> str:
    import easy_vqa

    return easy_vqa.get_test_image_paths()[0]


def test_demo_answers_as_the_pipeline_does(vqa_model, test_image):
    demo = _demo_module().Demo(str(vqa_model))
    scores, picture, described, note = demo.answer(Image.open(test_image), QUESTION)
    pipe = pipeline("image-text-classification", model=str(vqa_model))
    expected = pipe(image=test_image, question=QUESTION, top_k=5)
    assert list(scores) == [row["answer"] for row in expected]
    assert list(scores.values()) == pytest.approx([row["score"] for row in expected], abs=1e-6)
    assert picture.shape == (256, 256, 3) and picture.dtype == np.uint8  # a 64 px image, enlarged for the page
    # The map shown is the pipeline's default for the top answer, over the image: its method named, with the figures
    # measured at the end of the model's training.
    ((name, grid),) = pipe(image=test_image, question=QUESTION, return_map=True)[0]["maps"].items()
    np.testing.assert_array_equal(picture, _demo_module().overlay(Image.open(test_image), grid).astype("uint8"))
    figures = json.loads((vqa_model / "all_results.json").read_text())
    assert name == "input x gradient x fusion layer 1's attention" and name in described
    assert f"on the object for {figures['eval_map_on_object']:.1%}" in described
    assert note == ""
    _, _, _, note = demo.answer(Image.open(test_image), "what shape is the zorblax?")
    assert "zorblax" in note
    examples = _demo_module().example_pairs(vqa_model)
    assert len(examples) == 6 and all(Path(image).is_file() and question for image, question in examples)
    with pytest.raises(ValueError, match="Give an image and a question"):
        demo.answer(None, QUESTION)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(vqa_model):
    """`python scripts/demo.py MODEL --port P` in its own process, until the module's tests end."""
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(vqa_model), "--port", str(port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/"
    start = time.monotonic()
    while time.monotonic() - start < 120:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if process.poll() is not None:
                pytest.fail(f"demo.py exited: {process.stdout.read()[-3000:]}")
            time.sleep(0.5)
    else:
        process.kill()
        pytest.fail("demo.py did not serve within 120 s")
    yield url, time.monotonic() - start
    process.terminate()
    process.wait(timeout=30)


def test_gradio_client_calls_the_demo(served, vqa_model, test_image):
    from gradio_client import Client, handle_file

    url, _ = served
    scores, _, _, _ = Client(url, verbose=False).predict(handle_file(test_image), QUESTION, api_name="/answer")
    expected = pipeline("image-text-classification", model=str(vqa_model))(
        image=test_image, question=QUESTION, top_k=5
    )
    assert scores["label"] == expected[0]["answer"]
    got = {row["label"]: row["confidence"] for row in scores["confidences"]}
    assert got == pytest.approx({row["answer"]: row["score"] for row in expected}, abs=1e-6)


@pytest.mark.browser
def test_browser_answers_as_the_pipeline_does(served, vqa_model, test_image, tmp_path):
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "the browser test needs Debian's chromium (apt-get install chromium; .ci/run installs it)"
    url, _ = served
    expected = pipeline("image-text-classification", model=str(vqa_model))(
        image=test_image, question=QUESTION, top_k=5
    )
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(url, wait_until="networkidle")
        page.locator("#image input[type=file]").set_input_files(test_image)
        page.locator("#question textarea").fill(QUESTION)
        page.locator("#submit").click()
        page.locator("#map img").wait_for(timeout=60_000)
        shown = page.locator("#answers").inner_text().split("\n")
        method = page.locator("#method").inner_text()
        screenshot = Path(os.environ.get("MM_FUSION_DEMO_SCREENSHOT", tmp_path / "demo.png"))
        page.screenshot(path=str(screenshot), full_page=True)
        browser.close()
    # The label shows the top answer, then each answer with its score as a whole percentage.
    assert shown[1] == expected[0]["answer"]
    for row in expected:
        assert row["answer"] in shown and f"{round(row['score'] * 100)}%" in shown
    assert screenshot.stat().st_size > 10_000
    assert "input x gradient x fusion layer" in method and "Measured at the end of training" in method


def test_demo_of_a_pretraining_model_matches_retrieves_and_classifies_as_the_pipelines_do(tmp_path):
    out = tmp_path / "pretrain"
    flags = [*TINY_RUN, "--task", "pretrain", "--max_train_samples", "32", "--max_eval_samples", "16"]
    train_and_save(setup_run([*flags, "--num_train_epochs", "1", "--output_dir", str(out)]))
    folder = tmp_path / "gallery"
    folder.mkdir()
    colours = ["red", "green", "blue", "yellow", "white", "black"]
    for colour in colours:
        Image.new("RGB", (40, 40), colour).save(folder / f"{colour}.png")
    demo = _demo_module().Demo(str(out), images=str(folder))
    image = Image.open(folder / "red.png")
    labels = ["circle", "rectangle", "triangle"]
    expected = pipeline("cached-zero-shot-image-classification", model=str(out))(image, candidate_labels=labels)
    assert demo.classify(image, ",".join(labels)) == pytest.approx({r["label"]: r["score"] for r in expected})
    texts = ["a red shape", "a blue circle"]
    matched = pipeline("image-text-matching", model=str(out))(image=[image] * 2, text=texts)
    assert demo.match(image, "\n".join(texts)) == pytest.approx({t: r["score"] for t, r in zip(texts, matched)})
    found = demo.retrieve("a red shape")
    assert len(found) == 5 and all(picture.shape == (32, 32, 3) for picture, _ in found)  # the model's input size
    ranked = pipeline("image-text-retrieval", model=str(out))("a red shape", index=demo.index, top_k=5)
    assert [caption.split(":")[0] for _, caption in found] == [r["id"] for r in ranked]
    with pytest.raises(ValueError, match="at least two labels"):
        demo.classify(image, "circle")
