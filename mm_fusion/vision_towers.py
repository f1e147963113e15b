"""
Vision towers beyond transformer encoders: convolutional backbones whose feature maps become fusion tokens, and a
convolutional stem in place of a vision transformer's patchify.

A vision tower is one of three types, told apart by its config:

- `"transformer"`: an encoder whose layers share one width (`hidden_size`: ViT, CLIP / SigLIP vision, DeiT...). Its
  hidden states are the tokens.
- `"backbone"`: a config transformers builds a backbone for (`AutoBackbone`: ResNet, ConvNeXt, Swin...,
  `TimmBackbone`). Stage `i` is `config.stage_names[i]` (0 is the stem); the stages fusion reads are set as the
  backbone's `out_indices`, and its `feature_maps` are read.
- `"feature_maps"`: any other vision model whose `hidden_states` are `(batch, channels, height, width)` maps
  (MobileNetV2, EfficientNet...). Stage `i` is `hidden_states[i]`; their number and widths are found by running the
  model once on the meta device (no memory, no compute).

Feature maps become tokens ([`MMFusionFeatureMapTokens`]): a 1x1 convolution to the fusion width per stage read, and
2-D positions, fixed sine embeddings added to the tokens and/or (x, y) coordinate channels appended before the
projection, so that cross-attention can find an object by where it is.
"""

import copy
import inspect
import math

import torch
from torch import nn
from transformers import AutoBackbone, AutoModel, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_BACKBONE_MAPPING, MODEL_MAPPING


POSITION_EMBEDDINGS = ("sine", "coordinates", "sine_coordinates", "sine_attention", "none")


def vision_tower_type(config: PretrainedConfig) -> str:
    """`"transformer"`, `"backbone"` or `"feature_maps"` (see the module docstring)."""
    if getattr(config, "hidden_size", None) is not None:
        return "transformer"
    try:
        MODEL_FOR_BACKBONE_MAPPING[type(config)]
        return "backbone"
    except (KeyError, ValueError):
        return "feature_maps"


def with_out_indices(config: PretrainedConfig, stages: list[int]) -> PretrainedConfig:
    """A copy of a backbone config that outputs exactly these stages (sorted, once each)."""
    config = copy.deepcopy(config)
    config.out_indices = sorted(set(stages))
    return config


def num_stages(config: PretrainedConfig) -> int:
    """How many stages a feature-map tower has: stage indices run from 0 to this minus 1."""
    if vision_tower_type(config) == "backbone":
        names = getattr(config, "stage_names", None)
        if not names:
            raise ValueError(
                f"The vision backbone config {type(config).__name__} has no `stage_names`; mm_fusion reads its stages "
                "by index. Pass the config of a transformers backbone (ResNet, ConvNeXt...)."
            )
        return len(names)
    return len(_probe_feature_maps(config))


def stage_channels(config: PretrainedConfig, stages: list[int]) -> list[int]:
    """The channels of each of these stages of a feature-map tower, in the order given."""
    if vision_tower_type(config) == "backbone":
        with torch.device("meta"):
            backbone = AutoBackbone.from_config(with_out_indices(config, stages))
        by_stage = dict(zip(sorted(set(stages)), backbone.channels))
        return [by_stage[i] for i in stages]
    channels = _probe_feature_maps(config)
    return [channels[i] for i in stages]


_PROBED: dict[str, tuple[int, ...]] = {}


def _probe_feature_maps(config: PretrainedConfig) -> tuple[int, ...]:
    """The channels of every `hidden_states` map of a vision model, from one forward pass on the meta device (cached
    per config)."""
    key = config.to_json_string()
    if key not in _PROBED:
        _PROBED[key] = _probe(config)
    return _PROBED[key]


