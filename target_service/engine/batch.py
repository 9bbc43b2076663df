"""A batched verify's bookkeeping, beside the engine that runs it (engine.py): each session's share of the
one forward (``BatchStep``: its block, its layout and its rows [start, end) of the step's tokens) and the
forward's timer (``StepTimer``)."""

from __future__ import annotations

import time

import torch

from specserve.contract.types import DraftBlock

from .session import Session
from .tree import StepLayout


class BatchStep:
    """One session's share of a batched verify forward."""

    __slots__ = ("session", "block", "layout", "start", "end")

    def __init__(self, session: Session, block: DraftBlock, layout: StepLayout, start: int) -> None:
        self.session = session
        self.block = block
        self.layout = layout
        self.start = start
        self.end = start + layout.num_nodes


class StepTimer:
    """A step's forward time: CUDA events on the GPU (read after the step's result read, so they never wait on
    their own), the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._t0 = time.perf_counter()
        self._ms = 0.0

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._ms = (time.perf_counter() - self._t0) * 1e3

    def ms(self) -> float:
        if self._events is not None:
            return float(self._events[0].elapsed_time(self._events[1]))
        return self._ms
