"""Faults: a killed run resumes exactly, early stopping keeps exactly the best weights, damaged and untrusted
checkpoints are refused by name, a failed or stalled rank ends the run, and a user's file of bad rows trains on every
good row and reports every bad one. Marked `faults` (`pytest -m faults`; `.ci/run` runs them)."""

import io
import json
import os
import shutil
import signal
import struct
import subprocess
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from helpers.launch import start_nodes, worker_command, worker_env
from helpers.training import TINY_MODEL, correct_by_hand, train
from PIL import Image
from safetensors.torch import load_file

from mm_fusion import MMFusionForImageTextClassification
from mm_fusion.data import read_quarantine
from mm_fusion.training import CheckpointError, resolve_resume_checkpoint, setup_run, train_and_save


pytestmark = pytest.mark.faults

ANSWERS = ["yes", "no", "red", "blue"]
TINY = [*TINY_MODEL, "--patch_size", "8", "--logging_steps", "1", "--seed", "7"]


def write_pairs(directory: Path, images: int = 12, questions: int = 4) -> Path:
    """A user's own jsonl (`id`, `image` under `directory`, `question`, `answer`), `questions` per image."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(directory / "pairs.jsonl", "w") as f:
        for i in range(images):
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(directory / f"img{i}.png")
            for q in range(questions):
                row = {"id": f"p{i}-{q}", "image": f"img{i}.png", "question": f"question {q} about picture {i}",
                       "answer": ANSWERS[int(rng.integers(len(ANSWERS)))]}  # fmt: skip
                f.write(json.dumps(row) + "\n")
    return directory / "pairs.jsonl"


def user_flags(pairs: Path) -> list[str]:
    return ["--task", "vqa", "--dataset", str(pairs), "--data_root", str(pairs.parent), "--image_column", "image",
            "--text_column", "question", "--label_column", "answer", "--id_column", "id"]  # fmt: skip


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return write_pairs(tmp_path_factory.mktemp("pairs"))


def run_worker(record: Path, fault: str, flags: list[str], processes: int = 0, timeout: float = 600):
    """
    The fault worker in a new process (under torchrun with `processes` > 0), one thread per process for
    bit-reproducible arithmetic; it and every process it started are killed if it outlives `timeout`. Returns the
    exit code, the output, and the seconds from the fault to the end of the run (`None` without a fault).
    """
    command = worker_command("fault_worker", record, fault, *flags, processes=processes)
    process = subprocess.Popen(command, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own: kill them one by one (SIGKILL also ends a stopped one).
        for child in [*psutil.Process(process.pid).children(recursive=True), process]:
            child.kill()
        output, _ = process.communicate()
        pytest.fail(f"still running after {timeout:.0f} s:\n{output[-4000:]}")
    stamp = Path(f"{record}.fault")
    return process.returncode, output, time.time() - float(stamp.read_text()) if stamp.exists() else None


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(output_dir: Path) -> list[tuple[int, float]]:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [(h["step"], h["loss"]) for h in history if "loss" in h]


def train_loss(output_dir: Path) -> float:
    return json.loads((output_dir / "all_results.json").read_text())["train_loss"]


BATCHING = {
    "group_by_image": ["--per_device_train_batch_size", "8"],
    "group_by_length": ["--per_device_train_batch_size", "8", "--train_sampling_strategy", "group_by_length"],
    "accumulation": ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"],
}


@pytest.mark.parametrize("batching", list(BATCHING))
def test_sigkill_between_checkpoints_then_resume_equals_the_uninterrupted_run(pairs, tmp_path, batching):
    """48 pairs, 6 optimizer steps per epoch, 3 epochs, a checkpoint every 4 steps, dropout on. The run is SIGKILLed
    at step 10 (mid-epoch 2, 2 steps past checkpoint-8) and resumed with `last`."""
    flags = [*user_flags(pairs), *TINY, *BATCHING[batching], "--num_train_epochs", "3", "--save_steps", "4",
             "--eval_strategy", "no"]  # fmt: skip
    reference, out = tmp_path / "reference", tmp_path / "run"
    code, output, _ = run_worker(tmp_path / "reference.jsonl", "none", [*flags, "--output_dir", str(reference)])
    assert code == 0, output[-3000:]
    code, output, _ = run_worker(tmp_path / "killed.jsonl", "kill@10", [*flags, "--output_dir", str(out)])
    assert code == -signal.SIGKILL, output[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    code, output, _ = run_worker(
        tmp_path / "resumed.jsonl", "none", [*flags, "--output_dir", str(out), "--resume_from_checkpoint", "last"]
    )
    assert code == 0, output[-3000:]
    assert "There were missing keys" not in output and "unexpected keys" not in output

    # The same batches of the same samples, in the same order: nothing skipped, nothing seen twice.
    expected = read_records(tmp_path / "reference.jsonl")
    killed, resumed = read_records(tmp_path / "killed.jsonl"), read_records(tmp_path / "resumed.jsonl")
    assert killed[-1]["step"] == 10 and resumed[0]["step"] == 9
    assert [r for r in killed if r["step"] <= 8] + resumed == expected
    all_ids = [f"p{i}-{q}" for i in range(12) for q in range(4)]
    for epoch in range(3):
        seen = Counter(i for r in expected if 6 * epoch < r["step"] <= 6 * (epoch + 1) for i in r["ids"])
        assert seen == Counter(all_ids), f"epoch {epoch}"
    # Every logged loss, the whole run's mean loss and every final weight equal the uninterrupted run's.
    reference_losses, resumed_losses = losses(reference), losses(out)
    assert [s for s, _ in resumed_losses] == list(range(1, 19))
    torch.testing.assert_close(resumed_losses, reference_losses, rtol=1e-6, atol=1e-7)
    assert train_loss(out) == pytest.approx(train_loss(reference), rel=1e-6)
    card_row = next(line for line in (reference / "README.md").read_text().splitlines() if "training loss" in line)
    assert card_row in (out / "README.md").read_text()
    assert "resumed from the checkpoint of step 8" in (out / "README.md").read_text()
    final, expected_weights = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    assert final.keys() == expected_weights.keys()
    for name, value in expected_weights.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=1e-7, msg=name)


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    """A saved model's weights under the model's own key names."""
    return MMFusionForImageTextClassification.from_pretrained(directory).state_dict()


def test_early_stopping_returns_exactly_the_best_checkpoints_weights(pairs, tmp_path):
    out = tmp_path / "out"
    flags = [*user_flags(pairs), *TINY, "--output_dir", str(out), "--validation_split_percentage", "25",
             "--per_device_train_batch_size", "8", "--num_train_epochs", "20", "--eval_strategy", "epoch",
             "--early_stopping_patience", "1", "--learning_rate", "1e-5", "--save_total_limit", "5"]  # fmt: skip
    trainer = setup_run(flags)
    assert trainer.args.metric_for_best_model == "accuracy" and trainer.args.greater_is_better  # the task's metric
    train_and_save(trainer)
    best = Path(trainer.state.best_model_checkpoint)
    last = out / f"checkpoint-{trainer.state.global_step}"
    assert trainer.state.global_step < 20 * 5 and best != last  # it stopped early, after a worse evaluation
    final, best_weights, last_weights = _weights(out), _weights(best), _weights(last)
    for name, value in best_weights.items():
        assert torch.equal(final[name], value), name
    vision = [k for k in final if ".vision_model.layers." in k]
    assert vision and any(not torch.equal(final[k], last_weights[k]) for k in vision)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


class _Payload:
    """Unpickling this would create a file: what a malicious checkpoint would do with a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _plant_payload(path: Path, marker: Path) -> None:
    torch.save({"state": _Payload(marker)}, path)


