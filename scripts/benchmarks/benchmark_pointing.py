"""Pointing accuracy: does the map a Sort-of-CLEVR model reads the image by peak on the object the question names?

Every held-out Sort-of-CLEVR question names one object by its colour, and the generator knows where each object is.
For each question, the model's map (`MMFusionForImageTextClassification.image_maps`: the question's cross-attention per
fusion layer, or Grad-CAM on the tower's last map read) is put on the image's pixels; the question counts as pointed
at when the map's highest pixel lies inside the named object's square. Reported per method, layer and question
family, with the model's answer accuracy on the same questions. For attention, the map is the mean over the question's
tokens, and also (`attention_colour_word`) the attention of the word that names the colour alone. A tower conditioned
by cross-attention (`vision_text_attention`) adds `tower_attention_colour_word`: per stage, the attention its cells
give the colour word. For the
non-relational families (shape, left, top) the named object is all a right answer needs; for the relational ones it
is where the reading starts.
Chance: an object covers 10 x 10 of the 64 x 64 pixels, 2.4% of the image. On a coarse grid a small object may hold
no cell's centre at all; `reachable_non_relational` is the share of non-relational questions whose object holds one,
the most a map on that grid can score (1.0 from 8 x 8 cells up at 64 px; about 0.55 on a 4 x 4 grid).

    python scripts/benchmarks/benchmark_pointing.py --model outputs/sort_of_clevr --run hierarchical
    python scripts/benchmarks/benchmark_pointing.py --model outputs/sort_of_clevr --grid pointing_grid.png

`--run NAME` adds the figures to that row of scripts/benchmarks/results/sort_of_clevr.json (as `pointing`); the
figures are printed as a table either way. `--grid` draws 8 held-out questions (non-relational, every family and
colour) with their maps and the named object's square.
"""

import argparse
import json
import re
import sys

import numpy as np
import torch
import yaml
from benchmarking import RESULTS, ROOT, machine, markdown_table


NON_RELATIONAL = ("shape", "horizontal", "vertical")
FAMILIES = (*NON_RELATIONAL, "closest", "furthest", "count")


def colour_pattern() -> re.Pattern:
    """The colour word a question names its object by."""
    from mm_fusion.data.sort_of_clevr import COLOURS

    return re.compile(r"\b(" + "|".join(COLOURS) + r")\b")


def recipe_dataset_options() -> str:
    return yaml.safe_load((ROOT / "scripts/configs/sort_of_clevr.yaml").read_text())["dataset_options"]


def held_out_questions(dataset_options: str, images: int):
    """The test split's questions about its first `images` images (every family), with the named object's box."""
    from mm_fusion.data import load_sort_of_clevr
    from mm_fusion.training import parse_overrides

    options = parse_overrides(dataset_options, flag="--dataset_options")
    test = load_sort_of_clevr(["test"], **options)["test"]
    test = test.filter(lambda ids: [i < images for i in ids], input_columns="image_id", batched=True)
    size = options.get("object_size", 10)
    half = size // 2
    pattern = colour_pattern()
    boxes = []
    for question, objects in zip(test["question"], test["objects"]):
        colour = pattern.search(question).group(1)
        named = next(o for o in objects if o["colour"] == colour)
        x0, y0 = named["x"] - half, named["y"] - half
        boxes.append((x0, y0, x0 + size - 1, y0 + size - 1))
    return test, torch.tensor(boxes)


def colour_word_positions(tokenizer, questions: list[str]) -> torch.Tensor:
    """Per question, the position of the token that holds its colour word (the first, if the tokenizer splits it), as
    the processor lays the question out."""
    pattern = colour_pattern()
    questions = list(questions)
    encoded = tokenizer(questions, return_offsets_mapping=True)
    positions = []
    for question, offsets in zip(questions, encoded["offset_mapping"]):
        start = pattern.search(question).start()
        positions.append(next(k for k, (a, b) in enumerate(offsets) if a <= start < b))
    return torch.tensor(positions)


