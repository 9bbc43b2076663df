"""A session's state on the draft side: its copy of S (a token buffer), its hidden rows (a row buffer on their device),
sampling, RNG and the family's own state (proposer.py says how a propose syncs them).

A session's hidden rows live in a row buffer on their device (``RowBuffer``): appending copies the new rows into
its tail (one copy, no allocation while there is room), dropping old rows moves its start (no copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from specserve.contract.types import SamplingParams
from specserve.draft_service.drafter_errors import ProposerError


class TokenBuffer:
    """Growable int64 array (amortised O(1) append, O(1) truncate, zero-copy numpy view)."""

    def __init__(self, ids: Sequence[int]) -> None:
        self._buf = np.zeros(max(16, 2 * len(ids)), dtype=np.int64)
        self._len = 0
        self.extend(ids)

    def extend(self, ids: Sequence[int]) -> None:
        n = len(ids)
        if self._len + n > len(self._buf):
            grown = np.zeros(max(2 * len(self._buf), self._len + n), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : self._len + n] = np.asarray(ids, dtype=np.int64).reshape(-1)
        self._len += n

    def truncate(self, n: int) -> None:
        self._len = min(self._len, n)

    @property
    def array(self) -> np.ndarray:  # [len] view, do not keep across mutations
        return self._buf[: self._len]

    def __len__(self) -> int:
        return self._len


ROW_SPARE = 32  # rows of room a session's row buffer keeps past twice its live rows when it moves them


class RowBuffer:
    """A session's hidden rows [start, start + len) of one buffer on their device: append copies into the tail (a
    buffer the caller gave, or one that is full, is first replaced by a new one holding the live rows: the caller's
    tensor is never written), drop_front moves the start (a buffer left 3/4 empty is replaced by a small one, so a
    prompt's rows are not held for the session's life). Views handed out stay valid: rows are never moved in place."""

    def __init__(self, rows: torch.Tensor) -> None:  # [n, F], the caller's: not copied, never written
        self._buf, self._start, self._len, self._owned = rows, 0, rows.shape[0], False

    def __len__(self) -> int:
        return self._len

    @property
    def rows(self) -> torch.Tensor:  # [len, F] view
        return self._buf[self._start : self._start + self._len]

    def truncate(self, n: int) -> None:
        self._len = min(self._len, n)

    @torch.inference_mode()  # its buffer may be one made in inference mode (a family's drop_front)
    def append(self, rows: torch.Tensor) -> None:  # [m, F]
        m = rows.shape[0]
        if not self._owned or self._start + self._len + m > self._buf.shape[0]:
            self._move(2 * (self._len + m) + ROW_SPARE)
        self._buf[self._start + self._len : self._start + self._len + m].copy_(rows)
        self._len += m

    def drop_front(self, n: int) -> None:
        n = min(n, self._len)
        self._start, self._len = self._start + n, self._len - n
        if self._buf.shape[0] > 4 * (self._len + ROW_SPARE):
            self._move(2 * self._len + ROW_SPARE)

    @torch.inference_mode()
    def _move(self, capacity: int) -> None:
        buf = self._buf.new_empty((capacity, self._buf.shape[1]))
        buf[: self._len].copy_(self.rows)
        self._buf, self._start, self._owned = buf, 0, True


@dataclass
class SessionState:
    """One session's copy of S, its hidden rows, sampling, RNG and the family's own state."""

    tokens: TokenBuffer  # S (confirmed by the target)
    sampling: SamplingParams
    generator: torch.Generator
    rows: RowBuffer | None = None  # rows of positions [hidden_start, hidden_end)
    hidden_start: int = 0  # first position whose row is still kept (families may drop older rows)
    draft_tail: tuple[int, ...] = ()  # last drafted chain: speculative continuation of S
    family_state: Any = None
    proposals: int = field(default=0)
    rows_check: torch.Tensor | None = None  # 0-dim bool on the device: appended GPU rows all finite (not read yet)

    def take_rows_check(self) -> torch.Tensor | None:  # 0-dim bool on the device, or None
        """The pending finiteness check of rows appended on a GPU, for the family to read back with its drafted block
        (then it raises RowsNotFinite when it reads False); None when there is none."""
        check, self.rows_check = self.rows_check, None
        return check

    @property
    def ids(self) -> np.ndarray:  # [len(S)]
        return self.tokens.array

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def hidden(self) -> torch.Tensor | None:  # [hidden_end - hidden_start, F] view
        return None if self.rows is None else self.rows.rows

    @property
    def hidden_end(self) -> int:
        return self.hidden_start + (0 if self.rows is None else len(self.rows))

    def hidden_rows(self, start: int, end: int) -> torch.Tensor:  # [end - start, F] view (valid for this propose)
        if self.rows is None or start < self.hidden_start or end > self.hidden_end:
            raise ProposerError(
                f"hidden rows [{start}, {end}) requested; session keeps [{self.hidden_start}, {self.hidden_end})"
            )
        return self.rows.rows[start - self.hidden_start : end - self.hidden_start]

    def drop_hidden_before(self, pos: int) -> None:
        """Free rows of positions < pos (a family calls this once they live in its own cache)."""
        if self.rows is None or pos <= self.hidden_start:
            return
        pos = min(pos, self.hidden_end)
        self.rows.drop_front(pos - self.hidden_start)
        self.hidden_start = pos


# Families drop hidden rows once they live in their own caches, but keep the rows of this many
# positions before the pending token, so a caller may still roll S back by that many tokens.
ROLLBACK_ROWS = 4


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n
