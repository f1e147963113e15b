"""[`MMFusionVisionEncoder`]: the image side of [`MMFusionModel`], from `pixel_values` to the tokens fusion reads."""

import contextlib

import torch
from torch import nn
from transformers.utils import ModelOutput

from .configuration_mm_fusion import WORDS, MMFusionConfig
from .vision_towers import (
    MMFusionFeatureMapTokens,
    MMFusionVisionCrossAttention,
    MMFusionVisionFiLM,
    accepts,
    build_tower_model,
    film_stages,
    install_conv_stem,
    num_stages,
    stage_channels,
)


def normalize_uint8_pixels(
    pixel_values: torch.Tensor, mean: list[float], std: list[float], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`(pixel_values / 255 - mean) / std` per channel, computed as one fused multiply-add on the tensor's device."""
    std64 = torch.tensor(std, dtype=torch.float64)
    scale = (1.0 / (255.0 * std64)).view(1, -1, 1, 1).to(pixel_values.device, torch.float32)
    shift = (-torch.tensor(mean, dtype=torch.float64) / std64).view(1, -1, 1, 1).to(pixel_values.device, torch.float32)
    return torch.addcmul(shift, pixel_values.to(torch.float32), scale).to(dtype)


def sequence(hidden: torch.Tensor) -> torch.Tensor:
    """Flatten a (B, C, H, W) feature map to (B, H*W, C); sequences pass through."""
    return hidden.flatten(2).transpose(1, 2) if hidden.dim() == 4 else hidden


def pool(hidden: torch.Tensor, mask: torch.Tensor | None, mode: str) -> torch.Tensor:
    """Pool (B, T, D) to (B, D): the first token, or the mean over positions where `mask` is 1."""
    if mode == "cls":
        return hidden[:, 0]
    if mask is None:
        return hidden.mean(dim=1)
    mask = mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def bridge_features(
    tower_out: ModelOutput, layers: list[int | str], words: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Tower hidden states at the bridge layers (the last read after the tower's final norm); `words`, the word
    embeddings, where a text bridge is `"words"` (the hidden states may then be absent)."""
    hidden_states = tower_out.hidden_states
    last = len(hidden_states) - 1 if hidden_states is not None else None
    return [
        words if i == WORDS else sequence(tower_out.last_hidden_state if i == last else hidden_states[i])
        for i in layers
    ]


class MMFusionVisionEncoder(nn.Module):
    """
    The image side of [`MMFusionModel`], held as its `vision_encoder`: uint8 pixels normalised on the model's device,
    the vision tower `vision_model` (with its convolutional stem, `config.vision_conv_stem`), the image tokens the
    fusion block reads (a transformer tower's hidden states; a backbone / convolutional tower's feature maps at
    `config.vision_stages`, projected with positions by `feature_map_tokens`, an [`MMFusionFeatureMapTokens`]), and the
    tower's conditioning on the text (`config.vision_film`: `vision_film`, an [`MMFusionVisionFiLM`];
    `config.vision_text_attention`: `vision_text_attention`, an [`MMFusionVisionCrossAttention`]).

    Its forward runs the tower on images alone; [`per_text`] runs it conditioned on each text. Directories saved before
    it was a submodule name its parameters without the `vision_encoder.` prefix: transformers' checkpoint conversion
    (`SAVED_NAMES` in modeling_mm_fusion.py) maps them on load, and back on save.

    Args:
        config ([`MMFusionConfig`]):
            The model's configuration (its `vision_config`, and the settings named above).

    Example:

    ```python
    >>> import torch
    >>> from mm_fusion import MMFusionConfig, MMFusionModel

    >>> model = MMFusionModel(MMFusionConfig()).eval()
    >>> pixels = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8)
    >>> vision_out, features = model.vision_encoder(pixels)  # one token map per bridge layer
    >>> features[-1].shape
    torch.Size([2, 197, 384])
    ```
    """

    def __init__(self, config: MMFusionConfig):
        super().__init__()
        self.config = config
        self.vision_model = build_tower_model(config.vision_config)
        self.vision_model.config = config.vision_config  # shared, so that changes through either path are seen by both
        if config.vision_conv_stem:
            install_conv_stem(self.vision_model, config.vision_config, config.vision_conv_stem)
        self._takes_attentions = accepts(self.vision_model, "output_attentions")
        # Derived from the vision config (a feature-map tower's stages by probing it): found once, not per forward.
        self.tower_type, self.stages = config.vision_tower_type, config.vision_stages
        # A backbone / convolutional tower's feature maps become tokens of the fusion width.
        self.feature_map_tokens = None
        if self.tower_type != "transformer":
            channels = stage_channels(config.vision_config, self.stages)
            self.feature_map_tokens = MMFusionFeatureMapTokens(
                channels, config.vision_hidden_size, config.vision_position_embedding
            )
        # The text conditions every stage after the stem of a backbone / convolutional tower (one tower run per pair):
        # FiLM scales and shifts each stage, or each cell of each stage reads the text's tokens by cross-attention.
        self.vision_film = self.vision_text_attention = None
        if config.vision_film or config.vision_text_attention:
            count = num_stages(config.vision_config)
            stages = list(range(1, count)) if self.tower_type == "backbone" else list(range(count))
            conditioned = film_stages(self.vision_model, config.vision_config)
            channels = stage_channels(config.vision_config, stages)
            text = config.text_config
            if config.vision_film:
                self.vision_film = MMFusionVisionFiLM(conditioned, channels, text.hidden_size)
            else:
                self.vision_text_attention = MMFusionVisionCrossAttention(
                    conditioned,
                    channels,
                    text.hidden_size,
                    text.num_attention_heads,
                    first_stage=config.vision_text_attention_from_stage - 1,
                )

    @property
    def text_conditions_vision(self) -> bool:
        """Whether the vision tower runs conditioned on each text (`vision_film` / `vision_text_attention`): it then
        runs once per pair, and an image has no features without a text."""
        return self.vision_film is not None or self.vision_text_attention is not None

    def conditioned_on(
        self, text_hidden: torch.Tensor, attention_mask: torch.Tensor | None, image_index: torch.Tensor | None = None
    ):
        """A context in which the vision tower runs conditioned on these texts: on one image per text, or, with
        `image_index` (each text's image), on the distinct images, whose stem and stages up to the first conditioned
        one then run once per image and the conditioned stages once per text. No condition when the model has none."""
        if self.vision_film is not None:
            text = pool(text_hidden, attention_mask, self.config.pooling_mode)
            return self.vision_film.conditioned(text, image_index)
        if self.vision_text_attention is not None:
            return self.vision_text_attention.conditioned(text_hidden, attention_mask, image_index)
        return contextlib.nullcontext()

    def per_text(
        self,
        pixel_values: torch.Tensor,
        text_hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        image_index: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> tuple[ModelOutput, list[torch.Tensor]]:
        """
        The forward for a tower conditioned on each text (`vision_film` / `vision_text_attention`): the image features
        are one per text. What runs up to the first conditioned stage (the stem, the first stage, and with
        `vision_text_attention_from_stage` > 1 the stages before it) does not depend on the text, so when texts share
        images (`image_index`, fewer images than texts: an image-grouped batch) it runs once per distinct image and
        its output is expanded to the texts; its maps in the output (hidden states, a feature map read from them) are
        expanded the same way.
        """
        shared = image_index is not None and len(pixel_values) < len(image_index)
        if image_index is not None and not shared:
            pixel_values = pixel_values[image_index]  # no image is repeated: nothing to share
        with self.conditioned_on(text_hidden, attention_mask, image_index if shared else None):
            vision_out, image_features = self(pixel_values, output_attentions, output_hidden_states)
        if not shared:
            return vision_out, image_features

        def expand(value):  # a tower output made before the expansion has one row per image
            if isinstance(value, torch.Tensor) and value.dim() > 0 and len(value) == len(pixel_values):
                return value[image_index]
            return tuple(expand(v) for v in value) if isinstance(value, tuple) else value

        for key, value in vision_out.items():
            vision_out[key] = expand(value)
        return vision_out, [expand(f) for f in image_features]

    def normalize_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """
        uint8 images in [0, 255] (as the data collator delivers them, 4x less to copy to the device than float) are
        scaled and normalised with the config's `image_mean` / `image_std` here, on the model's device, once per
        batch; other integer types must hold 0-255 values too. Float `pixel_values` are taken as already normalised
        and pass through unchanged.
        """
        if pixel_values.is_floating_point():
            return pixel_values
        if pixel_values.dtype != torch.uint8:
            # Integer pixels of another type (e.g. int64 from numpy) are 0-255 values too, not normalised ones.
            low, high = int(pixel_values.min()), int(pixel_values.max())
            if low < 0 or high > 255:
                raise ValueError(
                    f"Integer pixel_values ({pixel_values.dtype}) are read as 0-255 pixel values, but they range over "
                    f"[{low}, {high}]. Pass uint8 images, or normalised float ones."
                )
            pixel_values = pixel_values.to(torch.uint8)
        config = self.config
        return normalize_uint8_pixels(pixel_values, config.image_mean, config.image_std, self.vision_model.dtype)

    def forward(
        self, pixel_values: torch.Tensor, output_attentions: bool = False, output_hidden_states: bool = False
    ) -> tuple[ModelOutput, list[torch.Tensor]]:
        """
        Run the vision tower: its output, and the image tokens the fusion block reads (one `(M, P,
        config.vision_hidden_size)` tensor per bridge layer for `"hierarchical"`, else the last one). The tokens of a
        transformer tower are its hidden states; those of a backbone / convolutional tower are its feature maps at
        `config.vision_stages`, projected with positions ([`MMFusionFeatureMapTokens`]). The last tensor is the one
        the image embedding pools.
        """
        hierarchical = self.config.fusion_type == "hierarchical"
        pixel_values = self.normalize_pixels(pixel_values)
        if self.tower_type == "transformer":
            vision_out = self.vision_model(
                pixel_values=pixel_values,
                output_attentions=output_attentions,
                output_hidden_states=hierarchical or output_hidden_states,
                return_dict=True,
            )
            if hierarchical:
                return vision_out, bridge_features(vision_out, self.config.vision_bridge_layers)
            return vision_out, [sequence(vision_out.last_hidden_state)]
        kwargs = {"output_attentions": output_attentions} if self._takes_attentions else {}
        # Channels-last maps: convolutions and BatchNorm run faster on them (oneDNN on CPUs, tensor cores on GPUs), and
        # a stage's cells flatten to (batch, cells, channels) rows without a copy for the reads and the tokens.
        pixel_values = pixel_values.contiguous(memory_format=torch.channels_last)
        # A backbone returns the maps of its `out_indices` (the stages read); another model all its hidden states.
        vision_out = self.vision_model(
            pixel_values=pixel_values,
            output_hidden_states=output_hidden_states or self.tower_type == "feature_maps",
            return_dict=True,
            **kwargs,
        )
        return vision_out, self.feature_map_tokens(self.stage_maps(vision_out))

    def stage_maps(self, vision_out: ModelOutput) -> list[torch.Tensor]:
        """A backbone / convolutional tower's feature maps at `config.vision_stages`, in that order."""
        if self.tower_type == "backbone":  # `feature_maps` are the stages read, sorted, once each
            by_stage = dict(zip(sorted(set(self.stages)), vision_out.feature_maps))
            return [by_stage[i] for i in self.stages]
        return [vision_out.hidden_states[i] for i in self.stages]
