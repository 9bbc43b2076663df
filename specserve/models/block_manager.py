"""Paged KV-cache bookkeeping: fixed-size blocks, one block table per sequence (pure Python, no torch).

A sequence of ``n`` tokens owns ``ceil(n / block_size)`` blocks. Token position ``i`` of a sequence lives
in slot ``table[i // block_size] * block_size + i % block_size`` of the cache. Growing a sequence
allocates blocks from a free list; truncating frees its trailing blocks; freeing returns them all.
Every operation either fully succeeds or leaves the state unchanged (no partial allocation).
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.errors import SpecserveError


class BlockManagerError(SpecserveError):
    """Base class of block-manager errors."""


class OutOfBlocks(BlockManagerError):
    """Not enough free KV-cache blocks for the requested growth."""

    def __init__(self, seq_id: object, needed: int, free: int) -> None:
        super().__init__(f"KV cache out of blocks: sequence {seq_id!r} needs {needed} more, {free} free")
        self.seq_id = seq_id
        self.needed = needed
        self.free = free


class UnknownSequence(BlockManagerError, LookupError):
    def __init__(self, seq_id: object) -> None:
        super().__init__(f"unknown sequence {seq_id!r}")
        self.seq_id = seq_id


class DuplicateSequence(BlockManagerError, ValueError):
    def __init__(self, seq_id: object) -> None:
        super().__init__(f"sequence {seq_id!r} already has a block table")
        self.seq_id = seq_id


@dataclass(frozen=True)
class KVUsage:
    num_blocks: int
    block_size: int
    free_blocks: int
    used_blocks: int
    num_sequences: int
    used_tokens: int  # sum over sequences of their current length

    @property
    def total_blocks(self) -> int:
        return self.num_blocks

    @property
    def utilization(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0


class _Sequence:
    __slots__ = ("blocks", "num_tokens")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.num_tokens = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO free list: recently freed blocks are reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._seqs: dict[object, _Sequence] = {}

    # ---- queries -------------------------------------------------------------------------------
    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def _get(self, seq_id: object) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(seq_id) from None

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens occupies."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_tokens(self, seq_id: object) -> int:
        return self._get(seq_id).num_tokens

    def block_table(self, seq_id: object) -> tuple[int, ...]:
        return tuple(self._get(seq_id).blocks)

    def can_grow(self, seq_id: object, num_tokens: int) -> bool:
        seq = self._get(seq_id)
        return self.blocks_for(num_tokens) - len(seq.blocks) <= len(self._free)

    def slot(self, seq_id: object, position: int) -> int:
        """Cache slot of token ``position`` (0-based) of the sequence."""
        seq = self._get(seq_id)
        if not 0 <= position < seq.num_tokens:
            raise IndexError(f"position {position} outside sequence {seq_id!r} of {seq.num_tokens} tokens")
        return seq.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, seq_id: object, start: int, end: int) -> list[int]:
        """Cache slots of token positions ``start .. end-1``."""
        seq = self._get(seq_id)
        if not 0 <= start <= end <= seq.num_tokens:
            raise IndexError(f"range [{start}, {end}) outside sequence {seq_id!r} of {seq.num_tokens} tokens")
        bs = self.block_size
        blocks = seq.blocks
        return [blocks[i // bs] * bs + i % bs for i in range(start, end)]

    def usage(self) -> KVUsage:
        used = self.num_blocks - len(self._free)
        return KVUsage(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            free_blocks=len(self._free),
            used_blocks=used,
            num_sequences=len(self._seqs),
            used_tokens=sum(s.num_tokens for s in self._seqs.values()),
        )

    # ---- mutations -----------------------------------------------------------------------------
    def add(self, seq_id: object, num_tokens: int = 0) -> tuple[int, ...]:
        """Create a sequence holding ``num_tokens`` tokens; returns its block table."""
        if seq_id in self._seqs:
            raise DuplicateSequence(seq_id)
        needed = self.blocks_for(num_tokens)
        if needed > len(self._free):
            raise OutOfBlocks(seq_id, needed, len(self._free))
        seq = _Sequence()
        self._seqs[seq_id] = seq
        self._take(seq, needed)
        seq.num_tokens = num_tokens
        return tuple(seq.blocks)

    def grow(self, seq_id: object, num_tokens: int) -> tuple[int, ...]:
        """Make the sequence ``num_tokens`` long (>= its current length); returns its block table."""
        seq = self._get(seq_id)
        if num_tokens < seq.num_tokens:
            raise ValueError(f"grow to {num_tokens} < current length {seq.num_tokens} of {seq_id!r}")
        needed = self.blocks_for(num_tokens) - len(seq.blocks)
        if needed > len(self._free):
            raise OutOfBlocks(seq_id, needed, len(self._free))
        self._take(seq, needed)
        seq.num_tokens = num_tokens
        return tuple(seq.blocks)

    def truncate(self, seq_id: object, num_tokens: int) -> tuple[int, ...]:
        """Shorten the sequence to ``num_tokens`` (<= its length), freeing trailing blocks."""
        seq = self._get(seq_id)
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"truncate to {num_tokens} outside [0, {seq.num_tokens}] for {seq_id!r}")
        keep = self.blocks_for(num_tokens)
        while len(seq.blocks) > keep:
            self._free.append(seq.blocks.pop())
        seq.num_tokens = num_tokens
        return tuple(seq.blocks)

    def free(self, seq_id: object) -> None:
        """Drop the sequence and return all its blocks."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        while seq.blocks:
            self._free.append(seq.blocks.pop())

    def _take(self, seq: _Sequence, n: int) -> None:
        for _ in range(n):
            seq.blocks.append(self._free.pop())
