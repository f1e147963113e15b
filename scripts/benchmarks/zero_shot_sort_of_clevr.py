"""Zero-shot evaluation of a contrastively pretrained model on Sort-of-CLEVR's held-out images.

For every test image and every object in it, the model must score the true caption above the same caption with that
object's shape swapped, by the ITC similarity and by the ITM head (chance 0.5). Method:
scripts/benchmarks/README.md; results: scripts/benchmarks/RESULTS.md.

    python scripts/benchmarks/zero_shot_sort_of_clevr.py --model outputs/sort_of_clevr_pretrain [--dataset_options ...]

Prints the accuracies and writes them as JSON: `zero_shot_results.json` next to the model, or `--output`.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from mm_fusion import MMFusionForPretraining, MMFusionProcessor
from mm_fusion.data import load_sort_of_clevr
from mm_fusion.data.sort_of_clevr import describe_scene
from mm_fusion.training import parse_overrides


def flipped_captions(objects: list[dict], image_size: int) -> list[str]:
    """One caption per object: the scene's caption with that object's shape swapped."""
    captions = []
    for i in range(len(objects)):
        other = {"square": "circle", "circle": "square"}[objects[i]["shape"]]
        scene = [dict(o, shape=other) if j == i else o for j, o in enumerate(objects)]
        captions.append(describe_scene(scene, image_size))
    return captions


@torch.no_grad()
def zero_shot_accuracy(model, processor, dataset, image_size: int = 64, batch_size: int = 32) -> dict[str, float]:
    """ITC and ITM accuracy of picking the true caption over each one-shape-swapped caption (see the module doc)."""
    model.eval()
    itc_correct = itm_correct = total = 0
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start : start + batch_size]
        pixels = processor(images=rows["image"], return_tensors="pt")["pixel_values"]
        true = rows["caption"]
        flipped = [c for objects in rows["objects"] for c in flipped_captions(objects, image_size)]
        per_image = len(flipped) // len(true)
        text = processor(text=true + flipped, return_tensors="pt")
        image_embeds = torch.nn.functional.normalize(model.mm_fusion.get_image_features(pixels).pooler_output, dim=-1)
        text_embeds = model.mm_fusion.get_text_features(text["input_ids"], text["attention_mask"]).pooler_output
        text_embeds = torch.nn.functional.normalize(text_embeds, dim=-1)
        n = len(true)
        true_sim = (image_embeds * text_embeds[:n]).sum(-1)  # (n,)
        flipped_sim = (image_embeds.repeat_interleave(per_image, 0) * text_embeds[n:]).sum(-1).view(n, per_image)
        itc_correct += int((true_sim[:, None] > flipped_sim).sum())
        # ITM: the matching probability of each (image, caption) pair.
        image_rows = torch.arange(n).repeat_interleave(per_image + 1)
        order = torch.cat([torch.arange(n)[:, None], n + torch.arange(n * per_image).view(n, per_image)], 1).flatten()
        out = model(
            pixel_values=pixels[image_rows],
            input_ids=text["input_ids"][order],
            attention_mask=text["attention_mask"][order],
            return_loss=False,
        )
        match = out.itm_logits.softmax(-1)[:, 1].view(n, per_image + 1)
        itm_correct += int((match[:, :1] > match[:, 1:]).sum())
        total += n * per_image
    return {
        "zero_shot_itc_accuracy": itc_correct / total,
        "zero_shot_itm_accuracy": itm_correct / total,
        "pairs": total,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="A checkpoint of `scripts/train.py --task pretrain`.")
    parser.add_argument("--dataset_options", default=None, help="As given to the training run (key=value,...).")
    parser.add_argument("--max_images", type=int, default=None, help="Evaluate on the first N test images only.")
    parser.add_argument("--output", default=None, help="JSON file for the results (default: next to the model).")
    args = parser.parse_args(argv)
    model = MMFusionForPretraining.from_pretrained(args.model)
    processor = MMFusionProcessor.from_pretrained(args.model)
    options = parse_overrides(args.dataset_options, flag="--dataset_options")
    test = load_sort_of_clevr(["test"], rows="captions", **options)["test"]
    if args.max_images is not None:
        test = test.select(range(min(args.max_images, len(test))))
    start = time.perf_counter()
    results = zero_shot_accuracy(model, processor, test, image_size=options.get("image_size", 64))
    results.update(images=len(test), seconds=round(time.perf_counter() - start, 1), model=str(args.model))
    for key, value in results.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    output = Path(args.output) if args.output else Path(args.model) / "zero_shot_results.json"
    output.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
