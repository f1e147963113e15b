"""
Whether a classification model's image maps ([`mm_fusion.image_maps`]) point and are faithful: where a map's peak
falls (inside a box, on a mask's pixels), and the deletion test (does painting over the peak change the answer far
more often than painting elsewhere). Used by the end-of-training map check (`mm_fusion/training/map_checks.py`),
`scripts/benchmarks/benchmark_pointing.py` and the pages that quote their figures; not saved with a model.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .image_maps import median_colours


def peak_inside(maps: torch.Tensor, boxes: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """
    Whether each map peaks inside its box: `maps` `(N, ..., h, w)`, `boxes` `(N, 4)` pixel boxes `(x0, y0, x1, y1)`,
    inclusive, on an image of `size` (height, width). The peak is the centre of the map's highest grid cell (ties: the
    first in row-major order), and it is inside when it falls on one of the box's pixels. Returns a boolean `(N, ...)`.
    """
    y, x = peak_pixels(maps, size)
    extra = (1,) * (y.dim() - 1)
    x0, y0, x1, y1 = (boxes[:, k].view(-1, *extra).float() for k in range(4))
    return (x >= x0 - 0.5) & (x <= x1 + 0.5) & (y >= y0 - 0.5) & (y <= y1 + 0.5)


def peak_on(maps: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """
    Whether each map's peak falls on its mask: `maps` `(N, ..., h, w)`, `masks` `(N, H, W)` boolean, True on the pixels
    where the peak should be (e.g. the object's, not the background's). The peak is the centre of the map's highest
    cell, on the pixel it falls in (a centre on a border between pixels: the one below / to the right). Returns a
    boolean `(N, ...)`.
    """
    rows, columns = peak_pixel_indices(maps, tuple(masks.shape[-2:]))
    index = torch.arange(len(masks)).view(-1, *(1,) * (rows.dim() - 1)).expand_as(rows)
    return masks[index, rows, columns]


def foreground_masks(pixel_values: torch.Tensor) -> torch.Tensor:
    """`(N, H, W)` True where a pixel's colour differs from its image's median colour: on a plain background (an
    easy-VQA image), the shape's pixels."""
    return (pixel_values != median_colours(pixel_values)[..., None, None]).any(1)


@dataclass
class MapChecks:
    """
    The checks of [`check_maps`], one entry per pair.

    Attributes:
        method (`str`), layer (`str`): the map checked (its last layer's).
        on_target (`torch.BoolTensor` `(N,)`): whether the map's peak falls on the pair's mask.
        right (`torch.BoolTensor` `(N,)`): whether the model's answer is the expected one.
        changed_at_peak, changed_at_random (`torch.BoolTensor` `(N,)`): [`deletion_test`].
    """

    method: str
    layer: str
    on_target: torch.Tensor
    right: torch.Tensor
    changed_at_peak: torch.Tensor
    changed_at_random: torch.Tensor


def check_maps(model, batches, method: str | None = None, side: int = 10, seed: int = 0, **map_kwargs) -> MapChecks:
    """
    Whether a classification model's maps point and are faithful, over `batches` of `(inputs, masks, answers)`: the
    model's inputs with one uint8 image per pair, the pixels the peak should fall on (`(N, H, W)` booleans at the
    inputs' size) and the expected answers (class ids). Checks the map's peak on the masks, the answers, and the
    [`deletion_test`] with `side` x `side` squares (random squares from `seed`). `map_kwargs` go to `image_maps`.
    """
    generator = torch.Generator().manual_seed(seed)
    checks = {"on_target": [], "right": [], "changed_at_peak": [], "changed_at_random": []}
    for inputs, masks, answers in batches:
        result = model.image_maps(**inputs, method=method, **map_kwargs)
        checks["on_target"].append(peak_on(result.maps[:, -1], masks))
        checks["right"].append(result.logits.argmax(-1) == torch.as_tensor(answers))
        at_peak, at_random = deletion_test(model, inputs, result.maps[:, -1], side, generator)
        checks["changed_at_peak"].append(at_peak)
        checks["changed_at_random"].append(at_random)
    return MapChecks(result.method, result.layers[-1], **{k: torch.cat(v) for k, v in checks.items()})


