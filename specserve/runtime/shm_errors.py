"""What a shared-memory channel (specserve/runtime/shm_ring.py) raises."""

from __future__ import annotations


class RingError(ConnectionError):
    """The channel cannot be used (closed, or a length that no peer of ours writes)."""


class PeerGone(RingError):
    """The peer process ended or closed its end of the channel."""


class MessageTooLarge(RingError):
    """A message over the reader's limit: refused by the writer before anything is written (the
    channel stays usable), or by the reader at its length prefix (the channel is dropped)."""


class RingTimeout(TimeoutError):
    """No message (or no room) within the timeout."""
