"""A drafter in process runs on its own CUDA stream (specserve/loop/local.py, runtime/device_stream.py; issue #30), on the
shipped demo, on the GPU (marked gpu, skipped without CUDA), with invariant steps (greedy speculation gives
target-only's tokens bit for bit):

- draft-ahead on with the demo's draft LM, in float32 and bfloat16: target-only's tokens, blocks drafted ahead were
  used, and every drafter call ran on the drafter's own stream, never the default stream the target runs on;
- EAGLE-3, whose drafter reads the target's hidden rows on the device: with the rows of every step written late on
  the target's stream (behind a GPU sleep), the drafter on its own stream drafts exactly the blocks it drafts on
  the target's stream (where it must wait), and the output is target-only's.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from specserve.contract.types import GenerationRequest
from specserve.draft_service import registry
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.loop.local import LocalDraft, LocalTarget
from specserve.loop.step_loop import FinalEvent, run_request
from specserve.paths import demo_dir
from specserve.target_service.factory import EngineConfig, build_engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CODE_PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser(description="
LATE_CYCLES = 5_000_000  # torch.cuda._sleep before a step's hidden rows are written: ~2.5 ms, longer than a hop


def _demo(part: str):
    path = demo_dir() / part
    if not (path / "config.json").is_file():
        pytest.skip(f"no shipped demo_model/{part}/")
    return path


def _engine(dtype: str):
    engine = build_engine(
        EngineConfig(
            model=_demo("target"), device="cuda", dtype=dtype, num_kv_blocks=256, kv_block_size=16, invariant_steps=True
        )
    )
    assert engine.runner.invariant_rows > 0
    return engine


def _drafter(family: str, dtype: str):
    return registry.build_proposer(
        DrafterConfig(
            family=family,
            checkpoint=_demo(family),
            target_checkpoint=_demo("target"),
            device="cuda",
            dtype=dtype,
            max_block_size=8,
        )
    )


def _generate(target, draft, prompt, new_tokens: int, k: int = 4, ahead: bool = False) -> FinalEvent:
    request = GenerationRequest(prompt, max_new_tokens=new_tokens, num_speculative_tokens=k, draft_ahead=ahead)

    async def go():
        final = None
        async for event in run_request(request, target, draft):
            final = event
        return final

    return asyncio.run(go())


def _record_calls(proposer, on_call) -> None:
    """Run on_call(args) inside each of the real proposer's proposes, on the drafter's thread."""
    propose = proposer.propose

    def recorded(*args):
        block = propose(*args)
        on_call(args, block)
        return block

    proposer.propose = recorded  # this instance only


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_draft_ahead_on_its_own_stream_gives_target_only_tokens(dtype):
    engine = _engine(dtype)
    proposer = _drafter("model", dtype)
    streams = []
    _record_calls(proposer, lambda args, block: streams.append(torch.cuda.current_stream()))
    target, draft = LocalTarget(engine), LocalDraft(proposer)
    try:
        prompt = tuple(engine.tokenizer.encode(CODE_PROMPT).ids)
        base = _generate(target, None, prompt, 96)
        spec = _generate(target, draft, prompt, 96, k=2, ahead=True)  # k = 2: whole blocks accepted often
    finally:
        target.close()
        draft.close()
    assert spec.token_ids == base.token_ids
    assert not spec.stats.draft_fallback and spec.stats.draft_ahead_hits > 0, spec.stats.as_dict()
    assert draft.stream is not None and draft.stream != torch.cuda.default_stream()
    assert streams and set(streams) == {draft.stream}  # every drafter call, ahead or not, on the drafter's stream
    assert proposer.chain_graphs is not None and proposer.chain_graphs.captured > 0  # its chains: graph replays there


class _LateRows:
    """The real engine, whose hidden rows of each step are written late on its stream (the default one): into fresh
    memory poisoned with NaN, behind a GPU sleep. A drafter reading them on another stream without waiting reads
    NaN (or whatever the memory held), and drafts other blocks."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    @staticmethod
    def _late(result):
        if not isinstance(result.hidden, torch.Tensor):
            return result
        late = torch.full_like(result.hidden, float("nan"))
        torch.cuda._sleep(LATE_CYCLES)
        late.copy_(result.hidden)
        return dataclasses.replace(result, hidden=late)

    def prefill(self, *args):
        return self._late(self.engine.prefill(*args))

    def verify(self, *args):
        return self._late(self.engine.verify(*args))


class _OnTargetStream:
    """The same drafter without a ``device``: LocalDraft gives it no stream of its own, so its thread issues its work
    on the default stream, behind the target's (as before issue #30): the reference, ordered by the stream itself."""

    def __init__(self, inner) -> None:
        self.inner, self.info = inner, inner.info

    def start(self, *args):
        return self.inner.start(*args)

    def propose(self, *args):
        return self.inner.propose(*args)

    def release(self, session_id):
        return self.inner.release(session_id)


def test_eagle3_reads_the_targets_rows_across_streams_and_drafts_as_on_one_stream():
    engine = _engine("float32")
    proposer = _drafter("eagle3", "float32")
    engine.add_graph_layers(proposer.info.hidden_layers)
    blocks = []
    _record_calls(proposer, lambda args, block: blocks.append(block.token_ids))
    target = LocalTarget(_LateRows(engine))
    own, shared = LocalDraft(proposer), LocalDraft(_OnTargetStream(proposer))
    try:
        prompt = tuple(engine.tokenizer.encode(CODE_PROMPT).ids)
        base = _generate(target, None, prompt, 64)
        _generate(target, own, prompt, 64)  # warm-up: graphs captured on first use
        runs = []
        for draft in (shared, own):
            torch.cuda.synchronize()  # the drafter's buffers change streams between the runs
            blocks.clear()
            runs.append((_generate(target, draft, prompt, 64), list(blocks)))
    finally:
        target.close()
        own.close()
        shared.close()
    (on_target, target_blocks), (on_own, own_blocks) = runs
    assert shared.stream is None and own.stream is not None and own.stream != torch.cuda.default_stream()
    assert not on_own.stats.draft_fallback and on_own.stats.accepted > 0
    assert own_blocks == target_blocks  # the same rows read: every block as on the target's stream
    assert on_own.token_ids == on_target.token_ids == base.token_ids
