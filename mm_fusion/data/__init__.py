"""Data pipelines on `datasets`: sources, validation with a quarantine report, and map-based preprocessing."""

from .preprocessing import BadSample, load_image, prepare_dataset, prepare_examples, to_rgb
from .sources import load_easy_vqa, load_pairs


__all__ = [
    "BadSample",
    "load_easy_vqa",
    "load_image",
    "load_pairs",
    "prepare_dataset",
    "prepare_examples",
    "to_rgb",
]
