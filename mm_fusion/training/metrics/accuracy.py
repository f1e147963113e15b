"""Accuracy as an `evaluate` module shipped with mm_fusion, loaded by local path (the hub's copy needs a network)."""

import datasets
import evaluate
import numpy as np


_DESCRIPTION = """
Fraction of predictions equal to their reference class. References of -100 (ignored labels) are left out. With
`num_labels`, also reports the accuracy of always predicting the most common reference class, as a floor.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[int]`): predicted class indices.
    references (`list[int]`): true class indices (-100 = ignore).
Returns:
    accuracy (`float`): in [0, 1].
    majority_accuracy (`float`): accuracy of the most common reference class.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        keep = references != -100
        predictions, references = predictions[keep], references[keep]
        if len(references) == 0:
            raise ValueError("accuracy needs at least one reference that is not -100.")
        majority = np.bincount(references).max() / len(references)
        return {"accuracy": float((predictions == references).mean()), "majority_accuracy": float(majority)}
