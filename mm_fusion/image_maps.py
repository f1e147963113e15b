"""
Where a classification model looks in the image for its answer, as maps over the image for every image-text pair.

- `"guided_gradient"` (the default for cross-attention fusion): input x gradient at the pixels, weighted by the coarse
  map the model reads the image by, as Guided Grad-CAM (Selvaraju et al. 2017, arXiv:1610.02391) weights guided
  backpropagation by Grad-CAM. Each pixel's input x gradient is the first-order change of the answer's logit were the
  pixel given the image's median colour (the background's, on a plain background), in magnitude: `|sum_c (x_c -
  median_c) * dlogit/dx_c|`. The coarse map is the question's cross-attention in the last fusion layer (`hierarchical`,
  `cross_attention`) or Grad-CAM on the tower's last map read (`late`), put on the pixels bilinearly; for a tower whose
  stages read the question (`vision_text_attention`), also where the first stage's read moves the answer (per cell,
  `|read . dlogit/dread|`: the pixels where the question's words are read, and where the tower's own reading of the
  question matters). The product is
  summed over a window of a seventh of the image's side (9 pixels at 64), so that its peak is where the evidence
  gathers rather than one noisy pixel. One forward and one backward pass per answer explained; the map is on the
  image's pixels.
- `"input_x_gradient"` (the default for late fusion): the same pixel attribution without the coarse weighting.
- `"attention"` (cross-attention fusion): per fusion layer, the text-to-image attention probabilities averaged over
  heads and over the text's real tokens. A map sums to 1 over the image's grid; the share a leading [CLS]-like image
  token took (a ViT tower's) is reported apart.
- `"tower_attention"` (a tower conditioned by `vision_text_attention`): per stage after the stem, the attention each
  cell of the stage's map gives one text token (`token`, e.g. the word that names the object: a cell's attention sums
  to 1 over the text, so there is no mean over the text to take), scaled to sum to 1 over the grid. Coarser stages
  are put on the first stage's grid bilinearly (each cell's value at its centre).
- `"grad_cam"` (any model): Grad-CAM on the last tower map the model reads, for the given answer: the map's channels
  weighted by the answer logit's gradient averaged over the grid, summed, rectified and scaled to sum to 1. The map is
  the tower's last stage read (as the text modulated it, with FiLM) for a backbone / convolutional tower, and the last
  hidden state's patch tokens for a transformer tower.

How well each points at the object a question names, and whether painting over its peak changes the answer, is
measured by `scripts/benchmarks/benchmark_pointing.py` (figures: scripts/benchmarks/RESULTS.md).

Maps are on the image's token grid or pixels, `(height, width)`; [`upsample`] puts them on the image's pixels. Saved
with the model's code: the pipelines' `return_map=True` uses it. Scoring maps (where their peak falls, the deletion
test) is `mm_fusion.map_scoring`'s job, drawing them `mm_fusion.map_plot`'s; neither is saved with a model.
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F


METHODS = ("guided_gradient", "input_x_gradient", "attention", "tower_attention", "grad_cam")
# The maps that explain one answer (computed from its logit's gradient): one per answer asked for.
ANSWER_METHODS = ("guided_gradient", "input_x_gradient", "grad_cam")


@dataclass
class ImageMaps:
    """
    Maps of N image-text pairs.

    Attributes:
        maps (`torch.FloatTensor` of shape `(N, L, height, width)`): one map per pair and layer, each summing to 1
            over the grid (or to 1 minus `leading_share` for attention with a leading image token).
        layers (`list[str]`): the L layers' names, e.g. `"fusion layer 1"` or `"Grad-CAM, vision stage 3"`.
        method (`str`): one of [`METHODS`].
        logits (`torch.FloatTensor` of shape `(N, num_labels)`): the model's logits for the pairs.
        targets (`torch.LongTensor` of shape `(N,)`): the answer each gradient map explains (the top answer unless
            given); for attention, the top answer (the map does not depend on it).
        leading_share (`torch.FloatTensor` of shape `(N, L)`): attention on a leading non-grid image token (0 for
            grids without one, and for the gradient maps).
    """

    maps: torch.Tensor
    layers: list[str]
    method: str
    logits: torch.Tensor
    targets: torch.Tensor
    leading_share: torch.Tensor


def default_method(config) -> str:
    """Of the maps measured, the one whose peak lies on the named object most often (scripts/benchmarks/RESULTS.md,
    benchmark_pointing.py): `"guided_gradient"` for cross-attention fusion, `"input_x_gradient"` for late fusion
    (whose coarse map, Grad-CAM on the last stage, points worse than the pixels alone)."""
    return "input_x_gradient" if config.fusion_type == "late" else "guided_gradient"


def describe(method: str) -> str:
    """A short name of the method, for a figure's title or a page."""
    return {
        "guided_gradient": "input x gradient weighted by the model's coarse map",
        "input_x_gradient": "input x gradient",
        "attention": "the question's cross-attention",
        "tower_attention": "the tower's reads of the question",
        "grad_cam": "Grad-CAM",
    }[method]


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
    if targets is not None and method not in ANSWER_METHODS:
        raise ValueError(f"`targets` choose the answer a gradient map explains; a {method!r} map has none.")
    if token is not None and method in ANSWER_METHODS:
        raise ValueError(f"`token` picks one text token's attention; a {method!r} map has no tokens.")
    if method == "tower_attention":
        if model.mm_fusion.vision_encoder.vision_text_attention is None:
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
    # The gradient maps: one image per pair, so that a shared image's gradient is not the sum over its questions.
    if method == "grad_cam":
        if image_index is not None:
            inputs["pixel_values"] = pixel_values[image_index]
        return _grad_cam(model, inputs, targets)
    return _gradient_maps(model, inputs, targets, guided=method == "guided_gradient", image_index=image_index)


