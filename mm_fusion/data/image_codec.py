"""How prepared images are stored: raw uint8, JPEG or lossless WebP bytes, and the rule that picks one."""

import io

import numpy as np


IMAGE_FORMATS = ("uint8", "jpeg", "webp")
# `auto` keeps raw uint8 while the images table stays under this many bytes, and switches to JPEG above it.
# Measured (scripts/benchmarks/results/image_cache.md): JPEG is 15-49x smaller than uint8 but decodes at ~2,200
# images/s per loader thread at 224 px against ~17,000 for uint8. Small tables cost nothing to keep raw, and large
# ones would not fit a disk or page cache raw.
AUTO_UINT8_LIMIT = 8 * 2**30


def choose_image_format(image_format: str, num_images: int, image_size: int) -> str:
    """`image_format` itself, or for `"auto"` uint8 when `num_images` raw images fit `AUTO_UINT8_LIMIT`, else JPEG."""
    if image_format not in (*IMAGE_FORMATS, "auto"):
        raise ValueError(f"image_format must be one of {(*IMAGE_FORMATS, 'auto')}, got {image_format!r}.")
    if image_format != "auto":
        return image_format
    return "uint8" if num_images * 3 * image_size**2 <= AUTO_UINT8_LIMIT else "jpeg"


def encode_pixels(pixels: np.ndarray, image_format: str = "uint8", quality: int = 90) -> bytes:
    """uint8 `(3, S, S)` pixels as the bytes an image cache holds: raw (`"uint8"`), JPEG at `quality`, or lossless
    WebP (`"webp"`: the exact pixels, smaller on disk, slower to decode)."""
    if image_format == "uint8":
        return np.ascontiguousarray(pixels, dtype=np.uint8).tobytes()
    from PIL import Image

    buffer = io.BytesIO()
    image = Image.fromarray(np.ascontiguousarray(pixels.transpose(1, 2, 0)))
    if image_format == "jpeg":
        image.save(buffer, format="JPEG", quality=quality, subsampling=0)  # 4:4:4, no chroma halving
    elif image_format == "webp":
        image.save(buffer, format="WEBP", lossless=True, quality=100, method=0)
    else:
        raise ValueError(f"image_format must be one of {IMAGE_FORMATS}, got {image_format!r}.")
    return buffer.getvalue()


def decode_pixels(data: bytes, image_size: int, image_format: str = "uint8", out: np.ndarray | None = None):
    """The uint8 `(3, S, S)` pixels of [`encode_pixels`]'s bytes, into `out` when given. Any format but `"uint8"` is
    read by PIL from the bytes themselves (JPEG or WebP alike)."""
    if image_format == "uint8":
        pixels = np.frombuffer(data, dtype=np.uint8).reshape(3, image_size, image_size)
    else:
        from PIL import Image

        image = Image.open(io.BytesIO(data))  # stored at its final size already
        pixels = np.asarray(image.convert("RGB"), dtype=np.uint8).transpose(2, 0, 1)
    if out is None:
        return np.array(pixels)
    out[...] = pixels
    return out
