"""Admission control shared by the gateway (sessions) and the target service (sessions + KV blocks).

A request is admitted when fewer than ``max_active`` requests run and, if it costs units (KV blocks),
when those units fit beside the units every admitted request holds. Otherwise it waits in a FIFO
queue of at most ``max_queued`` requests; a request beyond the queue is refused at once with
``AdmissionRefused`` (the services answer RESOURCE_EXHAUSTED with its message). A queued request
that is cancelled (client gone, deadline) leaves the queue. Event-loop only (no locking needed).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from specserve.errors import SpecserveError


class AdmissionRefused(SpecserveError):
    """No room now and the queue is full, or a request can never fit."""


@dataclass(frozen=True)
class AdmissionConfig:
    max_active: int
    max_queued: int
    capacity: int = 0  # units (KV blocks) shared by the admitted requests; 0 = not counted
    what: str = "sessions"  # names the limit in messages

    def __post_init__(self) -> None:
        if self.max_active < 1:
            raise ValueError(f"max_active must be >= 1, got {self.max_active}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {self.capacity}")


class _Waiter:
    __slots__ = ("units", "future")

    def __init__(self, units: int, future: asyncio.Future) -> None:
        self.units, self.future = units, future


class Admission:
    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.active = 0
        self.units_held = 0
        self._queue: deque[_Waiter] = deque()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def _fits(self, units: int) -> bool:
        if self.active >= self.config.max_active:
            return False
        return not self.config.capacity or self.units_held + units <= self.config.capacity

    def _take(self, units: int) -> None:
        self.active += 1
        self.units_held += units

    async def acquire(self, units: int = 0) -> None:
        """Wait for room (FIFO); raise AdmissionRefused when the queue is full or units never fit."""
        c = self.config
        if c.capacity and units > c.capacity:
            raise AdmissionRefused(f"the request needs {units} KV blocks, more than the whole cache ({c.capacity})")
        if not self._queue and self._fits(units):
            self._take(units)
            return
        if len(self._queue) >= c.max_queued:
            raise AdmissionRefused(
                f"busy: {self.active} {c.what} running (limit {c.max_active}"
                + (f", {self.units_held}/{c.capacity} KV blocks reserved" if c.capacity else "")
                + f") and {len(self._queue)} queued (queue limit {c.max_queued}); retry later"
            )
        waiter = _Waiter(units, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        try:
            await waiter.future  # set once _take() ran for this waiter
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(units)  # admitted just as it was cancelled: give the room back
            else:
                if waiter in self._queue:
                    self._queue.remove(waiter)
                self._wake()
            raise

    def release(self, units: int = 0) -> None:
        self.active -= 1
        self.units_held -= units
        self._wake()

    def _wake(self) -> None:
        """Admit queued requests in order while the head fits (no overtaking: FIFO, no starvation)."""
        while self._queue and self._fits(self._queue[0].units):
            waiter = self._queue.popleft()
            if waiter.future.done():
                continue
            self._take(waiter.units)
            waiter.future.set_result(None)
