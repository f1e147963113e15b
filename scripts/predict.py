"""Answer questions about images with a saved MMFusion model, through its pipeline.

    python scripts/predict.py --model outputs/easy_vqa --image shape.png --question "what shape is in the image?"
    python scripts/predict.py --model outputs/easy_vqa --input questions.jsonl --output answers.jsonl

One image and question prints the answers. `--input` (jsonl or csv with `image` and `question` columns; relative
image paths are read under `--data_root`, by default the input file's directory) runs them all in batches with a
progress bar and writes one jsonl line per input row, in order: its answers, or the reason it could not be answered.
No row is dropped. A pretraining model (`--task pretrain`) gives the image-text matching probability instead.

A question with words the model's tokenizer never saw is answered from its other words, with a warning; its row lists
them as `unknown_words`. Each option is given once (several questions go in an `--input` file).

Exit status: 0 when every question was answered; 3 when `--input` had rows that could not be (every row is still
written, with its `error`); 2 for a bad command line or a missing model, image or input file; 1 when the one image
cannot be read.
"""

import csv
import json
import os
import sys
import warnings
from dataclasses import dataclass, field

from transformers import pipeline

import mm_fusion  # registers the pipelines
from mm_fusion.cli import ScriptArgumentParser


EXIT_ROWS_FAILED = 3


@dataclass
class PredictArguments:
    model: str = field(metadata={"help": "A directory saved by scripts/train.py (model, processor, config)."})
    image: str | None = field(default=None, metadata={"help": "One image file."})
    question: str | None = field(default=None, metadata={"help": "One question (or text) about --image."})
    input: str | None = field(default=None, metadata={"help": "A .jsonl or .csv of image / question rows."})
    output: str | None = field(default=None, metadata={"help": "Where --input's answers go (default: stdout)."})
    image_column: str = field(default="image", metadata={"help": "--input's image column."})
    question_column: str = field(default="question", metadata={"help": "--input's question (or text) column."})
    data_root: str | None = field(default=None, metadata={"help": "Relative image paths are read under this."})
    top_k: int = field(default=1, metadata={"help": "Answers per question."})
    batch_size: int = field(default=64, metadata={"help": "Questions per model call."})
    device: str | None = field(default=None, metadata={"help": "cpu, cuda, cuda:1, ... (default: cpu)."})


def read_rows(path: str) -> list[dict]:
    """The rows of a jsonl or csv file; a jsonl line that is not a JSON object is kept as a row with its error."""
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    if not path.endswith((".jsonl", ".json")):
        raise ValueError(f"--input {path!r} must be a .jsonl or .csv file.")
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                row = {"_error": f"bad_json: line {number}: {err}"}
            rows.append(row if isinstance(row, dict) else {"_error": f"bad_json: line {number} is not an object"})
    return rows


class Predictor:
    """The right pipeline for the model's head, and the call that answers one batch of rows."""

    def __init__(self, args: PredictArguments):
        heads = set(mm_fusion.MMFusionConfig.from_pretrained(args.model).architectures or [])
        self.matching = "MMFusionForPretraining" in heads
        task = "image-text-matching" if self.matching else "image-text-classification"
        self.pipe = pipeline(task, model=args.model, device=args.device)
        self.top_k = args.top_k

    def __call__(self, images: list, questions: list[str]) -> list:
        # Unknown words are reported per row (`unknown_words`) and summed up at the end, not warned per batch.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", mm_fusion.UnknownWordsWarning)
            if self.matching:
                return self.pipe(image=images, text=questions)
            return self.pipe(image=images, question=questions, top_k=self.top_k)

    def unknown_words(self, output) -> list[str]:
        """The words of the question the tokenizer never saw, taken out of one input's output."""
        if self.matching:
            return output.pop("unknown_words", [])
        words = [answer.pop("unknown_words", []) for answer in output]  # each answer of the input has the same
        return words[0] if words else []


