"""Quick start: build a small MMFusion VQA model and processor on easy-VQA, fit a few batches, save, reload, predict.

Runs offline on a CPU in about a minute: `python scripts/quickstart.py`. It shows the pieces end to end (a tokenizer
trained on the questions, the processor, the model, `save_pretrained`, loading back with `trust_remote_code`);
it is not the training recipe.
"""

import sys
import time
from dataclasses import dataclass, field

import easy_vqa
import torch
from PIL import Image
from transformers import (
    AutoModelForVisualQuestionAnswering,
    AutoProcessor,
    BertConfig,
    HfArgumentParser,
    ViTConfig,
    pipeline,
)

from mm_fusion import (
    MMFusionConfig,
    MMFusionForImageTextClassification,
    MMFusionImageProcessor,
    MMFusionProcessor,
    train_tokenizer,
)


@dataclass
class QuickstartArguments:
    output_dir: str = field(default="outputs/quickstart", metadata={"help": "Where the model and processor go."})
    num_samples: int = field(default=64, metadata={"help": "Training (image, question) pairs to fit."})
    steps: int = field(default=150, metadata={"help": "Optimizer steps."})
    batch_size: int = field(default=16, metadata={"help": "Pairs per step."})
    fusion_type: str = field(default="hierarchical", metadata={"help": "hierarchical, cross_attention or late."})
    seed: int = field(default=0, metadata={"help": "Random seed."})


def load_pairs(split: str, n: int) -> tuple[list[Image.Image], list[str], list[str]]:
    """The first `n` (image, question, answer) triples of an easy-VQA split, images decoded as RGB."""
    train = split == "train"
    questions, answers, image_ids = easy_vqa.get_train_questions() if train else easy_vqa.get_test_questions()
    paths = easy_vqa.get_train_image_paths() if train else easy_vqa.get_test_image_paths()
    images = [Image.open(paths[i]).convert("RGB") for i in image_ids[:n]]
    return images, list(questions[:n]), list(answers[:n])


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(QuickstartArguments).parse_args_into_dataclasses(args=argv)
    torch.manual_seed(args.seed)
    answers = easy_vqa.get_answers()
    label2id = {a: i for i, a in enumerate(answers)}

    tokenizer = train_tokenizer(easy_vqa.get_train_questions()[0], vocab_size=1000, model_max_length=32)
    processor = MMFusionProcessor(MMFusionImageProcessor(size={"height": 64, "width": 64}), tokenizer)
    config = MMFusionConfig(
        vision_config=ViTConfig(
            image_size=64,
            patch_size=8,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=512,
        ),
        text_config=BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=512,
            max_position_embeddings=32,
        ),
        fusion_type=args.fusion_type,
        num_fusion_layers=2,
        projection_dim=128,
        id2label=dict(enumerate(answers)),
        label2id=label2id,
    )
    model = MMFusionForImageTextClassification(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, fusion {args.fusion_type}")

    images, questions, answer_texts = load_pairs("train", args.num_samples)
    batch = processor(images=images, text=questions, padding=True, return_tensors="pt")
    labels = torch.tensor([label2id[a] for a in answer_texts])

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model.train()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, args.num_samples, (args.batch_size,))
        loss = model(**{k: v[idx] for k, v in batch.items()}, labels=labels[idx]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.4f}  ({time.perf_counter() - start:.1f}s)")

    model.eval()
    with torch.no_grad():
        fit_accuracy = (model(**batch).logits.argmax(-1) == labels).float().mean().item()
    print(f"accuracy on the {args.num_samples} pairs it was fitted to: {fit_accuracy:.3f}")

    model.save_pretrained(args.output_dir)
    processor.save_pretrained(args.output_dir)
    # Load back the way a user without mm_fusion would: the code travels with the weights.
    reloaded = AutoModelForVisualQuestionAnswering.from_pretrained(args.output_dir, trust_remote_code=True).eval()
    reloaded_processor = AutoProcessor.from_pretrained(args.output_dir, trust_remote_code=True)
    test_images, test_questions, test_answers = load_pairs("test", 5)
    test_batch = reloaded_processor(images=test_images, text=test_questions, padding=True, return_tensors="pt")
    with torch.no_grad():
        predictions = reloaded(**test_batch).logits.argmax(-1).tolist()
    # The same through the pipeline, which reads the images with the saved processor and batches the questions.
    answerer = pipeline("image-text-classification", model=args.output_dir)
    served = answerer(image=test_images, question=test_questions)
    for question, answer, pred, top in zip(test_questions, test_answers, predictions, served):
        print(
            f"  {question!r:50} true {answer:10} predicted {reloaded.config.id2label[pred]:10} "
            f"pipeline {top[0]['answer']} ({top[0]['score']:.2f})"
        )
    print(f"saved to {args.output_dir}")
    return {"fit_accuracy": fit_accuracy, "output_dir": args.output_dir}


if __name__ == "__main__":
    main(sys.argv[1:])
