"""Sort-of-CLEVR diagnostic ladder: which models learn to find an object by its colour, in minutes on a CPU.

Every contender trains on the same generated scenes (`mm_fusion.data.sort_of_clevr`: 64 px, six objects of 10 px),
with every question of every image (6 colours x 6 families), the question given as ids, not text: for the
hand-written models a one-hot colour and a one-hot family (the Relation Network paper's question vector,
arXiv:1706.01427), for mm_fusion the token ids [CLS, colour, family] through its text tower. Random batches of 64,
Adam(W) at a fixed learning rate, one thread each; held-out accuracy per question family every `--eval_every` steps.
This isolates the model from the training pipeline (tokenizer, grouped batches, schedule).

    python scripts/benchmarks/sort_of_clevr_ladder.py --variants cnn_mlp film attention --steps 4000

Contenders (`--variants`):
- `cnn_mlp`: the paper's CNN+MLP baseline: four stride-2 3x3 convs (24 channels, BatchNorm), flattened, with the
  question into a 3-layer MLP.
- `film`: the same convs, each with (x, y) coordinate maps appended and its BatchNorm output scaled and shifted by a
  linear map of the question (FiLM, arXiv:1709.07871).
- `film_resnet`: mm_fusion's default ResNet tower (stages of 24 / 48 / 96 channels on 16 x 16, 8 x 8, 4 x 4 cells)
  with every stage's output scaled and shifted by a linear map of the question, its last stage flattened into the MLP.
- `attention`: two stride-2 convs, (x, y) appended to each of the 16 x 16 cells, one attention read of the cells by a
  query made from the question (PyTorch's default initialisation), the result and the question into an MLP.
- `attention_std002`: `attention` with its projections drawn from N(0, 0.02), the initialisation of BERT and of
  mm_fusion's fusion block.
- `attention_sine`: `attention` with sine positions added in place of the coordinates.
- `attention_layernorm`: `attention` with LayerNorm on the cells before the read (mm_fusion's `context_norm`).
- `attention_resnet`: `attention` reading mm_fusion's default ResNet tower (stage 1, 16 x 16) in place of two convs.
- `mm_fusion`: the Sort-of-CLEVR recipe's model (ResNet tower, hierarchical fusion, width 96, 2-layer BERT).
- `mm_fusion_std01`: the same with `initializer_range=0.1` (fusion block and text tower).
- `mm_fusion_film`: the recipe's model with `vision_film=True` (every ResNet stage scaled and shifted by a linear map
  of the pooled question, `MMFusionConfig.vision_film`).
- `mm_fusion_late_film`: the same with late fusion (no cross-attention: FiLM and the pooled image only).
- `mm_fusion_film_flatten`: `mm_fusion_late_film` with `image_pooling="flatten"` (every image token, in order, into
  the image embedding: the layout kept, as `film_resnet`'s flattened map keeps it).
- `mm_fusion_film_flatten_default_init`: `mm_fusion_film_flatten` with the FiLM maps drawn as PyTorch draws a new
  `nn.Linear` (as `film_resnet`'s are) instead of starting at zero.
- `mm_fusion_no_image_norms`: the recipe's model with the LayerNorms on the image tokens before the cross-attention
  (the bridges' and the context's) removed, so that object cells keep a larger norm than the background.

Writes `results/sort_of_clevr_ladder_runs.json` (every evaluation) and `.md` (the table of the last evaluations).
`--merge a.json b.json` combines the reports of variants run by separate commands.
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from benchmarking import RESULTS, machine, markdown_table, write_report

from mm_fusion.data.sort_of_clevr import (
    COLOURS,
    QUESTION_FAMILIES,
    answer_names,
    answer_question,
    generate_scenes,
    render_scene,
)
from mm_fusion.vision_towers import sine_positions


FAMILIES, COLOUR_NAMES, ANSWERS = list(QUESTION_FAMILIES), list(COLOURS), answer_names(6)
NON_RELATIONAL = ("shape", "horizontal", "vertical")
IMAGE_SIZE, OBJECT_SIZE = 64, 10
VARIANTS = (
    "cnn_mlp",
    "film",
    "film_resnet",
    "attention",
    "attention_std002",
    "attention_sine",
    "attention_layernorm",
    "attention_resnet",
    "mm_fusion",
    "mm_fusion_std01",
    "mm_fusion_film",
    "mm_fusion_late_film",
    "mm_fusion_film_flatten",
    "mm_fusion_no_image_norms",
    "mm_fusion_film_flatten_default_init",
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
    return {
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
    (hooks on the stages, no coordinate maps inside), its last stage flattened with the question into an MLP."""

    def __init__(self):
        super().__init__()
        self.backbone = resnet_backbone(3)
        self.film = nn.ModuleList(nn.Linear(12, 2 * c) for c in self.backbone.config.hidden_sizes)
        for stage, film in zip(self.backbone.encoder.stages, self.film):
            stage.register_forward_hook(lambda module, args, out, film=film: self._modulate(out, film))
        self.mlp = nn.Sequential(
            nn.Linear(96 * 4 * 4 + 12, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, len(ANSWERS))
        )

    def _modulate(self, features, film):
        scale, shift = film(self._question).unsqueeze(-1).unsqueeze(-1).chunk(2, dim=1)
        return features * (1 + scale) + shift

    def forward(self, images, question):
        self._question = question
        return self.mlp(torch.cat([self.backbone(images).feature_maps[0].flatten(1), question], dim=1))


