"""In-process adapters: the engine and the proposer as the loop's TargetClient and DraftClient.

Two ways to call them. **Direct** (``LocalTarget(engine, direct=True)``, ``InlineDraft``): the step loop runs on the
engine's own thread (specserve/loop/engine_thread.py), so a verify is a plain call on the thread that launches the target's
graph and a propose a plain call on the same thread, on the drafter's CUDA stream: no thread hand-off in a step.
**Threaded** (the default, a caller on its own event loop): each call hops to the part's own thread (runtime/worker.py),
one thread per part, so the synchronous engine and proposer never see two calls at once.

On a GPU the engine issues its work on the device's default stream and the proposer on a stream of its own
(runtime/device_stream.py), whichever thread calls it, so drafting (draft-ahead: block n+1, always on the drafter's
thread) overlaps a verify on the same GPU; the target's hidden rows cross to the drafter's stream through
``hand_over``. What the drafter hands back (token ids, q) is on the host.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from specserve.contract.types import (
    DraftBlock,
    LogprobsSpec,
    PrefillResult,
    SamplingParams,
    VerifyResult,
)
from specserve.loop.clients import DraftError
from specserve.runtime.device_stream import enter_own_stream, hand_over
from specserve.runtime.worker import OneThread


class LocalTarget:
    """The engine as a TargetClient: threaded (each call on the engine's own thread) or ``direct`` (each call on the
    calling thread, which must be the engine's: the step loop runs there, specserve/loop/engine_thread.py)."""

    def __init__(self, engine, direct: bool = False) -> None:
        self.engine = engine
        self._thread = None if direct else OneThread("target-engine")

    async def _run(self, fn, *args):
        if self._thread is None:
            return fn(*args)
        return await self._thread.call(fn, *args)

    async def info(self):
        return self.engine.info()

    async def prefill(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        hidden_layers: tuple[int, ...],
        logprobs: LogprobsSpec | None = None,
    ) -> PrefillResult:
        return await self._run(
            self.engine.prefill, session_id, list(prompt_ids), sampling, tuple(hidden_layers), None, logprobs
        )

    async def verify(self, session_id: str, block: DraftBlock) -> VerifyResult:
        return await self._run(self.engine.verify, session_id, block)

    async def release(self, session_id: str) -> None:
        await self._run(self.engine.release, session_id)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()


class LocalDraft(OneThread):
    """A proposer in its own thread, on its own CUDA stream when its ``device`` is a GPU; any exception it raises
    becomes a DraftError (target-only fallback)."""

    def __init__(self, proposer) -> None:
        self.proposer = proposer
        self.stream: torch.cuda.Stream | None = None  # the drafter thread's own stream (None off CUDA), made there
        self.ready = threading.Event()  # set once the stream is made (or failed to be)
        super().__init__("draft", init=self._enter_stream)

    def _enter_stream(self) -> None:
        try:
            self.stream = enter_own_stream(getattr(self.proposer, "device", None))
        finally:
            self.ready.set()

    def _start(self, session_id, token_ids, hidden, sampling) -> None:  # on the drafter's stream
        self.proposer.start(session_id, token_ids, hand_over(hidden, self.stream), sampling)

    def _propose(self, session_id, prefix_len, append_ids, append_hidden, num_tokens, tree) -> DraftBlock:
        return self.proposer.propose(
            session_id, prefix_len, append_ids, hand_over(append_hidden, self.stream), num_tokens, tree
        )

    async def _guarded(self, fn, *args):
        try:
            return await self.call(fn, *args)
        except Exception as exc:  # the drafter's failure must never fail the request
            raise DraftError(f"{type(exc).__name__}: {exc}") from exc

    async def info(self):
        return self.proposer.info

    async def start(self, session_id: str, token_ids: Sequence[int], hidden: torch.Tensor | None, sampling) -> None:
        await self._guarded(self._start, session_id, list(token_ids), hidden, sampling)

    async def propose(self, session_id, prefix_len, append_ids, append_hidden, num_tokens, tree=None) -> DraftBlock:
        return await self._guarded(
            self._propose, session_id, prefix_len, list(append_ids), append_hidden, num_tokens, tree
        )

    propose_ahead = propose  # block n+1 while block n is verified: on the drafter's thread, as every call here

    async def release(self, session_id: str) -> None:
        await self._guarded(self.proposer.release, session_id)


class InlineDraft:
    """A LocalDraft called from the engine's thread (specserve/loop/engine_thread.py): start, propose and release run on the
    calling thread, on the drafter's stream; a block drafted ahead (``propose_ahead``) runs on the drafter's own thread,
    so it overlaps the verify. While a call is in flight there, every call goes there too (queued behind it), so the
    proposer never runs on two threads at once. Any exception becomes a DraftError, as in LocalDraft."""

    def __init__(self, draft: LocalDraft) -> None:
        self.draft = draft
        self._on_thread = 0  # calls in flight on the drafter's thread (counted on the engine's thread only)

    async def info(self):
        return self.draft.proposer.info

    async def _call(self, fn, *args):
        if self._on_thread:
            return await self._threaded(fn, *args)
        if not self.draft.ready.is_set():  # (a flag read; wait() takes the event's lock every call)
            self.draft.ready.wait()
        stream = self.draft.stream
        try:
            if stream is None:  # off CUDA
                return fn(*args)
            with torch.cuda.stream(stream):
                return fn(*args)
        except Exception as exc:  # the drafter's failure must never fail the request
            raise DraftError(f"{type(exc).__name__}: {exc}") from exc

    async def _threaded(self, fn, *args):
        self._on_thread += 1
        try:
            return await self.draft._guarded(fn, *args)
        finally:
            self._on_thread -= 1

    async def start(self, session_id: str, token_ids: Sequence[int], hidden: torch.Tensor | None, sampling) -> None:
        await self._call(self.draft._start, session_id, list(token_ids), hidden, sampling)

    async def propose(self, session_id, prefix_len, append_ids, append_hidden, num_tokens, tree=None) -> DraftBlock:
        return await self._call(
            self.draft._propose, session_id, prefix_len, list(append_ids), append_hidden, num_tokens, tree
        )

    async def propose_ahead(self, session_id, prefix_len, append_ids, append_hidden, num_tokens, tree=None):
        return await self._threaded(
            self.draft._propose, session_id, prefix_len, list(append_ids), append_hidden, num_tokens, tree
        )

    async def release(self, session_id: str) -> None:
        await self._call(self.draft.proposer.release, session_id)
