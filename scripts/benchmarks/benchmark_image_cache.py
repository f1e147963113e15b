"""
Benchmark the image formats a streaming run can carry its prepared images in (`--image_format`, mm_fusion.data's
`encode_pixels` / `decode_pixels`): raw uint8, JPEG (quality 90, 4:4:4) and lossless WebP. For each corpus and size it
gives the bytes per image (what a cache or a shuffle buffer holds), the encoding time (paid once per image read) and
the loader's samples/s (`StreamingCollator` decoding batches of 64 in one process, one thread: the work each data
loader worker does), with the spread over `--repeats` timings, and the mean absolute pixel error.

Corpora: easy-VQA's training images (64 px originals, so 224 px is an upscale) and a synthetic 224 px corpus of
photo-like pictures (smooth gradients, soft shapes and sensor noise, drawn at 448 px and resized).

    python scripts/benchmarks/benchmark_image_cache.py                 # about 2 minutes on 2 cores
    python scripts/benchmarks/benchmark_image_cache.py --images 64 --repeats 1   # a look

Writes scripts/benchmarks/results/image_cache.{json,md} and prints the Markdown table.
"""

import time
from dataclasses import dataclass

import numpy as np
import torch
from benchmarking import RESULTS, machine, markdown_table, median_range, spread, write_report
from PIL import Image
from transformers import HfArgumentParser

from mm_fusion.data import StreamingCollator, decode_pixels, encode_pixels
from mm_fusion.image_processing_mm_fusion import load_pixels


FORMATS = ("uint8", "jpeg", "webp")


@dataclass
class Options:
    images: int = 512  # per corpus
    repeats: int = 3
    batch_size: int = 64
    output: str = str(RESULTS / "image_cache")


def easy_vqa_images(n: int) -> list:
    import easy_vqa

    paths = easy_vqa.get_train_image_paths()  # image id -> path
    return [paths[i] for i in sorted(paths)[:n]]


def synthetic_images(n: int, seed: int = 0) -> list:
    """Photo-like 448 px pictures: a smooth two-colour gradient, a few soft ellipses, and noise of sigma 6."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:448, 0:448] / 448.0
    images = []
    for _ in range(n):
        a, b = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
        t = (x * rng.uniform(-1, 1) + y * rng.uniform(-1, 1)) % 1.0
        picture = a * t[..., None] + b * (1 - t[..., None])
        for _ in range(int(rng.integers(2, 6))):
            cx, cy, rx, ry = rng.uniform(0, 1, 2).tolist() + rng.uniform(0.05, 0.3, 2).tolist()
            mask = np.clip(1.5 - ((x - cx) / rx) ** 2 - ((y - cy) / ry) ** 2, 0, 1)[..., None]
            picture = picture * (1 - mask) + rng.uniform(0, 255, 3) * mask
        picture += rng.normal(0, 6, picture.shape)
        images.append(Image.fromarray(np.clip(picture, 0, 255).astype(np.uint8)))
    return images


def measure(pixels: list[np.ndarray], image_format: str, size: int, options: Options) -> dict:
    start = time.perf_counter()
    encoded = [encode_pixels(p, image_format) for p in pixels]
    encode_ms = (time.perf_counter() - start) / len(pixels) * 1e3
    rows = [
        {"id": str(i), "image_key": str(i), "image_bytes": data, "image_crc": __import__("zlib").crc32(data),
         "input_ids": [1, 5, 2]}
        for i, data in enumerate(encoded)
    ]  # fmt: skip
    collator = StreamingCollator(image_size=size, image_format=image_format)
    rates = []
    for _ in range(options.repeats):
        start = time.perf_counter()
        for i in range(0, len(rows), options.batch_size):
            collator(rows[i : i + options.batch_size])
        rates.append(len(rows) / (time.perf_counter() - start))
    error = float(np.mean([np.abs(decode_pixels(d, size, image_format).astype(int) - p).mean()
                           for d, p in zip(encoded[:64], pixels[:64])]))  # fmt: skip
    return {
        "bytes_per_image": float(np.mean([len(d) for d in encoded])),
        "encode_ms_per_image": encode_ms,
        "samples_per_second": spread(rates),
        "mean_abs_pixel_error": error,
    }


def main() -> None:
    (options,) = HfArgumentParser(Options).parse_args_into_dataclasses()
    torch.set_num_threads(1)
    corpora = [("easy_vqa", 64, easy_vqa_images), ("easy_vqa", 224, easy_vqa_images)]
    corpora += [("synthetic", 64, synthetic_images), ("synthetic", 224, synthetic_images)]
    results, table = [], []
    for corpus, size, images in corpora:
        pixels = [load_pixels(image, size) for image in images(options.images)]
        for image_format in FORMATS:
            result = {
                "corpus": corpus,
                "image_size": size,
                "format": image_format,
                **measure(pixels, image_format, size, options),
            }
            results.append(result)
            raw = size * size * 3
            table.append([
                corpus, size, image_format, f"{result['bytes_per_image'] / 1024:.1f}",
                f"{raw / result['bytes_per_image']:.1f}x", f"{result['encode_ms_per_image']:.2f}",
                median_range(result["samples_per_second"]), f"{result['mean_abs_pixel_error']:.2f}",
            ])  # fmt: skip
            print(table[-1], flush=True)
    header = ["corpus", "px", "format", "KiB / image", "smaller than uint8", "encode ms / image",
              "collator samples/s (1 thread)", "mean abs pixel error"]  # fmt: skip
    text = markdown_table(header, table)
    report = {"machine": machine(), "options": vars(options), "results": results}
    title = "# Image formats of the images table and the streaming path (`--image_format`)"
    write_report(options.output, report, title + "\n\n" + text)
    print(text)


if __name__ == "__main__":
    main()
