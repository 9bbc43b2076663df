"""PagedKVCache, AttentionBatch validation, and the tensor-parallel weight loaders."""

from __future__ import annotations

import pytest
import torch

from specserve.models.attn_metadata import (
    AttentionBatch,
    AttentionBatchError,
    logical_to_slots,
)
from specserve.models.causal_lm import ModelInputError
from specserve.models.config import MoEConfig, ParallelConfig
from specserve.models.kv_cache import KVCacheError, PagedKVCache
from specserve.models.layers import ColumnParallelLinear, RowParallelLinear
from specserve.models.loader import load_model
from specserve.models.moe import StackedExperts


def test_write_gather_skip_and_copy():
    cache = PagedKVCache(2, num_blocks=6, block_size=4, entry_shape=(2, 3), dtype=torch.float32, device="cpu")
    table = [4, 1, 3]
    entries = torch.randn(10, 2, 3)
    slots = torch.tensor(logical_to_slots(table, 4, 0, 10))
    slots_with_skip = slots.clone()
    slots_with_skip[7] = -1
    cache.write(1, slots_with_skip, entries)
    got = cache.gather(1, table, 10)
    assert torch.equal(got[:7], entries[:7]) and torch.equal(got[8:], entries[8:])
    assert torch.equal(got[7], torch.zeros(2, 3))  # skipped
    assert torch.equal(cache.gather(0, table, 10), torch.zeros(10, 2, 3))  # other layer untouched
    # swap two slots in every layer (reads happen before writes)
    cache.copy_slots(slots[[0, 1]], slots[[1, 0]])
    got = cache.gather(1, table, 2)
    assert torch.equal(got[0], entries[1]) and torch.equal(got[1], entries[0])


def test_cache_rejects_bad_arguments():
    cache = PagedKVCache(1, 2, 4, (3,), torch.float32, "cpu")
    with pytest.raises(KVCacheError, match="entries shape"):
        cache.write(0, torch.tensor([0]), torch.zeros(1, 4))
    with pytest.raises(KVCacheError, match="slot out of range"):
        cache.write(0, torch.tensor([8]), torch.zeros(1, 3))
    with pytest.raises(KVCacheError, match="layer 1"):
        cache.write(1, torch.tensor([0]), torch.zeros(1, 3))
    with pytest.raises(AttentionBatchError, match="need 2"):
        cache.gather(0, [0], 5)
    assert cache.num_blocks == 2 and cache.block_size == 4


def test_attention_batch_validation():
    ok = AttentionBatch.contiguous([2, 1], [3, 0], [[0, 1], [2]], 4)
    assert ok.slot_mapping.tolist() == [3, 4, 8] and ok.token_ranges() == [(0, 2), (2, 3)]
    with pytest.raises(AttentionBatchError, match="slot_mapping has 2 entries for 3"):
        AttentionBatch((2, 1), (0, 0), ((0,), (1,)), torch.tensor([0, 1]), (None, None))
    with pytest.raises(AttentionBatchError, match=r"tree_masks\[0\] must be bool \[2, 2\]"):
        AttentionBatch((2,), (0,), ((0,),), torch.tensor([0, 1]), (torch.ones(3, 3, dtype=torch.bool),))
    with pytest.raises(AttentionBatchError, match="context_lens has 1 entries for 2"):
        AttentionBatch((1, 1), (0,), ((0,), (1,)), torch.tensor([0, 4]), (None, None))


def test_forward_rejects_mismatched_inputs(tiny_checkpoint):
    model, config = load_model(tiny_checkpoint("qwen3"), progress=False)
    cache = PagedKVCache(config.num_layers, 4, 4, model.kv_entry_shape(), torch.float32, "cpu")
    attn = AttentionBatch.contiguous([3], [0], [[0]], 4)
    with pytest.raises(ModelInputError, match=r"must both be \[3\]"):
        model(torch.tensor([1, 2]), torch.tensor([0, 1]), attn, cache)
    with pytest.raises(ModelInputError, match="capture_layers"):
        model(torch.tensor([1, 2, 3]), torch.arange(3), attn, cache, capture_layers=(5,))
    bad_cache = PagedKVCache(config.num_layers, 4, 4, (7,), torch.float32, "cpu")
    with pytest.raises(ModelInputError, match="entry"):
        model(torch.tensor([1, 2, 3]), torch.arange(3), attn, bad_cache)


def test_parallel_weight_loaders_take_their_rank_slice():
    w = torch.arange(24.0).view(4, 6)
    col = ColumnParallelLinear(6, 4, ParallelConfig(tp_rank=1, tp_size=2))
    col.weight.weight_loader(col.weight, w)
    assert torch.equal(col.weight, w[2:])
    row = RowParallelLinear(6, 4, ParallelConfig(tp_rank=1, tp_size=2))
    row.weight.weight_loader(row.weight, w)
    assert torch.equal(row.weight, w[:, 3:])

    cfg = MoEConfig(num_experts=4, top_k=2, intermediate_size=4, layers=(0,))
    gate, up, down = torch.randn(4, 3), torch.randn(4, 3), torch.randn(3, 4)
    tp = StackedExperts(cfg, 3, ParallelConfig(tp_rank=1, tp_size=2))
    tp.w13.weight_loader(tp.w13, gate, expert=2, shard_id="gate")
    tp.w13.weight_loader(tp.w13, up, expert=2, shard_id="up")
    tp.w2.weight_loader(tp.w2, down, expert=2, shard_id="down")
    assert torch.equal(tp.w13[2], torch.cat([gate[2:], up[2:]])) and torch.equal(tp.w2[2], down[:, 2:])
    ep = StackedExperts(cfg, 3, ParallelConfig(tp_rank=1, tp_size=2, ep=True))
    assert list(ep.local_experts()) == [2, 3]
    ep.w2.weight_loader(ep.w2, down, expert=0, shard_id="down")  # not ours: skipped
    ep.w2.weight_loader(ep.w2, down, expert=3, shard_id="down")
    assert torch.equal(ep.w2[1], down)
