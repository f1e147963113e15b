"""
A browser demo of a saved model, with Gradio: `python scripts/demo.py MODEL_DIR` (`pip install -e ".[demo]"`).

- A VQA / classification model (`scripts/train.py --task vqa | classify`): an image and a question give the top-5
  answers with their scores, the map of where the model looked for its answer over the enlarged image (the model's
  default map, as `pipeline(..., return_map=True)` gives it, its method named), the map's figures as measured at the
  end of training (does it peak on the object; does painting over its peak change the answer), and the words of the
  question the model cannot read.
- A pretraining model (`--task pretrain`): image-text matching scores for several texts; retrieval of a folder of
  images (or a saved `RetrievalIndex`) for a typed query; zero-shot labels.

Example inputs come from the model's own test data when its card names a dataset mm_fusion ships (easy-VQA). It runs
offline with Gradio's analytics off, and the same file serves as a hub Space's `app.py` (the model directory from
`MM_FUSION_DEMO_MODEL`, default `.`). `gradio_client` can call it: `Client(url).predict(image, question,
api_name="/answer")`.
"""

import argparse
import os
import re
import sys
from pathlib import Path


os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

TOP_K = 5
EXAMPLES = 6
MAP_SIDE = 256  # the map's image on the page: a 64 px image is shown 4x


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="demo.py", description=__doc__.split("\n\n")[0].strip())
    parser.add_argument(
        "model",
        nargs="?",
        default=os.environ.get("MM_FUSION_DEMO_MODEL", "."),
        help="a directory scripts/train.py saved (default: $MM_FUSION_DEMO_MODEL, or . as a Space's app.py)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=7860, help="port to serve on")
    parser.add_argument("--images", default=None, help="retrieval: a folder of images, or a saved RetrievalIndex")
    parser.add_argument("--labels", default="circle,rectangle,triangle", help="zero-shot: the default labels")
    return parser.parse_args(argv)


def card_dataset(model_dir: Path) -> str | None:
    """The dataset the model card's results name (`model-index`), if any."""
    card = model_dir / "README.md"
    if not card.is_file():
        return None
    match = re.search(r"^\s+dataset:\s*\n\s+name:\s*(.+)$", card.read_text(), flags=re.M)
    return match.group(1).strip() if match else None


def example_pairs(model_dir: Path, n: int = EXAMPLES) -> list[list[str]]:
    """`[image path, question]` pairs from the model's own test data: easy-VQA's test split when the card names it,
    one question per image, types in turn; none otherwise."""
    if card_dataset(model_dir) != "easy-VQA":
        return []
    from mm_fusion.data import load_easy_vqa

    test = load_easy_vqa(["test"])["test"]
    pairs, seen = [], set()
    for row in test:
        if row["image_id"] in seen:
            continue
        seen.add(row["image_id"])
        pairs.append([row["image"], row["question"]])
        if len(pairs) == n:
            break
    return pairs


def overlay(image, grid, alpha: float = 0.5, min_side: int = MAP_SIDE):
    """The map (a `(height, width)` grid summing to 1) over the image, as an RGB array; a small image is enlarged
    (pixels kept sharp) to at least `min_side` on its short side, for the page."""
    import matplotlib
    import numpy as np
    from PIL import Image

    image = image.convert("RGB")
    scale = max(1, -(-min_side // min(image.size)))
    image = image.resize((image.width * scale, image.height * scale), Image.NEAREST)
    rgb = np.asarray(image, dtype=np.float32) / 255
    heat = np.asarray(grid, dtype=np.float32)
    heat = (heat - heat.min()) / max(float(heat.max() - heat.min()), 1e-12)
    size = (rgb.shape[1], rgb.shape[0])
    heat = np.asarray(Image.fromarray((heat * 255).astype(np.uint8)).resize(size, Image.BILINEAR)) / 255
    colour = matplotlib.colormaps["inferno"](heat)[..., :3]
    return ((1 - alpha) * rgb + alpha * colour).clip(0, 1) * 255


class Demo:
    """What the app's buttons call, apart from Gradio (tested directly and through the browser)."""

    def __init__(self, model_dir: str, images: str | None = None):
        from transformers import AutoConfig, pipeline

        import mm_fusion  # registers the pipelines
        from mm_fusion.map_scoring import measured_map_figures

        self.model_dir = Path(model_dir)
        mm_fusion.check_model_path(self.model_dir)
        config = AutoConfig.from_pretrained(self.model_dir)
        self.head = (config.architectures or ["MMFusionForImageTextClassification"])[0]
        if self.head == "MMFusionForImageTextClassification":
            self.vqa = pipeline("image-text-classification", model=str(self.model_dir))
            self.map_figures = measured_map_figures(self.model_dir)
        else:
            self.matcher = None
            if config.itm_loss_weight > 0:
                self.matcher = pipeline("image-text-matching", model=str(self.model_dir))
            self.retriever = pipeline("image-text-retrieval", model=str(self.model_dir))
            self.zero_shot = pipeline("cached-zero-shot-image-classification", model=str(self.model_dir))
            self.index = self._index(images) if images else None

    def _index(self, images: str):
        from mm_fusion import RetrievalIndex

        path = Path(images)
        if (path / "index.json").is_file():
            return RetrievalIndex.load(path)
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp"))
        if not files:
            raise ValueError(f"--images {images}: no index.json and no .png / .jpg / .jpeg / .webp images in it.")
        return self.retriever.build_index(images=[str(p) for p in files], ids=[p.name for p in files])

    def answer(self, image, question: str):
        """Top-5 answers `{answer: score}`, the top answer's map over the image (or None), a note naming the map's
        method with its measured figures, and one on unknown words."""
        if image is None or not (question or "").strip():
            raise ValueError("Give an image and a question.")
        answers = self.vqa(image=image, question=question, top_k=TOP_K)
        top = self.vqa(image=image, question=question, return_map=True)[0]  # the map explains the top answer
        scores = {row["answer"]: row["score"] for row in answers}
        maps = top.get("maps") or {}
        picture = overlay(image, list(maps.values())[-1]).astype("uint8") if maps else None
        described = f'**Where the model looked for "{top["answer"]}"**: {", ".join(maps)}. {self.map_figures}'
        unknown = answers[0].get("unknown_words") or []
        note = (
            f"Words the model never saw, which it cannot read: {', '.join(unknown)}. Its answer rests on the others."
            if unknown
            else ""
        )
        return scores, picture, described, note

    def match(self, image, texts: str):
        """`{text: probability that it matches the image}` for each line of `texts`."""
        lines = [line.strip() for line in (texts or "").splitlines() if line.strip()]
        if image is None or not lines:
            raise ValueError("Give an image and at least one text (one per line).")
        if self.matcher is None:
            raise ValueError("This model was trained without its matching head (itm_loss_weight=0).")
        return {text: row["score"] for text, row in zip(lines, self.matcher(image=[image] * len(lines), text=lines))}

    def retrieve(self, query: str):
        """The gallery's best images for a text query, as (path, caption) pairs."""
        if self.index is None:
            raise ValueError("Start the demo with --images FOLDER (or a saved index) to search images.")
        results = self.retriever(query, index=self.index, top_k=TOP_K)
        rows = {image_id: i for i, image_id in enumerate(self.index.ids)}
        pixels = self.index.pixel_values  # the gallery's uint8 images, kept by build_index
        return [
            (
                pixels[rows[r["id"]]].permute(1, 2, 0).numpy() if pixels is not None else None,
                f"{r['id']}: {r['score']:.3f}",
            )
            for r in results
        ]

    def classify(self, image, labels: str):
        names = [label.strip() for label in (labels or "").split(",") if label.strip()]
        if image is None or len(names) < 2:
            raise ValueError("Give an image and at least two labels, separated by commas.")
        return {row["label"]: row["score"] for row in self.zero_shot(image, candidate_labels=names)}


def build_app(demo: Demo, labels: str = "circle,rectangle,triangle"):
    import gradio as gr

    name = demo.model_dir.resolve().name
    with gr.Blocks(title=f"mm_fusion: {name}", analytics_enabled=False) as app:
        gr.Markdown(f"# {name}\n{demo.head} from `{demo.model_dir}`.")
        if demo.head == "MMFusionForImageTextClassification":
            with gr.Row():
                with gr.Column():
                    image = gr.Image(type="pil", label="Image", elem_id="image", height=256)
                    question = gr.Textbox(label="Question", elem_id="question")
                    submit = gr.Button("Answer", variant="primary", elem_id="submit")
                with gr.Column():
                    answers = gr.Label(num_top_classes=TOP_K, label="Answers", elem_id="answers")
                    looked = gr.Image(label="Where the model looked", elem_id="map", height=256)
                    method = gr.Markdown(elem_id="method")
                    note = gr.Markdown(elem_id="note")
            examples = example_pairs(demo.model_dir)
            if examples:
                gr.Examples(examples, inputs=[image, question], label="From the model's test data")
            submit.click(demo.answer, [image, question], [answers, looked, method, note], api_name="answer")
        else:
            with gr.Tab("Matching"):
                image = gr.Image(type="pil", label="Image")
                texts = gr.Textbox(label="Texts, one per line", lines=4)
                scores = gr.Label(label="Match probability")
                gr.Button("Score", variant="primary").click(demo.match, [image, texts], scores, api_name="match")
            with gr.Tab("Retrieval"):
                query = gr.Textbox(label="Query")
                gallery = gr.Gallery(label="Best images")
                gr.Button("Search", variant="primary").click(demo.retrieve, query, gallery, api_name="retrieve")
            with gr.Tab("Zero-shot"):
                zs_image = gr.Image(type="pil", label="Image")
                zs_labels = gr.Textbox(label="Labels, comma-separated", value=labels)
                zs_out = gr.Label(label="Labels")
                gr.Button("Classify", variant="primary").click(
                    demo.classify, [zs_image, zs_labels], zs_out, api_name="classify"
                )
    return app


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        demo = Demo(args.model, images=args.images)
    except (FileNotFoundError, ValueError) as error:
        sys.exit(f"demo.py: error: {error}")
    build_app(demo, args.labels).launch(server_name=args.host, server_port=args.port, show_error=True)


if __name__ == "__main__":
    main()