def measure(
    model, processor, test, boxes, method: str | None, batch_size: int = 64, colour_word: bool = False
) -> dict:
    """Pointing accuracy per layer and family (and overall for the non-relational families), answer accuracy. With
    `colour_word` (attention only), the map is the colour word's attention alone, not the mean over the question."""
    from mm_fusion.image_maps import peak_inside, reachable

    pointed, possible, right, families, layers, used = [], [], [], [], None, None
    names = model.config.id2label
    answers = test.features["answer"].names
    for start in range(0, len(test), batch_size):
        rows = test[start : start + batch_size]
        batch = processor(images=rows["image"], text=rows["question"])
        token = colour_word_positions(processor.tokenizer, rows["question"]) if colour_word else None
        result = model.image_maps(**batch, method=method, **({"token": token} if colour_word else {}))
        layers, used = result.layers, result.method
        height, width = batch["pixel_values"].shape[-2:]
        scale = torch.tensor([width, height, width, height]) / torch.tensor(
            [rows["image"][0].width, rows["image"][0].height] * 2
        )
        box = (boxes[start : start + batch_size].float() * scale).round().long()
        pointed.append(peak_inside(result.maps, box, (height, width)))
        possible.append(reachable(tuple(result.maps.shape[-2:]), box, (height, width)))
        right += [names[int(p)] == answers[a] for p, a in zip(result.logits.argmax(-1), rows["answer"])]
        families += rows["question_family"]
    pointed = torch.cat(pointed).float().numpy()  # (questions, layers)
    possible = torch.cat(possible).float().numpy()  # (questions,): the maps' grid holds a cell centred in the object
    right = np.array(right, dtype=float)
    families = np.array(families)
    figures = {"method": used, "layers": layers, "questions": len(families), "per_layer": {}}
    if colour_word:
        figures["token"] = "colour word"
    non_relational = np.isin(families, NON_RELATIONAL)
    # The most the maps' grid allows: a question counts only where some cell's centre lies inside its object.
    figures["reachable_non_relational"] = round(float(possible[non_relational].mean()), 4)
    for k, layer in enumerate(layers):
        entry = {"non_relational": round(float(pointed[non_relational, k].mean()), 4)}
        entry |= {f: round(float(pointed[families == f, k].mean()), 4) for f in FAMILIES if (families == f).any()}
        figures["per_layer"][layer] = entry
    best = max(layers, key=lambda layer: figures["per_layer"][layer]["non_relational"])
    figures["best_layer"] = best
    figures["best_non_relational"] = figures["per_layer"][best]["non_relational"]
    figures["answer_accuracy"] = {"non_relational": round(float(right[non_relational].mean()), 4)}
    figures["answer_accuracy"] |= {
        f: round(float(right[families == f].mean()), 4) for f in FAMILIES if (families == f).any()
    }
    return figures


def grid_examples(test, count: int = 8) -> list[int]:
    """`count` non-relational questions of distinct images, cycling through the families and colours (any colour where
    no unused image asks about the wanted one)."""
    from mm_fusion.data.sort_of_clevr import COLOURS

    colours = list(COLOURS)
    rows = list(zip(test["question_family"], test["question"], test["image_id"]))
    chosen, used = [], set()
    for k in range(count):
        family, colour = NON_RELATIONAL[k % len(NON_RELATIONAL)], colours[k % len(colours)]
        candidates = [i for i, (f, _, image) in enumerate(rows) if f == family and image not in used]
        exact = [i for i in candidates if f" {colour} " in rows[i][1]]
        if candidates:
            index = (exact or candidates)[0]
            chosen.append(index)
            used.add(rows[index][2])
    return chosen


def draw_grid(model, processor, test, boxes, path: str, method: str | None, colour_word: bool = False) -> None:
    from mm_fusion.image_maps import plot

    picked = grid_examples(test)
    rows = test.select(picked)[:]  # plain lists: a processor takes no `datasets` Column
    batch = processor(images=rows["image"], text=rows["question"])
    token = {"token": colour_word_positions(processor.tokenizer, rows["question"])} if colour_word else {}
    result = model.image_maps(**batch, method=method, **token)
    probabilities = result.logits.softmax(-1)
    names = model.config.id2label
    drawn = []
    for k in range(len(picked)):
        answer = int(result.targets[k])
        drawn.append({
            "image": batch["pixel_values"][k].permute(1, 2, 0).numpy(),
            "question": rows["question"][k],
            "answer": names[answer],
            "score": float(probabilities[k, answer]),
            "maps": result.maps[k],
            "layers": result.layers,
            "box": boxes[picked[k]].tolist(),
        })  # fmt: skip
    kinds = {"attention": "cross-attention", "tower_attention": "The tower's reads", "grad_cam": "Grad-CAM"}
    kind = kinds[result.method]
    if colour_word and result.method == "tower_attention":
        title = "The attention the tower's cells give the colour word\n(green: the named object; +: the peak)"
    elif colour_word:
        title = "The colour word's attention\n(green: the named object; +: the peak)"
    else:
        title = f"{kind} on 8 held-out Sort-of-CLEVR questions (green: the named object; +: the peak)"
    plot(drawn, path, title=title)


