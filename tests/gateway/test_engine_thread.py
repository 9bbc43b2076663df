"""In process the step loop runs on the engine's thread (specserve/loop/engine_thread.py, issue #42): a step's prefill,
verify, propose and its record all run on that one thread, while the threaded adapters (the path `generate` and
`bench` took before) hop to two other threads each step (the control: this test tells the two apart). Same tokens
either way; requests on one engine take turns step by step; a block drafted ahead still goes to the drafter's
thread; a caller that stops reading releases the session. A lone request's steps do not turn the thread's event loop
(only what another thread hands it does), and the loop asks whether tracing is on once a request."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from specserve.contract.types import GenerationRequest, SamplingParams
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.registry import build_proposer
from specserve.loop.engine_thread import EngineThread
from specserve.loop.local import LocalDraft, LocalTarget
from specserve.loop.step_loop import FinalEvent, run_request
from specserve.runtime import tracing
from specserve.target_service.factory import EngineConfig, build_engine

PROMPT = (5, 17, 99, 5, 17, 3, 42, 7, 5, 17, 99, 5)


class _Recording:
    """The engine or proposer, noting (what, thread) of each call of ``names``."""

    def __init__(self, inner, names: tuple[str, ...], log: list) -> None:
        self._inner, self._names, self._log = inner, names, log

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self._names:
            return attr

        def call(*args, **kwargs):
            self._log.append((name, threading.get_ident()))
            return attr(*args, **kwargs)

        return call


@pytest.fixture(scope="module")
def engine(tiny_target_dir):
    return build_engine(EngineConfig(model=tiny_target_dir, num_kv_blocks=512, kv_block_size=4))


def _request(**kw) -> GenerationRequest:
    fields = dict(prompt_ids=PROMPT, max_new_tokens=24, sampling=SamplingParams(), num_speculative_tokens=4)
    return GenerationRequest(**(fields | kw))


async def _tokens(events) -> tuple[int, ...]:
    final = None
    async for event in events:
        if isinstance(event, FinalEvent):
            final = event
    return final.token_ids


def _ngram(log: list):
    return _Recording(build_proposer(DrafterConfig(family="ngram", max_block_size=8)), ("propose",), log)


def test_a_step_runs_whole_on_the_engine_thread_and_the_threaded_path_does_not(engine) -> None:
    log: list = []
    traced = _Recording(engine, ("prefill", "verify"), log)

    def on_step(rec) -> None:
        log.append(("step", threading.get_ident()))

    async def direct():
        target, draft = EngineThread(traced), LocalDraft(_ngram(log))
        try:
            return await _tokens(target.generate(_request(), draft, on_step=on_step)), target._thread.ident
        finally:
            target.close()
            draft.close()

    async def threaded():
        target, draft = LocalTarget(traced), LocalDraft(_ngram(log))
        try:
            return await _tokens(run_request(_request(), target, draft, on_step=on_step)), threading.get_ident()
        finally:
            target.close()
            draft.close()

    tokens, engine_thread = asyncio.run(direct())
    names = [name for name, _ in log]
    assert names.count("verify") >= 3 and names.count("propose") >= 3  # the n-gram drafted on several steps
    assert {thread for _, thread in log} == {engine_thread}  # prefill, verify, propose, the step's record: one thread

    log.clear()
    old_tokens, loop_thread = asyncio.run(threaded())
    threads = {name: {t for n, t in log if n == name} for name in ("verify", "propose", "step")}
    assert threads["step"] == {loop_thread}  # control: the threaded adapters hop to two other threads a step
    assert threads["verify"].isdisjoint(threads["propose"] | threads["step"])
    assert threads["propose"].isdisjoint(threads["step"])
    assert tokens == old_tokens and len(tokens) == 24


def test_requests_on_one_engine_take_turns_and_keep_their_tokens(engine) -> None:
    async def go():
        target, draft = (
            EngineThread(engine),
            LocalDraft(build_proposer(DrafterConfig(family="ngram", max_block_size=8))),
        )
        order: list[str] = []
        try:
            prompts = {"a": PROMPT, "b": PROMPT[::-1]}
            alone = {
                s: await _tokens(target.generate(_request(prompt_ids=p, num_speculative_tokens=0), None))
                for s, p in prompts.items()
            }
            together = await asyncio.gather(
                *(
                    _tokens(
                        target.generate(
                            _request(prompt_ids=p),
                            draft,
                            session_id=s,
                            on_step=lambda rec, s=s: order.append(s),
                        )
                    )
                    for s, p in prompts.items()
                )
            )
            return alone, dict(zip(prompts, together)), order
        finally:
            target.close()
            draft.close()

    alone, together, order = asyncio.run(go())
    assert together == alone  # greedy: target-only's tokens, each request its own
    first_b = order.index("b")
    assert "a" in order[first_b:]  # a's steps went on after b's began: they took turns


def test_a_block_drafted_ahead_goes_to_the_drafter_thread(engine) -> None:
    log: list = []

    async def go():
        target, draft = EngineThread(engine), LocalDraft(_ngram(log))
        try:
            tokens = await _tokens(target.generate(_request(draft_ahead=True), draft))
            return tokens, target._thread.ident, draft._thread.ident
        finally:
            target.close()
            draft.close()

    tokens, engine_thread, drafter_thread = asyncio.run(go())
    threads = {t for _, t in log}
    assert drafter_thread in threads  # blocks drafted ahead, overlapping the verify
    assert threads <= {engine_thread, drafter_thread}
    reference = asyncio.run(_reference(engine))
    assert tokens == reference


async def _reference(engine) -> tuple[int, ...]:
    target = LocalTarget(engine)
    try:
        return await _tokens(run_request(_request(num_speculative_tokens=0), target, None))
    finally:
        target.close()


def test_a_caller_that_stops_reading_releases_the_session(engine) -> None:
    async def go():
        target = EngineThread(engine)
        try:
            events = target.generate(_request(max_new_tokens=200), None, session_id="left-early")
            async for _ in events:
                break  # the first token, then the caller goes
            await events.aclose()
            deadline = time.monotonic() + 10
            while engine.has_session("left-early") and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return engine.has_session("left-early")
        finally:
            target.close()

    assert asyncio.run(go()) is False


def test_a_lone_request_turns_the_event_loop_only_when_handed_something(engine) -> None:
    """A direct step never waits, so a lone request's steps yield to the engine thread's event loop only when another
    thread handed it something (issue #42: a turn of the loop a step was a fifth of the in-process step's host time):
    a callback that each step leaves on that loop runs there at the request's end, not a step later (before: one turn
    a step). A request arriving mid-way still starts at the next step, and a caller that leaves is heard at once."""

    async def go():
        target = EngineThread(engine)
        ran, seen, order, left = [0], [], [], []
        b_sent = threading.Event()

        def tick() -> None:
            ran[0] += 1

        def on_lone(rec) -> None:  # on the engine's thread
            asyncio.get_running_loop().call_soon(tick)
            seen.append(ran[0])

        def on_a(rec) -> None:
            order.append("a")
            if len(order) == 3:  # hold a's third step until b has been handed to the loop
                b_sent.wait(10)

        try:
            await _tokens(target.generate(_request(num_speculative_tokens=0), None, on_step=on_lone))
            a = asyncio.ensure_future(
                _tokens(target.generate(_request(num_speculative_tokens=0), None, session_id="a", on_step=on_a))
            )
            while len(order) < 3:
                await asyncio.sleep(0.001)
            b = asyncio.ensure_future(
                _tokens(
                    target.generate(
                        _request(num_speculative_tokens=0), None, session_id="b", on_step=lambda rec: order.append("b")
                    )
                )
            )
            await asyncio.sleep(0.05)  # b's generate ran up to its first wait: b is on the engine's loop
            b_sent.set()
            await asyncio.gather(a, b)
            events = target.generate(
                _request(max_new_tokens=200, num_speculative_tokens=0), None, on_step=lambda rec: left.append(1)
            )
            async for _ in events:
                break
            await events.aclose()
            return seen, order, left
        finally:
            target.close()

    lone, order, left = asyncio.run(go())
    assert len(lone) == 23 and lone[-1] <= 1  # before: lone[-1] == 22, a turn a step
    assert "a" in order[order.index("b") :]  # b began before a ended
    assert len(left) < 50  # cancelled a step or so after the caller left, not after 200


def test_the_loop_asks_whether_tracing_is_on_once_a_request(engine, monkeypatch) -> None:
    """Whether a tracer provider is installed is asked once a request, not at each of a step's spans (the question
    reads the environment: three times a step it was a tenth of the in-process step's host time, issue #42)."""
    asked = [0]
    installed = tracing.tracing_installed

    def counted() -> bool:
        asked[0] += 1
        return installed()

    monkeypatch.setattr(tracing, "tracing_installed", counted)

    async def go():
        target = EngineThread(engine)
        steps: list = []
        try:
            await _tokens(target.generate(_request(num_speculative_tokens=0), None, on_step=steps.append))
            return len(steps)
        finally:
            target.close()

    assert asyncio.run(go()) == 23
    assert asked[0] == 1  # before: 2 a step (the verify's span and the stream's)
