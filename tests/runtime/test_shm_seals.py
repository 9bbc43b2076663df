"""#44: no channel end maps memory whose size its peer controls (specserve/runtime/shm_memfd.py, shm_ring.py). The
segment a creator hands over is a memfd sealed against resizing: its own creator cannot shrink it under the
attacher's mapping (before: a draft truncated its ring to 0 bytes and the gateway died of SIGBUS at the next read),
and an attacher refuses, unmapped, any descriptor that is not such a segment of a channel's size."""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
import threading

import pytest

from specserve.bench.soak_hostile import segment_fds
from specserve.runtime.shm_doorbell import RING_TAG
from specserve.runtime.shm_layout import CONTROL, SHM_DIR
from specserve.runtime.shm_memfd import SEALS, listen_at, send_fds
from specserve.runtime.shm_ring import RingError, ShmChannel

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this host")


def test_the_creator_cannot_shrink_its_segment_under_the_attacher():
    """What a hostile draft did to its ring: it kept the segment's descriptor and truncated it to 0 once the gateway
    had mapped it. Now the truncation fails (EPERM) and the attacher reads on (before: SIGBUS in the attacher)."""
    before = segment_fds()
    a = ShmChannel.create()
    kept = [os.dup(fd) for fd in segment_fds() - before]  # what a hostile creator would keep
    assert kept, "the creator holds its segment's descriptor until the hand-over"
    got: list = []
    t = threading.Thread(target=lambda: got.append(ShmChannel.attach(a.ticket)))
    t.start()
    a.accept(timeout=10)
    t.join(10)
    b = got[0]
    try:
        for fd in kept:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
        a.send(b"after the try")
        assert b.recv(timeout=5) == b"after the try"  # the attacher's mapping is whole
    finally:
        for fd in kept:
            os.close(fd)
        a.close()
        b.close()


def _unsealed(size: int) -> int:
    fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    return fd


def _sealed(size: int) -> int:
    fd = _unsealed(size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def _read_end() -> int:
    r, w = os.pipe()
    os.close(w)
    return r


def _named(size: int) -> int:
    fd, path = tempfile.mkstemp(dir=SHM_DIR, prefix="hostile-")
    os.unlink(path)
    os.ftruncate(fd, size)
    return fd


@pytest.mark.parametrize(
    "offered, refusal",
    [
        (lambda: _unsealed(CONTROL + 2 * 4096), "not sealed"),  # a memfd its maker can still truncate
        (lambda: _named(CONTROL + 2 * 4096), "not sealed"),  # a file of /dev/shm (what a channel was before)
        (lambda: _read_end(), "not a memory file"),
        (lambda: _sealed(CONTROL + 2 * 4096 + 8), "is not a channel"),  # sealed, not a channel's size
        (lambda: _sealed(0), "is not a channel"),
    ],
)
def test_the_attacher_maps_nothing_it_cannot_trust(offered, refusal):
    """A hostile creator hands over its own descriptor at the channel's socket: RingError naming why, before any
    mmap (the attacher holds no mapping and no descriptor after)."""
    name = "specserve-" + os.urandom(12).hex()
    listener = listen_at(name)
    fd = offered()

    def hand_over() -> None:
        listener.setblocking(True)
        conn, _ = listener.accept()
        with conn:
            conn.recv(64)  # whatever key it presents
            r, w = os.pipe()
            send_fds(conn, [fd, r, w], RING_TAG)  # the segment, then the attacher's two doorbell ends
            os.close(r)
            os.close(w)
            conn.recv(1)  # until the attacher hangs up

    t = threading.Thread(target=hand_over)
    t.start()
    maps_before = open("/proc/self/maps").read().count("memfd:hostile")
    fds_before = len(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(RingError, match=refusal):
            ShmChannel.attach(f"{name}:{'00' * 32}", timeout=5)
        t.join(5)
        assert open("/proc/self/maps").read().count("memfd:hostile") == maps_before
        assert len(os.listdir("/proc/self/fd")) == fds_before
    finally:
        listener.close()
        os.close(fd)
        (SHM_DIR / name).unlink(missing_ok=True)


def test_a_caller_without_the_key_gets_nothing_and_the_offer_stays():
    """/dev/shm is world-listable: whoever connects to a channel's socket with another key is hung up on, holds no
    descriptor, and the attacher with the ticket still attaches."""
    a = ShmChannel.create()
    name = a.name
    got: list = []

    def intruder_then_attacher() -> None:
        with pytest.raises(OSError):
            ShmChannel.attach(f"{name}:{'ab' * 32}", timeout=5)
        got.append(ShmChannel.attach(a.ticket, timeout=5))

    t = threading.Thread(target=intruder_then_attacher)
    t.start()
    a.accept(timeout=10)
    t.join(10)
    b = got[0]
    b.send(b"mine")
    assert a.recv(timeout=5) == b"mine"
    a.close()
    b.close()


def test_doorbells_that_are_not_a_pipes_ends_are_refused():
    """A sealed segment, but a socket and a file where the attacher's two doorbell ends go: refused (OSError),
    nothing mapped and no descriptor kept (a blocking or bogus doorbell would hang or fool the attacher)."""
    name = "specserve-" + os.urandom(12).hex()
    listener = listen_at(name)
    fd = _sealed(CONTROL + 2 * 4096)
    left, right = socket.socketpair()
    named = _named(8)

    def hand_over() -> None:
        listener.setblocking(True)
        conn, _ = listener.accept()
        with conn:
            conn.recv(64)
            send_fds(conn, [fd, left.fileno(), named], RING_TAG)
            conn.recv(1)

    t = threading.Thread(target=hand_over)
    t.start()
    fds_before = len(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(OSError, match="not a pipe"):
            ShmChannel.attach(f"{name}:{'00' * 32}", timeout=5)
        t.join(5)
        assert len(os.listdir("/proc/self/fd")) == fds_before
    finally:
        listener.close()
        for x in (fd, named):
            os.close(x)
        left.close()
        right.close()
        (SHM_DIR / name).unlink(missing_ok=True)
