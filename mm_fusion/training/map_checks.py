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

from ..map_scoring import check_maps, foreground_masks


QUESTIONS = 1000  # evaluation questions checked (evenly spread over the evaluation pairs)
NON_RELATIONAL = ("shape", "horizontal", "vertical")  # Sort-of-CLEVR families the named object alone answers


def map_check(data_args, eval_rows, eval_pairs, collator, options: dict | None = None) -> Callable | None:
    """For an easy-VQA or Sort-of-CLEVR VQA run with evaluation pairs, a function `model -> dict` of the figures above;
    None for other data (no object places to check against). It reads the pairs as evaluation does, from the cache
    (`eval_pairs`, prepared, through the evaluation `collator`): no image is decoded again. `eval_rows`: the loaded
    evaluation rows, for Sort-of-CLEVR's scenes; `options`: its `--dataset_options`."""
    if eval_pairs is None or data_args.dataset not in ("easy_vqa", "sort_of_clevr") or data_args.streaming:
        return None
    sort_of_clevr = data_args.dataset == "sort_of_clevr"
    keep = range(len(eval_pairs))
    if sort_of_clevr:
        rows = {str(i): (q, f, o) for i, q, f, o in zip(*(eval_rows[c] for c in ("id", "question", "question_family",
                                                                                  "objects")))}  # fmt: skip
        ids = [str(i) for i in eval_pairs["id"]]
        keep = [k for k, i in enumerate(ids) if rows[i][1] in NON_RELATIONAL]
    picked = sorted({keep[int(k)] for k in np.linspace(0, len(keep) - 1, min(QUESTIONS, len(keep))).round()})
    pairs = eval_pairs.select(picked)
    options = options or {}

    def batches(size: int = 64):
        for start in range(0, len(pairs), size):
            batch = collator([pairs[k] for k in range(start, min(start + size, len(pairs)))])
            inputs = {
                k: batch[k] for k in ("pixel_values", "input_ids", "attention_mask", "token_type_ids") if k in batch
            }
            if "image_index" in batch:  # one image per pair, as the deletion test paints each pair's own
                inputs["pixel_values"] = inputs["pixel_values"][batch["image_index"]]
            if sort_of_clevr:
                scenes = [rows[i] for i in batch["sample_ids"]]  # (question, family, objects)
                questions, scenes = [q for q, _, _ in scenes], [o for _, _, o in scenes]
                scene_size = (options.get("image_size", 64),) * 2
                image_size = tuple(inputs["pixel_values"].shape[-2:])
                masks = sort_of_clevr_masks(questions, scenes, image_size, scene_size, options.get("object_size", 10))
            else:
                masks = foreground_masks(inputs["pixel_values"])
            yield inputs, masks, batch["labels"]

    def check(model) -> dict:
        checks = check_maps(model.eval(), batches())
        return {
            "eval_map_on_object": float(checks.on_target.float().mean()),
            "eval_map_answer_changes_at_peak": float(checks.changed_at_peak.float().mean()),
            "eval_map_answer_changes_at_random": float(checks.changed_at_random.float().mean()),
        }

    return check


def sort_of_clevr_masks(
    questions, scenes, size: tuple[int, int], scene_size: tuple[int, int], object_size: int
) -> torch.Tensor:
    """The named objects' squares in scenes of `scene_size` (height, width), as masks on images of `size`."""
    from ..data.sort_of_clevr import named_object_boxes

    height, width = size
    masks = torch.zeros(len(questions), height, width, dtype=torch.bool)
    scale_x, scale_y = width / scene_size[1], height / scene_size[0]

    def pixel(edge: float) -> int:  # the first pixel whose centre (i + 0.5) lies at or past a scaled edge
        return math.ceil(edge - 0.5)

    for mask, (x0, y0, x1, y1) in zip(masks, named_object_boxes(questions, scenes, object_size)):
        rows = slice(pixel(y0 * scale_y), pixel((y1 + 1) * scale_y))
        mask[rows, pixel(x0 * scale_x) : pixel((x1 + 1) * scale_x)] = True
    return masks
