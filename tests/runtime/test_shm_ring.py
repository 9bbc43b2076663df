"""The shared-memory channel (specserve/runtime/shm_ring.py): round trips, wraparound, back-pressure,
timeouts, a peer process killed with SIGKILL, and nothing left in /dev/shm."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from shm_helpers import left_behind

from specserve.runtime.shm_layout import SHM_DIR, RingConfig, leftover_names
from specserve.runtime.shm_ring import MessageTooLarge, PeerGone, RingError, RingTimeout, ShmChannel

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this host")


@pytest.fixture(autouse=True)
def nothing_left():
    before = set(leftover_names())
    yield
    assert left_behind(before) == set(), "a segment or FIFO left in /dev/shm"


def attach_beside(a: ShmChannel, config: RingConfig | None = None) -> ShmChannel:
    """Attach to ``a`` from a thread while ``a`` (its creator) takes the attacher here."""
    got: list = []
    t = threading.Thread(target=lambda: got.append(ShmChannel.attach(a.ticket, config)))
    t.start()
    a.accept(timeout=10)
    t.join(10)
    return got[0]


def pair(config: RingConfig | None = None) -> tuple[ShmChannel, ShmChannel]:
    a = ShmChannel.create(config)
    return a, attach_beside(a, config)


def test_round_trip_both_ways_and_names_gone_once_attached():
    a = ShmChannel.create()
    assert a.name in leftover_names()  # offered, not yet attached
    b = attach_beside(a)
    assert not [n for n in leftover_names() if n.startswith(a.name)]  # its one name (the socket) went
    b.send(b"hello" * 40)
    assert a.recv(timeout=2) == b"hello" * 40
    a.send(b"")  # an empty message is a message
    assert b.recv(timeout=2) == b""
    a.send(b"x" * 200)
    assert b.recv(timeout=2) == b"x" * 200
    a.close()
    b.close()


def test_wraparound_keeps_every_byte():
    a, b = pair(RingConfig(capacity=64))
    for i in range(200):  # lengths that do not divide 64: messages straddle the end of the ring
        msg = bytes((i + j) % 256 for j in range(1 + i % 37))
        a.send(msg, timeout=2)
        assert b.recv(timeout=2) == msg
    a.close()
    b.close()


def test_message_larger_than_the_ring_streams_through_with_back_pressure():
    a, b = pair(RingConfig(capacity=64))
    big = os.urandom(10_000)  # 156 ring-fulls: the writer must wait for the reader again and again
    got = []
    reader = threading.Thread(target=lambda: got.append(b.recv(timeout=10)))
    reader.start()
    a.send(big, timeout=10)
    reader.join(10)
    assert got == [big]
    a.close()
    b.close()


def test_full_ring_blocks_the_writer_until_the_reader_drains():
    a, b = pair(RingConfig(capacity=64))
    msgs = [bytes([i]) * 50 for i in range(3)]  # 54 bytes each in a 64-byte ring
    writer = threading.Thread(target=lambda: [a.send(m, timeout=10) for m in msgs])
    writer.start()
    time.sleep(0.3)
    assert writer.is_alive()  # the second message does not fit: the writer waits for room
    got = [b.recv(timeout=5) for _ in msgs]
    writer.join(5)
    assert not writer.is_alive() and got == msgs
    a.send(b"1" * 50)
    with pytest.raises(RingTimeout):
        a.send(b"2" * 50, timeout=0.2)  # nobody reads: the wait for room ends at the timeout
    a.close()
    b.close()


def test_async_back_pressure_many_small_messages():
    async def main():
        a, b = pair(RingConfig(capacity=128))
        msgs = [bytes([i % 256]) * (i % 50) for i in range(300)]

        async def produce():
            for m in msgs:
                await a.asend(m, timeout=5)

        task = asyncio.ensure_future(produce())
        got = [await b.arecv(timeout=5) for _ in msgs]
        await task
        a.close()
        b.close()
        return got, msgs

    got, msgs = asyncio.run(main())
    assert got == msgs


def test_recv_times_out_and_the_channel_still_works():
    a, b = pair()
    t0 = time.monotonic()
    with pytest.raises(RingTimeout):
        b.recv(timeout=0.1)
    assert 0.09 < time.monotonic() - t0 < 1.0

    async def main():
        with pytest.raises(RingTimeout):
            await b.arecv(timeout=0.05)
        a.send(b"late")
        return await b.arecv(timeout=1)

    assert asyncio.run(main()) == b"late"
    a.close()
    b.close()


def test_closing_one_end_gives_peer_gone_and_a_closed_end_refuses():
    a, b = pair()
    a.send(b"last words")
    a.close()
    assert b.recv(timeout=1) == b"last words"  # written before the close: still delivered
    with pytest.raises(PeerGone):
        b.recv(timeout=1)
    with pytest.raises(RingError):
        a.recv(timeout=1)
    b.close()


def test_creator_closing_before_anyone_attached_unlinks_everything():
    a = ShmChannel.create()
    name, ticket = a.name, a.ticket
    a.close()
    assert not [n for n in leftover_names() if n.startswith(name)]
    with pytest.raises(OSError):
        ShmChannel.attach(ticket)


def test_the_attacher_takes_the_creators_ring_size():
    a = ShmChannel.create(RingConfig(capacity=64))
    b = attach_beside(a)  # its own config says 1 MiB: the segment's 64 bytes win
    assert b.capacity == 64
    for i in range(20):
        a.send(bytes([i]) * 40, timeout=2)
        assert b.recv(timeout=2) == bytes([i]) * 40
    a.close()
    b.close()


def test_attach_refuses_names_that_are_not_ours():
    with pytest.raises(RingError):
        ShmChannel.attach("../etc/passwd")
    with pytest.raises(OSError):
        ShmChannel.attach("specserve-" + "0" * 24 + ":" + "00" * 32)  # nobody offered it


def test_wait_attached_times_out_when_nobody_comes():
    a = ShmChannel.create()
    with pytest.raises(RingTimeout):
        asyncio.run(a.wait_attached(timeout=0.1))
    a.close()


PEER = textwrap.dedent(
    """
    import sys, time
    from specserve.runtime.shm_ring import ShmChannel
    ch = ShmChannel.attach(sys.argv[1])
    while True:
        msg = ch.recv()
        if msg == b"stall":
            time.sleep(3600)
        ch.send(msg[::-1])
    """
)


def start_peer(name: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PEER, name])


def test_peer_killed_mid_step_is_seen_at_once_and_leaves_nothing():
    a = ShmChannel.create()
    peer = start_peer(a.ticket)
    try:
        asyncio.run(a.wait_attached(timeout=30))
        a.send(b"abc" * 70)
        assert a.recv(timeout=10) == (b"abc" * 70)[::-1]
        a.send(b"stall")  # the peer is now inside a step and never answers
        time.sleep(0.2)
        peer.send_signal(signal.SIGKILL)
        t0 = time.monotonic()

        async def wait():
            return await a.arecv(timeout=10)

        with pytest.raises(PeerGone):
            asyncio.run(wait())
        assert time.monotonic() - t0 < 2.0  # the doorbell's end-of-file, not the timeout
    finally:
        peer.kill()
        peer.wait()
        a.close()
    assert not [n for n in leftover_names() if n.startswith(a.name)]


CREATOR = textwrap.dedent(
    """
    import sys, time
    from specserve.runtime.shm_ring import ShmChannel
    ch = ShmChannel.create()
    print(ch.ticket, flush=True)
    ch.send(ch.recv())
    time.sleep(3600)
    """
)


def test_creator_killed_gives_peer_gone_and_leaves_nothing():
    proc = subprocess.Popen([sys.executable, "-c", CREATOR], stdout=subprocess.PIPE, text=True)
    try:
        ticket = proc.stdout.readline().strip()
        name = ticket.partition(":")[0]
        b = ShmChannel.attach(ticket)
        b.send(b"ping")
        assert b.recv(timeout=10) == b"ping"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with pytest.raises(PeerGone):
            b.recv(timeout=5)
        with pytest.raises(PeerGone):
            b.send(b"anyone?")
        b.close()
    finally:
        proc.kill()
        proc.wait()
    assert not [n for n in leftover_names() if n.startswith(name)]


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_timeout_costs_no_extra_loop_turn_on_a_wake_up(loop_kind):
    """Every verify / propose over the ring waits with a timeout (the step timeout, the request's
    deadline): the doorbell must wake the waiting task as soon as without one (asyncio.wait_for added
    a future and a loop turn per wake-up)."""
    cfg = RingConfig(capacity=4096, spin_us=0.0)

    async def turns_to_wake(timeout: float | None) -> list[int]:
        a, b = pair(cfg)
        await a.wait_attached(5)
        counts = []
        try:
            for _ in range(3):
                task = asyncio.ensure_future(a.arecv(timeout))
                for _ in range(5):
                    await asyncio.sleep(0)
                assert not task.done()
                b.send(b"ping")
                turns = 0
                while not task.done():
                    await asyncio.sleep(0)
                    turns += 1
                assert task.result() == b"ping"
                counts.append(turns)
        finally:
            a.close()
            b.close()
        return counts

    async def both():
        return await turns_to_wake(None), await turns_to_wake(30.0)

    if loop_kind == "uvloop":
        import uvloop

        untimed, timed = uvloop.run(both())
    else:
        untimed, timed = asyncio.run(both())
    assert timed == untimed, (timed, untimed)


def test_try_send_from_another_thread_is_all_or_nothing_and_refuses_a_closed_end():
    a, b = pair(RingConfig(capacity=256, spin_us=0.0))
    try:
        sent: list[bool] = []
        t = threading.Thread(target=lambda: sent.extend([a.try_send(b"x" * 100), a.try_send(b"y" * 200)]))
        t.start()
        t.join(5)
        assert sent == [True, False]  # the second does not fit beside the first: nothing of it is written
        assert b.recv(timeout=5) == b"x" * 100
        assert a.try_send(b"y" * 200)  # room again once read
        assert b.recv(timeout=5) == b"y" * 200
        with pytest.raises(RingTimeout):
            b.recv(timeout=0.05)
    finally:
        a.close()
        b.close()
    assert not a.try_send(b"z")  # closed


def test_try_send_racing_close_never_breaks_the_process():
    for _ in range(20):
        a, b = pair(RingConfig(capacity=4096, spin_us=0.0))
        stop = threading.Event()

        def spam() -> None:
            while not stop.is_set() and a.try_send(b"m" * 64):
                pass

        t = threading.Thread(target=spam)
        t.start()
        time.sleep(0.001)
        a.close()  # waits for a try_send in flight; later ones see the closed end
        stop.set()
        t.join(5)
        assert not t.is_alive() and not a.try_send(b"m")
        b.close()


def _raw_prefix(ch: ShmChannel, length: int, body: bytes = b"") -> None:
    """What a rogue peer writes: a length prefix (and maybe some of a body), bypassing its own checks."""
    ch._rings.write_some([memoryview(length.to_bytes(4, "little")), memoryview(body)], 0)
    ch._ring_peer()


def test_a_length_over_the_readers_limit_is_refused_before_anything_is_allocated():
    """A 4-byte frame saying 2^32 - 1 bytes: the reader refuses it at the prefix (before #33 it made a
    bytearray of the claimed length: 2 GiB committed by 4 bytes) and the channel is dropped."""
    import tracemalloc

    a, b = pair(RingConfig(max_message=1 << 20))
    tracemalloc.start()
    try:
        _raw_prefix(a, (1 << 32) - 1)
        with pytest.raises(MessageTooLarge, match="4294967295 bytes"):
            b.recv(timeout=2)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    with pytest.raises(RingError):
        b.recv(timeout=0.1)
    a.close()
    b.close()


def test_a_message_buffer_grows_only_with_the_bytes_that_arrived():
    """A prefix within the limit whose body never comes: the reader holds what arrived, not the claim."""
    import tracemalloc

    a, b = pair(RingConfig(capacity=1 << 16))
    tracemalloc.start()
    try:
        _raw_prefix(a, 400 << 20, b"x" * 1000)  # claims 400 MiB, sends 1000 bytes
        with pytest.raises(RingTimeout):
            b.recv(timeout=0.2)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    a.close()
    b.close()


def test_the_writer_refuses_a_message_over_the_peers_limit_and_the_channel_goes_on():
    a = ShmChannel.create(RingConfig(max_message=1000))
    b = attach_beside(a, RingConfig(max_message=500))
    with pytest.raises(MessageTooLarge, match="limit of 500"):
        a.send(b"x" * 501)
    assert not a.try_send(b"x" * 501)
    with pytest.raises(MessageTooLarge, match="limit of 1000"):
        b.send(b"y" * 1001)
    a.send(b"x" * 500)
    assert b.recv(timeout=2) == b"x" * 500
    b.send(b"y" * 1000)
    assert a.recv(timeout=2) == b"y" * 1000
    a.close()
    b.close()


def test_an_attach_nobody_answers_leaves_no_fd() -> None:
    """A name with no socket behind it, and a socket whose creator never hands a segment over: OSError, and the
    attacher holds no descriptor after (the connection is closed again)."""
    from specserve.runtime.shm_layout import unlink_names
    from specserve.runtime.shm_memfd import listen_at

    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        ShmChannel.attach("specserve-" + "1" * 24 + ":" + "00" * 32, timeout=1)
    name = "specserve-" + os.urandom(12).hex()
    silent = listen_at(name)  # listens, never accepts
    try:
        t0 = time.monotonic()
        with pytest.raises(OSError):
            ShmChannel.attach(f"{name}:{'00' * 32}", timeout=0.3)
        assert time.monotonic() - t0 < 3
        assert len(os.listdir("/proc/self/fd")) == before + 1  # the silent listener only
    finally:
        silent.close()
        unlink_names(name)  # the attacher leaves a name it could not use (it may not be the one it is for)
