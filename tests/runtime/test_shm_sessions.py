"""ShmSessions (specserve/runtime/data_plane.py): a session released while its step runs ends after that step."""

from __future__ import annotations

import asyncio
import threading
import time

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


def _echoing_sessions(spin_us: float) -> ShmSessions:
    """Channels whose service answers each request with its session id's length, spinning ``spin_us`` when lone."""
    from specserve.runtime.data_plane import session_ring

    async def handle(session_id, request):
        return target_pb2.VerifyResponse(session_id=request.session_id, next_token=len(request.session_id))

    async def on_end(session_id):
        pass

    offer = ShmOffer(ring=session_ring(spin_us=spin_us))
    return ShmSessions("unit", offer, target_pb2.VerifyRequest, handle, lambda e: grpc.StatusCode.INTERNAL, on_end)


def _post_without_ringing(client: ShmClient, request) -> None:
    """Write a request into the ring as a caller does, but ring no doorbell: only a reader polling the ring sees it."""
    from specserve.runtime.data_plane import encode_message

    rings = client.channel._rings
    parts = rings.frame(encode_message(request))
    assert rings.write_some(parts, 0) == sum(len(p) for p in parts)


@pytest.mark.parametrize("spin_us", [0.0, 5e5])
def test_a_lone_channel_spins_on_the_ring_for_its_next_request(spin_us):
    """A drafter woken through shared memory (`specserve draft --shm-spin-us`, issue #42): after its answer, a lone
    session's channel spins on the ring before it sleeps on the doorbell, so a request that comes within the spin is
    read without any wake-up. Control: with no spin the same request, its doorbell never rung, waits."""
    before = set(leftover_names())

    async def main():
        sessions = _echoing_sessions(spin_us)
        client = await ShmClient.attach(sessions.offer("s", None))
        first = target_pb2.VerifyRequest(session_id="abc")  # echoed as its length
        second = target_pb2.VerifyRequest(session_id="abcd")
        # posted from another thread once the service waits for it (spinning, which holds this loop, or asleep on its
        # doorbell): the first exchange takes milliseconds, and the spin starts as its reply leaves
        threading.Timer(0.25, _post_without_ringing, (client, second)).start()
        assert (await client.exchange(first, target_pb2.VerifyResponse, 10)).next_token == 3  # the channel is up
        try:
            frame = await client.channel.arecv(1.0)
            from specserve.runtime.data_plane import decode

            answered = decode(frame, target_pb2.VerifyResponse).next_token
        except Exception as exc:  # noqa: BLE001 - the control's outcome: no answer in time
            answered = type(exc).__name__
        client.close()
        await sessions.close()
        return answered

    answered = asyncio.run(main())
    assert answered == (4 if spin_us else "RingTimeout")
    assert set(leftover_names()) == before


def test_with_several_channels_none_spins_and_holds_the_others():
    """The spin holds the service's event loop, so only a lone channel spins: with two sessions attached, B's request
    right after A's answer is answered at once, not after A's channel has spun its 0.5 s (the callers run on a loop
    of their own, in another thread, so their clock is not the service's)."""
    before = set(leftover_names())

    async def main():
        sessions = _echoing_sessions(5e5)
        tickets = sessions.offer("a", None), sessions.offer("b", None)

        async def callers() -> float:
            a, b = [await ShmClient.attach(t) for t in tickets]
            for client in (a, b):  # both attached and answered once
                await client.exchange(target_pb2.VerifyRequest(session_id="x"), target_pb2.VerifyResponse, 10)
            await a.exchange(target_pb2.VerifyRequest(session_id="xy"), target_pb2.VerifyResponse, 10)
            t0 = time.perf_counter()
            reply = await b.exchange(target_pb2.VerifyRequest(session_id="xyz"), target_pb2.VerifyResponse, 10)
            assert reply.next_token == 3
            a.close()
            b.close()
            return time.perf_counter() - t0

        waited = await asyncio.to_thread(asyncio.run, callers())
        await sessions.close()
        return waited

    assert asyncio.run(main()) < 0.25  # a spinning A would have held it ~0.5 s
    assert set(leftover_names()) == before