def _probe(config: PretrainedConfig) -> tuple[int, ...]:
    with torch.device("meta"):
        model = build_tower_model(config).eval()  # eval: BatchNorm on a 1-image batch
    size = getattr(config, "image_size", 224)
    size = size if isinstance(size, int) else max(size)
    pixel_values = torch.empty(1, getattr(config, "num_channels", 3), size, size, device="meta")
    try:
        hidden_states = model(pixel_values=pixel_values, output_hidden_states=True, return_dict=True).hidden_states
    except Exception as error:  # the model's own error, named with the config that caused it
        raise ValueError(
            f"The vision tower {type(config).__name__} has no `hidden_size` and could not be probed for feature maps "
            f"({type(error).__name__}: {error})."
        ) from error
    if not hidden_states or any(h.dim() != 4 for h in hidden_states):
        raise ValueError(
            f"The vision tower {type(config).__name__} has no `hidden_size` and its `hidden_states` are not "
            "(batch, channels, height, width) feature maps, so mm_fusion cannot read it as tokens. Pass a transformer "
            "encoder config, a backbone config or a convolutional model config."
        )
    return tuple(h.shape[1] for h in hidden_states)


def image_token_count(config: PretrainedConfig, stages: list[int] | None, image_size: int) -> int:
    """
    How many image tokens the fusion reads per image at this input size: a transformer tower's sequence length, or
    the cells of the finest grid among a feature-map tower's stages read. From one forward pass on the meta device.
    """
    kind = vision_tower_type(config)
    if kind == "backbone":
        config = with_out_indices(config, stages)
    with torch.device("meta"):
        model = build_tower_model(config).eval()
    pixel_values = torch.empty(1, getattr(config, "num_channels", 3), image_size, image_size, device="meta")
    out = model(pixel_values=pixel_values, output_hidden_states=kind == "feature_maps", return_dict=True)
    if kind == "transformer":
        hidden = out.last_hidden_state
        return hidden.shape[1] if hidden.dim() == 3 else hidden.shape[-2] * hidden.shape[-1]
    maps = out.feature_maps if kind == "backbone" else [out.hidden_states[i] for i in stages]
    return max(m.shape[-2] * m.shape[-1] for m in maps)


def build_tower_model(config: PretrainedConfig) -> nn.Module:
    """The tower a config builds: `AutoBackbone` for backbone configs, else `AutoModel` without its pooler where the
    class allows it (mm_fusion pools itself)."""
    if vision_tower_type(config) == "backbone":
        return AutoBackbone.from_config(config)
    try:
        return AutoModel.from_config(config, add_pooling_layer=False)
    except TypeError:
        return AutoModel.from_config(config)


def accepts(module: nn.Module, argument: str) -> bool:
    """Whether a module's forward takes this keyword argument."""
    parameters = inspect.signature(module.forward).parameters
    return argument in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def is_vision_model_config(config: PretrainedConfig) -> bool:
    """Whether the model a config builds (its backbone or its AutoModel) takes `pixel_values` and no `input_ids`."""
    for mapping in (MODEL_FOR_BACKBONE_MAPPING, MODEL_MAPPING):
        try:
            model_class = mapping[type(config)]
        except (KeyError, ValueError):
            continue
        inputs = inspect.signature(model_class.forward).parameters
        return "pixel_values" in inputs and "input_ids" not in inputs
    return False


