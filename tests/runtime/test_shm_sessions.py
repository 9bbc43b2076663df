"""ShmSessions (specserve/runtime/data_plane.py): a session released while its step runs ends after that step."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specserve.protos.specserve.v1 import target_pb2
from specserve.runtime.data_plane import ShmClient, ShmOffer, ShmSessions
from specserve.runtime.shm_ring import SHM_DIR, PeerGone, RingError, leftover_names

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this host")


def test_a_release_during_a_step_lets_the_step_finish_then_ends_the_channel():
    before = set(leftover_names())

    async def main():
        started, go = asyncio.Event(), asyncio.Event()
        finished: list[str] = []
        ended: list[str] = []

        async def handle(session_id, request):
            started.set()
            await go.wait()  # the step runs (the reply may already have left from the model's thread)
            finished.append(request.session_id)  # e.g. its span's attributes, its counts
            return target_pb2.VerifyResponse(session_id=request.session_id, next_token=7)

        async def on_end(session_id):
            ended.append(session_id)

        sessions = ShmSessions("unit", ShmOffer(), target_pb2.VerifyRequest, handle,
                               lambda exc: grpc.StatusCode.INTERNAL, on_end)
        client = ShmClient.attach(sessions.offer("s", None))
        exchange = asyncio.ensure_future(
            client.exchange(target_pb2.VerifyRequest(session_id="s"), target_pb2.VerifyResponse, 10))
        await asyncio.wait_for(started.wait(), 10)
        sessions.close_session("s")  # released while the step runs
        go.set()
        reply = await asyncio.wait_for(exchange, 10)
        assert reply.next_token == 7 and finished == ["s"]  # the step was not cut short
        with pytest.raises((PeerGone, RingError)):  # then the channel ended
            await client.exchange(target_pb2.VerifyRequest(session_id="s"), target_pb2.VerifyResponse, 10)
        for _ in range(100):
            if ended:
                break
            await asyncio.sleep(0.01)
        assert ended == ["s"]
        await sessions.close()

    asyncio.run(main())
    assert set(leftover_names()) == before
