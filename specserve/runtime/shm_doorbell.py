"""The doorbells of one shared-memory channel end (specserve/runtime/shm_ring.py is the channel).

Each side owns a FIFO (``mkfifo``, opened by name) that its peer writes one byte to after publishing data (or
room its writer waits for). A reader first spins on the head for ``RingConfig.spin_us`` (the answer is often
already there), then blocks on its FIFO: ``select`` in the blocking API, the event loop's reader callback in the
asyncio API. The FIFO doubles as the peer's pulse: when the peer process ends, however it ends (SIGKILL
included), the kernel closes its write end, the reader sees end-of-file and gets ``PeerGone`` at once; writing to
a peer whose read end is gone also gives ``PeerGone``.
"""

from __future__ import annotations

import contextlib
import os

from specserve.runtime.shm_layout import fifo_path


class Doorbell:
    """This end's FIFO (``fd``, the read end) and the peer's (``peer_fd``, the write end); -1 while not open."""

    def __init__(self) -> None:
        self.fd = -1  # my doorbell (read end)
        self.peer_fd = -1  # the peer's doorbell (write end)

    def open_creator(self, name: str) -> None:
        # read-write: opening a FIFO's write end alone needs a reader there, and the attacher
        # unlinks the name as soon as it has opened it; what is written before it reads waits
        self._open(fifo_path(name, "c"), fifo_path(name, "a"), os.O_RDWR)

    def open_attacher(self, name: str) -> None:
        self._open(fifo_path(name, "a"), fifo_path(name, "c"), os.O_WRONLY)  # ENXIO: the creator closed its end

    def _open(self, mine, peers, peer_mode: int) -> None:
        """Both ends, or neither: a failed second open closes the first (no fd is left behind)."""
        try:
            self.fd = os.open(mine, os.O_RDONLY | os.O_NONBLOCK)
            self.peer_fd = os.open(peers, peer_mode | os.O_NONBLOCK)
        except BaseException:
            self.close()
            raise

    def ring(self) -> None:
        """One byte to the peer; OSError (BrokenPipeError, ...) when its read end is gone."""
        try:
            os.write(self.peer_fd, b"\x01")
        except BlockingIOError:
            pass  # the FIFO is full of unread rings: the peer wakes anyway

    def drain(self) -> tuple[bool, bool]:
        """Consume my doorbell's bytes: (whether the peer rang, whether it is gone: end-of-file)."""
        rang = False
        while True:
            try:
                data = os.read(self.fd, 4096)
            except BlockingIOError:
                return rang, False
            if not data:  # every writer closed: the peer came (select saw it) and went
                return rang, True
            rang = True
            if len(data) < 4096:
                return rang, False

    def close(self) -> None:
        for fd in (self.fd, self.peer_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd = self.peer_fd = -1
