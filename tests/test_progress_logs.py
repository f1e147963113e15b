"""Training output fit for a file: off a terminal, progress comes as a log line every 5% of the steps instead of
carriage-return redraws of bars; on a terminal the bars stay."""

import fcntl
import io
import logging
import math
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.training import TINY_MODEL
from transformers import TrainerControl, TrainerState

import mm_fusion.training.callbacks as callbacks
from mm_fusion.training import MMFusionProgressLogCallback, MMFusionTrainingArguments


ROOT = Path(__file__).resolve().parents[1]
PROGRESS = re.compile(r"step (\d+) of (\d+) \((\d+)%\)")
# The tiny model, the progress left to its default (TINY_MODEL turns the bars off); 160 pairs in batches of 4: 40
# optimizer steps, a line every 2.
FLAGS = [
    *(f for f in TINY_MODEL if f not in ("--disable_tqdm", "True")),
    "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "32", "--logging_steps", "10",
    "--max_train_samples", "160", "--max_eval_samples", "32", "--num_train_epochs", "1",
]  # fmt: skip


class _Stream(io.StringIO):
    """A stand-in for stderr that is, or is not, a terminal."""

    def __init__(self, terminal: bool):
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def _run_steps(callback, state, steps, caplog, monkeypatch, seconds_per_step=0.4) -> list[str]:
    """`callback` through `steps` optimizer steps on a fake clock; the progress lines it logged."""
    clock = [0.0]
    monkeypatch.setattr(callbacks, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    args, control = SimpleNamespace(), TrainerControl()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mm_fusion.train"):
        callback.on_train_begin(args, state, control)
        for step in steps:
            clock[0] += seconds_per_step
            state.global_step, state.epoch = step, step / 603
            callback.on_step_end(args, state, control)
    return [r.getMessage() for r in caplog.records if PROGRESS.match(r.getMessage())]


def test_a_line_at_every_twentieth_of_the_run_and_none_between(caplog, monkeypatch):
    state = TrainerState(max_steps=2110)
    lines = _run_steps(MMFusionProgressLogCallback(), state, range(1, 2111), caplog, monkeypatch)
    steps = [int(PROGRESS.match(line)[1]) for line in lines]
    assert steps == [math.ceil(k * 2110 / 20) for k in range(1, 21)]  # 106, 211, 317, ..., 2110
    assert [int(PROGRESS.match(line)[3]) for line in lines] == list(range(5, 101, 5))
    # 106 steps of 0.4 s: 42 s so far, and 2004 steps at that pace left (802 s).
    assert lines[0] == "step 106 of 2110 (5%), epoch 0.18, 42 s elapsed, about 13 min left"
    assert lines[-1] == "step 2110 of 2110 (100%), epoch 3.50, 14 min elapsed"


def test_short_resumed_and_other_ranks_runs(caplog, monkeypatch):
    # Fewer steps than twentieths: a line at each step.
    lines = _run_steps(MMFusionProgressLogCallback(), TrainerState(max_steps=7), range(1, 8), caplog, monkeypatch)
    assert [int(PROGRESS.match(line)[1]) for line in lines] == list(range(1, 8))
    # Resumed at step 500 of 1000: lines from the next twentieth on, the time left from this call's own pace.
    state = TrainerState(max_steps=1000, global_step=500)
    lines = _run_steps(
        MMFusionProgressLogCallback(), state, range(501, 1001), caplog, monkeypatch, seconds_per_step=1.2
    )
    assert [int(PROGRESS.match(line)[1]) for line in lines] == list(range(550, 1001, 50))
    assert lines[0].endswith("60 s elapsed, about 9 min left")  # 50 steps of 1.2 s done, 450 to go
    assert any("from step 500" in r.getMessage() for r in caplog.records)
    # Only the main process logs.
    state = TrainerState(max_steps=100, is_world_process_zero=False)
    assert _run_steps(MMFusionProgressLogCallback(), state, range(1, 101), caplog, monkeypatch) == []
    assert not caplog.records


def test_disable_tqdm_defaults_to_on_off_a_terminal(monkeypatch):
    for terminal, given, expected in [(False, None, True), (True, None, False), (False, False, False),
                                      (True, True, True)]:  # fmt: skip
        monkeypatch.setattr(sys, "stderr", _Stream(terminal))
        args = MMFusionTrainingArguments(output_dir="unused", disable_tqdm=given)
        assert args.disable_tqdm is expected, (terminal, given)


def test_a_run_into_a_file_logs_lines_not_bars(tmp_path):
    log = tmp_path / "train.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--output_dir", str(tmp_path / "out"), *FLAGS]
    with open(log, "wb") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=300)
    text = log.read_text()
    assert done.returncode == 0, text[-3000:]
    assert "\r" not in text and "it/s" not in text and "examples/s" not in text  # no bar, not even datasets' maps'
    progress = [PROGRESS.search(line) for line in text.splitlines() if PROGRESS.search(line)]
    assert [int(m[1]) for m in progress] == list(range(2, 41, 2)) and {m[2] for m in progress} == {"40"}
    assert "training 40 optimizer steps, a line every 5%" in text
    assert text.count("evaluating 1 batch at step") == 2  # eval_steps 0.5
    assert text.count("{'loss': ") == 4  # Trainer's PrinterCallback still prints the metrics of each log
    assert "accuracy = " in text


def _run_in_terminal(command: list[str], env: dict, timeout: float = 300) -> tuple[int, bytes]:
    """`command` with its stdout and stderr on a pseudo-terminal: its exit status and everything it wrote."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 0 columns would draw empty bars
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    output, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([leader], [], [], 1)[0]:
                if process.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: every writer is gone
                break
            if not chunk:
                break
            output.append(chunk)
    finally:
        os.close(leader)
        if process.poll() is None:
            process.kill()
    return process.wait(), b"".join(output)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal as Linux has it")
def test_on_a_terminal_the_bars_stay(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = [*FLAGS, "--max_steps", "3", "--eval_strategy", "no", "--save_strategy", "no"]
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--output_dir", str(tmp_path / "out"), *flags]
    status, output = _run_in_terminal(command, env)
    text = output.decode(errors="replace")
    assert status == 0, text[-3000:]
    assert "3/3 [" in text and "it/s]\r" in text  # Trainer's bar, redrawn in place
    assert "Writing model shards: 100%" in text  # and transformers' own
    assert not PROGRESS.search(text) and "a line every" not in text
