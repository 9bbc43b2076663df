"""Shared memory whose size no peer can change, and how it travels between processes.

A segment is a memfd sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``): once
sealed, nobody (its maker included) can truncate it, so a page of a mapping of it never goes away under a reader,
and a read never raises SIGBUS. It has no name: its file descriptor is handed over a Unix socket (SCM_RIGHTS), and
the receiver checks the seals and the size (``fstat``) before it maps anything (``check_sealed``). A descriptor
that is not a sealed memfd, or not of the size expected, is refused unmapped (``SegmentRefused``).

The sockets live in /dev/shm (``specserve-<96-bit random token>``, mode 0600): whoever can connect to one sees the
maker's /dev/shm, which is what a data plane of one host needs (``hidden_share.host_id``). /dev/shm is
world-listable, so a name is no secret: whoever connects first presents the segment's 256-bit random key
(``ask_for_fds``), and the owner hands the descriptor only to a caller that presents it (a wrong key is hung up on,
and the offer stays for its rightful taker). The hand-over's byte says what the descriptor is (a ring's, a hidden
buffer's), so a name handed to the wrong taker opens nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import mmap
import os
import socket
import stat

from specserve.runtime.shm_layout import SHM_DIR

KEY_BYTES = 32  # what an owner asks before it hands a descriptor over (a random key per segment)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # what a segment we map must carry


class SegmentRefused(OSError):
    """A descriptor that is not a sealed segment of the expected size (nothing was mapped)."""


class HungUp(ConnectionError):
    """The owner of a hand-over socket hung up before it handed anything over (a key it does not know)."""


def make_sealed(label: str, size: int) -> int:
    """A new memfd of ``size`` bytes, its pages allocated now (no room is an OSError here, never a SIGBUS later),
    sealed against any change of size. Returns the descriptor (the caller closes it)."""
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_sealed(fd: int) -> int:
    """The size of a segment received from a peer, after checking that nobody can change it (SegmentRefused if not:
    a file of a name, a socket, a memfd without the seals)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SegmentRefused("the descriptor handed over is not a memory file")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # EINVAL: a file that cannot carry seals (not a memfd)
        raise SegmentRefused("the segment handed over cannot be sealed (not a memfd)") from None
    if seals & SEALS != SEALS:
        raise SegmentRefused(
            f"the segment handed over is not sealed against resizing (seals {seals:#x}, needs {SEALS:#x})"
        )
    return st.st_size


class Segment:
    """A read-write shared mapping of a whole sealed segment: ``buf`` (a memoryview of ``size`` bytes). ``close``
    unmaps it, unless a buffer export of it still lives (then the mapping goes with the last one, as
    ``multiprocessing.shared_memory`` does)."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf: memoryview | None = memoryview(self._mmap)

    def close(self) -> None:
        """Raises BufferError while a view exported from ``buf`` lives (the caller decides whether that matters)."""
        if self.buf is not None:
            self.buf.release()  # BufferError: something still views it
            self.buf = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


# ------------------------------------------------------------------------------------------------- hand-over
def socket_path(name: str):
    return SHM_DIR / name


def listen_at(name: str, backlog: int = 1) -> socket.socket:
    """A listening Unix socket at /dev/shm/<name>, mode 0600 before anyone can connect (non-blocking)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(str(socket_path(name)))
    except BaseException:
        sock.close()  # the name was not made here: nothing to remove
        raise
    try:
        os.chmod(socket_path(name), 0o600)  # connect() needs write permission; nobody can before listen()
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            socket_path(name).unlink()
        raise
    return sock


def ask_for_fds(name: str, key: bytes, tag: bytes, count: int, timeout: float) -> tuple[socket.socket, list[int]]:
    """Connect to the socket at /dev/shm/<name>, present ``key``, and take the ``count`` descriptors its owner hands
    over with ``tag`` (a ring's and a hidden buffer's differ: neither is ever taken for the other). Returns the
    connection (blocking, ``timeout`` a call) and the descriptors; the caller checks them (``check_sealed``) and
    closes them all. OSError when nobody listens there or nothing comes within ``timeout``; HungUp when the owner
    hangs up (a key it does not know); SegmentRefused when it hands over anything else (another tag, another
    count: whatever came is closed)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(str(socket_path(name)))
        sock.sendall(key)
        got, fds = recv_fds(sock, count)
    except BaseException:
        sock.close()
        raise
    if got != tag or len(fds) != count:
        close_all(fds)
        sock.close()
        raise SegmentRefused(
            f"{name} handed over {len(fds)} descriptors under tag {got!r} (expected {count} under {tag!r})"
        )
    return sock, fds


def key_matches(got: bytes, key: bytes) -> bool:
    return len(got) == len(key) and hmac.compare_digest(got, key)


def send_fds(sock: socket.socket, fds: list[int], tag: bytes) -> None:
    """One byte (``tag``) carrying ``fds`` (SCM_RIGHTS)."""
    socket.send_fds(sock, [tag], fds)


def recv_fds(sock: socket.socket, most: int) -> tuple[bytes, list[int]]:
    """One byte and the descriptors it carries (more than ``most`` are closed, and none is kept then); an
    end-of-file is HungUp."""
    data, fds, _, _ = socket.recv_fds(sock, 1, most + 1)
    if not data or len(fds) > most:
        close_all(fds)
        if not data:
            raise HungUp("the owner hung up without handing a segment over")
        return data, []
    return data, list(fds)


def close_all(fds) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
