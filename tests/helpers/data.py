"""Small test data made in code: texts for tokenizers, random images, Fashion-MNIST's IDX files."""

import gzip
from pathlib import Path

import numpy as np
from PIL import Image


CORPUS = [
    "what color is the circle?",
    "is there a blue triangle in the image?",
    "what shape is present?",
    "does the image contain a rectangle?",
    "is no red shape present?",
]


def random_images(n: int) -> list[Image.Image]:
    """`n` RGB images of noise, of different sizes (40+i x 50), the same on every call."""
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (40 + i, 50, 3), dtype=np.uint8)) for i in range(n)]


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    """An IDX file of unsigned bytes, written here from the format's description (magic 0x0800 + dimensions, then
    each dimension as a big-endian uint32, then the bytes)."""
    magic = 0x0800 + array.ndim if magic is None else magic
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_split(root: Path, prefix: str, images: np.ndarray, labels: np.ndarray, compress: bool = True):
    for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
        data = idx_bytes(array)
        name = f"{prefix}-{kind}-ubyte"
        if compress:
            (root / (name + ".gz")).write_bytes(gzip.compress(data))
        else:
            (root / name).write_bytes(data)


def make_photos(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each class a bright bar at its own row, so a photo's class can be read back from its pixels."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=count).astype(np.uint8)
    images = rng.integers(0, 40, size=(count, 28, 28)).astype(np.uint8)
    for image, label in zip(images, labels):
        image[2 * label + 4, 4:24] = 255
    return images, labels


def write_fashion_mnist(folder: Path, train: int = 24, test: int = 8) -> Path:
    """A directory like Debian's dataset-fashion-mnist: the train files gzipped, the test files plain (both are read);
    photos from make_photos (seeds 0 and 1)."""
    folder.mkdir(parents=True)
    write_split(folder, "train", *make_photos(train, 0))
    write_split(folder, "t10k", *make_photos(test, 1), compress=False)
    return folder
