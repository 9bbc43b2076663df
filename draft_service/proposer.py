"""The proposer interface every drafter family implements (``Proposer``): session start, sync and release.

What it uses: the errors (drafter_errors.py), DrafterInfo / DrafterConfig (drafter_config.py), a session's state and
buffers (session_state.py); the factories' checkpoint checks are checkpoint_checks.py.

Vocabulary (pending, drafted, accepted, ...) is the glossary of
``specserve.contract.types``.

A session mirrors the target's sequence S = prompt + emitted tokens (its last token is the pending
token). The target has hidden rows for every position of S but the last, and a family that needs
hidden states keeps the same invariant: after every ``start`` / ``propose`` sync it holds hidden rows
for positions ``[hidden_start, len(S) - 1)``.

Sync rule of ``propose(session_id, prefix_len, append_ids, append_hidden, ...)``:

1. Truncate the session's copy of S to ``prefix_len`` tokens. The copy may run past the confirmed S by
   the last drafted chain (a chain proposal is remembered as a speculative tail), so a caller may pass
   either ``prefix_len = len(S_before_verify)`` with ``append_ids = accepted + (next_token,)`` or
   ``prefix_len = len(S_before_verify) + len(accepted)`` with ``append_ids = (next_token,)``.
2. Append ``append_ids``. ``append_hidden`` holds the LAST rows of the new S's hidden rows, i.e. rows
   for positions ``[len(S) - 1 - m, len(S) - 1)`` with ``m = append_hidden.shape[0]`` (a
   ``VerifyResult.hidden`` fits as is: old pending + accepted tokens).
3. Families compare their own cache against the new S (longest common prefix) and drop whatever does
   not match, so a drafter can never drift out of sync with the target.

A session's hidden rows live in a row buffer on their device (``RowBuffer``): appending copies the new rows into
its tail (one copy, no allocation while there is room), dropping old rows moves its start (no copy). Rows are checked
for NaN / inf: host rows before anything changes; rows on a GPU on the device, with no host wait mid-propose, their
result read back with the drafted block (``SessionState.take_rows_check``; at the end of the propose if the family
did not read it): rows that fail end the session (its caches were built from them) with a ProposerError.

Families implement four hooks: ``_start_state``, ``_draft_chain``, ``_draft_tree`` (when they support
trees) and ``_release_state``. Nothing here branches on family names (see ``registry.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np
import torch

from specserve.contract.types import DraftBlock, SamplingParams, TreeSpec
from specserve.draft_service.drafter_config import DrafterInfo
from specserve.draft_service.drafter_errors import ProposerError, RowsNotFinite
from specserve.draft_service.session_state import RowBuffer, SessionState, TokenBuffer


def draft_seed(request_seed: int | None) -> int:
    """The drafter's RNG seed. A seeded request stays reproducible, but the drafter must NOT share the
    target's random stream (equal streams would correlate a drafted token's draw with its own acceptance
    test); the target draws from an HMAC of the seed under its own key (models/probs.py), and a remote
    draft is sent a seed the gateway derived, never the request's."""
    if request_seed is None:
        return int(torch.seed() % 2**63)
    return (int(request_seed) * 6364136223846793005 + 1442695040888963407) % 2**63


def _all_finite(rows: torch.Tensor) -> bool:
    """Whether every value is finite: host rows through numpy (no device involved), others on their device (the
    host waits for it)."""
    if rows.device.type == "cpu" and rows.dtype in (torch.float32, torch.float64, torch.float16):
        return bool(np.isfinite(rows.numpy()).all())
    return bool(torch.isfinite(rows).all())


