"""Data pipelines on `datasets`: sources, validation with a quarantine report, map-based preprocessing, collation."""

from .collator import AlignmentError, ImageTextCollator, uint8_pixels
from .preprocessing import (
    BadSample,
    PreparedData,
    image_key,
    load_image,
    prepare_dataset,
    prepare_images,
    prepare_texts,
    to_rgb,
)
from .sources import load_easy_vqa, load_pairs


__all__ = [
    "AlignmentError",
    "BadSample",
    "ImageTextCollator",
    "PreparedData",
    "image_key",
    "load_easy_vqa",
    "load_image",
    "load_pairs",
    "prepare_dataset",
    "prepare_images",
    "prepare_texts",
    "to_rgb",
    "uint8_pixels",
]
