"""Progress on long waits, for a terminal and for a log alike: on a terminal tqdm's bar; anywhere else (a pipe,
a file, a CI log) a plain line at most every ``every_s`` seconds, so a long run never looks hung there either.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

EVERY_S = 5.0  # seconds between two progress lines off a terminal


class Progress:
    """``done``/``total`` units on ``stream`` (stderr): tqdm's bar when the stream is a terminal, else a line
    ``DESC: DONE/TOTAL UNITs, LABEL, T s`` at most every ``every_s`` seconds and one at close."""

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str,
        stream: TextIO | None = None,
        every_s: float = EVERY_S,
        enabled: bool = True,
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.done, self.label = 0, ""
        self.start = self.last = time.monotonic()
        self.bar = None
        self.enabled = enabled
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream)

    def update(self, label: str = "") -> None:
        """One more unit done (``label``: what it was)."""
        self.done += 1
        self.label = label or self.label
        if self.bar is not None:
            self.bar.set_postfix_str(self.label, refresh=False)
            self.bar.update(1)
        elif self.enabled and time.monotonic() - self.last >= self.every_s:
            self._line()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.done:
            self._line()
        self.enabled = False

    def _line(self) -> None:
        self.last = time.monotonic()
        label = f", {self.label}" if self.label else ""
        _write_line(
            self.stream, f"{self.desc}: {self.done}/{self.total} {self.unit}s{label}, {self.last - self.start:.0f} s"
        )


class Heartbeat:
    """A line ``WHAT (T s)`` at most every ``every_s`` seconds while something is awaited; ``beat`` is called
    from the waiting loop, as often as it likes. ``say`` writes a line (default: stderr)."""

    def __init__(self, say: Callable[[str], None] | None = None, every_s: float = EVERY_S) -> None:
        self.say = say or (lambda line: _write_line(sys.stderr, line))
        self.every_s = every_s
        self.start = self.last = time.monotonic()

    def beat(self, what: str) -> None:
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self.say(f"{what} ({now - self.start:.0f} s)")


def _write_line(stream: TextIO, line: str) -> None:
    stream.write(line + "\n")  # one write: a line is never split by another thread's
    stream.flush()
