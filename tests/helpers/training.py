"""Flags of the tiny `scripts/train.py` runs the tests make, and such a run in-process (`mm_fusion.training`)."""

import numpy as np
import torch

from mm_fusion.training import setup_run, train_and_save


# A model of a few thousand parameters on 32 px images (a ViT tower; tests/test_vision_towers.py runs the others): a
# run of a few dozen pairs takes seconds.
TINY_MODEL = [
    "--vision_tower", "vit", "--image_size", "32", "--patch_size", "16", "--hidden_size", "32",
    "--num_attention_heads", "2", "--vision_layers", "1", "--text_layers", "1", "--fusion_layers", "1",
    "--disable_tqdm", "True",
]  # fmt: skip
TINY = [
    *TINY_MODEL,
    "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "32", "--logging_steps", "1",
]  # fmt: skip


def train(argv: list[str]) -> dict:
    """`scripts/train.py`'s run for these arguments, in this process: its metrics."""
    return train_and_save(setup_run(argv))


@torch.no_grad()
def correct_by_hand(trainer) -> np.ndarray:
    """Whether the model's top class is the label, for every evaluation pair in order: recomputed batch by batch from
    the model's logits, without Trainer's prediction loop or the metric modules."""
    model = trainer.model.eval()
    correct = []
    for batch in trainer.get_eval_dataloader():
        labels = batch.pop("labels")
        correct.append((model(**batch).logits.argmax(-1) == labels).numpy())
    return np.concatenate(correct)


@torch.no_grad()
def recall_by_hand(trainer, k: int) -> dict[str, float]:
    """Retrieval Recall@k of the evaluation pairs in both directions, recomputed from the model's embeddings: a text
    finds its image when fewer than k distinct images score above it; an image finds a text of its own likewise."""
    model = trainer.model.eval()
    images, texts, rows = [], [], []
    for batch in trainer.get_eval_dataloader():
        out = model(**batch, return_loss=False)
        images.append(out.image_embeds)
        texts.append(out.text_embeds)
        rows.append(batch["image_rows"])
    images, texts, rows = torch.cat(images), torch.cat(texts), torch.cat(rows)
    distinct = sorted(set(rows.tolist()))
    gallery = torch.stack([images[rows.tolist().index(r)] for r in distinct])  # one embedding per image
    similarity = texts @ gallery.T  # (texts, images)
    own = torch.tensor([distinct.index(r) for r in rows.tolist()])
    text_hits = [(similarity[t] > similarity[t, own[t]]).sum() < k for t in range(len(texts))]
    image_hits = []
    for i in range(len(distinct)):
        best = similarity[own == i, i].max()
        image_hits.append((similarity[:, i] > best).sum() < k)
    return {
        f"text_to_image_R@{k}": float(np.mean(text_hits)),
        f"image_to_text_R@{k}": float(np.mean(image_hits)),
    }
