"""
The two baselines that the speed benchmarks compare mm_fusion against, and what the three contenders share. The
baselines are kept exactly as specified when the project started:

- **`seed`**, the pipeline of the project's source articles: a `torch.utils.data.Dataset` whose `__getitem__` opens
  the image with PIL and applies `Resize((224, 224))` (or the size under test), `ToTensor` and `Normalize` (ImageNet
  mean and std), and tokenizes with `padding="max_length", truncation=True, max_length=512`; a
  `DataLoader(batch_size=32, num_workers=<cores>, pin_memory=True)`; fusion by `nn.MultiheadAttention` with a residual
  LayerNorm; fp32; gradient accumulation by hand.
- **`run_clip`**, transformers' contrastive image-text example: `datasets` with tokenization by `map` to
  `max_length`, the image transforms applied per batch with `set_transform`, and the stock `Trainer`.

Ratios are measured in one run on one machine, with the same model size and data (scripts/benchmarks/README.md,
"The baselines").

Here: the seed pipeline (`seed_loader`, `seed_split_loader`, `SeedFusionLayer`, `SeedStyleModel`, `seed_model`), the
run_clip pipeline (`run_clip_loader`, `TruncateTo`, `run_clip_dataset`, `run_clip_arguments`), and what the
contenders share: the recipe (`recipe`, read from mm_fusion's argument defaults), the model's config
(`build_fusion_config`), the towers' shapes (`tower_shapes`), the model `scripts/train.py` builds by default
(`default_model`: benchmark_time_to_accuracy.py runs the seed loop and run_clip on it instead of the seed-style model)
and the easy-VQA questions (`easy_vqa_splits`).

This module is imported by the benchmark scripts (they run from this folder and import it by name); it has no command.
"""

import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


CONTENDERS = ("seed", "run_clip", "mm_fusion")
SEED_MICRO_BATCH, SEED_MAX_LENGTH = 32, 512  # the seed baseline's
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


# --------------------------------------------------------------------------------------------------------------------
# What the contenders share: the recipe, the model's config, the towers' shapes, the data.


def recipe() -> dict:
    """The training recipe, from the defaults of mm_fusion's argument dataclasses (whatever they are today)."""
    from mm_fusion.training import DataArguments, ModelArguments, training_defaults

    training = training_defaults()
    model, data = ModelArguments(), DataArguments()
    return {
        "learning_rate": training["learning_rate"],
        "weight_decay": training["weight_decay"],
        "warmup_steps": training["warmup_steps"],
        "lr_scheduler_type": str(training["lr_scheduler_type"]),
        "max_grad_norm": training["max_grad_norm"],
        "batch_size": training["per_device_train_batch_size"],
        "seed": training["seed"],
        "dropout": model.dropout,
        "patch_size": model.patch_size,
        "vocab_size": model.vocab_size,
        "max_length": data.max_length,
    }


def build_fusion_config(
    size: int,
    vocab_size: int,
    max_length: int,
    labels: list[str],
    patch_size: int | None,
    vision_tower: str = "vit",
    config_overrides: str | None = None,
):
    """`MMFusionConfig` of the recipe's model (what `build_trainer` builds) at this size, BERT with `max_length`.
    `vision_tower`: the ViT these equal-size step comparisons were built around, or `scripts/train.py`'s default;
    `config_overrides` as `--config_overrides`."""
    from mm_fusion.training import ModelArguments, build_config

    sizes = {} if patch_size is None else {"patch_size": patch_size}
    model_args = ModelArguments(vision_tower=vision_tower, config_overrides=config_overrides, **sizes)
    return build_config(model_args, size, vocab_size, max_length, labels)


def tower_shapes(config) -> dict:
    """What must be equal across contenders: the towers' shapes."""
    v, t = config.vision_config, config.text_config
    keys = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
    return {
        "vision": {**{k: getattr(v, k) for k in keys}, "patch_size": v.patch_size, "image_size": v.image_size},
        "text": {**{k: getattr(t, k) for k in keys}, "vocab_size": t.vocab_size},
        "fusion_layers": config.num_fusion_layers,
    }


def default_model(tokenizer, labels: list[str], image_size: int, max_length: int, seed: int):
    """The model `scripts/train.py` builds with no arguments (`mm_fusion.training.build_model` of `ModelArguments()`,
    whatever its defaults are today), for this tokenizer, labels, image size and texts of up to `max_length` tokens
    (its BERT's positions), drawn from `seed` as there."""
    from transformers import set_seed

    from mm_fusion.training import ModelArguments, build_model

    set_seed(seed)
    model = build_model(ModelArguments(), tokenizer, labels, image_size, max_length)
    model.config.problem_type = "single_label_classification"  # as build_model_and_processor sets it for class ids
    return model


