"""Streaming pairs (mm_fusion.data.streaming): webdataset shards, jsonl + image folders and `datasets` streaming
sources through the same validation, per-shard quarantine, truncated shards, rank splitting, exact resume, mixing."""

import codecs
import gzip
import io
import json
import os
import tarfile
from collections import Counter

import pytest
import torch
from datasets import Dataset, IterableDataset
from helpers.launch import run_worker
from helpers.shards import LABELS, png, sample, tar_bytes, tokenizer, write_jsonl, write_shards, write_tar
from torchdata.stateful_dataloader import StatefulDataLoader

from mm_fusion.data import (
    AlignmentError,
    ShuffledStream,
    StreamingCollator,
    decode_pixels,
    encode_pixels,
    prepare_stream,
    read_quarantine,
)
from mm_fusion.data.streaming.validation import _safe_name
from mm_fusion.image_processing_mm_fusion import load_pixels


SIZE = 8


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def test_webdataset_shards_validated_with_bad_rows_quarantined_per_shard(tmp_path, tok):
    shards = write_shards(str(tmp_path / "wds"), shards=3, rows=12, bad_every=5)
    report = tmp_path / "quarantine"
    stream = prepare_stream(
        shards["paths"],
        tok,
        id_column="uid",
        label_column="answer",
        label_names=LABELS,
        image_size=SIZE,
        quarantine_dir=report,
    )
    assert isinstance(stream, IterableDataset) and stream.num_shards == 3
    rows = list(stream)
    assert [r["id"] for r in rows] == shards["good"]  # every good row once, in shard order, none lost
    first = rows[0]
    assert first["input_ids"] == tok(first_text(shards["paths"][0]))["input_ids"]
    assert first["labels"] == 0 and rows[1]["labels"] == 1
    expected = load_pixels(read_member(shards["paths"][0], "sample000000.png"), SIZE)
    assert (decode_pixels(first["image_bytes"], SIZE) == expected).all()  # the processor's own pixels
    entries = read_quarantine(report)
    assert {e["id"]: e["reason"].split(":")[0] for e in entries} == shards["bad"]
    for entry in entries:  # the report names the shard and the key within it
        assert entry["shard"] in shards["paths"] and entry["key"].startswith("sample")
    # one report per shard, named after it (an empty one for a clean shard), rewritten on every pass
    assert sorted(os.listdir(report)) == sorted(_safe_name(p) + ".jsonl" for p in shards["paths"])
    list(stream)
    assert len(read_quarantine(report)) == len(entries)


def first_text(path: str) -> str:
    return read_member(path, "sample000000.txt").decode()


def read_member(path: str, name: str) -> bytes:
    with tarfile.open(path) as tar:
        return tar.extractfile(name).read()


@pytest.mark.parametrize("cut", ["mid_member", "member_boundary", "missing"])
def test_a_truncated_or_missing_shard_is_reported_and_skipped(tmp_path, tok, cut):
    shards = write_shards(str(tmp_path / "wds"), shards=3, rows=6)
    damaged = shards["paths"][1]
    with tarfile.open(damaged) as tar:
        members = tar.getmembers()
    if cut == "missing":
        os.remove(damaged)
    else:
        # mid-member: inside the fourth file's data; member boundary: exactly after the sixth file, which a tar
        # reader takes for a shorter archive (only the missing end-of-archive marker tells)
        size = members[3].offset_data + 5 if cut == "mid_member" else members[6].offset
        with open(damaged, "r+b") as f:
            f.truncate(size)
    rows = list(prepare_stream(shards["paths"], tok, id_column="uid", image_size=SIZE, quarantine_dir=tmp_path / "q"))
    lost = set(shards["good"][6:12])
    assert [r["id"] for r in rows] == [uid for uid in shards["good"] if uid not in lost]  # the other shards whole
    (entry,) = read_quarantine(tmp_path / "q")
    assert entry["shard"] == damaged and entry["reason"].startswith("bad_shard:")
    assert ("truncated" in entry["reason"]) == (cut != "missing") or "not a readable tar" in entry["reason"]


