"""Batches of prepared pairs: text padded to the longest in the batch, uint8 images read once per batch, sample ids."""

import itertools
import math
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from datasets import Dataset

from .image_codec import IMAGE_FORMATS, decode_pixels


class AlignmentError(RuntimeError):
    """A pair in a batch was about to be trained with an image that is not its own."""


def uint8_pixels(
    column: pa.ChunkedArray | pa.Array, shape: tuple[int, ...], out: np.ndarray | None = None
) -> np.ndarray:
    """
    An `Array3D(uint8)` Arrow column as one uint8 array of shape `(rows, *shape)`, copied once, straight from the
    Arrow buffers (which are memory-mapped from the cache) into `out` when given. datasets' numpy / torch formatters
    would return int64, 8x the bytes.
    """
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    if out is None:
        out = np.empty((len(column), *shape), dtype=np.uint8)
    if len(out) == 0:
        return out
    # The rows of a gathered batch come as one chunk each: their storage is joined once and flattened once (per-chunk
    # flattening and conversion cost more than the copy).
    storage = [chunk.storage if isinstance(chunk, pa.ExtensionArray) else chunk for chunk in chunks]
    values = storage[0] if len(storage) == 1 else pa.concat_arrays(storage)
    while pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        values = values.flatten()
    out[:] = values.to_numpy(zero_copy_only=False).reshape(len(out), *shape)
    return out


def _empty_uint8(shape: tuple[int, ...]) -> torch.Tensor:
    """
    An uninitialised uint8 tensor. In a DataLoader worker it is allocated in shared memory, as torch's own
    `default_collate` does, so that handing the batch to the main process costs no extra copy.
    """
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=torch.uint8)
    storage = torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(math.prod(shape))
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