DAMAGE = {
    "model.safetensors truncated": ("model.safetensors", _truncate),
    "optimizer.pt truncated": ("optimizer.pt", _truncate),
    "trainer_state.json missing": ("trainer_state.json", lambda p: p.unlink()),
    "rng_state.pth holds a pickle payload": ("rng_state.pth", None),
}


@pytest.fixture(scope="module")
def saved_run(pairs, tmp_path_factory):
    """A finished run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("saved") / "out"
    flags = [*user_flags(pairs), *TINY, "--output_dir", str(out), "--per_device_train_batch_size", "8",
             "--max_steps", "4", "--save_steps", "2", "--eval_strategy", "no"]  # fmt: skip
    code, output, _ = run_worker(out.parent / "record.jsonl", "none", flags)
    assert code == 0, output[-3000:]
    return out, flags


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_falls_back_past_a_damaged_last_checkpoint_and_names_the_file(saved_run, tmp_path, damage, caplog):
    source, flags = saved_run
    out = tmp_path / "out"
    shutil.copytree(source, out)
    name, harm = DAMAGE[damage]
    marker = tmp_path / "payload-ran"
    if harm is None:
        _plant_payload(out / "checkpoint-4" / name, marker)
    else:
        harm(out / "checkpoint-4" / name)
    with caplog.at_level("WARNING", logger="mm_fusion.training.checkpoints"):
        assert resolve_resume_checkpoint("last", str(out)) == str(out / "checkpoint-2")
    assert f"checkpoint-4/{name}" in caplog.text
    with pytest.raises(CheckpointError, match=f"checkpoint-4/{name}"):
        resolve_resume_checkpoint(str(out / "checkpoint-4"), str(out))
    assert not marker.exists()
    # The training script resumes from checkpoint-2 and finishes the run.
    flags = [f if f != str(source) else str(out) for f in flags]
    code, output, _ = run_worker(tmp_path / "record.jsonl", "none", [*flags, "--resume_from_checkpoint", "last"])
    assert code == 0, output[-3000:]
    assert f"Skipping checkpoint-4, which cannot be resumed from: {out}/checkpoint-4/{name}" in output
    assert read_records(tmp_path / "record.jsonl")[0]["step"] == 3
    assert not marker.exists()


def test_no_complete_checkpoint_lists_what_is_wrong_with_each(saved_run, tmp_path):
    source, _ = saved_run
    out = tmp_path / "out"
    shutil.copytree(source, out)
    (out / "checkpoint-4" / "trainer_state.json").unlink()
    _truncate(out / "checkpoint-2" / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"no complete checkpoint.*checkpoint-4: .*trainer_state.json is missing"
    ):
        resolve_resume_checkpoint("last", str(out))


def test_pickle_payloads_are_refused_on_every_loading_path(saved_run, tmp_path):
    """Checkpoints from strangers: weights files that would run code when unpickled are refused, and never run."""
    source, flags = saved_run
    marker = tmp_path / "payload-ran"
    # A saved model whose weights are a pickle (pytorch_model.bin) instead of safetensors: from_pretrained, the
    # Auto classes with remote code, and --model_name_or_path all go through weights_only loading.
    model_dir = tmp_path / "model"
    shutil.copytree(source, model_dir, ignore=shutil.ignore_patterns("checkpoint-*"))
    (model_dir / "model.safetensors").unlink()
    _plant_payload(model_dir / "pytorch_model.bin", marker)
    with pytest.raises(Exception, match="(?i)weights.only|unsupported global|weights_only"):
        MMFusionForImageTextClassification.from_pretrained(model_dir)
    from transformers import AutoModelForVisualQuestionAnswering

    with pytest.raises(Exception, match="(?i)weights.only|unsupported global|weights_only"):
        AutoModelForVisualQuestionAnswering.from_pretrained(model_dir, trust_remote_code=True)
    with pytest.raises(Exception, match="(?i)weights.only|unsupported global|weights_only"):
        train([*flags, "--output_dir", str(tmp_path / "tuned"), "--model_name_or_path", str(model_dir)])
    # Resuming: each file a checkpoint is loaded from, refused by name before anything is unpickled.
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        out = tmp_path / f"resume-{name}"
        shutil.copytree(source, out)
        _plant_payload(out / "checkpoint-4" / name, marker)
        with pytest.raises(CheckpointError, match=f"checkpoint-4/{name} cannot be loaded safely"):
            resolve_resume_checkpoint(str(out / "checkpoint-4"), str(out))
    assert not marker.exists()


def _rank_flags(pairs: Path, out: Path, ddp_timeout: int = 10) -> list[str]:
    flags = ["--per_device_train_batch_size", "4", "--num_train_epochs", "50", "--eval_strategy", "no",
             "--save_strategy", "no", "--ddp_timeout", str(ddp_timeout)]  # fmt: skip
    return [*user_flags(pairs), *TINY, "--output_dir", str(out), *flags]


@pytest.mark.distributed
def test_a_stalled_rank_ends_the_run_within_the_ddp_timeout(pairs, tmp_path):
    """Rank 1 is SIGSTOPped at step 3: rank 0 times out (--ddp_timeout 10) and torchrun ends the run."""
    code, output, seconds = run_worker(tmp_path / "r.jsonl", "stop@3:1", _rank_flags(pairs, tmp_path / "o"),
                                       processes=2, timeout=300)  # fmt: skip
    assert code != 0
    assert "Timed out waiting 10000ms" in output, output[-3000:]
    # 10 s of timeout, then torchrun's 30 s grace before it SIGKILLs the stopped rank.
    assert seconds < 60, seconds


@pytest.mark.distributed
@pytest.mark.parametrize("fault, shows", [("raise@3:1", "injected failure at step 3 on rank 1"),
                                          ("kill@3:1", "Signal 9 (SIGKILL) received by PID")])  # fmt: skip
def test_a_dead_rank_ends_the_run_at_once_with_its_error(pairs, tmp_path, fault, shows):
    """The other rank does not wait for the dead one at its next collective: the run ends long before the DDP timeout
    (300 s here) that a rank left waiting would end on, whatever else the machine is doing."""
    flags = _rank_flags(pairs, tmp_path / "o", ddp_timeout=300)
    code, output, seconds = run_worker(tmp_path / "r.jsonl", fault, flags, processes=2, timeout=600)
    assert code != 0
    summary = output[output.rindex("Root Cause") :] if "raise" in fault else output
    assert shows in summary, output[-3000:]
    steps = [r["step"] for r in read_records(tmp_path / "r.jsonl.rank0")]
    assert max(steps) <= 4  # rank 0 did not train on alone
    assert seconds < 60, seconds


# A user's jsonl mixing good rows with every bad kind the pipeline knows, and images it converts.


def _png(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def _bomb(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims `width` x `height` pixels: a decompression bomb as PIL sees it."""
    data = bytearray(_png(Image.new("L", (1, 1))))
    ihdr = 8 + 8  # signature, then the IHDR chunk's length and type
    data[ihdr : ihdr + 8] = struct.pack(">II", width, height)
    data[ihdr + 13 : ihdr + 17] = struct.pack(">I", zlib.crc32(bytes(data[ihdr - 4 : ihdr + 13])))
    return bytes(data)


