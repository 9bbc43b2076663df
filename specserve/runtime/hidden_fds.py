"""The target's end of a hidden-row buffer's hand-over (specserve/runtime/hidden_share.py is the buffer): each
``host_shm`` buffer is a sealed memfd (specserve/runtime/shm_memfd.py) offered at a socket of its own,
/dev/shm/specserve-<96-bit random token> (mode 0600), to the one caller that presents the buffer's 256-bit key
(``ask_for_fds`` with ``HIDDEN_TAG``). The drafter connects, presents the key from the handle the gateway relayed,
gets the descriptor, checks it, and answers ``TAKEN``; the offer then ends (one drafter a buffer) and its name goes.
A caller with another key, one that refuses what it got (hangs up without the answer), or one that says nothing
within ``CALLER_TIMEOUT_S``, is hung up on and the offer stays for its drafter.

One thread (``FdServer``, started with the first offer) serves every offer of a process: a selector over the
offers' listeners and the callers whose key is still arriving, so no caller can hold up another, and neither the
engine's thread nor the event loop ever waits on a caller. ``withdraw`` ends an offer at once (the name goes then:
the target does at the session's first verify step, when its drafter has mapped the buffer or never will, and when
the buffer closes)."""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import selectors
import socket
import threading
import time

from specserve.runtime.shm_layout import NAME_PREFIX, unlink_names
from specserve.runtime.shm_memfd import KEY_BYTES, key_matches, listen_at, send_fds

TAKEN = b"T"  # a caller's answer once it has checked the segment it was handed (no answer: the offer stays)
HIDDEN_TAG = b"H"  # the hand-over byte of a hidden buffer's segment (a ring's is another: shm_doorbell.RING_TAG)
CALLER_TIMEOUT_S = 2.0  # a caller that has not presented a whole key by then is hung up on
MAX_CALLERS = 64  # callers with a key still arriving, at most (more are hung up on at once)


class _Offer:
    def __init__(self, name: str, key: bytes, fd: int, listener: socket.socket) -> None:
        self.name, self.key, self.fd, self.listener = name, key, fd, listener


class FdServer:
    """Offers sealed segments to the callers that present their keys (thread-safe; ``close`` when done)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offers: dict[str, _Offer] = {}  # name -> offer (the thread's own once registered)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._closed = False

    def offer(self, fd: int, key: bytes) -> str:
        """Offer ``fd`` (taken over: closed when the offer ends) to the caller with ``key``; returns the name its
        socket has in /dev/shm. OSError when no socket can be made (the caller closes ``fd`` then)."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"a hand-over key is {KEY_BYTES} bytes, got {len(key)}")
        name = NAME_PREFIX + secrets.token_hex(12)
        with self._lock:
            if self._closed:
                raise OSError("the hidden-buffer server is closed")
            listener = listen_at(name, backlog=8)
            self._offers[name] = _Offer(name, key, fd, listener)
            self._start()
        self._tell(("add", name))
        return name

    def withdraw(self, name: str) -> None:
        """End an offer now (its name goes at once; idempotent)."""
        with self._lock:
            known = name in self._offers
        if known:
            unlink_names(name)
            self._tell(("drop", name))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._tell(("stop", ""))
            thread.join(10)
        with self._lock:
            for offer in self._offers.values():
                _end(offer)
            self._offers.clear()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    # --------------------------------------------------------------------------------------- the thread
    def _start(self) -> None:
        if self._thread is None:
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._thread = threading.Thread(target=self._run, name="hidden-fds", daemon=True)
            self._thread.start()

    def _tell(self, command: tuple[str, str]) -> None:
        self._commands.put(command)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\x01")

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        callers: dict[socket.socket, _Caller] = {}
        try:
            while True:
                timeout = (
                    None if not callers else max(0.0, min(c.deadline for c in callers.values()) - time.monotonic())
                )
                for key, _ in sel.select(timeout):
                    what, obj = key.data
                    if what == "wake":
                        if not self._run_commands(sel, callers):
                            return
                    elif what == "listener":
                        self._accept(sel, callers, obj)
                    elif key.fileobj in callers:
                        self._read_key(sel, callers, key.fileobj)
                now = time.monotonic()
                for sock in [s for s, c in callers.items() if c.deadline <= now]:
                    _hang_up(sel, callers, sock)
        finally:
            for sock in list(callers):
                _hang_up(sel, callers, sock)
            sel.close()

    def _run_commands(self, sel, callers) -> bool:
        with contextlib.suppress(OSError):
            os.read(self._wake_r, 4096)
        while True:
            try:
                what, name = self._commands.get_nowait()
            except queue.Empty:
                return True
            if what == "stop":
                return False
            with self._lock:
                offer = self._offers.get(name)
            if offer is None:
                continue
            if what == "add":
                sel.register(offer.listener, selectors.EVENT_READ, ("listener", offer))
            else:
                self._end_offer(sel, callers, offer)

    def _accept(self, sel, callers, offer: _Offer) -> None:
        try:
            conn, _ = offer.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(callers) >= MAX_CALLERS:
            conn.close()
            return
        conn.setblocking(False)
        callers[conn] = _Caller(offer, time.monotonic() + CALLER_TIMEOUT_S)
        sel.register(conn, selectors.EVENT_READ, ("caller", offer))

    def _read_key(self, sel, callers, conn: socket.socket) -> None:
        caller = callers[conn]
        try:
            data = conn.recv(KEY_BYTES - len(caller.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        caller.got += data
        if data and len(caller.got) < KEY_BYTES:
            return  # the rest of the key is on its way
        offer = caller.offer
        if caller.handed:  # its answer: TAKEN once it has checked (and will map) the segment, else it refused it
            if caller.got[-1:] == TAKEN:
                self._end_offer(sel, callers, offer)  # one drafter a buffer
            _hang_up(sel, callers, conn)
            return
        with self._lock:
            current = self._offers.get(offer.name) is offer
        if data and current and key_matches(bytes(caller.got), offer.key):
            try:
                send_fds(conn, [offer.fd], HIDDEN_TAG)
            except OSError:
                pass  # it hung up: the offer stays
            else:
                caller.handed, caller.got = True, bytearray(KEY_BYTES - 1)  # one more byte to read: its answer
                caller.deadline = time.monotonic() + CALLER_TIMEOUT_S
                return
        _hang_up(sel, callers, conn)

    def _end_offer(self, sel, callers, offer: _Offer) -> None:
        with self._lock:
            if self._offers.get(offer.name) is offer:
                del self._offers[offer.name]
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(offer.listener)
        _end(offer)  # first: a caller that sees the hang-up sees the name gone
        for sock in [s for s, c in callers.items() if c.offer is offer]:
            _hang_up(sel, callers, sock)


class _Caller:
    def __init__(self, offer: _Offer, deadline: float) -> None:
        self.offer, self.deadline, self.got = offer, deadline, bytearray()
        self.handed = False  # the descriptor went to it: its answer is what is read next


def _hang_up(sel, callers, sock: socket.socket) -> None:
    callers.pop(sock, None)
    with contextlib.suppress(KeyError, ValueError):
        sel.unregister(sock)
    sock.close()


def _end(offer: _Offer) -> None:
    """Close an offer's listener and descriptor and remove its name."""
    offer.listener.close()
    if offer.fd >= 0:
        with contextlib.suppress(OSError):
            os.close(offer.fd)
        offer.fd = -1
    unlink_names(offer.name)
