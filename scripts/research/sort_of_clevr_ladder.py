"""Sort-of-CLEVR diagnostic ladder: which models learn to find an object by its colour, in minutes on a CPU.

Every contender trains on the same generated scenes (`mm_fusion.data.sort_of_clevr`: 64 px, six objects of 10 px),
with every question of every image (6 colours x 6 families), the question given as ids, not text: for the
hand-written models a one-hot colour and a one-hot family (the Relation Network paper's question vector,
arXiv:1706.01427), for mm_fusion the token ids [CLS, colour, family] through its text tower. Random batches of 64,
Adam(W) at a fixed learning rate, one thread each; held-out accuracy per question family every `--eval_every` steps.
This isolates the model from the training pipeline (tokenizer, grouped batches, schedule).

    python scripts/research/sort_of_clevr_ladder.py --variants cnn_mlp film attention --steps 4000

Contenders (`--variants`):
- `cnn_mlp`: the paper's CNN+MLP baseline: four stride-2 3x3 convs (24 channels, BatchNorm), flattened, with the
  question into a 3-layer MLP.
- `film`: the same convs, each with (x, y) coordinate maps appended and its BatchNorm output scaled and shifted by a
  linear map of the question (FiLM, arXiv:1709.07871).
- `film_resnet`: mm_fusion's default ResNet tower (stages of 24 / 48 / 96 channels on 16 x 16, 8 x 8, 4 x 4 cells)
  with every stage's output scaled and shifted by a linear map of the question, its last stage flattened into the MLP.
- `film_resnet_text`: `film_resnet` with the question read as mm_fusion reads it: the recipe's text tower (2-layer
  BERT, width 96) on [CLS, colour, family], mean-pooled, into the FiLM maps and the MLP in place of the one-hot.
- `film_resnet_zero_film`: `film_resnet` with its FiLM maps starting at zero (the identity), as mm_fusion's do.
- `film_resnet_frozen_text`: `film_resnet_text` with the text tower frozen at its random initialisation (a fixed
  question vector, as the one-hot is, but BERT's).
- `film_resnet_text_lr01`: `film_resnet_text` with the text tower at a tenth of the learning rate.
- `film_resnet_normalised`, `film_resnet_tokens`, `film_resnet_mm_head`: `film_resnet` with one of mm_fusion's
  choices each: ImageNet mean / std on the pixels; the last stage as 96-wide tokens (1x1 projection, sine positions);
  mm_fusion's late head (see `FiLMResNet`).
- `film_resnet_tokens_torch_init`, `film_resnet_mm_head_torch_init`: the same two with their new layers drawn as
  PyTorch draws them instead of from N(0, 0.02); `film_resnet_tokens_no_positions`: the tokens without sine positions.
- `attention`: two stride-2 convs, (x, y) appended to each of the 16 x 16 cells, one attention read of the cells by a
  query made from the question (PyTorch's default initialisation), the result and the question into an MLP.
- `attention_std002`: `attention` with its projections drawn from N(0, 0.02), the initialisation of BERT and of
  mm_fusion's fusion block.
- `attention_sine`: `attention` with sine positions added in place of the coordinates.
- `attention_layernorm`: `attention` with LayerNorm on the cells before the read (mm_fusion's `context_norm`).
- `attention_resnet`: `attention` reading mm_fusion's default ResNet tower (stage 1, 16 x 16) in place of two convs.
- `climb_*`: from `attention` toward mm_fusion's fusion block, one difference at a time (`CLIMB`): 4 heads;
  sine positions in place of the coordinates; width 96; the question through the recipe's text tower, every token a
  query, the tower at a tenth of the rate (`climb_text_full_lr`: at the full rate); the read added to each token and
  mean-pooled (`climb_residual`, mm_fusion's text stream); then, each from `climb_residual`, mm_fusion's ResNet
  tower (its stem, stage 1 or stage 2), the read's projections from N(0, 0.02), LayerNorm on the cells; from the
  stem read, LayerNorm on the cells (`climb_stem_layernorm`) and mm_fusion's fusion layer as the read
  (`climb_stem_mm_block`: self-attention, LayerNorms on queries and context, cross-attention, MLP; `_no_context_norm`
  without the LayerNorm on the cells).
- `mm_hier_*`: mm_fusion's hierarchical model (no FiLM) with the layers outside the towers drawn as PyTorch
  draws them and the text tower at a tenth of the rate, then: without the LayerNorms on the image tokens, with
  coordinates, reading ResNet stages 1-2 or the stem and stage 1, bidirectional; `mm_hier_read_like` (the stem and
  stage 1, no image LayerNorms, the joint vector the text stream alone); one fusion layer reading the stem
  (`mm_hier_one_layer_stem`, and `_read_like` without image LayerNorms, the text stream alone; from that, the read's
  head in place of mm_fusion's and no LayerNorm on the pooled text (`_read_head`), no LayerNorm on the pooled text
  alone (`_no_text_norm`), pixels in [0, 1] (`_unnormalised`), the pooled text's LayerNorm kept with the read's ReLU
  MLP (`_relu_head`) or with mm_fusion's head less its inner LayerNorm (`_head_no_norm`), `_read_head` with (x, y)
  coordinate channels in place of sine positions (`_read_head_coordinates`), with the text-to-image logits four times
  sharper (`_read_head_sharp4`), without the text bridge's LayerNorm (`_read_head_no_text_bridge_norm`) or the image
  bridge's linear map after the tokens' 1x1 projection (`_read_head_no_image_bridge`; and in the model as the library
  builds it, `mm_hier_one_layer_stem_no_image_bridge`; with mm_fusion's head, `_read_like_no_image_bridge`)); the
  image stream attending to the question too (`mm_hier_one_layer_stem_bidirectional`,
  `mm_hier_stem_stage1_bidirectional`: co-attention, the config's default direction, with mm_fusion's norms, head and
  joint vector); without the bridge, also without the image LayerNorms (`_no_image_bridge_no_image_norms`) or with
  the text stream alone as the joint vector (`_no_image_bridge_joint_text`); `mm_hier_one_layer_stem_recipe`, the
  model of `scripts/configs/sort_of_clevr_hierarchical.yaml` through the library's options (`feature_map_bridge=False`,
  `joint_pooling="text"`); `_recipe_positions_after_norm`, that model with its tokens' sine positions added after the
  cross-attention's context LayerNorm instead of before the LayerNorms (`vision_position_embedding="sine_attention"`),
  `_recipe_no_block_mlp`, that without the MLP after the text's cross-attention, and `_recipe_read_head`, with the
  read's head; `mm_hier_two_layers_stem_sine_attention`, two such layers on the stem;
  `mm_hier_one_layer_stem_image_self_attention`, the image tokens attending to each other (self-attention and MLP,
  once per image) before the text reads them; `mm_hier_two_layers_stem_second_zero_init` and
  `_image_self_attention_zero_init`, the same two with the new branches' last maps drawn as zero (at step 0 the
  one-layer model); `_recipe_text_embeddings`, the recipe's model reading the text tower's embeddings (hidden state
  0) instead of its last layer; `_recipe_no_text_self_attention`, the recipe's model without the fusion layer's text
  self-attention (each token reads the image as the text tower leaves it), `_recipe_embeddings_no_text_self_attention`
  the same reading the embeddings (the colour token's query is the colour's alone, whatever the family), and
  `_recipe_embeddings_cross_first`, reading the embeddings with the fusion layer's two attentions swapped (the image
  read first, then the tokens' self-attention; the library's `fusion_layer_order="cross_first"`, with the text bridge
  on the embeddings its default hierarchical layer); `_recipe_text_full_lr`, the recipe's model with
  the text tower at the full learning rate, and `_recipe_uniform_read`, with the cross-attention's query map drawn as
  zero (every token reads every cell alike at step 0); `_recipe_one_head`, with one attention head in place of four;
  `_recipe_positions_in_values`, with the image positions added to the cross-attention's values only, not its keys.
  `_recipe_stem_coordinates`, the recipe's model with (x, y) appended to the pixels into the tower's
  first convolution (CoordConv), and `_stem_coordinates_no_positions` the same without the sine positions;
  `_recipe_bidirectional`, the recipe's model with co-attention (the image tokens read the question too) and the
  pooled image and its product with the pooled text in the joint vector (`_stem_coordinates`: with CoordConv too);
  `mm_hier_one_layer_stage1_recipe_film`, the recipe's model with FiLM in its tower (`vision_film`) reading stage 1.
  `_recipe_embeddings_cross_first_image_self_attention`, `_recipe_embeddings_cross_first` with the
  image tokens attending to each other (once per image, question-free) before the words read them, so that each
  object's cell can hold its nearest and furthest object before the question's read reaches it.
- `mm_fusion`: the Sort-of-CLEVR recipe's model (ResNet tower, hierarchical fusion, width 96, 2-layer BERT).
- `mm_fusion_std01`: the same with `initializer_range=0.1` (fusion block and text tower).
- `mm_fusion_film`: the recipe's model with `vision_film=True` (every ResNet stage scaled and shifted by a linear map
  of the pooled question, `MMFusionConfig.vision_film`).
- `mm_fusion_late_film`: the same with late fusion (no cross-attention: FiLM and the pooled image only).
- `mm_fusion_film_flatten`: `mm_fusion_late_film` with `image_pooling="flatten"` (every image token, in order, into
  the image embedding: the layout kept, as `film_resnet`'s flattened map keeps it).
- `mm_fusion_film_flatten_default_init`: `mm_fusion_film_flatten` with the FiLM maps drawn as PyTorch draws a new
  `nn.Linear` (as `film_resnet`'s are) instead of starting at zero.
- `mm_fusion_film_flatten_one_hot`: `mm_fusion_film_flatten` with its text tower replaced by the one-hot question
  (each token's state its one-hot id, mean-pooled), as the hand-written models get it.
- `mm_fusion_film_flatten_one_hot_torch_init`: the same with every linear and 1x1 layer outside the towers and FiLM
  (tokens' projection, image / text projections, classifier) drawn as PyTorch draws a new layer, not from N(0, 0.02).
- `mm_fusion_film_flatten_one_hot_default_init`: `mm_fusion_film_flatten_one_hot` with the FiLM maps drawn as
  PyTorch draws a new `nn.Linear` (as `film_resnet`'s are) instead of starting at zero.
- `mm_fusion_film_flatten_one_hot_film_std015_torch_init`: `mm_fusion_film_flatten_one_hot_torch_init` with the FiLM
  maps drawn from N(0, 0.15), so that their initial scale and shift of a one-hot question match `film_resnet`'s.
- `mm_fusion_film_flatten_fixes_one_hot`: `mm_fusion_film_flatten_one_hot_film_std015_torch_init` with the image
  tokens' sine positions left out (`vision_position_embedding="none"`): every difference the `film_resnet_*` rungs
  found, undone in mm_fusion's late model.
- `mm_fusion_film_flatten_fixes`: the same with the text tower in place of the one-hot, trained at a tenth of the
  learning rate, and the FiLM maps drawn as PyTorch draws them.
- `mm_fusion_film_flatten_options`: `mm_fusion_film_flatten_fixes` through mm_fusion's own options, as
  `scripts/train.py` sets them (`vision_film_init="pytorch"`, `fusion_init="pytorch"`, the text tower at a tenth of the
  learning rate) in place of patching the model from outside.
- `mm_fusion_film_fixes`: the same fixes in the recipe's hierarchical (cross-attention) model with `vision_film=True`
  (its fusion block drawn as PyTorch draws it too); `mm_fusion_film_fixes_no_image_norms` without the LayerNorms on
  the image tokens before the cross-attention as well.
- `mm_fusion_no_image_norms`: the recipe's model with the LayerNorms on the image tokens before the cross-attention
  (the bridges' and the context's) removed, so that object cells keep a larger norm than the background.

Every evaluation of a model with cross-attention also gives `on_object`: the share of its (last layer's)
text-to-image attention on the named object's square, over 600 non-relational questions (about 0.03 when uniform),
and the same per family (`on_object_shape`, `on_object_horizontal`, `on_object_vertical`: the families read
differently).

Writes `results/sort_of_clevr_ladder_runs.json` (every evaluation), `.md` (the table of the last evaluations) and
`.png` (the learning curves of the left / right question).
`--merge a.json b.json` combines the reports of variants run by separate commands.
`--device cuda` trains on a GPU (the scenes are drawn on the CPU as before); a run there follows another trajectory
than on a CPU, as a run on one CPU does beside another (results/sort_of_clevr_ladder.md).
"""

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' shared helpers
from benchmarking import machine, markdown_table, write_report  # noqa: E402

