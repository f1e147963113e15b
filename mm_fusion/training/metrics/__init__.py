"""
The evaluation metrics of the tasks: `evaluate` modules that ship with mm_fusion and load from their local path (no
hub access), and factories of the `compute_metrics` / `preprocess_logits_for_metrics` functions `Trainer` takes.
"""

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np


METRICS_DIR = Path(__file__).parent


def load_metric(name: str, **kwargs):
    """`evaluate.load` of one of the shipped modules: `"accuracy"` or `"retrieval"`."""
    import evaluate

    path = METRICS_DIR / f"{name}.py"
    if not path.is_file():
        available = sorted(p.stem for p in METRICS_DIR.glob("*.py") if p.stem != "__init__")
        raise ValueError(f"No shipped metric {name!r}; available: {available}.")
    return evaluate.load(str(path), **kwargs)


def classification_metrics(groups: Mapping[str, np.ndarray] | None = None) -> tuple[Callable, Callable]:
    """
    `compute_metrics` and `preprocess_logits_for_metrics` for a classification head: `accuracy` and
    `majority_accuracy` (the shipped accuracy module), and for each column of `groups` (its value for every evaluation
    pair, in the evaluation order) the accuracy within each value, as `accuracy_<value>`. The logits are reduced to
    class ids as they are gathered, so evaluation never holds every pair's logits.
    """
    metric = load_metric("accuracy")
    groups = {column: np.asarray(values) for column, values in (groups or {}).items()}

    def compute_metrics(prediction) -> dict[str, float]:
        predictions, references = prediction.predictions, prediction.label_ids
        results = metric.compute(predictions=predictions, references=references)
        for column, values in groups.items():
            if len(values) != len(predictions):
                raise ValueError(f"{len(predictions)} predictions for {len(values)} evaluation pairs.")
            for value in sorted(set(values.tolist())):
                rows = values == value
                results[f"accuracy_{value}"] = metric.compute(
                    predictions=predictions[rows], references=references[rows]
                )["accuracy"]
        return results

    def preprocess_logits_for_metrics(logits, labels):
        return (logits[0] if isinstance(logits, tuple) else logits).argmax(-1)

    return compute_metrics, preprocess_logits_for_metrics


def retrieval_metrics() -> Callable:
    """`compute_metrics` for a pretraining head, whose predictions are the (image, text) embeddings and labels each
    pair's image row: retrieval Recall@1/5/10 in both directions and their mean (the shipped retrieval module)."""
    metric = load_metric("retrieval")

    def compute_metrics(prediction) -> dict[str, float]:
        image_embeds, text_embeds = prediction.predictions
        return metric.compute(image_embeds=image_embeds, text_embeds=text_embeds, image_ids=prediction.label_ids)

    return compute_metrics


__all__ = ["classification_metrics", "load_metric", "retrieval_metrics"]
