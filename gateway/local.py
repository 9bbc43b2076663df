"""In-process adapters: the engine and the proposer each run in one dedicated thread.

The event loop only awaits; all model work happens on the adapter's thread (one thread per part, so
the synchronous engine and proposer never see two calls at once). On a GPU the engine's thread issues its
work on the device's default stream and the proposer's thread on a stream of its own (runtime/device_stream.py),
so drafting (draft-ahead: block n+1) overlaps a verify on the same GPU; the target's hidden rows cross to the
drafter's stream through ``hand_over``. What the drafter hands back (token ids, q) is on the host.
"""

from __future__ import annotations

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


class LocalTarget(OneThread):
    def __init__(self, engine) -> None:
        super().__init__("target-engine")
        self.engine = engine

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
        return await self.call(
            self.engine.prefill, session_id, list(prompt_ids), sampling, tuple(hidden_layers), None, logprobs
        )

    async def verify(self, session_id: str, block: DraftBlock) -> VerifyResult:
        return await self.call(self.engine.verify, session_id, block)

    async def release(self, session_id: str) -> None:
        await self.call(self.engine.release, session_id)


class LocalDraft(OneThread):
    """A proposer in its own thread, on its own CUDA stream when its ``device`` is a GPU; any exception it raises
    becomes a DraftError (target-only fallback)."""

    def __init__(self, proposer) -> None:
        self.proposer = proposer
        self.stream: torch.cuda.Stream | None = None  # the drafter thread's own stream (None off CUDA), made there
        super().__init__("draft", init=self._enter_stream)

    def _enter_stream(self) -> None:
        self.stream = enter_own_stream(getattr(self.proposer, "device", None))

    def _start(self, session_id, token_ids, hidden, sampling) -> None:  # on the drafter thread
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

    async def release(self, session_id: str) -> None:
        await self._guarded(self.proposer.release, session_id)