from mm_fusion.data.sort_of_clevr import (  # noqa: E402
    COLOURS,
    QUESTION_FAMILIES,
    answer_names,
    answer_question,
    generate_scenes,
    render_scene,
)
from mm_fusion.vision_towers import sine_positions  # noqa: E402


RESULTS = Path(__file__).resolve().parent / "results"


FAMILIES, COLOUR_NAMES, ANSWERS = list(QUESTION_FAMILIES), list(COLOURS), answer_names(6)
NON_RELATIONAL = ("shape", "horizontal", "vertical")
IMAGE_SIZE, OBJECT_SIZE = 64, 10
VARIANTS = (
    "cnn_mlp",
    "film",
    "film_resnet",
    "film_resnet_text",
    "film_resnet_zero_film",
    "film_resnet_frozen_text",
    "film_resnet_text_lr01",
    "film_resnet_normalised",
    "film_resnet_tokens",
    "film_resnet_mm_head",
    "film_resnet_tokens_torch_init",
    "film_resnet_tokens_no_positions",
    "film_resnet_mm_head_torch_init",
    "attention",
    "attention_std002",
    "attention_sine",
    "attention_layernorm",
    "attention_resnet",
    "climb_heads4",
    "climb_sine",
    "climb_width96",
    "climb_text",
    "climb_text_full_lr",
    "climb_residual",
    "climb_resnet_stem",
    "climb_resnet",
    "climb_resnet2",
    "climb_std002",
    "climb_layernorm",
    "climb_stem_layernorm",
    "climb_stem_mm_block",
    "climb_stem_mm_block_no_context_norm",
    "mm_fusion",
    "mm_fusion_std01",
    "mm_fusion_film",
    "mm_fusion_late_film",
    "mm_fusion_film_flatten",
    "mm_fusion_no_image_norms",
    "mm_fusion_film_flatten_default_init",
    "mm_fusion_film_flatten_one_hot",
    "mm_fusion_film_flatten_one_hot_torch_init",
    "mm_fusion_film_flatten_one_hot_default_init",
    "mm_fusion_film_flatten_one_hot_film_std015_torch_init",
    "mm_fusion_film_flatten_fixes_one_hot",
    "mm_fusion_film_flatten_fixes",
    "mm_fusion_film_flatten_options",
    "mm_fusion_film_fixes",
    "mm_fusion_film_fixes_no_image_norms",
    "mm_hier_fixes",
    "mm_hier_fixes_no_image_norms",
    "mm_hier_fixes_coordinates",
    "mm_hier_fixes_stage1",
    "mm_hier_fixes_stem",
    "mm_hier_fixes_stem_no_image_norms",
    "mm_hier_read_like",
    "mm_hier_one_layer_stem_read_like",
    "mm_hier_one_layer_stem_read_like_read_head",
    "mm_hier_one_layer_stem_read_like_no_text_norm",
    "mm_hier_one_layer_stem_read_like_read_head_coordinates",
    "mm_hier_one_layer_stem_read_like_read_head_sharp4",
    "mm_hier_one_layer_stem_read_like_read_head_no_text_bridge_norm",
    "mm_hier_one_layer_stem_read_like_read_head_no_image_bridge",
    "mm_hier_one_layer_stem_read_like_no_image_bridge",
    "mm_hier_one_layer_stem_read_like_relu_head",
    "mm_hier_one_layer_stem_read_like_head_no_norm",
    "mm_hier_one_layer_stem_read_like_unnormalised",
    "mm_hier_one_layer_stem",
    "mm_hier_one_layer_stem_no_image_bridge",
    "mm_hier_one_layer_stem_no_image_bridge_no_image_norms",
    "mm_hier_one_layer_stem_no_image_bridge_joint_text",
    "mm_hier_one_layer_stem_recipe",
    "mm_hier_one_layer_stem_recipe_positions_after_norm",
    "mm_hier_one_layer_stem_recipe_no_block_mlp",
    "mm_hier_one_layer_stem_recipe_text_embeddings",
    "mm_hier_one_layer_stem_recipe_read_head",
    "mm_hier_one_layer_stem_recipe_no_text_self_attention",
    "mm_hier_one_layer_stem_recipe_embeddings_no_text_self_attention",
    "mm_hier_one_layer_stem_recipe_embeddings_cross_first",
    "mm_hier_one_layer_stem_recipe_embeddings_cross_first_image_self_attention",
    "mm_hier_one_layer_stem_recipe_text_full_lr",
    "mm_hier_one_layer_stem_recipe_uniform_read",
    "mm_hier_one_layer_stem_recipe_one_head",
    "mm_hier_one_layer_stem_recipe_positions_in_values",
    "mm_hier_one_layer_stem_recipe_stem_coordinates",
    "mm_hier_one_layer_stem_recipe_stem_coordinates_no_positions",
    "mm_hier_one_layer_stem_recipe_bidirectional",
    "mm_hier_one_layer_stem_recipe_bidirectional_stem_coordinates",
    "mm_hier_one_layer_stage1_recipe_film",
    "mm_hier_two_layers_stem_sine_attention",
    "mm_hier_two_layers_stem_second_zero_init",
    "mm_hier_one_layer_stem_image_self_attention",
    "mm_hier_one_layer_stem_image_self_attention_zero_init",
    "mm_hier_one_layer_stem_bidirectional",
    "mm_hier_stem_stage1_bidirectional",
    "mm_hier_fixes_bidirectional",
)


def build_split(scenes: list[list[dict]]) -> dict[str, torch.Tensor]:
    """Images in [0, 1], and per question: its image, colour, family and answer (every colour x family)."""
    images = np.stack([np.asarray(render_scene(s, IMAGE_SIZE, OBJECT_SIZE), dtype=np.float32) for s in scenes])
    rows = [
        (i, c, f, ANSWERS.index(answer_question(scene, family, colour, IMAGE_SIZE)))
        for i, scene in enumerate(scenes)
        for f, family in enumerate(FAMILIES)
        for c, colour in enumerate(COLOUR_NAMES)
    ]
    image, colour, family, answer = (torch.tensor(column) for column in zip(*rows))
    centres = {(i, o["colour"]): (o["x"], o["y"]) for i, scene in enumerate(scenes) for o in scene}
    return {
        "centre": torch.tensor([centres[i, COLOUR_NAMES[c]] for i, c, _, _ in rows], dtype=torch.float32),
        "images": torch.from_numpy(images / 255.0).permute(0, 3, 1, 2).contiguous(),
        "image": image,
        "colour": colour,
        "family": family,
        "answer": answer,
    }


def one_hot_question(colour: torch.Tensor, family: torch.Tensor) -> torch.Tensor:
    return torch.cat([F.one_hot(colour, len(COLOURS)), F.one_hot(family, len(FAMILIES))], dim=1).float()


def coordinates(batch: int, height: int, width: int) -> torch.Tensor:
    """(batch, 2, height, width) x and y in [-1, 1]."""
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, height), torch.linspace(-1, 1, width), indexing="ij")
    return torch.stack([xs, ys]).expand(batch, -1, -1, -1)


