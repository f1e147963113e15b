"""Maps that point, and are faithful: does the map a model reads the image by peak on the object the question names,
and does painting over its peak change the answer?

Sort-of-CLEVR (`--dataset sort_of_clevr`, the default): every held-out question names one object by its colour, and
the generator knows where each object is. A question counts as pointed at when its map's peak lies inside the named
object's square. For the non-relational families (shape, left, top) the named object is all a right answer needs; for
the relational ones it is where the reading starts. easy-VQA (`--dataset easy_vqa`): one shape on a plain background;
the peak must fall on the shape's pixels (those whose colour differs from the image's median colour).

Every map the model has is measured (`MMFusionForImageTextClassification.image_maps`): the default
(`guided_gradient`), `input_x_gradient`, the question's cross-attention (mean over its tokens, and the colour word's
alone), Grad-CAM, and for a tower conditioned by cross-attention its stages' reads of the colour word. For each:
pointing per family, and the deletion test (`mm_fusion.map_scoring.deletion_test`: the image's median colour painted
over the 10 x 10 square at the peak, and over a random square away from it; how often the answer changes). On
Sort-of-CLEVR also, whatever the map: the counterfactual (re-draw the scene with only the named object's shape
changed, then only another object's: the answer should follow the first and ignore the second) and what removing the
named object, or another one, does to the answer.

    python scripts/benchmarks/benchmark_pointing.py --model outputs/sort_of_clevr_hierarchical --name hierarchical
    python scripts/benchmarks/benchmark_pointing.py --model outputs/easy_vqa --dataset easy_vqa --name easy_vqa
    python scripts/benchmarks/benchmark_pointing.py --model outputs/sort_of_clevr --grid pointing_grid.png

`--name` stores the report in scripts/benchmarks/results/pointing.json (and its tables in pointing.md) under that
name; `--run NAME` adds it to that row of results/sort_of_clevr.json (as `pointing`). `--grid` draws 8 held-out
questions (non-relational, every family and colour) with the default map and the named object's square. Chance: an
object covers 10 x 10 of the 64 x 64 pixels, 2.4% of the image.
"""

import argparse
import json
import re
import sys
import textwrap

import numpy as np
import torch
import yaml
from benchmarking import RESULTS, ROOT, check_choices, machine, markdown_table


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
    from mm_fusion.data.sort_of_clevr import named_object_boxes
    from mm_fusion.training import parse_overrides

    options = parse_overrides(dataset_options, flag="--dataset_options")
    test = load_sort_of_clevr(["test"], **options)["test"]
    test = test.filter(lambda ids: [i < images for i in ids], input_columns="image_id", batched=True)
    boxes = named_object_boxes(test["question"], test["objects"], options.get("object_size", 10))
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
    model,
    processor,
    test,
    boxes,
    method: str | None,
    batch_size: int = 64,
    colour_word: bool = False,
    deletion: bool = False,
    seed: int = 0,
) -> dict:
    """Pointing accuracy per layer and family (and overall for the non-relational families), answer accuracy. With
    `colour_word` (attention only), the map is the colour word's attention alone, not the mean over the question. With
    `deletion`, the deletion test of its last layer's map ([`deletion_figures`])."""
    from mm_fusion.map_scoring import deletion_test, peak_inside, reachable

    pointed, possible, right, families, layers, used = [], [], [], [], None, None
    changed = {"peak": [], "random": []}
    generator = torch.Generator().manual_seed(seed)
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
        if deletion:  # per layer: (questions, layers)
            tests = [
                deletion_test(model, dict(batch), result.maps[:, k], generator=generator) for k in range(len(layers))
            ]
            changed["peak"].append(torch.stack([t[0] for t in tests], 1))
            changed["random"].append(torch.stack([t[1] for t in tests], 1))
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
    if deletion:  # of the best layer's map
        k = layers.index(best)
        at_peak, at_random = (torch.cat(changed[key])[:, k].float().numpy() for key in ("peak", "random"))
        groups = {"non_relational": non_relational, **{f: families == f for f in FAMILIES if (families == f).any()}}
        figures["deletion"] = {"layer": best, **deletion_figures(at_peak, at_random, groups)}
    return figures


def deletion_figures(at_peak: np.ndarray, at_random: np.ndarray, groups: dict[str, np.ndarray]) -> dict:
    """Per group of questions: how often the answer changed with the peak's square painted, with a random square
    painted, and the ratio of the two (the target: 3 or more; None where no random square changed an answer)."""
    figures = {}
    for name, members in groups.items():
        peak, random = float(at_peak[members].mean()), float(at_random[members].mean())
        ratio = round(peak / random, 2) if random > 0 else None  # None: no random square changed an answer
        figures[name] = {"at_peak": round(peak, 4), "at_random": round(random, 4), "ratio": ratio}
    return figures


