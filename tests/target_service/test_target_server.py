"""The target gRPC service in-process (real engine, real gRPC over a unix socket) against a second,
local engine built from the same checkpoint."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from served import InProcessServer

from specserve.contract.types import DraftBlock, SamplingParams
from specserve.protos import convert
from specserve.protos.specserve.v1 import common_pb2, target_pb2, target_pb2_grpc
from specserve.runtime.servers_common import ServiceBinding
from specserve.target_service.engine_worker import EngineWorker
from specserve.target_service.factory import EngineConfig, build_engine
from specserve.target_service.server import SERVICE_NAME, TargetServicer, add_target_to_server

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


class ServedTarget(InProcessServer):
    """A TargetServicer on its own event loop thread, as the `specserve target` process runs it."""

    call_timeout_s = 30.0

    def __init__(self, cfg: EngineConfig, address: str) -> None:
        self.cfg = cfg
        super().__init__(address, target_pb2_grpc.TargetServiceStub, start_timeout_s=120)

    async def _build(self):
        worker = await EngineWorker.build(lambda: build_engine(self.cfg))
        worker.start()
        servicer = TargetServicer(worker, model_name="tiny")
        return worker, ServiceBinding(add_target_to_server, servicer, SERVICE_NAME)

    def stats(self) -> target_pb2.TargetStats:
        return self.stub.GetStats(target_pb2.TargetStatsRequest(), timeout=10)


@pytest.fixture(scope="module")
def engine_config(tiny_checkpoint):
    return EngineConfig(model=tiny_checkpoint("qwen3_moe"), num_kv_blocks=320, kv_block_size=4)


@pytest.fixture(scope="module")
def served(engine_config, tmp_path_factory):
    s = ServedTarget(engine_config, f"unix:{tmp_path_factory.mktemp('tsock')}/t.sock")
    yield s
    s.close()


@pytest.fixture(scope="module")
def local(engine_config):
    return build_engine(engine_config)


def block_msg(ids, probs=None) -> common_pb2.DraftBlock:
    return convert.draft_block_to_proto(DraftBlock(token_ids=tuple(ids), probs=probs))


def test_info_health_reflection(served, local):
    info = served.stub.GetInfo(target_pb2.TargetInfoRequest(), timeout=10)
    ref = local.info()
    assert (info.model_type, info.vocab_size, info.vocab_hash, info.max_context, info.num_layers) == (
        ref.model_type,
        ref.vocab_size,
        ref.vocab_hash,
        ref.max_context,
        ref.num_layers,
    )
    assert info.model_name == "tiny" and info.tensor_parallel_size == 1
    health = health_pb2_grpc.HealthStub(served.channel)
    for name in ("", SERVICE_NAME):
        assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == 1  # SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    reply = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert SERVICE_NAME in {s.name for s in reply.list_services_response.service}


def test_stream_matches_local_engine(served, local):
    """Prefill (with hidden states) then verify steps over one VerifyStream = the same calls on a local
    engine, token for token and row for row."""
    layers = (0, 1)
    pre = served.stub.Prefill(
        target_pb2.PrefillRequest(session_id="s1", prompt_ids=PROMPT, hidden_layers=list(layers)), timeout=30
    )
    ref = local.prefill("s1", PROMPT, SamplingParams(), layers)
    assert pre.next_token == ref.next_token
    assert torch.allclose(convert.tensor_from_proto(pre.hidden), ref.hidden.float())
    blocks = [[], [7, 7, 7], [ref.next_token, 1], [5]]
    reqs = iter([target_pb2.VerifyRequest(session_id="s1", draft=block_msg(b)) for b in blocks])
    for b, resp in zip(blocks, served.stub.VerifyStream(reqs, timeout=30)):
        want = local.verify("s1", DraftBlock(token_ids=tuple(b)))
        assert (tuple(resp.accepted_ids), resp.next_token, resp.num_drafted) == (
            want.accepted_ids,
            want.next_token,
            len(b),
        )
        assert torch.allclose(convert.tensor_from_proto(resp.hidden), want.hidden.float())
        assert resp.batch_size == 1 and resp.timings.forward_ms > 0 and resp.timings.total_ms > 0
    local.release("s1")
    # the stream ended: the service released the session by itself
    deadline = time.monotonic() + 2
    while served.stats().active_sessions and time.monotonic() < deadline:
        time.sleep(0.02)
    assert served.stats().active_sessions == 0 and served.stats().kv_blocks_used == 0


def test_errors_map_to_status_and_leave_session_usable(served):
    stub = served.stub
    cases = [
        (lambda: stub.Verify(target_pb2.VerifyRequest(session_id="nope"), timeout=10), grpc.StatusCode.NOT_FOUND),
        (
            lambda: stub.Prefill(target_pb2.PrefillRequest(session_id="e", prompt_ids=[1, 999]), timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            lambda: stub.Prefill(target_pb2.PrefillRequest(session_id="e", prompt_ids=[]), timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            lambda: stub.Prefill(target_pb2.PrefillRequest(session_id="e", prompt_ids=[1] * 600), timeout=10),
            grpc.StatusCode.OUT_OF_RANGE,
        ),
    ]
    for call, code in cases:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == code, info.value.details()
    stub.Prefill(target_pb2.PrefillRequest(session_id="e", prompt_ids=PROMPT), timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        stub.Prefill(target_pb2.PrefillRequest(session_id="e", prompt_ids=PROMPT), timeout=10)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    bad_blocks = [block_msg([1, 300]), block_msg([1, 2], probs=torch.full((2, 256), float("nan")))]
    for bad in bad_blocks:
        with pytest.raises(grpc.RpcError) as info:
            stub.Verify(target_pb2.VerifyRequest(session_id="e", draft=bad), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ok = stub.Verify(target_pb2.VerifyRequest(session_id="e", draft=block_msg([2])), timeout=10)
    assert ok.num_drafted == 1
    assert stub.Release(target_pb2.ReleaseRequest(session_id="e"), timeout=10).released
    assert not stub.Release(target_pb2.ReleaseRequest(session_id="e"), timeout=10).released


def test_concurrent_sessions_share_one_forward_losslessly(served, local):
    """Verify requests queued while the engine thread is busy run as one verify_batch call, and each
    session gets what it would get alone."""
    sids = [f"b{i}" for i in range(3)]
    prompts = {sid: PROMPT[i:] + [i + 1] for i, sid in enumerate(sids)}
    block = {sid: [9, 9] for sid in sids}
    for sid in sids:
        served.stub.Prefill(target_pb2.PrefillRequest(session_id=sid, prompt_ids=prompts[sid]), timeout=10)
        local.prefill(sid, prompts[sid], SamplingParams(), ())
    want = {sid: local.verify(sid, DraftBlock(token_ids=tuple(block[sid]))) for sid in sids}
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        busy = [
            pool.submit(served.stub.Prefill, target_pb2.PrefillRequest(session_id=b, prompt_ids=[5] * 500), timeout=60)
            for b in ("busy1", "busy2")
        ]  # keep the engine thread busy a while
        time.sleep(0.01)
        futs = {
            sid: pool.submit(
                served.stub.Verify, target_pb2.VerifyRequest(session_id=sid, draft=block_msg(block[sid])), timeout=60
            )
            for sid in sids
        }
        got = {sid: f.result() for sid, f in futs.items()}
        [b.result() for b in busy]
    for sid in sids:
        assert (tuple(got[sid].accepted_ids), got[sid].next_token) == (want[sid].accepted_ids, want[sid].next_token)
        local.release(sid)
        served.stub.Release(target_pb2.ReleaseRequest(session_id=sid), timeout=10)
    for b in ("busy1", "busy2"):
        served.stub.Release(target_pb2.ReleaseRequest(session_id=b), timeout=10)
    assert max(r.batch_size for r in got.values()) == 3
    assert served.stats().active_sessions == 0 and served.stats().kv_blocks_used == 0


def test_cancelled_stream_frees_the_session(served):
    served.stub.Prefill(target_pb2.PrefillRequest(session_id="c", prompt_ids=PROMPT), timeout=10)
    requests = [target_pb2.VerifyRequest(session_id="c")]
    gate = threading.Event()

    def gen():
        yield requests[0]
        gate.wait(10)  # keep the stream open until the test cancels it

    call = served.stub.VerifyStream(gen())
    next(call)
    assert served.stats().active_sessions == 1
    call.cancel()
    gate.set()
    deadline = time.monotonic() + 1
    while served.stats().active_sessions and time.monotonic() < deadline:
        time.sleep(0.02)
    assert served.stats().active_sessions == 0 and served.stats().kv_blocks_used == 0


def test_worker_runs_calls_in_order_skips_cancelled_ones_and_close_answers_every_waiter(engine_config):
    """The engine thread's hand-over (EngineWorker._dispatch): a call cancelled before it started never runs;
    closing the worker answers every caller still waiting (none hangs), after the job on the thread ends."""

    async def main():
        worker = await EngineWorker.build(lambda: build_engine(engine_config))
        worker.start()
        await worker.prefill("w", PROMPT, SamplingParams(), ())
        busy = asyncio.ensure_future(worker.prefill("busy", [5] * 400, SamplingParams(), ()))
        await asyncio.sleep(0.005)  # the long prefill holds the engine thread
        dropped = asyncio.ensure_future(worker.call(worker.engine.release, "w"))
        await asyncio.sleep(0)
        dropped.cancel()  # before it started: "w" stays open
        step = await asyncio.wait_for(worker.verify("w", DraftBlock(token_ids=(9,))), 30)
        await busy
        assert step.result.num_drafted == 1  # "w" was not released by the cancelled call
        hold = asyncio.ensure_future(worker.prefill("busy2", [5] * 400, SamplingParams(), ()))
        await asyncio.sleep(0.005)
        waiting = [
            asyncio.ensure_future(worker.verify("w", DraftBlock(token_ids=(9,)))),
            asyncio.ensure_future(worker.call(worker.engine.kv_usage)),
        ]
        await asyncio.sleep(0)
        await asyncio.wait_for(worker.close(), 30)
        outcomes = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 5)
        assert all(isinstance(o, RuntimeError) for o in outcomes), outcomes
        await asyncio.gather(hold, return_exceptions=True)

    asyncio.run(main())


def test_a_verify_answer_runs_on_the_engine_thread_before_the_loop_hears_of_the_result(engine_config, local):
    """EngineWorker.verify(answer=...): the shared-memory path's reply leaves from the engine thread as soon as
    the result is there; an answer that declines or fails leaves the reply to the loop, with the same result."""

    async def main():
        worker = await EngineWorker.build(lambda: build_engine(engine_config))
        worker.start()
        seen: list[tuple[str, int, int]] = []
        try:
            for sid in ("a1", "a2", "a3"):
                await worker.prefill(sid, PROMPT, SamplingParams(), ())

            def answering(res, queue_ms, batch_size):  # what the loop has of "a1" while the reply leaves
                seen.append((threading.current_thread().name, worker.active["a1"], batch_size))
                return True

            out = await worker.verify("a1", DraftBlock(token_ids=(9, 9)), answering)
            assert out.answered
            assert seen == [("target-engine", len(PROMPT) + 1, 1)]  # on the engine thread, the loop not yet told
            assert worker.active["a1"] == len(PROMPT) + 1 + len(out.result.emitted)  # and then it was

            def declining(res, queue_ms, batch_size):
                return False

            def failing(res, queue_ms, batch_size):
                raise ValueError("no room")

            for sid, answer in (("a2", declining), ("a3", failing)):
                got = await worker.verify(sid, DraftBlock(token_ids=(9, 9)), answer)
                assert not got.answered
                assert (got.result.accepted_ids, got.result.next_token) == (
                    out.result.accepted_ids,
                    out.result.next_token,
                )
        finally:
            await worker.close()

    asyncio.run(main())


def _run_tokens(served, sid: str, prompt, n: int = 12) -> tuple[list[int], list[target_pb2.RunEvent]]:
    events = list(
        served.stub.Run(target_pb2.RunRequest(session_id=sid, prompt_ids=prompt, max_new_tokens=n), timeout=60)
    )
    assert events[-1].HasField("final") and events[-1].final.completion_tokens == n
    return [t for e in events[:-1] for t in e.tokens.token_ids], events


def test_a_lone_run_verifies_on_the_engine_thread_with_no_hand_over_a_step(served, local):
    """Issue #42: the served loop (Run) runs on the engine's thread: a lone session's verify is a plain call there
    (no hand-over to the host's queue: worker.verify is never called, and every engine.verify runs on the engine's
    thread, called from the loop's own thread); its tokens are the local engine's."""
    worker = served.worker
    queued, threads = [], []
    verify, engine_verify = worker.verify, worker.engine.verify

    async def counted(*args, **kw):
        queued.append(args[0])
        return await verify(*args, **kw)

    def noted(*args, **kw):
        threads.append(threading.current_thread().name)
        return engine_verify(*args, **kw)

    worker.verify, worker.engine.verify = counted, noted
    try:
        got, events = _run_tokens(served, "lone", PROMPT)
    finally:
        del worker.verify, worker.engine.verify
    steps = events[-1].final.stats.steps
    assert steps >= 1 and queued == []  # 0 hand-overs a step (before: one a step)
    assert threads == ["target-engine"] * steps
    local.prefill("lone-local", PROMPT, SamplingParams(), ())
    want = [local.verify("lone-local", DraftBlock(token_ids=())).next_token for _ in range(1)]
    local.release("lone-local")
    assert got[1:2] == want  # the first verify's token (greedy, target-only): the local engine's
    wait_until_free(served)


def test_concurrent_runs_batch_their_verifies_and_keep_their_tokens(served):
    """With several sessions open the loop's verify goes to the host's queue, where it batches with the others';
    each Run's tokens are what it makes alone."""
    prompts = {f"c{i}": PROMPT[i:] + [i + 1] for i in range(3)}
    alone = {sid: _run_tokens(served, sid + "-alone", p)[0] for sid, p in prompts.items()}
    steps_before = served.worker.host.steps
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futs = {sid: pool.submit(_run_tokens, served, sid, p, 12) for sid, p in prompts.items()}
        together = {sid: f.result()[0] for sid, f in futs.items()}
    assert together == alone
    assert served.worker.host.steps > steps_before  # some steps went through the host's batches
    wait_until_free(served)


def wait_until_free(served, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while served.stats().active_sessions and time.monotonic() < end:
        time.sleep(0.02)
    assert served.stats().active_sessions == 0


def test_a_call_handed_to_the_engine_thread_runs_between_a_lone_runs_steps(served):
    """A lone Run's direct steps never wait on anything, so the engine thread's loop takes a turn when another
    thread hands it something: another session's Prefill (and a cancellation) runs while the Run goes on, not after
    its last step (before the turn, both waited for the Run's end)."""
    worker = served.worker
    req = target_pb2.RunRequest(session_id="long", prompt_ids=PROMPT, max_new_tokens=200)
    before = worker.steps
    call = served.stub.Run(req, timeout=60)
    next(call), next(call)  # the Run's steps are under way
    served.stub.Prefill(target_pb2.PrefillRequest(session_id="between", prompt_ids=PROMPT), timeout=60)
    at_prefill = worker.steps - before
    final = list(call)[-1].final
    assert final.completion_tokens == 200 and at_prefill < final.stats.steps
    served.stub.Release(target_pb2.ReleaseRequest(session_id="between"), timeout=10)
    before = worker.steps
    call = served.stub.Run(req, timeout=60)
    next(call), next(call)
    call.cancel()  # the cancellation runs between two steps: the loop ends there and releases the session
    wait_until_free(served)
    assert worker.steps - before < final.stats.steps
