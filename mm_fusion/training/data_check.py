"""
`scripts/train.py --check_data`: the data of a run loaded and validated exactly as the same command would train on it
(the same tables, columns, classes, tokenizer, image size and checks, which also fill the preprocessing cache that
the run then reuses), a short report instead of training, and the refusal the run would end with, if any.
"""

from collections import Counter
from collections.abc import Callable

import numpy as np

from ..data import PreparedData
from .arguments import DataArguments, ModelArguments
from .data import TrainingData, check_usable, file_order, prepare_pairs, quarantine_file, source_of
from .models import build_model, build_tokenizer, input_image_size


EXAMPLES = 3  # rows shown for each reason a row was left out


def check_data(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args,
    data: TrainingData,
    show: Callable[[str], None] | None = None,
) -> PreparedData:
    """
    Validate `data` as the run would ([`prepare_pairs`]: every image decoded and checked, texts and labels checked,
    the quarantine report written), `show` the report ([`data_report`]; default: `print` on the main process), then
    raise the [`DataError`] the run would stop with ([`check_usable`]), if any. The model is built (not trained) for
    the image size its processor serves.
    """
    if show is None:
        show = print if training_args.process_index == 0 else lambda report: None
    if data.path.streaming:
        raise ValueError("--check_data reads a whole table; a --streaming run's shards are checked as they are read.")
    tokenizer = build_tokenizer(model_args, data_args, training_args, data)
    model = build_model(model_args, tokenizer, data.labels, data_args.image_size or 64, data_args.max_length)
    image_size = input_image_size(model.config, data_args.image_size)
    prepared = prepare_pairs(data, tokenizer, image_size, model_args.task, data_args, training_args)
    show(data_report(prepared, data, data_args, image_size, quarantine_file(training_args)))
    check_usable(prepared, data_args, quarantine_file(training_args))
    pairs = {split: len(kept) for split, kept in prepared.pairs.items()}
    evaluation = f" and evaluate on {pairs['eval']:,}" if "eval" in pairs else ""
    show(f"ok: scripts/train.py would train on {pairs['train']:,} pairs{evaluation} (drop --check_data to train).")
    return prepared


def data_report(
    prepared: PreparedData, data: TrainingData, data_args: DataArguments, image_size: int, quarantine_path
) -> str:
    """Rows per split, classes and their counts, the rows left out by reason with examples, and the images' sizes."""
    lines = []
    for split, kept in prepared.pairs.items():
        bad = sum(1 for q in prepared.quarantine if q.get("split") == split)
        lines.append(f"{split}: {len(kept) + bad:,} rows from {source_of(data_args, split)}, {len(kept):,} usable")
    if data.labels is not None:
        counts = Counter(prepared.pairs["train"]["labels"])
        listed = ", ".join(f"{data.labels[i]} {n:,}" for i, n in counts.most_common(20))
        more = f", {len(counts) - 20} more" if len(counts) > 20 else ""
        lines.append(f"classes: {len(data.labels)} (usable training rows: {listed}{more})")
        unused = [name for i, name in enumerate(data.labels) if i not in counts]
        if unused:
            lines.append(f"  no usable training row: {', '.join(unused[:20])}")
    total = sum(len(kept) for kept in prepared.pairs.values()) + len(prepared.quarantine)
    if prepared.quarantine:
        reasons = Counter(q["reason"].split(":", 1)[0] for q in prepared.quarantine)
        summary = ", ".join(f"{reason} {count:,}" for reason, count in reasons.most_common())
        share = len(prepared.quarantine) / total
        lines.append(f"left out: {len(prepared.quarantine):,} of {total:,} rows ({share:.1%}): {summary}")
        for reason, _ in reasons.most_common():
            entries = [q for q in prepared.quarantine if q["reason"].split(":", 1)[0] == reason]
            for q in sorted(entries, key=file_order)[:EXAMPLES]:
                place = f"line {q['line']}" if "line" in q else f"id {q['id']!r}"
                lines.append(f"  {q.get('split', '')} {place}: {q['reason']}")
    else:
        lines.append(f"left out: none of {total:,} rows")
    sizes = prepared.image_sizes
    if sizes is not None and len(sizes):
        median = np.median(sizes, axis=0).astype(int)
        smallest, largest = sizes[np.argmin(sizes.prod(1))], sizes[np.argmax(sizes.prod(1))]
        lines.append(
            f"images: {len(sizes):,} distinct usable, {smallest[0]}x{smallest[1]} to {largest[0]}x{largest[1]} pixels "
            f"(median {median[0]}x{median[1]}), resized to {image_size}x{image_size}"
        )
    lines.append(f"every row left out, with its reason: {quarantine_path}")
    return "\n".join(lines)
