"""
Fashion-MNIST (Zalando's product photographs: 70,000 28 x 28 grey images in 10 classes, MIT licence) as image-text
pairs, read offline from the IDX files of Debian's `dataset-fashion-mnist` package (`apt-get install
dataset-fashion-mnist`, files in `/usr/share/datasets/fashion-mnist/`) or any directory holding the same four files,
gzipped or not.

Two kinds of rows, both built from the class names:
- `"questions"` (vqa / classify): two questions per photo, `what` (which of the 10 products it is, in one of
  [`QUESTION_TEMPLATES`]) and `yes_no` (whether it is a named product: the true one or another, half and half);
- `"captions"` (pretrain): one caption per photo from [`CAPTION_TEMPLATES`]. [`ZERO_SHOT_TEMPLATE`] is kept out of
  them, for the zero-shot evaluation's prompts.
"""

import gzip
import io
import os
from collections.abc import Sequence

import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value
from datasets.exceptions import DatasetGenerationError


FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
INSTALL_HINT = "apt-get install dataset-fashion-mnist"
SPLITS = ("train", "test")
ROWS = ("questions", "captions")
# The dataset's own class order (its labels are indices into this), in words a caption would use.
CLASS_NAMES = (
    "t-shirt",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
QUESTION_TEMPLATES = (
    "what is this product?",
    "what kind of item is shown?",
    "which product is in the photo?",
    "what is pictured here?",
)
YES_NO_TEMPLATES = ("is this a {}?", "does the photo show a {}?")
CAPTION_TEMPLATES = (
    "a photo of a {}.",
    "a product photo of a {}.",
    "a grey picture of a {}.",
    "a {} on a dark background.",
    "a small photo of the {}.",
)
ZERO_SHOT_TEMPLATE = "an image showing a {}."  # in no training caption: the zero-shot prompts' template
GENERATOR_VERSION = 1  # part of the cache key: bump when the rows change


class FashionMNISTError(ValueError):
    """The Fashion-MNIST files are missing or damaged; the message names the file and what is wrong."""


def find_file(root: str, name: str) -> str:
    """`root/name.gz` or `root/name`, whichever exists."""
    for candidate in (os.path.join(root, name + ".gz"), os.path.join(root, name)):
        if os.path.isfile(candidate):
            return candidate
    raise FashionMNISTError(
        f"Fashion-MNIST: {os.path.join(root, name)}[.gz] not found. Install the photos with `{INSTALL_HINT}` "
        f"(files in {FASHION_MNIST_DIR}), or pass root=DIR in --dataset_options."
    )


def read_idx(path: str, dims: int) -> np.ndarray:
    """An IDX file of unsigned bytes with `dims` dimensions (3: images, 1: labels), gzipped or not."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise FashionMNISTError(f"Fashion-MNIST: cannot read {path}: {err}.") from None
    header = 4 + 4 * dims
    if len(raw) < header:
        raise FashionMNISTError(f"Fashion-MNIST: {path} is {len(raw)} bytes, shorter than an IDX header.")
    magic = int.from_bytes(raw[:4], "big")
    if magic != 0x0800 + dims:  # 0x08: unsigned bytes; then the number of dimensions
        raise FashionMNISTError(
            f"Fashion-MNIST: {path} is not an IDX file of {dims}-dimensional unsigned bytes (magic number "
            f"{magic:#010x}, expected {0x0800 + dims:#010x})."
        )
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    expected = header + int(np.prod(shape))
    if len(raw) != expected:
        raise FashionMNISTError(
            f"Fashion-MNIST: {path} declares shape {shape} ({expected} bytes with its header) but holds {len(raw)} "
            "bytes: the file is truncated or damaged."
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def read_split(root: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The (N, 28, 28) images and (N,) labels of a split, checked against each other."""
    images_path, labels_path = (find_file(root, name) for name in FILES[split])
    images, labels = read_idx(images_path, 3), read_idx(labels_path, 1)
    if len(images) != len(labels):
        raise FashionMNISTError(
            f"Fashion-MNIST: {images_path} has {len(images)} images but {labels_path} has {len(labels)} labels."
        )
    bad = np.flatnonzero(labels >= len(CLASS_NAMES))
    if len(bad):
        raise FashionMNISTError(
            f"Fashion-MNIST: {labels_path} has labels outside 0-{len(CLASS_NAMES) - 1} (first at row {bad[0]}: "
            f"{labels[bad[0]]})."
        )
    return images, labels


def answer_names() -> list[str]:
    """The answers of the question rows: the class names, then `no` and `yes`."""
    return [*CLASS_NAMES, "no", "yes"]


def vocabulary_texts() -> list[str]:
    """Every question and caption the generator can write (not the zero-shot template), so that a tokenizer trained on
    one kind of row covers the other."""
    texts = list(QUESTION_TEMPLATES)
    for name in CLASS_NAMES:
        texts += [template.format(name) for template in (*YES_NO_TEMPLATES, *CAPTION_TEMPLATES)]
    return texts


def load_fashion_mnist(
    splits: Sequence[str] = SPLITS,
    *,
    rows: str = "questions",
    root: str = FASHION_MNIST_DIR,
    max_images: int | None = None,
    seed: int = 0,
) -> DatasetDict:
    """
    Fashion-MNIST splits as pair rows (cached by `datasets`, keyed on these arguments and the files' sizes and times).

    Args:
        splits: any of `"train"` (60,000 photos), `"test"` (10,000).
        rows: `"questions"`: two rows per photo, with columns `id`, `image` (PNG), `image_id`, `question`, `answer`
            (`ClassLabel` over [`answer_names`]), `question_type` (`what` / `yes_no`), `product` (the class name).
            `"captions"`: one row per photo, with `id`, `image`, `image_id`, `caption`, `label` (`ClassLabel` over
            [`CLASS_NAMES`]).
        root: the directory of the four IDX files (`.gz` or not).
        max_images: the first N photos of each split (default: all).
        seed: draws the templates and the yes / no questions' products; the same arguments give the same rows.
    """
    unknown = [s for s in splits if s not in SPLITS]
    if unknown:
        raise ValueError(f"Fashion-MNIST has splits {list(SPLITS)}; got {unknown}.")
    if rows not in ROWS:
        raise ValueError(f"rows must be one of {ROWS}, got {rows!r}.")
    if max_images is not None and max_images < 1:
        raise ValueError(f"max_images must be 1 or more, got {max_images}.")
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise FashionMNISTError(
            f"Fashion-MNIST: no directory {root}. Install the photos with `{INSTALL_HINT}` (files in "
            f"{FASHION_MNIST_DIR}), or pass root=DIR in --dataset_options."
        )
    features = {"id": Value("string"), "image": Image(), "image_id": Value("int64")}
    if rows == "questions":
        features.update(
            question=Value("string"),
            answer=ClassLabel(names=answer_names()),
            question_type=Value("string"),
            product=Value("string"),
        )
    else:
        features.update(caption=Value("string"), label=ClassLabel(names=list(CLASS_NAMES)))
    result = {}
    for split in splits:
        paths = [find_file(root, name) for name in FILES[split]]
        # The files' sizes and times key the cache with the arguments: replaced files are read again.
        # A string: `datasets` would split a list in gen_kwargs into shards, each generating every row.
        stamps = ";".join(f"{p}:{os.path.getsize(p)}:{os.path.getmtime(p)}" for p in paths)
        options = {"split": split, "rows": rows, "root": root, "max_images": max_images, "seed": seed}
        try:
            result[split] = Dataset.from_generator(
                _rows,
                features=Features(features),
                gen_kwargs={**options, "stamps": stamps, "version": GENERATOR_VERSION},
            )
        except DatasetGenerationError as err:  # our own error about the files, rather than datasets' wrapper
            if isinstance(err.__cause__, FashionMNISTError):
                raise err.__cause__ from None
            raise
    return DatasetDict(result)


def _png(image: np.ndarray) -> bytes:
    from PIL import Image as PILImage

    buffer = io.BytesIO()
    PILImage.fromarray(image, mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


def _rows(split: str, rows: str, root: str, max_images: int | None, seed: int, stamps, version):
    images, labels = read_split(root, split)
    if max_images is not None:
        images, labels = images[:max_images], labels[:max_images]
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    for i, (image, label) in enumerate(zip(images, labels)):
        product = CLASS_NAMES[label]
        row = {"image": {"bytes": _png(image), "path": None}, "image_id": i}
        if rows == "captions":
            template = CAPTION_TEMPLATES[rng.integers(len(CAPTION_TEMPLATES))]
            yield {"id": f"{split}-{i}", **row, "caption": template.format(product), "label": int(label)}
            continue
        question = QUESTION_TEMPLATES[rng.integers(len(QUESTION_TEMPLATES))]
        yield {"id": f"{split}-{i}-what", **row, "question": question, "answer": product, "question_type": "what",
               "product": product}  # fmt: skip
        named = product if rng.random() < 0.5 else CLASS_NAMES[(label + rng.integers(1, len(CLASS_NAMES))) % 10]
        question = YES_NO_TEMPLATES[rng.integers(len(YES_NO_TEMPLATES))].format(named)
        answer = "yes" if named == product else "no"
        yield {"id": f"{split}-{i}-yes_no", **row, "question": question, "answer": answer, "question_type": "yes_no",
               "product": product}  # fmt: skip
