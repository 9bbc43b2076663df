"""Block manager: allocation, growth, truncation, freeing, slots, exhaustion (no torch)."""

from __future__ import annotations

import random

import pytest

from specserve.models.block_manager import (
    BlockManager,
    DuplicateSequence,
    OutOfBlocks,
    UnknownSequence,
)


def _check_invariants(bm: BlockManager) -> None:
    owned = [b for s in bm._seqs.values() for b in s.blocks]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert not set(owned) & set(bm._free), "a block is both owned and free"
    assert sorted(owned + bm._free) == list(range(bm.num_blocks))
    all_slots = []
    for sid, s in bm._seqs.items():
        assert len(s.blocks) == bm.blocks_for(s.num_tokens)
        all_slots += bm.slots(sid, 0, s.num_tokens)
    assert len(all_slots) == len(set(all_slots)), "two tokens share a slot"
    u = bm.usage()
    assert u.free_blocks + u.used_blocks == bm.num_blocks
    assert u.used_blocks == len(owned)
    assert u.num_sequences == len(bm._seqs)


def test_grow_truncate_free_and_slots():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.add("a") == ()
    table = bm.grow("a", 5)
    assert len(table) == 2 and bm.num_tokens("a") == 5
    assert bm.slot("a", 0) == table[0] * 4
    assert bm.slot("a", 4) == table[1] * 4
    assert bm.slots("a", 2, 5) == [table[0] * 4 + 2, table[0] * 4 + 3, table[1] * 4]
    assert bm.usage().used_blocks == 2 and bm.usage().used_tokens == 5
    bm.grow("a", 8)
    assert len(bm.block_table("a")) == 2
    bm.grow("a", 9)
    assert len(bm.block_table("a")) == 3
    bm.truncate("a", 4)
    assert bm.block_table("a") == table[:1]
    assert bm.usage().free_blocks == 7
    bm.truncate("a", 0)
    assert bm.block_table("a") == () and bm.usage().free_blocks == 8
    bm.free("a")
    assert "a" not in bm and bm.usage().num_sequences == 0
    _check_invariants(bm)


def test_out_of_blocks_is_clear_and_atomic():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.add("a", 4)
    bm.add("b", 1)
    before = (bm.block_table("a"), bm.block_table("b"), bm.usage())
    with pytest.raises(OutOfBlocks, match="needs 1 more, 0 free"):
        bm.grow("b", 3)
    with pytest.raises(OutOfBlocks):
        bm.add("c", 1)
    assert "c" not in bm
    assert (bm.block_table("a"), bm.block_table("b"), bm.usage()) == before
    assert not bm.can_grow("b", 3) and bm.can_grow("b", 2)
    bm.free("a")
    bm.grow("b", 6)
    assert len(bm.block_table("b")) == 3
    _check_invariants(bm)


def test_bad_calls_raise_named_errors():
    bm = BlockManager(num_blocks=4, block_size=2)
    with pytest.raises(UnknownSequence, match="'x'"):
        bm.grow("x", 1)
    with pytest.raises(UnknownSequence):
        bm.free("x")
    bm.add("a", 3)
    with pytest.raises(DuplicateSequence):
        bm.add("a")
    with pytest.raises(ValueError):
        bm.grow("a", 2)
    with pytest.raises(ValueError):
        bm.truncate("a", 4)
    with pytest.raises(IndexError):
        bm.slot("a", 3)
    with pytest.raises(IndexError):
        bm.slots("a", 1, 4)
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_random_operations_keep_invariants():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=32, block_size=3)
    live: set[int] = set()
    out_of_blocks = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.15 or not live:
            sid = step
            try:
                bm.add(sid, rng.randint(0, 10))
                live.add(sid)
            except OutOfBlocks:
                out_of_blocks += 1
        else:
            sid = rng.choice(sorted(live))
            n = bm.num_tokens(sid)
            if op < 0.55:
                try:
                    bm.grow(sid, n + rng.randint(0, 12))
                except OutOfBlocks:
                    out_of_blocks += 1
            elif op < 0.9:
                bm.truncate(sid, rng.randint(0, n))
            else:
                bm.free(sid)
                live.discard(sid)
        if step % 50 == 0:
            _check_invariants(bm)
    _check_invariants(bm)
    assert out_of_blocks > 0  # the pool was exhausted at least once and survived it


def test_block_manager_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, specserve.models.block_manager; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