def scene_variants(test, object_size: int, seed: int = 0) -> tuple[list, list, list[int], list[int]]:
    """For each shape question: its scene re-drawn with only the named object's shape changed, and with only another
    object's (drawn at random) changed; the answers each then has (the named object's new shape, and the same as
    before)."""
    from mm_fusion.data.sort_of_clevr import SHAPES, named_colour, render_scene

    rng = np.random.default_rng(seed)
    names = test.features["answer"].names
    size = test[0]["image"].width
    named_changed, other_changed, follow, stay = [], [], [], []
    for question, objects, answer in zip(test["question"], test["objects"], test["answer"]):
        colour = named_colour(question)
        others = [k for k, o in enumerate(objects) if o["colour"] != colour]
        variants = []
        named = next(k for k, o in enumerate(objects) if o["colour"] == colour)
        for changed in (named, others[rng.integers(len(others))]):
            scene = [dict(o) for o in objects]
            scene[changed]["shape"] = SHAPES[1 - SHAPES.index(scene[changed]["shape"])]
            variants.append(scene)
        named_changed.append(render_scene(variants[0], size, object_size))
        other_changed.append(render_scene(variants[1], size, object_size))
        new_shape = next(o["shape"] for o in variants[0] if o["colour"] == colour)
        follow.append(names.index(new_shape))
        stay.append(answer)
    return named_changed, other_changed, follow, stay


def predict(model, processor, images: list, texts: list[str], batch_size: int = 128) -> np.ndarray:
    """The model's top answers (class ids)."""
    answers = []
    for start in range(0, len(texts), batch_size):
        batch = processor(images=images[start : start + batch_size], text=texts[start : start + batch_size])
        with torch.no_grad():
            answers.append(model(**batch).logits.argmax(-1))
    return torch.cat(answers).numpy()


def counterfactual(model, processor, test, object_size: int) -> dict:
    """Shape questions, their scenes re-drawn: the share whose answer follows the named object's changed shape, and
    the share whose answer stays when another object's shape changes (the targets: 0.95 each)."""
    shape = test.filter(lambda f: [x == "shape" for x in f], input_columns="question_family", batched=True)
    named_changed, other_changed, follow, _ = scene_variants(shape, object_size)
    questions = list(shape["question"])
    followed = predict(model, processor, named_changed, questions) == np.array(follow)
    before = predict(model, processor, list(shape["image"]), questions)
    stayed = predict(model, processor, other_changed, questions) == before
    return {
        "questions": len(questions),
        "follows_the_named_object": round(float(followed.mean()), 4),
        "ignores_another_object": round(float(stayed.mean()), 4),
    }