def easy_vqa_splits(eval_questions: int, train_questions: int | None = None):
    """easy-VQA's training questions (the first `train_questions`, default all), and its first `eval_questions` test
    questions."""
    from mm_fusion.data import load_easy_vqa

    data = load_easy_vqa(["train", "test"])
    train = data["train"] if train_questions is None else data["train"].select(range(train_questions))
    return train, data["test"].select(range(eval_questions))


# --------------------------------------------------------------------------------------------------------------------
# The seed baseline: its data loader, and the same towers fused by nn.MultiheadAttention as the source articles write
# it.


def seed_loader(rows, tokenizer, size, args):
    """The source articles' pipeline (the `seed` baseline of scripts/benchmarks/README.md)."""
    import torch
    from PIL import Image
    from torchvision import transforms

    class SeedStyleDataset(torch.utils.data.Dataset):
        def __init__(self, paths, questions, answers):
            self.paths, self.questions, self.answers = paths, questions, answers
            self.transform = transforms.Compose(
                [
                    transforms.Resize((size, size)),
                    transforms.ToTensor(),
                    transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
                ]
            )

        def __len__(self):
            return len(self.paths)

        def __getitem__(self, i):
            image = Image.open(self.paths[i]).convert("RGB")
            text = tokenizer(
                self.questions[i], padding="max_length", truncation=True, max_length=512, return_tensors="pt"
            )
            return {
                "pixel_values": self.transform(image),
                "input_ids": text["input_ids"].squeeze(0),
                "attention_mask": text["attention_mask"].squeeze(0),
                "labels": torch.tensor(self.answers[i]),
            }

    dataset = SeedStyleDataset(rows["image"], rows["question"], rows["answer"])
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers, pin_memory=True
    )
    return loader, None


def seed_split_loader(split, tokenizer, size: int):
    """`seed_loader` on a split of `easy_vqa_splits`, with the seed baseline's micro-batch and a worker per core."""
    loader_args = SimpleNamespace(batch_size=SEED_MICRO_BATCH, num_workers=os.cpu_count() or 1)
    rows = {"image": split["image"], "question": split["question"], "answer": split["answer"]}
    return seed_loader(rows, tokenizer, size, loader_args)[0]


class SeedFusionLayer(nn.Module):
    """Text self-attention, text-to-image cross-attention and an FFN, each with a residual and a LayerNorm after."""

    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, dropout: float):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(hidden_size, num_heads, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(hidden_size, num_heads, batch_first=True)
        self.ffn = nn.Sequential(
            nn.Linear(hidden_size, intermediate_size), nn.GELU(), nn.Linear(intermediate_size, hidden_size)
        )
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(hidden_size) for _ in range(3))
        self.dropout = nn.Dropout(dropout)

    def forward(self, text: torch.Tensor, image: torch.Tensor, text_padding: torch.Tensor) -> torch.Tensor:
        attended, _ = self.self_attn(text, text, text, key_padding_mask=text_padding)
        text = self.norm1(text + self.dropout(attended))
        attended, _ = self.cross_attn(text, image, image)
        text = self.norm2(text + self.dropout(attended))
        return self.norm3(text + self.dropout(self.ffn(text)))


class SeedStyleModel(nn.Module):
    """
    The given towers (a ViT or a convolutional tower, and BERT), seed-style fusion layers, [CLS] pooling and the
    recipe's head. A convolutional tower's last feature map gives the image tokens (one per cell) and their mean the
    pooled image.
    """

    def __init__(self, vision_config, text_config, num_labels: int, num_fusion_layers: int, dropout: float):
        super().__init__()
        from transformers import AutoModel

        convolutional = hasattr(vision_config, "hidden_sizes")
        width = vision_config.hidden_sizes[-1] if convolutional else vision_config.hidden_size
        if width != text_config.hidden_size:
            raise ValueError("The seed-style fusion needs towers of one width.")
        pooling = {} if convolutional else {"add_pooling_layer": False}
        self.vision_model = AutoModel.from_config(vision_config, **pooling)
        self.text_model = AutoModel.from_config(text_config, add_pooling_layer=False)
        h = text_config.hidden_size
        self.fusion = nn.ModuleList(
            SeedFusionLayer(h, text_config.num_attention_heads, text_config.intermediate_size, dropout)
            for _ in range(num_fusion_layers)
        )
        # The head of the recipe's model on the same joint vector (text [CLS], image [CLS], their product), so that
        # only the fusion layers and the loop differ from the other contenders.
        hidden = 2 * 3 * h
        self.classifier = nn.Sequential(
            nn.Linear(3 * h, hidden),
            nn.GELU(),
            nn.LayerNorm(hidden),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_labels),
        )

    def forward(
        self, pixel_values, input_ids, attention_mask, labels=None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        image = self.vision_model(pixel_values=pixel_values).last_hidden_state  # (B, 1 + patches, D) or (B, D, H, W)
        if image.dim() == 4:
            image = image.flatten(2).transpose(1, 2)  # (B, H * W, D): a token per cell
            pooled_image = image.mean(1)
        else:
            pooled_image = image[:, 0]  # [CLS]
        text = self.text_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, 512, D)
        for layer in self.fusion:
            text = layer(text, image, attention_mask == 0)
        text, image = text[:, 0], pooled_image
        logits = self.classifier(torch.cat([text, image, text * image], dim=-1))
        return (F.cross_entropy(logits, labels) if labels is not None else None), logits


