"""Pad rows of invariant steps do no work that counts (CPU: paged torch attention, the fixed-rows torch MoE; the GPU
side is test_gpu_pad_rows.py): a padded step's real rows are bit for bit the rows of a step that fills all its rows
with real tokens (negative control: without invariant steps the rows round differently), its pad rows write no
cache slot (negative control: pad rows that skip their work but keep the last token's slot overwrite it) and route
to no expert (the step touches only its real rows' experts)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from invariance_helpers import engine_for

from specserve.kernels.moe_reference import NO_EXPERT
from specserve.models.attn_metadata import AttentionBatch
from specserve.paths import demo_checkpoint
from specserve.target_service.engine.model_runner import distinct_experts, pad_step
from specserve.target_service.factory import CPU_ROWS

PROMPT = [5, 17, 101, 33, 64, 9, 150, 77, 3, 120, 41, 8, 199, 60, 21, 90, 14, 180, 2, 55]
CTX = len(PROMPT)
BLOCKS = tuple(range(8))  # one made-up sequence's block table (no session holds blocks): 128 positions at 16
DRAFT = [(7 * i + 11) % 200 for i in range(CPU_ROWS)]  # a step of CPU_ROWS real tokens after the prompt
DEMO = str(demo_checkpoint("target"))


def _setup(model: str, dtype: str, invariant: bool):
    engine = engine_for(model, dtype, invariant)
    runner = engine.runner
    _step(runner, PROMPT, 0)  # the prompt's K/V at slots 0..CTX-1
    return runner, engine.kv_cache


def _batch(runner, tokens: list[int], ctx: int) -> AttentionBatch:
    return AttentionBatch.contiguous([len(tokens)], [ctx], [BLOCKS], runner.block_size)


def _step(runner, tokens: list[int], ctx: int):
    return runner.run(tokens, list(range(ctx, ctx + len(tokens))), _batch(runner, tokens, ctx))


def _rows_differing(runner) -> list[int]:
    """Step sizes t whose rows differ from the first t rows of a step of CPU_ROWS real tokens."""
    full = _step(runner, DRAFT, CTX).logits.clone()
    return [t for t in (1, 2, 5, 16, 33) if not torch.equal(_step(runner, DRAFT[:t], CTX).logits, full[:t])]


def test_a_padded_steps_real_rows_are_those_of_a_step_without_pad_rows():
    runner, _ = _setup(DEMO, "float32", invariant=True)
    assert runner.invariant_rows == CPU_ROWS
    assert _rows_differing(runner) == []


def test_without_invariant_steps_the_rows_differ():
    """The negative control of the check above: unpadded steps at their own row count (float32 on the demo: torch's
    CPU GEMMs pick their kernel by row count)."""
    runner, _ = _setup(DEMO, "float32", invariant=False)
    assert runner.invariant_rows == 0
    assert _rows_differing(runner) != []


def _flat(layer: torch.Tensor) -> torch.Tensor:  # [num_blocks, block_size, ...] -> [slots, entry]
    return layer.reshape(layer.shape[0] * layer.shape[1], -1)


def _cache_after(runner, cache, batch: AttentionBatch, ids: list[int], pos: list[int]) -> list[torch.Tensor]:
    """Each layer's cache after one forward of the (padded) batch, the slots past the prompt poisoned first."""
    for layer in cache.layers:
        _flat(layer)[CTX:].fill_(1024.0)
    runner.model(torch.tensor(ids), torch.tensor(pos), batch, cache)
    return [_flat(layer).clone() for layer in cache.layers]


def _real_entries(runner, cache, t: int) -> list[torch.Tensor]:
    """Each layer's entries of the first t drafted tokens, written by a step of CPU_ROWS real tokens (no pad rows)."""
    runner.model(torch.tensor(DRAFT), torch.arange(CTX, CTX + CPU_ROWS), _batch(runner, DRAFT, CTX), cache)
    return [_flat(layer)[CTX : CTX + t].clone() for layer in cache.layers]


def _padded(runner, t: int):
    tokens, positions = DRAFT[:t], list(range(CTX, CTX + t))
    return pad_step(tokens, positions, _batch(runner, tokens, CTX), CPU_ROWS)


@pytest.mark.parametrize(
    "model,dtype",
    [(DEMO, "float32"), ("synthetic:tiny-kimi-k2-int4", "bfloat16")],
    ids=["demo-fp32", "tiny-kimi-int4-bf16"],
)
def test_pad_rows_write_no_cache_slot_and_route_to_no_expert(model, dtype):
    runner, cache = _setup(model, dtype, invariant=True)
    t = 5
    written = _real_entries(runner, cache, t)
    full = runner.model(torch.tensor(DRAFT), torch.arange(CTX, CTX + CPU_ROWS), _batch(runner, DRAFT, CTX), cache)
    ids, pos, padded = _padded(runner, t)
    assert padded.slot_mapping[t:].tolist() == [-1] * (CPU_ROWS - t) and padded.live_rows.tolist() == [t]
    after = _cache_after(runner, cache, padded, ids, pos)
    for layer, real in zip(after, written):
        assert torch.equal(layer[CTX : CTX + t], real)  # the real rows' entries
        assert bool((layer[CTX + t :] == 1024.0).all())  # nothing else written

    out = runner.model(torch.tensor(ids), torch.tensor(pos), padded, cache)
    routed = out.routed_experts  # [MoE layers, CPU_ROWS, top_k]
    assert bool((routed[:, t:] == NO_EXPERT).all())  # pad rows: no expert
    assert torch.equal(routed[:, :t], full.routed_experts[:, :t])
    experts = runner.num_experts
    assert distinct_experts(routed, experts, routed.device) == distinct_experts(routed[:, :t], experts, routed.device)


def test_pad_rows_that_skip_their_work_must_not_keep_the_last_slot():
    """The negative control of the cache check: pad rows that skip their experts but keep the last token's slot (the
    padding before, with the skipping now) overwrite that token's entries with their own from the layer after the
    first MoE layer on (the demo: MoE from layer 1 of 5)."""
    runner, cache = _setup(DEMO, "float32", invariant=True)
    t = 5
    written = _real_entries(runner, cache, t)
    ids, pos, padded = _padded(runner, t)
    last = padded.slot_mapping[t - 1]
    broken = dataclasses.replace(padded, slot_mapping=torch.cat([padded.slot_mapping[:t], last.expand(CPU_ROWS - t)]))
    after = _cache_after(runner, cache, broken, ids, pos)
    assert any(not torch.equal(layer[CTX : CTX + t], real) for layer, real in zip(after, written))