def paint(pixel_values: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, side: int) -> torch.Tensor:
    """A copy of `pixel_values` `(N, C, H, W)` with a `side` x `side` square of each image's median colour centred on
    its pixel `(rows[i], columns[i])` (moved inside the image where it would cross an edge)."""
    painted = pixel_values.clone()
    height, width = pixel_values.shape[-2:]
    colours = median_colours(pixel_values)
    for i, (row, column) in enumerate(zip(rows.tolist(), columns.tolist())):
        top = min(max(int(row) - side // 2, 0), height - side)
        left = min(max(int(column) - side // 2, 0), width - side)
        painted[i, :, top : top + side, left : left + side] = colours[i, :, None, None]
    return painted


def deletion_test(
    model, inputs: dict, maps: torch.Tensor, side: int = 10, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Whether the maps are faithful: for each pair (`inputs` as the model's `forward` takes them, one uint8 image per
    pair), whether the top answer changes when the image's median colour is painted over the `side` x `side` square
    centred on the map's peak (`maps` `(N, h, w)`), and when it is painted over a random square of that size that does
    not overlap it. Returns the two boolean `(N,)` tensors; a faithful map changes the answer far more often at its
    peak.
    """
    pixel_values = inputs["pixel_values"]
    height, width = pixel_values.shape[-2:]
    if height < 2 * side and width < 2 * side:
        raise ValueError(f"A {height} x {width} image has no room for two {side} x {side} squares apart.")
    # Square centres, kept where the whole square lies inside the image.
    low, high_rows, high_columns = side // 2, height - side + side // 2, width - side + side // 2
    rows, columns = peak_pixel_indices(maps, (height, width))
    rows, columns = rows.clamp(low, high_rows), columns.clamp(low, high_columns)
    # Random squares that do not overlap the peak's: centres `side` or more apart along a row or a column.
    random_rows, random_columns = rows.clone(), columns.clone()
    for i in range(len(rows)):
        while abs(int(random_rows[i]) - int(rows[i])) < side and abs(int(random_columns[i]) - int(columns[i])) < side:
            random_rows[i] = torch.randint(low, high_rows + 1, (), generator=generator)
            random_columns[i] = torch.randint(low, high_columns + 1, (), generator=generator)
    answers = []
    with torch.no_grad():
        for pixels in (
            pixel_values,
            paint(pixel_values, rows, columns, side),
            paint(pixel_values, random_rows, random_columns, side),
        ):
            answers.append(model(**{**inputs, "pixel_values": pixels}).logits.argmax(-1))
    return answers[1] != answers[0], answers[2] != answers[0]


def reachable(grid: tuple[int, int], boxes: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """
    Whether a map on a `grid` (height, width) of cells can peak inside each of `boxes` `(N, 4)` at all, on an image of
    `size`: whether some cell's centre falls on one of the box's pixels. On a coarse grid a small object may hold no
    cell's centre, so the share of True is the most [`peak_inside`] can give there. Returns a boolean `(N,)`.
    """
    (h, w), (height, width) = grid, size
    rows = (torch.arange(h) + 0.5) * height / h - 0.5
    columns = (torch.arange(w) + 0.5) * width / w - 0.5
    x0, y0, x1, y1 = (boxes[:, k, None].float() for k in range(4))
    across = ((columns >= x0 - 0.5) & (columns <= x1 + 0.5)).any(-1)
    down = ((rows >= y0 - 0.5) & (rows <= y1 + 0.5)).any(-1)
    return across & down


def peak_pixel_indices(maps: torch.Tensor, size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, column) of the pixel each map's peak ([`peak_pixels`]) falls in (a centre on a border between
    pixels: the one below / to the right)."""
    y, x = peak_pixels(maps, size)
    return (torch.floor(y + 0.5).long().clamp(0, size[0] - 1), torch.floor(x + 0.5).long().clamp(0, size[1] - 1))


def peak_pixels(maps: torch.Tensor, size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (y, x) pixel coordinates (pixel k spans [k - 0.5, k + 0.5]) of the centre of each map's highest cell."""
    h, w = maps.shape[-2:]
    flat = maps.flatten(-2).argmax(-1)
    row, column = flat // w, flat % w
    return (row + 0.5) * size[0] / h - 0.5, (column + 0.5) * size[1] / w - 0.5


def measured_map_figures(model_dir: str | Path) -> str:
    """A line on how the model's default map was measured at the end of its training (`eval_map_*` in its
    `all_results.json`, mm_fusion/training/map_checks.py), or why it was not."""
    results = Path(model_dir) / "all_results.json"
    figures = json.loads(results.read_text()) if results.is_file() else {}
    if "eval_map_on_object" not in figures:
        return (
            "This map's pointing was not measured for this model: its data has no known object places (easy-VQA's "
            "and Sort-of-CLEVR's have; scripts/benchmarks/benchmark_pointing.py)."
        )
    return (
        f"Measured at the end of training on up to 1,000 test questions: the map's peak fell on the object for "
        f"{figures['eval_map_on_object']:.1%} of them; painting over the 10 x 10 square at the peak changed the "
        f"answer for {figures['eval_map_answer_changes_at_peak']:.1%}, over a random square away from it for "
        f"{figures['eval_map_answer_changes_at_random']:.1%}."
    )
