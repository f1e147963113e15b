"""Data pipelines on `datasets`: sources, validation with a quarantine report, map-based preprocessing, collation."""

from ..image_processing_mm_fusion import BadSample, load_image, load_pixels, to_rgb
from .collator import AlignmentError, ImageTextCollator, StreamingCollator, uint8_pixels
from .image_codec import IMAGE_FORMATS, choose_image_format, decode_pixels, encode_pixels
from .preprocessing import PreparedData, image_key, prepare_dataset, prepare_images, prepare_texts
from .sort_of_clevr import load_sort_of_clevr
from .sources import load_easy_vqa, load_pairs
from .streaming import (
    ShardError,
    ShuffledStream,
    StreamSource,
    prepare_stream,
    read_quarantine,
    split_by_rank,
    stream_source,
)


__all__ = [
    "AlignmentError",
    "BadSample",
    "ImageTextCollator",
    "IMAGE_FORMATS",
    "PreparedData",
    "ShardError",
    "ShuffledStream",
    "StreamSource",
    "StreamingCollator",
    "image_key",
    "choose_image_format",
    "decode_pixels",
    "encode_pixels",
    "load_easy_vqa",
    "load_image",
    "load_pixels",
    "load_sort_of_clevr",
    "load_pairs",
    "prepare_dataset",
    "prepare_stream",
    "prepare_images",
    "prepare_texts",
    "read_quarantine",
    "split_by_rank",
    "stream_source",
    "to_rgb",
    "uint8_pixels",
]
