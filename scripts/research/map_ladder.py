"""Where a Sort-of-CLEVR model's evidence for its answer lies: candidate maps read from one forward and one backward
pass of a saved model whose tower reads the question (`vision_text_attention`), each scored by whether its peak lies
inside the object a held-out non-relational question names (as scripts/benchmarks/benchmark_pointing.py scores the
library's maps).

    python scripts/research/map_ladder.py --model outputs/sort_of_clevr/hierarchical_4_epochs --images 100 \\
        --name seed_0

The candidates, each one change from the library's map before the tower's read weighted it (input x gradient x the
last fusion layer's attention, summed over the window): the window's side; the attention squared; the colour word's
attention instead of the mean over the question; the positive or negative part of input x gradient; and per tower
stage after the stem, |read . dlogit/dread| (where that stage's read of the question moves the answer), its read's
attention on the colour word, and either as a further weight. The left / top questions' figures are also given split
by the true answer (yes / no): a model that answers "yes" unless it finds the object on the other side has no evidence
on the object for its "yes". With `--path_alphas`, input x gradient also with the gradient taken on the scene faded
toward its median colour (`path_maps`); with `--heads`, per head of the last fusion layer its attention and its value
path, and all heads' key and value paths (`head_maps`). Prints the table and stores it under `--name` in
`--output` (scripts/research/results/map_ladder.json), beside the models measured before.
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np
import torch


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts/benchmarks"))

from benchmark_pointing import (  # noqa: E402
    NON_RELATIONAL,
    colour_word_positions,
    held_out_questions,
    load,
    recipe_dataset_options,
)
from benchmarking import machine  # noqa: E402

from mm_fusion.image_maps import (  # noqa: E402
    _box_mean,
    _capture_attention,
    _grid,
    _text_mean,
    median_colours,
    smoothing_window,
    upsample,
)
from mm_fusion.map_scoring import peak_inside  # noqa: E402


def prepared(model, processor, rows):
    """One batch of questions as the maps read it: the processor's batch, the image size, the smoothing window, the
    normalised pixels (detached) and each image's median colour `(N, 3, 1, 1)`."""
    batch = processor(images=rows["image"], text=rows["question"])
    size = tuple(batch["pixel_values"].shape[-2:])
    pixels = model.mm_fusion.vision_encoder.normalize_pixels(batch["pixel_values"]).detach()
    return batch, size, smoothing_window(size), pixels, median_colours(pixels)[..., None, None]


def batch_maps(model, processor, rows) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
    """Every candidate map `(N, H, W)` of one batch of questions."""
    reads = model.mm_fusion.vision_encoder.vision_text_attention
    batch, size, window, pixels, reference = prepared(model, processor, rows)
    pixels.requires_grad_(True)
    attention_record = []
    handles = _capture_attention(model, attention_record)
    reads.read_outputs, reads.recorded = [], []
    try:
        with torch.enable_grad():
            logits = model(**{**batch, "pixel_values": pixels}).logits
            score = logits.gather(1, logits.argmax(-1, keepdim=True)).sum()
            stages = list(reads.read_outputs)
            gradients = torch.autograd.grad(score, [pixels, *(after for _, after in stages)])
        recorded = reads.recorded
    finally:
        for handle in handles:
            handle.remove()
        reads.read_outputs = reads.recorded = None
    signed = ((pixels.detach() - reference) * gradients[0]).sum(1)
    pixel_evidence = signed.abs()
    count = len(signed)
    leading, height, width = _grid(attention_record[-1].shape[-1])
    attention = _text_mean(attention_record[-1], batch["attention_mask"])[:, leading:].reshape(-1, height, width)
    attention = upsample(attention, size)
    colour = colour_word_positions(processor.tokenizer, rows["question"])
    colour_attention = attention_record[-1].mean(1)[torch.arange(count), colour][:, leading:]
    colour_attention = upsample(colour_attention.reshape(-1, height, width), size)
    maps = {
        "input x gradient": _box_mean(pixel_evidence, window),
        "input x gradient x attention (the map before the read's weight)": _box_mean(
            pixel_evidence * attention, window
        ),
        "... window 5": _box_mean(pixel_evidence * attention, 5),
        "... window 13": _box_mean(pixel_evidence * attention, 13),
        "... attention squared": _box_mean(pixel_evidence * attention**2, window),
        "... the colour word's attention instead of the mean": _box_mean(pixel_evidence * colour_attention, window),
        "... positive input x gradient only": _box_mean(signed.clamp(min=0) * attention, window),
        "... negative input x gradient only": _box_mean((-signed).clamp(min=0) * attention, window),
    }
    for k, ((before, after), gradient) in enumerate(zip(stages, gradients[1:])):
        stage = k + 1 + reads.first_stage
        moved = upsample(((after - before).detach() * gradient).sum(1).abs(), size)
        probabilities, grid = recorded[k]
        on_colour = probabilities.mean(1)[torch.arange(count), :, colour].reshape(count, *grid)
        on_colour = upsample(on_colour, size)
        maps[f"stage {stage}: |read . gradient|"] = moved
        maps[f"stage {stage}: input x gradient x |read . gradient|"] = _box_mean(pixel_evidence * moved, window)
        maps[f"stage {stage}: ... x |read . gradient|"] = _box_mean(pixel_evidence * attention * moved, window)
        maps[f"stage {stage}: its read's attention on the colour word"] = on_colour
        maps[f"stage {stage}: ... x its read's attention on the colour word"] = _box_mean(
            pixel_evidence * attention * on_colour, window
        )
    return maps, size