def occlusion_pointing(model, processor, test, boxes, images: int = 50, side: int = 10, stride: int = 4) -> dict:
    """
    The most a deletion-faithful map points, for reference (not a map the library serves: it costs a forward pass per
    square): for the non-relational questions about the first `images` images, the drop of the answer's probability
    when the image's median colour is painted over each `side` x `side` square (every `stride` pixels), each pixel
    given the mean drop of the squares over it; the share whose peak lies inside the named object.
    """
    from mm_fusion.map_scoring import paint, peak_inside

    keep = [i for i, (f, image) in enumerate(zip(test["question_family"], test["image_id"]))
            if f in NON_RELATIONAL and image < images]  # fmt: skip
    hits, families = [], []
    for i in keep:
        row = test[i]
        batch = processor(images=[row["image"]], text=[row["question"]])
        height, width = batch["pixel_values"].shape[-2:]
        starts = [sorted({*range(0, n - side + 1, stride), n - side}) for n in (height, width)]
        corners = [(top, left) for top in starts[0] for left in starts[1]]
        centres = torch.tensor([[top + side // 2, left + side // 2] for top, left in corners])
        pixels = batch["pixel_values"].expand(len(corners), -1, -1, -1)
        painted = paint(pixels, centres[:, 0], centres[:, 1], side)
        text = {k: v.expand(len(corners), -1) for k, v in batch.items() if k != "pixel_values"}
        with torch.no_grad():
            before = model(**batch).logits.softmax(-1)[0]
            after = model(pixel_values=painted, **text).logits.softmax(-1)
        answer = int(before.argmax())
        drops = before[answer] - after[:, answer]
        total, count = torch.zeros(height, width), torch.zeros(height, width)
        for drop, (top, left) in zip(drops, corners):
            total[top : top + side, left : left + side] += drop
            count[top : top + side, left : left + side] += 1
        hits.append(bool(peak_inside((total / count)[None], boxes[i : i + 1], (height, width))))
        families.append(row["question_family"])
    hits, families = np.array(hits, dtype=float), np.array(families)
    figures = {"images": images, "questions": len(hits), "squares": len(corners), "side": side, "stride": stride}
    figures["non_relational"] = round(float(hits.mean()), 4)
    return figures | {f: round(float(hits[families == f].mean()), 4) for f in NON_RELATIONAL}


def object_removal(model, processor, test, object_size: int) -> dict:
    """What the answer rests on, per family (and per answer for left / top): how often it changes when the named
    object is removed from the scene (re-drawn without it), and when another object is."""
    from mm_fusion.data.sort_of_clevr import named_colour, render_scene

    rng = np.random.default_rng(0)
    size = test[0]["image"].width
    without_named, without_other = [], []
    for question, objects in zip(test["question"], test["objects"]):
        colour = named_colour(question)
        others = [o for o in objects if o["colour"] != colour]
        other = others[rng.integers(len(others))]
        without_named.append(render_scene(others, size, object_size))
        without_other.append(render_scene([o for o in objects if o is not other], size, object_size))
    questions = list(test["question"])
    before = predict(model, processor, list(test["image"]), questions)
    named = predict(model, processor, without_named, questions) != before
    other = predict(model, processor, without_other, questions) != before
    answers = test.features["answer"].names
    groups = []
    for family, answer in zip(test["question_family"], before):
        groups.append(f"{family} ({answers[answer]})" if family in ("horizontal", "vertical") else family)
    groups = np.array(groups)
    return {
        group: {"named_removed": round(float(named[groups == group].mean()), 4),
                "other_removed": round(float(other[groups == group].mean()), 4),
                "questions": int((groups == group).sum())}
        for group in sorted(set(groups))
    }  # fmt: skip


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
    from mm_fusion.image_maps import describe
    from mm_fusion.map_plot import plot

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
    word = " (the colour word's)" if colour_word else ""
    title = (
        f"{describe(result.method)}{word}: 8 held-out Sort-of-CLEVR questions (green: the named object; +: the peak)"
    )
    plot(drawn, path, title="\n".join(textwrap.wrap(title, 50)))  # two columns: a narrow figure


def table(figures: dict) -> str:
    header = ["method", "layer", "non-relational", *FAMILIES]
    rows = []
    method = figures["method"] + (f" ({figures['token']})" if "token" in figures else "")
    for layer, entry in figures["per_layer"].items():
        rows.append([method, layer, f"{entry['non_relational']:.3f}", *(cell(entry.get(f)) for f in FAMILIES)])
    answers = figures["answer_accuracy"]
    rows.append(
        ["(answer accuracy)", "", f"{answers['non_relational']:.3f}", *(cell(answers.get(f)) for f in FAMILIES)]
    )
    if "reachable_non_relational" in figures:  # measured since 2026-11-27
        rows.append(["(the most this grid allows)", "", f"{figures['reachable_non_relational']:.3f}", *[""] * 6])
    if "deletion" in figures:  # measured since 2026-12-01
        deletion = figures["deletion"]
        for key, what in (("at_peak", "peak's square painted"), ("at_random", "a random square painted")):
            values = [cell(deletion.get(f, {}).get(key)) for f in ("non_relational", *FAMILIES)]
            rows.append([f"(answer changes, {what})", deletion["layer"], *values])
        rows.append(
            ["(ratio)", "", *(cell(deletion.get(f, {}).get("ratio"), 2) for f in ("non_relational", *FAMILIES))]
        )
    return markdown_table(header, rows)


def cell(value: float | None, digits: int = 3) -> str:
    """A figure for a table; "–" for none (a ratio whose random squares changed no answer)."""
    return "–" if value is None else f"{value:.{digits}f}"


def load(model_dir: str):
    """The saved model (eval mode) and its processor."""
    from transformers import AutoProcessor

    from mm_fusion import MMFusionForImageTextClassification

    model = MMFusionForImageTextClassification.from_pretrained(model_dir).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def candidate_methods(config) -> list[str]:
    """The maps a model has: the default first."""
    from mm_fusion.image_maps import default_method

    methods = [default_method(config), "input_x_gradient", "grad_cam"]
    if config.fusion_type != "late":
        methods.insert(2, "attention")
    return list(dict.fromkeys(methods))


def pointing(
    model_dir: str,
    dataset_options: str | None = None,
    images: int = 1000,
    methods=None,
    grid: str | None = None,
    grid_colour_word: bool = False,
    grid_method: str | None = None,
    occlusion_images: int = 50,
) -> dict:
    """The figures of a saved Sort-of-CLEVR model: per method (default: every map it has, [`candidate_methods`]; for
    attention the colour word's too, and a tower conditioned by `vision_text_attention` adds its reads of the colour
    word) its pointing and deletion test; the counterfactual and the object removals; the occlusion map's pointing on
    the questions about `occlusion_images` images ([`occlusion_pointing`], 0: none); with `grid`, the 8-question
    drawing of its maps there too (`grid_method`, default the model's; the colour word's with `grid_colour_word`)."""
    from mm_fusion.training import parse_overrides

    model, processor = load(model_dir)
    options = dataset_options or recipe_dataset_options()
    test, boxes = held_out_questions(options, images)
    report = {"images": images, "dataset_options": options, "by_method": {}}
    for method in methods or candidate_methods(model.config):
        figures = measure(model, processor, test, boxes, method, deletion=True)
        report["by_method"][figures["method"]] = figures
        if figures["method"] == "attention":  # and the colour word's own map, beside the question's mean
            word = measure(model, processor, test, boxes, method, colour_word=True, deletion=True)
            report["by_method"]["attention_colour_word"] = word
    if getattr(model.config, "vision_text_attention", False):  # the tower's own reads of the colour word
        word = measure(model, processor, test, boxes, "tower_attention", colour_word=True, deletion=True)
        report["by_method"]["tower_attention_colour_word"] = word
    object_size = parse_overrides(options, flag="--dataset_options").get("object_size", 10)
    report["counterfactual"] = counterfactual(model, processor, test, object_size)
    report["object_removal"] = object_removal(model, processor, test, object_size)
    if occlusion_images:
        report["occlusion"] = occlusion_pointing(model, processor, test, boxes, occlusion_images)
    report["machine"] = machine()
    if grid:
        draw_grid(model, processor, test, boxes, grid, grid_method, colour_word=grid_colour_word)
    return report


def easy_vqa_pointing(model_dir: str, questions: int | None = None, methods=None) -> dict:
    """The figures of a saved easy-VQA model on its test questions (the first `questions`, default all): per method,
    the share whose map peaks on the shape's pixels, and the deletion test, per question type."""
    from PIL import Image

    from mm_fusion.data import load_easy_vqa
    from mm_fusion.map_scoring import check_maps, foreground_masks

    model, processor = load(model_dir)
    test = load_easy_vqa(["test"])["test"]
    if questions is not None:
        test = test.select(range(min(questions, len(test))))
    images = [Image.open(path).convert("RGB") for path in test["image"]]
    types = np.array(test["question_type"])
    groups = {"all": np.ones(len(types), dtype=bool), **{t: types == t for t in sorted(set(types))}}
    label2id = {label: int(i) for i, label in model.config.id2label.items()}
    names = test.features["answer"].names
    answers = [label2id[names[a]] for a in test["answer"]]
    report = {"questions": len(test), "by_method": {}}
    texts = list(test["question"])

    def batches(size: int = 64):
        for start in range(0, len(texts), size):
            inputs = dict(processor(images=images[start : start + size], text=texts[start : start + size]))
            yield inputs, foreground_masks(inputs["pixel_values"]), answers[start : start + size]

    for method in methods or candidate_methods(model.config):
        checks = check_maps(model, batches(), method)
        on_shape, right = checks.on_target.float().numpy(), checks.right.float().numpy()
        report["by_method"][checks.method] = {
            "layer": checks.layer,
            "on_shape": {g: round(float(on_shape[m].mean()), 4) for g, m in groups.items()},
            "answer_accuracy": {g: round(float(right[m].mean()), 4) for g, m in groups.items()},
            "deletion": deletion_figures(
                checks.changed_at_peak.float().numpy(), checks.changed_at_random.float().numpy(), groups
            ),
        }
    report["machine"] = machine()
    return report


def easy_vqa_table(report: dict) -> str:
    groups = list(next(iter(report["by_method"].values()))["on_shape"])
    rows = []
    for method, figures in report["by_method"].items():
        rows.append([method, "peak on the shape", *(cell(figures["on_shape"][g]) for g in groups)])
        for key, what in (("at_peak", "answer changes, peak's square painted"), ("at_random", "a random square")):
            rows.append([method, what, *(cell(figures["deletion"][g][key]) for g in groups)])
        rows.append([method, "ratio", *(cell(figures["deletion"][g]["ratio"], 2) for g in groups)])
    return markdown_table(["method", "figure", *groups], rows)


def pointing_tables(report: dict) -> str:
    """A Sort-of-CLEVR report's tables: per map, then the counterfactual and the object removals."""
    return "\n\n".join([*(table(f) for f in report["by_method"].values()), sort_of_clevr_extra_tables(report)])


def sort_of_clevr_extra_tables(report: dict) -> str:
    counter = report["counterfactual"]
    lines = []
    if "occlusion" in report:
        o = report["occlusion"]
        lines += [
            f"Occlusion, for reference ({o['squares']} painted {o['side']} x {o['side']} squares per question, "
            f"{o['questions']} non-relational questions about {o['images']} images): the peak inside the named "
            f"object for {o['non_relational']:.3f} (shape {o['shape']:.3f}, left {o['horizontal']:.3f}, top "
            f"{o['vertical']:.3f}).",
            "",
        ]
    lines += [
        f"Counterfactual, {counter['questions']} shape questions: the answer follows the named object's changed shape "
        f"for {counter['follows_the_named_object']:.3f}, and stays when another object's shape changes for "
        f"{counter['ignores_another_object']:.3f}.",
        "",
        markdown_table(
            ["family (answer)", "questions", "named object removed: answer changes", "another object removed"],
            [
                [g, f["questions"], cell(f["named_removed"]), cell(f["other_removed"])]
                for g, f in report["object_removal"].items()
            ],  # fmt: skip
        ),
    ]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="A VQA model saved by scripts/train.py.")
    parser.add_argument("--dataset", default="sort_of_clevr", choices=("sort_of_clevr", "easy_vqa"), help="Its data.")
    parser.add_argument("--dataset_options", default=None, help="Sort-of-CLEVR's options (default: the recipe's).")
    parser.add_argument("--images", type=int, default=1000, help="Sort-of-CLEVR: held-out images (all questions).")
    parser.add_argument("--questions", type=int, default=None, help="easy-VQA: the first N test questions (all).")
    parser.add_argument("--methods", default=None, help="Comma-separated maps to measure (default: all it has).")
    parser.add_argument("--name", default=None, help="Store the report in results/pointing.json under this name.")
    parser.add_argument("--run", default=None, help="Add the figures to this row of results/sort_of_clevr.json.")
    parser.add_argument("--results", default=str(RESULTS / "sort_of_clevr.json"))
    parser.add_argument(
        "--occlusion_images", type=int, default=50, help="Sort-of-CLEVR: the occlusion map's images (0: none)."
    )
    parser.add_argument("--grid", default=None, help="Also draw 8 held-out questions with their maps to this PNG.")
    parser.add_argument("--grid_colour_word", action="store_true", help="Draw the colour word's attention alone.")
    parser.add_argument("--grid_method", default=None, help="The grid's maps (default: the model's default).")
    args = parser.parse_args(argv)
    methods = args.methods.split(",") if args.methods else None
    if methods:
        from mm_fusion.image_maps import METHODS

        check_choices(methods, METHODS, "--methods")
    path = ROOT / args.results
    rows = json.loads(path.read_text()) if args.run else {}
    if args.run and args.run not in rows:  # before any work
        raise SystemExit(f"--run {args.run}: no such row in {path} (rows: {', '.join(rows)}).")
    if args.dataset == "easy_vqa":
        report = easy_vqa_pointing(args.model, args.questions, methods)
        text = easy_vqa_table(report)
    else:
        report = pointing(
            args.model,
            args.dataset_options,
            args.images,
            methods,
            args.grid,
            args.grid_colour_word,
            args.grid_method,
            args.occlusion_images,
        )
        text = pointing_tables(report)
    report = {"model": args.model, "dataset": args.dataset, **report}
    print(text)
    if args.grid:
        print(f"grid: {args.grid}", file=sys.stderr)
    if args.run:
        rows[args.run]["pointing"] = report
        path.write_text(json.dumps(rows, indent=2) + "\n")
    if args.name:
        store(args.name, report, text)
    return report


def store(name: str, report: dict, text: str) -> None:
    """The report in results/pointing.json under `name`, and its tables in results/pointing.md, beside the others."""
    path = RESULTS / "pointing.json"
    reports = json.loads(path.read_text()) if path.exists() else {}
    reports[name] = {**report, "tables": text}
    path.write_text(json.dumps(reports, indent=2) + "\n")
    sections = [f"## {key}\n\n`{r['model']}` ({r['dataset']})\n\n{r['tables']}\n" for key, r in reports.items()]
    (RESULTS / "pointing.md").write_text("# benchmark_pointing.py\n\n" + "\n".join(sections))


if __name__ == "__main__":
    main()
