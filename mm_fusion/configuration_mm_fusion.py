"""MMFusion model configuration."""

import inspect
import os

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from .custom_pipelines import save_custom_pipelines, served_here
from .vision_towers import (
    POSITION_EMBEDDINGS,
    image_token_count,
    is_vision_model_config,
    num_stages,
    vision_tower_type,
    with_out_indices,
)


FUSION_TYPES = ("hierarchical", "cross_attention", "late")
FUSION_DIRECTIONS = ("bidirectional", "text_to_image")
POOLING_MODES = ("mean", "cls")
IMAGE_POOLING = ("mean", "cls", "flatten")
JOINT_POOLING = ("concat", "concat_product", "text")
INIT_SCHEMES = ("normal", "pytorch")
# The two settings `init_scheme` replaces, still read from configs saved with them: their values, and the scheme each
# "pytorch" gives.
FILM_INITS = ("zeros", "pytorch")
FUSION_INITS = ("normal", "pytorch")
FUSION_LAYER_ORDERS = ("cross_first", "self_first")
# A text bridge on the text tower's word embeddings alone (its `get_input_embeddings()`, without positions).
WORDS = "words"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Small towers that train from scratch on a laptop; users pass their own configs for anything real.
DEFAULT_VISION_CONFIG = {
    "model_type": "vit",
    "image_size": 224,
    "patch_size": 16,
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "intermediate_size": 1536,
}
DEFAULT_TEXT_CONFIG = {
    "model_type": "bert",
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "intermediate_size": 1536,
}


def _as_config(config: PreTrainedConfig | dict | None, default: dict, name: str) -> PreTrainedConfig:
    """Turn a sub-config given as `None`, a dict (with `model_type`) or a config object into a config object."""
    if config is None:
        config = dict(default)
    if isinstance(config, PreTrainedConfig):
        return config
    if not isinstance(config, dict):
        raise TypeError(f"`{name}` must be a transformers config, a dict or None, got {type(config).__name__}.")
    config = dict(config)
    model_type = config.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"`{name}` given as a dict needs a `model_type` key (e.g. 'vit' or 'bert'), got {config}.")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"`{name}` has model_type {model_type!r}, which transformers does not know.")
    return CONFIG_MAPPING[model_type](**config)


def _check_tower_config(config: PreTrainedConfig, role: str) -> None:
    """Refuse a tower config whose model is not an encoder of the right modality."""
    name = f"{role}_config"
    if role == "vision" and vision_tower_type(config) != "transformer" and is_vision_model_config(config):
        return  # a backbone / convolutional tower: its feature maps become tokens (vision_towers.py)
    try:
        model_class = MODEL_MAPPING[type(config)]
    except (KeyError, ValueError):
        raise ValueError(
            f"`{name}` is a {type(config).__name__}, which has no AutoModel class; "
            "register one with AutoModel.register or pass a transformers encoder config."
        ) from None
    inputs = inspect.signature(model_class.forward).parameters
    wanted, other = ("pixel_values", "input_ids") if role == "vision" else ("input_ids", "pixel_values")
    if wanted not in inputs or other in inputs:
        hint = (
            " For a dual encoder such as CLIP or SigLIP, pass its vision/text sub-config." if other in inputs else ""
        )
        raise ValueError(
            f"`{name}` must be a {role} encoder config whose model takes `{wanted}` only, but "
            f"{type(config).__name__} builds {model_class.__name__}.{hint}"
        )
    if getattr(config, "hidden_size", None) is None:
        kinds = "encoder" if role == "text" else "encoder, backbone or convolutional"
        raise ValueError(
            f"`{name}` ({type(config).__name__}) has no `hidden_size`; mm_fusion fuses {role} {kinds} towers."
        )


def _per_channel(value: list | tuple | float | int | None, default: tuple, num_channels: int) -> list[float]:
    """A per-channel normalisation setting as a list of floats: the default, or one number for every channel."""
    if value is None:
        value = default
    if isinstance(value, (int, float)):
        value = [value] * num_channels
    return [float(x) for x in value]


