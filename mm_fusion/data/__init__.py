"""
Data pipelines on `datasets`: sources, validation with a quarantine report, map-based preprocessing, collation.

The path of a pair, from raw rows to the model:

1. **Raw rows.** A source gives rows of an image (a path, bytes, an array or a PIL image), a text and, for vqa /
   classify, a label: [`load_easy_vqa`], [`load_sort_of_clevr`], [`load_pairs`] (users' tables in every form they
   export, read by [`read_table`]: a defect of the table itself is a [`DataError`] naming its file and line; labels
   are class names, [`label_name`]) as a `DatasetDict`, or, for corpora too large for one disk, shards read as a
   stream ([`stream_source`]:
   webdataset tars, jsonl files with image folders, `load_dataset(..., streaming=True)`; `streaming.readers`).
2. **Validation.** Every row is checked by the same [`prepare_images`] / [`prepare_texts`]: a row whose image is
   missing, empty, truncated, not an image, too large, outside the data root or a URL, or whose text or label is
   bad, is left out and written to a quarantine report with its id, source, line and reason, never dropped
   silently. A stream is validated shard by shard as it is read, in the data loader's workers
   (`streaming.validation`: [`prepare_stream`], [`read_quarantine`]).
3. **Cache or stream.** Arrow: [`prepare_dataset`] tokenizes and resizes once, by batched `map`, into the `datasets`
   cache, each distinct image stored once ([`PreparedData`]; uint8, JPEG or WebP, [`encode_pixels`]). Stream: each
   rank reads its own part, shuffled by a buffer and resumable exactly (`streaming.shuffle`: [`split_by_rank`],
   [`ShuffledStream`]).
4. **Collator.** [`ImageTextCollator`] (Arrow: each batch's images once, texts padded to the longest) or
   [`StreamingCollator`] makes the batch: uint8 `pixel_values`, `input_ids`, `attention_mask`, `labels`.
5. **Model.** The model normalises the uint8 pixels on its own device with the processor's mean and std.

`mm_fusion.training` chooses the Arrow path or the streaming one once per run, from `--streaming`.
"""

from ..image_processing_mm_fusion import BadSample, load_image, load_pixels, to_rgb
from .collator import AlignmentError, ImageTextCollator, StreamingCollator, uint8_pixels
from .fashion_mnist import load_fashion_mnist
from .image_codec import IMAGE_FORMATS, choose_image_format, decode_pixels, encode_pixels
from .labels import class_names, label_name
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
from .tables import LINE_COLUMN, DataError, read_table, saved_splits


__all__ = [
    "AlignmentError",
    "DataError",
    "LINE_COLUMN",
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
    "class_names",
    "decode_pixels",
    "encode_pixels",
    "load_easy_vqa",
    "load_fashion_mnist",
    "label_name",
    "load_image",
    "load_pixels",
    "load_sort_of_clevr",
    "load_pairs",
    "prepare_dataset",
    "prepare_stream",
    "prepare_images",
    "prepare_texts",
    "read_quarantine",
    "read_table",
    "saved_splits",
    "split_by_rank",
    "stream_source",
    "to_rgb",
    "uint8_pixels",
]