def seed_model(config) -> SeedStyleModel:
    """The seed-style model with the towers of an `MMFusionConfig` (its text config with 512 positions)."""
    return SeedStyleModel(
        config.vision_config, config.text_config, config.num_labels, config.num_fusion_layers, config.fusion_dropout
    )


# --------------------------------------------------------------------------------------------------------------------
# The run_clip baseline: transformers' example's data path, training our model with the stock Trainer.


def run_clip_loader(dataset, tokenizer, size, args):
    """transformers' examples/pytorch/contrastive-image-text/run_clip.py data path, on the same rows."""
    import torch
    from PIL import Image
    from torchvision.io import ImageReadMode, read_image
    from torchvision.transforms import CenterCrop, ConvertImageDtype, InterpolationMode, Normalize, Resize

    class Transform(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.transforms = torch.nn.Sequential(
                Resize([size], interpolation=InterpolationMode.BICUBIC),
                CenterCrop(size),
                ConvertImageDtype(torch.float),
                Normalize(IMAGENET_MEAN, IMAGENET_STD),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return self.transforms(x)

    transform = torch.jit.script(Transform())

    def readable(batch):
        keep = []
        for path in batch["image"]:
            try:
                Image.open(path)
                keep.append(True)
            except Exception:
                keep.append(False)
        return keep

    def tokenize(batch):
        text = tokenizer(batch["question"], max_length=128, padding="max_length", truncation=True)
        return {"input_ids": text["input_ids"], "attention_mask": text["attention_mask"]}

    def transform_images(batch):
        batch["pixel_values"] = [transform(read_image(p, mode=ImageReadMode.RGB)) for p in batch["image"]]
        return batch

    def collate(examples):
        return {
            "pixel_values": torch.stack([e["pixel_values"] for e in examples]),
            "input_ids": torch.tensor([e["input_ids"] for e in examples], dtype=torch.long),
            "attention_mask": torch.tensor([e["attention_mask"] for e in examples], dtype=torch.long),
        }

    dataset = dataset.filter(readable, batched=True)
    dataset = dataset.map(tokenize, batched=True, remove_columns=[c for c in dataset.column_names if c != "image"])
    dataset.set_transform(transform_images)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        pin_memory=True,
        collate_fn=collate,
    )
    return loader, None


class TruncateTo:
    """The tokenizer, padding / truncating to `max_length` whatever the caller asks (run_clip_loader asks for 128)."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, texts, **kwargs):
        return self.tokenizer(texts, **{**kwargs, "max_length": self.max_length})


def run_clip_dataset(split, tokenizer, size: int, rec: dict):
    """run_clip_loader's pipeline on `split` (its DataLoader unused: Trainer builds its own), with the answers as
    labels, and the collate function that batches them."""
    loader_args = SimpleNamespace(batch_size=rec["batch_size"], num_workers=0)
    loader = run_clip_loader(split, TruncateTo(tokenizer, rec["max_length"]), size, loader_args)[0]
    if len(loader.dataset) != len(split):
        raise RuntimeError("run_clip's filter dropped rows; the labels would no longer line up.")
    clip_collate = loader.collate_fn

    def collate(examples):
        return {**clip_collate(examples), "labels": torch.tensor([e["labels"] for e in examples])}

    return loader.dataset.add_column("labels", split["answer"]), collate


def run_clip_arguments(rec: dict, out: str, max_steps: int, **changes):
    """The stock `TrainingArguments` of the run_clip contender: the recipe's optimizer, gradient clipping and
    schedule."""
    from transformers import TrainingArguments

    settings = dict(
        output_dir=out,
        per_device_train_batch_size=rec["batch_size"],
        per_device_eval_batch_size=rec["batch_size"],
        learning_rate=rec["learning_rate"],
        weight_decay=rec["weight_decay"],
        warmup_steps=rec["warmup_steps"],
        lr_scheduler_type=rec["lr_scheduler_type"],
        max_grad_norm=rec["max_grad_norm"],
        max_steps=max_steps,
        seed=rec["seed"],
        bf16=torch.cuda.is_available(),
        remove_unused_columns=False,  # pixel_values are made from the image column by the transform
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    return TrainingArguments(**(settings | changes))


if __name__ == "__main__":
    import sys

    usage = "usage: baselines.py\nbaselines.py is a module that the benchmark scripts import; it has no command."
    if sys.argv[1:] in (["--help"], ["-h"]):
        print(usage)
    else:
        sys.exit(usage)