def _capture_attention(model, captured: list[torch.Tensor]) -> list:
    """Hooks that append each fusion layer's text-to-image attention probabilities `(B, heads, T, S)` to `captured` as
    the layer attends (from its own projections, whatever attention implementation runs); returns their handles."""

    def capture(module, args, kwargs):
        hidden, context, context_mask, context_index = (list(args) + [None, None])[:4]
        context_index = kwargs.get("context_index", context_index)
        B, T, _ = hidden.shape
        N, S = context.shape[:2]
        heads, size = module.num_heads, module.head_dim
        with torch.no_grad():  # a record of the forward, not part of what a gradient map differentiates
            q = module.q_proj(hidden).view(B, T, heads, size).transpose(1, 2)
            k = module.k_proj(context).view(N, S, heads, size).transpose(1, 2)
            if context_index is not None:
                k = k[context_index]
            scores = (q @ k.transpose(-1, -2)).float() * module.scaling  # (B, heads, T, S)
            if context_mask is not None:
                scores = scores.masked_fill(~context_mask[:, None, None, :].bool(), float("-inf"))
            captured.append(scores.softmax(-1))

    blocks = [layer.text_block.cross_attn for layer in model.mm_fusion.encoder.layers]
    return [block.register_forward_pre_hook(capture, with_kwargs=True) for block in blocks]