def resnet_backbone(stage: int) -> nn.Module:
    """mm_fusion's default ResNet tower (`scripts/train.py --vision_tower resnet`: basic blocks, stages of 24 / 48 / 96
    channels on 16 x 16, 8 x 8, 4 x 4 cells at 64 px), returning the feature map of `stage`."""
    from transformers import AutoBackbone, ResNetConfig

    config = ResNetConfig(
        image_size=IMAGE_SIZE, embedding_size=24, hidden_sizes=[24, 48, 96], depths=[1, 1, 1], layer_type="basic",
        out_indices=[stage],
    )  # fmt: skip
    return AutoBackbone.from_config(config)


def conv_stack(layers: int, extra_channels: int = 0) -> nn.ModuleList:
    return nn.ModuleList(
        nn.Conv2d((3 if k == 0 else 24) + extra_channels, 24, 3, stride=2, padding=1) for k in range(layers)
    )


def recipe_config(**overrides):
    """The MMFusionConfig of the Sort-of-CLEVR recipe's model (ResNet tower), vocabulary of 20 ids."""
    from mm_fusion.training.arguments import ModelArguments
    from mm_fusion.training.model_presets import load_model_preset
    from mm_fusion.training.models import build_config

    # Its rungs ran with the baseline model (two fusion layers over a tower that does not read the question, and the
    # settings below), unless they name them.
    baseline = Path(__file__).parents[1] / "benchmarks" / "model_configs" / "two_fusion_layers_blind_tower.json"
    earlier = load_model_preset(str(baseline))
    args = ModelArguments(vision_tower="resnet", **{**earlier["model"], **overrides})
    # The rungs from before the library's `fusion_layer_order` and text bridge defaults keep the model they
    # ran with unless they name either: self-attention first, and the text tower's last layers bridged.
    settings = [args.config_overrides] if args.config_overrides else []
    if "fusion_layer_order" not in (args.config_overrides or ""):
        settings.append("fusion_layer_order=self_first")
    # Nor do they take train.py's defaults for a convolutional tower unless they name them, whatever the
    # fusion (the preset's conv_tower_config, given as overrides).
    settings += [
        f"{key}={json.dumps(value)}"
        for key, value in earlier["conv_tower_config"].items()
        if key not in (args.config_overrides or "")
    ]
    if "text_bridge_layers" not in (args.config_overrides or "") and args.fusion_type == "hierarchical":
        last = range(args.text_layers - args.fusion_layers + 1, args.text_layers + 1)
        settings.append(f"text_bridge_layers=[{','.join(map(str, last))}]")
    args.config_overrides = ",".join(settings)
    return build_config(args, IMAGE_SIZE, 20, 3, ANSWERS)


def question_ids(question: torch.Tensor) -> torch.Tensor:
    """One-hot questions as token ids [CLS, colour, family] (CLS 1, colours 2-7, families 8-13)."""
    colour, family = question[:, : len(COLOURS)].argmax(1), question[:, len(COLOURS) :].argmax(1)
    return torch.stack([torch.ones_like(colour), 2 + colour, 2 + len(COLOURS) + family], dim=1)