class Proposer(ABC):
    """A drafter. Synchronous; driven from one draft thread (no locking inside)."""

    info: DrafterInfo
    device: torch.device = torch.device(
        "cpu"
    )  # where it computes (a family on a GPU sets its own); its thread's stream

    def __init__(self, info: DrafterInfo) -> None:
        self.info = info
        self._sessions: dict[str, SessionState] = {}

    # ---------------------------------------------------------------- public interface
    def start(
        self,
        session_id: str,
        token_ids: Sequence[int],  # S = prompt + first pending token
        hidden: torch.Tensor | None,  # [len(S) - 1, F] when info.needs_hidden_states
        sampling: SamplingParams,
    ) -> None:
        if session_id in self._sessions:
            raise ProposerError(f"session {session_id!r} already started")
        if len(token_ids) < 1:
            raise ProposerError("start needs at least one token (the pending token)")
        self._check_ids(token_ids)
        gen = torch.Generator(device=self._generator_device())
        gen.manual_seed(draft_seed(sampling.seed))
        state = SessionState(tokens=TokenBuffer(token_ids), sampling=sampling, generator=gen)
        if self.info.needs_hidden_states:
            state.rows = RowBuffer(self._check_hidden(hidden, len(token_ids) - 1, "start hidden"))
        self._start_state(state)
        self._sessions[session_id] = state

    def propose(
        self,
        session_id: str,
        prefix_len: int,
        append_ids: Sequence[int],
        append_hidden: torch.Tensor | None,  # [m, F]: rows of the last m positions before the pending
        num_tokens: int,
        tree: TreeSpec | None = None,
    ) -> DraftBlock:
        state = self.session(session_id)
        self._sync(state, prefix_len, append_ids, append_hidden)
        state.proposals += 1
        try:
            block = self._draft(state, num_tokens, tree)
            check = state.take_rows_check()  # the family did not read it with its block: read it now (no wait left)
            if check is not None and not bool(check):
                raise RowsNotFinite("")
        except RowsNotFinite:
            self.release(session_id)
            raise ProposerError(
                "append_hidden: hidden rows contain NaN or inf (checked on the device with the drafted "
                f"block; session {session_id!r} is released)"
            ) from None
        return block

    def _draft(self, state: SessionState, num_tokens: int, tree: TreeSpec | None) -> DraftBlock:
        if tree is not None:
            if not self.info.supports_tree:
                raise ProposerError(f"drafter family {self.info.family!r} does not propose trees")
            if tree.depth > self.info.max_block_size:  # a tree is at most max_block_size deep
                tree = TreeSpec(tree.num_nodes, tree.top_k, self.info.max_block_size)
            state.draft_tail = ()
            return self._draft_tree(state, tree)
        if num_tokens < 0:
            raise ProposerError(f"num_tokens must be >= 0, got {num_tokens}")
        num_tokens = min(num_tokens, self.info.max_block_size)  # a chain is at most max_block_size
        block = DraftBlock(token_ids=()) if num_tokens == 0 else self._draft_chain(state, num_tokens)
        state.draft_tail = block.token_ids
        return block

    def release(self, session_id: str) -> None:
        state = self._sessions.pop(session_id, None)
        if state is not None:
            self._release_state(state)

    def session(self, session_id: str) -> SessionState:
        state = self._sessions.get(session_id)
        if state is None:
            raise ProposerError(f"unknown session {session_id!r} (not started or already released)")
        return state

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    # ---------------------------------------------------------------- family hooks
    def _start_state(self, state: SessionState) -> None:
        """Set ``state.family_state``; may prefill the family's cache."""

    @abstractmethod
    def _draft_chain(self, state: SessionState, num_tokens: int) -> DraftBlock:
        """Draft ``num_tokens`` (>= 1) tokens after the last token of ``state.ids``."""

    def _draft_tree(self, state: SessionState, spec: TreeSpec) -> DraftBlock:
        raise ProposerError(f"drafter family {self.info.family!r} does not propose trees")

    def _release_state(self, state: SessionState) -> None:
        """Free the family's per-session resources (e.g. KV blocks)."""

    def _generator_device(self) -> str:
        return "cpu"

    # ---------------------------------------------------------------- bookkeeping
    def _sync(
        self,
        state: SessionState,
        prefix_len: int,
        append_ids: Sequence[int],
        append_hidden: torch.Tensor | None,
    ) -> None:
        """Validate everything first, then mutate: a refused sync leaves the session unchanged."""
        n_old, tail = len(state), state.draft_tail
        if not 0 <= prefix_len <= n_old + len(tail):
            raise ProposerError(
                f"prefix_len {prefix_len} out of range: session holds {n_old} tokens + {len(tail)} drafted"
            )
        new_len = prefix_len + len(append_ids)
        if new_len < 1:
            raise ProposerError("the sequence would be empty after the sync")
        self._check_ids(append_ids)
        new_rows, keep_end = None, 0
        if self.info.needs_hidden_states:
            m = 0 if append_hidden is None else int(append_hidden.shape[0])
            keep_end = new_len - 1 - m  # rows [hidden_start, keep_end) come from the old rows
            available = min(state.hidden_end, prefix_len)
            if keep_end < state.hidden_start or keep_end > available:
                raise ProposerError(
                    f"append_hidden has {m} rows for a sequence of {new_len} tokens: the rows before"
                    f" them would be positions [{state.hidden_start}, {keep_end}) but the session"
                    f" keeps [{state.hidden_start}, {available}) after truncating to prefix_len"
                    f" {prefix_len}"
                )
            if m:
                new_rows = self._check_hidden(append_hidden, m, "append_hidden", on_device=True)
        if prefix_len > n_old:  # the caller counts accepted drafted tokens into the prefix
            state.tokens.extend(tail[: prefix_len - n_old])
        else:
            state.tokens.truncate(prefix_len)
        state.tokens.extend(append_ids)
        state.draft_tail = ()
        if self.info.needs_hidden_states:
            state.rows.truncate(keep_end - state.hidden_start)
            if new_rows is not None:
                state.rows.append(new_rows)
                if new_rows.device.type != "cpu":  # checked on the device, read back with the block
                    check = torch.isfinite(new_rows).all()
                    state.rows_check = check if state.rows_check is None else state.rows_check & check

    def _check_ids(self, ids: Sequence[int]) -> None:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not len(arr):
            return
        vocab = self.info.vocab_size
        bad = np.flatnonzero((arr < 0) | (arr >= vocab)) if vocab else np.flatnonzero(arr < 0)
        if len(bad):
            t = int(arr[bad[0]])
            raise ProposerError(f"token id {t} outside the vocabulary [0, {vocab or 'inf'})")

    def _check_hidden(self, hidden: torch.Tensor | None, rows: int, what: str, on_device: bool = False) -> torch.Tensor:
        """Shape, width and (host rows, or `on_device` False) finiteness; with `on_device` the caller checks GPU rows'
        finiteness on the device (no host wait here)."""
        if hidden is None:
            raise ProposerError(f"{what}: this drafter needs target hidden states, got None")
        if hidden.dim() != 2 or hidden.shape[0] != rows:
            raise ProposerError(f"{what}: expected [{rows}, F] hidden rows, got {tuple(hidden.shape)}")
        width = self._hidden_width()
        if width is not None and hidden.shape[1] != width:
            raise ProposerError(
                f"{what}: expected feature width {width} ({len(self.info.hidden_layers)} layers x"
                f" hidden size), got {hidden.shape[1]}"
            )
        if not (on_device and hidden.device.type != "cpu") and not _all_finite(hidden):
            raise ProposerError(f"{what}: hidden rows contain NaN or inf")
        return hidden

    def _hidden_width(self) -> int | None:
        """Expected F of hidden rows, or None to skip the check."""
        return None

    def hidden_width(self) -> int | None:
        """The F of the hidden rows it reads (None: not stated); sizes the draft service's receive limit."""
        return self._hidden_width()