def test_jsonl_with_image_folder_through_the_same_validation(tmp_path, tok):
    pairs = write_jsonl(str(tmp_path / "jsonl"), rows=6, files=2)
    stream = prepare_stream(
        pairs["paths"],
        tok,
        id_column="uid",
        text_column="question",
        label_column="answer",
        label_names=LABELS,
        image_size=SIZE,
        quarantine_dir=tmp_path / "q",
    )
    assert stream.num_shards == 2
    assert [r["id"] for r in stream] == pairs["good"]
    entries = read_quarantine(tmp_path / "q")
    reasons = {e["id"] if not e["id"].endswith("line 4") else "line 4": e["reason"].split(":")[0] for e in entries}
    assert reasons == pairs["bad"]
    assert all(e["shard"] == pairs["paths"][0] and e["key"].startswith("line ") for e in entries)


def jsonl_rows(pairs: dict, folder) -> list[dict]:
    """The parseable rows of `write_jsonl`'s files, their image paths made absolute."""
    rows = [json.loads(line) for path in pairs["paths"] for line in open(path) if line.strip().endswith("}")]
    return [{**row, "image": os.path.join(folder, row["image"])} for row in rows]


def test_a_datasets_streaming_source_keeps_its_shards_and_unknown_labels_are_quarantined(tmp_path, tok):
    pairs = write_jsonl(str(tmp_path / "jsonl"), rows=5, files=3)
    rows = jsonl_rows(pairs, tmp_path / "jsonl")
    rows[-1]["answer"] = "maybe"
    source = Dataset.from_list(rows).to_iterable_dataset(num_shards=3)
    stream = prepare_stream(
        source,
        tok,
        id_column="uid",
        text_column="question",
        label_column="answer",
        label_names=LABELS,
        image_size=SIZE,
        quarantine_dir=tmp_path / "q",
    )
    assert stream.num_shards == 3
    ids = [r["id"] for r in stream]
    assert ids == [uid for uid in pairs["good"] if uid != rows[-1]["uid"]]
    reasons = {e["id"]: e["reason"] for e in read_quarantine(tmp_path / "q")}
    assert reasons[rows[-1]["uid"]] == "bad_label: 'maybe' is not one of the 2 labels"
    assert all("[shard " in e["shard"] for e in read_quarantine(tmp_path / "q"))


def test_streaming_collator_checks_each_image_against_its_pair(tmp_path, tok):
    shards = write_shards(str(tmp_path / "wds"), shards=1, rows=4)
    rows = list(prepare_stream(shards["paths"], tok, id_column="uid", image_size=SIZE))
    batch = StreamingCollator(image_size=SIZE, pad_token_id=tok.pad_token_id)(rows)
    assert batch["pixel_values"].dtype == torch.uint8 and batch["pixel_values"].shape == (4, 3, SIZE, SIZE)
    assert batch["sample_ids"] == shards["good"] and batch["attention_mask"].sum(1).tolist() == [
        len(r["input_ids"]) for r in rows
    ]
    rows[2] = {**rows[2], "image_bytes": rows[3]["image_bytes"]}  # a pair given another pair's image
    with pytest.raises(AlignmentError, match=r"'u2'.*CRC-32"):
        StreamingCollator(image_size=SIZE)(rows)


@pytest.mark.parametrize("image_format", ["jpeg", "webp"])
def test_compressed_image_bytes(image_format):
    pixels = load_pixels(write_png(), 32)
    data = encode_pixels(pixels, image_format)
    assert len(data) < pixels.nbytes
    decoded = decode_pixels(data, 32, image_format)
    assert decoded.shape == pixels.shape and decoded.dtype == pixels.dtype
    if image_format == "webp":
        assert (decoded == pixels).all()  # lossless: the exact pixels
    else:
        assert abs(decoded.astype(int) - pixels).mean() < 2


def write_png() -> bytes:
    """A smooth picture (JPEG's case; noise is its worst)."""
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:40, 0:40]
    picture = np.stack([x * 6, y * 6, (x + y) * 3], axis=-1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="PNG")
    return buffer.getvalue()


def _ids(batch):
    return [row["id"] for row in batch]


