"""The proposer interface every drafter family implements, plus the per-session bookkeeping they share.

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

A session's hidden rows live in a row buffer on their device (``_RowBuffer``): appending copies the new rows into
its tail (one copy, no allocation while there is room), dropping old rows moves its start (no copy). Rows are checked
for NaN / inf: host rows before anything changes; rows on a GPU on the device, with no host wait mid-propose, their
result read back with the drafted block (``SessionState.take_rows_check``; at the end of the propose if the family
did not read it): rows that fail end the session (its caches were built from them) with a ProposerError.

Families implement four hooks: ``_start_state``, ``_draft_chain``, ``_draft_tree`` (when they support
trees) and ``_release_state``. Nothing here branches on family names (see ``registry.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from specserve.contract.speculation import DEFAULT_MAX_BLOCK_SIZE
from specserve.contract.types import DraftBlock, SamplingParams, TreeSpec
from specserve.errors import SpecserveError
from specserve.models.dtypes import DTYPES


class ProposerError(SpecserveError):
    """Bad input to a proposer (unknown session, out-of-range prefix, wrong hidden rows, ...)."""


class DrafterConfigError(ProposerError):
    """A drafter cannot be built from its config or checkpoint (missing file, malformed head, ...)."""


class VocabMismatchError(DrafterConfigError):
    """The drafter's vocabulary differs from the target's."""


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise DrafterConfigError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass(frozen=True)
class DrafterInfo:
    """What a drafter is, for the gateway's compatibility check and the DraftInfo RPC."""

    family: str
    vocab_size: int  # 0 = vocabulary-agnostic (ngram without a target checkpoint)
    vocab_hash: str  # "" = vocabulary-agnostic; else must equal TargetEngine.info().vocab_hash
    max_block_size: int
    needs_hidden_states: bool
    hidden_layers: tuple[int, ...]  # target layers whose hidden states it consumes (prefill/verify arg)
    has_probs: bool  # DraftBlock.probs is filled for sampled requests (greedy: always None = one-hot)
    supports_tree: bool

    def __post_init__(self) -> None:
        if self.max_block_size < 1:
            raise ValueError(f"max_block_size must be >= 1, got {self.max_block_size}")
        if self.needs_hidden_states and not self.hidden_layers:
            raise ValueError("a drafter that needs hidden states must name its hidden_layers")