class OneHotText(nn.Module):
    """In place of mm_fusion's text tower: every token's state is its one-hot id (times 3, padded to the width), so
    the mean over [CLS, colour, family] is the one-hot question of the hand-written models (plus the CLS one)."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False, **kwargs):
        from transformers.modeling_outputs import BaseModelOutput

        states = 3.0 * F.one_hot(input_ids, self.width).float()
        return BaseModelOutput(last_hidden_state=states, hidden_states=(states,) * 3 if output_hidden_states else None)


def text_tower_groups(model: nn.Module, text: nn.Module | None, lr: float, scale: float) -> list[dict]:
    """The optimizer's parameter groups: the text tower's parameters at `scale` times the learning rate."""
    tower = list(text.parameters()) if text is not None else []
    ids = {id(p) for p in tower}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": rest, "lr": lr}] + ([{"params": tower, "lr": lr * scale}] if tower else [])


class CNNMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.convs, self.norms = conv_stack(4), nn.ModuleList(nn.BatchNorm2d(24) for _ in range(4))
        self.mlp = nn.Sequential(
            nn.Linear(24 * 4 * 4 + 12, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, len(ANSWERS))
        )

    def forward(self, images, question):
        x = images
        for conv, norm in zip(self.convs, self.norms):
            x = F.relu(norm(conv(x)))
        return self.mlp(torch.cat([x.flatten(1), question], dim=1))


class FiLM(CNNMLP):
    def __init__(self):
        super().__init__()
        self.convs = conv_stack(4, extra_channels=2)
        self.norms = nn.ModuleList(nn.BatchNorm2d(24, affine=False) for _ in range(4))
        self.film = nn.Linear(12, 4 * 2 * 24)

    def forward(self, images, question):
        scale_shift = self.film(question).view(-1, 4, 2, 24, 1, 1)
        x = images
        for k, (conv, norm) in enumerate(zip(self.convs, self.norms)):
            x = conv(torch.cat([x, coordinates(x.shape[0], *x.shape[-2:])], dim=1))
            x = F.relu(norm(x) * (1 + scale_shift[:, k, 0]) + scale_shift[:, k, 1])
        return self.mlp(torch.cat([x.flatten(1), question], dim=1))


class FiLMResNet(nn.Module):
    """mm_fusion's default ResNet tower with each stage's output scaled and shifted by a linear map of the question
    (hooks on the stages, no coordinate maps inside), its last stage flattened with the question into an MLP. With
    `text_tower`, the question is what mm_fusion's FiLM reads: the recipe's text tower (2-layer BERT, width 96) on
    [CLS, colour, family], mean-pooled, in place of the one-hot. The other options each put one of mm_fusion's
    choices in: `zero_film` (maps starting at zero), `normalise` (ImageNet mean / std on the pixels), `tokens` (a 1x1
    projection of the last stage to 96-wide tokens plus sine positions, N(0, 0.02)), `mm_head` (mm_fusion's late head:
    bias-free projections of the flattened map and the question to 96, [image, question, image x question], a
    GELU + LayerNorm MLP, all N(0, 0.02)); `token_positions=False` leaves the sine positions out, `mm_init=False` draws
    the new layers as PyTorch does."""

    def __init__(
        self,
        text_tower: bool = False,
        zero_film: bool = False,
        freeze_text: bool = False,
        text_lr_scale: float = 1.0,
        normalise: bool = False,
        tokens: bool = False,
        mm_head: bool = False,
        token_positions: bool = True,
        mm_init: bool = True,
    ):
        super().__init__()
        self.backbone = resnet_backbone(3)
        self.text = None
        if text_tower:
            from transformers import BertModel

            self.text = BertModel(recipe_config().text_config, add_pooling_layer=False)
            self.text.requires_grad_(not freeze_text)
        self.text_lr_scale = text_lr_scale
        width = self.text.config.hidden_size if text_tower else 12
        self.film = nn.ModuleList(nn.Linear(width, 2 * c) for c in self.backbone.config.hidden_sizes)
        if zero_film:  # as mm_fusion's FiLM starts: the identity
            for layer in self.film:
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)
        for stage, film in zip(self.backbone.encoder.stages, self.film):
            stage.register_forward_hook(lambda module, args, out, film=film: self._modulate(out, film))
        self.normalise = normalise
        if normalise:
            config = recipe_config()
            self.register_buffer("mean", torch.tensor(config.image_mean).view(1, 3, 1, 1))
            self.register_buffer("std", torch.tensor(config.image_std).view(1, 3, 1, 1))
        self.tokens = nn.Conv2d(96, 96, 1) if tokens else None
        self.token_positions = token_positions
        self.mm_head = mm_head
        if mm_head:
            self.image_projection = nn.Linear(96 * 4 * 4, 96, bias=False)
            self.text_projection = nn.Linear(width, 96, bias=False)
            self.mlp = nn.Sequential(
                nn.Linear(3 * 96, 576), nn.GELU(), nn.LayerNorm(576), nn.Linear(576, len(ANSWERS))
            )  # fmt: skip
        else:
            self.mlp = nn.Sequential(
                nn.Linear(96 * 4 * 4 + width, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                nn.Linear(256, len(ANSWERS)),
            )  # fmt: skip
        mm_fusion_init = ([self.tokens] if tokens else []) + (
            [self.image_projection, self.text_projection, self.mlp[0], self.mlp[3]] if mm_head else []
        )
        mm_fusion_init = mm_fusion_init if mm_init else []  # else as PyTorch draws them
        for layer in mm_fusion_init:  # as mm_fusion's _init_weights draws them
            nn.init.normal_(layer.weight, std=0.02)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def param_groups(self, lr: float) -> list[dict]:
        return text_tower_groups(self, self.text, lr, self.text_lr_scale)

    def _modulate(self, features, film):
        scale, shift = film(self._question).unsqueeze(-1).unsqueeze(-1).chunk(2, dim=1)
        return features * (1 + scale) + shift

    def forward(self, images, question):
        if self.text is not None:
            question = self.text(input_ids=question_ids(question)).last_hidden_state.mean(1)
        self._question = question
        if self.normalise:
            images = (images - self.mean) / self.std
        maps = self.backbone(images).feature_maps[0]
        if self.tokens is not None:
            cells = self.tokens(maps).flatten(2).transpose(1, 2)
            positions = sine_positions(*maps.shape[-2:], cells.shape[-1]).to(cells.dtype)
            maps = cells + positions if self.token_positions else cells
        image = maps.flatten(1)
        if self.mm_head:
            image, question = self.image_projection(image), self.text_projection(question)
            return self.mlp(torch.cat([image, question, image * question], dim=1))
        return self.mlp(torch.cat([image, question], dim=1))


class AttentionRead(nn.Module):
    """
    One cross-attention read of the image cells by the question, then an MLP. Each option puts in one of mm_fusion's
    choices (the climb): `tower` (two convs, or mm_fusion's ResNet: `"resnet"` stage 1, `"resnet_stem"`
    its stem, `"resnet2"` stage 2 on 8 x 8 cells), `positions` (`"coordinates"` appended before the cells' projection,
    `"sine"` added after it, `"none"`), `std` (the read's projections from N(0, std), not PyTorch's draw), `norm`
    (LayerNorm on the cells), `heads`, `query` (`"one_hot"`, or `"text"`: the recipe's text tower on [CLS, colour,
    family], every token a query, at `text_lr_scale` of the rate), `readout` (`"read_question"`: the read and the
    question into the MLP; `"residual_mean"`: each text token plus its read, mean-pooled, as mm_fusion's text stream
    after one cross-attention layer), `width` of the read.
    """

    def __init__(
        self,
        tower: str = "conv",
        positions: str = "coordinates",
        std: float | None = None,
        norm: bool = False,
        heads: int = 1,
        query: str = "one_hot",
        readout: str = "read_question",
        text_lr_scale: float = 1.0,
        width: int = 64,
    ):
        super().__init__()
        if tower == "conv":
            self.tower = nn.Sequential(
                nn.Conv2d(3, 24, 3, 2, 1), nn.BatchNorm2d(24), nn.ReLU(), nn.Conv2d(24, 24, 3, 2, 1),
                nn.BatchNorm2d(24), nn.ReLU(),
            )  # fmt: skip
            channels = 24
        elif tower == "resnet_stem":  # the ResNet's 7x7 stride-2 conv and max-pool: 16 x 16 cells
            backbone = resnet_backbone(1)
            self.tower, channels = backbone.embedder, 24
        else:  # mm_fusion's default ResNet, its stage 1 (16 x 16 cells) or 2 (8 x 8)
            stage = 2 if tower == "resnet2" else 1
            backbone = resnet_backbone(stage)
            self.tower = lambda images: backbone(images).feature_maps[0]
            self.backbone, channels = backbone, backbone.config.hidden_sizes[stage - 1]
        self.positions, self.heads, self.readout = positions, heads, readout
        self.cells = nn.Linear(channels + (2 if positions == "coordinates" else 0), width)
        self.norm = nn.LayerNorm(width) if norm else nn.Identity()
        self.text = None
        question_width = 12
        if query == "text":
            from transformers import BertModel

            self.text = BertModel(recipe_config().text_config, add_pooling_layer=False)
            question_width = self.text.config.hidden_size
        self.text_lr_scale = text_lr_scale
        self.key, self.value = nn.Linear(width, width), nn.Linear(width, width)
        self.query = nn.Linear(question_width, width)
        if readout == "residual_mean":
            self.out = nn.Linear(width, question_width)
            mlp_in = question_width
        elif readout.startswith("mm_block"):  # mm_fusion's fusion layer (text stream) in place of the read
            from mm_fusion.modeling_mm_fusion import MMFusionStreamBlock

            self.text_in = nn.Linear(question_width, width)
            self.block = MMFusionStreamBlock(recipe_config(config_overrides=f"fusion_hidden_size={width}"))
            if readout == "mm_block_no_context_norm":
                self.block.context_norm = nn.Identity()
            mlp_in = width
        else:
            mlp_in = width + question_width
        self.mlp = nn.Sequential(nn.Linear(mlp_in, 256), nn.ReLU(), nn.Linear(256, len(ANSWERS)))
        if std is not None:
            for layer in (self.cells, self.key, self.value, self.query):
                nn.init.normal_(layer.weight, std=std)
                nn.init.zeros_(layer.bias)

    def param_groups(self, lr: float) -> list[dict]:
        return text_tower_groups(self, self.text, lr, self.text_lr_scale)

    def attention_maps(self, images, question) -> torch.Tensor | None:
        """The read's attention over the cells (N, 1, h, w), as mm_fusion's `image_maps` gives its own; None for the
        `mm_block` readouts (their attention is inside mm_fusion's layer)."""
        if self.readout.startswith("mm_block"):
            return None
        self(images, question)
        return self.last_weights

    def forward(self, images, question):
        maps = self.tower(images)
        batch, _, height, width = maps.shape
        if self.positions == "coordinates":
            maps = torch.cat([maps, coordinates(batch, height, width)], dim=1)
        cells = self.cells(maps.flatten(2).transpose(1, 2))
        if self.positions == "sine":
            cells = cells + sine_positions(height, width, cells.shape[-1])
        cells = self.norm(cells)
        if self.text is not None:
            tokens = self.text(input_ids=question_ids(question)).last_hidden_state  # (B, 3, 96)
        else:
            tokens = question.unsqueeze(1)  # (B, 1, 12)
        if self.readout.startswith("mm_block"):
            states, _, _ = self.block(self.text_in(tokens), cells, None, None)
            return self.mlp(states.mean(1))
        q, k, v = self.query(tokens), self.key(cells), self.value(cells)
        heads, size = self.heads, q.shape[-1] // self.heads
        q, k, v = (x.view(batch, -1, heads, size).transpose(1, 2) for x in (q, k, v))  # (B, heads, n, size)
        weights = (q @ k.transpose(-1, -2) / size**0.5).softmax(-1)
        self.last_weights = weights.mean((1, 2)).view(batch, 1, height, width)  # heads and queries averaged
        read = (weights @ v).transpose(1, 2).reshape(batch, tokens.shape[1], -1)  # (B, queries, width)
        if self.readout == "residual_mean":
            return self.mlp((tokens + self.out(read)).mean(1))
        return self.mlp(torch.cat([read.mean(1), tokens.mean(1)], dim=1))


class Zero(nn.Module):
    """In place of a residual branch: adds nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


class NoAttention(nn.Module):
    """In place of an attention: adds nothing (its output zero, no probabilities)."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, None]:
        return torch.zeros_like(hidden_states), None


class PlusPositions(nn.Module):
    """A value map that adds the image tokens' positions (set per call in `positions`) to its input first."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear
        self.positions: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x if self.positions is None else x + self.positions)


class ValuePositions(nn.Module):
    """A fusion layer's text block whose cross-attention gets the image tokens' positions in its values only: the
    keys are the cells' features, so a question can select cells by what is in them (colour, shape), not by where
    they are, and the position of what it selected comes back in the read. mm_fusion's block with
    `sine_attention` adds them to the keys too. The same modules and parameters, the value map wrapped."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        block.cross_attn.v_proj = PlusPositions(block.cross_attn.v_proj)

    @property
    def cross_attn(self) -> nn.Module:  # where mm_fusion.image_maps reads the attention (from the keys alone)
        return self.block.cross_attn

    def forward(self, hidden_states, context, self_mask, context_mask, context_index=None, output_attentions=False,
                positions=None, context_positions=None):  # fmt: skip
        value_map = self.block.cross_attn.v_proj
        value_map.positions = context_positions
        try:
            return self.block(hidden_states, context, self_mask, context_mask, context_index, output_attentions)
        finally:
            value_map.positions = None


class CoordinateStem(nn.Module):
    """The tower's first convolution with the pixel's (x, y) in [-1, 1] appended to its input as two more channels
    (CoordConv, arXiv:1807.03247): after its ReLU the stem's features are functions of colour and position together, so
    a mixture of every cell tells where each colour is, as the mixture tells each colour's shape. The colour channels'
    weights are the convolution's own; the coordinate channels' are drawn as PyTorch draws a new convolution's."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.conv = nn.Conv2d(
            conv.in_channels + 2, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
            bias=conv.bias is not None,
        )  # fmt: skip
        with torch.no_grad():
            self.conv.weight[:, : conv.in_channels] = conv.weight
            if conv.bias is not None:
                self.conv.bias.copy_(conv.bias)

    def forward(self, pixels):
        grid = coordinates(pixels.shape[0], *pixels.shape[-2:]).to(pixels)
        return self.conv(torch.cat([pixels, grid], dim=1))


class ImageSelfFirst(nn.Module):
    """A text-to-image fusion layer whose image stream first attends to itself (self-attention and MLP, pre-norm, the
    image positions added after the LayerNorm as `sine_attention` does): question-independent, so once per image. The
    layer's text then reads the updated image tokens."""

    def __init__(self, layer: nn.Module, config, zero_init: bool = False):
        super().__init__()
        from mm_fusion.modeling_mm_fusion import MMFusionAttention

        width, eps = config.fusion_hidden_size, config.layer_norm_eps
        self.layer = layer
        self.self_attn_norm, self.self_attn = nn.LayerNorm(width, eps=eps), MMFusionAttention(config)
        self.mlp_norm = nn.LayerNorm(width, eps=eps)
        self.mlp = nn.Sequential(
            nn.Linear(width, config.fusion_intermediate_size),
            nn.GELU(),
            nn.Linear(config.fusion_intermediate_size, width),
        )
        self.dropout = nn.Dropout(config.fusion_dropout)
        if zero_init:  # both residual branches start at zero: at step 0 the model is the layer alone
            for last in (self.self_attn.out_proj, self.mlp[2]):
                nn.init.zeros_(last.weight)
                nn.init.zeros_(last.bias)

    @property
    def text_block(self):
        return self.layer.text_block

    @property
    def image_block(self):
        return self.layer.image_block

    def forward(self, text, image, text_mask, image_index=None, output_attentions=False, image_positions=None):
        x = self.self_attn_norm(image)
        x = x + image_positions if image_positions is not None else x
        image = image + self.dropout(self.self_attn(x, x)[0])
        image = image + self.dropout(self.mlp(self.mlp_norm(image)))
        return self.layer(
            text, image, text_mask, image_index, output_attentions=output_attentions, image_positions=image_positions
        )


class MMFusion(nn.Module):
    """The recipe's model; the question as token ids [CLS, colour, family] (no tokenizer)."""

    def __init__(
        self,
        initializer_range: float = 0.02,
        image_norms: bool = True,
        film_default_init: bool = False,
        one_hot_text: bool = False,
        torch_init: bool = False,
        film_init_std: float | None = None,
        text_lr_scale: float = 1.0,
        read_head: bool = False,
        text_norm: bool = True,
        head: str = "mm",
        attention_sharpness: float = 1.0,
        text_bridge_norm: bool = True,
        image_bridge: bool = True,
        normalise: bool = True,
        image_self_attention: bool | str = False,
        block_mlp: bool = True,
        later_layers_zero: bool = False,
        text_self_attention: bool = True,
        uniform_read: bool = False,
        positions_in_values: bool = False,
        stem_coordinates: bool = False,
        **overrides,
    ):
        super().__init__()
        from mm_fusion import MMFusionForImageTextClassification

        config = recipe_config(**overrides)
        config.initializer_range = config.text_config.initializer_range = initializer_range
        self.model = MMFusionForImageTextClassification(config)
        if film_default_init:
            for layer in self.model.mm_fusion.vision_encoder.vision_film.maps:
                layer.reset_parameters()
        if film_init_std is not None:
            for layer in self.model.mm_fusion.vision_encoder.vision_film.maps:
                nn.init.normal_(layer.weight, std=film_init_std)
        if torch_init:  # every linear / 1x1 layer outside the towers and FiLM as PyTorch draws a new one
            base = self.model.mm_fusion
            towers = {id(m) for tower in (base.vision_model, base.text_model) for m in tower.modules()}
            film_maps = base.vision_encoder.vision_film
            film = {id(m) for m in film_maps.modules()} if film_maps is not None else set()
            for module in self.model.modules():
                if isinstance(module, (nn.Linear, nn.Conv2d)) and id(module) not in towers | film:
                    module.reset_parameters()
        if one_hot_text:
            self.model.mm_fusion.text_model = OneHotText(config.text_config.hidden_size)
        if not image_norms:
            encoder = self.model.mm_fusion.encoder
            encoder.image_bridge_norms = nn.ModuleList(nn.Identity() for _ in encoder.image_bridge_norms)
            for layer in encoder.layers:
                layer.text_block.context_norm = nn.Identity()
        if read_head:  # the read's head: no LayerNorm on the pooled text, a ReLU MLP without LayerNorm
            head, text_norm = "relu_mlp", False
        if head == "relu_mlp":  # the read's ReLU MLP in place of mm_fusion's head
            width = config.fusion_hidden_size * {"text": 1, "concat": 2, "concat_product": 3}[config.joint_pooling]
            self.model.classifier = nn.Sequential(nn.Linear(width, 256), nn.ReLU(), nn.Linear(256, len(ANSWERS)))
        elif head == "mm_no_norm":  # mm_fusion's head without its inner LayerNorm: Linear, GELU, dropout, Linear
            self.model.classifier.norm = nn.Identity()
        encoder = self.model.mm_fusion.encoder
        if not text_bridge_norm:  # the text tower's tokens enter the fusion without the bridge's LayerNorm
            encoder.text_bridge_norms = nn.ModuleList(nn.Identity() for _ in encoder.text_bridge_norms)
        if not image_bridge:  # the image tokens (1x1 projection plus positions) enter without the bridge's linear map
            encoder.image_bridges = nn.ModuleList(nn.Identity() for _ in encoder.image_bridges)
        if attention_sharpness != 1.0:  # the text-to-image logits times this (1: d ** -0.5)
            for layer in encoder.layers:
                layer.text_block.cross_attn.scaling *= attention_sharpness
        if not block_mlp:  # no MLP after the text's cross-attention: the text stream is each token plus its reads
            for layer in encoder.layers:
                layer.text_block.mlp = Zero()
        if later_layers_zero:  # each fusion layer after the first adds nothing at step 0 (its last maps zero)
            for layer in encoder.layers[1:]:
                block = layer.text_block
                for last in (block.self_attn.out_proj, block.cross_attn.out_proj, block.mlp[2]):
                    nn.init.zeros_(last.weight)
                    nn.init.zeros_(last.bias)
        if not text_self_attention:  # the text tokens read the image without first attending to each other
            for layer in encoder.layers:
                layer.text_block.self_attn = NoAttention()
        if uniform_read:  # the cross-attention's queries drawn as zero: at step 0 every token reads every cell alike
            for layer in encoder.layers:
                nn.init.zeros_(layer.text_block.cross_attn.q_proj.weight)
                nn.init.zeros_(layer.text_block.cross_attn.q_proj.bias)
        if positions_in_values:  # the image positions in the cross-attention's values, not its keys
            for layer in encoder.layers:
                layer.text_block = ValuePositions(layer.text_block)
        if stem_coordinates:  # (x, y) into the tower's first convolution (CoordConv)
            stem = self.model.mm_fusion.vision_model.embedder.embedder
            stem.convolution = CoordinateStem(stem.convolution)
        if image_self_attention:  # each layer's image stream attends to itself first (once per image), then is read
            zero = image_self_attention == "zero_init"  # its residual branches drawn as zero
            encoder.layers = nn.ModuleList(ImageSelfFirst(layer, config, zero_init=zero) for layer in encoder.layers)
        if not text_norm:  # no LayerNorm on the fused text stream before it is pooled
            encoder.text_norm = nn.Identity()
        # Without `normalise`, the pixels in [0, 1] as the hand-written contenders see them, not ImageNet-normalised.
        self.register_buffer("mean", torch.tensor(config.image_mean if normalise else [0.0] * 3).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(config.image_std if normalise else [1.0] * 3).view(1, 3, 1, 1))
        self.text_lr_scale = text_lr_scale

    def param_groups(self, lr: float) -> list[dict]:
        return text_tower_groups(self, self.model.mm_fusion.text_model, lr, self.text_lr_scale)

    def forward(self, images, question):
        return self.model(pixel_values=(images - self.mean) / self.std, input_ids=question_ids(question)).logits

    def attention_maps(self, images, question) -> torch.Tensor | None:
        """The text-to-image attention per fusion layer (N, layers, h, w), or None for a late model."""
        if self.model.config.fusion_type == "late":
            return None
        from mm_fusion.image_maps import image_maps

        pixel_values, input_ids = (images - self.mean) / self.std, question_ids(question)
        return image_maps(self.model, pixel_values, input_ids, method="attention").maps


# The late model with FiLM and the flattened tokens (the closest mm_fusion gets to `film_resnet`), and the four fixes
# the `film_resnet_*` rungs found (results/sort_of_clevr_ladder.md; positions are the fourth).
LATE_FILM = {"config_overrides": "vision_film=true,image_pooling=flatten", "fusion_type": "late"}
LATE_FILM_NO_POSITIONS = LATE_FILM | {
    "config_overrides": LATE_FILM["config_overrides"] + ",vision_position_embedding=none"
}
FIXES = {"film_default_init": True, "torch_init": True, "text_lr_scale": 0.1}
# The same fixes through mm_fusion's own options (`vision_film_init`, `fusion_init`; `text_tower_lr_scale` is the
# training argument `text_lr_scale` stands for here), as `scripts/train.py` sets them.
OPTIONS = LATE_FILM_NO_POSITIONS | {
    "config_overrides": LATE_FILM_NO_POSITIONS["config_overrides"] + ",vision_film_init=pytorch,fusion_init=pytorch",
    "text_lr_scale": 0.1,
}


# The climb: from `attention`, which learns, toward mm_fusion's fusion block, one difference at a time.
CLIMB = {
    "climb_heads4": {"heads": 4},
    "climb_sine": {"heads": 4, "positions": "sine"},
    "climb_width96": {"heads": 4, "positions": "sine", "width": 96},
    "climb_text": {"heads": 4, "positions": "sine", "width": 96, "query": "text", "text_lr_scale": 0.1},
    "climb_text_full_lr": {"heads": 4, "positions": "sine", "width": 96, "query": "text"},
    "climb_residual": {
        "heads": 4,
        "positions": "sine",
        "width": 96,
        "query": "text",
        "text_lr_scale": 0.1,
        "readout": "residual_mean",
    },
}
CLIMB_READ = CLIMB["climb_residual"]
CLIMB |= {
    "climb_resnet_stem": CLIMB_READ | {"tower": "resnet_stem"},
    "climb_resnet": CLIMB_READ | {"tower": "resnet"},
    "climb_resnet2": CLIMB_READ | {"tower": "resnet2"},
    "climb_std002": CLIMB_READ | {"std": 0.02},
    "climb_layernorm": CLIMB_READ | {"norm": True},
    "climb_stem_layernorm": CLIMB_READ | {"tower": "resnet_stem", "norm": True},
    # mm_fusion's fusion layer (self-attention, LayerNorms on queries and context, cross-attention, MLP) as the read.
    "climb_stem_mm_block": CLIMB_READ | {"tower": "resnet_stem", "readout": "mm_block"},
    "climb_stem_mm_block_no_context_norm": CLIMB_READ
    | {"tower": "resnet_stem", "readout": "mm_block_no_context_norm"},
}

# The recipe's model (scripts/configs/sort_of_clevr_hierarchical.yaml) as the library builds it now: one text-to-image
# layer on the stem, no image bridge, the text stream alone, the sine positions after the LayerNorms.
RECIPE_SINE = (
    "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],joint_pooling=text,"
    "feature_map_bridge=false,vision_position_embedding=sine_attention"
)

# The same reading the text tower's embeddings (hidden state 0) instead of its last layer.
RECIPE_SINE_EMBEDDINGS = RECIPE_SINE.replace("text_bridge_layers=[2]", "text_bridge_layers=[0]")

# The same with the pooled image and its product with the pooled text beside the pooled text, for co-attention.
RECIPE_BIDIRECTIONAL = RECIPE_SINE.replace("joint_pooling=text", "joint_pooling=concat_product")

# mm_fusion's own hierarchical model (no FiLM) with the fixes the climb points to, through its options.
MM_HIERARCHICAL = {
    "mm_hier_fixes": {"config_overrides": "fusion_init=pytorch", "text_lr_scale": 0.1},
    "mm_hier_fixes_no_image_norms": {
        "config_overrides": "fusion_init=pytorch",
        "text_lr_scale": 0.1,
        "image_norms": False,
    },
    "mm_hier_fixes_coordinates": {
        "config_overrides": "fusion_init=pytorch,vision_position_embedding=coordinates",
        "text_lr_scale": 0.1,
    },
    "mm_hier_fixes_stage1": {
        "config_overrides": "fusion_init=pytorch,vision_bridge_layers=[1,2]",
        "text_lr_scale": 0.1,
    },
    "mm_hier_fixes_stem": {
        "config_overrides": "fusion_init=pytorch,vision_bridge_layers=[0,1]",
        "text_lr_scale": 0.1,
    },
    "mm_hier_fixes_stem_no_image_norms": {
        "config_overrides": "fusion_init=pytorch,vision_bridge_layers=[0,1]",
        "text_lr_scale": 0.1,
        "image_norms": False,
    },
    # Everything the read that learns has and mm_fusion's block lacks, at once (then taken back one at a time): no
    # LayerNorms on the image tokens, the joint vector the text stream alone, no dropout.
    "mm_hier_read_like": {
        "config_overrides": "fusion_init=pytorch,vision_bridge_layers=[0,1],joint_pooling=text,fusion_dropout=0.0,"
        "classifier_dropout=0.0",
        "text_lr_scale": 0.1,
        "image_norms": False,
    },
    # One fusion layer reading the stem: the block that learns as a read (climb_stem_mm_block), in mm_fusion's model.
    "mm_hier_one_layer_stem_read_like": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],"
        "joint_pooling=text",
        "text_lr_scale": 0.1,
        "image_norms": False,
    },
    "mm_hier_one_layer_stem_read_like_read_head": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],"
        "joint_pooling=text",
        "text_lr_scale": 0.1,
        "image_norms": False,
        "read_head": True,
    },
    "mm_hier_one_layer_stem_read_like_no_text_norm": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],"
        "joint_pooling=text",
        "text_lr_scale": 0.1,
        "image_norms": False,
        "text_norm": False,
    },
    "mm_hier_one_layer_stem_read_like_read_head_coordinates": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],"
        "joint_pooling=text,vision_position_embedding=coordinates",
        "text_lr_scale": 0.1,
        "image_norms": False,
        "read_head": True,
    },
    "mm_hier_one_layer_stem_read_like_read_head_sharp4": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],"
        "joint_pooling=text",
        "text_lr_scale": 0.1,
        "image_norms": False,
        "read_head": True,
        "attention_sharpness": 4.0,
    },
    "mm_hier_one_layer_stem_read_like_read_head_no_text_bridge_norm": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],"
        "joint_pooling=text",
        "text_lr_scale": 0.1,
        "image_norms": False,
        "read_head": True,
        "text_bridge_norm": False,
    },
    "mm_hier_one_layer_stem_read_like_read_head_no_image_bridge": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],"
        "joint_pooling=text",
        "text_lr_scale": 0.1,
        "image_norms": False,
        "read_head": True,
        "image_bridge": False,
    },
    "mm_hier_one_layer_stem_read_like_no_image_bridge": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],"
        "joint_pooling=text",
        "text_lr_scale": 0.1,
        "image_norms": False,
        "image_bridge": False,
    },
    "mm_hier_one_layer_stem_read_like_relu_head": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],"
        "joint_pooling=text",
        "text_lr_scale": 0.1,
        "image_norms": False,
        "head": "relu_mlp",
    },
    "mm_hier_one_layer_stem_read_like_head_no_norm": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],"
        "joint_pooling=text",
        "text_lr_scale": 0.1,
        "image_norms": False,
        "head": "mm_no_norm",
    },
    "mm_hier_one_layer_stem_read_like_unnormalised": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],"
        "joint_pooling=text",
        "text_lr_scale": 0.1,
        "image_norms": False,
        "normalise": False,
    },
    "mm_hier_one_layer_stem": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2]",
        "text_lr_scale": 0.1,
    },
    # The image stream attends to the question too (co-attention, the config's default direction), and the joint
    # vector keeps the image stream's mean (mm_fusion's "concat"): each cell can be conditioned on the question, as
    # FiLM conditions them, before any read has to be sharp.
    "mm_hier_one_layer_stem_bidirectional": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2]",
        "text_lr_scale": 0.1,
        "fusion_direction": "bidirectional",
    },
    "mm_hier_stem_stage1_bidirectional": {
        "config_overrides": "fusion_init=pytorch,vision_bridge_layers=[0,1]",
        "text_lr_scale": 0.1,
        "fusion_direction": "bidirectional",
    },
    # mm_fusion's one-layer stem model as the library builds it (its norms, head and joint vector), without the image
    # bridge's linear map after the tokens' 1x1 projection.
    "mm_hier_one_layer_stem_no_image_bridge": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2]",
        "text_lr_scale": 0.1,
        "image_bridge": False,
    },
    "mm_hier_fixes_bidirectional": {
        "config_overrides": "fusion_init=pytorch",
        "text_lr_scale": 0.1,
        "fusion_direction": "bidirectional",
    },
    # Which of the library model's other differences keeps its attention off the object once the bridge is gone: its
    # LayerNorms on the image tokens (taken out), or the pooled image stream in its joint vector (the text alone).
    "mm_hier_one_layer_stem_no_image_bridge_no_image_norms": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2]",
        "text_lr_scale": 0.1,
        "image_bridge": False,
        "image_norms": False,
    },
    "mm_hier_one_layer_stem_no_image_bridge_joint_text": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],"
        "joint_pooling=text",
        "text_lr_scale": 0.1,
        "image_bridge": False,
    },
    # The model of scripts/configs/sort_of_clevr_hierarchical.yaml through the library's options: no bridge
    # after the tokens' projection (`feature_map_bridge=False`), the text stream alone as the joint vector.
    "mm_hier_one_layer_stem_recipe": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],"
        "joint_pooling=text,feature_map_bridge=false",
        "text_lr_scale": 0.1,
    },
    # Position: the recipe's model with its tokens' sine positions added after the
    # LayerNorms (before the cross-attention's keys and values) rather than before them (the library's
    # `sine_attention`; first run as a wrapper around the context LayerNorm, which gave the same logits from the same
    # weights).
    "mm_hier_one_layer_stem_recipe_positions_after_norm": {"config_overrides": RECIPE_SINE, "text_lr_scale": 0.1},
    # Relations: a second text-to-image layer reading the stem again (the first finds the named object, the second
    # can look from there), with the positions after the LayerNorms through the library's option.
    "mm_hier_two_layers_stem_sine_attention": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=2,vision_bridge_layers=[0,0],"
        "text_bridge_layers=[2,2],joint_pooling=text,feature_map_bridge=false,vision_position_embedding=sine_attention",
        "text_lr_scale": 0.1,
    },
    # The same, the second layer's residual branches drawn as zero: at step 0 the one-layer model, so the first read
    # is not slowed while the second grows.
    "mm_hier_two_layers_stem_second_zero_init": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=2,vision_bridge_layers=[0,0],"
        "text_bridge_layers=[2,2],joint_pooling=text,feature_map_bridge=false,vision_position_embedding=sine_attention",
        "text_lr_scale": 0.1,
        "later_layers_zero": True,
    },
    # Relations, question-independent: the image stream attends to itself (once per image) before the text reads it.
    "mm_hier_one_layer_stem_image_self_attention": {
        "config_overrides": RECIPE_SINE,
        "text_lr_scale": 0.1,
        "image_self_attention": True,
    },
    # The same with the self-attention's and its MLP's last layers drawn as zero: at step 0 the recipe's model, so the
    # first read is not slowed while the image stream's own attention grows.
    "mm_hier_one_layer_stem_image_self_attention_zero_init": {
        "config_overrides": RECIPE_SINE,
        "text_lr_scale": 0.1,
        "image_self_attention": "zero_init",
    },
    "mm_hier_one_layer_stem_recipe_no_block_mlp": {
        "config_overrides": RECIPE_SINE,
        "text_lr_scale": 0.1,
        "block_mlp": False,
    },
    # The first read's query from the text tower's embeddings (hidden state 0), not its last layer: the colour word's
    # query is then the same whatever the family asks, so the read that shape questions learn serves left / top too.
    "mm_hier_one_layer_stem_recipe_text_embeddings": {
        "config_overrides": RECIPE_SINE_EMBEDDINGS,
        "text_lr_scale": 0.1,
    },
    # A read that does not depend on the question's family: the slow seed's shape questions find the
    # object and its left / top questions do not, so the colour token's query differs by family. Without the fusion
    # layer's text self-attention, the tokens read the image as the text tower leaves them (layer 2: still mixed by the
    # tower's own attention) ...
    "mm_hier_one_layer_stem_recipe_no_text_self_attention": {
        "config_overrides": RECIPE_SINE,
        "text_lr_scale": 0.1,
        "text_self_attention": False,
    },
    # ... or as the tower's embeddings (hidden state 0): the colour token's query is then the colour's alone.
    "mm_hier_one_layer_stem_recipe_embeddings_no_text_self_attention": {
        "config_overrides": RECIPE_SINE_EMBEDDINGS,
        "text_lr_scale": 0.1,
        "text_self_attention": False,
    },
    # ... or with both attentions, the image read first (as the layer's input leaves the tokens), then the tokens'
    # self-attention, which can bring the colour token's read to the family's.
    "mm_hier_one_layer_stem_recipe_embeddings_cross_first": {
        "config_overrides": RECIPE_SINE_EMBEDDINGS + ",fusion_layer_order=cross_first",
        "text_lr_scale": 0.1,
    },
    # The relational questions: the image tokens attend to each other before the words read them
    # (question-free, once per image), so an object's cell can gather its nearest and furthest object for the read.
    "mm_hier_one_layer_stem_recipe_embeddings_cross_first_image_self_attention": {
        "config_overrides": RECIPE_SINE_EMBEDDINGS + ",fusion_layer_order=cross_first",
        "text_lr_scale": 0.1,
        "image_self_attention": True,
    },
    # Over seeds: the recipe's model with the text tower at the full learning rate (its states, from
    # which the read's queries come, then move as fast as the read), ...
    "mm_hier_one_layer_stem_recipe_text_full_lr": {"config_overrides": RECIPE_SINE, "text_lr_scale": 1.0},
    # ... and with the cross-attention's query map drawn as zero, so that every family starts from the same uniform
    # read rather than from a random one of its own.
    "mm_hier_one_layer_stem_recipe_uniform_read": {
        "config_overrides": RECIPE_SINE,
        "text_lr_scale": 0.1,
        "uniform_read": True,
    },
    # ... and with one attention head in place of four (the whole width reads one map: the 4-head hand-written read
    # had not left the prior on left where the 1-head one had).
    "mm_hier_one_layer_stem_recipe_one_head": {
        "config_overrides": RECIPE_SINE + ",fusion_num_attention_heads=1",
        "text_lr_scale": 0.1,
    },
    # ... and with the positions in the cross-attention's values only, not its keys: a question can then pick cells
    # only by their content, so the left / top questions cannot learn a read of their own by position (seed 3 learned
    # top 2,500 steps after shape, left not by 8,000, each family's attention reaching the object on its own).
    "mm_hier_one_layer_stem_recipe_positions_in_values": {
        "config_overrides": RECIPE_SINE,
        "text_lr_scale": 0.1,
        "positions_in_values": True,
    },
    # The recipe's model with (x, y) appended to the pixels into the tower's first convolution (CoordConv): position
    # mixed with colour in the stem's features, as FiLM's flattened read has it by construction; and the same without
    # the sine positions (the position only in the features).
    "mm_hier_one_layer_stem_recipe_stem_coordinates": {
        "config_overrides": RECIPE_SINE,
        "text_lr_scale": 0.1,
        "stem_coordinates": True,
    },
    "mm_hier_one_layer_stem_recipe_stem_coordinates_no_positions": {
        "config_overrides": RECIPE_SINE.replace(
            "vision_position_embedding=sine_attention", "vision_position_embedding=none"
        ),
        "text_lr_scale": 0.1,
        "stem_coordinates": True,
    },
    # Co-attention on the recipe: the image tokens also read the question (self-attention, cross-attention to the
    # text, MLP), and the head reads the pooled text, the pooled image and their product, so that a question-marked
    # mixture of the cells can tell where the named object is, as FiLM's question-scaled features do.
    "mm_hier_one_layer_stem_recipe_bidirectional": {
        "config_overrides": RECIPE_BIDIRECTIONAL,
        "fusion_direction": "bidirectional",
        "text_lr_scale": 0.1,
    },
    "mm_hier_one_layer_stem_recipe_bidirectional_stem_coordinates": {
        "config_overrides": RECIPE_BIDIRECTIONAL,
        "fusion_direction": "bidirectional",
        "text_lr_scale": 0.1,
        "stem_coordinates": True,
    },
    # FiLM and the read together: the recipe's model with its tower's stages scaled and shifted by the question
    # (`vision_film`, drawn as PyTorch draws it), its text-to-image layer reading stage 1 (16 x 16, after FiLM; the
    # stem is before it), so that the cells the question names stand out before the read looks for them.
    "mm_hier_one_layer_stage1_recipe_film": {
        "config_overrides": RECIPE_SINE.replace("vision_bridge_layers=[0]", "vision_bridge_layers=[1]")
        + ",vision_film=true,vision_film_init=pytorch",
        "text_lr_scale": 0.1,
    },
    # The recipe's model as it was (positions before the LayerNorms) with the read's head.
    "mm_hier_one_layer_stem_recipe_read_head": {
        "config_overrides": "fusion_init=pytorch,num_fusion_layers=1,vision_bridge_layers=[0],text_bridge_layers=[2],"
        "joint_pooling=text,feature_map_bridge=false",
        "text_lr_scale": 0.1,
        "read_head": True,
    },
}


