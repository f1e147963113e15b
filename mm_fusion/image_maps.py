"""
Where a classification model looks in the image for its answer: one map over the image tokens per layer it reads the
image by, for every image-text pair.

- `"attention"` (cross-attention fusion: `hierarchical`, `cross_attention`): per fusion layer, the text-to-image
  attention probabilities averaged over heads and over the text's real tokens. A map sums to 1 over the image's
  grid; the share a leading [CLS]-like image token took (a ViT tower's) is reported apart.
- `"tower_attention"` (a tower conditioned by `vision_text_attention`): per stage after the stem, the attention each
  cell of the stage's map gives one text token (`token`, e.g. the word that names the object: a cell's attention sums
  to 1 over the text, so there is no mean over the text to take), scaled to sum to 1 over the grid. Coarser stages
  are put on the first stage's grid bilinearly (each cell's value at its centre).
- `"grad_cam"` (any model, and the only choice for `late` fusion): Grad-CAM (Selvaraju et al. 2017,
  arXiv:1610.02391) on the last tower map the model reads, for the given answer: the map's channels weighted by the
  answer logit's gradient averaged over the grid, summed, rectified and scaled to sum to 1. The map is the tower's
  last stage read (as the text modulated it, with FiLM) for a backbone / convolutional tower, and the last hidden
  state's patch tokens for a transformer tower.

Maps are on the image's token grid, `(height, width)`; [`upsample`] puts them on the image's pixels and
[`peak_inside`] says whether a map's highest cell is centred inside a box (the pointing accuracy of
`scripts/benchmarks/benchmark_pointing.py`). Saved with the model's code: the pipelines' `return_map=True` uses it.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


METHODS = ("attention", "tower_attention", "grad_cam")


@dataclass
class ImageMaps:
    """
    Maps of N image-text pairs.

    Attributes:
        maps (`torch.FloatTensor` of shape `(N, L, height, width)`): one map per pair and layer, each summing to 1
            over the grid (or to 1 minus `leading_share` for attention with a leading image token).
        layers (`list[str]`): the L layers' names, e.g. `"fusion layer 1"` or `"Grad-CAM, vision stage 3"`.
        method (`str`): `"attention"` or `"grad_cam"`.
        logits (`torch.FloatTensor` of shape `(N, num_labels)`): the model's logits for the pairs.
        targets (`torch.LongTensor` of shape `(N,)`): the answer each Grad-CAM map explains (the top answer unless
            given); for attention, the top answer (the map does not depend on it).
        leading_share (`torch.FloatTensor` of shape `(N, L)`): attention on a leading non-grid image token (0 for
            grids without one, and for Grad-CAM).
    """

    maps: torch.Tensor
    layers: list[str]
    method: str
    logits: torch.Tensor
    targets: torch.Tensor
    leading_share: torch.Tensor


def default_method(config) -> str:
    """`"attention"` for cross-attention fusion, `"grad_cam"` for late fusion."""
    return "grad_cam" if config.fusion_type == "late" else "attention"


def _grid(count: int) -> tuple[int, int, int]:
    """(leading tokens, height, width) of `count` image tokens: a square grid, after one leading token if needed."""
    for leading in (0, 1):
        side = math.isqrt(count - leading)
        if side * side == count - leading and side > 0:
            return leading, side, side
    raise ValueError(f"Cannot lay {count} image tokens on a square grid (with or without one leading token).")


def image_maps(
    model,
    pixel_values: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    token_type_ids: torch.Tensor | None = None,
    image_index: torch.Tensor | None = None,
    method: str | None = None,
    targets: torch.Tensor | None = None,
    token: int | torch.Tensor | None = None,
) -> ImageMaps:
    """
    The maps of an `MMFusionForImageTextClassification` model for N image-text pairs (inputs as its `forward` takes
    them). `method` defaults to [`default_method`]; `targets` (Grad-CAM only) are the answers to explain, one per pair,
    by default the top answer; `token` (attention only) takes that token position's attention instead of the mean over
    the text's real tokens: one position for every pair, or a `(N,)` tensor of one per pair (e.g. where each question
    names its object). The model is left as it was (mode, gradients, hooks).
    """
    config = model.config
    method = method or default_method(config)
    if method not in METHODS:
        raise ValueError(f"Unknown map method {method!r}; choose from {', '.join(METHODS)}.")
    if method == "attention" and config.fusion_type == "late":
        raise ValueError("A late-fusion model has no cross-attention to read its map from: use method='grad_cam'.")
    if targets is not None and method != "grad_cam":
        raise ValueError("`targets` choose the answer a Grad-CAM map explains; an attention map has none.")
    if token is not None and method == "grad_cam":
        raise ValueError("`token` picks one text token's attention; a Grad-CAM map has no tokens.")
    if method == "tower_attention":
        if getattr(model.mm_fusion, "vision_text_attention", None) is None:
            raise ValueError(
                "method='tower_attention' maps the reads of a tower conditioned by cross-attention "
                "(config.vision_text_attention); this model's vision tower reads no text."
            )
        if token is None:
            raise ValueError(
                "method='tower_attention' needs `token`: a cell's attention sums to 1 over the text, so the map is "
                "the attention the cells give one token (e.g. the word that names the object)."
            )
    if token is not None:
        token = torch.as_tensor(token, dtype=torch.long)
        if token.dim() > 1 or token.numel() not in (1, input_ids.shape[0]):
            raise ValueError(
                f"`token` takes one position or one per pair ({input_ids.shape[0]}), got {list(token.shape)}."
            )
        token = token.reshape(-1).expand(input_ids.shape[0])
        outside = (token < 0) | (token >= input_ids.shape[1])
        if outside.any():
            first = token[outside][0].item()
            raise ValueError(f"`token` {first} is outside the texts' {input_ids.shape[1]} positions.")
    inputs = {"pixel_values": pixel_values, "input_ids": input_ids, "attention_mask": attention_mask}
    if token_type_ids is not None:
        inputs["token_type_ids"] = token_type_ids
    if method == "attention":
        return _attention_maps(model, inputs, image_index, token)
    if method == "tower_attention":
        return _tower_attention_maps(model, inputs, image_index, token)
    # Grad-CAM: one image per pair, so that a shared image's gradient is not the sum over its questions.
    if image_index is not None:
        inputs["pixel_values"] = pixel_values[image_index]
    return _grad_cam(model, inputs, targets)


def _attention_maps(model, inputs: dict, image_index: torch.Tensor | None, token: torch.Tensor | None) -> ImageMaps:
    blocks = [layer.text_block.cross_attn for layer in model.mm_fusion.encoder.layers]
    captured: list[torch.Tensor] = []

    def capture(module, args, kwargs):
        # The probabilities the layer attends with, from its own projections, whatever attention implementation runs.
        hidden, context, context_mask, context_index = (list(args) + [None, None])[:4]
        context_index = kwargs.get("context_index", context_index)
        B, T, _ = hidden.shape
        N, S = context.shape[:2]
        heads, size = module.num_heads, module.head_dim
        q = module.q_proj(hidden).view(B, T, heads, size).transpose(1, 2)
        k = module.k_proj(context).view(N, S, heads, size).transpose(1, 2)
        if context_index is not None:
            k = k[context_index]
        scores = (q @ k.transpose(-1, -2)).float() * module.scaling  # (B, heads, T, S)
        if context_mask is not None:
            scores = scores.masked_fill(~context_mask[:, None, None, :].bool(), float("-inf"))
        captured.append(scores.softmax(-1))

    handles = [block.register_forward_pre_hook(capture, with_kwargs=True) for block in blocks]
    try:
        with torch.no_grad():
            logits = model(**inputs, image_index=image_index).logits
    finally:
        for handle in handles:
            handle.remove()
    mask = inputs["attention_mask"]
    if mask is None:
        mask = torch.ones_like(inputs["input_ids"])
    if token is not None:
        mask = torch.zeros_like(mask)
        mask[torch.arange(len(token)), token] = 1
    weights = mask[:, None, :, None].to(captured[0].dtype)  # (B, 1, T, 1): the text's real tokens
    per_layer = []
    for probabilities in captured:
        per_layer.append((probabilities * weights).sum(2).mean(1) / weights.sum(2).squeeze(-1).clamp(min=1))
    stacked = torch.stack(per_layer, dim=1)  # (B, L, S)
    leading, height, width = _grid(stacked.shape[-1])
    maps = stacked[..., leading:].reshape(*stacked.shape[:2], height, width)
    return ImageMaps(
        maps=maps,
        layers=[f"fusion layer {k + 1}" for k in range(len(captured))],
        method="attention",
        logits=logits.float(),
        targets=logits.argmax(-1),
        leading_share=stacked[..., :leading].sum(-1),
    )


def _tower_attention_maps(model, inputs: dict, image_index: torch.Tensor | None, token: torch.Tensor) -> ImageMaps:
    reads = model.mm_fusion.vision_text_attention
    reads.recorded = []
    try:
        with torch.no_grad():
            logits = model(**inputs, image_index=image_index).logits
        recorded = reads.recorded
    finally:
        reads.recorded = None
    size = recorded[0][1]
    offset = 1 if model.mm_fusion._vision_tower_type == "backbone" else 0  # a backbone's stage 0 is its stem
    offset += reads.first_stage  # the stages before it read nothing
    rows = torch.arange(len(token))
    maps = []
    for probabilities, (height, width) in recorded:
        chosen = probabilities.mean(1)[rows, :, token.to(probabilities.device)]  # (N, height * width)
        grid = chosen.reshape(-1, height, width)
        if (height, width) != size:
            grid = upsample(grid, size)
        maps.append(grid / grid.flatten(1).sum(-1).clamp(min=1e-12)[:, None, None])
    return ImageMaps(
        maps=torch.stack(maps, dim=1),
        layers=[f"vision stage {k + offset} read" for k in range(len(recorded))],
        method="tower_attention",
        logits=logits.float(),
        targets=logits.argmax(-1),
        leading_share=torch.zeros(len(token), len(recorded)),
    )


def _grad_cam(model, inputs: dict, targets: torch.Tensor | None) -> ImageMaps:
    base = model.mm_fusion
    captured: list[torch.Tensor] = []
    transformer = base.feature_map_tokens is None
    if transformer:  # the last hidden state's tokens

        def capture(module, args, output):
            captured.append(output.last_hidden_state)

        handle = base.vision_model.register_forward_hook(capture)
        name = "Grad-CAM, vision tower's last hidden state"
    else:  # the tower's maps at the stages the fusion reads, as its token projection receives them

        def capture(module, args):
            captured.append(args[0][-1])

        handle = base.feature_map_tokens.register_forward_pre_hook(capture)
        name = f"Grad-CAM, vision stage {base._vision_stages[-1]}"
    try:
        with torch.enable_grad():
            logits = model(**inputs).logits
            chosen = logits.argmax(-1) if targets is None else targets.to(logits.device)
            activations = captured[-1]
            score = logits.gather(1, chosen[:, None]).sum()
            (gradients,) = torch.autograd.grad(score, activations)
    finally:
        handle.remove()
    activations, gradients = activations.detach().float(), gradients.float()
    if transformer:  # (N, P, D) tokens: channels last
        leading, height, width = _grid(activations.shape[1])
        activations = activations[:, leading:].transpose(1, 2).reshape(activations.shape[0], -1, height, width)
        gradients = gradients[:, leading:].transpose(1, 2).reshape(gradients.shape[0], -1, height, width)
    channel_weights = gradients.mean(dim=(2, 3), keepdim=True)  # (N, C, 1, 1)
    cam = F.relu((channel_weights * activations).sum(1))  # (N, h, w)
    total = cam.flatten(1).sum(-1).view(-1, 1, 1)
    uniform = torch.full_like(cam, 1.0 / cam[0].numel())
    cam = torch.where(total > 0, cam / total.clamp(min=1e-12), uniform)  # all-zero: no evidence, a flat map
    return ImageMaps(
        maps=cam[:, None],
        layers=[name],
        method="grad_cam",
        logits=logits.detach().float(),
        targets=chosen.detach(),
        leading_share=torch.zeros(cam.shape[0], 1),
    )


def upsample(maps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Maps `(..., h, w)` on the pixels of a `size` image, bilinearly (each grid value at its cell's centre)."""
    shape = maps.shape
    flat = maps.reshape(-1, 1, *shape[-2:]).float()
    return F.interpolate(flat, size=size, mode="bilinear", align_corners=False).reshape(*shape[:-2], *size)


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


def peak_pixels(maps: torch.Tensor, size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (y, x) pixel coordinates (pixel k spans [k - 0.5, k + 0.5]) of the centre of each map's highest cell."""
    h, w = maps.shape[-2:]
    flat = maps.flatten(-2).argmax(-1)
    row, column = flat // w, flat % w
    return (row + 0.5) * size[0] / h - 0.5, (column + 0.5) * size[1] / w - 0.5


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
