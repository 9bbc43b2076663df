"""In-process adapters: the engine and the proposer each run in one dedicated thread.

The event loop only awaits; all model work happens on the adapter's thread (one thread per part, so
the synchronous engine and proposer never see two calls at once).
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
from specserve.gateway.clients import DraftError
from specserve.runtime.worker import OneThread


class LocalTarget(OneThread):
    def __init__(self, engine) -> None:
        super().__init__("target-engine")
        self.engine = engine

    async def info(self):
        return self.engine.info()

    async def prefill(
        self, session_id: str, prompt_ids: Sequence[int], sampling: SamplingParams, hidden_layers: tuple[int, ...],
        logprobs: LogprobsSpec | None = None,
    ) -> PrefillResult:
        return await self.call(self.engine.prefill, session_id, list(prompt_ids), sampling, tuple(hidden_layers), None,
                               logprobs)

    async def verify(self, session_id: str, block: DraftBlock) -> VerifyResult:
        return await self.call(self.engine.verify, session_id, block)

    async def release(self, session_id: str) -> None:
        await self.call(self.engine.release, session_id)


class LocalDraft(OneThread):
    """A proposer in its own thread; any exception it raises becomes a DraftError (target-only fallback)."""

    def __init__(self, proposer) -> None:
        super().__init__("draft")
        self.proposer = proposer

    async def _guarded(self, fn, *args):
        try:
            return await self.call(fn, *args)
        except Exception as exc:  # the drafter's failure must never fail the request
            raise DraftError(f"{type(exc).__name__}: {exc}") from exc

    async def info(self):
        return self.proposer.info

    async def start(self, session_id: str, token_ids: Sequence[int], hidden: torch.Tensor | None, sampling) -> None:
        await self._guarded(self.proposer.start, session_id, list(token_ids), hidden, sampling)

    async def propose(self, session_id, prefix_len, append_ids, append_hidden, num_tokens, tree=None) -> DraftBlock:
        return await self._guarded(
            self.proposer.propose, session_id, prefix_len, list(append_ids), append_hidden, num_tokens, tree
        )

    async def release(self, session_id: str) -> None:
        await self._guarded(self.proposer.release, session_id)
