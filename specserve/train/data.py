"""Token streams and seeded random windows for language-model training."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from specserve.errors import SpecserveError
from specserve.train.tokenizer import EOS_ID


class DataError(SpecserveError):
    """The token stream is too short or a batch request is malformed."""


def encode_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """All texts, each followed by EOS, as one int32 array [N]."""
    encs = tok.encode_batch(texts, add_special_tokens=False)
    parts = []
    for enc in encs:
        parts.append(np.asarray(enc.ids, dtype=np.int32))
        parts.append(np.asarray([EOS_ID], dtype=np.int32))
    if not parts:
        raise DataError("no texts to encode")
    return np.concatenate(parts)


@dataclass
class WindowSampler:
    """Uniformly random windows of ``seq_len + 1`` tokens from a stream (inputs + shifted labels)."""

    stream: np.ndarray  # [N] int32
    seq_len: int
    batch_size: int
    seed: int

    def __post_init__(self) -> None:
        if self.seq_len < 2 or self.batch_size < 1:
            raise DataError(f"need seq_len >= 2 and batch_size >= 1, got {self.seq_len}, {self.batch_size}")
        if len(self.stream) < self.seq_len + 2:
            raise DataError(f"stream of {len(self.stream)} tokens is shorter than one window of {self.seq_len + 1}")
        self._rng = np.random.default_rng(self.seed)
        self._tensor = torch.from_numpy(self.stream.astype(np.int64))

    def next(self) -> torch.Tensor:  # [B, seq_len + 1] int64
        starts = self._rng.integers(0, len(self.stream) - self.seq_len - 1, size=self.batch_size)
        idx = torch.from_numpy(starts)[:, None] + torch.arange(self.seq_len + 1)[None, :]
        return self._tensor[idx]


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping consecutive windows [W, seq_len + 1] covering the stream (the tail is dropped)."""
    n = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise DataError(f"stream of {len(stream)} tokens is shorter than one window of {seq_len + 1}")
    t = torch.from_numpy(stream.astype(np.int64))
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return t[idx]


def unigram_cross_entropy(train: np.ndarray, heldout: np.ndarray, vocab_size: int) -> float:
    """Held-out cross entropy (nats/token) of an add-one smoothed unigram model fitted on ``train``,
    scored on the same predicted positions as the LM (every token but the first)."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout[1:]].mean())
