"""ShmSessions (specserve/runtime/data_plane.py): a session released while its step runs ends after that step."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specserve.protos.specserve.v1 import target_pb2
from specserve.runtime.data_plane import ShmClient, ShmOffer, ShmSessions
from specserve.runtime.shm_layout import SHM_DIR, leftover_names
from specserve.runtime.shm_ring import PeerGone, RingError

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

        sessions = ShmSessions(
            "unit", ShmOffer(), target_pb2.VerifyRequest, handle, lambda exc: grpc.StatusCode.INTERNAL, on_end
        )
        client = await ShmClient.attach(sessions.offer("s", None))
        exchange = asyncio.ensure_future(
            client.exchange(target_pb2.VerifyRequest(session_id="s"), target_pb2.VerifyResponse, 10)
        )
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


def test_an_offer_nobody_attaches_to_and_no_grpc_step_withdraws_releases_its_session():
    """#33: a caller that asked for a channel and then went (a gateway killed between the reply and its
    attach) costs the service its session only until ``abandon_s``: the names go at the attach timeout,
    the session is released at abandon_s. One whose steps came over gRPC (drop_offer) is kept."""
    before = set(leftover_names())

    async def main():
        ended: list[str] = []

        async def on_end(session_id):
            ended.append(session_id)

        async def handle(session_id, request):
            raise AssertionError("no step comes")

        offer = ShmOffer(attach_timeout_s=0.1, abandon_s=0.4)
        sessions = ShmSessions(
            "unit", offer, target_pb2.VerifyRequest, handle, lambda exc: grpc.StatusCode.INTERNAL, on_end
        )
        gone, kept = sessions.offer("gone", None), sessions.offer("kept", None)
        assert gone and kept
        await asyncio.sleep(0.2)
        assert set(leftover_names()) == before and ended == []  # the names went at the attach timeout
        sessions.drop_offer("kept")  # its first step came over gRPC
        await asyncio.sleep(0.4)
        assert ended == ["gone"]
        await sessions.close()

    asyncio.run(main())
    with pytest.raises(ValueError, match="abandon_s"):
        ShmOffer(attach_timeout_s=5.0, abandon_s=1.0)