def build_variant(name: str) -> nn.Module:
    """A new model of the contender `name` (see the module doc)."""
    models = {
        "cnn_mlp": lambda: CNNMLP(),
        "film": lambda: FiLM(),
        "film_resnet": lambda: FiLMResNet(),
        "film_resnet_text": lambda: FiLMResNet(text_tower=True),
        "film_resnet_zero_film": lambda: FiLMResNet(zero_film=True),
        "film_resnet_frozen_text": lambda: FiLMResNet(text_tower=True, freeze_text=True),
        "film_resnet_text_lr01": lambda: FiLMResNet(text_tower=True, text_lr_scale=0.1),
        "film_resnet_normalised": lambda: FiLMResNet(normalise=True),
        "film_resnet_tokens": lambda: FiLMResNet(tokens=True),
        "film_resnet_mm_head": lambda: FiLMResNet(mm_head=True),
        "film_resnet_tokens_torch_init": lambda: FiLMResNet(tokens=True, mm_init=False),
        "film_resnet_tokens_no_positions": lambda: FiLMResNet(tokens=True, token_positions=False),
        "film_resnet_mm_head_torch_init": lambda: FiLMResNet(mm_head=True, mm_init=False),
        "attention": lambda: AttentionRead(),
        "attention_std002": lambda: AttentionRead(std=0.02),
        "attention_sine": lambda: AttentionRead(positions="sine"),
        "attention_layernorm": lambda: AttentionRead(norm=True),
        "attention_resnet": lambda: AttentionRead(tower="resnet"),
        **{name: (lambda options=options: AttentionRead(**options)) for name, options in CLIMB.items()},
        **{name: (lambda options=options: MMFusion(**options)) for name, options in MM_HIERARCHICAL.items()},
        "mm_fusion": lambda: MMFusion(),
        "mm_fusion_std01": lambda: MMFusion(initializer_range=0.1),
        "mm_fusion_film": lambda: MMFusion(config_overrides="vision_film=true"),
        "mm_fusion_late_film": lambda: MMFusion(config_overrides="vision_film=true", fusion_type="late"),
        "mm_fusion_film_flatten": lambda: MMFusion(**LATE_FILM),
        "mm_fusion_no_image_norms": lambda: MMFusion(image_norms=False),
        "mm_fusion_film_flatten_default_init": lambda: MMFusion(**LATE_FILM, film_default_init=True),
        "mm_fusion_film_flatten_one_hot": lambda: MMFusion(**LATE_FILM, one_hot_text=True),
        "mm_fusion_film_flatten_one_hot_default_init": lambda: MMFusion(
            **LATE_FILM, one_hot_text=True, film_default_init=True
        ),
        "mm_fusion_film_flatten_one_hot_film_std015_torch_init": lambda: MMFusion(
            **LATE_FILM, one_hot_text=True, film_init_std=0.15, torch_init=True
        ),
        "mm_fusion_film_flatten_fixes_one_hot": lambda: MMFusion(
            **LATE_FILM_NO_POSITIONS, one_hot_text=True, film_init_std=0.15, torch_init=True
        ),
        "mm_fusion_film_flatten_fixes": lambda: MMFusion(**LATE_FILM_NO_POSITIONS, **FIXES),
        "mm_fusion_film_flatten_options": lambda: MMFusion(**OPTIONS),
        "mm_fusion_film_fixes": lambda: MMFusion(
            config_overrides="vision_film=true,vision_position_embedding=none", **FIXES
        ),
        "mm_fusion_film_fixes_no_image_norms": lambda: MMFusion(
            config_overrides="vision_film=true,vision_position_embedding=none", **FIXES, image_norms=False
        ),
        "mm_fusion_film_flatten_one_hot_torch_init": lambda: MMFusion(**LATE_FILM, one_hot_text=True, torch_init=True),
    }
    return models[name]()


