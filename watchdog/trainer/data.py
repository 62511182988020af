"""Training batches as a pure function of (seed, position, shard).

Because a batch depends on nothing but its position, resuming is exact: the checkpoint stores
the position of the next batch, and a restarted job sees the very batches it would have seen
had it never stopped. No iterator state, no RNG stream shared with the model.

Two sources:
- synthetic (default): a fixed random Markov chain over the vocabulary, followed 90% of the
  time; learnable, so the loss curve falls and a discontinuity after a reinit would show.
- a text file, character (byte) level: random windows of the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from watchdog.core.errors import InputError
from watchdog.core.inputs import open_regular

FOLLOW_CHAIN = 0.9  # share of synthetic tokens that follow the chain; the rest are noise


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # (batch, seq_len) int64
    targets: torch.Tensor  # tokens shifted by one


class TokenSource:
    """Batches on the CPU; the caller moves them to the device (or MpDeviceLoader does)."""

    def __init__(self, *, batch_size: int, seq_len: int, vocab_size: int, seed: int,
                 text_file: str | Path | None = None, shard: int = 0, num_shards: int = 1):
        self.batch_size, self.seq_len, self.vocab_size = batch_size, seq_len, vocab_size
        self.seed, self.shard, self.num_shards = seed, shard, num_shards
        self.text = _read_text(text_file, seq_len) if text_file is not None else None
        # The chain is part of the data set, fixed by the seed alone.
        chain_rng = torch.Generator().manual_seed(seed)
        self.chain = torch.randint(vocab_size, (vocab_size,), generator=chain_rng)

    def batch_at(self, position: int) -> Batch:
        rng = torch.Generator().manual_seed(_mix(self.seed, position * self.num_shards + self.shard))
        rows = self._text_rows(rng) if self.text is not None else self._synthetic_rows(rng)
        return Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())

    def batches_from(self, position: int) -> Iterator[Batch]:
        while True:
            yield self.batch_at(position)
            position += 1

    def _synthetic_rows(self, rng: torch.Generator) -> torch.Tensor:
        shape = (self.batch_size, self.seq_len + 1)
        rows = torch.empty(shape, dtype=torch.long)
        rows[:, 0] = torch.randint(self.vocab_size, (self.batch_size,), generator=rng)
        follow = torch.rand(shape, generator=rng) < FOLLOW_CHAIN
        noise = torch.randint(self.vocab_size, shape, generator=rng)
        for t in range(1, shape[1]):
            rows[:, t] = torch.where(follow[:, t], self.chain[rows[:, t - 1]], noise[:, t])
        return rows

    def _text_rows(self, rng: torch.Generator) -> torch.Tensor:
        starts = torch.randint(len(self.text) - self.seq_len - 1, (self.batch_size,), generator=rng)
        offsets = torch.arange(self.seq_len + 1)
        return self.text[starts[:, None] + offsets[None, :]]


def _read_text(path: str | Path, seq_len: int) -> torch.Tensor:
    path = Path(path)
    try:
        with open_regular(path, "rb", what="--text-file ") as handle:
            data = handle.read()
    except OSError as exc:
        raise InputError(f"--text-file {path}: cannot read it ({exc.strerror or exc})") from None
    if len(data) < seq_len + 2:
        raise InputError(f"--text-file {path}: needs at least {seq_len + 2} bytes for sequences of "
                         f"{seq_len}, has {len(data)}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def _mix(seed: int, position: int) -> int:
    """A well-spread 63-bit seed from two integers (splitmix64's finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
