"""A duplex shared-memory channel between two processes of one host: two single-producer /
single-consumer rings of length-prefixed messages in one sealed memfd segment, and a doorbell (a pipe) per
side. The segment's layout, ``RingConfig``, and the channel's name in /dev/shm (with who
unlinks it when) are specserve/runtime/shm_layout.py; the rings and their messages (framing, limits, the order
of stores) specserve/runtime/shm_rings.py; the doorbells (the peer's pulse) and the segment's hand-over (a Unix
socket) specserve/runtime/shm_doorbell.py; sealed segments specserve/runtime/shm_memfd.py; what it raises
specserve/runtime/shm_errors.py. This module is one end: making and attaching it, waiting (spin, then the
doorbell), and closing.

No end maps memory whose size its peer controls: the creator seals the segment against resizing before anyone
can see it, and the attacher maps only a segment whose seals and size it has checked, so a peer that tries to
shrink it under us (the SIGBUS of issue #44) gets EPERM.

The blocking API (``send`` / ``recv``) and the asyncio API (``asend`` / ``arecv``) may not be mixed on
one channel end; each end is used by one thread (or one event loop) at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import select
import threading
import time
from collections.abc import Iterator

from specserve.runtime.shm_doorbell import Doorbell, close_fd
from specserve.runtime.shm_errors import MessageTooLarge, PeerGone, RingError, RingTimeout
from specserve.runtime.shm_layout import CONTROL, NAME_PREFIX, RingConfig, unlink_names
from specserve.runtime.shm_memfd import KEY_BYTES, Segment, SegmentRefused, check_sealed, make_sealed
from specserve.runtime.shm_rings import Rings

_CHANNEL_NAME = re.compile(re.escape(NAME_PREFIX) + "[0-9a-f]{24}")  # what create makes: never a path
_KEY_HEX = re.compile(f"[0-9a-f]{{{2 * KEY_BYTES}}}")
ATTACH_TIMEOUT_S = 5.0  # an attacher waits this long for the creator to hand its segment over


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(RingTimeout("no message within the timeout"))


class ShmChannel:
    """One end of a duplex channel. ``create`` on one side (it gets a ``ticket`` to hand over),
    ``attach(ticket)`` on the other."""

    def __init__(self, shm: Segment, name: str, creator: bool, capacity: int, config: RingConfig) -> None:
        self.name = name  # its socket's name in /dev/shm
        self.ticket = ""  # creator: what the attacher needs, ``name:key`` (the service's reply carries it)
        self.creator = creator
        self.capacity = capacity
        self.max_message = config.max_message  # what this end reads
        self._spin_s = config.spin_us * 1e-6
        self._shm = shm
        self._rings = Rings(shm.buf, creator, capacity, config.max_message)
        self._bell = Doorbell()
        self._segment_fd = -1  # the creator's, until the attacher has it
        self._attached = False
        self._linked = creator  # the name still exists (the creator unlinks it if nobody attaches)
        self._closed = False
        self._peer_gone = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watched = -1  # the descriptor ``_loop`` watches for this end (the hand-over's, then the doorbell pipe)
        self._waiter: asyncio.Future | None = None
        self._send_lock = threading.Lock()  # try_send (any thread) against close

    # ------------------------------------------------------------------------------ set-up
    @classmethod
    def create(cls, config: RingConfig | None = None) -> ShmChannel:
        """Make the sealed segment and listen for the attacher at /dev/shm/<name> (OSError: no room, no /dev/shm)."""
        cfg = config or RingConfig()
        name, key = NAME_PREFIX + secrets.token_hex(12), secrets.token_bytes(KEY_BYTES)
        size = CONTROL + 2 * cfg.capacity
        fd = make_sealed("specserve-ring", size)
        try:
            shm = Segment(fd, size)
        except BaseException:
            os.close(fd)
            raise
        ch = cls(shm, name, True, cfg.capacity, cfg)
        ch._segment_fd = fd
        ch.ticket = f"{name}:{key.hex()}"
        try:
            ch._rings.publish_limit()
            ch._bell.listen(name, key)
        except BaseException:
            ch._linked = False  # listen removes what it made
            ch.close()
            raise
        return ch

    @classmethod
    def attach(cls, ticket: str, config: RingConfig | None = None, timeout: float = ATTACH_TIMEOUT_S) -> ShmChannel:
        """Connect to the creator's socket with the ticket's key, take its segment and map it once its seals and
        size say nobody can shrink it, and unlink the name. Raises OSError when it is not on this host or its
        creator is gone (or does not hand it over within ``timeout``, or knows another key), RingError when the
        ticket is malformed or what it hands over is no sealed channel segment."""
        cfg = config or RingConfig()
        name, _, key_hex = ticket.partition(":")
        if not _CHANNEL_NAME.fullmatch(name) or not _KEY_HEX.fullmatch(key_hex):
            raise RingError(f"not a specserve channel ticket: {ticket[:70]!r}")
        bell = Doorbell()
        fd = -1
        try:
            fd = bell.connect(name, bytes.fromhex(key_hex), timeout)
            try:
                size = check_sealed(fd)
            except SegmentRefused as exc:
                raise RingError(f"channel {name}: {exc}") from None
            capacity = (size - CONTROL) // 2  # the creator's (the attacher's config sets only the spin)
            if capacity < 64 or capacity % 8 or size != CONTROL + 2 * capacity:
                raise RingError(f"segment {name} of {size} bytes is not a channel")
            shm = Segment(fd, size)
        except BaseException:
            bell.close()  # the name stays: whoever failed here may not be the one the offer is for
            raise
        finally:
            close_fd(fd)  # the mapping holds the segment
        ch = cls(shm, name, False, capacity, cfg)
        ch._bell = bell
        ch._rings.publish_limit()
        unlink_names(name)  # both sides hold everything now: nothing stays in /dev/shm
        ch._attached = True
        try:
            ch._ring_peer()  # tells the creator we are here
        except PeerGone:
            ch.close()
            raise
        return ch

    def _accept(self) -> None:
        """Creator: hand the segment to an attacher waiting at the socket (if one is); the name goes then."""
        if not self._bell.accept(self._segment_fd):
            return
        self._segment_fd = close_fd(self._segment_fd)
        if self._linked:
            self._linked = False
            unlink_names(self.name)

    def _on_attached(self) -> None:
        """Creator: the peer rang for the first time (it has mapped the segment)."""
        self._attached = True

    @property
    def attached(self) -> bool:
        return self._attached

    # ----------------------------------------------------------------------------- doorbell
    def _ring_peer(self) -> None:
        try:
            self._bell.ring()
        except OSError as exc:  # BrokenPipeError, ...
            self._peer_gone = True
            raise PeerGone(f"shared-memory peer went away: {exc}") from None

    def _drain_doorbell(self) -> None:
        """Consume my doorbell's bytes (the creator first takes a waiting attacher); end-of-file means the peer is
        gone."""
        if self._bell.listening:
            self._unwatch()  # the descriptor a wait watches may close here (a caller dropped, the listener done)
            self._accept()
            if not self._bell.connected:
                return
        rang, gone = self._bell.drain()
        if rang and not self.attached:
            self._on_attached()
        if gone:
            self._peer_gone = True

    def _check_usable(self) -> None:
        if self._closed:
            raise RingError("the channel is closed")
        if self._peer_gone:
            raise PeerGone("shared-memory peer went away")

    # ---------------------------------------------------------------------------- reading
    def _try_read(self) -> bytes | None:
        """A whole message if one is there (consumes what is there of a longer one)."""
        try:
            msg, freed = self._rings.read_message()
        except MessageTooLarge:
            self._peer_gone = True
            raise
        self._wake_waiting_writer(freed)
        return msg

    def _try_read_usable(self) -> bytes | None:
        """A whole message if one is there; a message the peer wrote before it went is still read."""
        if self._closed:
            raise RingError("the channel is closed")
        msg = self._try_read()
        if msg is None:
            self._check_usable()
        return msg

    def _wake_waiting_writer(self, freed: bool) -> None:
        if freed and self._rings.peer_waiting() and self.attached:
            self._rings.clear_peer_waiting()
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
        return self._rings.peer_max_message()

    # ------------------------------------------------------------------------------ blocking
    def _block(self, deadline: float | None) -> None:
        left = self._left(deadline)
        readable, _, _ = select.select([self._bell.fd], [], [], left)
        if readable:
            self._drain_doorbell()

    def _send_steps(self, payload: bytes | bytearray | memoryview) -> Iterator[None]:
        """Write one message, ringing the peer after every part written; yield whenever the ring stays full
        past the spin (the caller then waits for the reader's doorbell, capped by _waiting_deadline)."""
        self._check_usable()
        parts = self._rings.frame(payload)
        total, done = sum(len(p) for p in parts), 0
        while True:
            done += self._rings.write_some(parts, done)
            self._ring_peer()
            if done == total:
                return
            self._rings.mark_waiting()
            if not self._spin(lambda: self._rings.room() > 0):
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
            if self._spin(self._rings.can_read):
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
                parts = self._rings.frame(payload)
            except MessageTooLarge:
                return False  # the loop's send says so
            if self._rings.room() < sum(len(p) for p in parts):
                return False
            self._rings.write_some(parts, 0)
            try:
                self._ring_peer()
            except PeerGone:
                return True  # written; the peer went (the next read or write says so)
            return True

    # ------------------------------------------------------------------------------- asyncio
    def _unwatch(self) -> None:
        if self._loop is not None and self._watched >= 0 and not self._loop.is_closed():
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._watched)
        self._watched = -1

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Have ``loop`` call _on_doorbell when this end's descriptor is readable (the hand-over's, then the pipe)."""
        if self._loop is not loop or self._watched != self._bell.fd:
            self._unwatch()
            self._loop = loop
            if self._bell.fd >= 0:
                loop.add_reader(self._bell.fd, self._on_doorbell)
                self._watched = self._bell.fd

    def _on_doorbell(self) -> None:
        self._drain_doorbell()
        if self._peer_gone:
            self._unwatch()
        elif self._loop is not None and self._watched != self._bell.fd:
            self._watch(self._loop)  # the next step of the hand-over, or the doorbell once the attacher came
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _await_doorbell(self, deadline: float | None) -> None:
        loop = asyncio.get_running_loop()
        if not self._peer_gone:
            self._watch(loop)
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

    def accept(self, timeout: float | None = None) -> None:
        """Creator, blocking: until the peer attaches (RingTimeout when it does not in time)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.attached:
            self._check_usable()
            self._block(deadline)
        self._check_usable()

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

    async def arecv(self, timeout: float | None = None, spin: bool = True) -> bytes:
        """The next message; first a spin on the ring of at most the config's ``spin_us`` (unless ``spin`` is off),
        then the doorbell."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            msg = self._try_read_usable()
            if msg is not None:
                return msg
            if spin and self._spin(self._rings.can_read):
                continue
            await self._await_doorbell(deadline)

    # ------------------------------------------------------------------------------- closing
    def _close_fds(self) -> None:
        self._unwatch()
        self._bell.close()
        self._segment_fd = close_fd(self._segment_fd)

    def close(self) -> None:
        """Close this end (the peer sees PeerGone); unlink the name if nobody attached."""
        if self._closed:
            return
        with self._send_lock:  # a try_send in flight on another thread ends first
            self._closed = True
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_exception(RingError("the channel is closed"))
            self._close_fds()
            self._rings.release()  # what had arrived of a message goes with the channel
            with contextlib.suppress(BufferError):
                self._shm.close()
        if self._linked:
            self._linked = False
            unlink_names(self.name)

    @property
    def closed(self) -> bool:
        return self._closed
