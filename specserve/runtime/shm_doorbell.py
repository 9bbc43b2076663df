"""The doorbells of one shared-memory channel end, and the hand-over of its segment (specserve/runtime/shm_ring.py is
the channel).

The creator listens on a Unix socket at /dev/shm/<channel name> (``listen``). The attacher connects (``connect``),
presents the channel's key (its ticket, ``name:key``, came in the service's reply) and gets three descriptors over
the socket (SCM_RIGHTS, one byte carrying them: specserve/runtime/shm_memfd.py): the channel's sealed memfd, the read
end of its own doorbell and the write end of the creator's. The creator hands them over to the caller with the key
(``accept``: in whatever wait the creator is in, ``wait_attached`` or a ``recv``), keeps the other two ends, and
closes the socket and removes the name. A caller with another key is hung up on and the offer stays.

Each side's doorbell is then a pipe that its peer writes one byte to after publishing data (or room its writer waits
for). A reader first spins on the head for ``RingConfig.spin_us`` (the answer is often already there), then blocks on
its pipe: ``select`` in the blocking API, the event loop's reader callback in the asyncio API. (Pipes, not the
socket: a pipe's wake-up is the cheaper one, and the ring's round trip is the data plane's cost.) The pipe doubles
as the peer's pulse: each side holds the only write end of the other's, so when the peer process ends, however it
ends (SIGKILL included), the kernel closes it, the reader sees end-of-file and gets ``PeerGone`` at once; writing
to a peer whose read end is gone also gives ``PeerGone``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat

from specserve.runtime.shm_memfd import (
    KEY_BYTES,
    SegmentRefused,
    ask_for_fds,
    close_all,
    key_matches,
    listen_at,
    send_fds,
)

RING_TAG = b"R"  # the hand-over byte of a ring's segment (a hidden buffer's is another: hidden_fds.py)


class Doorbell:
    """This end's doorbell: ``fd`` (my pipe's read end: what a wait watches; before the hand-over, the creator's
    listener or a caller whose key has not all arrived) and ``peer_fd`` (the write end of the peer's; -1 until
    there)."""

    def __init__(self) -> None:
        self._listener: socket.socket | None = None
        self._key = b""
        self._candidate: socket.socket | None = None  # accepted, its key still arriving
        self._got = b""
        self._fd = -1
        self.peer_fd = -1

    @property
    def fd(self) -> int:
        if self._fd >= 0:
            return self._fd
        sock = self._candidate or self._listener
        return -1 if sock is None else sock.fileno()

    @property
    def listening(self) -> bool:
        return self._fd < 0 and self._listener is not None

    @property
    def connected(self) -> bool:
        return self._fd >= 0

    def listen(self, name: str, key: bytes) -> None:
        self._listener, self._key = listen_at(name), key

    def accept(self, segment_fd: int) -> bool:
        """Creator: advance the hand-over without blocking: take a caller, read its key, and hand the one whose key
        is the channel's the segment and its two pipe ends (True then; the listener closes: one attacher a
        channel). A caller with another key, or one that hangs up, is dropped and the offer stays."""
        if self._candidate is None:
            try:
                self._candidate, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return False
            self._candidate.setblocking(False)
            self._got = b""
        try:
            data = self._candidate.recv(KEY_BYTES - len(self._got))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        self._got += data
        if data and len(self._got) < KEY_BYTES:
            return False  # the rest of the key is on its way
        conn, self._candidate = self._candidate, None
        with conn:
            if not data or not key_matches(self._got, self._key):
                return False
            mine_r, theirs_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # my doorbell: the attacher rings it
            theirs_r, mine_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # the attacher's: I ring it
            try:
                send_fds(conn, [segment_fd, theirs_r, theirs_w], RING_TAG)
            except OSError:  # it hung up already: its pipe ends close with it (the next wait says it went)
                pass
            finally:
                close_all((theirs_r, theirs_w))  # only the attacher holds them now: its exit closes them
        self._listener.close()
        self._listener = None
        self._fd, self.peer_fd = mine_r, mine_w
        return True

    def connect(self, name: str, key: bytes, timeout: float) -> int:
        """Attacher: connect, present the key and receive the segment's descriptor (returned: the caller checks and
        closes it) and this end's two pipe ends. OSError when nobody offers that name here, the key is not its, or
        nothing comes within ``timeout``; SegmentRefused when what comes is not a segment and two pipe ends."""
        conn, fds = ask_for_fds(name, key, RING_TAG, 3, timeout)
        conn.close()
        segment, mine_r, peer_w = fds
        if not (_pipe_end(mine_r, os.O_RDONLY) and _pipe_end(peer_w, os.O_WRONLY)):
            close_all(fds)
            raise SegmentRefused(f"{name} handed over doorbells that are not a pipe's read and write ends")
        for fd in (mine_r, peer_w):
            os.set_blocking(fd, False)
        self._fd, self.peer_fd = mine_r, peer_w
        return segment

    def ring(self) -> None:
        """One byte to the peer; OSError (BrokenPipeError, ...) when its read end is gone; nothing before it came."""
        if self.peer_fd < 0:
            return  # the attacher reads the ring when it comes
        try:
            os.write(self.peer_fd, b"\x01")
        except BlockingIOError:
            pass  # the pipe is full of unread rings: the peer wakes anyway

    def drain(self) -> tuple[bool, bool]:
        """Consume my doorbell's bytes: (whether the peer rang, whether it is gone: end-of-file)."""
        rang = False
        while True:
            try:
                data = os.read(self._fd, 4096)
            except BlockingIOError:
                return rang, False
            if not data:  # every writer closed: the peer went
                return rang, True
            rang = True
            if len(data) < 4096:
                return rang, False

    def close(self) -> None:
        for sock in (self._listener, self._candidate):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self._listener = self._candidate = None
        close_all([fd for fd in (self._fd, self.peer_fd) if fd >= 0])
        self._fd = self.peer_fd = -1


def _pipe_end(fd: int, mode: int) -> bool:
    return stat.S_ISFIFO(os.fstat(fd).st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == mode


def close_fd(fd: int) -> int:
    """Close a descriptor if open; returns -1 (to store)."""
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
    return -1
