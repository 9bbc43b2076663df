"""Prompt-lookup (n-gram) drafting: no model, copy what followed an earlier occurrence of the suffix.

Worked example (``min_n=1, max_n=3``, ``k=4``)::

    position  0  1  2  3  4  5  6  7  8
    S       = 5  7  9  2  4  8  7  9  2      (the last token, 2, is the pending token)

The suffix of S is ``... 7 9 2``. Scanning for earlier occurrences of the last token ``2`` finds
position 3; extending backwards, positions 1..3 read ``7 9 2`` = the 3-token suffix, so the match has
length 3 = max_n (longer matches are not looked for). The drafted tokens are what followed it:
positions 4, 5, 6, 7 -> ``4 8 7 9``.

If the continuation runs into the end of S (self-overlapping, periodic text), it keeps copying from its
own proposal: for ``S = 1 2 1 2 1 2`` and k=4 the match of ``2 1 2`` ends at position 3, and the
proposal ``1 2 1 2`` is read from positions 4, 5 and then from the proposal itself.

Search: one vectorised comparison of the pending token against the history, then at most ``max_n - 1``
narrowing steps over the surviving candidates (numpy, no Python loop over the history). Among the
longest matches (>= ``min_n``), the most recent one wins.
"""

from __future__ import annotations

import numpy as np

from specserve.contract.types import DraftBlock
from specserve.draft_service.checkpoint_checks import target_vocab
from specserve.draft_service.drafter_config import DrafterConfig, DrafterInfo
from specserve.draft_service.proposer import Proposer
from specserve.draft_service.session_state import SessionState


def find_ngram_continuation(
    ids: np.ndarray,  # [L] int64, the sequence S
    min_n: int,
    max_n: int,
    k: int,
) -> tuple[int, ...]:
    """Up to ``k`` tokens following the most recent longest earlier match (``min_n <= n <= max_n``)
    of the suffix of ``ids``; empty when no suffix of length >= ``min_n`` recurs."""
    L = len(ids)
    if L < 2 or k < 1 or min_n > L - 1:
        return ()
    last = ids[L - 1]
    ends = np.flatnonzero(ids[: L - 1] == last)  # candidate match end positions, [C]
    if len(ends) == 0:
        return ()
    match_len = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, min(max_n, L - 1)):  # extend matches backwards by one token per step
        idx = ends - j
        ok = alive & (idx >= 0)
        ok[ok] = ids[idx[ok]] == ids[L - 1 - j]
        match_len += ok
        alive = ok
        if not alive.any():
            break
    best = int(match_len.max())
    if best < min_n:
        return ()
    end = int(ends[np.flatnonzero(match_len == best)[-1]])  # most recent of the longest matches
    start = end + 1
    avail = min(k, L - start)
    out = ids[start : start + avail].tolist()
    period = L - start  # > 0; beyond the end of S the text repeats with this period
    while len(out) < k:
        out.append(out[len(out) - period])
    return tuple(int(t) for t in out)


class NgramProposer(Proposer):
    """Prompt-lookup decoding. No model, no probabilities (DraftBlock.probs is None = one-hot)."""

    def __init__(self, config: DrafterConfig, vocab_size: int = 0, vocab_hash: str = "") -> None:
        super().__init__(
            DrafterInfo(
                family="ngram",
                vocab_size=vocab_size,
                vocab_hash=vocab_hash,
                max_block_size=config.max_block_size,
                needs_hidden_states=False,
                hidden_layers=(),
                has_probs=False,
                supports_tree=False,
            )
        )
        self.min_n = config.ngram_min_n
        self.max_n = config.ngram_max_n

    def _draft_chain(self, state: SessionState, num_tokens: int) -> DraftBlock:
        return DraftBlock(token_ids=find_ngram_continuation(state.ids, self.min_n, self.max_n, num_tokens))


def build_ngram_proposer(config: DrafterConfig) -> NgramProposer:
    """Registry factory. With a target checkpoint, report (and enforce) its vocabulary."""
    if config.target_checkpoint is None:
        return NgramProposer(config)
    vocab = target_vocab(config.target_checkpoint)
    return NgramProposer(config, vocab_size=vocab.size, vocab_hash=vocab.hash)
