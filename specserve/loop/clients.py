"""What the per-request loop needs from a target and a drafter, local or remote.

Both sides are async: a local adapter (specserve/loop/local.py) calls the synchronous engine or proposer directly (the loop
on the engine's thread) or on its own thread; a remote adapter (gateway/remote.py) calls the gRPC service.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from specserve.errors import SpecserveError

if TYPE_CHECKING:
    import torch

    from specserve.contract.types import (
        DraftBlock,
        LogprobsSpec,
        PrefillResult,
        SamplingParams,
        SharedRows,
        VerifyResult,
    )


class DraftError(Exception):
    """The drafter failed (down, too slow, or gave a malformed block). The request goes on target-only."""


class TargetUnavailable(Exception):
    """The target cannot serve the request (down, or past the deadline)."""


class RequestRejected(SpecserveError):
    """The target refused the request's input (for example a prompt over its context)."""


class TargetClient(Protocol):
    async def info(self): ...  # -> TargetInfo-like: vocab_size, vocab_hash, max_context, eos_token_ids, model_type

    async def prefill(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        hidden_layers: tuple[int, ...],
        logprobs: LogprobsSpec | None = None,
    ) -> PrefillResult: ...

    async def verify(self, session_id: str, block: DraftBlock) -> VerifyResult: ...

    async def release(self, session_id: str) -> None: ...


class DraftClient(Protocol):
    async def info(self): ...  # -> DrafterInfo-like: family, vocab_hash, hidden_layers, needs_hidden_states, ...

    async def start(
        self,
        session_id: str,
        token_ids: Sequence[int],
        hidden: torch.Tensor | SharedRows | None,
        sampling: SamplingParams,
    ) -> None: ...

    async def propose(
        self,
        session_id: str,
        prefix_len: int,
        append_ids: Sequence[int],
        append_hidden: torch.Tensor | SharedRows | None,  # [m, F] rows (or where they are: SharedRows) or None
        num_tokens: int,
        tree=None,
    ) -> DraftBlock: ...

    async def propose_ahead(
        self,
        session_id: str,
        prefix_len: int,
        append_ids: Sequence[int],
        append_hidden: torch.Tensor | SharedRows | None,
        num_tokens: int,
        tree=None,
    ) -> DraftBlock: ...  # propose's, for block n+1 while block n is verified (in process: on the drafter's thread)

    async def release(self, session_id: str) -> None: ...
