"""
MMFusion image processor: the one function that turns an image into model input, for training and for serving.

`load_pixels` decodes an image (a path, bytes, a PIL image, a numpy array or a uint8 tensor), checks it (missing,
empty, truncated, not an image, too large, a path outside the data root), converts any mode to RGB and resizes it to
uint8 `(3, S, S)`. The training cache (`mm_fusion.data.prepare_dataset`) and [`MMFusionImageProcessor`] both call it,
so a saved model's processor gives the pixels the model was trained on, bit for bit. Normalisation is the model's
job (`image_mean` / `image_std` in its config), on its device.
"""

import io
import math
import os
import re
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_utils import BaseImageProcessor


# Default refusal limit, in pixels, for one image (PIL warns at 89M and refuses at 179M). 50 megapixels is far above
# any photo a fusion model is trained on and keeps a single decode under ~150 MB.
MAX_IMAGE_PIXELS = 50_000_000


class BadSample(Exception):
    """A row that cannot be trained on; `reason` is a short machine-readable tag."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _to_8_bit(image: Image.Image) -> Image.Image:
    """
    A 16/32-bit integer or float grayscale image as 8-bit. Integer values are read against the full scale of the
    bit depth they use (12-bit sensor data stored in 16 bits: 4095, not 65535), so an image that does not span its
    container's range keeps its contrast instead of turning black; floats in [0, 1] against 1.
    """
    array = np.asarray(image, dtype=np.float64)
    top = float(array.max()) if array.size else 0.0
    if image.mode == "F" and top <= 1.0:
        full_scale = 1.0
    else:
        full_scale = float(2 ** max(8, math.ceil(math.log2(max(top, 0.0) + 1))) - 1)
    return Image.fromarray(np.clip(array / full_scale * 255.0, 0, 255).round().astype(np.uint8), mode="L")


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL mode to RGB: transparency is composited on white, 16/32-bit and float images are rescaled."""
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        image = _to_8_bit(image)
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")  # http://, https://, s3://, gs://...


def _resolve_path(path: str, data_root: str | None) -> str:
    """An image path made absolute against `data_root`, refused if it points outside the root."""
    if data_root is None:
        return os.path.abspath(path)
    root = os.path.realpath(data_root)
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise BadSample("path_outside_root", f"{path!r} resolves outside the data root {data_root!r}")
    return full


def _array_to_image(value: np.ndarray | torch.Tensor) -> Image.Image:
    """A uint8 array or tensor, `(H, W)`, `(H, W, C)` or `(C, H, W)` with C in 1, 3, 4, as a PIL image."""
    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if array.dtype != np.uint8:
        if not np.issubdtype(array.dtype, np.integer) or array.size == 0 or array.min() < 0 or array.max() > 255:
            raise BadSample(
                "bad_array",
                f"an image array must hold uint8 values (0-255), got dtype {array.dtype}"
                + (
                    f" with values in [{array.min()}, {array.max()}]"
                    if array.size and array.dtype.kind in "iuf"
                    else ""
                ),
            )
        array = array.astype(np.uint8)
    if array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[-1] not in (1, 3, 4):
        array = array.transpose(1, 2, 0)  # channels first -> channels last
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)) or 0 in array.shape:
        raise BadSample(
            "bad_array", f"an image array must be (H, W), (H, W, C) or (C, H, W) with C in 1, 3, 4; got {array.shape}"
        )
    return Image.fromarray(np.ascontiguousarray(array))


def load_image(value: Any, data_root: str | None = None, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """
    Decode one image fully and return it as RGB, or raise `BadSample`. `value` is a path (relative to `data_root`
    when given), a `datasets.Image(decode=False)` dict with `bytes` / `path`, raw bytes, a PIL image, or a uint8
    numpy array / torch tensor (`(H, W)`, `(H, W, C)` or `(C, H, W)`).
    """
    if isinstance(value, (np.ndarray, torch.Tensor)):
        value = _array_to_image(value)
    if isinstance(value, Image.Image):
        image = value
    else:
        if isinstance(value, dict):  # empty bytes are an empty file, not a missing one at `path`
            value = value["bytes"] if value.get("bytes") is not None else value.get("path")
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, (bytes, bytearray)):
            if not value:
                raise BadSample("empty_file", "the image bytes are empty")
            stream, source = io.BytesIO(value), "<bytes>"
        elif isinstance(value, str) and _URL.match(value):
            raise BadSample("url_image", f"{value:.200} is a URL; URLs are not fetched: download the images first")
        elif isinstance(value, str) and value:
            source = _resolve_path(value, data_root)
            if not os.path.isfile(source):
                raise BadSample("missing_image", f"no file at {source}")
            if os.path.getsize(source) == 0:
                raise BadSample("empty_file", f"{source} has zero bytes")
            stream = source
        else:
            raise BadSample("missing_image", f"no image given ({type(value).__name__}: {value!r:.80})")
        try:
            image = Image.open(stream)
        except UnidentifiedImageError:
            raise BadSample("not_an_image", f"{source} is not an image PIL can read") from None
        except Image.DecompressionBombError as err:
            raise BadSample("too_large", str(err)) from None
    width, height = image.size
    if width * height > max_pixels:  # checked from the header, before decoding
        raise BadSample("too_large", f"{width}x{height} exceeds the limit of {max_pixels} pixels")
    try:
        image.load()
    except OSError as err:
        raise BadSample("truncated", f"decoding failed: {err}") from None
    return to_rgb(image)


def to_pixels(image: Image.Image, image_size: int) -> np.ndarray:
    """An RGB image resized (bilinear) to `image_size` x `image_size`, as uint8 `(3, S, S)`."""
    resized = image.resize((image_size, image_size), Image.BILINEAR)
    return np.ascontiguousarray(np.asarray(resized, dtype=np.uint8).transpose(2, 0, 1))


