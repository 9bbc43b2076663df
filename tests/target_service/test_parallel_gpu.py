"""Parallel target on GPUs (NCCL; skipped without CUDA): world size 1 on one GPU matches the CPU engine,
and TP / EP over two GPUs matches it too (skipped with fewer than two GPUs). float32 throughout."""

from __future__ import annotations

import os

import pytest
import torch

from specserve.contract.types import DraftBlock
from specserve.models.loader import load_model
from specserve.target_service.engine.engine import TargetEngine
from specserve.target_service.parallel import MULTICAST_OFF
from specserve.target_service.parallel.engine import ParallelTargetEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

PROMPT = [3, 17, 99, 5, 42, 7, 8, 250, 1, 64, 9]
TREE = DraftBlock(token_ids=(11, 12, 13, 14, 15), parents=(-1, 0, 0, 1, -1))
KW = dict(num_blocks=64, block_size=4)


def _run(engine) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    greedy = engine.generate_greedy(PROMPT, 10)
    engine.prefill("s", PROMPT)
    chain = engine.score_block("s", DraftBlock(token_ids=tuple(greedy[1:5]))).float().cpu()
    tree = engine.score_block("s", TREE).float().cpu()
    engine.release("s")
    return greedy, chain, tree


def _compare(tiny_checkpoint, arch: str, ranks: int, ep: bool) -> None:
    model, config = load_model(tiny_checkpoint(arch), progress=False)
    want = _run(TargetEngine(model, config, **KW))
    with ParallelTargetEngine(
        tiny_checkpoint(arch), tensor_parallel_size=ranks, expert_parallel=ep, device="cuda", progress=False, **KW
    ) as engine:
        assert engine.kv_cache.layers[0].is_cuda
        assert all(os.environ.get(k) == v for k, v in MULTICAST_OFF.items())
        got = _run(engine)
    assert got[0] == want[0]
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_world_size_one_on_gpu_matches_cpu(tiny_checkpoint, arch):
    _compare(tiny_checkpoint, arch, 1, False)


@two_gpus
@pytest.mark.parametrize("ep", [False, True])
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_two_gpus_match_cpu(tiny_checkpoint, arch, ep):
    _compare(tiny_checkpoint, arch, 2, ep)
