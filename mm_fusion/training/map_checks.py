"""
Whether a finished run's map points at what its questions are about, for the built-in data where the objects' places
are known: easy-VQA (one shape on a plain background: the peak must fall on the shape's pixels) and Sort-of-CLEVR (the
object a non-relational question names: the peak must fall inside its square). [`final_metrics`] adds the figures of
the model's default map (the one `pipeline(..., return_map=True)`, `scripts/visualize_attention.py` and the demo show)
over up to [`QUESTIONS`] evaluation questions, with the deletion test (the image's median colour painted over the 10 x
10 square at the map's peak, and over a random square away from it: how often the answer changes):

- `eval_map_on_object`: the share of questions whose map peaks on the object;
- `eval_map_answer_changes_at_peak`, `eval_map_answer_changes_at_random`: the deletion test.

They land in `all_results.json` and on the model card; the demo shows them beside the map.
"""

import math
from collections.abc import Callable

import numpy as np
import torch

from ..image_maps import check_maps, foreground_masks


QUESTIONS = 1000  # evaluation questions checked (evenly spread over the evaluation pairs)
NON_RELATIONAL = ("shape", "horizontal", "vertical")  # Sort-of-CLEVR families the named object alone answers


def map_check(data_args, eval_rows, options: dict | None = None) -> Callable | None:
    """For an easy-VQA or Sort-of-CLEVR VQA run with evaluation pairs (`eval_rows`, as loaded), a function `(model,
    processor) -> dict` of the figures above; None for other data (no object places to check against).
    `options`: Sort-of-CLEVR's `--dataset_options`."""
    if eval_rows is None or data_args.dataset not in ("easy_vqa", "sort_of_clevr") or data_args.streaming:
        return None
    if data_args.dataset == "sort_of_clevr":
        keep = [i for i, family in enumerate(eval_rows["question_family"]) if family in NON_RELATIONAL]
        eval_rows = eval_rows.select(keep)
    picked = np.unique(np.linspace(0, len(eval_rows) - 1, min(QUESTIONS, len(eval_rows))).round().astype(int))
    rows = eval_rows.select(picked)
    object_size = (options or {}).get("object_size", 10)

    def check(model, processor) -> dict:
        from PIL import Image

        images = [Image.open(i).convert("RGB") if isinstance(i, str) else i.convert("RGB") for i in rows["image"]]
        texts = list(rows["question"])
        names = rows.features["answer"].names
        label2id = {label: int(i) for i, label in model.config.id2label.items()}
        answers = [label2id.get(names[a], -1) for a in rows["answer"]]
        if data_args.dataset == "easy_vqa":
            masks = foreground_masks
        else:
            masks = sort_of_clevr_masks(texts, rows["objects"], processor, images[0].size, object_size)
        checks = check_maps(model.eval(), processor, images, texts, masks, answers)
        return {
            "eval_map_on_object": float(checks.on_target.float().mean()),
            "eval_map_answer_changes_at_peak": float(checks.changed_at_peak.float().mean()),
            "eval_map_answer_changes_at_random": float(checks.changed_at_random.float().mean()),
        }

    return check


def sort_of_clevr_masks(questions, scenes, processor, scene_size: tuple[int, int], object_size: int) -> torch.Tensor:
    """The named objects' squares, as masks on the processor's image size."""
    from ..data.sort_of_clevr import named_object_boxes

    height, width = processor.image_processor.size["height"], processor.image_processor.size["width"]
    masks = torch.zeros(len(questions), height, width, dtype=torch.bool)
    scale_x, scale_y = width / scene_size[0], height / scene_size[1]

    def pixel(edge: float) -> int:  # the first pixel whose centre (i + 0.5) lies at or past a scaled edge
        return math.ceil(edge - 0.5)

    for mask, (x0, y0, x1, y1) in zip(masks, named_object_boxes(questions, scenes, object_size)):
        rows = slice(pixel(y0 * scale_y), pixel((y1 + 1) * scale_y))
        mask[rows, pixel(x0 * scale_x) : pixel((x1 + 1) * scale_x)] = True
    return masks
