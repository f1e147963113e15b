"""Where a model looks in the image for its answer: its map over the image (by default the model's default map, as
`pipeline(..., return_map=True)` and the demo show it), with a colour bar, the question -> answer and its score, the
method named, and how that map was measured at the end of the model's training.

    python scripts/visualize_attention.py --model outputs/easy_vqa --image shape.png \
        --question "what shape is in the image?" --output attention.png
    python scripts/visualize_attention.py --model outputs/sort_of_clevr --image a.png b.png \
        --question "Is the red object on the left?" "What is the shape of the blue object?"   # one row per pair

The default map is, for cross-attention fusion, input x gradient at the pixels weighted by the question's
cross-attention (`--method guided_gradient`), for the answer given; for late fusion input x gradient alone (`--method
input_x_gradient`). `--method attention` shows, per fusion layer, the question's attention over the image tokens,
averaged over heads and over its real tokens (or one token's with `--token`); a leading [CLS]-like image token's share
is reported apart. A tower conditioned by cross-attention (`vision_text_attention`) shows, with `--method
tower_attention --token N`, per stage the attention its cells give token N. `--method grad_cam`: Grad-CAM on the last
tower map the model reads. The maps come from `MMFusionForImageTextClassification.image_maps`; how often each peaks on
the object a question names: scripts/benchmarks/RESULTS.md, benchmark_pointing.py.
"""

import os
import sys
import textwrap
from dataclasses import dataclass, field

from transformers import AutoConfig, AutoModelForVisualQuestionAnswering, AutoProcessor

import mm_fusion  # registers the Auto classes
from mm_fusion.cli import ScriptArgumentParser
from mm_fusion.head_check import MissingHeadError, check_saved_head
from mm_fusion.image_maps import ANSWER_METHODS, METHODS, default_method, describe
from mm_fusion.map_plot import plot
from mm_fusion.map_scoring import measured_map_figures


@dataclass
class VisualizeArguments:
    model: str = field(metadata={"help": "A VQA / classification model directory saved with its processor."})
    image: list[str] = field(metadata={"help": "The image file(s); one per question, or one for all of them."})
    question: list[str] = field(metadata={"help": "The question(s) (or texts)."})
    output: str = field(default="attention.png", metadata={"help": "Where the PNG goes."})
    method: str | None = field(
        default=None,
        metadata={
            "help": "guided_gradient (the default: input x gradient weighted by the model's coarse map), "
            "input_x_gradient, attention (cross-attention fusion), grad_cam, or tower_attention (a tower conditioned "
            "by vision_text_attention: the cells' attention to --token)."
        },
    )
    token: int | None = field(default=None, metadata={"help": "One token position instead of the mean over tokens."})


def parse_args(argv: list[str] | None = None) -> VisualizeArguments:
    """The arguments, checked before any model is loaded: a mistake is a one-line error, exit status 2."""
    parser = ScriptArgumentParser(VisualizeArguments)
    argv = sys.argv[1:] if argv is None else list(argv)
    parser.refuse_repeats(argv)
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    if args.method is not None and args.method not in METHODS:
        parser.error(f"--method {args.method}: choose from {', '.join(METHODS)}.")
    if args.token is not None and args.method in (*ANSWER_METHODS, None):
        parser.error(f"--token picks one token's attention; the {args.method or 'default'} map has no tokens.")
    if args.method == "tower_attention" and args.token is None:
        parser.error("--method tower_attention maps the attention the cells give one token: give --token.")
    if len(args.image) not in (1, len(args.question)):
        parser.error(f"--image: give one image, or one per question ({len(args.question)}); got {len(args.image)}.")
    try:
        mm_fusion.check_model_path(args.model)
        # The maps of a VQA / classification model: any other head would answer from a fresh classifier.
        heads = ("MMFusionForImageTextClassification",)
        check_saved_head(heads, AutoConfig.from_pretrained(args.model), "scripts/visualize_attention.py", args.model)
    except (FileNotFoundError, MissingHeadError) as err:
        parser.error(f"--model: {err}")
    for image in args.image:
        if not os.path.isfile(image):
            parser.error(f"--image {image}: no file at {os.path.abspath(image)}.")
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    model = AutoModelForVisualQuestionAnswering.from_pretrained(args.model).eval()
    if args.method == "attention" and model.config.fusion_type == "late":
        raise SystemExit("--method attention: this model fuses late and has no cross-attention; use grad_cam.")
    processor = AutoProcessor.from_pretrained(args.model)
    images = args.image * len(args.question) if len(args.image) == 1 else args.image
    batch = processor(images=images, text=args.question)
    lengths = batch["attention_mask"].sum(1)
    if args.token is not None and not all(0 <= args.token < int(n) for n in lengths):
        raise SystemExit(f"--token {args.token} is outside a question's {int(lengths.min())} tokens.")
    result = model.image_maps(**batch, method=args.method, token=args.token)
    probabilities = result.logits.softmax(-1)
    rows = []
    for k, question in enumerate(args.question):
        answer = int(result.targets[k])
        layers = list(result.layers)
        if result.method == "attention" and float(result.leading_share[k].max()) > 0:
            layers = [f"{name}, {share:.0%} on [CLS]" for name, share in zip(layers, result.leading_share[k].tolist())]
        if args.token is not None:
            token = processor.tokenizer.convert_ids_to_tokens(batch["input_ids"][k][args.token : args.token + 1])[0]
            layers = [f"{name}, token {token!r}" for name in layers]
        rows.append(
            {
                "image": batch["pixel_values"][k].permute(1, 2, 0).numpy(),  # what the model saw (uint8, resized)
                "question": question,
                "answer": model.config.id2label[answer],
                "score": float(probabilities[k, answer]),
                "maps": result.maps[k],
                "layers": layers,
            }
        )
    kind = describe(result.method)
    # The figures measured at the end of training are the default map's.
    measured = measured_map_figures(args.model) if result.method == default_method(model.config) else ""
    title = f"Where the model looked: {kind}" + ("\n" + "\n".join(textwrap.wrap(measured, 100)) if measured else "")
    plot(rows, args.output, title=title)
    for row in rows:
        print(f"{row['answer']} ({row['score']:.3f}); {kind} in {args.output}", file=sys.stderr)
    return args.output


if __name__ == "__main__":
    main()
