"""Small test data made in code: texts for tokenizers and random images."""

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