def _init_scheme(init_scheme: str | None, fusion_init: str | None, vision_film_init: str | None) -> str:
    """`init_scheme`, or the scheme of the two settings it replaced (`fusion_init`, `vision_film_init`), which configs
    saved with them still carry: `"pytorch"` where either is `"pytorch"`."""
    if fusion_init is not None and fusion_init not in FUSION_INITS:
        raise ValueError(f"Unknown fusion_init {fusion_init!r}; valid values are {', '.join(FUSION_INITS)}.")
    if vision_film_init is not None and vision_film_init not in FILM_INITS:
        raise ValueError(f"Unknown vision_film_init {vision_film_init!r}; valid values are {', '.join(FILM_INITS)}.")
    if init_scheme is not None and init_scheme not in INIT_SCHEMES:
        raise ValueError(f"Unknown init_scheme {init_scheme!r}; valid values are {', '.join(INIT_SCHEMES)}.")
    if fusion_init is None and vision_film_init is None:
        return init_scheme or "normal"
    earlier = "pytorch" if "pytorch" in (fusion_init, vision_film_init) else "normal"
    if init_scheme is not None and init_scheme != earlier:
        raise ValueError(
            f"init_scheme={init_scheme!r} and fusion_init={fusion_init!r} / vision_film_init={vision_film_init!r} "
            "disagree: init_scheme replaces the two, give it alone."
        )
    return earlier


