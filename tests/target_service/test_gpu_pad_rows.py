"""Pad rows of invariant steps on the GPU (skipped without CUDA): through the one padded CUDA graph, the live row count
is device data refilled each step, so a step of t tokens replays the graph captured at 17 rows with 17 - t pad rows
that write no cache slot and touch no expert, and its rows are bit for bit the first t rows of a step of 17 real
tokens. The CPU side: test_pad_rows.py; the kernels: tests/kernels/test_no_expert.py."""

from __future__ import annotations

import pytest
import torch
from invariance_helpers import engine_for

from specserve.models.attn_metadata import AttentionBatch
from specserve.paths import demo_checkpoint
from specserve.target_service.engine.model_runner import distinct_experts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODELS = ["demo", "synthetic:tiny-qwen3-moe", "synthetic:tiny-kimi-k2-int4", "synthetic:mini-qwen3-moe"]
ROWS = 17
PROMPT = [5, 17, 101, 33, 64, 9, 150, 77, 3, 120]  # within ROWS: the prompt runs through the padded graph too
CTX = len(PROMPT)
BLOCKS = tuple(range(4))  # a made-up sequence's block table (no session holds blocks): 64 positions at 16
DRAFT = [(7 * i + 11) % 200 for i in range(ROWS)]
POISON = 1024.0  # exact in bf16


def _step(runner, tokens: list[int], ctx: int):
    attn = AttentionBatch.contiguous([len(tokens)], [ctx], [BLOCKS], runner.block_size)
    return runner.run(tokens, list(range(ctx, ctx + len(tokens))), attn)


def _flat(layer: torch.Tensor) -> torch.Tensor:  # [num_blocks, block_size, ...] -> [slots, entry]
    return layer.reshape(layer.shape[0] * layer.shape[1], -1)


@pytest.mark.parametrize("spec", MODELS)
def test_one_graph_skips_each_steps_pad_rows(spec):
    engine = engine_for(str(demo_checkpoint("target")) if spec == "demo" else spec, "bfloat16", True, "cuda")
    runner, cache = engine.runner, engine.kv_cache
    assert runner.invariant_rows == ROWS and runner.graph_for((1,)) is not None, runner.capture_errors
    _step(runner, PROMPT, 0)
    full = _step(runner, DRAFT, CTX)  # ROWS real tokens: no pad row
    logits, entries = full.logits.clone(), [_flat(layer)[CTX : CTX + ROWS].clone() for layer in cache.layers]
    before = runner.graph_steps
    for t in (1, 4, 9, 16):
        for layer in cache.layers:
            _flat(layer)[CTX:].fill_(POISON)
        run = _step(runner, DRAFT[:t], CTX)
        assert torch.equal(run.logits, logits[:t]), f"t = {t}"
        for layer, real in zip(cache.layers, entries):
            assert torch.equal(_flat(layer)[CTX : CTX + t], real[:t]), f"t = {t}"
            assert bool((_flat(layer)[CTX + t :] == POISON).all()), f"t = {t}: a pad row wrote the cache"
        routed = run.out.routed_experts  # the real rows' [MoE layers, t, top_k]
        # the graph counted the experts of all ROWS rows: the pad rows added none
        assert int(run.summary[2]) == int(distinct_experts(routed, runner.num_experts, routed.device)), f"t = {t}"
    assert runner.graph_steps == before + 4 and runner.eager_steps == 0