def _bad_data(root: Path) -> tuple[Path, dict, dict]:
    """pairs.jsonl under `root`: good rows, convertible rows (with their expected 32x32 RGB pixels) and bad rows
    (with the reason each must be quarantined for)."""
    root.mkdir()
    rng = np.random.default_rng(1)
    rows, expected_pixels, bad = [], {}, {}
    for i in range(10):  # good RGB images, 3 questions each
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / f"good{i}.png")
        for q in range(3):
            rows.append({"id": f"g{i}-{q}", "image": f"good{i}.png", "question": f"is it {q}?", "answer": ANSWERS[q]})
    # Convertible images at the training size (32 px), so the expected pixels need no resampling.
    gradient = np.tile(np.linspace(0, 4095, 32).astype(np.uint16), (32, 1))  # 12-bit data in a 16-bit PNG
    palette = Image.new("P", (32, 32), 0)
    palette.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    palette.paste(1, (0, 0, 32, 16))
    palette.info["transparency"] = 0
    la = np.zeros((32, 32, 2), dtype=np.uint8)
    la[:, :, 0], la[:16, :, 1] = 90, 255  # top half opaque gray 90, bottom half fully transparent
    top_white = np.full((32, 32, 3), 255, dtype=np.uint8)
    convertible = {
        "cmyk.jpg": (_png(Image.new("CMYK", (32, 32), (0, 255, 255, 0)), "JPEG"), np.full((32, 32, 3), (255, 0, 0))),
        "gray16.png": (_png(Image.fromarray(gradient)), np.repeat(np.round(gradient / 4095 * 255)[..., None], 3, 2)),
        "palette.png": (_png(palette), np.where(np.arange(32)[:, None, None] < 16, [0, 255, 0], top_white)),
        "la.png": (_png(Image.fromarray(la, "LA")), np.where(np.arange(32)[:, None, None] < 16, 90, top_white)),
        "gray.png": (_png(Image.new("L", (32, 32), 77)), np.full((32, 32, 3), 77)),
    }
    for name, (data, pixels) in convertible.items():
        (root / name).write_bytes(data)
        rows.append({"id": f"c-{name}", "image": name, "question": "what colour is it?", "answer": "red"})
        expected_pixels[f"c-{name}"] = pixels
    full = _png(Image.new("RGB", (32, 32), (9, 9, 9)))
    (root / "truncated.png").write_bytes(full[: len(full) // 2])
    (root / "zero.png").write_bytes(b"")
    (root / "text.png").write_text("not a picture")
    (root / "bomb.png").write_bytes(_bomb(30_000, 30_000))  # over PIL's own refusal limit
    (root / "big.png").write_bytes(_bomb(9_000, 9_000))  # under PIL's limit, over mm_fusion's 50 MP
    (root.parent / "outside.png").write_bytes(full)
    os.symlink(root.parent / "outside.png", root / "link.png")
    bad_rows = {
        "b-truncated": ({"image": "truncated.png"}, "truncated"),
        "b-zero": ({"image": "zero.png"}, "empty_file"),
        "b-text": ({"image": "text.png"}, "not_an_image"),
        "b-bomb": ({"image": "bomb.png"}, "too_large"),
        "b-big": ({"image": "big.png"}, "too_large"),
        "b-escape": ({"image": "../outside.png"}, "path_outside_root"),
        "b-symlink": ({"image": "link.png"}, "path_outside_root"),
        "b-missing": ({"image": "nowhere.png"}, "missing_image"),
        "b-no-image": ({"image": None}, "missing_image"),
        "b-empty-text": ({"question": ""}, "bad_text"),
        "b-blank-text": ({"question": " \t "}, "bad_text"),
        "b-number-text": ({"question": 42}, "bad_text"),
        "g3-1": ({"image": "good4.png", "question": "a second row with the id g3-1"}, "duplicate_id"),
    }
    for sample_id, (change, reason) in bad_rows.items():
        rows.append({"id": sample_id, "image": "good0.png", "question": "is it red?", "answer": "yes", **change})
        bad[sample_id] = reason
    rng.shuffle(rows)  # bad rows anywhere among the good ones
    first, repeat = [i for i, r in enumerate(rows) if r["id"] == "g3-1"]
    if rows[first]["image"] == "good4.png":  # the genuine row is the first with its id, the repeat comes later
        rows[first], rows[repeat] = rows[repeat], rows[first]
    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, expected_pixels, bad


def test_bad_rows_in_a_users_jsonl_are_reported_and_every_good_row_is_trained_on(tmp_path):
    pairs, expected_pixels, bad = _bad_data(tmp_path / "data")
    out = tmp_path / "out"
    flags = [*user_flags(pairs), *TINY, "--output_dir", str(out), "--per_device_train_batch_size", "8",
             "--num_train_epochs", "2", "--validation_split_percentage", "20", "--seed", "44",
             "--max_bad_fraction", "0.5"]  # fmt: skip  # a corpus of every defect: a quarter of its rows are bad
    trainer = setup_run(flags)
    trained_on = Counter()
    compute_loss = trainer.compute_loss

    def counting_compute_loss(model, inputs, *args, **kwargs):
        if model.training:
            trained_on.update(inputs["sample_ids"])
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = counting_compute_loss
    results = train_and_save(trainer)
    assert results["eval_accuracy"] == pytest.approx(correct_by_hand(trainer).mean())

    report = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    assert {q["id"]: q["reason"].split(":", 1)[0] for q in report} == bad  # exactly the bad rows, for their reasons
    duplicate = next(q for q in report if q["id"] == "g3-1")
    assert duplicate["source"] == "good4.png" and "which is kept" in duplicate["reason"]

    train_ids, eval_ids = list(trainer.train_dataset["id"]), list(trainer.eval_dataset["id"])
    all_rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    good = {r["id"] for r in all_rows} - (set(bad) - {"g3-1"})
    assert sorted(train_ids + eval_ids) == sorted(good) and not set(train_ids) & set(eval_ids)
    # Every good training row was trained on, once per epoch; nothing else was.
    assert trained_on == Counter({i: 2 for i in train_ids})
    # Converted images kept with the right pixels (the JPEG within its compression error).
    images = trainer.data_collator.images.with_format(None)  # the cached images the collator reads
    pixels = {k: np.asarray(v) for k, v in zip(images["image_key"], images["pixel_values"])}
    for sample_id, expected in expected_pixels.items():
        row = next(r for r in all_rows if r["id"] == sample_id)
        stored = pixels[f"path:{row['image']}"].transpose(1, 2, 0).astype(int)
        tolerance = 3 if sample_id.endswith(".jpg") else 0
        assert np.abs(stored - expected).max() <= tolerance, sample_id


@pytest.mark.parametrize("workers", [0, 1])
def test_streaming_run_sigkilled_mid_pass_resumes_with_the_same_batches_and_losses(tmp_path, workers):
    """A `--streaming` run over 4 webdataset shards (48 samples, 8 bad), a shuffle buffer of 10, batches of 8 (5
    per pass), 14 steps (almost 3 passes), a checkpoint every 4 steps. SIGKILLed at step 10 and resumed with `last`
    from checkpoint-8, 3 batches into the second pass with a full buffer: the batches from step 9 on, every logged loss
    and the final weights equal the uninterrupted run's (the stream's state, buffer included, is in each checkpoint:
    stream_state_rank0.json)."""
    from helpers.shards import write_shards

    shards = write_shards(str(tmp_path / "shards"), shards=4, rows=12, bad_every=6)
    flags = [*TINY_MODEL, "--patch_size", "8", "--logging_steps", "1", "--seed", "7", "--streaming",
             "--dataset", str(tmp_path / "shards" / "*.tar"), "--class_names", "no,yes", "--label_column", "answer",
             "--id_column", "uid", "--per_device_train_batch_size", "8", "--max_steps", "14", "--save_steps", "4",
             "--eval_strategy", "no", "--shuffle_buffer_size", "10",
             "--dataloader_num_workers", str(workers)]  # fmt: skip
    reference, out = tmp_path / "reference", tmp_path / "run"
    code, output, _ = run_worker(tmp_path / "reference.jsonl", "none", [*flags, "--output_dir", str(reference)])
    assert code == 0, output[-3000:]
    code, output, _ = run_worker(tmp_path / "killed.jsonl", "kill@10", [*flags, "--output_dir", str(out)])
    assert code == -signal.SIGKILL, output[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    assert (out / "checkpoint-8" / "stream_state_rank0.json").is_file()
    code, output, _ = run_worker(
        tmp_path / "resumed.jsonl", "none", [*flags, "--output_dir", str(out), "--resume_from_checkpoint", "last"]
    )
    assert code == 0, output[-3000:]

    expected = read_records(tmp_path / "reference.jsonl")
    killed, resumed = read_records(tmp_path / "killed.jsonl"), read_records(tmp_path / "resumed.jsonl")
    assert killed[-1]["step"] == 10 and resumed[0]["step"] == 9
    assert [r for r in killed if r["step"] <= 8] + resumed == expected
    # The first 40 pairs read are the 40 good ones, each once (one pass), in an order that is not the shards'.
    first_pass = [i for r in expected for i in r["ids"]][:40]
    assert sorted(first_pass) == sorted(shards["good"]) and first_pass != shards["good"]
    reference_losses, resumed_losses = losses(reference), losses(out)
    assert [s for s, _ in resumed_losses] == list(range(1, 15))
    torch.testing.assert_close(resumed_losses, reference_losses, rtol=1e-6, atol=1e-7)
    final, expected_weights = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    for name, value in expected_weights.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=1e-7, msg=name)
    reports = {e["id"]: e["reason"].split(":")[0] for e in read_quarantine(out / "quarantine")}
    assert reports == shards["bad"]


def test_a_finished_streaming_run_resumed_from_last_takes_no_step(tmp_path):
    """A streaming run that reached `--max_steps` 4, resumed with `last`, does what the Arrow path does: nothing. No
    step 5, no checkpoint-5, the same final weights and step losses (Trainer counts a stream's epochs without end, and
    took one more step)."""
    from helpers.shards import write_shards

    write_shards(str(tmp_path / "shards"), shards=2, rows=6)
    out = tmp_path / "run"
    flags = [*TINY, "--streaming", "--dataset", str(tmp_path / "shards" / "*.tar"), "--class_names", "no,yes",
             "--label_column", "answer", "--id_column", "uid", "--per_device_train_batch_size", "4",
             "--max_steps", "4", "--save_steps", "2", "--eval_strategy", "no", "--shuffle_buffer_size", "4",
             "--output_dir", str(out)]  # fmt: skip
    train(flags)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    finished, finished_losses = load_file(out / "model.safetensors"), losses(out)
    assert [step for step, _ in finished_losses] == [1, 2, 3, 4]
    train([*flags, "--resume_from_checkpoint", "last"])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4
    assert losses(out) == finished_losses
    resumed = load_file(out / "model.safetensors")
    assert resumed.keys() == finished.keys()
    for name, value in finished.items():
        assert torch.equal(resumed[name], value), name


def _run_nodes(root: Path, pairs: Path, fault: str, extra: list[str], record: str, timeout: float = 300):
    """Two simulated nodes (helpers.launch.start_nodes), one fault-worker process each, each with its own datasets
    cache and output directory, checkpoints saved on each node. Returns each node's exit code and output, and the
    seconds from the fault to the end of the slower node."""
    flags = [*user_flags(pairs), *TINY, "--per_device_train_batch_size", "8", "--num_train_epochs", "3",
             "--save_steps", "4", "--eval_strategy", "no", "--save_on_each_node", "True", "--ddp_timeout", "20",
             *extra]  # fmt: skip
    for node in range(2):
        (root / f"node{node}" / "cache").mkdir(parents=True, exist_ok=True)
    processes = start_nodes(
        "fault_worker",
        lambda node: [root / f"node{node}" / record, fault, *flags, "--output_dir", root / f"node{node}" / "run"],
        lambda node: {"HF_DATASETS_CACHE": str(root / f"node{node}" / "cache")},
    )
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in processes:
                for child in [*psutil.Process(p.pid).children(recursive=True), p]:
                    child.kill()
            pytest.fail(f"a node was still running after {timeout:.0f} s")
    ended = time.time()
    stamps = [Path(root / f"node{node}" / f"{record}.fault") for node in range(2)]
    struck = [float(s.read_text()) for s in stamps if s.exists()]
    return [p.returncode for p in processes], outputs, (ended - struck[0]) if struck else None


@pytest.mark.distributed
def test_a_dead_node_ends_the_run_and_both_nodes_resume_from_the_last_common_checkpoint(pairs, tmp_path):
    """Two simulated nodes with node-local disks; node 1's only process is SIGKILLed at step 6 (48 pairs, global
    batch 16: 3 steps an epoch, 9 in all; checkpoints at steps 4 and 8). Node 0 fails at its next collective, well
    within --ddp_timeout, and never hangs. Both nodes restarted with `last` agree on checkpoint-4 and finish: every
    logged loss and final weight equal an uninterrupted two-node run's."""
    reference_root, root = tmp_path / "reference", tmp_path / "run"
    codes, outputs, _ = _run_nodes(reference_root, pairs, "none", [], "reference.jsonl")
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]

    codes, outputs, seconds = _run_nodes(root, pairs, "kill@6:1", [], "killed.jsonl")
    assert codes[0] != 0 and codes[1] != 0, outputs[0][-3000:]
    assert seconds < 20 + 30, seconds  # --ddp_timeout, then torchrun's grace
    for node in range(2):
        assert sorted(p.name for p in (root / f"node{node}" / "run").glob("checkpoint-*")) == ["checkpoint-4"]

    codes, outputs, _ = _run_nodes(root, pairs, "none", ["--resume_from_checkpoint", "last"], "resumed.jsonl")
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    reference_losses = losses(reference_root / "node0" / "run")
    assert [s for s, _ in reference_losses] == list(range(1, 10))
    torch.testing.assert_close(losses(root / "node0" / "run"), reference_losses, rtol=1e-6, atol=1e-7)
    expected = load_file(reference_root / "node0" / "run" / "model.safetensors")
    for node in range(2):  # node 1's copy too (saved on each node)
        final = load_file(root / f"node{node}" / "run" / "model.safetensors")
        for name, value in expected.items():
            torch.testing.assert_close(final[name], value, rtol=0, atol=1e-7, msg=f"node {node}: {name}")


def test_a_batch_ramp_run_sigkilled_mid_epoch_resumes_with_the_same_batches_and_losses(pairs, tmp_path):
    """48 pairs, batch 4 growing by 4 an epoch up to 12, 3 epochs: 12 + 6 + 4 = 22 steps; checkpoints every 5
    steps. SIGKILLed at step 17 and resumed from checkpoint-15 (3 steps into the second epoch, batches of 8): the
    same batches, losses (and learning rates, which follow the batch) and final weights as the uninterrupted run."""
    flags = [*user_flags(pairs), *TINY, "--per_device_train_batch_size", "4", "--batch_size_ramp_max", "12",
             "--num_train_epochs", "3", "--save_steps", "5", "--eval_strategy", "no"]  # fmt: skip
    reference, out = tmp_path / "reference", tmp_path / "run"
    code, output, _ = run_worker(tmp_path / "reference.jsonl", "none", [*flags, "--output_dir", str(reference)])
    assert code == 0, output[-3000:]
    code, output, _ = run_worker(tmp_path / "killed.jsonl", "kill@17", [*flags, "--output_dir", str(out)])
    assert code == -signal.SIGKILL, output[-3000:]
    code, output, _ = run_worker(
        tmp_path / "resumed.jsonl", "none", [*flags, "--output_dir", str(out), "--resume_from_checkpoint", "last"]
    )
    assert code == 0, output[-3000:]
    expected = read_records(tmp_path / "reference.jsonl")
    assert [len(r["ids"]) for r in expected] == [4] * 12 + [8] * 6 + [12] * 4
    killed, resumed = read_records(tmp_path / "killed.jsonl"), read_records(tmp_path / "resumed.jsonl")
    assert resumed[0]["step"] == 16
    assert [r for r in killed if r["step"] <= 15] + resumed == expected
    reference_losses, resumed_losses = losses(reference), losses(out)
    assert [s for s, _ in resumed_losses] == list(range(1, 23))
    torch.testing.assert_close(resumed_losses, reference_losses, rtol=1e-6, atol=1e-7)
    final, expected_weights = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    for name, value in expected_weights.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=1e-7, msg=name)