def path_maps(model, processor, rows, alphas: list[float]) -> dict[str, torch.Tensor]:
    """Input x gradient with the gradient taken on the scene faded toward its median colour (`reference + a (x -
    reference)`, one backward pass per `a`), per `a` and averaged over them (integrated gradients over those points of
    the path): whether the answer's gradient at the image itself is saturated where the evidence lies. Each alone and
    times the last fusion layer's attention, summed over the window as the library's map."""
    batch, size, window, pixels, reference = prepared(model, processor, rows)
    attention_record = []
    handles = _capture_attention(model, attention_record)
    try:
        with torch.no_grad():
            chosen = model(**batch).logits.argmax(-1, keepdim=True)
    finally:
        for handle in handles:
            handle.remove()
    leading, height, width = _grid(attention_record[-1].shape[-1])
    attention = _text_mean(attention_record[-1], batch["attention_mask"])[:, leading:].reshape(-1, height, width)
    attention = upsample(attention, size)
    maps, total = {}, torch.zeros_like(pixels)
    for alpha in alphas:
        faded = (reference + alpha * (pixels - reference)).requires_grad_(True)
        with torch.enable_grad():
            logits = model(**{**batch, "pixel_values": faded}).logits
            (gradient,) = torch.autograd.grad(logits.gather(1, chosen).sum(), faded)
        total += gradient / len(alphas)
        evidence = ((pixels - reference) * gradient).sum(1).abs()
        maps[f"input x gradient at {alpha:g}"] = _box_mean(evidence, window)
        maps[f"input x gradient at {alpha:g} x attention"] = _box_mean(evidence * attention, window)
    if len(alphas) > 1:
        evidence = ((pixels - reference) * total).sum(1).abs()
        points = ",".join(f"{alpha:g}" for alpha in alphas)
        maps[f"input x gradient averaged over {points}"] = _box_mean(evidence, window)
        maps[f"input x gradient averaged over {points} x attention"] = _box_mean(evidence * attention, window)
    return maps


