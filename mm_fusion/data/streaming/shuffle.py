"""A stream split between ranks ([`split_by_rank`]), shuffled by a buffer and repeated, resumable exactly
([`ShuffledStream`])."""

import copy
import json
import logging
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from datasets import IterableDataset
from datasets.distributed import split_dataset_by_node


def split_by_rank(dataset: IterableDataset, rank: int, world_size: int) -> tuple[IterableDataset, str]:
    """
    This rank's part of a stream, by `datasets.distributed.split_dataset_by_node`, and the strategy used:

    - `"shards"` when there are at least as many shards as ranks: each rank reads whole shards, ⌊n/w⌋ or ⌈n/w⌉ of
      them when `w` does not divide `n` (so ranks may get different numbers of rows);
    - `"examples"` with fewer shards than ranks: every rank reads every shard and keeps every `w`-th row.

    Either way every pair goes to exactly one rank per pass. Ranks never wait for data: [`ShuffledStream`] starts a
    rank's next pass as soon as its own ends, and the run's length is a number of steps (`max_steps`), the same on
    every rank.
    """
    if world_size == 1:
        return dataset, "shards"
    strategy = "shards" if dataset.num_shards >= world_size else "examples"
    return split_dataset_by_node(dataset, rank=rank, world_size=world_size, strategy=strategy), strategy


@contextmanager
def _quiet(name: str):
    logger_ = logging.getLogger(name)
    level = logger_.level
    logger_.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger_.setLevel(level)