@torch.no_grad()
def evaluate(model: nn.Module, test: dict) -> dict[str, float]:
    model.eval()
    correct = []
    for start in range(0, len(test["answer"]), 512):
        rows = slice(start, start + 512)
        logits = model(
            test["images"][test["image"][rows]], one_hot_question(test["colour"][rows], test["family"][rows])
        )
        correct.append(logits.argmax(-1) == test["answer"][rows])
    on_object = attention_on_object(model, test) if hasattr(model, "attention_maps") else None
    model.train()
    correct = torch.cat(correct).float()
    result = {family: round(correct[test["family"] == f].mean().item(), 4) for f, family in enumerate(FAMILIES)}
    by_type = {
        "non_relational": [result[f] for f in NON_RELATIONAL],
        "relational": [result[f] for f in FAMILIES if f not in NON_RELATIONAL],
    }
    accuracy = {kind: round(sum(v) / len(v), 4) for kind, v in by_type.items()} | result
    return accuracy if on_object is None else accuracy | on_object


def attention_on_object(model: nn.Module, test: dict, count: int = 600) -> dict[str, float] | None:
    """The share of the last fusion layer's text-to-image attention (heads and text tokens averaged) on the cells of
    the named object's square, over the first `count` non-relational questions (`on_object`) and per family among them
    (`on_object_shape`, `on_object_horizontal`, `on_object_vertical`): near the square's share of the image (about
    2.5%) when the model answers without finding the object."""
    rows = torch.nonzero(torch.isin(test["family"], torch.tensor([FAMILIES.index(f) for f in NON_RELATIONAL])))[
        :count, 0
    ]
    with torch.no_grad():
        maps = model.attention_maps(
            test["images"][test["image"][rows]], one_hot_question(test["colour"][rows], test["family"][rows])
        )
    if maps is None:  # a late model: no cross-attention
        return None
    maps = maps[:, -1]  # (N, h, w)
    height, width = maps.shape[-2:]
    ys = (torch.arange(height) + 0.5) * IMAGE_SIZE / height
    xs = (torch.arange(width) + 0.5) * IMAGE_SIZE / width
    centre = test["centre"][rows]
    inside_x = (xs[None, :] - centre[:, :1]).abs() <= OBJECT_SIZE / 2
    inside_y = (ys[None, :] - centre[:, 1:]).abs() <= OBJECT_SIZE / 2
    inside = inside_y[:, :, None] & inside_x[:, None, :]
    share = (maps * inside).sum((1, 2))
    family = test["family"][rows]
    per_family = {f"on_object_{f}": round(share[family == FAMILIES.index(f)].mean().item(), 4) for f in NON_RELATIONAL}
    return {"on_object": round(share.mean().item(), 4)} | per_family