@pytest.mark.parametrize("workers", [0, 2])
def test_shuffled_stream_resumes_exactly_mid_pass(tmp_path, tok, workers):
    """Stopped after `cut` batches, a new loader given the state continues with the very batches the uninterrupted
    one yields, across the end of a pass, buffer included (datasets' own buffer shuffle would refill it)."""
    shards = write_shards(str(tmp_path / "wds"), shards=4, rows=15, bad_every=7)

    def loader():
        stream = prepare_stream(shards["paths"], tok, id_column="uid", image_size=SIZE)
        return StatefulDataLoader(
            ShuffledStream(stream, buffer_size=10, seed=3, passes=2),
            batch_size=4,
            num_workers=workers,
            collate_fn=_ids,
        )

    full = list(loader())
    one_pass = [uid for batch in full for uid in batch][: len(shards["good"])]
    if workers == 0:
        assert sorted(one_pass) == sorted(shards["good"]) and one_pass != shards["good"]  # shuffled, all there
    for cut in (2, 9, len(full) // 2 + 1):
        interrupted = loader()
        iterator = iter(interrupted)
        first = [next(iterator) for _ in range(cut)]
        state = json.loads(json.dumps(interrupted.state_dict()))  # as saved in a checkpoint
        del iterator, interrupted
        resumed = loader()
        resumed.load_state_dict(state)
        assert first + list(resumed) == full, cut


@pytest.mark.distributed
@pytest.mark.parametrize(
    "shards,strategy",
    [(4, "shards"), (5, "shards"), (1, "examples")],
    ids=["even", "uneven", "fewer_shards_than_ranks"],
)
def test_two_ranks_see_every_good_pair_exactly_once(tmp_path, shards, strategy):
    made = write_shards(str(tmp_path / "wds"), shards=shards, rows=9, bad_every=4)
    output = tmp_path / "out"
    output.mkdir()
    run_worker("streaming_worker", tmp_path / "wds", output, 6, processes=2, timeout=300)
    seen = [json.loads((output / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["strategy"] for s in seen] == [strategy] * 2
    ids = seen[0]["ids"] + seen[1]["ids"]
    assert Counter(ids).most_common(1)[0][1] == 1  # no pair twice
    assert sorted(ids) == sorted(made["good"])  # every good pair
    assert seen[0]["ids"] and seen[1]["ids"]  # no rank without data
    if strategy == "shards":  # whole shards per rank: ⌊n/2⌋ or ⌈n/2⌉ of them
        shards_of = [{int(uid[1:]) // 9 for uid in rank["ids"]} for rank in seen]
        assert not shards_of[0] & shards_of[1]
        assert sorted(len(s) for s in shards_of) == [shards // 2, shards - shards // 2]


@pytest.mark.parametrize(
    "flags,message",
    [
        ([], "needs --max_steps"),
        (["--max_steps", "5", "--save_strategy", "epoch"], "save_strategy epoch"),
        (["--max_steps", "5", "--task", "vqa"], "needs --class_names"),
        (["--max_steps", "5", "--class_names", "a,b", "--group_by_image", "True"], "no group_by_image"),
        (["--max_steps", "5", "--class_names", "a,b", "--image_format", "png"], "--image_format must be"),
    ],
)
def test_streaming_flags_are_checked_before_any_work(tmp_path, flags, message):
    from mm_fusion.training import parse_arguments

    argv = ["--streaming", "--dataset", str(tmp_path / "*.tar"), "--output_dir", str(tmp_path / "out"), *flags]
    with pytest.raises(ValueError, match=message):
        parse_arguments(argv)


def test_a_stream_without_a_usable_pair_is_an_error_not_a_hang(tmp_path, tok):
    shards = write_shards(str(tmp_path / "wds"), shards=1, rows=3, bad_every=1)
    assert not shards["good"]
    stream = ShuffledStream(prepare_stream(shards["paths"], tok, id_column="uid", image_size=SIZE), buffer_size=4)
    with pytest.raises(RuntimeError, match="no usable pairs"):
        next(iter(stream))


@pytest.mark.distributed
@pytest.mark.scale
def test_two_rank_streaming_run_with_uneven_shards_never_waits_for_data(tmp_path):
    """3 shards on 2 ranks (rank 0 reads 2 of them, 22 good pairs; rank 1 one, 11): batches of 4, 12 steps. Rank 1
    runs out of its pass first and starts its next one at once; both ranks take all 12 steps and the run ends."""
    from helpers.training import TINY_MODEL

    made = write_shards(str(tmp_path / "wds"), shards=3, rows=12, bad_every=12)
    flags = [*TINY_MODEL, "--streaming", "--dataset", str(tmp_path / "wds" / "*.tar"), "--class_names", "no,yes",
             "--label_column", "answer", "--id_column", "uid", "--per_device_train_batch_size", "4",
             "--max_steps", "12", "--eval_strategy", "no", "--save_strategy", "no", "--shuffle_buffer_size", "8",
             "--output_dir", str(tmp_path / "out"), "--logging_steps", "1"]  # fmt: skip
    run_worker("fault_worker", tmp_path / "record.jsonl", "none", *flags, processes=2, timeout=300)
    records = [[json.loads(line) for line in open(tmp_path / f"record.jsonl.rank{r}")] for r in range(2)]
    assert [len(r) for r in records] == [12, 12]  # every step on both ranks
    ids = [[uid for step in rank for uid in step["ids"]] for rank in records]
    good = set(made["good"])

    def first_pass_shards(rank_ids):
        """The shards of a rank's first pass: the shortest start of its ids that reads whole shards (11 good pairs
        each), every pair once."""
        for shards in (1, 2):
            head = rank_ids[: 11 * shards]
            of = {int(uid[1:]) // 12 for uid in head}
            if len(set(head)) == len(head) and len(of) == shards and set(head) <= good:
                return of
        raise AssertionError(f"no whole-shard first pass in {rank_ids[:22]}")

    first = [first_pass_shards(rank_ids) for rank_ids in ids]
    assert first[0].isdisjoint(first[1]) and first[0] | first[1] == {0, 1, 2}  # each shard on one rank, in pass 1
    assert sorted(map(len, first)) == [1, 2]  # the uneven split: 1 shard against 2
    small = min(range(2), key=lambda r: len(first[r]))
    assert len(ids[small]) == 48 and Counter(ids[small]).most_common(1)[0][1] > 1  # its next passes, at once


def test_a_datasets_source_is_read_whole_by_two_loader_workers(tmp_path, tok):
    """Each worker reads its own shards of a `datasets` streaming source whole (datasets would split a shard again
    between the workers when iterated inside one, and all but the first would read nothing)."""
    pairs = write_jsonl(str(tmp_path / "jsonl"), rows=6, files=1)
    source = Dataset.from_list(jsonl_rows(pairs, tmp_path / "jsonl")).to_iterable_dataset(num_shards=4)
    stream = prepare_stream(source, tok, id_column="uid", text_column="question", image_size=SIZE)
    loader = StatefulDataLoader(ShuffledStream(stream, buffer_size=1, passes=1), batch_size=2, num_workers=2,
                                collate_fn=_ids)  # fmt: skip
    assert sorted(uid for batch in loader for uid in batch) == sorted(pairs["good"])


def test_jsonl_files_in_different_folders_read_images_beside_each_file(tmp_path, tok):
    first, second = write_jsonl(str(tmp_path / "a"), rows=5), write_jsonl(str(tmp_path / "b"), rows=5)
    stream = prepare_stream([*first["paths"], *second["paths"]], tok, id_column="uid", text_column="question",
                            image_size=SIZE, quarantine_dir=tmp_path / "q")  # fmt: skip
    ids = [r["id"] for r in stream]
    assert len(ids) == 2 * len(first["good"])  # both files' good rows (the uids repeat: two corpora)
    missing = [e for e in read_quarantine(tmp_path / "q") if e["reason"].startswith("missing_image")]
    assert len(missing) == 2  # the one planted in each folder, nothing more


def test_state_of_a_resumed_stream_before_its_first_row_is_the_loaded_one(tmp_path, tok):
    shards = write_shards(str(tmp_path / "wds"), shards=2, rows=6)
    stream = lambda: ShuffledStream(prepare_stream(shards["paths"], tok, id_column="uid", image_size=SIZE),  # noqa: E731
                                    buffer_size=4, seed=1, passes=2)  # fmt: skip
    running = stream()
    iterator = iter(running)
    first = [next(iterator)["id"] for _ in range(5)]
    state = running.state_dict()
    resumed = stream()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # a checkpoint taken now must not send it back to the start
    rest = [row["id"] for row in resumed]
    assert first + rest == [row["id"] for row in stream()]


def test_an_unshuffled_stream_resumed_mid_pass_reads_its_next_pass_whole(tmp_path, tok):
    shards = write_shards(str(tmp_path / "wds"), shards=2, rows=5)
    stream = lambda: ShuffledStream(prepare_stream(shards["paths"], tok, id_column="uid", image_size=SIZE),  # noqa: E731
                                    buffer_size=1, passes=2, shuffle_shards=False)  # fmt: skip
    running = stream()
    iterator = iter(running)
    first = [next(iterator)["id"] for _ in range(3)]
    resumed = stream()
    resumed.load_state_dict(running.state_dict())
    assert first + [row["id"] for row in resumed] == shards["good"] * 2


# --- bad input: every bad shard or row reported, every good pair read once -------------------------------------------


def _flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1 :]


def _member_offset(tar: bytes, index: int) -> int:
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        return archive.getmembers()[index].offset


# A gzip shard damaged as downloads and disks damage files, and what the report must say. A whole gzip stream of a
# tar that was itself cut short is a truncated tar, as for a `.tar` shard.
GZIP_DAMAGE = {
    "cut_in_header": (lambda gz, tar: gz[:6], "Compressed file ended before the end-of-stream marker"),
    "cut_mid_stream": (lambda gz, tar: gz[: len(gz) // 2], "Compressed file ended before the end-of-stream marker"),
    "trailer_cut_off": (lambda gz, tar: gz[:-8], "Compressed file ended before the end-of-stream marker"),
    "cut_in_trailer": (lambda gz, tar: gz[:-3], "Compressed file ended before the end-of-stream marker"),
    "crc_flipped": (lambda gz, tar: _flip(gz, len(gz) - 8), "BadGzipFile: CRC check failed"),
    "length_flipped": (lambda gz, tar: _flip(gz, len(gz) - 1), "BadGzipFile: Incorrect length of data produced"),
    "data_flipped": (lambda gz, tar: _flip(gz, len(gz) // 2), "BadGzipFile: CRC check failed"),
    "error_page_appended": (lambda gz, tar: gz + b"<html>502 Bad Gateway</html>", "Not a gzipped file"),
    "not_gzip": (lambda gz, tar: tar, "Not a gzipped file"),
    "empty": (lambda gz, tar: b"", "not a readable tar archive (ReadError: empty file)"),
    "gzip_of_a_tar_cut_mid_member": (
        lambda gz, tar: gzip.compress(tar[: len(tar) // 3]),
        "not a readable tar archive (ReadError: unexpected end of data)",
    ),
    "gzip_of_a_tar_cut_between_members": (
        lambda gz, tar: gzip.compress(tar[: _member_offset(tar, 6)]),
        "truncated: no end-of-archive marker after the last member",
    ),
}


@pytest.mark.parametrize("damage", list(GZIP_DAMAGE))
@pytest.mark.parametrize("suffix", [".tar.gz", ".tgz"])
def test_a_damaged_gzip_shard_is_reported_whole_before_its_first_row(tmp_path, tok, damage, suffix):
    """A gzip shard whose stream is cut, corrupt or has a wrong CRC / length is `bad_shard`, every pair of it left
    out (none trained on, none reported as a bad image); the shards around it, compressed or not, read whole."""
    cut, says = GZIP_DAMAGE[damage]
    shards = [
        write_tar(str(tmp_path / "a.tar"), [m for n in range(0, 4) for m in sample(n)]),
        str(tmp_path / f"b{suffix}"),
        write_tar(str(tmp_path / "c.tgz"), [m for n in range(20, 24) for m in sample(n)]),
    ]
    tar = tar_bytes([m for n in range(10, 20) for m in sample(n)])
    with open(shards[1], "wb") as f:
        f.write(cut(gzip.compress(tar), tar))
    rows = list(prepare_stream(shards, tok, id_column="uid", image_size=SIZE, quarantine_dir=tmp_path / "q"))
    assert [r["id"] for r in rows] == [f"u{n}" for n in (*range(0, 4), *range(20, 24))]
    (entry,) = read_quarantine(tmp_path / "q")
    assert (entry["shard"], entry["key"], entry["id"]) == (shards[1], None, None)
    assert entry["reason"].startswith("bad_shard: ") and says in entry["reason"], entry["reason"]
    assert "which are kept" not in entry["reason"]  # no row of it was read before the damage was found


def test_gzip_shards_read_exactly_as_the_same_tar(tmp_path, tok):
    members = [m for n in range(6) for m in sample(n)]
    paths = [write_tar(str(tmp_path / name), members) for name in ("s.tar", "s.tar.gz", "s.tgz")]
    streams = [list(prepare_stream([p], tok, id_column="uid", image_size=SIZE)) for p in paths]
    columns = ("id", "key", "image_bytes", "image_crc", "input_ids")
    assert [[{c: r[c] for c in columns} for r in rows] for rows in streams[1:]] == [
        [{c: r[c] for c in columns} for r in streams[0]]
    ] * 2
    assert [r["id"] for r in streams[0]] == [f"u{n}" for n in range(6)]


def test_a_key_used_twice_in_a_shard_keeps_its_first_sample_and_reports_every_other(tmp_path, tok):
    """Duplicate keys as shard writers make them: a sample written twice in a row, a second image of another format,
    a second caption, an upper-case extension, and a key that comes back far later (three times in all). The first
    sample of a key is read (as the Arrow path keeps an id's first row); every later one is quarantined with a reason
    that names the key and its members. The same name in another folder is another key."""
    members = [
        *sample(0),  # 1-3
        *sample(1, key="k1"),  # 4-6: read
        *sample(2, key="k1"),  # 7-9: the same key again at once
        *sample(3),  # 10-12
        ("k3.png", png(4)), *sample(5, key="k3")[1:2], ("k3.jpg", png(5)), *sample(5, key="k3")[2:],  # 13-16
        *sample(6, key="k4"), ("k4.txt", b"what shape is the circle"),  # 17-20
        ("k6.PNG", png(7)), *sample(7, key="k6"),  # 21-24
        *sample(8),  # 25-27
        *sample(9, key="k1"),  # 28-30: the first key a third time, far from the others
        *sample(10, key="x/k1"),  # 31-33: another folder, another key
    ]  # fmt: skip
    shard = write_tar(str(tmp_path / "dup.tar"), members)
    rows = list(prepare_stream([shard], tok, id_column="uid", image_size=SIZE, quarantine_dir=tmp_path / "q"))
    assert [r["id"] for r in rows] == ["u0", "u1", "u3", f"{shard}/k3", "u6", "u8", "u10"]
    assert [r["key"] for r in rows] == ["sample000000", "k1", "sample000003", "k3", "k4", "sample000008", "x/k1"]
    assert rows[1]["input_ids"] == tok(sample(1)[1][1].decode())["input_ids"]  # k1's first caption, not merged
    first_k1 = "only its first sample, at k1.png, k1.txt, k1.json (members 4-6), is read"
    expected = [
        ("u2", "k1", f"duplicate_key: key 'k1' again at k1.png, k1.txt, k1.json (members 7-9); {first_k1}"),
        ("u5", "k3", "duplicate_key: key 'k3' again at k3.jpg, k3.json (members 15-16); only its first sample, at "
                     "k3.png, k3.txt (members 13-14), is read"),
        (f"{shard}/k4", "k4", "duplicate_key: key 'k4' again at k4.txt (member 20); only its first sample, at "
                              "k4.png, k4.txt, k4.json (members 17-19), is read"),
        (f"{shard}/k6", "k6", "bad_text: no text (null or absent)"),  # k6.PNG alone: no caption
        ("u7", "k6", "duplicate_key: key 'k6' again at k6.png, k6.txt, k6.json (members 22-24); only its first "
                     "sample, at k6.PNG (member 21), is read"),
        ("u9", "k1", f"duplicate_key: key 'k1' again at k1.png, k1.txt, k1.json (members 28-30); {first_k1}"),
    ]  # fmt: skip
    entries = read_quarantine(tmp_path / "q")
    assert [(e["id"], e["key"], e["reason"]) for e in entries] == expected
    assert all(e["shard"] == shard for e in entries)
    # k3's first sample is k3.png + k3.txt (its second image began another), without the json that went with that
    assert rows[3]["input_ids"] == tok(sample(5)[1][1].decode())["input_ids"]


def test_a_zero_byte_image_member_is_an_empty_file_as_on_the_arrow_path(tmp_path, tok):
    from mm_fusion.image_processing_mm_fusion import BadSample, load_image

    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(BadSample) as arrow:
        load_image(str(empty))
    shard = write_tar(str(tmp_path / "s.tar"), [*sample(0), ("z.png", b""), *sample(1, key="z")[1:], *sample(2)])
    rows = list(prepare_stream([shard], tok, id_column="uid", image_size=SIZE, quarantine_dir=tmp_path / "q"))
    assert [r["id"] for r in rows] == ["u0", "u2"]
    (entry,) = read_quarantine(tmp_path / "q")
    assert entry["reason"].split(":")[0] == arrow.value.reason == "empty_file"
    assert (entry["id"], entry["key"], entry["source"]) == ("u1", "z", f"{shard}:z.png")
    with pytest.raises(BadSample, match="empty_file"):  # a `datasets` image dict with empty bytes, likewise
        load_image({"bytes": b"", "path": str(tmp_path / "elsewhere.png")})


def test_text_that_is_not_utf8_is_quarantined_in_tar_and_jsonl_shards(tmp_path, tok):
    """Latin-1 and cp1252 captions, a UTF-16 one, a latin-1 label and json, beside a real UTF-8 caption with accents
    (read) and a jsonl file starting with a byte-order mark (read)."""
    shard = write_tar(
        str(tmp_path / "s.tar"),
        [
            *sample(0, key="a", caption="red café"),
            ("b.png", png(1)), ("b.txt", "red café".encode("latin-1")), *sample(1, key="b")[2:],
            ("c.png", png(2)), ("c.txt", "\u201cred\u201d circle".encode("cp1252")), *sample(2, key="c")[2:],
            ("d.png", png(3)), ("d.txt", "red circle".encode("utf-16")), *sample(3, key="d")[2:],
            *sample(4, key="e")[:2], ("e.cls", "oui-détaillé".encode("latin-1")),
            *sample(5, key="f")[:2], ("f.json", '{"uid": "u5", "note": "é"}'.encode("latin-1")),
            *sample(6, key="g"),
        ],
    )  # fmt: skip
    rows = list(prepare_stream([shard], tok, id_column="uid", image_size=SIZE, quarantine_dir=tmp_path / "q"))
    assert [r["id"] for r in rows] == ["u0", "u6"]
    assert rows[0]["input_ids"] == tok("red café")["input_ids"]
    reasons = [(e["key"], e["reason"]) for e in read_quarantine(tmp_path / "q")]
    assert reasons == [
        ("b", "bad_text: b.txt is not UTF-8 (unexpected end of data: b'\\xe9' at byte 7)"),
        ("c", "bad_text: c.txt is not UTF-8 (invalid start byte: b'\\x93red' at byte 0)"),
        ("d", "bad_text: d.txt is not UTF-8 (invalid start byte: b'\\xff\\xfer\\x00' at byte 0)"),
        ("e", "bad_label: e.cls is not UTF-8 (invalid continuation byte: b'\\xe9tai' at byte 5)"),
        ("f", "bad_json: f.json: 'utf-8' codec can't decode byte 0xe9 in position 23: invalid continuation byte"),
    ]

    folder = tmp_path / "jsonl"
    folder.mkdir()
    for n in range(4):
        (folder / f"{n}.png").write_bytes(png(n))
    lines = [json.dumps({"uid": f"j{n}", "image": f"{n}.png", "text": "red circle"}).encode() for n in range(4)]
    lines[0] = codecs.BOM_UTF8 + lines[0]
    lines[2] = json.dumps({"uid": "j2", "image": "2.png", "text": "red caf\u00e9"}).replace("\\u00e9", "\xe9")
    lines[2] = lines[2].encode("latin-1")
    (folder / "pairs.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    q = tmp_path / "qj"
    rows = list(prepare_stream([str(folder / "pairs.jsonl")], tok, id_column="uid", image_size=SIZE, quarantine_dir=q))
    assert [r["id"] for r in rows] == ["j0", "j1", "j3"]  # the line after the bad one is read too
    assert [(e["key"], e["reason"]) for e in read_quarantine(q)] == [
        ("line 3", "bad_text: line 3 is not UTF-8 (invalid continuation byte: b'\\xe9\"}\\n' at byte 48)")
    ]


def test_a_folder_of_shards_is_read_as_its_sorted_shards(tmp_path, tok, caplog):
    """A folder given for `--dataset`: its `.tar` / `.tar.gz` / `.tgz` shards (or its `.jsonl` files) in name order,
    label names in `.cls` members (datasets' own loader failed on them: `invalid literal for int(): b'yellow'`)."""
    from mm_fusion.data import stream_source

    folder = tmp_path / "shards"
    folder.mkdir()
    colours = ["yellow", "red"]

    def members(first):
        return [
            m for n in range(first, first + 3) for m in [*sample(n), (f"sample{n:06d}.cls", colours[n % 2].encode())]
        ]

    paths = [
        write_tar(str(folder / name), members(first)) for name, first in (("b.tgz", 3), ("a.tar", 0), ("c.tar.gz", 6))
    ]
    (folder / "README.txt").write_text("shards of the colour set")
    (folder / ".DS_Store").write_bytes(b"\0\0")
    with caplog.at_level("WARNING", logger="mm_fusion.data.streaming"):
        source = stream_source(str(folder))
    assert (source.kind, source.shards) == ("webdataset", sorted(paths))
    assert "README.txt" in caplog.text and ".DS_Store" not in caplog.text  # what was left out is said
    rows = list(prepare_stream(source, tok, id_column="uid", label_column="cls", label_names=colours, image_size=SIZE))
    assert [r["id"] for r in rows] == [f"u{n}" for n in range(9)]
    assert [r["labels"] for r in rows] == [n % 2 for n in range(9)]

    pairs = write_jsonl(str(tmp_path / "jsonl"), rows=4, files=2)
    source = stream_source(str(tmp_path / "jsonl"))
    assert (source.kind, source.shards) == ("jsonl", pairs["paths"])

    (folder / "more.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=rf"{folder}.*webdataset shards.*jsonl files.*glob"):
        stream_source(str(folder))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=rf"{tmp_path / 'empty'}' has no file to read\. Pass webdataset shards"):
        stream_source(str(tmp_path / "empty"))
    (tmp_path / "nested" / "train").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"only the folders train: pass one of them or a glob"):
        stream_source(str(tmp_path / "nested"))


def test_shuffle_buffer_size_below_zero_is_an_error_and_zero_keeps_the_shard_order(tmp_path, tok):
    from mm_fusion.training import parse_arguments

    argv = ["--streaming", "--dataset", str(tmp_path / "*.tar"), "--output_dir", str(tmp_path / "out"),
            "--max_steps", "5", "--class_names", "a,b", "--shuffle_buffer_size"]  # fmt: skip
    with pytest.raises(ValueError, match=r"^--shuffle_buffer_size must be .* got -1\.$"):
        parse_arguments([*argv, "-1"])
    assert parse_arguments([*argv, "0"])[1].shuffle_buffer_size == 0
    shards = write_shards(str(tmp_path / "wds"), shards=2, rows=4)
    stream = prepare_stream(shards["paths"], tok, id_column="uid", image_size=SIZE)
    with pytest.raises(ValueError, match="buffer_size must be 0 or more rows"):
        ShuffledStream(stream, buffer_size=-1)
    ids = [row["id"] for row in ShuffledStream(stream, buffer_size=0, passes=1, shuffle_shards=False)]
    assert ids == shards["good"]


def test_each_good_pair_once_a_pass_beside_bad_shards_and_duplicates(tmp_path, tok):
    """A corrupt gzip shard, a shard with a duplicate key and a latin-1 caption, and two clean shards, shuffled over
    two passes: each good pair twice, nothing else, and the same report after the second pass."""
    shards = [
        write_tar(str(tmp_path / "0.tar"), [m for n in range(0, 5) for m in sample(n)]),
        write_tar(str(tmp_path / "1.tar.gz"), [m for n in range(5, 10) for m in sample(n)]),
        write_tar(str(tmp_path / "2.tar"), [*sample(10, key="k"), *sample(11, key="k"),
                                            ("t.png", png(12)), ("t.txt", b"caf\xe9"), *sample(12, key="t")[2:],
                                            *sample(13)]),
        write_tar(str(tmp_path / "3.tgz"), [m for n in range(14, 18) for m in sample(n)]),
    ]  # fmt: skip
    with open(shards[1], "r+b") as f:
        f.truncate(os.path.getsize(shards[1]) - 8)
    stream = prepare_stream(shards, tok, id_column="uid", image_size=SIZE, quarantine_dir=tmp_path / "q")
    ids = [row["id"] for row in ShuffledStream(stream, buffer_size=6, seed=2, passes=2)]
    good = [f"u{n}" for n in (*range(0, 5), 10, 13, *range(14, 18))]
    assert Counter(ids) == {uid: 2 for uid in good}
    assert [(e["shard"], e["key"], e["reason"].split(":")[0]) for e in read_quarantine(tmp_path / "q")] == [
        (shards[1], None, "bad_shard"), (shards[2], "k", "duplicate_key"), (shards[2], "t", "bad_text")
    ]  # fmt: skip
