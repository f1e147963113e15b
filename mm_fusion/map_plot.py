"""Image maps ([`mm_fusion.image_maps`]) drawn over their images, for `scripts/visualize_attention.py` and the
pointing benchmark; needs matplotlib. Not saved with a model."""

import torch

from .image_maps import upsample
from .map_scoring import peak_pixels


def plot(rows: list[dict], path: str, title: str | None = None) -> None:
    """
    Draw maps over their images and save a PNG (needs matplotlib): one row per image-text pair, the image with its
    question -> answer (score), then one panel per layer with the map over the image, and a colour bar per row (the
    share of the map on each grid cell). Each row is a dict with `image` (`(H, W, 3)` uint8 array, as the model saw
    it), `question`, `answer`, `score`, `maps` (`(L, h, w)`), `layers` (L names) and, optionally, `box` (`(x0, y0, x1,
    y1)` pixels, drawn as a rectangle: where the map should peak).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    columns = 1 + max(len(row["layers"]) for row in rows)
    figure, axes = plt.subplots(
        len(rows), columns, figsize=(2.6 * columns + 0.6, 2.7 * len(rows)), squeeze=False, constrained_layout=True
    )
    for axis_row, row in zip(axes, rows):
        image = row["image"]
        size = image.shape[:2]
        maps = torch.as_tensor(row["maps"]).float()
        pixels = upsample(maps, size).numpy()
        top = float(maps.max())
        axis_row[0].imshow(image, interpolation="nearest")
        axis_row[0].set_title(f"{row['question']}\n-> {row['answer']} ({row['score']:.2f})", fontsize=8)
        shown = None
        for k, (axis, name) in enumerate(zip(axis_row[1:], row["layers"])):
            axis.imshow(image, interpolation="nearest")
            shown = axis.imshow(pixels[k], cmap="inferno", alpha=0.6, vmin=0.0, vmax=top, interpolation="nearest")
            y, x = peak_pixels(maps[k], size)
            axis.plot(float(x), float(y), marker="+", color="cyan", markersize=10, markeredgewidth=2)
            axis.set_title(name, fontsize=8)
        if row.get("box") is not None:
            x0, y0, x1, y1 = row["box"]
            for axis in axis_row[: 1 + len(row["layers"])]:
                axis.add_patch(Rectangle((x0 - 0.5, y0 - 0.5), x1 - x0 + 1, y1 - y0 + 1, fill=False, color="lime"))
        for axis in axis_row:
            axis.axis("off")
        if shown is not None:
            figure.colorbar(shown, ax=list(axis_row), shrink=0.8, label="share of the map per cell")
    if title:
        figure.suptitle(title, fontsize=9)
    figure.savefig(path, dpi=110)
    plt.close(figure)