def sine_positions(height: int, width: int, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """
    Fixed 2-D sine / cosine position embeddings of a height x width grid, `(height * width, dim)`, row-major as
    `flatten(2)` orders feature-map tokens: half the channels encode the row, half the column, each at geometrically
    spaced frequencies over a normalised [0, 2 pi] coordinate (as DETR's sine embedding does).
    """
    if dim % 4:
        raise ValueError(f"Sine position embeddings need a width divisible by 4, got {dim}.")
    quarter = dim // 4
    frequencies = temperature ** (-torch.arange(quarter, dtype=torch.float32) / quarter)  # (dim / 4,)
    rows = (torch.arange(height, dtype=torch.float32) + 0.5) / height * 2 * math.pi
    cols = (torch.arange(width, dtype=torch.float32) + 0.5) / width * 2 * math.pi
    row_angles, col_angles = rows[:, None] * frequencies, cols[:, None] * frequencies  # (H, dim/4), (W, dim/4)
    row_part = torch.cat([row_angles.sin(), row_angles.cos()], dim=-1)[:, None, :].expand(height, width, dim // 2)
    col_part = torch.cat([col_angles.sin(), col_angles.cos()], dim=-1)[None, :, :].expand(height, width, dim // 2)
    return torch.cat([row_part, col_part], dim=-1).reshape(height * width, dim)


def coordinate_channels(features: torch.Tensor) -> torch.Tensor:
    """Two channels holding each cell's (x, y) centre in [-1, 1], for a `(batch, channels, height, width)` map."""
    batch, _, height, width = features.shape
    ys = (torch.arange(height, device=features.device, dtype=features.dtype) + 0.5) / height * 2 - 1
    xs = (torch.arange(width, device=features.device, dtype=features.dtype) + 0.5) / width * 2 - 1
    grid = torch.stack([xs[None, :].expand(height, width), ys[:, None].expand(height, width)])
    return grid[None].expand(batch, 2, height, width)


class MMFusionFeatureMapTokens(nn.Module):
    """
    Feature maps to fusion tokens: per stage read, (x, y) coordinate channels appended (`"coordinates"`), a 1x1
    convolution to `width`, resized bilinearly to the finest grid among the stages read (hierarchical fusion adds
    each stage to the same token positions), flattened row-major to `(batch, height * width, width)`, plus fixed sine
    positions (`"sine"`); `"sine_coordinates"` does both. With `"sine_attention"` the tokens leave without positions
    and the fusion adds the sine positions ([`attention_positions`]) after each of its LayerNorms that feeds an
    attention, where no LayerNorm can scale them down.
    """

    def __init__(self, channels: list[int], width: int, position_embedding: str):
        super().__init__()
        if position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"Unknown vision_position_embedding {position_embedding!r}; valid values are "
                f"{', '.join(POSITION_EMBEDDINGS)}."
            )
        self.coordinates = position_embedding in ("coordinates", "sine_coordinates")
        self.sine = position_embedding in ("sine", "sine_coordinates")
        self.in_attention = position_embedding == "sine_attention"
        extra = 2 if self.coordinates else 0
        self.projections = nn.ModuleList(nn.Conv2d(c + extra, width, kernel_size=1) for c in channels)
        self.width = width
        self._positions: dict[tuple, torch.Tensor] = {}  # per grid, device and dtype: computed once
        self._grids: dict[int, tuple[int, int]] = {}  # the grid each token count came from

    def _sine_positions(self, grid: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
        key = (grid, like.device, like.dtype)
        if key not in self._positions:
            self._positions[key] = sine_positions(*grid, self.width).to(like.device, like.dtype)
        return self._positions[key]

    def forward(self, feature_maps: list[torch.Tensor]) -> list[torch.Tensor]:
        grid = max((tuple(f.shape[-2:]) for f in feature_maps), key=lambda size: size[0] * size[1])
        self._grids[grid[0] * grid[1]] = grid
        positions = self._sine_positions(grid, feature_maps[0]) if self.sine else None
        tokens = []
        for projection, features in zip(self.projections, feature_maps):
            if self.coordinates:
                features = torch.cat([features, coordinate_channels(features)], dim=1)
            projected = projection(features)
            if tuple(projected.shape[-2:]) != grid:
                projected = nn.functional.interpolate(projected, size=grid, mode="bilinear", align_corners=False)
            sequence = projected.flatten(2).transpose(1, 2)
            tokens.append(sequence + positions if positions is not None else sequence)
        return tokens

    def attention_positions(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """
        With `"sine_attention"`, the `(P, width)` sine positions of `tokens` (`(M, P, width)`, made by this module:
        their grid is the one `P` cells came from, or a square one); `None` otherwise.
        """
        if not self.in_attention:
            return None
        count = tokens.shape[1]
        grid = self._grids.get(count)
        if grid is None:
            side = round(count**0.5)
            if side * side != count:
                raise ValueError(
                    f"Image features of {count} tokens: not a square grid, and not a grid this model's tower made. "
                    "Pass the features the model's own `vision_encoder` / `encode` returned."
                )
            grid = (side, side)
        return self._sine_positions(grid, tokens)


class MMFusionConvStem(nn.Module):
    """
    A convolutional stem in place of a vision transformer's patchify: stride-2 3x3 convolutions, each followed by
    BatchNorm and ReLU, then a convolution of the remaining stride to the tower's width. The same `(batch, width,
    height / patch_size, width / patch_size)` grid as the patch convolution it replaces, so the tower's position
    embeddings and everything after them are unchanged ("Early convolutions help transformers see better",
    arXiv:2106.14881).
    """

    def __init__(self, in_channels: int, channels: list[int], out_channels: int, patch_size: int):
        super().__init__()
        stride = 2 ** len(channels)
        if not channels or patch_size % stride:
            raise ValueError(
                f"vision_conv_stem {channels} has {len(channels)} stride-2 convolutions (stride {stride}), which "
                f"must divide the tower's patch_size {patch_size}."
            )
        layers = []
        for width in channels:
            layers.append(
                nn.Sequential(
                    nn.Conv2d(in_channels, width, kernel_size=3, stride=2, padding=1, bias=False),
                    nn.BatchNorm2d(width),
                    nn.ReLU(inplace=True),
                )
            )
            in_channels = width
        self.layers = nn.Sequential(*layers)
        rest = patch_size // stride
        self.projection = nn.Conv2d(in_channels, out_channels, kernel_size=rest, stride=rest)

    @property
    def weight(self) -> torch.Tensor:
        """The last convolution's weight: towers read their patch convolution's `weight.dtype` to cast the pixels."""
        return self.projection.weight

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.projection(self.layers(pixel_values))


def install_conv_stem(tower: nn.Module, config: PretrainedConfig, channels: list[int]) -> None:
    """Replace the tower's patch-embedding convolution (kernel and stride `patch_size`, from the image channels)
    with an [`MMFusionConvStem`]."""
    patch = getattr(config, "patch_size", None)
    patch = patch if isinstance(patch, int) or patch is None else patch[0]
    in_channels = getattr(config, "num_channels", 3)
    found = [
        (name, module)
        for name, module in tower.named_modules()
        if isinstance(module, nn.Conv2d)
        and module.in_channels == in_channels
        and module.kernel_size == (patch, patch)
        and module.stride == (patch, patch)
    ]
    if patch is None or len(found) != 1:
        raise ValueError(
            f"vision_conv_stem replaces the patch-embedding convolution of a vision transformer tower, but "
            f"{type(tower).__name__} has {len(found)} convolutions with kernel and stride patch_size={patch}."
        )
    name, patchify = found[0]
    parent = tower.get_submodule(name.rpartition(".")[0]) if "." in name else tower
    stem = MMFusionConvStem(in_channels, list(channels), patchify.out_channels, patch)
    setattr(parent, name.rpartition(".")[2], stem)


def film_stages(tower: nn.Module, config: PretrainedConfig) -> nn.ModuleList:
    """
    The modules whose outputs are a backbone / convolutional tower's stages after the stem: the tower's
    `nn.ModuleList` with one entry per such stage (ResNet's and ConvNeXt's `encoder.stages`, MobileNetV2's `layer`).
    """
    count = num_stages(config) - (1 if vision_tower_type(config) == "backbone" else 0)
    found = [m for m in tower.modules() if isinstance(m, nn.ModuleList) and len(m) == count]
    if len(found) != 1:
        raise ValueError(
            f"vision_film / vision_text_attention condition each stage of the vision tower, found as its one module "
            f"list with an entry per stage after the stem ({count}); {type(tower).__name__} has {len(found)} such "
            "lists."
        )
    return found[0]


def early_stage_parameters(tower: nn.Module, config: PretrainedConfig, count: int) -> list[nn.Parameter]:
    """
    The parameters that compute a backbone / convolutional tower's first `count` stages (indices `0 .. count - 1`, as
    `vision_stages` counts them): those registered before its stage list ([`film_stages`]: the stem, ResNet's
    embedder, MobileNetV2's `conv_stem`) and those of the list's entries up to stage `count - 1`.
    """
    if vision_tower_type(config) == "transformer":
        raise ValueError(
            f"Freezing the first stages is for a backbone / convolutional vision tower; {type(tower).__name__} is a "
            "transformer tower (freeze it whole, or adapt it with --lora)."
        )
    total = num_stages(config)
    if not 1 <= count <= total:
        raise ValueError(
            f"The vision tower has stages 0 to {total - 1}: the first 1 to {total} can be frozen, not {count}."
        )
    stages = film_stages(tower, config)
    offset = 1 if vision_tower_type(config) == "backbone" else 0  # a backbone's stage 0 is its stem
    in_list = {id(p) for p in stages.parameters()}
    later = {id(p) for entry in stages[count - offset :] for p in entry.parameters()}
    found, before_list = [], True
    for parameter in tower.parameters():  # in registration order: the stem's come before the list's
        before_list = before_list and id(parameter) not in in_list
        if before_list or (id(parameter) in in_list and id(parameter) not in later):
            found.append(parameter)
    return found


class MMFusionFiLMLinear(nn.Linear):
    """A FiLM map (text to scale and shift): a linear layer that the models initialise to zero."""


class MMFusionVisionFiLM(nn.Module):
    """
    Feature-wise linear modulation of a vision tower by the text (FiLM, arXiv:1709.07871): per stage after the stem, a
    linear map of the pooled text gives a per-channel scale and shift, and the stage's output `h` becomes
    `h * (1 + scale) + shift`. The maps start at zero (the unconditioned tower). Forward hooks on the stage modules
    apply them, so the tower's own modules and weight names are unchanged (pretrained towers load as they are).
    """

    def __init__(self, stages: nn.ModuleList, channels: list[int], text_width: int):
        super().__init__()
        self.maps = nn.ModuleList(MMFusionFiLMLinear(text_width, 2 * c) for c in channels)
        self._condition: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._image_index: torch.Tensor | None = None
        for index, stage in enumerate(stages):
            stage.register_forward_hook(_StageHook(self, index))

    def conditioned(self, text: torch.Tensor, image_index: torch.Tensor | None = None) -> "_Conditioned":
        """A context in which the tower's stages are modulated by `text`, `(batch, text_width)`: one row per image,
        or, with `image_index` (each text's image), the stem runs once per image and the stages once per text."""
        modulation = []
        for layer in self.maps:
            scale, shift = layer(text)[:, :, None, None].chunk(2, dim=1)
            modulation.append((scale, shift))
        return _Conditioned(self, modulation, image_index)

    def condition_stage(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        scale, shift = self._condition[index]
        return hidden * (1 + scale) + shift


class _StageHook:
    """The forward hook of one stage: an object rather than a closure, so that `copy.deepcopy` of a model gives the
    copy's hooks the copy's conditioning module (a closure would keep conditioning through the original's)."""

    def __init__(self, owner: nn.Module, index: int):
        self.owner, self.index = owner, index

    def __call__(self, module, args, output):
        if self.owner._condition is None:  # the tower run without a text (not through `conditioned`)
            return output
        hidden = output[0] if isinstance(output, tuple) else output
        if self.index == 0 and self.owner._image_index is not None:
            # Everything up to here (the stem and the stages to this first conditioned one) saw no text: it ran once
            # per distinct image, and its output now becomes one row per text, which the stages from here on condition
            # on their own text.
            hidden = hidden[self.owner._image_index]
        hidden = self.owner.condition_stage(self.index, hidden)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


class _Conditioned:
    """The context of `conditioned`: the tower's stage hooks read `condition` (and `image_index`) while it is open."""

    def __init__(self, owner: nn.Module, condition, image_index: torch.Tensor | None = None):
        self.owner, self.condition, self.image_index = owner, condition, image_index

    def __enter__(self):
        self.owner._condition, self.owner._image_index = self.condition, self.image_index

    def __exit__(self, *exc):
        self.owner._condition = self.owner._image_index = None


class MMFusionStageRead(nn.Module):
    """
    One stage's read of the text: the stage's cells (LayerNorm over channels, then a query each) attend over the
    text's tokens, and what each cell reads, projected back to the stage's channels, is added to it.
    """

    def __init__(self, channels: int, text_width: int, num_heads: int):
        super().__init__()
        if text_width % num_heads:
            raise ValueError(f"The text width {text_width} is not a multiple of the {num_heads} heads that read it.")
        self.num_heads = num_heads
        self.norm = nn.LayerNorm(channels)
        self.query = nn.Linear(channels, text_width)
        self.key = nn.Linear(text_width, text_width)
        self.value = nn.Linear(text_width, text_width)
        self.output = nn.Linear(text_width, channels)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

    def _factored_pays(self, cells: int, channels: int, tokens: int) -> bool:
        """
        Whether [`_factored`] is the faster way to this read: when it needs at most 3/4 of the multiply-adds of the
        projected attention (a query and an output projection per cell, through SDPA). Where the two cross was
        measured on a 2-core CPU (scripts/benchmarks/results/profile_training_step.md, "the reads").
        """
        width = self.query.out_features
        projected = 2 * cells * width * (channels + tokens)
        factored = 2 * tokens * width * channels + 2 * cells * channels * self.num_heads * tokens
        return 4 * factored <= 3 * projected

    def _factored(
        self, cells: torch.Tensor, text: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """
        The read with the projections moved to the text's side. A cell's score for token t in head h is
        `(W_q cell + b_q)_h . k_th / sqrt(d) = cell . (W_q,h^T k_th) / sqrt(d) + b_q,h . k_th / sqrt(d)`, and what it
        reads, projected out, is `sum_t a_th W_o,h v_th`: so each (head, token) gets a key and a value in the cells'
        own channels, computed once per text, and the cells need two batched products, no per-cell projection. The
        softmax runs over the tokens with the cells innermost (over a last dimension of ~12 tokens a CPU runs it row
        by row, about 20x slower). Returns the attention `(batch, heads * tokens, cells)` and the values `(batch, heads
        * tokens, channels)`, from `cells` `(batch, cells, channels)` (normed).
        """
        batch, length, channels = cells.shape
        heads, tokens = self.num_heads, text.shape[1]
        key = self.key(text).unflatten(-1, (heads, -1))  # (batch, tokens, heads, head_dim)
        key = key * key.shape[-1] ** -0.5
        query_weight = self.query.weight.unflatten(0, (heads, -1))  # (heads, head_dim, channels)
        keys = torch.einsum("bthj,hjc->bhtc", key, query_weight).reshape(batch, heads * tokens, channels)
        bias = torch.einsum("bthj,hj->bht", key, self.query.bias.unflatten(0, (heads, -1)))  # (batch, heads, tokens)
        if mask is not None:
            bias = bias.masked_fill(~mask.view(batch, 1, tokens), float("-inf"))  # mask: (batch, 1, 1, tokens)
        scores = torch.baddbmm(bias.reshape(batch, heads * tokens, 1), keys, cells.transpose(1, 2))
        attention = scores.unflatten(1, (heads, tokens)).softmax(2).flatten(1, 2)  # (batch, heads * tokens, cells)
        value = self.value(text).unflatten(-1, (heads, -1))  # (batch, tokens, heads, head_dim)
        output_weight = self.output.weight.unflatten(1, (heads, -1))  # (channels, heads, head_dim)
        values = torch.einsum("bthj,chj->bhtc", value, output_weight).reshape(batch, heads * tokens, channels)
        return attention, values

    def _cells(self, hidden: torch.Tensor) -> torch.Tensor:
        """`(batch, channels, height, width)` to normed cells `(batch, height * width, channels)` (no copy for a
        channels-last map)."""
        return self.norm(hidden.flatten(2).transpose(1, 2))

    def probabilities(self, hidden: torch.Tensor, text: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The attention each cell reads the text with, `(batch, heads, height * width, tokens)`."""
        attention = self._factored(self._cells(hidden), text, mask)[0]
        return attention.unflatten(1, (self.num_heads, -1)).float().transpose(-1, -2)

    def forward(self, hidden: torch.Tensor, text: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, channels, height, width = hidden.shape
        cells = self._cells(hidden)  # (batch, height * width, channels)
        # An exported graph serves every text length, so it takes one way for all (the projected one): a choice by the
        # length would be a guard on the graph's dynamic sequence dimension.
        if not torch.compiler.is_exporting() and self._factored_pays(height * width, channels, text.shape[1]):
            attention, values = self._factored(cells, text, mask)
            read = torch.baddbmm(self.output.bias, attention.transpose(1, 2), values)  # (batch, cells, channels)
        else:
            query, key, value = (
                self._heads(self.query(cells)),
                self._heads(self.key(text)),
                self._heads(self.value(text)),
            )
            read = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
            read = self.output(read.transpose(1, 2).flatten(2))  # (batch, height * width, channels)
        return hidden + read.transpose(1, 2).reshape(batch, channels, height, width)


class MMFusionVisionCrossAttention(nn.Module):
    """
    A vision tower conditioned on the text by cross-attention: per stage after the stem, every cell of the stage's map
    reads the text's tokens with a query from its own channels ([`MMFusionStageRead`]), and the read is added to it
    before the next stage. Unlike FiLM, whose one scale and shift serve every cell, each cell reads for itself: the
    cells of an object the question names can take the naming word's value and the others not, so the convolutions
    after the read see where that object is. Forward hooks on the stage modules apply the reads, as for FiLM.
    """

    def __init__(
        self, stages: nn.ModuleList, channels: list[int], text_width: int, num_heads: int, first_stage: int = 0
    ):
        super().__init__()
        # Stages from `first_stage` on (0 = every stage after the stem) read; `reads[k]` is stage `first_stage + k`'s.
        self.first_stage = first_stage
        self.reads = nn.ModuleList(MMFusionStageRead(c, text_width, num_heads) for c in channels[first_stage:])
        self._condition: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._image_index: torch.Tensor | None = None
        # Set to a list to record each stage's read probabilities and grid (image_maps' "tower_attention" maps).
        self.recorded: list[tuple[torch.Tensor, tuple[int, int]]] | None = None
        # Set to a list to record each stage's map before and after its read (image_maps' "guided_gradient" weights the
        # pixels by where the first read's contribution moves the answer).
        self.read_outputs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        for index, stage in enumerate(list(stages)[first_stage:]):
            stage.register_forward_hook(_StageHook(self, index))

    def conditioned(
        self, text: torch.Tensor, attention_mask: torch.Tensor | None = None, image_index: torch.Tensor | None = None
    ) -> _Conditioned:
        """A context in which the tower's stages read `text`, `(batch, tokens, text_width)`, whose padding
        `attention_mask` marks with 0: one row per image, or, with `image_index` (each text's image), the stem runs
        once per image and the stages once per text."""
        mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        return _Conditioned(self, (text, mask), image_index)

    def condition_stage(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        text, mask = self._condition
        if self.recorded is not None:
            self.recorded.append((self.reads[index].probabilities(hidden, text, mask), tuple(hidden.shape[-2:])))
        output = self.reads[index](hidden, text, mask)
        if self.read_outputs is not None:
            self.read_outputs.append((hidden, output))
        return output