class AttentionRead(nn.Module):
    def __init__(self, tower: str = "conv", positions: str = "coordinates", std: float | None = None, norm=False):
        super().__init__()
        width = 64
        if tower == "conv":
            self.tower = nn.Sequential(
                nn.Conv2d(3, 24, 3, 2, 1), nn.BatchNorm2d(24), nn.ReLU(), nn.Conv2d(24, 24, 3, 2, 1),
                nn.BatchNorm2d(24), nn.ReLU(),
            )  # fmt: skip
            channels = 24
        else:  # mm_fusion's default ResNet, its stage 1: 16 x 16 cells
            backbone = resnet_backbone(1)
            self.tower = lambda images: backbone(images).feature_maps[0]
            self.backbone, channels = backbone, 24
        self.positions = positions
        self.cells = nn.Linear(channels + (2 if positions == "coordinates" else 0), width)
        self.norm = nn.LayerNorm(width) if norm else nn.Identity()
        self.key, self.value, self.query = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(12, width)
        self.mlp = nn.Sequential(nn.Linear(width + 12, 256), nn.ReLU(), nn.Linear(256, len(ANSWERS)))
        if std is not None:
            for layer in (self.cells, self.key, self.value, self.query):
                nn.init.normal_(layer.weight, std=std)
                nn.init.zeros_(layer.bias)

    def forward(self, images, question):
        maps = self.tower(images)
        batch, _, height, width = maps.shape
        if self.positions == "coordinates":
            maps = torch.cat([maps, coordinates(batch, height, width)], dim=1)
        cells = self.cells(maps.flatten(2).transpose(1, 2))
        if self.positions == "sine":
            cells = cells + sine_positions(height, width, cells.shape[-1])
        cells = self.norm(cells)
        scores = (self.key(cells) @ self.query(question).unsqueeze(-1)).squeeze(-1) / cells.shape[-1] ** 0.5
        read = (scores.softmax(-1).unsqueeze(-1) * self.value(cells)).sum(1)
        return self.mlp(torch.cat([read, question], dim=1))


class MMFusion(nn.Module):
    """The recipe's model; the question as token ids [CLS, colour, family] (no tokenizer)."""

    def __init__(
        self, initializer_range: float = 0.02, image_norms: bool = True, film_default_init: bool = False, **overrides
    ):
        super().__init__()
        from mm_fusion import MMFusionForImageTextClassification
        from mm_fusion.training.arguments import ModelArguments
        from mm_fusion.training.models import build_config

        config = build_config(ModelArguments(vision_tower="resnet", **overrides), IMAGE_SIZE, 20, 3, ANSWERS)
        config.initializer_range = config.text_config.initializer_range = initializer_range
        self.model = MMFusionForImageTextClassification(config)
        if film_default_init:
            for layer in self.model.mm_fusion.vision_film.maps:
                layer.reset_parameters()
        if not image_norms:
            encoder = self.model.mm_fusion.encoder
            encoder.image_bridge_norms = nn.ModuleList(nn.Identity() for _ in encoder.image_bridge_norms)
            for layer in encoder.layers:
                layer.text_block.context_norm = nn.Identity()
        self.register_buffer("mean", torch.tensor(config.image_mean).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(config.image_std).view(1, 3, 1, 1))

    def forward(self, images, question):
        colour, family = question[:, : len(COLOURS)].argmax(1), question[:, len(COLOURS) :].argmax(1)
        ids = torch.stack([torch.ones_like(colour), 2 + colour, 2 + len(COLOURS) + family], dim=1)
        return self.model(pixel_values=(images - self.mean) / self.std, input_ids=ids).logits