def _text_mean(probabilities: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`(B, heads, T, S)` attention averaged over heads and over the tokens where `mask` `(B, T)` is 1: `(B, S)`."""
    weights = mask[:, None, :, None].to(probabilities.dtype)
    return (probabilities * weights).sum(2).mean(1) / weights.sum(2).squeeze(-1).clamp(min=1)


def _attention_maps(model, inputs: dict, image_index: torch.Tensor | None, token: torch.Tensor | None) -> ImageMaps:
    captured: list[torch.Tensor] = []
    handles = _capture_attention(model, captured)
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
    stacked = torch.stack([_text_mean(probabilities, mask) for probabilities in captured], dim=1)  # (B, L, S)
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
    reads = model.mm_fusion.vision_encoder.vision_text_attention
    reads.recorded = []
    try:
        with torch.no_grad():
            logits = model(**inputs, image_index=image_index).logits
        recorded = reads.recorded
    finally:
        reads.recorded = None
    size = recorded[0][1]
    offset = 1 if model.mm_fusion.vision_encoder.tower_type == "backbone" else 0  # a backbone's stage 0 is its stem
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


def _capture_name(model) -> str:
    """The name of the map [`_capture_last_map`] records."""
    vision = model.mm_fusion.vision_encoder
    if vision.feature_map_tokens is None:
        return "vision tower's last hidden state"
    return f"vision stage {vision.stages[-1]}"


def _capture_last_map(model, captured: list[torch.Tensor]):
    """A hook that appends the last tower map the model reads to `captured` (a backbone / convolutional tower's last
    stage read, as its token projection receives it; a transformer tower's last hidden state); returns its handle."""
    vision = model.mm_fusion.vision_encoder
    if vision.feature_map_tokens is None:  # the last hidden state's tokens

        def capture(module, args, output):
            captured.append(output.last_hidden_state)

        return vision.vision_model.register_forward_hook(capture)

    def capture_stages(module, args):
        captured.append(args[0][-1])

    return vision.feature_map_tokens.register_forward_pre_hook(capture_stages)


def _cam(activations: torch.Tensor, gradients: torch.Tensor) -> torch.Tensor:
    """Grad-CAM `(N, h, w)`, unscaled, of a map `(N, C, h, w)` or of transformer tokens `(N, P, D)`."""
    activations, gradients = activations.detach().float(), gradients.float()
    if activations.dim() == 3:  # (N, P, D) tokens: channels last
        leading, height, width = _grid(activations.shape[1])
        activations = activations[:, leading:].transpose(1, 2).reshape(activations.shape[0], -1, height, width)
        gradients = gradients[:, leading:].transpose(1, 2).reshape(gradients.shape[0], -1, height, width)
    channel_weights = gradients.mean(dim=(2, 3), keepdim=True)  # (N, C, 1, 1)
    return F.relu((channel_weights * activations).sum(1))


def _sum_to_one(maps: torch.Tensor) -> torch.Tensor:
    """`(N, h, w)` non-negative maps scaled to sum to 1; an all-zero map (no evidence) becomes a flat one."""
    total = maps.flatten(1).sum(-1).view(-1, 1, 1)
    uniform = torch.full_like(maps, 1.0 / maps[0].numel())
    return torch.where(total > 0, maps / total.clamp(min=1e-12), uniform)


def _answer_score(logits: torch.Tensor, targets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The answers explained (the top ones unless given) and the sum of their logits, whose gradient the maps take."""
    chosen = logits.argmax(-1) if targets is None else targets.to(logits.device)
    return chosen, logits.gather(1, chosen[:, None]).sum()


def _grad_cam(model, inputs: dict, targets: torch.Tensor | None) -> ImageMaps:
    captured: list[torch.Tensor] = []
    handle = _capture_last_map(model, captured)
    try:
        with torch.enable_grad():
            logits = model(**inputs).logits
            chosen, score = _answer_score(logits, targets)
            (gradients,) = torch.autograd.grad(score, captured[-1])
    finally:
        handle.remove()
    cam = _sum_to_one(_cam(captured[-1], gradients))
    return ImageMaps(
        maps=cam[:, None],
        layers=[f"Grad-CAM, {_capture_name(model)}"],
        method="grad_cam",
        logits=logits.detach().float(),
        targets=chosen.detach(),
        leading_share=torch.zeros(cam.shape[0], 1),
    )


def smoothing_window(size: tuple[int, int]) -> int:
    """The side of the window the gradient maps are summed over: a seventh of the image's shorter side, odd (9 at
    64 px: about an easy-VQA shape's or a Sort-of-CLEVR object's size)."""
    return (min(size) // 7) | 1


def pixel_contributions(
    model, inputs: dict, targets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    Input x gradient at the pixels, signed: for each pair (`inputs` as the model's `forward` takes them, one image per
    pair), `sum_c (x_c - median_c) d logit / d x_c` `(N, H, W)` over the normalised pixels, the first-order change of
    the answer's logit were the pixel given the image's median colour (negated: positive where that colour would lower
    the answer). Returns it with the logits and the answers explained (`targets`, by default the top ones).
    """
    contributions, logits, chosen, _, _, _ = _contributions(model, inputs, targets, None)
    return contributions, logits, chosen


def _contributions(
    model, inputs: dict, targets: torch.Tensor | None, coarse: str | None, image_index: torch.Tensor | None = None
) -> tuple:
    """[`pixel_contributions`], and with `coarse` the coarse map's record from the same pass: `"attention"` (the
    fusion layers' attention; and for a tower whose stages read the text, [`_read_contributions`] of its first read)
    or `"grad_cam"` (the last tower map read and its gradient). With `image_index`, the images are the distinct ones
    and each pair gets its own copy (its gradient its own)."""
    pixels = model.mm_fusion.vision_encoder.normalize_pixels(inputs["pixel_values"]).detach()
    reference = median_colours(pixels)[..., None, None]  # (N, C, 1, 1), once per distinct image
    if image_index is not None:
        pixels, reference = pixels[image_index], reference[image_index]
    pixels.requires_grad_(True)
    captured: list[torch.Tensor] = []
    handles = []
    if coarse == "grad_cam":
        handles = [_capture_last_map(model, captured)]
    elif coarse == "attention":
        handles = _capture_attention(model, captured)
    reads = model.mm_fusion.vision_encoder.vision_text_attention if coarse == "attention" else None
    if reads is not None:
        reads.read_outputs = []
    try:
        with torch.enable_grad(), _parameters_frozen(model):
            logits = model(**{**inputs, "pixel_values": pixels}).logits
            chosen, score = _answer_score(logits, targets)
            wrt = [pixels, *captured[-1:]] if coarse == "grad_cam" else [pixels]
            if reads is not None:
                before, after = reads.read_outputs[0]
                wrt.append(after)
            gradients = torch.autograd.grad(score, wrt)
    finally:
        for handle in handles:
            handle.remove()
        if reads is not None:
            reads.read_outputs = None
    contributions = ((pixels.detach() - reference) * gradients[0]).sum(1).float()  # (N, H, W)
    read = None if reads is None else _read_contributions(before, after, gradients[1])
    return contributions, logits.detach().float(), chosen.detach(), captured, gradients[1:], read


def _read_contributions(before: torch.Tensor, after: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """Where a tower stage's read of the text moves the answer: per cell, `|sum_c read_c * dlogit/dread_c|`, the
    first-order change of the answer's logit were the cell's read (`after - before`, `(N, C, h, w)`) taken away
    (`gradient`: the logit's gradient at `after`, the same as at the read). `(N, h, w)`."""
    return ((after.detach() - before.detach()) * gradient).sum(1).abs().float()


@contextmanager
def _parameters_frozen(model):
    """The model's parameters with `requires_grad` off for the block, then as they were: a map differentiates the
    answer with respect to the pixels only, so no operation records what the parameters' own gradients would need
    (about a fifth of a map's time, for a convolutional tower)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    for parameter in trainable:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in trainable:
            parameter.requires_grad_(True)


def _box_mean(maps: torch.Tensor, window: int) -> torch.Tensor:
    """Each value of `(N, H, W)` maps replaced by the mean over the `window` x `window` square around it (the part
    inside the map at the edges), as a row pass then a column pass: the same mean as one square pass, in about half
    its time."""
    pad = window // 2
    rows = F.avg_pool2d(maps[:, None], (window, 1), stride=1, padding=(pad, 0), count_include_pad=False)
    return F.avg_pool2d(rows, (1, window), stride=1, padding=(0, pad), count_include_pad=False)[:, 0]


def _gradient_maps(
    model, inputs: dict, targets: torch.Tensor | None, guided: bool, image_index: torch.Tensor | None
) -> ImageMaps:
    """`"input_x_gradient"` and `"guided_gradient"` (the module docstring): one forward and one backward pass."""
    late = model.config.fusion_type == "late"
    coarse = ("grad_cam" if late else "attention") if guided else None
    contributions, logits, chosen, captured, gradients, read = _contributions(
        model, inputs, targets, coarse, image_index
    )
    evidence = contributions.abs()
    size = tuple(evidence.shape[-2:])
    name = "input x gradient"
    if coarse == "grad_cam":
        evidence = evidence * upsample(_cam(captured[-1], gradients[0]), size)
        name += f" x Grad-CAM on the {_capture_name(model)}"
    elif coarse == "attention":
        mask = inputs["attention_mask"]
        attention = _text_mean(captured[-1], torch.ones_like(inputs["input_ids"]) if mask is None else mask)
        leading, height, width = _grid(attention.shape[-1])
        evidence = evidence * upsample(attention[:, leading:].reshape(-1, height, width), size)
        name += f" x fusion layer {len(captured)}'s attention"
        if read is not None:
            evidence = evidence * upsample(read, size)
            name += " x the tower's first read x its gradient"
    maps = _sum_to_one(_box_mean(evidence, smoothing_window(size)))
    return ImageMaps(
        maps=maps[:, None],
        layers=[name],
        method="guided_gradient" if guided else "input_x_gradient",
        logits=logits,
        targets=chosen,
        leading_share=torch.zeros(maps.shape[0], 1),
    )


def upsample(maps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Maps `(..., h, w)` on the pixels of a `size` image, bilinearly (each grid value at its cell's centre)."""
    shape = maps.shape
    flat = maps.reshape(-1, 1, *shape[-2:]).float()
    return F.interpolate(flat, size=size, mode="bilinear", align_corners=False).reshape(*shape[:-2], *size)


def median_colours(pixel_values: torch.Tensor) -> torch.Tensor:
    """Each image's median colour `(N, C)` (per channel): the background's, on a plain background."""
    return pixel_values.flatten(2).median(-1).values
