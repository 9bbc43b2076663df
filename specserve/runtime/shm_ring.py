"""A duplex shared-memory channel between two processes of one host: two single-producer /
single-consumer rings of length-prefixed messages in one ``multiprocessing.shared_memory`` segment,
and a doorbell per side. The segment's layout, ``RingConfig``, and the names in /dev/shm (with who
unlinks them when) are specserve/runtime/shm_layout.py.

A message is a u32 length and its bytes, written as a byte stream modulo C (it may wrap); one larger
than C goes through in pieces while the reader drains it (back-pressure: the writer waits for room).
Each end refuses an incoming length above its own ``RingConfig.max_message`` (by default the services'
gRPC message limit) before it allocates anything, and grows a message's buffer only with bytes that
have arrived: a peer cannot make a reader commit memory it did not send. A writer checks the
reader's published limit first (``MessageTooLarge``, nothing written), as gRPC refuses a message
over the peer's limit. Head and tail only grow; the writer stores the bytes before it publishes the head, the reader
reads the bytes before it publishes the tail (aligned 8-byte stores are atomic and stay in order on
x86-64; other CPUs are not claimed).

Doorbell: each side owns a FIFO (``mkfifo``, opened by name) that its peer writes one byte to after
publishing data (or room its writer waits for). A reader first spins on the head for
``RingConfig.spin_us`` (the answer is often already there), then blocks on its FIFO: ``select`` in
the blocking API, the event loop's reader callback in the asyncio API. The FIFO doubles as the peer's
pulse: when the peer process ends, however it ends (SIGKILL included), the kernel closes its write
end, the reader sees end-of-file and gets ``PeerGone`` at once; writing to a peer whose read end is
gone also gives ``PeerGone``.

The blocking API (``send`` / ``recv``) and the asyncio API (``asend`` / ``arecv``) may not be mixed on
one channel end; each end is used by one thread (or one event loop) at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import select
import stat
import threading
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

from specserve.runtime.shm_layout import (
    CONTROL,
    HEAD,
    LEN,
    LIMIT,
    MAX_MESSAGE,
    NAME_PREFIX,
    RING_CTRL,
    TAIL,
    U32,
    U64,
    WAITING,
    RingConfig,
    fifo_path,
    reserve,
    unlink_names,
)


class RingError(ConnectionError):
    """The channel cannot be used (closed, or a length that no peer of ours writes)."""


class PeerGone(RingError):
    """The peer process ended or closed its end of the channel."""


class MessageTooLarge(RingError):
    """A message over the reader's limit: refused by the writer before anything is written (the
    channel stays usable), or by the reader at its length prefix (the channel is dropped)."""


class RingTimeout(TimeoutError):
    """No message (or no room) within the timeout."""


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(RingTimeout("no message within the timeout"))


class ShmChannel:
    """One end of a duplex channel. ``create`` on one side (it gets a ``name`` to hand over),
    ``attach(name)`` on the other."""

    def __init__(self, shm: SharedMemory, name: str, creator: bool, capacity: int, config: RingConfig) -> None:
        self.name = name
        self.creator = creator
        self.capacity = capacity
        self.max_message = config.max_message  # what this end reads
        self._spin_s = config.spin_us * 1e-6
        self._shm = shm
        self._buf = shm.buf
        self._out_ctrl, self._in_ctrl = (RING_CTRL[0], RING_CTRL[1]) if creator else (RING_CTRL[1], RING_CTRL[0])
        self._out_data = CONTROL + (0 if creator else capacity)
        self._in_data = CONTROL + (capacity if creator else 0)
        self._my_fd = -1  # my doorbell (read end)
        self._peer_fd = -1  # the peer's doorbell (write end)
        self._attached = False
        self._linked = creator  # the names still exist (the creator unlinks them if nobody attaches)
        self._closed = False
        self._peer_gone = False
        self._partial: bytearray | None = None  # a message being read: the bytes that have arrived of it
        self._partial_len = 0  # its length (from its prefix)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future | None = None
        self._send_lock = threading.Lock()  # try_send (any thread) against close

    # ------------------------------------------------------------------------------ set-up
    @classmethod
    def create(cls, config: RingConfig | None = None) -> ShmChannel:
        cfg = config or RingConfig()
        name = NAME_PREFIX + secrets.token_hex(12)
        shm = SharedMemory(name=name, create=True, size=CONTROL + 2 * cfg.capacity)
        # the names' lifetime is the channel's (the attacher unlinks them, or close does), not the process's
        resource_tracker.unregister(shm._name, "shared_memory")
        try:
            reserve(name, shm.size)
            shm.buf[:CONTROL] = bytes(CONTROL)
            for side in ("c", "a"):
                os.mkfifo(fifo_path(name, side), 0o600)
            ch = cls(shm, name, True, cfg.capacity, cfg)
            ch._put(ch._in_ctrl + LIMIT, cfg.max_message)
            ch._my_fd = os.open(fifo_path(name, "c"), os.O_RDONLY | os.O_NONBLOCK)
            # read-write: opening a FIFO's write end alone needs a reader there, and the attacher
            # unlinks the name as soon as it has opened it; what is written before it reads waits
            ch._peer_fd = os.open(fifo_path(name, "a"), os.O_RDWR | os.O_NONBLOCK)
        except BaseException:
            shm.close()
            unlink_names(name)
            raise
        return ch

    @classmethod
    def attach(cls, name: str, config: RingConfig | None = None) -> ShmChannel:
        """Open the peer's channel and unlink its names (raises OSError when it is not on this host,
        or its creator is gone)."""
        cfg = config or RingConfig()
        if not name.startswith(NAME_PREFIX) or "/" in name or len(name) > 64:
            raise RingError(f"not a specserve channel name: {name[:70]!r}")
        fifo = fifo_path(name, "c")
        if not stat.S_ISFIFO(os.stat(fifo).st_mode):
            raise RingError(f"{fifo} is not a FIFO")
        shm = SharedMemory(name=name, create=False)
        resource_tracker.unregister(shm._name, "shared_memory")  # the creator's, not ours to unlink at exit
        try:
            capacity = (shm.size - CONTROL) // 2  # the creator's (the attacher's config sets only the spin)
            if capacity < 64 or capacity % 8 or shm.size != CONTROL + 2 * capacity:
                raise RingError(f"segment {name} of {shm.size} bytes is not a channel")
            ch = cls(shm, name, False, capacity, cfg)
            ch._put(ch._in_ctrl + LIMIT, cfg.max_message)
            ch._my_fd = os.open(fifo_path(name, "a"), os.O_RDONLY | os.O_NONBLOCK)
            ch._peer_fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: the creator closed its end
        except BaseException:
            if "ch" in locals():
                ch._close_fds()
            shm.close()
            unlink_names(name)
            raise
        unlink_names(name)  # both sides hold everything now: nothing stays in /dev/shm
        ch._attached = True
        ch._ring_peer()  # tells the creator we are here
        return ch

    def _on_attached(self) -> None:
        """Creator: the peer rang for the first time (it has unlinked the names)."""
        self._attached = True
        if self._linked:
            self._linked = False
            unlink_names(self.name)  # the attacher did; this only makes sure

    @property
    def attached(self) -> bool:
        return self._attached

    # ---------------------------------------------------------------------------- ring words
    def _get(self, off: int) -> int:
        return U64.unpack_from(self._buf, off)[0]

    def _put(self, off: int, value: int) -> None:
        U64.pack_into(self._buf, off, value)

    def _readable(self) -> int:
        return self._get(self._in_ctrl + HEAD) - self._get(self._in_ctrl + TAIL)

    def _room(self) -> int:
        return self.capacity - (self._get(self._out_ctrl + HEAD) - self._get(self._out_ctrl + TAIL))

    # ----------------------------------------------------------------------------- doorbell
    def _ring_peer(self) -> None:
        try:
            os.write(self._peer_fd, b"\x01")
        except BlockingIOError:
            pass  # the FIFO is full of unread rings: the peer wakes anyway
        except (BrokenPipeError, OSError) as exc:
            self._peer_gone = True
            raise PeerGone(f"shared-memory peer went away: {exc}") from None

    def _drain_doorbell(self) -> None:
        """Consume my doorbell's bytes; end-of-file means the peer is gone."""
        while True:
            try:
                data = os.read(self._my_fd, 4096)
            except BlockingIOError:
                return
            if not data:  # every writer closed: the peer came (select saw it) and went
                self._peer_gone = True
                return
            if not self.attached:
                self._on_attached()
            if len(data) < 4096:
                return

    def _check_usable(self) -> None:
        if self._closed:
            raise RingError("the channel is closed")
        if self._peer_gone:
            raise PeerGone("shared-memory peer went away")

    # ------------------------------------------------------------------------ non-blocking
    def _write_some(self, parts: list[memoryview], done: int) -> int:
        """Copy what fits of the concatenated parts from byte ``done`` on; publish; return bytes written."""
        room = self._room()
        if room <= 0:
            return 0
        head = self._get(self._out_ctrl + HEAD)
        wrote, skip = 0, done
        for part in parts:
            if skip >= len(part):
                skip -= len(part)
                continue
            chunk = part[skip : skip + (room - wrote)]
            skip = 0
            pos = (head + wrote) % self.capacity
            first = min(len(chunk), self.capacity - pos)
            base = self._out_data
            self._buf[base + pos : base + pos + first] = chunk[:first]
            if first < len(chunk):
                self._buf[base : base + len(chunk) - first] = chunk[first:]
            wrote += len(chunk)
            if wrote >= room:
                break
        self._put(self._out_ctrl + HEAD, head + wrote)
        return wrote

    def _read_into(self, dst: memoryview, n: int) -> None:
        tail = self._get(self._in_ctrl + TAIL)
        pos = tail % self.capacity
        first = min(n, self.capacity - pos)
        base = self._in_data
        dst[:first] = self._buf[base + pos : base + pos + first]
        if first < n:
            dst[first:n] = self._buf[base : base + n - first]
        self._put(self._in_ctrl + TAIL, tail + n)

    def _read_append(self, dst: bytearray, n: int) -> None:
        """Append the next n bytes of the ring to dst (it grows by what has arrived, never ahead of it)."""
        tail = self._get(self._in_ctrl + TAIL)
        pos = tail % self.capacity
        first = min(n, self.capacity - pos)
        base = self._in_data
        dst += self._buf[base + pos : base + pos + first]
        if first < n:
            dst += self._buf[base : base + n - first]
        self._put(self._in_ctrl + TAIL, tail + n)

    def _try_read(self) -> bytes | None:
        """A whole message if one is there (consumes what is there of a longer one)."""
        freed = False
        while True:
            avail = self._readable()
            if self._partial is None:
                if avail < LEN:
                    break
                hdr = bytearray(LEN)
                self._read_into(memoryview(hdr), LEN)
                freed = True
                (length,) = U32.unpack(hdr)
                if length > self.max_message:  # refused before a byte of it is allocated
                    self._peer_gone = True
                    raise MessageTooLarge(f"the peer sent a message of {length} bytes; this end reads at most "
                                          f"{self.max_message}")
                self._partial, self._partial_len = bytearray(), length
                avail -= LEN
            n = min(self._partial_len - len(self._partial), avail)
            if n:
                self._read_append(self._partial, n)
                freed = True
            if len(self._partial) == self._partial_len:
                msg, self._partial = bytes(self._partial), None
                self._wake_waiting_writer(freed)
                return msg
            if not n:
                break
        self._wake_waiting_writer(freed)
        return None

    def _can_read(self) -> bool:
        """A read would make progress (a length prefix is read whole)."""
        return self._readable() >= (LEN if self._partial is None else 1)

    def _try_read_usable(self) -> bytes | None:
        """A whole message if one is there; a message the peer wrote before it went is still read."""
        if self._closed:
            raise RingError("the channel is closed")
        msg = self._try_read()
        if msg is None:
            self._check_usable()
        return msg

    def _wake_waiting_writer(self, freed: bool) -> None:
        if freed and self._get(self._in_ctrl + WAITING) and self.attached:
            self._put(self._in_ctrl + WAITING, 0)
            with contextlib.suppress(PeerGone):  # a writer that went: the next call says so
                self._ring_peer()

    def _spin(self, ready) -> bool:
        if self._spin_s <= 0:
            return ready()
        end = time.perf_counter() + self._spin_s
        while True:
            if ready():
                return True
            if time.perf_counter() >= end:
                return False

    @staticmethod
    def _left(deadline: float | None) -> float | None:
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise RingTimeout("no message within the timeout")
        return left

    def peer_max_message(self) -> int:
        """The largest message the peer reads (what it published; a u32 length's most before it has)."""
        return self._get(self._out_ctrl + LIMIT) or MAX_MESSAGE

    def _frame(self, payload: bytes | bytearray | memoryview) -> list[memoryview]:
        view = memoryview(payload).cast("B")
        limit = self.peer_max_message()
        if len(view) > limit:
            raise MessageTooLarge(f"a message of {len(view)} bytes exceeds the peer's limit of {limit}")
        return [memoryview(U32.pack(len(view))), view]

    # ------------------------------------------------------------------------------ blocking
    def _block(self, deadline: float | None) -> None:
        left = self._left(deadline)
        readable, _, _ = select.select([self._my_fd], [], [], left)
        if readable:
            self._drain_doorbell()

    def _send_steps(self, payload: bytes | bytearray | memoryview) -> Iterator[None]:
        """Write one message, ringing the peer after every part written; yield whenever the ring stays full
        past the spin (the caller then waits for the reader's doorbell, capped by _waiting_deadline)."""
        self._check_usable()
        parts = self._frame(payload)
        total, done = sum(len(p) for p in parts), 0
        while True:
            done += self._write_some(parts, done)
            self._ring_peer()
            if done == total:
                return
            self._put(self._out_ctrl + WAITING, 1)
            if not self._spin(lambda: self._room() > 0):
                yield
                self._check_usable()

    @staticmethod
    def _waiting_deadline(deadline: float | None) -> float:
        """A full ring's doorbell wait: the waiting flag and the reader's check can cross (no store-load fence
        from Python), so the wait is capped and a missed ring costs at most 1 ms, never a hang."""
        return min(deadline or float("inf"), time.monotonic() + 1e-3)

    def send(self, payload: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in self._send_steps(payload):
            with contextlib.suppress(RingTimeout):
                self._block(self._waiting_deadline(deadline))
            self._left(deadline)

    def recv(self, timeout: float | None = None) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            msg = self._try_read_usable()
            if msg is not None:
                return msg
            if self._spin(self._can_read):
                continue
            self._block(deadline)

    def try_send(self, payload: bytes | bytearray | memoryview) -> bool:
        """Send a whole message now if the ring has room for it, from any thread (while no other
        thread or loop sends on this end); False, and nothing written, when it has not or the channel
        is closed or its peer gone."""
        with self._send_lock:
            if self._closed or self._peer_gone:
                return False
            try:
                parts = self._frame(payload)
            except MessageTooLarge:
                return False  # the loop's send says so
            if self._room() < sum(len(p) for p in parts):
                return False
            self._write_some(parts, 0)
            try:
                self._ring_peer()
            except PeerGone:
                return True  # written; the peer went (the next read or write says so)
            return True

    # ------------------------------------------------------------------------------- asyncio
    def _on_doorbell(self) -> None:
        self._drain_doorbell()
        if self._peer_gone and self._loop is not None:
            self._loop.remove_reader(self._my_fd)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _await_doorbell(self, deadline: float | None) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._my_fd)
            self._loop = loop
            loop.add_reader(self._my_fd, self._on_doorbell)
        left = self._left(deadline)
        self._waiter = waiter = loop.create_future()
        # the timeout is a timer on the waiter itself: asyncio.wait_for would add a second future and
        # a loop turn between the doorbell and this task on every wake-up
        timer = None if left is None else loop.call_later(left, _expire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def wait_attached(self, timeout: float | None = None) -> None:
        """Creator: until the peer attaches (RingTimeout when it does not in time)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.attached:
            self._check_usable()
            await self._await_doorbell(deadline)
        self._check_usable()

    async def asend(self, payload: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in self._send_steps(payload):
            with contextlib.suppress(RingTimeout):
                await self._await_doorbell(self._waiting_deadline(deadline))
            self._left(deadline)

    async def arecv(self, timeout: float | None = None) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            msg = self._try_read_usable()
            if msg is not None:
                return msg
            if self._spin(self._can_read):
                continue
            await self._await_doorbell(deadline)

    # ------------------------------------------------------------------------------- closing
    def _close_fds(self) -> None:
        if self._loop is not None and self._my_fd >= 0 and not self._loop.is_closed():
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._my_fd)
        for fd in (self._my_fd, self._peer_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._my_fd = self._peer_fd = -1

    def close(self) -> None:
        """Close this end (the peer sees PeerGone); unlink the names if nobody attached."""
        if self._closed:
            return
        with self._send_lock:  # a try_send in flight on another thread ends first
            self._closed = True
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_exception(RingError("the channel is closed"))
            self._close_fds()
            self._buf = None
            self._partial = None  # what had arrived of a message goes with the channel
            with contextlib.suppress(BufferError):
                self._shm.close()
        if self._linked:
            self._linked = False
            unlink_names(self.name)

    @property
    def closed(self) -> bool:
        return self._closed