class ImageTextCollator:
    """
    Data collator for the pairs of [`prepare_dataset`]: pads `input_ids` to the longest text in the batch (with an
    `attention_mask`), reads each distinct image of the batch once from the images table as uint8, and carries every
    sample's id. Normalisation is left to the model, which does it on its device once per batch.

    Args:
        images (`Dataset`):
            `PreparedData.images`: the table the pairs' `image_index` points into.
        pad_token_id (`int`, *optional*, defaults to 0):
            Token id used for padding (`tokenizer.pad_token_id`).
        pad_to_multiple_of (`int`, *optional*):
            Round the padded length up to a multiple of this (e.g. 8 for tensor cores).
        share_images (`bool`, *optional*, defaults to `True`):
            Return each distinct image once with an `image_index` per text (the vision tower then encodes it once).
            With `False`, one image per text, repeated where texts share one (for heads that need a 1:1 batch, such
            as contrastive pretraining).
        image_transform (`Callable`, *optional*):
            Random augmentation, called on each uint8 `(3, S, S)` image tensor of every batch, so it differs from
            epoch to epoch and never enters the cached preprocessing. Must return a uint8 tensor of the same shape,
            e.g. a `torchvision.transforms.v2` transform. A transform with `batched = True` is called once on the
            batch's `(N, 3, S, S)` images instead.
        check_alignment (`bool`, *optional*, defaults to `True`):
            Check that every image read for the batch is the one its pair was linked to at preprocessing (by its key)
            and raise [`AlignmentError`] otherwise. It costs one string comparison per sample.
        blank (`str`, *optional*):
            For ablations: `"image"` replaces every image with a black one (the model sees the text only), `"text"`
            keeps only the first and last token of every text (e.g. `[CLS] [SEP]`: the model sees the image only).

    Returns a dict with `pixel_values` (uint8), `image_index` (when sharing), `input_ids`, `attention_mask`,
    `labels` (when the pairs have them), and, ignored by the model, `image_rows` (each pair's row of the images
    table: its image's identity, e.g. for retrieval metrics) and `sample_ids` (a list of str).
    """

    def __init__(
        self,
        images: Dataset,
        pad_token_id: int = 0,
        pad_to_multiple_of: int | None = None,
        share_images: bool = True,
        image_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        check_alignment: bool = True,
        blank: str | None = None,
    ):
        if blank not in (None, "image", "text"):
            raise ValueError(f"blank must be None, 'image' or 'text', got {blank!r}.")
        self.image_shape = self._attach_images(images)
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.share_images = share_images
        self.image_transform = image_transform
        self.check_alignment = check_alignment
        self.blank = blank

    def _attach_images(self, images: Dataset) -> tuple[int, ...]:
        """Keep the images table the pairs' `image_index` points into, after checking its columns, and return the
        shape of one of its images."""
        self.encoded = "image_bytes" in images.column_names  # a JPEG / WebP images table (`image_format`)
        missing = {"image_key", "image_bytes" if self.encoded else "pixel_values"} - set(images.column_names)
        if missing:
            raise ValueError(
                f"`images` must be PreparedData.images from prepare_dataset; it lacks the columns {sorted(missing)}."
            )
        self.images = images.with_format("arrow")
        self._columns: dict | None = None  # built on first use, in the process that reads (see `_rows`)
        if self.encoded:
            if len(images) == 0:
                raise ValueError("`images` (an encoded images table) has no rows: there is no image to train on.")
            first = decode_pixels(self.images[:1].column("image_bytes")[0].as_py(), 0, "encoded")
            return tuple(first.shape)
        return tuple(images.features["pixel_values"].shape)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        if not features:
            raise ValueError("ImageTextCollator got an empty list of pairs; a batch needs at least one.")
        missing = {"id", "image_index", "image_key", "input_ids"} - set(features[0])
        if missing:
            raise ValueError(
                f"The batch lacks {sorted(missing)}: pass the pairs of prepare_dataset, and keep their columns (with "
                "Trainer, set remove_unused_columns=False)."
            )
        sample_ids = [str(f["id"]) for f in features]
        rows = [int(f["image_index"]) for f in features]
        unique_rows = list(dict.fromkeys(rows))
        position = {row: i for i, row in enumerate(unique_rows)}
        image_index = torch.tensor([position[row] for row in rows], dtype=torch.long)
        table = self._rows(unique_rows)
        if self.check_alignment:
            self._check_alignment(features, table.column("image_key").to_pylist(), position)
        pixel_values = _empty_uint8((len(unique_rows), *self.image_shape))
        if self.encoded:  # decoded here, in the data loader's workers
            for i, data in enumerate(table.column("image_bytes").to_pylist()):
                decode_pixels(data, self.image_shape[-1], "encoded", out=pixel_values.numpy()[i])
        else:
            uint8_pixels(table.column("pixel_values"), self.image_shape, out=pixel_values.numpy())
        pixel_values = self._augment(pixel_values)
        batch = {"pixel_values": pixel_values}
        if self.share_images:
            batch["image_index"] = image_index
        elif len(unique_rows) < len(rows):
            batch["pixel_values"] = pixel_values[image_index]
        batch.update(self._texts_and_labels(features))
        batch["image_rows"] = torch.tensor(rows, dtype=torch.long)
        batch["sample_ids"] = sample_ids
        return batch

    def _rows(self, rows: list[int]) -> pa.Table:
        """
        The image key and pixel (or encoded image) columns of these rows of the images table, as one slice of the
        columns' plain storage per row. datasets' own row gather does the same slicing but rebuilds the `Array3D`
        extension type for every slice (a JSON round trip per row: on easy-VQA 2.9 ms of a batch's 4.3 ms of
        collation; 0.3 ms this way). A table with an indices mapping (shuffled or filtered after preparation) is
        gathered by datasets.
        """
        if self.images._indices is not None:  # datasets has no public accessor for it
            return self.images[rows]
        if self._columns is None:
            whole = self.images[: len(self.images)]  # a zero-copy slice of the (memory-mapped) cache
            self._columns = {}
            for name in ["image_key", "image_bytes" if self.encoded else "pixel_values"]:
                chunks = [c.storage if isinstance(c, pa.ExtensionArray) else c for c in whole.column(name).chunks]
                self._columns[name] = (chunks, np.cumsum([0] + [len(chunk) for chunk in chunks]))
        if min(rows) < 0 or max(rows) >= len(self.images):
            bad = [row for row in rows if not 0 <= row < len(self.images)]
            raise IndexError(f"Image rows {bad} out of range for the images table's {len(self.images)} rows.")
        columns = []
        for chunks, starts in self._columns.values():
            which = np.searchsorted(starts, rows, side="right") - 1
            offsets = np.asarray(rows) - starts[which]
            columns.append(pa.chunked_array([chunks[k].slice(i, 1) for k, i in zip(which.tolist(), offsets.tolist())]))
        return pa.table(columns, names=list(self._columns))

    def __getstate__(self) -> dict[str, Any]:
        # A data loader worker gets the collator pickled: the gathered columns would travel by value (a copy of every
        # image), the `Dataset` travels as its cache file's path. The worker builds its own on first use.
        return {**self.__dict__, "_columns": None}

    def _augment(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The random image transform, and the image ablation (black images)."""
        if getattr(self.image_transform, "batched", False):
            pixel_values = self.image_transform(pixel_values)
        elif self.image_transform is not None:
            pixel_values = torch.stack([self.image_transform(image) for image in pixel_values])
        if self.blank == "image":
            pixel_values.zero_()
        return pixel_values

    def _texts_and_labels(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Padded `input_ids` and `attention_mask` (the text ablation keeps the first and last token), and
        `labels` when the pairs have them."""
        texts = [f["input_ids"] for f in features]
        if self.blank == "text":
            texts = [[t[0], t[-1]] if len(t) > 1 else list(t) for t in texts]
        batch = self._pad(texts)
        if "labels" in features[0]:
            labels = [f["labels"] for f in features]
            dtype = torch.float32 if isinstance(labels[0], (list, tuple, np.ndarray)) else torch.long
            batch["labels"] = torch.tensor(np.asarray(labels), dtype=dtype)
        return batch

    def _pad(self, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
        """Right-pad token ids to the longest sequence (rounded up to `pad_to_multiple_of`)."""
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        length = int(lengths.max())
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        attention_mask = np.arange(length)[None, :] < lengths[:, None]  # (batch, length)
        input_ids = np.full((len(sequences), length), self.pad_token_id, dtype=np.int64)
        # The tokens in row-major order fill the unmasked positions, row by row: one copy, no loop over the rows.
        input_ids[attention_mask] = np.fromiter(itertools.chain.from_iterable(sequences), np.int64, int(lengths.sum()))
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask.astype(np.int64)),
        }

    @staticmethod
    def _check_alignment(features, keys: list[str], position: dict[int, int]) -> None:
        for feature in features:
            row = int(feature["image_index"])
            found = keys[position[row]]
            if found != feature["image_key"]:
                raise AlignmentError(
                    f"Sample {feature['id']!r} was paired with image {feature['image_key']!r} at preprocessing, but "
                    f"row {row} of the images table holds {found!r}. The images table does not belong to these pairs "
                    "(was it filtered, shuffled or taken from another run?)."
                )


