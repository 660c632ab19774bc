"""``sl.data.tokens``: global batches of packed token sequences from prepared data, a pure function of the step.

Note [token batches]: a split's stream (its shards in order, documents packed
with the end-of-document token) is cut into ``n`` sequences of ``seq_len + 1``
tokens: sequence ``j`` is tokens ``j*(seq_len+1)`` up to ``(j+1)*(seq_len+1)``
(inputs and shifted targets, as the examples' ``lm_loss`` takes them; the tail
shorter than a sequence is left out). Epoch ``e`` visits every sequence once, in
the order of a permutation drawn from ``(seed, e)``; the samples of all epochs
follow one another, and global batch ``k`` is samples ``k*B`` up to
``(k+1)*B`` (``B`` the global batch). So batch ``k`` is a function of the data,
the seed and ``k`` alone:

- the same sequences at every world size and spec (``shardlang check`` compares
  against one process on them);
- resuming at step ``k`` reads batch ``k``: a run stopped and resumed trains on
  what an uninterrupted one does, mid-epoch included, at any world size;
- each rank reads only its rows (``rows``), memory-mapped, and a background
  thread reads the next step's rows while this one trains.

Example (a job file)::

    make_batch = sl.data.tokens("data/python", seq_len=256, global_batch=16, seed=0)
    make_eval_batch = sl.data.tokens("data/python", seq_len=256, global_batch=16, split="val")
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xxhash

from ..errors import DataError
from .index import TokenIndex, read_index


class TokenBatches:
    """Global batch ``k`` of prepared data (Note [token batches]): ``batches(k)``, a ``(B, seq_len + 1)`` int64 tensor.

    ``rows(k, start, stop)`` gives rows ``start:stop`` of it, reading only those: the local launcher and
    torchrun ranks call it for their own rows. ``vocab_size`` and ``eod`` are the data's.
    """

    def __init__(self, directory: str | Path, seq_len: int, global_batch: int, seed: int = 0, split: str = "train",
                 verify: bool = True, read_ahead: bool = True):
        for name, value in (("seq_len", seq_len), ("global_batch", global_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DataError(f"sl.data.tokens: {name}={value!r}; expected an integer >= 1")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise DataError(f"sl.data.tokens: seed={seed!r}; expected an integer >= 0")
        self.index: TokenIndex = read_index(directory)
        self.split, self.seq_len, self.global_batch, self.seed = split, seq_len, global_batch, seed
        self.shards = self.index.open_split(split, verify=verify)
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])
        total = int(self.offsets[-1])
        self.sequences = total // (seq_len + 1)
        if self.sequences == 0:
            raise DataError(f"{self.index.path}: split {split!r} holds {total:,} tokens, fewer than one sequence of "
                            f"seq_len + 1 = {seq_len + 1:,}; use a seq_len of at most {max(total - 1, 1):,}, or "
                            "prepare more data (or a larger --val-fraction for the validation split)", path=self.index.path)
        self._order: tuple[int, torch.Tensor] | None = None
        self._order_lock = threading.Lock()
        self._ahead: dict[tuple[int, int, int], Future] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="shardlang-data") if read_ahead else None

    @property
    def vocab_size(self) -> int:
        return self.index.vocab_size

    @property
    def eod(self) -> int:
        return self.index.eod

    @property
    def path(self) -> Path:
        return self.index.path

    def __call__(self, step: int) -> torch.Tensor:
        """The global batch of ``step`` (every row)."""
        return self.rows(step, 0, self.global_batch)

    def rows(self, step: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of global batch ``step``; the next step's same rows are read in the background."""
        if not 0 <= start < stop <= self.global_batch:
            raise DataError(f"rows {start}:{stop} are not within the global batch of {self.global_batch}")
        key = (step, start, stop)
        future = self._ahead.pop(key, None)
        out = future.result() if future is not None else self._read(*key)
        if self._reader is not None:
            self._ahead = {k: f for k, f in self._ahead.items() if k[0] > step}  # forget skipped steps
            after = (step + 1, start, stop)
            if after not in self._ahead:
                self._ahead[after] = self._reader.submit(self._read, *after)
        return out

    def sample(self, index: int) -> int:
        """The sequence that sample ``index`` of the run reads (epoch ``index // n``, its permutation)."""
        epoch, position = divmod(index, self.sequences)
        return int(self._permutation(epoch)[position])

    def _permutation(self, epoch: int) -> torch.Tensor:
        with self._order_lock:
            if self._order is None or self._order[0] != epoch:
                g = torch.Generator().manual_seed(xxhash.xxh3_64_intdigest(f"{self.seed}/{epoch}".encode()) >> 1)
                self._order = (epoch, torch.randperm(self.sequences, generator=g))
            return self._order[1]

    def _read(self, step: int, start: int, stop: int) -> torch.Tensor:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise DataError(f"step {step!r}: expected an integer >= 0")
        first = step * self.global_batch
        length = self.seq_len + 1
        out = np.empty((stop - start, length), dtype=np.int64)
        for row in range(start, stop):
            out[row - start] = self._tokens(self.sample(first + row) * length, length)
        return torch.from_numpy(out)

    def _tokens(self, begin: int, length: int) -> np.ndarray:
        """Tokens ``begin:begin+length`` of the split's stream, across shard boundaries."""
        parts, end = [], begin + length
        shard = int(np.searchsorted(self.offsets, begin, side="right")) - 1
        while begin < end:
            lo = begin - int(self.offsets[shard])
            take = min(end - begin, len(self.shards[shard]) - lo)
            parts.append(self.shards[shard][lo:lo + take])
            begin += take
            shard += 1
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def __repr__(self) -> str:
        return (f"sl.data.tokens({str(self.index.directory)!r}, seq_len={self.seq_len}, "
                f"global_batch={self.global_batch}, seed={self.seed}, split={self.split!r})")

    def __getstate__(self):
        raise TypeError("a TokenBatches holds memory maps and a thread; each rank opens its own (load the job file)")


def tokens(directory: str | Path, seq_len: int, global_batch: int, seed: int = 0, split: str = "train",
           verify: bool = True) -> TokenBatches:
    """Global batches of prepared data: a job's ``make_batch`` (``split="train"``) or ``make_eval_batch`` (``"val"``).

    ``directory`` is what ``shardlang data prepare`` wrote; a relative path is relative to the working directory.
    With ``verify`` (the default) every shard is checked against the index's checksum when opened.
    See Note [token batches].
    """
    return TokenBatches(directory, seq_len, global_batch, seed, split, verify)