def build_variant(name: str) -> nn.Module:
    """A new model of the contender `name` (see the module doc)."""
    models = {
        "cnn_mlp": lambda: CNNMLP(),
        "film": lambda: FiLM(),
        "film_resnet": lambda: FiLMResNet(),
        "attention": lambda: AttentionRead(),
        "attention_std002": lambda: AttentionRead(std=0.02),
        "attention_sine": lambda: AttentionRead(positions="sine"),
        "attention_layernorm": lambda: AttentionRead(norm=True),
        "attention_resnet": lambda: AttentionRead(tower="resnet"),
        "mm_fusion": lambda: MMFusion(),
        "mm_fusion_std01": lambda: MMFusion(initializer_range=0.1),
        "mm_fusion_film": lambda: MMFusion(config_overrides="vision_film=true"),
        "mm_fusion_late_film": lambda: MMFusion(config_overrides="vision_film=true", fusion_type="late"),
        "mm_fusion_film_flatten": lambda: MMFusion(
            config_overrides="vision_film=true,image_pooling=flatten", fusion_type="late"
        ),
        "mm_fusion_no_image_norms": lambda: MMFusion(image_norms=False),
        "mm_fusion_film_flatten_default_init": lambda: MMFusion(
            config_overrides="vision_film=true,image_pooling=flatten", fusion_type="late", film_default_init=True
        ),
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
    model.train()
    correct = torch.cat(correct).float()
    result = {family: round(correct[test["family"] == f].mean().item(), 4) for f, family in enumerate(FAMILIES)}
    by_type = {
        "non_relational": [result[f] for f in NON_RELATIONAL],
        "relational": [result[f] for f in FAMILIES if f not in NON_RELATIONAL],
    }
    return {kind: round(sum(v) / len(v), 4) for kind, v in by_type.items()} | result


def train_variant(name: str, train: dict, test: dict, args) -> dict:
    torch.manual_seed(args.seed)
    model = build_variant(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    evaluations, step, start = [], 0, time.perf_counter()
    while step < args.steps:
        order = torch.randperm(len(train["answer"]), generator=generator)
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


def first_step(evaluations: list[dict], key: str, threshold: float) -> int | None:
    return next((e["step"] for e in evaluations if e[key] >= threshold), None)


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
    parser.add_argument("--merge", nargs="+", default=[], help="Only combine these reports (JSON) into --output.")
    parser.add_argument("--output", default=str(RESULTS / "sort_of_clevr_ladder_runs"), help="Without a suffix.")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:  # called in-process (tests), the caller's thread pool is left as it was
        torch.set_num_threads(threads)


def run(args) -> dict:
    done = {}
    for part in args.merge:  # reports of variants run by separate commands (e.g. two at a time)
        done.update({r["variant"]: r for r in json.loads(Path(part).read_text())["runs"]})
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
        for name in args.variants:
            done[name] = train_variant(name, train, test, args) | {"settings": vars(args) | {"variants": None}}
    # Variants since retired (their code is in the commit that ran them; see results/sort_of_clevr_ladder.md) last.
    runs = [done[name] for name in VARIANTS if name in done] + [r for n, r in done.items() if n not in VARIANTS]
    rows = []
    for run in runs:
        last = run["evaluations"][-1]
        rows.append(
            [run["variant"], last["step"], f"{last['seconds']:.0f}", f"{last['non_relational']:.3f}",
             f"{last['relational']:.3f}", *(f"{last[f]:.3f}" for f in FAMILIES),
             first_step(run["evaluations"], "non_relational", 0.9) or "not reached"]
        )  # fmt: skip
    header = ["variant", "steps", "s", "non-rel", "rel", *FAMILIES, "first step non-rel >= 0.9"]
    table = markdown_table(header, rows)
    print(table)
    report = {"machine": machine(), "runs": runs}
    write_report(args.output, report, f"{table}\n")
    return report


if __name__ == "__main__":
    main()