@strict
class MMFusionConfig(PreTrainedConfig):
    r"""
    Configuration of an image-text fusion model: a vision tower, a text tower (any transformers encoder configs) and
    the block that fuses them.

    Args:
        vision_config (`PreTrainedConfig` or `dict`, *optional*):
            Config of the vision tower: a transformer encoder (e.g. `ViTConfig`, `CLIPVisionConfig`,
            `SiglipVisionConfig`), a backbone (`ResNetConfig`, `ConvNextConfig`..., built with `AutoBackbone`) or a
            convolutional model (`MobileNetV2Config`...), whose feature maps become tokens (see
            `vision_position_embedding`). Defaults to a small ViT.
        text_config (`PreTrainedConfig` or `dict`, *optional*):
            Config of the text tower (e.g. `BertConfig`, `RobertaConfig`). Defaults to a small BERT.
        fusion_type (`str`, *optional*, defaults to `"hierarchical"`):
            `"hierarchical"`: co-attention layers, each fed through a bridge from a different tower layer
            (BridgeTower-like); `"cross_attention"`: a stack of co-attention layers on the towers' final features;
            `"late"`: no cross-modal attention, pooled tower features and projections only (dual encoder).
        fusion_direction (`str`, *optional*, defaults to `"bidirectional"`):
            `"bidirectional"`: co-attention, text attends to image and image to text in every fusion layer;
            `"text_to_image"`: only the text attends to the image (the image stream is bridged but not updated), so
            the image keys / values are computed once per image and shared by all its texts: with batches grouped by
            image (several questions per image) the fusion costs a fraction.
        fusion_layer_order (`str`, *optional*, defaults to `"self_first"`):
            The order of the two attentions in each fusion layer's streams. `"self_first"`: self-attention,
            cross-attention, MLP (the order of a BERT decoder layer; a saved config without this field loads with
            it). `"cross_first"`: each token reads the other modality with its query as the layer's input leaves it,
            then the tokens attend to each other, then the MLP. With `"cross_first"` and the first text bridge on the
            word embeddings (`text_bridge_layers=["words", ...]`), each word reads the image with a query of its own,
            the same in every sentence it is in, so that a read learned for one question serves the others: use it
            when the texts name what to look at by single words (`scripts/configs/sort_of_clevr_hierarchical.yaml`
            sets both).
        num_fusion_layers (`int`, *optional*, defaults to 2):
            Number of co-attention layers (ignored by `"late"`).
        fusion_hidden_size (`int`, *optional*):
            Width of the fusion layers. Defaults to the text tower's `hidden_size`.
        fusion_num_attention_heads (`int`, *optional*):
            Attention heads in each fusion attention. Defaults to the text tower's `num_attention_heads`.
        fusion_intermediate_size (`int`, *optional*):
            Width of the fusion feed-forward layers. Defaults to `4 * fusion_hidden_size`.
        vision_bridge_layers (`list[int]`, *optional*):
            For `"hierarchical"`: which vision tower hidden states (0 = embeddings, `num_hidden_layers` = last layer)
            feed the fusion layers, one per fusion layer. Defaults to the last `num_fusion_layers` layers. For a
            backbone / convolutional tower these are stages: `stage_names[i]` of a backbone (0 = its stem), or
            `hidden_states[i]` of another convolutional model. Only `"hierarchical"` reads them: the other fusion
            types read the towers' final features (a feature-map tower's last stage) and raise an error when they are
            set.
        text_bridge_layers (`list[int | str]`, *optional*):
            The same for the text tower (0 = its embeddings, word and position). An entry may also be `"words"`: the
            tower's word embeddings alone (`get_input_embeddings()`, no positions), so that each word's query is its
            own wherever it stands and whatever the sentence around it (see `fusion_layer_order`). `"hierarchical"`
            only, as `vision_bridge_layers`.
        fusion_dropout (`float`, *optional*, defaults to 0.1):
            Dropout on the fusion layers' residual branches.
        fusion_attention_dropout (`float`, *optional*, defaults to 0.0):
            Dropout on the fusion attention probabilities.
        hidden_act (`str`, *optional*, defaults to `"gelu"`):
            Activation of the fusion feed-forward layers and heads.
        layer_norm_eps (`float`, *optional*, defaults to 1e-6):
            Epsilon of the fusion layer norms.
        vision_position_embedding (`str`, *optional*, defaults to `"sine"`):
            How the tokens of a backbone / convolutional tower know where they are: `"sine"` (fixed 2-D sine
            embeddings added after the 1x1 projection to `fusion_hidden_size`), `"coordinates"` ((x, y) channels
            appended to the feature map before it), `"sine_coordinates"` (both), `"sine_attention"` (the same sine
            embeddings, added inside the fusion after each LayerNorm that feeds an attention, to the keys and values
            the text reads, so that no LayerNorm scales an object's position down beside its features; late fusion
            has no attention to add them to) or `"none"`. Transformer towers keep their own position embeddings.
        feature_map_bridge (`bool`, *optional*, defaults to `True`):
            Whether a backbone / convolutional tower's tokens pass through the fusion's image bridge (a linear map to
            `fusion_hidden_size`) after their own 1x1 projection to that width. `False` feeds them to the fusion as
            projected (plus positions), one linear map fewer between the feature map and the attention
            (`scripts/train.py` sets it for a convolutional tower trained from scratch with cross-attention fusion and
            a classification head). Transformer towers always have their bridge.
        vision_conv_stem (`list[int]`, *optional*):
            Widths of stride-2 3x3 convolutions (each with BatchNorm and ReLU) that replace the patch-embedding
            convolution of a transformer vision tower, followed by a convolution of the remaining stride to its width:
            `[32, 64, 128]` with `patch_size=8` gives the same 8x8-pixel tokens from a convolutional stem.
        vision_film (`bool`, *optional*, defaults to `False`):
            Condition a backbone / convolutional vision tower on the text (FiLM, arXiv:1709.07871): the output of every
            stage after the stem is scaled and shifted per channel by a linear map of the pooled text (initialised to
            zero, so training starts from the unconditioned tower). The tower then runs once per image-text pair
            instead of once per image, and an image has no features without a text, so the contrastive / matching
            head ([`MMFusionForPretraining`]) and `get_image_features` are not available.
        vision_text_attention (`bool`, *optional*, defaults to `False`):
            Condition a backbone / convolutional vision tower on the text by cross-attention: after every stage but the
            stem, each cell of the stage's map reads the text's tokens (the text tower's last layer) with a query from
            its own channels, and what it reads is added to it. Unlike FiLM's one scale and shift for all cells, each
            cell reads for itself, so the convolutions that follow see which cells the question is about: use it when
            the answer depends on where the object the text names is (`scripts/train.py` sets it for a convolutional
            tower trained from scratch with cross-attention fusion and a classification head). The same consequences
            as `vision_film` (one tower run per pair; no pretraining head or `get_image_features`); the two cannot be
            combined.
        vision_text_attention_from_stage (`int`, *optional*, defaults to 1):
            With `vision_text_attention`: the first stage after the stem whose cells read the text (1 = every stage).
            The stages before it do not depend on the text: with image-grouped batches (`image_index`) they run once
            per distinct image, as the stem does. Measured at 2 on the default model: no faster in a random order,
            and Sort-of-CLEVR learned later (scripts/benchmarks/RESULTS.md, benchmark_sort_of_clevr.py).
        pooling_mode (`str`, *optional*, defaults to `"mean"`):
            How a sequence becomes one vector: `"mean"` (over non-padding tokens / all patches) or `"cls"` (first
            token).
        image_pooling (`str`, *optional*):
            How the image tokens become the image vector that late fusion and the image embeddings
            (`get_image_features`, contrastive learning) read: `"mean"`, `"cls"`, or `"flatten"` (every token in
            order, concatenated before the image projection, so the vector keeps where each feature is, as the
            CNN+MLP baseline of the Relation Network paper does; needs `vision_config.image_size`, the input size).
            Defaults to `pooling_mode`.
        joint_pooling (`str`, *optional*, defaults to `"concat"`):
            The joint vector the heads read after cross-attention fusion (`hierarchical`, `cross_attention`):
            `"concat"`, the pooled text and image streams side by side, or `"concat_product"`, followed by their
            element-wise product too (the multiplicative interaction late fusion always has), which gives the head the
            agreement of the two streams directly instead of leaving it to learn it. `scripts/train.py` uses
            `"concat_product"`. `"text"`: the pooled text stream alone, the text after it has read the image, so that
            the image reaches the head only through the cross-attention. Use it with
            `fusion_direction="text_to_image"` when the answer depends on what the text picks out of the image: there
            the image stream does not depend on the text, so the pooled image beside it is a late-fusion path.
        projection_dim (`int`, *optional*, defaults to 256):
            Width of the image/text embeddings used by contrastive learning and late fusion.
        logit_scale_init_value (`float`, *optional*, defaults to 2.6592):
            Initial value of the learnable contrastive temperature, as log(1 / 0.07) in CLIP.
        max_logit_scale (`float`, *optional*, defaults to 100.0):
            The contrastive logit scale is clamped to at most this value.
        itc_loss_weight (`float`, *optional*, defaults to 1.0):
            Weight of the image-text contrastive loss in the pretraining loss.
        itm_loss_weight (`float`, *optional*, defaults to 1.0):
            Weight of the image-text matching loss in the pretraining loss; 0 skips the matching head's forward.
        classifier_hidden_size (`int`, *optional*):
            Hidden width of the classification and matching heads. Defaults to twice their input width.
        classifier_dropout (`float`, *optional*, defaults to 0.1):
            Dropout before the classification head's output layer.
        initializer_range (`float`, *optional*, defaults to 0.02):
            Standard deviation of the normal initialisation of the fusion block and heads.
        init_scheme (`str`, *optional*, defaults to `"normal"`):
            How the layers outside the towers (fusion block, feature-map token projections, FiLM maps, projections,
            heads) are drawn. `"normal"`: linear layers N(0, `initializer_range`) with zero biases, as BERT / CLIP, and
            the FiLM maps zero, so that training starts from the unconditioned tower (for a pretrained tower whose
            features should stay as they are at first). `"pytorch"`: every linear and convolution layer, the FiLM
            maps included, as PyTorch draws a new `nn.Linear` / `nn.Conv2d` (uniform with bound 1 / sqrt(fan-in),
            about N(0, 0.06) for a width of 96), so every question modulates the tower from the first step: use it
            for a convolutional tower trained from scratch whose fusion or head must find where an object is
            (`scripts/train.py` sets it for such a tower with cross-attention fusion and a classification head).
            Configs saved with the earlier `fusion_init` / `vision_film_init` load with `"pytorch"` where either
            was `"pytorch"`.
        image_mean (`list[float]` or `float`, *optional*, defaults to the ImageNet mean):
            Per-channel mean used when `pixel_values` arrive as uint8 in [0, 255] (as the data collator delivers
            them): the model then normalises them itself, on its device. Set it to the vision tower's own values
            when composing pretrained towers. One number serves every channel.
        image_std (`list[float]` or `float`, *optional*, defaults to the ImageNet standard deviation):
            Per-channel standard deviation for the same normalisation.
        kwargs (*optional*):
            Passed to [`PreTrainedConfig`], e.g. `num_labels`, `id2label`, `label2id`.

    Example:

    ```python
    >>> from transformers import BertConfig, ViTConfig
    >>> from mm_fusion import MMFusionConfig, MMFusionModel

    >>> config = MMFusionConfig(vision_config=ViTConfig(image_size=64), text_config=BertConfig(), num_fusion_layers=2)
    >>> model = MMFusionModel(config)
    ```
    """

    model_type = "mm_fusion"
    sub_configs = {"vision_config": AutoConfig, "text_config": AutoConfig}

    # The fields, by what they shape. `None` where the default follows from another field (`__post_init__` fills it).
    # The towers
    vision_config: dict | PreTrainedConfig | None = None
    text_config: dict | PreTrainedConfig | None = None
    # The fusion block
    fusion_type: str = "hierarchical"
    fusion_direction: str = "bidirectional"
    fusion_layer_order: str = "self_first"
    num_fusion_layers: int = 2
    fusion_hidden_size: int | None = None
    fusion_num_attention_heads: int | None = None
    fusion_intermediate_size: int | None = None
    vision_bridge_layers: list[int | str] | None = None
    text_bridge_layers: list[int | str] | None = None
    fusion_dropout: float | int = 0.1
    fusion_attention_dropout: float | int = 0.0
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-6
    # The image tokens of a backbone / convolutional tower, and its conditioning on the text
    vision_position_embedding: str = "sine"
    feature_map_bridge: bool = True
    vision_conv_stem: list[int] | None = None
    vision_film: bool = False
    vision_text_attention: bool = False
    vision_text_attention_from_stage: int = 1
    # Pooling
    pooling_mode: str = "mean"
    image_pooling: str | None = None
    joint_pooling: str = "concat"
    # The heads and their losses
    projection_dim: int = 256
    logit_scale_init_value: float | int = 2.6592
    max_logit_scale: float | int = 100.0
    itc_loss_weight: float | int = 1.0
    itm_loss_weight: float | int = 1.0
    classifier_hidden_size: int | None = None
    classifier_dropout: float | int = 0.1
    # Initialisation
    initializer_range: float = 0.02
    init_scheme: str | None = None
    # Pixel normalisation: a value per channel, or one for all
    image_mean: list[float | int] | tuple[float | int, ...] | float | int | None = None
    image_std: list[float | int] | tuple[float | int, ...] | float | int | None = None

    def __post_init__(self, **kwargs):
        """Fill the defaults that follow from other fields, read the settings that `init_scheme` replaced, and refuse
        a combination the model cannot build, naming the fields."""
        self.init_scheme = _init_scheme(
            self.init_scheme, kwargs.pop("fusion_init", None), kwargs.pop("vision_film_init", None)
        )
        self._settle_pooling()
        self.vision_config = _as_config(self.vision_config, DEFAULT_VISION_CONFIG, "vision_config")
        self.text_config = _as_config(self.text_config, DEFAULT_TEXT_CONFIG, "text_config")
        _check_tower_config(self.vision_config, "vision")
        _check_tower_config(self.text_config, "text")
        self._settle_fusion()
        self._settle_vision_tokens()
        self._settle_heads()
        num_channels = getattr(self.vision_config, "num_channels", 3)
        self.image_mean = _per_channel(self.image_mean, IMAGENET_MEAN, num_channels)
        self.image_std = _per_channel(self.image_std, IMAGENET_STD, num_channels)
        if len(self.image_mean) != num_channels or len(self.image_std) != num_channels or min(self.image_std) <= 0:
            raise ValueError(
                f"image_mean and image_std need {num_channels} values (one per channel, std > 0); got "
                f"{self.image_mean} and {self.image_std}."
            )
        super().__post_init__(**kwargs)

    def _settle_fusion(self) -> None:
        if self.fusion_type not in FUSION_TYPES:
            raise ValueError(
                f"Unknown fusion_type {self.fusion_type!r}; valid fusion types are {', '.join(FUSION_TYPES)}."
            )
        if self.fusion_direction not in FUSION_DIRECTIONS:
            raise ValueError(
                f"Unknown fusion_direction {self.fusion_direction!r}; valid values are {', '.join(FUSION_DIRECTIONS)}."
            )
        if self.fusion_layer_order not in FUSION_LAYER_ORDERS:
            raise ValueError(
                f"Unknown fusion_layer_order {self.fusion_layer_order!r}; orders are {', '.join(FUSION_LAYER_ORDERS)}."
            )
        self.fusion_hidden_size = self.fusion_hidden_size or self.text_config.hidden_size
        self.fusion_num_attention_heads = self.fusion_num_attention_heads or getattr(
            self.text_config, "num_attention_heads", 8
        )
        self.fusion_intermediate_size = self.fusion_intermediate_size or 4 * self.fusion_hidden_size
        if self.fusion_hidden_size % self.fusion_num_attention_heads:
            raise ValueError(
                f"fusion_hidden_size ({self.fusion_hidden_size}) must be divisible by fusion_num_attention_heads "
                f"({self.fusion_num_attention_heads})."
            )
        if self.fusion_type != "late" and self.num_fusion_layers < 1:
            raise ValueError(
                f"fusion_type {self.fusion_type!r} needs num_fusion_layers >= 1, got {self.num_fusion_layers}."
            )
        self.vision_bridge_layers = self._bridge_layers(self.vision_bridge_layers, self.vision_config, "vision")
        self.text_bridge_layers = self._bridge_layers(self.text_bridge_layers, self.text_config, "text")

    def _settle_vision_tokens(self) -> None:
        self._check_vision_tokens()
        if self.vision_conv_stem:
            self.vision_conv_stem = [int(c) for c in self.vision_conv_stem]
        else:
            self.vision_conv_stem = None
        name = type(self.vision_config).__name__
        if self.vision_film and self.vision_tower_type == "transformer":
            raise ValueError(
                f"vision_film scales and shifts the stages of a backbone / convolutional vision tower; the {name} "
                "tower is a transformer encoder."
            )
        if self.vision_text_attention and self.vision_tower_type == "transformer":
            raise ValueError(
                f"vision_text_attention conditions the stages of a backbone / convolutional vision tower; the {name} "
                "tower is a transformer encoder."
            )
        if self.vision_text_attention:
            count = num_stages(self.vision_config) - (1 if self.vision_tower_type == "backbone" else 0)
            if not 1 <= self.vision_text_attention_from_stage <= count:
                raise ValueError(
                    f"vision_text_attention_from_stage={self.vision_text_attention_from_stage}: the {name} tower has "
                    f"{count} stages after its stem, so the first stage that reads the text is one of 1-{count}."
                )
        if self.vision_film and self.vision_text_attention:
            raise ValueError(
                "vision_film and vision_text_attention both condition the vision tower's stages on the text: choose "
                "one."
            )
        if self.vision_tower_type == "backbone":  # the backbone outputs exactly the stages fusion reads
            self.vision_config = with_out_indices(self.vision_config, self.vision_stages)

    def _settle_pooling(self) -> None:
        if self.pooling_mode not in POOLING_MODES:
            raise ValueError(
                f"Unknown pooling_mode {self.pooling_mode!r}; valid modes are {', '.join(POOLING_MODES)}."
            )
        self.image_pooling = self.image_pooling or self.pooling_mode
        if self.image_pooling not in IMAGE_POOLING:
            raise ValueError(
                f"Unknown image_pooling {self.image_pooling!r}; valid values are {', '.join(IMAGE_POOLING)}."
            )
        if self.joint_pooling not in JOINT_POOLING:
            raise ValueError(
                f"Unknown joint_pooling {self.joint_pooling!r}; valid values are {', '.join(JOINT_POOLING)}."
            )

    def _settle_heads(self) -> None:
        itc, itm = self.itc_loss_weight, self.itm_loss_weight
        if itc < 0 or itm < 0 or itc + itm == 0:
            raise ValueError(f"itc_loss_weight ({itc}) and itm_loss_weight ({itm}) must be >= 0 and not both 0.")

    # The pipelines that serve the saved head travel with it: `custom_pipelines` entries and their code
    # (`custom_pipelines.py` says which, and why a task this process serves itself is not read back).
    @property
    def custom_pipelines(self) -> dict:
        saved = self.__dict__.get("_custom_pipelines") or {}
        return {task: entry for task, entry in saved.items() if not served_here(task, entry)}

    @custom_pipelines.setter
    def custom_pipelines(self, value: dict | None) -> None:
        self.__dict__["_custom_pipelines"] = dict(value or {})

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        os.makedirs(save_directory, exist_ok=True)
        self.custom_pipelines = save_custom_pipelines(self, save_directory)
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    def to_dict(self) -> dict:
        output = super().to_dict()
        saved = output.pop("_custom_pipelines", None)
        if saved:
            output["custom_pipelines"] = saved
        return output

    @property
    def vision_tower_type(self) -> str:
        """`"transformer"` (tokens are its hidden states), `"backbone"` or `"feature_maps"` (tokens are projected
        feature maps): see vision_towers.py."""
        return vision_tower_type(self.vision_config)

    @property
    def vision_hidden_size(self) -> int:
        """Width of the image tokens the fusion block and the image projection read: the transformer tower's, or
        `fusion_hidden_size` for feature maps projected to tokens."""
        if self.vision_tower_type == "transformer":
            return self.vision_config.hidden_size
        return self.fusion_hidden_size

    @property
    def vision_stages(self) -> list[int] | None:
        """The feature-map stages a backbone / convolutional tower feeds the fusion with: the bridge layers, or the
        last stage (None for a transformer tower)."""
        if self.vision_tower_type == "transformer":
            return None
        if self.vision_bridge_layers is not None:
            return list(self.vision_bridge_layers)
        return [num_stages(self.vision_config) - 1]

    @property
    def num_image_tokens(self) -> int:
        """The image tokens per image at `vision_config.image_size` (what `image_pooling="flatten"` concatenates)."""
        size = getattr(self.vision_config, "image_size", None)
        size = size if isinstance(size, int) or size is None else size[0]
        if size is None:
            raise ValueError(
                f"image_pooling='flatten' needs the input image size: set `image_size` on the vision config "
                f"({type(self.vision_config).__name__})."
            )
        return image_token_count(self.vision_config, self.vision_stages, size)

    def _check_vision_tokens(self) -> None:
        position_embedding, conv_stem = self.vision_position_embedding, self.vision_conv_stem
        if position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"Unknown vision_position_embedding {position_embedding!r}; valid values are "
                f"{', '.join(POSITION_EMBEDDINGS)}."
            )
        kind = self.vision_tower_type
        name = type(self.vision_config).__name__
        if kind != "transformer":
            if conv_stem:
                raise ValueError(
                    f"vision_conv_stem replaces a vision transformer's patchify; the {name} tower is convolutional "
                    "already."
                )
            if "cls" in (self.pooling_mode, self.image_pooling):
                raise ValueError(
                    f"pooling_mode / image_pooling 'cls' pools the first token, but the {name} tower's tokens are "
                    "feature-map cells with no CLS token among them: use 'mean' (or image_pooling='flatten')."
                )
            if "sine" in position_embedding and self.fusion_hidden_size % 4:
                raise ValueError(
                    f"Sine position embeddings need fusion_hidden_size divisible by 4, got {self.fusion_hidden_size}."
                )
        elif conv_stem:
            patch = getattr(self.vision_config, "patch_size", None)
            patch = patch if isinstance(patch, int) or patch is None else patch[0]
            if patch is None or patch % 2 ** len(conv_stem):
                raise ValueError(
                    f"vision_conv_stem {list(conv_stem)} has {len(conv_stem)} stride-2 convolutions (stride "
                    f"{2 ** len(conv_stem)}), which must divide the vision tower's patch_size ({patch})."
                )

    def _bridge_layers(self, layers: list[int] | None, tower: PreTrainedConfig, role: str) -> list[int] | None:
        """Resolve and check the tower layers (or feature-map stages) that feed the hierarchical bridges. Only
        `"hierarchical"` fusion has them: the other fusion types leave them None and raise when they are set (their
        saved configs hold None, as the default is never filled in for them)."""
        if self.fusion_type != "hierarchical":
            if layers is not None:
                raise ValueError(
                    f"`{role}_bridge_layers` {layers} choose the tower layers that feed the hierarchical bridges, but "
                    f"fusion_type {self.fusion_type!r} has none: it reads the towers' final features. Leave "
                    f"`{role}_bridge_layers` unset, or use fusion_type 'hierarchical', which reads them."
                )
            return None
        if role == "vision" and vision_tower_type(tower) != "transformer":
            num_layers = num_stages(tower) - 1  # stage indices run from 0 (the stem) to this
        else:
            num_layers = getattr(tower, "num_hidden_layers", None)
        if layers is None:
            if num_layers is None:
                raise ValueError(
                    f"`{role}_bridge_layers` is required: {type(tower).__name__} has no num_hidden_layers."
                )
            if num_layers < self.num_fusion_layers:
                raise ValueError(
                    f"The {role} tower has {num_layers} layers, fewer than "
                    f"num_fusion_layers={self.num_fusion_layers}; pass `{role}_bridge_layers` explicitly."
                )
            return list(range(num_layers - self.num_fusion_layers + 1, num_layers + 1))
        words = f' or "{WORDS}"' if role == "text" else ""
        numbers = [i for i in layers if not (role == "text" and i == WORDS)]
        if not all(isinstance(i, int) or (isinstance(i, str) and i.isdigit()) for i in numbers):
            raise ValueError(f"`{role}_bridge_layers` {layers} must be layer numbers{words}.")
        layers = [i if role == "text" and i == WORDS else int(i) for i in layers]
        if len(layers) != self.num_fusion_layers:
            raise ValueError(
                f"`{role}_bridge_layers` has {len(layers)} entries but num_fusion_layers is {self.num_fusion_layers}."
            )
        if num_layers is not None and not all(0 <= int(i) <= num_layers for i in numbers):
            raise ValueError(
                f"`{role}_bridge_layers` {layers} must lie in [0, {num_layers}]{words} for this {role} tower."
            )
        return layers


__all__ = ["MMFusionConfig"]
