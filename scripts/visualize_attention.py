"""Where a question looks: its cross-attention over the image patches (or feature-map cells), as a heat map on the
image, per fusion layer.

    python scripts/visualize_attention.py --model outputs/easy_vqa --image shape.png \
        --question "what shape is in the image?" --output attention.png

The model runs with the eager attention implementation and `output_attentions=True`; for every fusion layer the
text-to-image attention probabilities are averaged over heads and over the question's real tokens (or taken for one
token with `--token`), giving one weight per image patch (a leading [CLS]-like token, if the tower has one, is left
out and its share reported). The PNG shows the image as the model saw it, then one panel per fusion layer.
"""

import math
import os
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForVisualQuestionAnswering, AutoProcessor

import mm_fusion  # registers the Auto classes
from mm_fusion.cli import ScriptArgumentParser
from mm_fusion.head_check import MissingHeadError, check_saved_head


@dataclass
class VisualizeArguments:
    model: str = field(metadata={"help": "A VQA / classification model directory saved with its processor."})
    image: str = field(metadata={"help": "The image file."})
    question: str = field(metadata={"help": "The question (or text)."})
    output: str = field(default="attention.png", metadata={"help": "Where the PNG goes."})
    token: int | None = field(default=None, metadata={"help": "One token position instead of the mean over tokens."})


def attention_maps(model, batch, token: int | None = None) -> tuple[list[np.ndarray], list[float], torch.Tensor]:
    """Per fusion layer: the (grid, grid) attention over patches, the weight on a leading non-patch token, logits."""
    with torch.no_grad():
        outputs = model(**batch, output_attentions=True)
    layers = outputs.text_to_image_attentions
    if not layers:
        raise ValueError(
            f"This model ({model.config.fusion_type} fusion) has no text-to-image attention to show; "
            "late fusion pools each modality alone."
        )
    mask = batch["attention_mask"][0].bool()
    maps, extra = [], []
    for probabilities in layers:  # (1, heads, text length, image tokens)
        per_token = probabilities[0].float().mean(0)  # (text length, image tokens)
        weights = per_token[mask].mean(0) if token is None else per_token[token]
        # A square grid of patches or feature-map cells, after a leading CLS-like token if the tower has one.
        count = weights.shape[0]
        leading = 0 if math.isqrt(count) ** 2 == count else 1
        grid = math.isqrt(count - leading)
        if grid * grid + leading != count:
            raise ValueError(f"Expected a square grid of image tokens (+1), got {count} image tokens.")
        extra.append(float(weights[:leading].sum()))
        maps.append(weights[leading:].reshape(grid, grid).numpy())
    return maps, extra, outputs.logits


def parse_args(argv: list[str] | None = None) -> VisualizeArguments:
    """The arguments, checked before any model is loaded: a mistake is a one-line error, exit status 2."""
    parser = ScriptArgumentParser(VisualizeArguments)
    argv = sys.argv[1:] if argv is None else list(argv)
    parser.refuse_repeats(argv)
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    try:
        mm_fusion.check_model_path(args.model)
        # The attention of a VQA / classification model: any other head would answer from a fresh classifier.
        heads = ("MMFusionForImageTextClassification",)
        check_saved_head(heads, AutoConfig.from_pretrained(args.model), "scripts/visualize_attention.py", args.model)
    except (FileNotFoundError, MissingHeadError) as err:
        parser.error(f"--model: {err}")
    if not os.path.isfile(args.image):
        parser.error(f"--image {args.image}: no file at {os.path.abspath(args.image)}.")
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = AutoModelForVisualQuestionAnswering.from_pretrained(args.model, attn_implementation="eager").eval()
    processor = AutoProcessor.from_pretrained(args.model)
    batch = processor(images=[args.image], text=[args.question])
    length = int(batch["attention_mask"].sum())
    if args.token is not None and not 0 <= args.token < length:
        raise ValueError(f"--token {args.token} is outside the question's {length} tokens.")
    maps, extra, logits = attention_maps(model, batch, args.token)
    probabilities = logits.softmax(-1)[0]
    answer = model.config.id2label[int(probabilities.argmax())]

    image = batch["pixel_values"][0].permute(1, 2, 0).numpy()  # what the model saw (uint8, resized)
    size = image.shape[0]
    figure, axes = plt.subplots(1, len(maps) + 1, figsize=(3 * (len(maps) + 1), 3.4))
    axes[0].imshow(image, interpolation="nearest")
    axes[0].set_title("input", fontsize=9)
    tokens = processor.tokenizer.convert_ids_to_tokens(batch["input_ids"][0][:length])
    for k, (heat, leading) in enumerate(zip(maps, extra), start=1):
        upsampled = np.kron(heat, np.ones((size // heat.shape[0], size // heat.shape[1])))
        axes[k].imshow(image, interpolation="nearest")
        axes[k].imshow(upsampled, cmap="inferno", alpha=0.6, interpolation="bilinear")
        note = f", {leading:.0%} on [CLS]" if leading > 0 else ""
        axes[k].set_title(f"fusion layer {k}{note}", fontsize=9)
    for axis in axes:
        axis.axis("off")
    focus = f"token {tokens[args.token]!r}" if args.token is not None else "mean over the question's tokens"
    figure.suptitle(f"{args.question!r} -> {answer} ({float(probabilities.max()):.2f}); {focus}", fontsize=9)
    figure.tight_layout()
    figure.savefig(args.output, dpi=120)
    print(f"{answer} ({float(probabilities.max()):.3f}); attention maps in {args.output}", file=sys.stderr)
    return args.output


if __name__ == "__main__":
    main()