def head_maps(model, processor, rows) -> dict[str, torch.Tensor]:
    """Per head of the last fusion layer's cross-attention (the question's words reading the image's tokens): its
    attention averaged over the question, its colour word's attention, and where its value path carries the answer,
    `|v_j . dlogit/dv_j|` per image token `j` (the first-order change of the answer were token `j`'s value taken away
    from that head; `sum_i A_ij (v_j . g_i)` with `g_i` the gradient at query `i`'s output); the same for all heads at
    once and for the key path (`|k_j . dlogit/dk_j|`, where the attention's choice moves the answer), each alone and
    times input x gradient, summed over the window as the library's map."""
    block = model.mm_fusion.encoder.layers[-1].text_block.cross_attn
    batch, size, window, pixels, reference = prepared(model, processor, rows)
    pixels.requires_grad_(True)
    attention_record, projected = [], {}
    handles = _capture_attention(model, attention_record)
    for name in ("k_proj", "v_proj"):
        handles.append(
            getattr(block, name).register_forward_hook(lambda m, a, out, name=name: projected.__setitem__(name, out))
        )
    try:
        with torch.enable_grad():
            logits = model(**{**batch, "pixel_values": pixels}).logits
            score = logits.gather(1, logits.argmax(-1, keepdim=True)).sum()
            gradients = torch.autograd.grad(score, [pixels, projected["k_proj"], projected["v_proj"]])
    finally:
        for handle in handles:
            handle.remove()
    count = len(pixels)
    if projected["v_proj"].shape[0] != count:
        raise ValueError("head_maps needs one image per question (no shared image encodings).")
    pixel_evidence = ((pixels.detach() - reference) * gradients[0]).sum(1).abs()
    probabilities = attention_record[-1]
    heads = probabilities.shape[1]
    leading, height, width = _grid(probabilities.shape[-1])
    colour = colour_word_positions(processor.tokenizer, rows["question"])

    def image(tokens: torch.Tensor) -> torch.Tensor:  # (B, S) over the context -> (B, H, W) at the image's size
        return upsample(tokens[:, leading:].reshape(-1, height, width), size)

    per_head = {}
    for path, output, gradient in (
        ("key", projected["k_proj"], gradients[1]),
        ("value", projected["v_proj"], gradients[2]),
    ):
        product = (output.detach() * gradient).reshape(count, -1, heads, block.head_dim).sum(-1)  # (B, S, heads)
        per_head[path] = product
    maps = {}
    mask = batch["attention_mask"]
    for h in range(heads):
        one = probabilities[:, h : h + 1]
        maps[f"head {h}: attention (question mean)"] = image(_text_mean(one, mask))
        maps[f"head {h}: the colour word's attention"] = image(one[torch.arange(count), 0, colour])
        maps[f"head {h}: |value . gradient|"] = image(per_head["value"][..., h].abs())
        maps[f"head {h}: input x gradient x |value . gradient|"] = _box_mean(
            pixel_evidence * maps[f"head {h}: |value . gradient|"], window
        )
    for path in ("key", "value"):
        moved = image(per_head[path].sum(-1).abs())
        maps[f"all heads: |{path} . gradient|"] = moved
        maps[f"all heads: input x gradient x |{path} . gradient|"] = _box_mean(pixel_evidence * moved, window)
    return maps


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="A Sort-of-CLEVR model whose tower reads the question.")
    parser.add_argument("--images", type=int, default=100, help="Held-out images (6 non-relational questions each).")
    parser.add_argument("--name", default=None, help="Store the table under this name (default: the model's folder).")
    parser.add_argument(
        "--path_alphas",
        default=None,
        help="Comma-separated points a of the path from the median colour to the image (1 is the image) at which "
        "input x gradient is also taken, each alone and averaged over them (one backward pass per point).",
    )
    parser.add_argument(
        "--heads",
        action="store_true",
        help="Also the last fusion layer's maps per head: its attention, its value path (|v . gradient|), and the key "
        "and value paths of all heads at once.",
    )
    default = str(ROOT / "scripts/research/results/map_ladder.json")
    parser.add_argument("--output", default=default, help="The JSON file it is stored in.")
    args = parser.parse_args(argv)
    model, processor = load(args.model)
    if model.mm_fusion.vision_encoder.vision_text_attention is None:
        raise ValueError(f"{args.model}: its vision tower reads no text (config.vision_text_attention is off).")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    test, boxes = held_out_questions(recipe_dataset_options(), args.images)
    keep = [i for i, family in enumerate(test["question_family"]) if family in NON_RELATIONAL]
    test, boxes = test.select(keep), boxes[keep]
    pointed, families, answers = {}, [], []
    answer_names = test.features["answer"].names
    for start in range(0, len(test), 64):
        rows = test[start : start + 64]
        maps, (height, width) = batch_maps(model, processor, rows)
        if args.path_alphas:
            maps |= path_maps(model, processor, rows, [float(a) for a in args.path_alphas.split(",")])
        if args.heads:
            maps |= head_maps(model, processor, rows)
        scale = torch.tensor([width, height] * 2) / torch.tensor([rows["image"][0].width, rows["image"][0].height] * 2)
        box = (boxes[start : start + 64].float() * scale).round().long()
        for name, batch in maps.items():
            pointed.setdefault(name, []).append(peak_inside(batch[:, None], box, (height, width))[:, 0].numpy())
        families += rows["question_family"]
        answers += [answer_names[answer] for answer in rows["answer"]]
    families, answers = np.array(families), np.array(answers)
    table = {}
    for name, parts in pointed.items():
        hits = np.concatenate(parts)
        table[name] = {"non_relational": round(float(hits.mean()), 4)}
        table[name] |= {family: round(float(hits[families == family].mean()), 4) for family in NON_RELATIONAL}
        for family, answer in ((f, a) for f in ("horizontal", "vertical") for a in ("yes", "no")):
            chosen = (families == family) & (answers == answer)
            table[name][f"{family} ({answer})"] = round(float(hits[chosen].mean()), 4) if chosen.any() else None
    split = [f"{f} ({a})" for f in ("horizontal", "vertical") for a in ("yes", "no")]
    print(f"{'map':78s} non-rel.  shape  left   top    left yes / no  top yes / no")
    for name, entry in table.items():
        figures = "  ".join(
            "  -  " if entry[key] is None else f"{entry[key]:.3f}"
            for key in ("non_relational", *NON_RELATIONAL, *split)
        )
        print(f"{name:78s} {figures}")
    report = {
        "model": args.model,
        "date": datetime.date.today().isoformat(),
        "images": args.images,
        "questions": len(families),
        "command": "python scripts/research/map_ladder.py " + " ".join(argv or sys.argv[1:]),
        "machine": machine(),
        "maps": table,
    }
    output = Path(args.output)
    stored = json.loads(output.read_text()) if output.is_file() else {}
    stored[args.name or Path(args.model).name] = report
    output.write_text(json.dumps(stored, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
