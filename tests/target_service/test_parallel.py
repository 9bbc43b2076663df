"""Tensor / expert parallel target on CPU ranks (gloo): the same logits and tokens as one process.

Every case starts real worker processes (forkserver: torch is imported once, then each group of
ranks starts in well under a second) and compares against a TargetEngine over the unsharded model.
The tiny checkpoints have 4 attention heads and 2 kv heads (DeepSeek-V3 MLA: 4 heads, one shared
latent): at 4 ranks each kv head is replicated on 2 ranks, as vLLM does.
"""

from __future__ import annotations

import json

import pytest
import torch

from specserve.cli.main import main
from specserve.contract.types import DraftBlock, SamplingParams
from specserve.models.loader import load_model
from specserve.target_service.engine.engine import TargetEngine
from specserve.target_service.parallel import MULTICAST_OFF, ParallelError
from specserve.target_service.parallel.engine import ParallelTargetEngine

ARCHS = ("deepseek_v3", "qwen3_moe", "mixtral")
PLACEMENTS = ((1, False), (2, False), (2, True), (4, False), (4, True))  # (ranks, expert parallel); 1: no workers
PROMPT = [3, 17, 99, 5, 42, 7, 8, 250, 1, 64, 9]
TREE = DraftBlock(token_ids=(11, 12, 13, 14, 15), parents=(-1, 0, 0, 1, -1))
ATOL = RTOL = 1e-5
ENGINE_KW = dict(num_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """One-process TargetEngine per architecture (float32)."""
    engines = {}

    def get(arch: str) -> TargetEngine:
        if arch not in engines:
            model, config = load_model(tiny_checkpoint(arch), progress=False)
            engines[arch] = TargetEngine(model, config, **ENGINE_KW)
        return engines[arch]

    return get


def _exercise(engine, own: list[int]) -> dict:
    """Prefill, tree and chain scoring, a tree verify (moves K/V slots), decode and a batched verify.
    own = the greedy continuation of PROMPT (own[0] is the pending token after the prefill)."""
    out = {}
    pre = engine.prefill("a", PROMPT, SamplingParams(), hidden_layers=(0, 1))
    out["prefill"] = (pre.next_token, pre.hidden)
    out["score_tree"] = engine.score_block("a", TREE)
    out["score_chain"] = engine.score_block("a", DraftBlock(token_ids=tuple(own[1:5])))
    # a tree whose second branch is the model's own continuation: two nodes accepted, their slots compacted
    tree = DraftBlock(token_ids=(own[1] ^ 1, own[1], own[2], own[2] ^ 1), parents=(-1, -1, 1, 1))
    v = engine.verify("a", tree)
    out["verify_tree"] = (v.accepted_ids, v.next_token, v.hidden)
    out["decode"] = [engine.decode("a").next_token for _ in range(3)]
    engine.prefill("b", PROMPT[:5], SamplingParams())
    batch = engine.verify_batch([("a", DraftBlock(token_ids=(1, 2))), ("b", TREE)])
    out["batch"] = [(r.accepted_ids, r.next_token) for r in batch]
    out["score_after"] = engine.score_block("a", TREE)
    engine.release("a")
    engine.release("b")
    out["greedy"] = engine.generate_greedy(PROMPT, 8)
    return out


def _assert_same(got: dict, want: dict) -> None:
    for key in ("score_tree", "score_chain", "score_after"):
        torch.testing.assert_close(got[key], want[key], atol=ATOL, rtol=RTOL, msg=key)
    assert got["prefill"][0] == want["prefill"][0]
    torch.testing.assert_close(got["prefill"][1], want["prefill"][1], atol=ATOL, rtol=RTOL)
    assert got["verify_tree"][:2] == want["verify_tree"][:2]
    assert len(got["verify_tree"][0]) >= 2  # the own-continuation branch was accepted
    torch.testing.assert_close(got["verify_tree"][2], want["verify_tree"][2], atol=ATOL, rtol=RTOL)
    for key in ("decode", "batch", "greedy"):
        assert got[key] == want[key], key


@pytest.mark.parametrize("ranks,ep", PLACEMENTS, ids=lambda v: str(v))
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_matches_one_process(arch, ranks, ep, tiny_checkpoint, reference):
    ref = reference(arch)
    own = ref.generate_greedy(PROMPT, 5)
    want = _exercise(ref, own)
    with ParallelTargetEngine(
        tiny_checkpoint(arch), tensor_parallel_size=ranks, expert_parallel=ep, progress=False, **ENGINE_KW
    ) as engine:
        assert engine.info() == ref.info()
        if arch == "deepseek_v3" or ranks == 1:  # the MLA latent is shared by all heads: kept whole
            assert engine.kv_cache.entry_shape == ref.kv_cache.entry_shape
        else:  # 2 kv heads: one per rank at 2 ranks, each replicated on 2 ranks at 4
            assert engine.kv_cache.entry_shape == (2, 1, ref.kv_cache.entry_shape[2])
        got = _exercise(engine, own)
        assert engine.kv_usage() == ref.kv_usage()
    _assert_same(got, want)


def _generate(capsys, ckpt, *extra: str) -> list[int]:
    capsys.readouterr()
    argv = [
        "generate",
        "--model",
        str(ckpt),
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--max-new-tokens",
        "12",
        "--draft",
        "ngram",
        "--num-speculative-tokens",
        "3",
        "--num-kv-blocks",
        "64",
        "--json",
        *extra,
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 12
    return out["token_ids"]


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_cli_matches_one_process(arch, tiny_checkpoint, capsys):
    ckpt = tiny_checkpoint(arch)
    want = _generate(capsys, ckpt)
    assert _generate(capsys, ckpt, "--tensor-parallel-size", "2") == want
    assert _generate(capsys, ckpt, "--tensor-parallel-size", "4", "--enable-expert-parallel") == want


def test_refuses_a_model_that_does_not_split(tiny_checkpoint):
    with pytest.raises(ParallelError, match="num_heads"):  # 4 heads over 3 ranks; no process started
        ParallelTargetEngine(tiny_checkpoint("qwen3_moe"), tensor_parallel_size=3, progress=False, **ENGINE_KW)
    with pytest.raises(ParallelError, match="mixtral does not split over 8 ranks"):
        ParallelTargetEngine(tiny_checkpoint("mixtral"), tensor_parallel_size=8, expert_parallel=True, **ENGINE_KW)


def test_a_worker_that_dies_fails_the_engine_with_a_clear_error(tiny_checkpoint):
    engine = ParallelTargetEngine(tiny_checkpoint("qwen3_moe"), tensor_parallel_size=2, progress=False, **ENGINE_KW)
    try:
        engine.prefill("a", PROMPT)
        proc = engine._group.procs[0]
        with open(f"/proc/{proc.pid}/environ", "rb") as f:  # NVLink multicast off in every started rank
            environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        assert all(environ.get(k.encode()) == v.encode() for k, v in MULTICAST_OFF.items())
        proc.kill()
        proc.join(10)
        with pytest.raises(Exception):
            engine.decode("a")
        with pytest.raises(ParallelError, match="lost a rank"):
            engine.decode("a")
    finally:
        engine.close()
    assert not engine._group.procs
    # the process can host a new parallel target afterwards
    with ParallelTargetEngine(
        tiny_checkpoint("qwen3_moe"), tensor_parallel_size=2, progress=False, **ENGINE_KW
    ) as again:
        assert len(again.generate_greedy(PROMPT, 3)) == 3
