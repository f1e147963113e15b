"""Webdataset tar shards and jsonl files made in code, with known bad rows, for the streaming tests."""

import gzip
import io
import json
import os
import tarfile

import numpy as np
from PIL import Image

from mm_fusion import train_tokenizer


WORDS = ["red", "green", "blue", "circle", "square", "left", "right", "top", "what", "shape", "is", "the"]
LABELS = ["no", "yes"]


def png(seed: int, size: int = 20) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size + 3, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def text(seed: int) -> str:
    rng = np.random.default_rng(seed + 10_000)
    return " ".join(rng.choice(WORDS, size=int(rng.integers(3, 7))))


def tokenizer():
    return train_tokenizer(WORDS * 3, vocab_size=120)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(
    folder: str, shards: int, rows: int, bad_every: int = 0, truncate: tuple[int, ...] = (), offset: int = 0
) -> dict:
    """
    `shards` webdataset shards of `rows` samples (`<key>.png`, `.txt`, `.json` with `answer` and `uid`), numbered
    from `offset`. With `bad_every`, every `bad_every`-th sample is bad (alternately an image that is not one and an
    empty text). Shards in `truncate` are cut short after writing. Returns the paths, the good uids, the bad uids
    (with their reason) and the uids of the truncated shards.
    """
    os.makedirs(folder, exist_ok=True)
    paths, good, bad, lost = [], [], {}, []
    n = offset
    for shard in range(shards):
        path = os.path.join(folder, f"shard-{shard + offset // max(rows, 1):04d}.tar")
        with tarfile.open(path, "w") as tar:
            for _ in range(rows):
                key = f"sample{n:06d}"
                uid = f"u{n}"
                image, caption = png(n), text(n)
                kind = None
                if bad_every and n % bad_every == bad_every - 1:
                    kind = "not_an_image" if (n // bad_every) % 2 == 0 else "bad_text"
                    image = b"not a png" if kind == "not_an_image" else image
                    caption = "" if kind == "bad_text" else caption
                _add(tar, f"{key}.png", image)
                _add(tar, f"{key}.txt", caption.encode())
                _add(tar, f"{key}.json", json.dumps({"answer": LABELS[n % 2], "uid": uid}).encode())
                if shard in truncate:
                    lost.append(uid)
                elif kind:
                    bad[uid] = kind
                else:
                    good.append(uid)
                n += 1
        if shard in truncate:
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                f.truncate(size // 2)
        paths.append(path)
    return {"paths": paths, "good": good, "bad": bad, "lost": lost}


def write_jsonl(folder: str, rows: int, files: int = 1) -> dict:
    """`files` jsonl files of `rows` rows each (`image` paths relative to the folder, `question`, `answer`), with one
    missing image, one line that is not JSON and one row without text in the first file."""
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    paths, good, bad = [], [], {}
    n = 0
    for file in range(files):
        path = os.path.join(folder, f"pairs-{file}.jsonl")
        with open(path, "w") as f:
            for i in range(rows):
                uid = f"j{n}"
                image = f"images/{uid}.png"
                with open(os.path.join(folder, image), "wb") as g:
                    g.write(png(n))
                row = {"uid": uid, "image": image, "question": text(n), "answer": LABELS[n % 2]}
                if file == 0 and i == 1:
                    row["image"], bad[uid] = "images/missing.png", "missing_image"
                if file == 0 and i == 2:
                    row["question"], bad[uid] = "", "bad_text"
                if file == 0 and i == 3:
                    f.write('{"uid": "broken", "image": \n')
                    bad["line 4"] = "bad_json"
                    n += 1
                    continue
                f.write(json.dumps(row) + "\n")
                if uid not in bad:
                    good.append(uid)
                n += 1
        paths.append(path)
    return {"paths": paths, "good": good, "bad": bad}


def sample(n: int, key: str | None = None, caption: str | None = None) -> list[tuple[str, bytes]]:
    """The members of good sample `n` of a hand-made shard: `<key>.png`, `.txt` and `.json` (`answer`, `uid` u<n>)."""
    key = key or f"sample{n:06d}"
    meta = json.dumps({"answer": LABELS[n % 2], "uid": f"u{n}"}).encode()
    return [(f"{key}.png", png(n)), (f"{key}.txt", (caption or text(n)).encode()), (f"{key}.json", meta)]


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """An uncompressed tar of `members` (name, data), in that order."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members:
            _add(tar, name, data)
    return buffer.getvalue()


def write_tar(path: str, members: list[tuple[str, bytes]]) -> str:
    """A shard of `members` at `path`, gzip-compressed when its name ends in `.tar.gz` or `.tgz`."""
    data = tar_bytes(members)
    with open(path, "wb") as f:
        f.write(gzip.compress(data, mtime=0) if path.endswith((".tar.gz", ".tgz")) else data)
    return path