class ShuffledStream(torch.utils.data.IterableDataset):
    """
    A rank's stream of pairs, shuffled by a buffer of `buffer_size` rows and repeated pass after pass (each pass with
    its own shard order and buffer draws, from `seed` and the pass number), for `passes` passes or for ever.

    It has `state_dict` / `load_state_dict` (used by torchdata's `StatefulDataLoader`, which accelerate wraps with
    `use_stateful_dataloader=True`, and which calls them in each worker) that resume exactly, buffer included:
    `datasets`' own buffered shuffle refills its buffer from later rows on resume, so the resumed order differs. The
    state holds the source's `state_dict` (datasets') at the oldest row still in the buffer, the positions of the
    buffered rows and the generator's state; loading it re-reads the source from that point (at most a few buffers
    of rows) and keeps the rows that were in the buffer.

    Args:
        dataset (`datasets.IterableDataset`): this rank's part of the stream ([`split_by_rank`]).
        buffer_size (`int`): rows in the shuffle buffer; 0 or 1 keeps the source order (the shard order is still
            shuffled when `shuffle_shards`).
        seed (`int`): the same on every rank.
        passes (`int`, *optional*): stop after this many passes (e.g. 1 for evaluation); `None` repeats for ever.
        shuffle_shards (`bool`): shuffle the order of the shards each pass (`IterableDataset.shuffle` of the source
            with no buffer of its own).
    """

    SNAPSHOT_EVERY = 32

    def __init__(
        self,
        dataset: IterableDataset,
        buffer_size: int = 1000,
        seed: int = 0,
        passes: int | None = None,
        shuffle_shards: bool = True,
    ):
        super().__init__()
        if int(buffer_size) < 0:
            raise ValueError(f"buffer_size must be 0 or more rows (0 or 1: no shuffle buffer), got {buffer_size}.")
        self.dataset = dataset
        self.buffer_size = max(int(buffer_size), 1)
        self.seed = seed
        self.passes = passes
        self.shuffle_shards = shuffle_shards
        self._live: tuple | None = None  # the running pass: (number, snapshots, buffer, rows read, generator)
        self._resume: dict[str, Any] | None = None

    def _source(self, pass_number: int) -> IterableDataset:
        if not self.shuffle_shards:
            return copy.copy(self.dataset)  # a resumed pass loads a state into it, not into the later passes' source
        # `buffer_size=1, max_buffer_input_shards=1`: datasets shuffles the shard order (from the seed and the epoch)
        # and nothing else; it neither buffers rows nor reads several shards at once.
        source = self.dataset.shuffle(seed=self.seed, buffer_size=1, max_buffer_input_shards=1)
        source.set_epoch(pass_number)
        return source

    def _generator(self, pass_number: int) -> np.random.Generator:
        worker = torch.utils.data.get_worker_info()
        return np.random.default_rng([self.seed, pass_number, worker.id if worker else 0])

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is; called between two rows (the generator paused at its `yield`)."""
        if self._live is None:  # nothing yielded yet: the state loaded (a resume not begun), or the start
            return json.loads(json.dumps(self._resume)) if self._resume is not None else {"pass": 0, "fresh": True}
        pass_number, snapshots, buffer, read, rng = self._live
        oldest = min((position for position, _ in buffer), default=read)
        position, source = next((p, state) for p, state in reversed(snapshots) if p <= oldest)
        state = {"pass": pass_number, "source_position": position, "source": source, "read": read,
                 "buffer": [p for p, _ in buffer], "rng": rng.bit_generator.state}  # fmt: skip
        return json.loads(json.dumps(state))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = None if state.get("fresh") else state
        self._live = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        resume, self._live = self._resume, None
        pass_number = resume["pass"] if resume else 0
        while self.passes is None or pass_number < self.passes:
            rows = 0
            for row in self._one_pass(pass_number, resume):
                rows += 1
                yield row
            if rows == 0 and resume is None and self.passes is None:
                # Repeating an empty pass would spin for ever without a batch, and hang the other ranks.
                worker = torch.utils.data.get_worker_info()
                where = f" (data loader worker {worker.id} of {worker.num_workers})" if worker else ""
                raise RuntimeError(
                    f"This process's part of the stream{where} has no usable pairs: every row of its shards was "
                    "quarantined or it got no shard. See the quarantine reports; use fewer workers or more shards."
                )
            resume = None
            pass_number += 1

    def _one_pass(self, pass_number: int, resume: dict | None) -> Iterator[dict[str, Any]]:
        source = self._source(pass_number)
        rng = self._generator(pass_number)
        buffer: list[tuple[int, dict]] = []  # (read position in this pass, row)
        snapshots: deque[tuple[int, dict]] = deque()  # (read position, source state before reading it)
        read = 0
        if resume:
            if resume["source"] is not None:
                with _quiet("datasets.iterable_dataset"):
                    # Its warning is about datasets' shuffle buffer, which is one row here (the shard order only).
                    source.load_state_dict(resume["source"])
            rng.bit_generator.state = resume["rng"]
            read = resume["source_position"]
            wanted = {position: slot for slot, position in enumerate(resume["buffer"])}
            slots: list[tuple[int, dict] | None] = [None] * len(wanted)
            iterator = iter(source)
            snapshots.append((read, resume["source"]))
            while read < resume["read"]:
                if read % self.SNAPSHOT_EVERY == 0 and read != snapshots[-1][0]:
                    snapshots.append((read, source.state_dict()))
                row = next(iterator)
                if read in wanted:
                    slots[wanted[read]] = (read, row)
                read += 1
            if any(slot is None for slot in slots):
                raise RuntimeError("The stream's state does not match its data: a buffered row was not found again.")
            buffer = slots
        else:
            iterator = iter(source)
            snapshots.append((0, None))  # None: the start of the pass
        exhausted = False
        while True:
            # Fill the buffer, then each row read takes the place of one drawn at random, which is yielded.
            while not exhausted and len(buffer) < self.buffer_size:
                if read % self.SNAPSHOT_EVERY == 0 and snapshots[-1][0] != read:
                    snapshots.append((read, source.state_dict()))
                try:
                    row = next(iterator)
                except StopIteration:
                    exhausted = True
                    break
                buffer.append((read, row))
                read += 1
            if not buffer:
                break
            index = int(rng.integers(len(buffer))) if len(buffer) > 1 else 0
            _, row = buffer[index]
            last = buffer.pop()
            if index < len(buffer):
                buffer[index] = last
            if len(snapshots) > 4 and read % self.SNAPSHOT_EVERY == 0:  # drop the snapshots no buffered row needs
                oldest = min((position for position, _ in buffer), default=read)
                while len(snapshots) > 1 and snapshots[1][0] <= oldest:
                    snapshots.popleft()
            self._live = (pass_number, snapshots, buffer, read, rng)
            self._resume = None  # from the first row on, the state is the live one
            yield row