def train_variant(name: str, train: dict, test: dict, args) -> dict:
    torch.manual_seed(args.seed)
    model = build_variant(name)
    groups = model.param_groups(args.learning_rate) if hasattr(model, "param_groups") else model.parameters()
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    evaluations, step, start = [], 0, time.perf_counter()
    while step < args.steps:
        order = torch.randperm(len(train["answer"]), generator=generator, device="cpu").to(train["answer"].device)
        for begin in range(0, len(order) - args.batch_size + 1, args.batch_size):
            rows = order[begin : begin + args.batch_size]
            logits = model(
                train["images"][train["image"][rows]], one_hot_question(train["colour"][rows], train["family"][rows])
            )
            loss = F.cross_entropy(logits, train["answer"][rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.eval_every == 0 or step == args.steps:
                seconds = time.perf_counter() - start
                evaluations.append({"step": step, "seconds": round(seconds, 1), **evaluate(model, test)})
                print(name, evaluations[-1], flush=True)
            if step == args.steps:
                break
    return {"variant": name, "evaluations": evaluations}


def run_name(run: dict) -> str:
    """The variant, with its seed when not 0 (the seed draws the scenes and the initialisation)."""
    seed = run.get("settings", {}).get("seed", 0)
    return run["variant"] if not seed else f"{run['variant']} (seed {seed})"


def first_step(evaluations: list[dict], key: str, threshold: float) -> int | None:
    return next((e["step"] for e in evaluations if e[key] >= threshold), None)


def plot(runs: list[dict], path: Path) -> None:
    """Learning curves of "is the <colour> object on the left" (the diagnostic question: the prior is 0.5 until a model
    finds the object by its colour), one panel per group of variants."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def seed(run):
        return run.get("settings", {}).get("seed", 0)

    def library(run):  # a model mm_fusion builds (its name says so), not a hand-written contender
        return run["variant"].startswith(("mm_fusion", "mm_hier"))

    groups = [
        (f"{kind}, {seeds}", [r for r in runs if library(r) == is_library and (seed(r) == 0) == first_seed])
        for kind, is_library in (("hand-written contenders", False), ("mm_fusion models", True))
        for seeds, first_seed in (("seed 0", True), ("other seeds", False))
    ]
    groups = [(title, members) for title, members in groups if members]
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 7.5), sharey=True, squeeze=False)
    for ax, (title, members) in zip(axes[0], groups):
        for k, run in enumerate(members):
            steps = [e["step"] for e in run["evaluations"]]
            ax.plot(
                steps, [e["horizontal"] for e in run["evaluations"]], color=plt.cm.tab20(k % 20),
                linestyle="-" if k < 20 else "--", marker=".", linewidth=1, label=run_name(run),
            )  # fmt: skip
        ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step (64 questions each)")
        ax.set_ylim(0.3, 1.02)
        ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1, frameon=False)
    axes[0][0].set_ylabel('held-out accuracy, "is the <colour> object on the left"')
    fig.suptitle("Sort-of-CLEVR diagnostic ladder (question-only prior dotted)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_by_variant(runs: list[dict], path: Path) -> None:
    """The same curves for reports of many seeds: one panel per variant, a line per seed (the spread over seeds, not
    one draw, is what tells rungs apart: results/sort_of_clevr_ladder.md)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(run["variant"] for run in runs))
    columns = min(4, len(variants))
    rows = -(-len(variants) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), sharey=True, squeeze=False)
    for ax, variant in zip(axes.flat, variants):
        for run in (r for r in runs if r["variant"] == variant):
            evaluations, settings = run["evaluations"], run.get("settings", {})
            ax.plot(
                [e["step"] for e in evaluations], [e["horizontal"] for e in evaluations], marker=".", linewidth=1,
                color=plt.cm.tab10(settings.get("seed", 0) % 10), label=f"seed {settings.get('seed', 0)}",
            )  # fmt: skip
        ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(variant.replace("mm_hier_one_layer_", ""), fontsize=8)
        ax.set_ylim(0.3, 1.02)
        ax.set_xlabel("step (64 questions each)", fontsize=8)
        ax.legend(fontsize=6, ncol=2, loc="upper left", frameon=False)
    for ax in axes.flat[len(variants) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel('"is the <colour> object on the left"', fontsize=8)
    fig.suptitle("Sort-of-CLEVR diagnostic ladder: held-out left / right accuracy per seed, prior dotted", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def colour_probe(seed: int = 1, images: int = 400) -> dict[str, float]:
    """
    How well the towers' features at initialisation tell an object's colour: the feature vector of the cell under each
    object's centre, classified by the nearest colour mean of the first half of the objects, on the second half. For
    the two-conv tower of the read and mm_fusion's ResNet (stem, stages 1-3), images in [0, 1], train-mode BatchNorm.
    """
    torch.manual_seed(seed)
    scenes = generate_scenes(
        num_train_images=images, num_test_images=1, num_objects=len(COLOURS), image_size=IMAGE_SIZE,
        object_size=OBJECT_SIZE, min_distance_gap=2.0, seed=seed,
    )["train"]  # fmt: skip
    pixels = build_split(scenes)["images"]
    read = AttentionRead().tower
    towers = {"two convs (16 x 16)": read, "ResNet stem (16 x 16)": resnet_backbone(1).embedder}
    for stage, grid in ((1, 16), (2, 8), (3, 4)):
        backbone = resnet_backbone(stage)
        towers[f"ResNet stage {stage} ({grid} x {grid})"] = lambda x, b=backbone: b(x).feature_maps[0]
    result = {}
    for name, tower in towers.items():
        with torch.no_grad():
            maps = tower(pixels)
        height, width = maps.shape[-2:]
        features, colours = [], []
        for i, scene in enumerate(scenes):
            for c, o in enumerate(scene):
                cell = min(o["y"] * height // IMAGE_SIZE, height - 1), min(o["x"] * width // IMAGE_SIZE, width - 1)
                features.append(maps[i, :, cell[0], cell[1]])
                colours.append(c)
        features, colours = torch.stack(features), torch.tensor(colours)
        half = len(colours) // 2
        means = torch.stack([features[:half][colours[:half] == c].mean(0) for c in range(len(COLOURS))])
        predicted = torch.cdist(features[half:], means).argmin(1)
        result[name] = round((predicted == colours[half:]).float().mean().item(), 3)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--eval_every", type=int, default=500)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--train_images", type=int, default=3000)
    parser.add_argument("--test_images", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", default="cpu", help="Where the models train (e.g. cuda); the data is drawn on the CPU."
    )
    parser.add_argument("--merge", nargs="+", default=[], help="Only combine these reports (JSON) into --output.")
    parser.add_argument(
        "--colour_probe", action="store_true", help="Only print how well each tower's initial features tell colours."
    )
    parser.add_argument("--output", default=str(RESULTS / "sort_of_clevr_ladder_runs"), help="Without a suffix.")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if args.colour_probe:
            probe = colour_probe(args.seed)
            print(markdown_table(["tower", "colour from the object's cell"], [[k, v] for k, v in probe.items()]))
            return probe
        return run(args)
    finally:  # called in-process (tests), the caller's thread pool is left as it was
        torch.set_num_threads(threads)


def run(args) -> dict:
    done = {}
    for part in args.merge:  # reports of variants run by separate commands (e.g. two at a time)
        done.update({run_name(r): r for r in json.loads(Path(part).read_text())["runs"]})
    if not args.merge:
        scenes = generate_scenes(
            num_train_images=args.train_images,
            num_test_images=args.test_images,
            num_objects=len(COLOURS),
            image_size=IMAGE_SIZE,
            object_size=OBJECT_SIZE,
            min_distance_gap=2.0,
            seed=args.seed,
        )
        train, test = build_split(scenes["train"]), build_split(scenes["test"])
        if args.device != "cpu":  # the splits, models and every tensor they make on that device
            train, test = ({k: v.to(args.device) for k, v in split.items()} for split in (train, test))
            torch.set_default_device(args.device)
        for name in args.variants:
            run = train_variant(name, train, test, args) | {"settings": vars(args) | {"variants": None}}
            done[run_name(run)] = run
    # In the order of VARIANTS, seeds in order; variants since retired (their code is in the commit that ran them;
    # see results/sort_of_clevr_ladder.md) last.
    rank = {name: k for k, name in enumerate(VARIANTS)}
    runs = sorted(done.values(), key=lambda r: (rank.get(r["variant"], len(VARIANTS)), r["settings"]["seed"]))
    rows = []
    for run in runs:
        last = run["evaluations"][-1]
        rows.append(
            [run_name(run), last["step"], f"{last['seconds']:.0f}", f"{last['non_relational']:.3f}",
             f"{last['relational']:.3f}", *(f"{last[f]:.3f}" for f in FAMILIES),
             first_step(run["evaluations"], "non_relational", 0.9) or "not reached"]
        )  # fmt: skip
    header = ["variant", "steps", "s", "non-rel", "rel", *FAMILIES, "first step non-rel >= 0.9"]
    table = markdown_table(header, rows)
    print(table)
    report = {"machine": machine(), "runs": runs}
    write_report(args.output, report, f"{table}\n")
    seeds = Counter(run["variant"] for run in runs)
    # A report of a few variants with many seeds each by variant, else the groups of contenders.
    by_variant = max(seeds.values()) >= 3 and len(seeds) <= 12
    (plot_by_variant if by_variant else plot)(runs, Path(args.output).with_suffix(".png"))
    return report


if __name__ == "__main__":
    main()
