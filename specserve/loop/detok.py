"""Incremental detokenization with stop strings."""

from __future__ import annotations


class IncrementalText:
    """Turns a growing list of token ids into text deltas and finds stop strings.

    Decodes the whole completion each time (completions here are short; correctness over cleverness) and
    holds back a trailing replacement character, which means a multi-byte character is still incomplete.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._sent = 0  # characters already emitted
        self.text = ""

    def push(self, ids: list[int]) -> tuple[str, bool]:
        """Add tokens; return (new text to emit, whether a stop string was reached)."""
        if self._tok is None:
            return "", False
        self._ids.extend(ids)
        full = self._tok.decode(self._ids)
        stopped = False
        for s in self._stop:
            at = full.find(s)
            if at != -1:
                full, stopped = full[:at], True
        ready = full if stopped else full.rstrip("\ufffd")
        delta = ready[self._sent :]
        self._sent = max(self._sent, len(ready))
        self.text = ready
        return delta, stopped
