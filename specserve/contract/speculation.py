"""k, the drafted tokens one step verifies (a chain's length; ``num_speculative_tokens`` on the wire), in one place.

- ``DEFAULT_K``: the k of a request that names none (the gateway, ``generate``, ``bench``, ``GenerationRequest``);
- ``MAX_K``: the most a request may ask for (the gateway refuses more; the largest k adaptive speculation picks);
- ``DEFAULT_MAX_BLOCK_SIZE``: the most tokens a drafter drafts in one proposal (``--max-block-size``);
- on a draft service a request runs with its k (``k_on_draft``): one above the draft's max_block_size is
  refused, never drafted shorter; a request that names none gets DEFAULT_K, capped at the max_block_size;
- a drafter built in process for chains of k drafts blocks of ``block_size_for(k)`` = k + 1: draft-ahead asks
  for k + 1 tokens, the first its guess of the bonus token.
"""

from __future__ import annotations

DEFAULT_K = 4
MAX_K = 64
DEFAULT_MAX_BLOCK_SIZE = 8


class KTooLong(ValueError):
    """A request's k above what its draft drafts per proposal."""


def k_on_draft(asked: int, max_block_size: int | None) -> int:
    """The k a request that asked for ``asked`` (0: none) runs with on a draft that drafts at most
    ``max_block_size`` tokens per proposal (None: not known yet). Raises KTooLong when asked > max_block_size."""
    k = asked or DEFAULT_K
    if max_block_size is None:
        return k
    if asked > max_block_size:
        raise KTooLong(f"num_speculative_tokens: {asked} exceeds the draft's max_block_size of {max_block_size}")
    return min(k, max_block_size)


def block_size_for(k: int) -> int:
    """The max_block_size of a drafter built to draft chains of k (draft-ahead asks for one more)."""
    return max(k, 1) + 1