def predict_rows(predictor: Predictor, rows: list[dict], args: PredictArguments, root: str) -> list[dict]:
    """One result per row, in order: `answers` (or `score` for matching), or `error` with the reason."""
    results: list[dict] = []
    todo = []  # (row number, image, question) of the rows that are well-formed
    for number, row in enumerate(rows):
        result = {
            "row": number,
            **{k: row.get(k) for k in (args.image_column, args.question_column, "id") if k in row},
        }
        results.append(result)
        missing = [c for c in (args.image_column, args.question_column) if not row.get(c)]
        if "_error" in row or missing:
            result["error"] = row.get("_error") or f"missing_column: no {' / '.join(missing)} in this row"
            continue
        image = row[args.image_column]
        if isinstance(image, str) and not os.path.isabs(image):
            image = os.path.join(root, image)
        todo.append((number, image, row[args.question_column]))

    bar = _progress(len(todo))
    for start in range(0, len(todo), args.batch_size):
        batch = todo[start : start + args.batch_size]
        try:
            outputs = predictor([image for _, image, _ in batch], [question for _, _, question in batch])
        except ValueError:  # a bad input in this batch: answer its rows one by one to find it, keep the others
            outputs = []
            for _, image, question in batch:
                try:
                    outputs.append(predictor([image], [question])[0])
                except ValueError as err:
                    outputs.append(err)
        for (number, _, _), output in zip(batch, outputs):
            if isinstance(output, Exception):
                results[number]["error"] = str(output).replace("Input 0 ", "", 1)
                continue
            unknown = predictor.unknown_words(output)
            if predictor.matching:
                results[number]["score"] = output["score"]
            else:
                results[number]["answers"] = output
            if unknown:
                results[number]["unknown_words"] = unknown
        bar.update(len(batch))
    bar.close()
    return results


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="questions", unit="q", disable=total == 0)


def parse_args(argv: list[str] | None = None) -> tuple[PredictArguments, ScriptArgumentParser]:
    """The arguments, checked before any model is loaded: a mistake is a one-line error, exit status 2."""
    parser = ScriptArgumentParser(PredictArguments)
    argv = sys.argv[1:] if argv is None else list(argv)
    several = "to ask several questions, put them in an --input file (one row each)"
    parser.refuse_repeats(argv, hints={"--question": several, "--image": several})
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    if (args.input is None) == (args.image is None):
        parser.error("pass either --image with --question, or --input FILE.")
    if args.image is not None and not args.question:
        parser.error("--image needs --question.")
    if args.top_k < 1 or args.batch_size < 1:
        parser.error("--top_k and --batch_size must be at least 1.")
    try:
        mm_fusion.check_model_path(args.model)
    except FileNotFoundError as err:
        parser.error(f"--model: {err}")
    for option in ("image", "input"):
        path = getattr(args, option)
        if path is not None and not os.path.isfile(path):
            parser.error(f"--{option} {path}: no file at {os.path.abspath(path)}.")
    return args, parser


def main(argv: list[str] | None = None) -> list[dict]:
    """The answers (one result per question or row); the exit status follows from them (see the module docstring)."""
    args, parser = parse_args(argv)
    predictor = Predictor(args)
    if args.image is not None:
        try:
            (output,) = predictor([args.image], [args.question])
        except ValueError as err:  # an image that cannot be read: the pipeline names it and the reason
            sys.exit(f"{parser.prog}: error: --image {str(err).replace('Input 0 ', '', 1)}")
        unknown = predictor.unknown_words(output)
        if unknown:
            words = ", ".join(map(repr, unknown))
            print(
                f"{parser.prog}: warning: the model's tokenizer never saw {words}, so the answer rests on the other "
                "words of the question.",
                file=sys.stderr,
            )
        if predictor.matching:
            print(f"match probability: {output['score']:.4f}")
        else:
            for answer in output:
                print(f"{answer['answer']}\t{answer['score']:.4f}")
        return [output]

    rows = read_rows(args.input)
    root = args.data_root or os.path.dirname(os.path.abspath(args.input))
    results = predict_rows(predictor, rows, args, root)
    out = open(args.output, "w") if args.output else sys.stdout
    try:
        for result in results:
            out.write(json.dumps(result) + "\n")
    finally:
        if args.output:
            out.close()
    failed = sum("error" in r for r in results)
    unknown = sum("unknown_words" in r for r in results)
    print(
        f"{len(results) - failed} of {len(results)} rows answered, {failed} could not be"
        + (f"; {unknown} have words the tokenizer never saw (their `unknown_words`)" if unknown else ""),
        file=sys.stderr,
    )
    return results


if __name__ == "__main__":
    sys.exit(EXIT_ROWS_FAILED if any("error" in result for result in main()) else 0)