@dataclass(frozen=True)
class DrafterConfig:
    """How to build one drafter. ``family`` picks the factory in ``registry.py``."""

    family: str
    checkpoint: Path | None = None  # the drafter's own checkpoint dir (model / eagle3 / dflash)
    # the target: its checkpoint dir (vocab check, eagle3 embeddings, layers) or a model name; a demo@ name
    # (models/model_names.py) has eagle3 / model / dflash / mtp build the demo-size checkpoint scaled to it
    target_checkpoint: Path | None = None
    device: str = "cpu"
    dtype: torch.dtype | str = torch.float32
    max_block_size: int = DEFAULT_MAX_BLOCK_SIZE  # the most tokens one proposal drafts (contract/speculation.py)
    # ngram options
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    # model drafter: paged KV cache size
    kv_block_size: int = 16
    kv_num_blocks: int = 512
    # eagle3 / dflash: override the target layers to read (default: the checkpoint's or the family's)
    hidden_layers: tuple[int, ...] | None = None
    # dflash: passes per drafted block (default: the checkpoint's denoise_steps)
    denoise_steps: int | None = None
    # on CUDA, drafts as CUDA graphs over a window of this many positions (0 = eager only): eagle3 chains
    # (eagle3_graph.py), model chains (model_graph.py), dflash blocks (dflash_graph.py); longer contexts draft eagerly
    graph_window: int = 2048

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not self.family:
            raise DrafterConfigError(f"family must be a non-empty string, got {self.family!r}")
        for name in ("checkpoint", "target_checkpoint"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.max_block_size < 1:
            raise DrafterConfigError(f"max_block_size must be >= 1, got {self.max_block_size}")
        if self.graph_window < 0:
            raise DrafterConfigError(f"graph_window must be >= 0, got {self.graph_window}")
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise DrafterConfigError(
                f"need 1 <= ngram_min_n <= ngram_max_n, got {self.ngram_min_n}, {self.ngram_max_n}"
            )
        if self.kv_block_size < 1 or self.kv_num_blocks < 1:
            raise DrafterConfigError("kv_block_size and kv_num_blocks must be >= 1")
        if self.denoise_steps is not None and self.denoise_steps < 1:
            raise DrafterConfigError(f"denoise_steps must be >= 1, got {self.denoise_steps}")
        if self.hidden_layers is not None:
            object.__setattr__(self, "hidden_layers", tuple(int(i) for i in self.hidden_layers))
            if not self.hidden_layers:
                raise DrafterConfigError("hidden_layers, when given, must name at least one layer")


class _TokenBuffer:
    """Growable int64 array (amortised O(1) append, O(1) truncate, zero-copy numpy view)."""

    def __init__(self, ids: Sequence[int]) -> None:
        self._buf = np.zeros(max(16, 2 * len(ids)), dtype=np.int64)
        self._len = 0
        self.extend(ids)

    def extend(self, ids: Sequence[int]) -> None:
        n = len(ids)
        if self._len + n > len(self._buf):
            grown = np.zeros(max(2 * len(self._buf), self._len + n), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : self._len + n] = np.asarray(ids, dtype=np.int64).reshape(-1)
        self._len += n

    def truncate(self, n: int) -> None:
        self._len = min(self._len, n)

    @property
    def array(self) -> np.ndarray:  # [len] view, do not keep across mutations
        return self._buf[: self._len]

    def __len__(self) -> int:
        return self._len


ROW_SPARE = 32  # rows of room a session's row buffer keeps past twice its live rows when it moves them


class _RowBuffer:
    """A session's hidden rows [start, start + len) of one buffer on their device: append copies into the tail (a
    buffer the caller gave, or one that is full, is first replaced by a new one holding the live rows: the caller's
    tensor is never written), drop_front moves the start (a buffer left 3/4 empty is replaced by a small one, so a
    prompt's rows are not held for the session's life). Views handed out stay valid: rows are never moved in place."""

    def __init__(self, rows: torch.Tensor) -> None:  # [n, F], the caller's: not copied, never written
        self._buf, self._start, self._len, self._owned = rows, 0, rows.shape[0], False

    def __len__(self) -> int:
        return self._len

    @property
    def rows(self) -> torch.Tensor:  # [len, F] view
        return self._buf[self._start : self._start + self._len]

    def truncate(self, n: int) -> None:
        self._len = min(self._len, n)

    @torch.inference_mode()  # its buffer may be one made in inference mode (a family's drop_front)
    def append(self, rows: torch.Tensor) -> None:  # [m, F]
        m = rows.shape[0]
        if not self._owned or self._start + self._len + m > self._buf.shape[0]:
            self._move(2 * (self._len + m) + ROW_SPARE)
        self._buf[self._start + self._len : self._start + self._len + m].copy_(rows)
        self._len += m

    def drop_front(self, n: int) -> None:
        n = min(n, self._len)
        self._start, self._len = self._start + n, self._len - n
        if self._buf.shape[0] > 4 * (self._len + ROW_SPARE):
            self._move(2 * self._len + ROW_SPARE)

    @torch.inference_mode()
    def _move(self, capacity: int) -> None:
        buf = self._buf.new_empty((capacity, self._buf.shape[1]))
        buf[: self._len].copy_(self.rows)
        self._buf, self._start, self._owned = buf, 0, True


@dataclass
class SessionState:
    """One session's copy of S, its hidden rows, sampling, RNG and the family's own state."""

    tokens: _TokenBuffer  # S (confirmed by the target)
    sampling: SamplingParams
    generator: torch.Generator
    rows: _RowBuffer | None = None  # rows of positions [hidden_start, hidden_end)
    hidden_start: int = 0  # first position whose row is still kept (families may drop older rows)
    draft_tail: tuple[int, ...] = ()  # last drafted chain: speculative continuation of S
    family_state: Any = None
    proposals: int = field(default=0)
    rows_check: torch.Tensor | None = None  # 0-dim bool on the device: appended GPU rows all finite (not read yet)

    def take_rows_check(self) -> torch.Tensor | None:  # 0-dim bool on the device, or None
        """The pending finiteness check of rows appended on a GPU, for the family to read back with its drafted block
        (then it raises RowsNotFinite when it reads False); None when there is none."""
        check, self.rows_check = self.rows_check, None
        return check

    @property
    def ids(self) -> np.ndarray:  # [len(S)]
        return self.tokens.array

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def hidden(self) -> torch.Tensor | None:  # [hidden_end - hidden_start, F] view
        return None if self.rows is None else self.rows.rows

    @property
    def hidden_end(self) -> int:
        return self.hidden_start + (0 if self.rows is None else len(self.rows))

    def hidden_rows(self, start: int, end: int) -> torch.Tensor:  # [end - start, F] view (valid for this propose)
        if self.rows is None or start < self.hidden_start or end > self.hidden_end:
            raise ProposerError(
                f"hidden rows [{start}, {end}) requested; session keeps [{self.hidden_start}, "
                f"{self.hidden_end})"
            )
        return self.rows.rows[start - self.hidden_start : end - self.hidden_start]

    def drop_hidden_before(self, pos: int) -> None:
        """Free rows of positions < pos (a family calls this once they live in its own cache)."""
        if self.rows is None or pos <= self.hidden_start:
            return
        pos = min(pos, self.hidden_end)
        self.rows.drop_front(pos - self.hidden_start)
        self.hidden_start = pos


class RowsNotFinite(ProposerError):
    """A family read back a False rows check (SessionState.take_rows_check): Proposer.propose ends the session."""


def checkpoint_vocab(checkpoint_dir: Path) -> tuple[int, str]:
    """(vocab_size from config.json, vocab_hash) of a checkpoint dir; errors become DrafterConfigError."""
    from specserve.models.vocab import config_vocab_size, vocab_hash

    try:
        return config_vocab_size(checkpoint_dir), vocab_hash(checkpoint_dir)
    except (ValueError, RuntimeError) as e:
        raise DrafterConfigError(f"cannot read the vocabulary of {checkpoint_dir}: {e}") from e


def target_name(target: Path):
    """The target's ModelName (models/model_names.py: a checkpoint folder or a demo@ / synthetic name); a bad one is a
    DrafterConfigError."""
    from specserve.models.model_names import resolve_model

    try:
        return resolve_model(target)
    except (ValueError, RuntimeError) as e:
        raise DrafterConfigError(f"target {target}: {e}") from e


def target_vocab(target: Path):
    """The target's Vocabulary (models/model_names.py: a checkpoint folder or a demo@ / synthetic name); errors
    become DrafterConfigError."""
    try:
        return target_name(target).vocabulary()
    except (ValueError, RuntimeError) as e:
        raise DrafterConfigError(f"cannot read the vocabulary of the target {target}: {e}") from e


def target_config(target: Path):
    """The target's ModelConfig (a checkpoint folder or a demo@ / synthetic name); errors become DrafterConfigError."""
    try:
        return target_name(target).config()
    except (ValueError, RuntimeError) as e:
        raise DrafterConfigError(f"cannot read the config of the target {target}: {e}") from e


def check_same_vocab(draft_dir: Path, target: Path) -> tuple[int, str]:
    """Refuse a drafter whose vocabulary differs from the target's; returns the target's (size, hash). Without two
    tokenizer fingerprints the drafter's size must be the number of ids the target can emit (a demo@ target: the
    demo's, its padded rows masked)."""
    from specserve.models.vocab import vocab_matches

    d_size, d_hash = checkpoint_vocab(draft_dir)
    t = target_vocab(target)
    if not vocab_matches(d_hash, d_size, t.hash, t.limit):
        raise VocabMismatchError(
            f"drafter vocabulary ({d_hash}, vocab_size {d_size}) at {draft_dir} does not match the"
            f" target's ({t.hash}, vocab_size {t.limit}) at {target}"
        )
    return t.size, t.hash


def draft_seed(request_seed: int | None) -> int:
    """The drafter's RNG seed. A seeded request stays reproducible, but the drafter must NOT share the
    target's random stream (equal streams would correlate a drafted token's draw with its own acceptance
    test); the target draws from an HMAC of the seed under its own key (models/probs.py), and a remote
    draft is sent a seed the gateway derived, never the request's."""
    if request_seed is None:
        return int(torch.seed() % 2**63)
    return (int(request_seed) * 6364136223846793005 + 1442695040888963407) % 2**63


# Families drop hidden rows once they live in their own caches, but keep the rows of this many
# positions before the pending token, so a caller may still roll S back by that many tokens.
ROLLBACK_ROWS = 4


def _all_finite(rows: torch.Tensor) -> bool:
    """Whether every value is finite: host rows through numpy (no device involved), others on their device (the
    host waits for it)."""
    if rows.device.type == "cpu" and rows.dtype in (torch.float32, torch.float64, torch.float16):
        return bool(np.isfinite(rows.numpy()).all())
    return bool(torch.isfinite(rows).all())


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class Proposer(ABC):
    """A drafter. Synchronous; driven from one draft thread (no locking inside)."""

    info: DrafterInfo
    device: torch.device = torch.device("cpu")  # where it computes (a family on a GPU sets its own); its thread's stream

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
        state = SessionState(tokens=_TokenBuffer(token_ids), sampling=sampling, generator=gen)
        if self.info.needs_hidden_states:
            state.rows = _RowBuffer(self._check_hidden(hidden, len(token_ids) - 1, "start hidden"))
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
            raise ProposerError("append_hidden: hidden rows contain NaN or inf (checked on the device with the drafted "
                                f"block; session {session_id!r} is released)") from None
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
                f"prefix_len {prefix_len} out of range: session holds {n_old} tokens"
                f" + {len(tail)} drafted"
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