def load_pixels(
    value: Any, image_size: int, data_root: str | None = None, max_pixels: int = MAX_IMAGE_PIXELS
) -> np.ndarray:
    """
    The model input of one image: decoded and checked by [`load_image`] (raises `BadSample`), converted to RGB and
    resized by [`to_pixels`], uint8 `(3, S, S)`. Training's cache and the processor both call this.
    """
    return to_pixels(load_image(value, data_root, max_pixels), image_size)


def describe_image(value: Any) -> str:
    """A short description of an image input, for error messages and reports."""
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    if isinstance(value, dict) and value.get("path"):
        return value["path"]
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return f"<{type(value).__name__} {tuple(value.shape)} {value.dtype}>"
    if isinstance(value, Image.Image):
        return f"<PIL {value.mode} {value.size[0]}x{value.size[1]}>"
    return f"<{type(value).__name__}>"


class MMFusionImageProcessor(BaseImageProcessor):
    r"""
    Turns images into the `pixel_values` an MMFusion model was trained on: the same function as the training cache
    ([`load_pixels`]: decode, check, any mode to RGB with transparency on white and 16-bit data rescaled, bilinear
    resize), returning uint8 `(N, 3, S, S)`. The model normalises them itself with its config's `image_mean` /
    `image_std`, so nothing here has to be kept in step with training by hand.

    Args:
        size (`dict[str, int]`, *optional*, defaults to `{"height": 224, "width": 224}`):
            Output size; square (the training cache's `image_size`).
        max_pixels (`int`, *optional*, defaults to 50,000,000):
            Images with more pixels are refused, read from the header before decoding.
        data_root (`str`, *optional*):
            Relative image paths are read under this directory, and paths that resolve outside it are refused.

    Images may be paths, `bytes`, PIL images, uint8 numpy arrays or tensors (`(H, W)`, `(H, W, C)` or
    `(C, H, W)`), one or a list. A bad image is a `ValueError` that names it and its position in the list.

    Example:

    ```python
    >>> from PIL import Image
    >>> from mm_fusion import MMFusionImageProcessor

    >>> processor = MMFusionImageProcessor(size={"height": 64, "width": 64})
    >>> processor(Image.new("LA", (80, 60)), return_tensors="pt")["pixel_values"].dtype
    torch.uint8
    ```
    """

    model_input_names = ["pixel_values"]

    def __init__(
        self,
        size: dict[str, int] | None = None,
        max_pixels: int = MAX_IMAGE_PIXELS,
        data_root: str | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        size = dict(size) if size is not None else {"height": 224, "width": 224}
        if set(size) != {"height", "width"} or size["height"] != size["width"] or size["height"] < 1:
            raise ValueError(f"MMFusionImageProcessor needs a square size {{'height': S, 'width': S}}, got {size}.")
        self.size = size
        self.max_pixels = int(max_pixels)
        self.data_root = data_root

    @property
    def image_size(self) -> int:
        return self.size["height"]

    def __call__(self, images, **kwargs) -> BatchFeature:
        return self.preprocess(images, **kwargs)

    def preprocess(self, images, return_tensors: str | None = "pt", **kwargs) -> BatchFeature:
        """
        `images` (one or a list) as uint8 `pixel_values` `(N, 3, S, S)`: a torch tensor with `return_tensors="pt"`
        (the default), else a numpy array. Other keyword arguments (`size`, `max_pixels`, `data_root`) override the
        saved settings for this call.
        """
        unknown = set(kwargs) - {"size", "max_pixels", "data_root"}
        if unknown:
            raise TypeError(f"MMFusionImageProcessor got unexpected arguments {sorted(unknown)}.")
        size = kwargs.get("size") or self.size
        max_pixels = kwargs.get("max_pixels") or self.max_pixels
        data_root = kwargs.get("data_root", self.data_root)
        batch = self.load_batch(as_image_list(images), size["height"], max_pixels, data_root)
        pixel_values = torch.from_numpy(batch) if return_tensors == "pt" else batch
        return BatchFeature({"pixel_values": pixel_values})

    def load_batch(
        self,
        images: list,
        image_size: int | None = None,
        max_pixels: int | None = None,
        data_root: str | None = None,
        names: list[str] | None = None,
    ) -> np.ndarray:
        """
        A list of images as one uint8 array `(N, 3, S, S)`; a bad one raises a `ValueError` that names it, by
        `names[i]` when given (the pipelines pass each image's input position) or by its place in the list.
        """
        if not images:
            raise ValueError("MMFusionImageProcessor got no images.")
        image_size = image_size or self.image_size
        data_root = data_root if data_root is not None else self.data_root
        out = np.empty((len(images), 3, image_size, image_size), dtype=np.uint8)
        for i, image in enumerate(images):
            try:
                out[i] = load_pixels(image, image_size, data_root, max_pixels or self.max_pixels)
            except BadSample as bad:
                if names is not None:
                    where = names[i]
                else:
                    where = f"Cannot use image {i} of {len(images)}" if len(images) > 1 else "Cannot use the image"
                raise ValueError(f"{where} ({describe_image(image)}): {bad.reason}: {bad.detail}.") from None
        return out


def as_image_list(images) -> list:
    """One image or a list / tuple of them as a list (an array with a batch dimension is a list of images too)."""
    if isinstance(images, (list, tuple)):
        return list(images)
    if isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 4:
        return list(images)
    return [images]


__all__ = ["MMFusionImageProcessor", "load_image", "load_pixels", "to_pixels", "to_rgb"]