class StreamingCollator(ImageTextCollator):
    """
    Data collator for the streaming pairs of [`prepare_stream`]: every pair carries its own image as bytes (raw
    uint8, JPEG or lossless WebP, `image_format`), decoded here (in the data loader's workers) into one uint8 batch.
    The alignment check compares each image's CRC-32 with the one computed when the pair was prepared. Same outputs
    and options as [`ImageTextCollator`], one image per pair; `image_rows` identifies images by their key's hash.
    """

    def __init__(
        self,
        image_size: int,
        image_format: str = "uint8",
        pad_token_id: int = 0,
        pad_to_multiple_of: int | None = None,
        image_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        check_alignment: bool = True,
        blank: str | None = None,
    ):
        self.image_size = image_size
        self.image_format = image_format
        # One image per pair, each its own: nothing to share.
        super().__init__(
            None,
            pad_token_id=pad_token_id,
            pad_to_multiple_of=pad_to_multiple_of,
            share_images=False,
            image_transform=image_transform,
            check_alignment=check_alignment,
            blank=blank,
        )

    def _attach_images(self, images: Dataset | None) -> tuple[int, ...]:
        """No images table (`images` is None): every pair brings its image's bytes, decoded at `image_size`."""
        if self.image_format not in IMAGE_FORMATS:
            raise ValueError(f"image_format must be one of {IMAGE_FORMATS}, got {self.image_format!r}.")
        return (3, self.image_size, self.image_size)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        if not features:
            raise ValueError("StreamingCollator got an empty list of pairs; a batch needs at least one.")
        missing = {"id", "image_bytes", "image_crc", "image_key", "input_ids"} - set(features[0])
        if missing:
            raise ValueError(f"The batch lacks {sorted(missing)}: pass the pairs of prepare_stream.")
        pixel_values = _empty_uint8((len(features), *self.image_shape))
        out = pixel_values.numpy()
        for i, feature in enumerate(features):
            data = feature["image_bytes"]
            if self.check_alignment and zlib.crc32(data) != feature["image_crc"]:
                raise AlignmentError(
                    f"Sample {feature['id']!r} (shard {feature.get('shard')!r}, key {feature.get('key')!r}): its "
                    "image bytes are not the ones prepared with its text (CRC-32 differs)."
                )
            decode_pixels(data, self.image_size, self.image_format, out=out[i])
        batch = {"pixel_values": self._augment(pixel_values), **self._texts_and_labels(features)}
        keys = [f["image_key"] for f in features]
        batch["image_rows"] = torch.tensor([zlib.crc32(k.encode()) for k in keys], dtype=torch.long)
        batch["sample_ids"] = [str(f["id"]) for f in features]
        return batch