def table(figures: dict) -> str:
    header = ["method", "layer", "non-relational", *FAMILIES]
    rows = []
    method = figures["method"] + (f" ({figures['token']})" if "token" in figures else "")
    for layer, entry in figures["per_layer"].items():
        rows.append(
            [
                method,
                layer,
                f"{entry['non_relational']:.3f}",
                *(f"{entry.get(f, float('nan')):.3f}" for f in FAMILIES),
            ]
        )
    answers = figures["answer_accuracy"]
    rows.append(
        [
            "(answer accuracy)",
            "",
            f"{answers['non_relational']:.3f}",
            *(f"{answers.get(f, float('nan')):.3f}" for f in FAMILIES),
        ]
    )
    if "reachable_non_relational" in figures:  # measured since 2026-11-27
        rows.append(["(the most this grid allows)", "", f"{figures['reachable_non_relational']:.3f}", *[""] * 6])
    return markdown_table(header, rows)


def load(model_dir: str):
    """The saved model (eval mode) and its processor."""
    from transformers import AutoProcessor

    from mm_fusion import MMFusionForImageTextClassification

    model = MMFusionForImageTextClassification.from_pretrained(model_dir).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def pointing(
    model_dir: str,
    dataset_options: str | None = None,
    images: int = 1000,
    methods=(None,),
    grid: str | None = None,
    grid_colour_word: bool = False,
    grid_method: str | None = None,
) -> dict:
    """The figures of a saved model, per method (`None`: the model's default, attention or Grad-CAM; a tower
    conditioned by `vision_text_attention` adds its reads of the colour word); with `grid`, the 8-question drawing of
    its maps there too (`grid_method`, default the model's; of the colour word's attention with `grid_colour_word`)."""
    model, processor = load(model_dir)
    options = dataset_options or recipe_dataset_options()
    test, boxes = held_out_questions(options, images)
    report = {"images": images, "dataset_options": options, "by_method": {}}
    for method in methods:
        figures = measure(model, processor, test, boxes, method)
        report["by_method"][figures["method"]] = figures
        if figures["method"] == "attention":  # and the colour word's own map, beside the question's mean
            word = measure(model, processor, test, boxes, method, colour_word=True)
            report["by_method"]["attention_colour_word"] = word
    if getattr(model.config, "vision_text_attention", False):  # the tower's own reads of the colour word
        word = measure(model, processor, test, boxes, "tower_attention", colour_word=True)
        report["by_method"]["tower_attention_colour_word"] = word
    report["machine"] = machine()
    if grid:
        draw_grid(model, processor, test, boxes, grid, grid_method, colour_word=grid_colour_word)
    return report


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="A Sort-of-CLEVR VQA model saved by scripts/train.py.")
    parser.add_argument("--dataset_options", default=None, help="Its data (default: the recipe's).")
    parser.add_argument("--images", type=int, default=1000, help="Held-out images (all their questions).")
    parser.add_argument("--grad_cam_too", action="store_true", help="For an attention model, Grad-CAM as well.")
    parser.add_argument("--run", default=None, help="Add the figures to this row of results/sort_of_clevr.json.")
    parser.add_argument("--results", default=str(RESULTS / "sort_of_clevr.json"))
    parser.add_argument("--grid", default=None, help="Also draw 8 held-out questions with their maps to this PNG.")
    parser.add_argument("--grid_colour_word", action="store_true", help="Draw the colour word's attention alone.")
    parser.add_argument("--grid_method", default=None, help="The grid's maps: attention, tower_attention or grad_cam.")
    args = parser.parse_args(argv)
    methods = (None, "grad_cam") if args.grad_cam_too else (None,)
    path = ROOT / args.results
    rows = json.loads(path.read_text()) if args.run else {}
    if args.run and args.run not in rows:  # before any work
        raise SystemExit(f"--run {args.run}: no such row in {path} (rows: {', '.join(rows)}).")
    report = pointing(
        args.model, args.dataset_options, args.images, methods, args.grid, args.grid_colour_word, args.grid_method
    )
    for figures in report["by_method"].values():
        print(table(figures))
    if args.grid:
        print(f"grid: {args.grid}", file=sys.stderr)
    if args.run:
        rows[args.run]["pointing"] = report
        path.write_text(json.dumps(rows, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
