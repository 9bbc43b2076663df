"""Per-session state of the target engine and the engine's error classes (glossary: specserve/contract/types.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.contract.types import LogprobsSpec, SamplingParams
from specserve.errors import SpecserveError
from specserve.models.block_manager import OutOfBlocks  # noqa: F401  (re-exported: the engine raises it unchanged)


class EngineError(SpecserveError):
    """A request the engine refuses; the engine state is unchanged when it is raised."""


class UnknownSession(EngineError, LookupError):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"unknown session {session_id!r} (never prefilled, or released)")
        self.session_id = session_id


class DuplicateSession(EngineError, ValueError):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} is already open")
        self.session_id = session_id


class ContextTooLong(EngineError, ValueError):
    def __init__(self, session_id: str, needed: int, max_context: int) -> None:
        super().__init__(f"session {session_id!r} needs {needed} positions, the context holds {max_context}")
        self.session_id = session_id
        self.needed = needed
        self.max_context = max_context


class InvalidInput(EngineError, ValueError):
    """Prompt, draft block or hidden-layer list that does not fit the model."""


@dataclass
class Session:
    """Mutable state of one sequence; only the engine thread touches it."""

    session_id: str
    sampling: SamplingParams
    generator: torch.Generator | None  # None for greedy sessions (no randomness used)
    hidden_layers: tuple[int, ...]
    cached_len: int  # tokens whose K/V is committed (prompt + emitted tokens before the pending one)
    pending_token: int
    steps: int = 0
    # [max_rows, len(hidden_layers) * hidden_size]: where the engine also writes every committed hidden row
    # (row i = position i) that fits, a shared buffer a drafter reads (target_service/server.py); or None
    hidden_out: torch.Tensor | None = None
    logprobs: LogprobsSpec | None = None  # the emitted tokens' log-probabilities are returned with each step
    # hidden_out is the engine's own (no caller gave a sink): grown when a step needs more rows, and a step's rows are
    # returned as a view of it, so a step copies its rows once and consecutive steps' rows are one range of it
    own_rows: bool = False


@dataclass(frozen=True)
class SessionView:
    """Read-only snapshot of a session for callers and tests."""

    session_id: str
    cached_len: int
    pending_token: int
    steps: int
    hidden_layers: tuple[int, ...]
    sampling: SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    model_type: str
    vocab_size: int
    vocab_hash: str  # same fingerprint rule as models/vocab.py ("sha256:..." or "size:<vocab_size>")
    max_context: int
    num_layers: int
    hidden_size: int
    eos_token_ids: tuple[int, ...]
    kv_block_size: int
    kv_num_blocks: int
